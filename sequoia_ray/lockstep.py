"""Requests decoded in lockstep, in process: every step is one ``grow_batch`` and one ``verify_batch`` over all
the requests still running — the batched serving step without Ray (no batcher thread, no actor calls).

The profile measures with it what its forward timings leave out (sampling, the tree walk, the KV compaction,
the Python around them: ``sequoia_ray.hardware``'s overhead term) and runs candidate plans for real (the
measured choice). A request leaves the batch when it has its ``max_tokens``; EOS is ignored, so every
request runs the same number of tokens and a plan is compared on the same work.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from sequoia_ray.config import SamplingParams
from sequoia_ray.devices import synchronize
from sequoia_ray.draft import DraftTree, DraftWorker
from sequoia_ray.engine import ROOT_ONLY
from sequoia_ray.target import TargetWorker
from sequoia_ray.tree.plan import TreePlan, first_levels


@dataclass(frozen=True)
class LockstepRun:
    tokens: int  # tokens generated, all requests
    step_s: tuple[float, ...]  # seconds of each batched step after the first (the first one prefills)
    batch: tuple[int, ...]  # requests in each of those steps
    step_tokens: tuple[int, ...]  # tokens the requests kept in each of those steps (within max_tokens)
    tokens_per_step: float  # per request and step, over every step
    outputs: tuple[tuple[int, ...], ...] = ()  # each request's tokens (its first max_tokens)
    forward_s: tuple[float, ...] = ()  # seconds of each timed step inside the models' forwards (time_forwards)
    draft_forward_s: tuple[float, ...] = ()  # the part of ``forward_s`` inside the draft's forwards

    @property
    def seconds(self) -> float:
        return sum(self.step_s)

    @property
    def timed_tokens(self) -> int:
        return sum(self.step_tokens)

    def full_steps(self) -> tuple[float, ...]:
        """The seconds of the timed steps that held every request (the tail, as requests finish, holds fewer)."""
        top = max(self.batch, default=0)
        return tuple(s for s, b in zip(self.step_s, self.batch) if b == top)

    def full_rate(self) -> tuple[int, float, int]:
        """(tokens kept, seconds, request-steps) of the timed steps that held every request: the run at its
        batch size. Its tail, where the requests that finished first have left, runs the rest at a smaller
        batch (a tree's requests finish at different steps; the target alone's all at the same one)."""
        top = max(self.batch, default=0)
        full = [(k, s) for k, s, b in zip(self.step_tokens, self.step_s, self.batch) if b == top]
        return sum(k for k, _ in full), sum(s for _, s in full), top * len(full)

    def full_steps_outside(self) -> tuple[float, ...]:
        """The seconds of those steps spent outside the models' forwards (a run with ``time_forwards``)."""
        if len(self.forward_s) != len(self.step_s):
            raise ValueError("this run did not time its forwards; run it with time_forwards=True")
        top = max(self.batch, default=0)
        return tuple(s - f for s, f, b in zip(self.step_s, self.forward_s, self.batch) if b == top)


@dataclass
class _Running:
    rid: str
    length: int  # committed tokens
    last: int  # the last committed token (the root of the next tree)
    out: list[int] = field(default_factory=list)  # generated tokens
    commits: list = field(default_factory=list)  # verdicts the draft has not been sent yet

    @property
    def produced(self) -> int:
        return len(self.out)


def run_lockstep(target: TargetWorker, draft: DraftWorker | None, prompts: list[list[int]], plan: TreePlan,
                 params: SamplingParams, *, seed: int = 0, time_forwards: bool = False) -> LockstepRun:
    """Decode every prompt for ``params.max_tokens`` tokens (EOS ignored) on ``plan``'s tree (the root-only
    tree, or no draft: the target alone), all in lockstep. Request i's generators are seeded from ``seed + i``.
    Any request's failure raises (a measurement has no partial result). ``time_forwards``: also record each
    step's seconds inside the models' forwards (turns the workers' ``forward_clock`` on)."""
    if not prompts:
        raise ValueError("run_lockstep needs at least one prompt")
    params = params.model_copy(update={"ignore_eos": True})
    running = [_Running(f"lockstep-{seed}-{i}", len(p), p[-1]) for i, p in enumerate(prompts)]
    workers = [w for w in (target, draft if plan.n > 1 else None) if w is not None]
    for worker in workers:
        worker.forward_clock.on = worker.forward_clock.on or time_forwards
    started: list[tuple[TargetWorker | DraftWorker, str]] = []  # finished whatever fails (a start too)
    try:
        for i, (r, prompt) in enumerate(zip(running, prompts)):
            for k, worker in enumerate(workers):
                worker.start(r.rid, prompt, params, 2 * (seed + i) + k)
                started.append((worker, r.rid))
        return _steps(target, draft if len(workers) > 1 else None, running, plan, params.max_tokens)
    finally:
        for worker, rid in started:
            worker.finish(rid)


def _steps(target: TargetWorker, draft: DraftWorker | None, running: list[_Running], plan: TreePlan,
           max_tokens: int) -> LockstepRun:
    step_s, batch, step_tokens, forward_s, draft_s, accepted, steps = [], [], [], [], [], 0, 0
    clocks = [w.forward_clock for w in (target, draft) if w is not None]  # the target's first
    live = list(running)
    while live:
        plans = [first_levels(plan, max_tokens - r.produced) if draft else ROOT_ONLY for r in live]
        before = [c.seconds for c in clocks]
        start = _clock(target)
        verdicts = _step(target, draft, live, plans)
        elapsed = _clock(target) - start
        inside = [c.seconds - b for c, b in zip(clocks, before)]
        kept = 0
        for r, verdict in zip(live, verdicts):
            r.commits.append((verdict.path, verdict.tokens, r.length))
            r.length, r.last = r.length + len(verdict.tokens), verdict.tokens[-1]
            kept += min(len(verdict.tokens), max_tokens - len(r.out))
            r.out += verdict.tokens
            accepted += len(verdict.tokens)
        if steps:  # the first step prefills the prompts: not timed
            step_s.append(elapsed)
            batch.append(len(live))
            step_tokens.append(kept)
            forward_s.append(sum(inside))
            draft_s.append(sum(inside[1:]))
        steps += len(live)
        live = [r for r in live if r.produced < max_tokens]
    outputs = tuple(tuple(r.out[:max_tokens]) for r in running)
    timed = all(c.on for c in clocks)
    return LockstepRun(sum(map(len, outputs)), tuple(step_s), tuple(batch), tuple(step_tokens), accepted / steps,
                       outputs, *((tuple(forward_s), tuple(draft_s)) if timed else ()))


def _step(target: TargetWorker, draft: DraftWorker | None, live: list[_Running], plans: list[TreePlan]) -> list:
    if draft is None:
        trees = [DraftTree(torch.tensor([r.last]), {}) for r in live]
    else:
        trees = _no_failure(draft.grow_batch([(r.rid, p, r.commits) for r, p in zip(live, plans)]), "grow")
        for r in live:
            r.commits = []
    return _no_failure(target.verify_batch([(r.rid, p, t) for r, p, t in zip(live, plans, trees)]), "verify")


def _no_failure(results: list, what: str) -> list:
    for result in results:
        if isinstance(result, Exception):
            raise RuntimeError(f"lockstep {what} failed: {type(result).__name__}: {result}") from result
        if isinstance(result, str):  # NOT_YET: the workers here prefill whole prompts
            raise RuntimeError(f"lockstep {what} answered {result!r}; build the workers without prefill_chunk")
    return results


def _clock(worker: TargetWorker) -> float:
    synchronize(worker.device)
    return time.perf_counter()
