"""The Ray Serve deployments that own the model actors: ``DraftDeployment`` (one ``DraftActor``) and
``TargetDeployment`` (a ``TargetGroup`` of TP ranks), each actor in a bundle of the replica's placement
group.

Per-step calls must reach the replica that holds a request's KV cache, so each deployment hands out the
Ray actor handles of the actors it owns (``actors()``): the ingress asks once per request — Serve
load-balances *that* call across replicas — and then talks to those actors directly for every step.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

import ray
from ray import serve

from actors.draft import DraftActor
from actors.health import raise_if_unhealthy
from actors.placement import bundles, in_bundle
from actors.reaper import IdleReaping
from actors.spec import STEP_TIMEOUT_S
from actors.target import TargetGroup
from deployments.autoscaling import HELD
from deployments.config import ServeConfig

logger = logging.getLogger("ray.serve")
DRAIN_POLL_S = 0.25
REAPS_PER_TIMEOUT = 4  # an idle actor is told to free idle requests this often per request_idle_timeout_s
DRAIN_STALL_S = 5.0  # held requests but no forward ran or ran on for this long: abandoned (their ingress gone)


async def drain(state: Callable[[], Awaitable[tuple[int, float]]], timeout_s: float, *,
                stall_s: float = DRAIN_STALL_S, poll_s: float = DRAIN_POLL_S, call_s: float = 30.0) -> int:
    """Wait while the replica's actors hold requests that still progress; returns how many are left.

    ``state()``: (requests the actors hold, seconds they have spent running forwards, the one running now
    included: ``actor_state``). Serve stops a replica it scales away without waiting for those requests (it
    counts only its own calls, and the ingress calls the actors directly), so each model deployment's
    ``__del__`` waits here and a request that began on a replica ends on it. The wait ends when none is held,
    when no forward ran for ``stall_s`` (requests whose ingress is gone, e.g. the whole app shutting down), after
    ``timeout_s``, or when the actor is dead or does not answer ``state()`` within ``call_s`` (a frozen actor,
    the case the health check fails by its timeout: waited for, it kept the replica's bundles reserved for the
    whole ``timeout_s``, where its replacement may need them)."""
    deadline, busy, moved = time.monotonic() + timeout_s, None, time.monotonic()
    while True:
        try:
            left, busy_now = await asyncio.wait_for(state(), call_s)
        except Exception:  # noqa: BLE001 - a dead, unreachable or frozen actor: nothing left to wait for
            return 0
        now = time.monotonic()
        if busy_now != busy:
            busy, moved = busy_now, now
        if not left or now >= deadline or now - moved >= stall_s:
            if left:
                logger.warning("stopping a model replica whose actors still hold %d requests (%s)", left,
                               f"after {timeout_s:.0f} s" if now >= deadline else f"no forward for {stall_s:.0f} s")
            return left
        await asyncio.sleep(poll_s)


async def group_whole(ranks: list, timeout_s: float) -> bool:
    """Whether every rank of a TP group answers its health call within ``timeout_s``. A group missing a rank
    (dead, or too stuck to answer) can finish none of the requests it holds, so there is nothing to drain."""
    try:
        await asyncio.wait_for(asyncio.gather(*[r.health.remote() for r in ranks]), timeout_s)
    except Exception:  # noqa: BLE001 - a dead rank's call raises RayActorError; a stuck one times out
        return False
    return True


async def actor_state(actor, call_limit_s: float = STEP_TIMEOUT_S) -> tuple[int, float]:
    """(requests ``actor`` holds, seconds of forwards it ran, the one running now included).

    The batcher adds a forward's time only when it ends, so a long one (a CPU prefill may take far more than
    ``DRAIN_STALL_S``) would look like no progress and the drain would end the ranks mid-forward: the time the
    actor has spent in its current call (``health()``) counts too — up to ``call_limit_s`` (step_timeout_s):
    a call past it is stuck, not progressing, and the health check fails it anyway."""
    held, use, health = await asyncio.gather(actor.active.remote(), actor.utilization.remote(),
                                             actor.health.remote())
    return held, use.get("busy_s", 0.0) + min(health.get("busy_s", 0.0), call_limit_s)


@serve.deployment(ray_actor_options={"num_cpus": 0})
class DraftDeployment:
    def __init__(self, config: dict) -> None:
        self.cfg = ServeConfig.model_validate(config)
        spec = self.cfg.actor_spec("draft")
        self.actor = ray.remote(concurrency_groups={"health": 1})(DraftActor).options(
            **in_bundle(self.cfg.resources(), 0), max_concurrency=spec.callers).remote(spec)
        ray.get(self.actor.info.remote())  # returns once the model has loaded
        self.reaping = IdleReaping(self.actor, self.cfg.request_idle_timeout_s / REAPS_PER_TIMEOUT)

    def actors(self):
        """The draft actor's handle (the ingress then calls it directly every step)."""
        return self.actor

    def check_health(self) -> None:
        state = ray.get(self.actor.health.remote(), timeout=self.cfg.health_check_timeout_s)
        raise_if_unhealthy([state], self.cfg.step_timeout_s, "draft actor")
        self.reaping.tick()

    async def record_autoscaling_stats(self) -> dict[str, float]:
        return {HELD: await self.actor.active.remote()}

    async def __del__(self) -> None:  # Serve awaits it when it stops this replica
        await drain(lambda: actor_state(self.actor, self.cfg.step_timeout_s), self.cfg.drain_timeout_s,
                    call_s=self.cfg.health_check_timeout_s)


@serve.deployment(ray_actor_options={"num_cpus": 0})
class TargetDeployment:
    def __init__(self, config: dict) -> None:
        self.cfg = ServeConfig.model_validate(config)
        self.group = TargetGroup(self.cfg.actor_spec("target"), self.cfg.tp_size, self.cfg.tp_backend,
                                 self.cfg.resources())
        self.reaping = IdleReaping(self.group.ranks[0], self.cfg.request_idle_timeout_s / REAPS_PER_TIMEOUT)

    def actors(self) -> dict:
        """The rank handles and what the ingress needs of the model (EOS ids, context, hardware id, device)."""
        meta = self.group.meta  # what the target's rank 0 reports of the machine it runs on
        hw = self.cfg.plan_hardware_id(meta["threads"], meta["accelerator"], meta["cpu"])
        return {"ranks": self.group.ranks, "hardware_id": hw, **meta}

    def check_health(self) -> None:
        """A dead rank (its call raises), a broken or stuck one -> unhealthy -> Serve replaces this replica,
        and with it the whole TP group (the rank actors are owned by, and die with, the replica)."""
        states = ray.get([r.health.remote() for r in self.group.ranks], timeout=self.cfg.health_check_timeout_s)
        raise_if_unhealthy(states, self.cfg.step_timeout_s, "target rank")
        self.reaping.tick()

    async def record_autoscaling_stats(self) -> dict[str, float]:
        return {HELD: await self.group.ranks[0].active.remote()}  # every rank holds the same requests

    async def __del__(self) -> None:  # Serve awaits it when it stops this replica
        """Drain the held requests while the whole group lives, then end the ranks now: left to Ray, they
        die with their owner (this replica) only some seconds later, beside the group replacing them."""
        group = getattr(self, "group", None)
        if group is None:  # the constructor failed before the group existed: nothing to drain or end
            return
        try:
            if await group_whole(group.ranks, self.cfg.health_check_timeout_s):
                await drain(lambda: actor_state(group.ranks[0], self.cfg.step_timeout_s), self.cfg.drain_timeout_s,
                            call_s=self.cfg.health_check_timeout_s)
        finally:
            group.kill()


def replica_bundles(cfg: ServeConfig, actors: int) -> list[dict]:
    """A replica's placement-group bundles: one per model actor it owns (the replica shares bundle 0)."""
    return bundles(cfg.resources(), actors)
