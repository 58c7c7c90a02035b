"""What the ingress runs per request: the core ``SpeculativeDecoder`` over Ray actor handles.

The decoder is the same code as in-process; ``ActorDraft`` / ``RanksTarget`` implement its two small
protocols by calling the request's draft actor and every TP rank of its target replica. The loop runs in
a worker thread (each step blocks on the actors); the async side awaits one chunk at a time, so a client
disconnect (task cancellation) lands between steps and closing the generator frees the request's KV state
on every actor. Plans come from the plan store (latest for this hardware, pair and temperature bucket),
refreshed in the background; missing or broken store -> the last good plan or the built-in one.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import ray

from sequoia_ray.config import SamplingParams, ServeConfig
from sequoia_ray.draft import DraftTree
from sequoia_ray.engine import Chunk, SpeculativeDecoder
from sequoia_ray.plan_store import PlanKey, PlanNotFound, PlanStore, StoreError, temperature_bucket
from sequoia_ray.tree.builtin import builtin_plan
from sequoia_ray.tree.plan import TreePlan
from sequoia_ray.tree.plan_file import PlannedTree
from sequoia_ray.verify import Verdict

logger = logging.getLogger("sequoia_ray.serve")
_END = object()


class ActorDraft:
    """The Draft protocol over one DraftActor handle."""

    def __init__(self, actor) -> None:
        self.actor = actor

    def start(self, request_id: str, prompt: list[int], params: SamplingParams, seed: int) -> None:
        ray.get(self.actor.call.remote("start", request_id, prompt, params, seed))

    def grow(self, request_id: str, plan: TreePlan) -> DraftTree:
        return ray.get(self.actor.call.remote("grow", request_id, plan))

    def commit(self, request_id: str, path: list[int], new_tokens: list[int]) -> None:
        ray.get(self.actor.call.remote("commit", request_id, path, new_tokens))

    def finish(self, request_id: str) -> None:
        ray.get(self.actor.call.remote("finish", request_id))


class RanksTarget:
    """The Target protocol over every rank of a tensor-parallel group (they must agree)."""

    def __init__(self, ranks: list) -> None:
        self.ranks = ranks

    def _all(self, method: str, *args):
        results = ray.get([r.call.remote(method, *args) for r in self.ranks])
        if any(res != results[0] for res in results[1:]):
            raise RuntimeError(f"tensor-parallel ranks disagree on {method}")
        return results[0]

    def start(self, request_id: str, prompt: list[int], params: SamplingParams, seed: int) -> None:
        self._all("start", request_id, prompt, params, seed)

    def verify(self, request_id: str, plan: TreePlan, draft: DraftTree) -> Verdict:
        return self._all("verify", request_id, plan, draft)

    def finish(self, request_id: str) -> None:
        self._all("finish", request_id)


@dataclass(frozen=True)
class ActivePlan:
    planned: PlannedTree
    source: str  # "store:<path>" or "builtin"


class PlanProvider:
    """The plan per temperature bucket: the store's latest, else the last good one, else built-in."""

    def __init__(self, cfg: ServeConfig, hardware: str) -> None:
        self.cfg, self.hardware = cfg, hardware
        self.store = PlanStore(cfg.plan_store) if cfg.plan_store else None
        self.plans: dict[str, ActivePlan] = {}
        self.errors = 0

    def get(self, temperature: float) -> ActivePlan:
        bucket = temperature_bucket(temperature)
        if bucket not in self.plans:
            self.plans[bucket] = self._fetch(temperature) or ActivePlan(builtin_plan(temperature), "builtin")
            logger.info("plan for %s T=%s: %s (%d nodes)", self.hardware, temperature, self.plans[bucket].source,
                        self.plans[bucket].planned.plan.n)
        return self.plans[bucket]

    def refresh(self) -> None:
        for bucket in list(self.plans):
            fresh = self._fetch(float(bucket[1:]))
            if fresh is not None and fresh.source != self.plans[bucket].source:
                logger.info("new plan for %s: %s", bucket, fresh.source)
                self.plans[bucket] = fresh

    def _fetch(self, temperature: float) -> ActivePlan | None:
        if self.store is None:
            return None
        key = PlanKey(self.hardware, self.cfg.draft or "", self.cfg.target, temperature)
        try:
            planned, path = self.store.fetch_plan(key)
        except PlanNotFound as exc:
            logger.warning("%s; using the built-in plan", exc)
            return None
        except (StoreError, ValueError) as exc:
            self.errors += 1
            logger.error("plan store error, keeping the last good plan: %s", exc)
            return None
        return ActivePlan(planned, f"store:{path}")


class Runner:
    """Runs decoders in worker threads and exposes them as async chunk streams."""

    def __init__(self, threads: int) -> None:
        self.pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="sequoia-request")

    async def stream(self, decoder: SpeculativeDecoder, prompt: list[int], params: SamplingParams,
                     request_id: str) -> AsyncIterator[Chunk]:
        loop = asyncio.get_running_loop()
        gen: Iterator[Chunk] = decoder.stream(prompt, params, request_id)
        pending = None
        try:
            while True:
                pending = loop.run_in_executor(self.pool, next, gen, _END)
                chunk = await asyncio.shield(pending)
                if chunk is _END:
                    return
                yield chunk
        finally:
            if pending is not None and not pending.done():
                await asyncio.wait([pending])  # the step in flight finishes before the generator closes
            await loop.run_in_executor(self.pool, gen.close)  # frees the request on every actor
