"""A tensor-parallel target: one Ray actor per rank, in the replica's placement group, over torch.distributed.

Every rank loads the target sharded with transformers' ``tp_plan="auto"`` (gloo on CPU, nccl on GPU) and
runs the same ``TargetWorker`` calls in lockstep: the forward all-reduces inside the model, the logits are
replicated, and each rank walks the tree with an identically seeded generator, so all ranks reach the same
verdict and compact their own KV shard the same way. The group returns rank 0's verdict and checks the
others agree. Trap: transformers reads ``WORLD_SIZE``; without it every rank silently loads the
whole model, so each rank asserts its weights really are sharded.
"""

from __future__ import annotations

import os
import socket
from datetime import timedelta

import ray

from actors.base import ModelActor, assigned_device, model_meta
from actors.placement import ActorResources, in_bundle
from actors.reaper import REAP
from actors.spec import ModelActorSpec, check_backend
from actors.thread_share import ThreadShare


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def rank_environment(device, world: int) -> dict[str, str]:
    """What transformers' TP loading must read in a rank on ``device``: ``LOCAL_RANK``, the index of the rank's
    device in this process (Ray narrows ``CUDA_VISIBLE_DEVICES`` to the GPU it assigned, so 0), and, for a CPU
    rank of a group, no visible GPU: transformers puts the shards on whatever accelerator torch detects, and
    Ray 2.60 leaves every GPU of the node visible to an actor with ``num_gpus: 0`` (ray-project/ray#54868), so
    the gloo ranks of a CPU target on a GPU node would all load onto cuda:0. One rank loads without TP, onto
    ``device`` itself, and keeps the process's GPUs."""
    env = {"LOCAL_RANK": str(device.index or 0)}
    if world > 1 and device.type == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    return env


class TargetRank(ModelActor):
    """One rank of the target group (a Ray actor). Its device: with nccl the GPU Ray assigned it (Ray sets
    ``CUDA_VISIBLE_DEVICES`` per actor, so ``LOCAL_RANK`` 0 = ``cuda:0`` here), with gloo the CPU."""

    def __init__(self, rank: int, world: int, master: str, port: int, backend: str, spec: ModelActorSpec) -> None:
        import torch  # here, not at the top: the deployment replica that creates the group never loads torch

        from sequoia_ray.models.loading import resolve

        device = assigned_device(spec.device)
        check_backend(backend, device.type, world)
        os.environ.update(rank_environment(device, world))
        if world > 1 and torch._C._get_accelerator().type != device.type:  # what transformers' TP loading reads
            raise RuntimeError(f"rank {rank} runs on {device} but torch already sees a "
                               f"{torch._C._get_accelerator().type} device (CUDA was initialised before the rank "
                               "hid the GPUs); start the ranks in fresh processes")
        super().__init__(spec, device, fatal_errors=world > 1)  # a failed collective leaves the group unusable
        self.compute.run(resolve, spec.source, progress=False)  # fetch / write checkpoints before the group exists
        self.rank, self.world = rank, world
        self.followers: list = []
        self.worker = self._join_and_load(master, port, backend)
        self.meta = model_meta(self.loaded, device)

    def _join_and_load(self, master: str, port: int, backend: str):
        import torch.distributed as dist

        from sequoia_ray.target import TargetWorker

        os.environ.update(MASTER_ADDR=master, MASTER_PORT=str(port), RANK=str(self.rank), WORLD_SIZE=str(self.world))
        if self.world > 1:  # one rank has no collectives; its group would only add gloo's loop thread, which
            # wakes every 10 ms in the process that computes (~100 wake-ups/s; +2% on a forward, within noise)
            dist.init_process_group(backend, rank=self.rank, world_size=self.world,
                                    init_method=f"tcp://{master}:{port}",
                                    timeout=timedelta(seconds=self.spec.collective_timeout_s),
                                    device_id=self.device if backend == "nccl" else None)  # the rank's GPU, eagerly
        self.loaded = self.compute.run(self._load)
        check_sharded(self.loaded.model, self.world)
        return self.compute.run(TargetWorker, self.loaded.model, layout=self.spec.batch_layout,
                                prefill_chunk=self.spec.prefill_chunk, retry_alone=self.world == 1,
                                prefix_cache=self.spec.prefix_cache())

    def _load(self):
        from sequoia_ray.models.loading import load_model

        return load_model(self.spec.source, dtype=self.spec.dtype, progress=False, device=self.device,
                          tp_plan="auto" if self.world > 1 else None, linears=self.spec.linears,
                          layers=self.spec.layers)

    def lead(self, followers: list) -> None:
        """Make this rank (0) the group's entry point for ``followers`` (ranks 1..tp-1)."""
        self.followers = followers
        if self.world == 1 and self.spec.pipelines:  # TP ranks keep one count (same numerics); in lockstep the
            self.share = ThreadShare(self.spec.threads)  # draft never grows while this rank verifies
        self._start_batcher(self._lead_batch, self._lead_one)

    def call(self, method: str, request_id: str, *args):
        """The group's entry point (rank 0): one request's call. A ``verify`` joins the next forward with every
        other waiting ``verify`` (continuous batching); the batcher's one thread then forwards the whole batch
        to every other rank as ONE call and runs it here. One sender per group keeps every rank's sequence
        of collectives in one order — callers in several threads or replicas sending to each rank
        themselves would interleave differently on each rank and pair up different requests' all-reduces."""
        return self.batcher.call(method, request_id, *args)

    def _lead_one(self, method: str, request_id: str, *args):
        with self.tracker.running(method):
            # rank 0 decides; every rank frees the same
            stale = self.reaper.due(method, [] if method == REAP else [request_id], self._waiting())
            refs = [f.step.remote(method, request_id, *args, stale=stale) for f in self.followers]
            mine = self._unsafe_run(method, request_id, *args, stale=stale)
            self._check_agree(method, [mine], [[r] for r in self._gather(refs)])
            return mine

    def _lead_batch(self, method: str, calls: list[tuple], caps: dict[str, int] | None = None) -> list:
        with self.tracker.running(method):
            stale = self.reaper.due(method, [call[0] for call in calls], self._waiting())
            refs = [f.step_batch.remote(method, calls, stale, caps) for f in self.followers]
            mine = self._unsafe_run_batch(method, calls, caps, stale=stale)
            self._check_agree(method, mine, self._gather(refs))
            return mine

    def _gather(self, refs) -> list:
        if not refs:  # no followers (TP 1): ray.get([]) outside a Ray worker (in process) would start local Ray
            return []
        return ray.get(refs, timeout=self.spec.collective_timeout_s)

    @staticmethod
    def _check_agree(method: str, mine: list, theirs: list[list]) -> None:
        def key(result):  # exceptions compare by kind and message (the workers' messages name no rank state)
            return (type(result).__name__, str(result)) if isinstance(result, BaseException) else result

        if any([key(r) for r in other] != [key(r) for r in mine] for other in theirs):
            raise RuntimeError(f"tensor-parallel ranks disagree on a batched {method} of {len(mine)} requests")

    def step(self, method: str, request_id: str, *args, stale: list[str] = ()):
        """A follower's share of a call forwarded by rank 0 (``stale``: the idle requests rank 0 freed)."""
        return self.compute.run(self._run, method, request_id, *args, stale=list(stale))

    def step_batch(self, method: str, calls: list[tuple], stale: list[str] = (),
                   caps: dict[str, int] | None = None) -> list:
        """A follower's share of a batch forwarded by rank 0 (its chunks cut as rank 0's: ``caps``)."""
        return self.compute.run(self._run_batch, method, calls, caps, stale=list(stale))

    def time_forward(self, sizes, context: int, repeats: int) -> dict[int, float]:
        """Target timings; every rank must run this at once (the forward is collective)."""
        from sequoia_ray.hardware import time_forward

        return self.compute.run(time_forward, self.worker.model, sizes, context=context, repeats=repeats)


def check_sharded(model, world: int) -> None:
    """Assert the attention projections hold 1/world of their output rows on this rank (one rank holds every
    row: nothing to check, and its Linear layers may be packed, without a plain ``weight``)."""
    if world == 1:
        return
    proj = model.model.layers[0].self_attn.q_proj.weight
    local = proj.to_local() if hasattr(proj, "to_local") else proj
    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    expected = config.num_attention_heads * head_dim // world
    if local.shape[0] != expected:
        raise RuntimeError(f"target is not sharded: q_proj has {local.shape[0]} local rows, expected {expected} "
                           f"for tp_size {world}; set WORLD_SIZE before loading (transformers reads it)")


class TargetGroup:
    """``tp_size`` rank actors in bundles ``first_bundle``.. of the caller's placement group, or anywhere when
    there is none (in-process tests). A Serve replica holds no resources and shares bundle 0 with rank 0; a
    Tune trial runs the draft itself in bundle 0, so its ranks start at bundle 1."""

    def __init__(self, spec: ModelActorSpec, tp_size: int, backend: str, resources: ActorResources, *,
                 first_bundle: int = 0) -> None:
        master, port = ray.util.get_node_ip_address(), free_port()
        actor = ray.remote(concurrency_groups={"health": 1})(TargetRank)
        self.ranks = [actor.options(**in_bundle(resources, first_bundle + rank),
                                     max_concurrency=spec.callers)
                      .remote(rank, tp_size, master, port, backend, spec) for rank in range(tp_size)]
        self.meta = ray.get([r.info.remote() for r in self.ranks])[0]
        ray.get(self.ranks[0].lead.remote(self.ranks[1:]))

    def time_target(self, sizes, context: int, repeats: int) -> dict[int, float]:
        """t(n) of the whole group: rank 0's timings of a forward all ranks run together."""
        return ray.get([r.time_forward.remote(sizes, context, repeats) for r in self.ranks])[0]

    def kill(self) -> None:
        for r in self.ranks:
            ray.kill(r)
