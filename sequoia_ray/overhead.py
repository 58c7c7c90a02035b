"""Measure the cost model's per-step overhead (``sequoia_ray.hardware.StepOverhead``): run real steps in
lockstep (``sequoia_ray.lockstep``) on a root-only tree and on a tree plan, at batch 1 and at a larger batch,
and time what each step spends outside the models' forwards (``sequoia_ray.forward_clock``: the forwards are
timed inside the same step) — drawing children, the verifier's walk, the KV compaction, the Python around
them. It is fitted as ``fixed + per_request·B`` for each kind of step, in target steps of the profile.

Until session 31 the overhead was the step minus the forwards the profile predicts for it: a residual of two
timings taken minutes apart, so the machine's phase between them landed in it. On the 2-core EPYC the main
job's 120 s profile read 0.15 target steps for the target alone's step (whose walk and bookkeeping take ~1 ms
of ~140) and its T = 0.6 prediction came out 13.5% high; other runs read -0.04 to -0.12 (clamped to 0).
Timed inside the step, what is outside is ~1 ms for the target alone and ~7 ms for a 16-node tree at batch 1.
"""

from __future__ import annotations

import functools
import statistics
from dataclasses import dataclass

from sequoia_ray.config import SamplingParams
from sequoia_ray.draft import DraftWorker
from sequoia_ray.engine import ROOT_ONLY
from sequoia_ray.hardware import HardwareProfile, StepOverhead, quiet, relative_noise, timed_rounds
from sequoia_ray.lockstep import run_lockstep
from sequoia_ray.target import TargetWorker
from sequoia_ray.tree.plan import TreePlan

OVERHEAD_BATCHES = (1, 4)  # batch sizes the overhead is measured at (fixed + per_request·B through them)


@dataclass(frozen=True)
class OverheadMeasurement:
    overhead: StepOverhead  # in target steps
    outside: dict[tuple[str, int], float]  # (alone | tree, batch) -> a step's time outside the forwards, in target steps
    step_s: dict[tuple[str, int], float]  # (alone | tree, batch) -> seconds of a step holding every request
    noise: float  # relative MAD of the repeats (see ``hardware.relative_noise``)


def measure_overhead(target_model, draft_model, prof: HardwareProfile, plan: TreePlan, prompts: list[list[int]],
                     params: SamplingParams, *, batches=OVERHEAD_BATCHES, repeats: int = 3) -> OverheadMeasurement:
    """Every (kind, batch) run ``repeats`` times, round-robin; a run decodes ``params.max_tokens`` tokens for
    ``batch`` of ``prompts`` (cycled). Its steps that held the whole batch give the median time outside the
    forwards (the overhead: the median over the runs) and the median step (``step_s``: the quietest run, as
    ``hardware.quiet`` reads forwards)."""
    plans = {"alone": ROOT_ONLY, "tree": plan}
    outside: dict[tuple[str, int], list[float]] = {(kind, b): [] for kind in plans for b in batches}
    runs = {(kind, b): functools.partial(_median_step, target_model, draft_model, _cycle(prompts, b), p, params,
                                         outside[kind, b])
            for kind, p in plans.items() for b in batches}
    rounds = timed_rounds(runs, repeats=repeats, warmup=0)
    per_step = {k: statistics.median(v) / prof.target_step_s for k, v in outside.items()}
    fitted = {kind: fit_linear({b: per_step[kind, b] for b in batches}) for kind in plans}
    return OverheadMeasurement(StepOverhead(alone=fitted["alone"], tree=fitted["tree"]), per_step,
                               {k: quiet(v) for k, v in rounds.items()}, relative_noise(rounds))


def fit_linear(by_batch: dict[int, float]) -> tuple[float, float]:
    """(fixed, per_request) through the smallest and largest batch's values, both >= 0 (one batch size: all of it
    fixed). A line that would cross zero before the smallest batch goes through the origin and the largest
    batch's value instead: clamping its intercept alone kept the slope, and the model then overstated the
    largest batch (10 and 500 ms at batches 1 and 4 were modelled as 653 ms at 4), the one the fit is for."""
    lo, hi = min(by_batch), max(by_batch)
    per_request = max(0.0, (by_batch[hi] - by_batch[lo]) / (hi - lo)) if hi > lo else 0.0
    fixed = by_batch[lo] - per_request * lo
    if fixed < 0:
        return 0.0, max(0.0, by_batch[hi]) / hi
    return fixed, per_request


def _median_step(target_model, draft_model, prompts, plan: TreePlan, params: SamplingParams,
                 outside: list[float]) -> float:
    """The median full step of one run (seconds); its median time outside the forwards is appended to
    ``outside``."""
    run = run_lockstep(TargetWorker(target_model), DraftWorker(draft_model), prompts, plan, params,
                       time_forwards=True)
    full = run.full_steps()
    if not full:
        raise ValueError(f"max_tokens {params.max_tokens} gave no timed step; measure with more tokens")
    outside.append(statistics.median(run.full_steps_outside()))
    return statistics.median(full)


def _cycle(prompts: list[list[int]], batch: int) -> list[list[int]]:
    if not prompts:
        raise ValueError("no prompts to measure the overhead on")
    return [prompts[i % len(prompts)] for i in range(batch)]
