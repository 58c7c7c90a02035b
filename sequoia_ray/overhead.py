"""Measure the cost model's per-step overhead (``sequoia_ray.hardware.StepOverhead``): run real steps in
lockstep (``sequoia_ray.lockstep``) on a root-only tree and on a tree plan, at batch 1 and at a larger batch,
and subtract the forwards the profile predicts for them. What is left — drawing, walking, compacting, the
Python around it — is fitted as ``fixed + per_request·B`` for each kind of step.

The steps run on the real prompts (their context lengths, not the profile's), so the overhead also absorbs
what the profile's context gets wrong: it calibrates the model on the work it will predict. A residual below
zero (the forwards predicted slower than whole steps ran) is clamped at zero: the overhead never makes a step
cheaper than its forwards.
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
    residual: dict[tuple[str, int], float]  # (alone | tree, batch) -> measured step - predicted forwards, in target steps
    step_s: dict[tuple[str, int], float]  # (alone | tree, batch) -> seconds of a step holding every request
    noise: float  # relative MAD of the repeats (see ``hardware.relative_noise``)


def measure_overhead(target_model, draft_model, prof: HardwareProfile, plan: TreePlan, prompts: list[list[int]],
                     params: SamplingParams, *, batches=OVERHEAD_BATCHES, repeats: int = 3) -> OverheadMeasurement:
    """Every (kind, batch) run ``repeats`` times, round-robin; a run decodes ``params.max_tokens`` tokens for
    ``batch`` of ``prompts`` (cycled) and yields the median seconds of its steps that held the whole batch; the
    quietest run counts (``hardware.quiet``), as the profile's forwards it is set against."""
    plans = {"alone": ROOT_ONLY, "tree": plan}
    runs = {(kind, b): functools.partial(_median_step, target_model, draft_model, _cycle(prompts, b), p, params)
            for kind, p in plans.items() for b in batches}
    rounds = timed_rounds(runs, repeats=repeats, warmup=0)
    step_s = {k: quiet(v) for k, v in rounds.items()}  # the quietest run, as the forwards it is set against
    residual = {(kind, b): step_s[kind, b] / prof.target_step_s - prof.step_cost(plans[kind], b)
                for kind, b in step_s}
    fitted = {kind: fit_linear({b: residual[kind, b] for b in batches}) for kind in plans}
    return OverheadMeasurement(StepOverhead(alone=fitted["alone"], tree=fitted["tree"]), residual, step_s,
                               relative_noise(rounds))


def fit_linear(by_batch: dict[int, float]) -> tuple[float, float]:
    """(fixed, per_request) through the smallest and largest batch's residuals, both clamped at >= 0 (one batch
    size: all of it fixed)."""
    lo, hi = min(by_batch), max(by_batch)
    per_request = max(0.0, (by_batch[hi] - by_batch[lo]) / (hi - lo)) if hi > lo else 0.0
    return max(0.0, by_batch[lo] - per_request * lo), per_request


def _median_step(target_model, draft_model, prompts, plan: TreePlan, params: SamplingParams) -> float:
    run = run_lockstep(TargetWorker(target_model), DraftWorker(draft_model), prompts, plan, params)
    full = run.full_steps()
    if not full:
        raise ValueError(f"max_tokens {params.max_tokens} gave no timed step; measure with more tokens")
    return statistics.median(full)


def _cycle(prompts: list[list[int]], batch: int) -> list[list[int]]:
    if not prompts:
        raise ValueError("no prompts to measure the overhead on")
    return [prompts[i % len(prompts)] for i in range(batch)]
