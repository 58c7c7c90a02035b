"""Ray Serve deployments that own the models: the draft on its own actor, the target as a TP group.

Per-step calls must reach the replica that holds a request's KV cache, so each deployment hands out the
Ray actor handles of the actors it owns (``session()``): the ingress asks once per request — Serve
load-balances *that* call across replicas — and then talks to those actors directly for every step.
"""

from __future__ import annotations

import ray
from ray import serve

from deployments.actor_health import CallTracker, raise_if_unhealthy
from deployments.autoscaling import HELD
from deployments.reaper import Reaper
from deployments.tp import TargetGroup
from sequoia_ray.config import ServeConfig


class DraftActor:
    """Holds the draft model and per-request draft state (a plain Ray actor)."""

    def __init__(self, cfg: dict) -> None:
        import torch

        from sequoia_ray.draft import DraftWorker
        from sequoia_ray.models.loading import load_model

        torch.set_num_threads(max(1, int(cfg.get("threads") or 1)))
        loaded = load_model(cfg["draft"], dtype=cfg["dtype"], quantize=cfg.get("draft_quantize"), progress=False)
        self.worker = DraftWorker(loaded.model)
        self.reaper = Reaper(cfg.get("idle_timeout_s", 300.0))
        self.tracker = CallTracker(fatal_errors=False)

    def call(self, method: str, request_id: str, *args):
        with self.tracker.running(method):
            return self.reaper.call(self.worker, method, request_id, *args)

    @ray.method(concurrency_group="health")
    def active(self) -> int:
        return len(self.worker.requests)

    @ray.method(concurrency_group="health")
    def health(self) -> dict:
        return self.tracker.health()


def _actor_options(cfg: ServeConfig) -> dict:
    opts: dict = {"num_cpus": cfg.num_cpus, "num_gpus": cfg.num_gpus}
    if cfg.accelerator_type:
        opts["accelerator_type"] = cfg.accelerator_type
    return opts


def _model_cfg(cfg: ServeConfig) -> dict:
    return {"draft": cfg.draft, "target": cfg.target, "dtype": cfg.dtype, "draft_quantize": cfg.draft_quantize,
            "threads": max(1, int(cfg.num_cpus)), "idle_timeout_s": cfg.request_idle_timeout_s,
            "collective_timeout_s": cfg.collective_timeout_s}


@serve.deployment(ray_actor_options={"num_cpus": 0})
class DraftServer:
    def __init__(self, config: dict) -> None:
        from ray.util.placement_group import get_current_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self.cfg = ServeConfig.model_validate(config)
        pg = get_current_placement_group()
        opts = _actor_options(self.cfg)
        if pg is not None:
            opts["scheduling_strategy"] = PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=1)
        self.actor = ray.remote(concurrency_groups={"health": 1})(DraftActor).options(**opts).remote(
            _model_cfg(self.cfg))
        ray.get(self.actor.health.remote())

    def session(self):
        return self.actor

    def check_health(self) -> None:
        state = ray.get(self.actor.health.remote(), timeout=self.cfg.health_check_timeout_s)
        raise_if_unhealthy([state], self.cfg.step_timeout_s, "draft actor")

    async def record_autoscaling_stats(self) -> dict[str, float]:
        return {HELD: await self.actor.active.remote()}


@serve.deployment(ray_actor_options={"num_cpus": 0})
class TargetServer:
    def __init__(self, config: dict) -> None:
        self.cfg = ServeConfig.model_validate(config)
        self.group = TargetGroup(_model_cfg(self.cfg), self.cfg.tp_size, self.cfg.tp_backend, self.cfg.num_cpus,
                                 self.cfg.num_gpus)

    def session(self) -> dict:
        from sequoia_ray.hardware import hardware_id

        hw = self.cfg.hardware_id or hardware_id(self.cfg.accelerator_type, self.cfg.tp_size,
                                                 self.group.meta["threads"])
        return {"ranks": self.group.ranks, "hardware_id": hw, **self.group.meta}

    def check_health(self) -> None:
        """A dead rank (its call raises), a broken or stuck one -> unhealthy -> Serve replaces this replica,
        and with it the whole TP group (the rank actors are owned by, and die with, the replica)."""
        states = ray.get([r.health.remote() for r in self.group.ranks], timeout=self.cfg.health_check_timeout_s)
        raise_if_unhealthy(states, self.cfg.step_timeout_s, "target rank")

    async def record_autoscaling_stats(self) -> dict[str, float]:
        return {HELD: await self.group.ranks[0].active.remote()}  # every rank holds the same requests


def bundles(cfg: ServeConfig, actors: int) -> list[dict]:
    """Bundle 0 for the (resource-free) replica, then one bundle per model actor it owns."""
    rank = {"CPU": cfg.num_cpus, **({"GPU": cfg.num_gpus} if cfg.num_gpus else {})}
    if cfg.accelerator_type:
        rank[f"accelerator_type:{cfg.accelerator_type}"] = 0.001
    return [{"CPU": 0.001}] + [dict(rank) for _ in range(actors)]
