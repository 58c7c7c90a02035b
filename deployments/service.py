"""What the ingress runs per request: the core ``SpeculativeDecoder`` over Ray actor handles.

The decoder is the same code as in-process; ``actors.adapters`` implements its two small protocols over
the request's draft actor and the TP ranks of its target replica. The loop runs in
a worker thread (each step blocks on the actors); the async side awaits one chunk at a time, so a client
disconnect (task cancellation) lands between steps and closing the generator frees the request's KV state
on every actor. Plans come from the plan store (latest for this hardware, pair, temperature bucket and batch
bucket), refreshed in the background; missing or broken store -> the last good plan, the batch-1 plan (for a
batch bucket with no plan of its own) or the built-in one.
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
from sequoia_ray.hardware import batch_bucket
from sequoia_ray.plan_store import PlanKey, PlanNotFound, PlanStore, plan_bucket
from sequoia_ray.tree.builtin import builtin_plan
from sequoia_ray.tree.plan_file import PlannedTree

logger = logging.getLogger("sequoia_ray.serve")
_END = object()


@dataclass(frozen=True)
class ActivePlan:
    planned: PlannedTree
    source: str  # "store:<path>" or "builtin"
    bucket: int = 1  # the batch bucket the plan was chosen for (1 when a bigger bucket falls back to it)


class PlanProvider:
    """The plan per temperature bucket and batch bucket: the store's latest for that bucket, else the last
    good one, else (a batch bucket > 1 with no plan of its own) the batch-1 plan, else built-in. No store
    fault (unreachable, a bad URI, a corrupt or invalid plan file) ever reaches a request: it is logged,
    counted in ``errors`` (exported as a metric and in /v1/models) and the current plan stays.

    ``get`` runs at every step of a batch: once a bucket is loaded it is a dict lookup, no I/O. ``plans``
    is keyed by the store's folder name (``t0.0``, ``t0.0-b4``)."""

    def __init__(self, cfg: ServeConfig, hardware: str) -> None:
        self.cfg, self.hardware = cfg, hardware
        self.store: PlanStore | None = None
        self.plans: dict[str, ActivePlan] = {}
        self.keys: dict[str, tuple[float, int]] = {}  # folder name -> (temperature, batch bucket)
        self.errors, self.last_error = 0, None

    def get(self, temperature: float, batch_size: int = 1) -> ActivePlan:
        """The plan for a batch of ``batch_size`` requests at ``temperature``: its bucket's (the largest
        bucket <= batch_size, e.g. 3 -> 2)."""
        bucket = batch_bucket(batch_size)
        name = plan_bucket(temperature, bucket)
        active = self.plans.get(name)
        if active is None:
            active = self._fetch(temperature, bucket) or self._fallback(temperature, bucket)
            self.plans[name], self.keys[name] = active, (temperature, bucket)
            logger.info("plan for %s T=%s batch bucket %d: %s (%d nodes)", self.hardware, temperature, bucket,
                        active.source, active.planned.plan.n)
        return active

    def _fallback(self, temperature: float, bucket: int) -> ActivePlan:
        if bucket > 1:
            return self.get(temperature, 1)
        return ActivePlan(builtin_plan(temperature), "builtin")

    def refresh(self) -> None:
        """Every bucket held: its own newer plan if published; a bucket > 1 still without one follows the
        batch-1 plan (refreshed first)."""
        for name, (temperature, bucket) in sorted(self.keys.items(), key=lambda kv: kv[1][1]):
            current = self.plans[name]
            fresh = self._fetch(temperature, bucket)
            if fresh is None and current.bucket != bucket:  # a fallback: follow the batch-1 plan
                fresh = self.plans[plan_bucket(temperature, 1)]
            if fresh is not None and fresh.source != current.source:
                logger.info("new plan for %s: %s", name, fresh.source)
                self.plans[name] = fresh

    def _fetch(self, temperature: float, bucket: int) -> ActivePlan | None:
        if not self.cfg.plan_store:
            return None
        key = PlanKey(self.hardware, self.cfg.draft or "", self.cfg.target, temperature, bucket)
        try:
            self.store = self.store or PlanStore(self.cfg.plan_store)
            planned, path = self.store.fetch_plan(key)
        except PlanNotFound as exc:  # a bigger bucket without a plan of its own is normal: it uses batch 1's
            (logger.warning if bucket == 1 else logger.debug)("%s", exc)
            return None
        except Exception as exc:  # noqa: BLE001 - whatever the store does, serving goes on with a good plan
            error = f"{type(exc).__name__}: {exc}"
            log = logger.error if error != self.last_error else logger.debug  # once per distinct error
            log("plan store error, keeping the current plan: %s", error)
            self.errors, self.last_error = self.errors + 1, error
            return None
        return ActivePlan(planned, f"store:{path}", bucket)


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
