"""What every model actor shares: its device, the in-process worker it wraps (a core ``DraftWorker`` or
``TargetWorker``), idle-request reaping, call tracking for health checks, and the calls a deployment makes
(``health``, ``active``, ``info``) in their own concurrency group so they answer while a step runs."""

from __future__ import annotations

import hashlib
import json
import logging
import sys
from typing import TYPE_CHECKING

import ray

from actors.health import CallTracker
from actors.reaper import REAP, Reaper
from actors.spec import ModelActorSpec
from actors.thread_share import ThreadShare
from sequoia_ray.batching import BATCHED, Batcher, comes_straight_back
from sequoia_ray.compute_thread import compute_thread
from sequoia_ray.devices import resolve_device

if TYPE_CHECKING:  # torch is imported where a model actor runs: a deployment replica that only creates
    import torch  # and calls actors never loads it


def assigned_device(spec: str) -> torch.device:
    """The device for ``spec`` (auto | cpu | cuda) from the GPUs Ray assigned this actor; outside Ray (an
    actor class used in-process by a test) there are none. Sets torch's current CUDA device to it."""
    import torch

    gpu_ids = ray.get_gpu_ids() if ray.is_initialized() else []  # get_gpu_ids() would start Ray otherwise
    if ray.is_initialized() and not gpu_ids:  # never take a GPU Ray left visible to a num_gpus 0 actor
        if spec == "cuda":
            raise ValueError("device cuda, but Ray assigned this actor no GPU; set num_gpus >= 1 (or device auto)")
        return torch.device("cpu")
    device = resolve_device(spec, gpu_ids=gpu_ids)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return device


class _StderrLines(logging.StreamHandler):
    """Plain lines to whatever ``sys.stderr`` is when a record is emitted, not the stream that was
    ``sys.stderr`` when the handler was made: a worker (or a test's capture) may swap it in between."""

    def __init__(self) -> None:
        super().__init__()
        self.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))

    @property
    def stream(self):  # noqa: D102 - StreamHandler reads self.stream in emit and flush
        return sys.stderr

    @stream.setter
    def stream(self, _value) -> None:
        pass


def log_lines_to_stderr(level: int = logging.INFO) -> None:
    """In an actor, the core's log lines (model loading, plan changes) go to stderr — which Ray forwards to
    the driver's log — as plain lines; no handler is set up there otherwise, and INFO would be dropped.
    Idempotent: one handler however many actors a process holds."""
    log = logging.getLogger("sequoia_ray")
    if not any(isinstance(h, _StderrLines) for h in log.handlers):
        log.addHandler(_StderrLines())
    log.setLevel(level)


class ModelActor:
    """Base of ``DraftActor`` and ``TargetRank``; subclasses set ``self.worker`` and ``self.meta``."""

    def __init__(self, spec: ModelActorSpec, device: torch.device, *, fatal_errors: bool) -> None:
        import torch

        log_lines_to_stderr()
        # Every torch call of this actor runs on the process's one compute thread (loading, forwards,
        # timings): torch kernels on two threads cost ~1.5x a forward on 2 cores (sequoia_ray.compute_thread).
        self.compute = compute_thread()
        self.compute.run(torch.set_num_threads, spec.threads)  # the global count and that thread's OpenMP
        self.spec, self.device = spec, device
        self.reaper = Reaper(spec.idle_timeout_s)
        self.tracker = CallTracker(fatal_errors=fatal_errors)  # fatal: a failed collective breaks a TP group
        self.worker = None
        self.batcher: Batcher | None = None
        self.share: ThreadShare | None = None  # None: every forward runs spec.threads threads
        self.meta: dict = {}

    def _run(self, method: str, request_id: str, *args, stale=None):
        """``worker.<method>(request_id, *args)``, tracked for health, after freeing idle requests."""
        with self.tracker.running(method):
            return self._unsafe_run(method, request_id, *args, stale=stale)

    def _run_batch(self, method: str, calls: list[tuple], caps: dict[str, int] | None = None, stale=None) -> list:
        """One batched ``grow`` / ``verify`` (``calls`` = [(request_id, *args)]; ``caps``: prefill chunks cut to so
        many tokens, ``sequoia_ray.batching``): per call a result or exception."""
        with self.tracker.running(method):
            return self._unsafe_run_batch(method, calls, caps, stale=stale)

    def _unsafe_run(self, method: str, request_id: str, *args, stale=None):  # untracked: the caller tracks
        if method == REAP:  # the requests freed (rank 0's list on a TP follower)
            return self._reap(method, [], stale)
        self._reap(method, [request_id], stale)
        if method == "finish":
            self._forget(request_id)
        return getattr(self.worker, method)(request_id, *args)

    def _unsafe_run_batch(self, method: str, calls: list[tuple], caps: dict[str, int] | None = None,
                          stale=None) -> list:  # untracked
        self._reap(method, [call[0] for call in calls], stale)
        return getattr(self.worker, BATCHED[method])(calls, caps)

    def _reap(self, method: str, request_ids: list[str], stale: list[str] | None) -> list[str]:
        """Free the requests idle for too long (after marking these calls' requests alive); ``stale`` given:
        free exactly those (a TP follower frees what rank 0 decided, so every rank holds the same requests)."""
        stale = self.reaper.due(method, request_ids, self._waiting()) if stale is None else stale
        for rid in stale:
            self._forget(rid)
            self.worker.finish(rid)
        return stale

    def _waiting(self) -> list[str]:
        """The requests with a call queued in this actor's batcher (none without one)."""
        batcher = getattr(self, "batcher", None)
        return batcher.waiting() if batcher is not None else []

    def _forget(self, request_id: str) -> None:
        """A finished request no longer counts as computing on the other actor (``ThreadShare.forget``)."""
        if self.share is not None:
            self.share.forget(request_id)

    def _start_batcher(self, run_batch, run_one, *, waits: bool = True) -> None:
        """Continuous batching of the calls this actor receives (``sequoia_ray.batching``): every call
        waits in its own Ray thread while one batcher thread gathers them and the compute thread runs them.
        With ``spec.wait_trees`` tree requests are waited for too (lockstep); ``waits`` False: this actor only
        gathers (the draft: one of the two may wait long, see ``comes_back_after_any_step``)."""
        self.batcher = Batcher(
            lambda method, calls, caps: self.compute.run(self._run_shared, run_batch, method, calls, caps),
            lambda method, rid, *args: self.compute.run(run_one, method, rid, *args),
            self.worker.tokens_of, name=f"{type(self).__name__}-batcher", fewest=self.worker.fewest_tokens_of,
            **self.spec.batcher_policy(waits=waits))

    def _run_shared(self, run_batch, method: str, calls: list[tuple], caps: dict[str, int] | None = None) -> list:
        """``run_batch`` with the threads ``self.share`` gives it (on the compute thread: the count is its own)."""
        import torch

        if self.share is not None:
            tree = {call[0] for call in calls if _steps_a_tree(method, call)}
            alone = {call[0] for call in calls if method == "verify"} - tree
            wanted = self.share.threads_for(tree, alone)
            if wanted != torch.get_num_threads():
                torch.set_num_threads(wanted)
        return run_batch(method, calls, caps)

    def info(self) -> dict:
        """What the deployment needs to know of the loaded model (EOS ids, context, vocab, threads, device)."""
        return self.meta

    @ray.method(concurrency_group="health")
    def active(self) -> int:
        return len(self.worker.requests)

    @ray.method(concurrency_group="health")
    def batch_sizes(self) -> dict[int, int]:
        """Requests per forward -> forwards run, since the actor started (rank 0 and the draft batch)."""
        return self.batcher.stats() if self.batcher else {}

    @ray.method(concurrency_group="health")
    def utilization(self) -> dict[str, float]:
        """Seconds this actor's batcher spent running batches, and seconds since it started (rank 0 and the
        draft batch; empty before)."""
        return self.batcher.utilization() if self.batcher else {}

    @ray.method(concurrency_group="health")
    def batch_trace(self, since: float = 0.0) -> list:
        """The batches this actor's batcher ran since ``since`` (``time.monotonic()``, the host's clock), as
        ``sequoia_ray.batching.Forward``; empty before the batcher starts."""
        return self.batcher.trace(since) if self.batcher else []

    @ray.method(concurrency_group="health")
    def health(self) -> dict:
        """The tracker's state; an actor whose batcher thread has died is broken (every call would fail)."""
        state = self.tracker.health()
        if self.batcher is not None and not self.batcher.closed and not self.batcher.thread.is_alive():
            state["broken"] = state["broken"] or "its batcher thread has died"
        return state


def _steps_a_tree(method: str, call: tuple) -> bool:
    """A batched call of a request stepping a tree: every ``grow``, a ``verify`` of more than the root — a
    step call that does not come straight back to this actor."""
    return method in ("grow", "verify") and not comes_straight_back(method, call[1:])


def model_meta(loaded, device: torch.device) -> dict:
    import torch

    from sequoia_ray.hardware import accelerator_name, cpu_name

    return {"eos_ids": loaded.eos_ids, "max_context": loaded.max_context, "vocab": loaded.model.config.vocab_size,
            "tokenizer": tokenizer_digest(loaded.tokenizer), "threads": torch.get_num_threads(),
            "device": str(device), "accelerator": accelerator_name(device), "cpu": cpu_name()}


def tokenizer_digest(tokenizer) -> str | None:
    """A short digest of a tokenizer's token -> id map (None without a tokenizer): two actors' models share a
    tokenizer when their digests are equal (the ingress checks the draft's against the target's)."""
    if tokenizer is None:
        return None
    vocab = sorted(tokenizer.get_vocab().items())
    return hashlib.sha256(json.dumps(vocab, ensure_ascii=False).encode()).hexdigest()[:16]
