"""What the ingress runs per request: the core ``SpeculativeDecoder`` over Ray actor handles.

The decoder is the same code as in-process; ``actors.adapters`` implements its two small protocols over
the request's draft actor and the TP ranks of its target replica. The loop runs in
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

from deployments.config import ServeConfig
from sequoia_ray.config import SamplingParams
from sequoia_ray.engine import Chunk, SpeculativeDecoder
from sequoia_ray.plan_store import PlanKey, PlanNotFound, PlanStore, temperature_bucket
from sequoia_ray.tree.builtin import builtin_plan
from sequoia_ray.tree.plan_file import PlannedTree

logger = logging.getLogger("sequoia_ray.serve")
_END = object()


@dataclass(frozen=True)
class ActivePlan:
    planned: PlannedTree
    source: str  # "store:<path>" or "builtin"


class PlanProvider:
    """The plan per temperature bucket: the store's latest, else the last good one, else built-in. No store
    fault (unreachable, a bad URI, a corrupt or invalid plan file) ever reaches a request: it is logged,
    counted in ``errors`` (exported as a metric and in /v1/models) and the current plan stays."""

    def __init__(self, cfg: ServeConfig, hardware: str) -> None:
        self.cfg, self.hardware = cfg, hardware
        self.store: PlanStore | None = None
        self.plans: dict[str, ActivePlan] = {}
        self.errors, self.last_error = 0, None

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
        if not self.cfg.plan_store:
            return None
        key = PlanKey(self.hardware, self.cfg.draft or "", self.cfg.target, temperature)
        try:
            self.store = self.store or PlanStore(self.cfg.plan_store)
            planned, path = self.store.fetch_plan(key)
        except PlanNotFound as exc:
            logger.warning("%s", exc)
            return None
        except Exception as exc:  # noqa: BLE001 - whatever the store does, serving goes on with a good plan
            error = f"{type(exc).__name__}: {exc}"
            log = logger.error if error != self.last_error else logger.debug  # once per distinct error
            log("plan store error, keeping the current plan: %s", error)
            self.errors, self.last_error = self.errors + 1, error
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
