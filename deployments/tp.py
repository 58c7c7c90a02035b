"""A tensor-parallel target: one Ray actor per rank, in the replica's placement group, over torch.distributed.

Every rank loads the target sharded with transformers' ``tp_plan="auto"`` (gloo on CPU, nccl on GPU) and
runs the same ``TargetWorker`` calls in lockstep: the forward all-reduces inside the model, the logits are
replicated, and each rank walks the tree with an identically seeded generator, so all ranks reach the same
verdict and compact their own KV shard the same way. The group returns rank 0's verdict and checks the
others agree. Trap (DESIGN.md): transformers reads ``WORLD_SIZE``; without it every rank silently loads the
whole model, so each rank asserts its weights really are sharded.
"""

from __future__ import annotations

import os
import socket
from datetime import timedelta

import ray
import torch

from deployments.actor_health import CallTracker
from deployments.reaper import Reaper


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


class TPRank:
    """One rank of the target group (a Ray actor)."""

    def __init__(self, rank: int, world: int, master: str, port: int, backend: str, cfg: dict) -> None:
        import torch.distributed as dist

        torch.set_num_threads(max(1, int(cfg.get("threads") or 1)))
        from sequoia_ray.models.loading import load_model, resolve
        from sequoia_ray.target import TargetWorker

        resolve(cfg["target"], progress=False)  # fetch / write checkpoints before the group exists
        os.environ.update(MASTER_ADDR=master, MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                          LOCAL_RANK="0" if backend == "gloo" else str(rank % max(torch.cuda.device_count(), 1)))
        dist.init_process_group(backend, rank=rank, world_size=world, init_method=f"tcp://{master}:{port}",
                                timeout=timedelta(seconds=cfg.get("collective_timeout_s", 120.0)))
        self.rank, self.world = rank, world
        loaded = load_model(cfg["target"], dtype=cfg["dtype"], progress=False, tp_plan="auto" if world > 1 else None)
        check_sharded(loaded.model, world)
        self.worker = TargetWorker(loaded.model)
        self.reaper = Reaper(cfg.get("idle_timeout_s", 300.0))
        self.tracker = CallTracker(fatal_errors=world > 1)  # a failed collective leaves the group unusable
        self.followers: list = []
        self.collective_timeout_s = cfg.get("collective_timeout_s", 120.0)
        self.meta = {"eos_ids": loaded.eos_ids, "max_context": loaded.max_context,
                     "vocab": loaded.model.config.vocab_size, "threads": torch.get_num_threads()}

    def info(self) -> dict:
        return self.meta

    def lead(self, followers: list) -> None:
        """Make this rank (0) the group's entry point for ``followers`` (ranks 1..tp-1)."""
        self.followers = followers

    def call(self, method: str, request_id: str, *args):
        """The group's entry point (rank 0): forward the call to every other rank, run it here, check they
        agree. One sender per group keeps every rank's sequence of collectives in one order — callers in
        several threads or replicas sending to each rank themselves would interleave differently on each
        rank and pair up different requests' all-reduces. (Ray runs one caller's calls to an actor in order.)"""
        with self.tracker.running(method):
            refs = [f.step.remote(method, request_id, *args) for f in self.followers]
            mine = self.reaper.call(self.worker, method, request_id, *args)
            if any(theirs != mine for theirs in ray.get(refs, timeout=self.collective_timeout_s)):
                raise RuntimeError(f"tensor-parallel ranks disagree on {method} for request {request_id}")
            return mine

    def step(self, method: str, request_id: str, *args):
        """A follower's share of a call forwarded by rank 0."""
        with self.tracker.running(method):
            return self.reaper.call(self.worker, method, request_id, *args)

    @ray.method(concurrency_group="health")
    def health(self) -> dict:
        return self.tracker.health()

    @ray.method(concurrency_group="health")
    def active(self) -> int:
        return len(self.worker.requests)

    def time_forward(self, sizes, context: int, repeats: int) -> dict[int, float]:
        """Target timings; every rank must run this at once (the forward is collective)."""
        from sequoia_ray.hardware import time_forward

        return time_forward(self.worker.model, sizes, context=context, repeats=repeats)


def check_sharded(model, world: int) -> None:
    """Assert the attention projections hold 1/world of their output rows on this rank."""
    proj = model.model.layers[0].self_attn.q_proj.weight
    local = proj.to_local() if hasattr(proj, "to_local") else proj
    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    expected = config.num_attention_heads * head_dim // world
    if local.shape[0] != expected:
        raise RuntimeError(f"target is not sharded: q_proj has {local.shape[0]} local rows, expected {expected} "
                           f"for tp_size {world}; set WORLD_SIZE before loading (transformers reads it)")


class TargetGroup:
    """``tp_size`` rank actors in bundles 1..tp_size of the replica's placement group (bundle 0 is the
    replica itself), or anywhere when there is no placement group (in-process tests)."""

    def __init__(self, cfg: dict, tp_size: int, backend: str, num_cpus: float, num_gpus: float) -> None:
        from ray.util.placement_group import get_current_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        pg = get_current_placement_group()
        master = ray.util.get_node_ip_address()
        port = free_port()
        actor = ray.remote(concurrency_groups={"health": 1})(TPRank)
        self.ranks = []
        for rank in range(tp_size):
            strategy = PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=rank + 1) if pg else None
            opts = {"num_cpus": num_cpus, "num_gpus": num_gpus, "max_concurrency": 1}
            if strategy is not None:
                opts["scheduling_strategy"] = strategy
            self.ranks.append(actor.options(**opts).remote(rank, tp_size, master, port, backend, cfg))
        self.meta = ray.get([r.info.remote() for r in self.ranks])[0]
        ray.get(self.ranks[0].lead.remote(self.ranks[1:]))

    def time_target(self, sizes, context: int, repeats: int) -> dict[int, float]:
        """t(n) of the whole group: rank 0's timings of a forward all ranks run together."""
        return ray.get([r.time_forward.remote(sizes, context, repeats) for r in self.ranks])[0]

    def kill(self) -> None:
        for r in self.ranks:
            ray.kill(r)

