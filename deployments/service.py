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
from ray.exceptions import GetTimeoutError, RayError

from sequoia_ray.config import SamplingParams, ServeConfig
from sequoia_ray.draft import DraftTree
from sequoia_ray.engine import Chunk, SpeculativeDecoder
from sequoia_ray.plan_store import PlanKey, PlanNotFound, PlanStore, temperature_bucket
from sequoia_ray.tree.builtin import builtin_plan
from sequoia_ray.tree.plan import TreePlan
from sequoia_ray.tree.plan_file import PlannedTree
from sequoia_ray.verify import Verdict

logger = logging.getLogger("sequoia_ray.serve")
_END = object()


class TargetUnavailable(RuntimeError):
    """The target group failed or timed out on a call (a rank died or hung): the request cannot go on;
    the client may retry once the group has been replaced (HTTP 503)."""


class ActorDraft:
    """The Draft protocol over one DraftActor handle; a call slower than ``timeout_s`` fails (and the
    engine goes on without the draft)."""

    def __init__(self, actor, timeout_s: float = 60.0) -> None:
        self.actor, self.timeout_s = actor, timeout_s

    def _call(self, method: str, request_id: str, *args):
        try:
            return ray.get(self.actor.call.remote(method, request_id, *args), timeout=self.timeout_s)
        except GetTimeoutError:
            self.actor.call.remote("finish", request_id)  # queued behind the stuck call; not awaited
            raise

    def start(self, request_id: str, prompt: list[int], params: SamplingParams, seed: int) -> None:
        self._call("start", request_id, prompt, params, seed)

    def grow(self, request_id: str, plan: TreePlan) -> DraftTree:
        return self._call("grow", request_id, plan)

    def commit(self, request_id: str, path: list[int], new_tokens: list[int]) -> None:
        self._call("commit", request_id, path, new_tokens)

    def finish(self, request_id: str) -> None:
        self._call("finish", request_id)


class RanksTarget:
    """The Target protocol over a tensor-parallel group: every call goes to rank 0, which forwards it to
    the other ranks (one sender keeps the ranks' collectives in one order) and checks they agree. Any
    failure — a dead or broken rank, no answer within ``timeout_s``, ranks that disagree — raises
    ``TargetUnavailable``; the request is then over (its state goes with the group, which is replaced)."""

    def __init__(self, ranks: list, timeout_s: float = 60.0) -> None:
        self.ranks, self.timeout_s = ranks, timeout_s
        self.failed = False

    def _call(self, method: str, *args):
        try:
            return ray.get(self.ranks[0].call.remote(method, *args), timeout=self.timeout_s)
        except (RayError, GetTimeoutError) as exc:
            self.failed = True
            first_line = str(exc).splitlines()[0] if str(exc) else ""
            raise TargetUnavailable(f"the target group failed during {method}: {type(exc).__name__}: "
                                    f"{first_line}") from exc

    def start(self, request_id: str, prompt: list[int], params: SamplingParams, seed: int) -> None:
        self._call("start", request_id, prompt, params, seed)

    def verify(self, request_id: str, plan: TreePlan, draft: DraftTree) -> Verdict:
        return self._call("verify", request_id, plan, draft)

    def finish(self, request_id: str) -> None:
        if self.failed:  # do not wait on a failed group: tell it without awaiting the answer
            self.ranks[0].call.remote("finish", request_id)
            return
        self._call("finish", request_id)


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
