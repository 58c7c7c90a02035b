"""The acceptance vector learnt from live traffic, and the re-plan it triggers.

Observations. Every verified tree's walk reports, per visited inner node (root first), its number of
children w and the rank k accepted (1-based in draw order; 0 = every child rejected): ``Verdict.ranks``.
The tree may be any tree (a pruned or extended one), not only the plan's.

Estimate. Children are drawn without replacement and verified in rank order, so whether rank k is accepted
does not depend on how many children come after it: a node with w >= k children is a fair trial for rank k,
a node with fewer is censored. So, with m[k] = (weighted) inner nodes with >= k children and a[k] = those of
them that accepted rank k, p̂[k] = a[k] / m[k] is unbiased for trees of any widths chosen without regard to
the node's own acceptance. A tree a request's own policy chose (``request_trees``: wide for prose, narrow for
code) is not: its nodes tell rank 1 alone (``engine._rank_one``). One row (not depth-indexed): every visited
inner node counts, whatever its depth.

Prior. A rank that has never had ``min_samples`` effective trials is *unsettled*. Once settled, a rank keeps its
estimate when the plan stops trying it: its counts stop decaying at ``min_samples`` effective trials, so the
estimate weighs as much as when it settled, and a later trial moves it by ~1 / min_samples. (Decayed towards
0 they left p̂ = a / m to the next trial: a rank 3 of p̂ 0.1 read 1.0 after one 3-wide node accepted rank 3,
and every rank was scaled by 1 / sum p̂.) With ``explore`` (default) an unsettled rank is optimistic:
min(its Wilson upper bound, the previous rank's value) — a rank the served trees never try (a plan 2 wide
never tries rank 3) would otherwise keep the prior forever, however wrong; the optimistic value makes the
DP try it, which settles it after ``min_samples`` trials. Without ``explore`` it keeps the prior's p[k] (the
served plan's vector; 0 beyond its width). Either way unsettled ranks share only the mass 1 - sum(settled p̂),
in rank order, so they never shift the settled estimates.

Bound. A Wilson score interval at ``z`` (default 3) per rank. The served plan's vector *leaves its bound* when
some rank with m[k] >= ``min_samples`` has the plan's p[k] outside the interval; then the service re-plans,
and serves a bucket's new plan only when, under the estimate, it is worth ``MIN_GAIN`` more than the plan
served there (tokens a step, or with a profile tokens per unit of step time). The interval counts every inner
node as an independent trial, while real traffic comes in requests whose nodes share their own acceptance
(code and prose): a mix that did not change left the bound 17-25 times in 2 hours in a review's simulation,
and two replicas publishing to one store, their estimates 0.02 apart, re-planned at every check (40 in 40
minutes each, 81 plan files) — each time for a tree worth about the same.

Recent traffic: exponential decay. Every inner-node observation first multiplies all counts by
2 ** (-1 / half_life), so an observation ``half_life`` observations old weighs 1/2, and the effective sample
size m[k] tops out at about half_life / ln 2. A rank no longer tried stops decaying at ``min_samples``
effective trials once settled, at ``FROZEN`` before, keeping its p̂. ``samples`` (the raw count since the
start) is reported beside the effective counts. Thread-safe: many request threads feed one ``LiveAcceptance``.

No tree served: the estimate fades back to exploring. A verdict with no inner node (the target alone: a
root-only plan, or ``live_cost``'s other arm) is a *blind* step (a dynamic tree's step, whose ranks the
engine withholds, is not observed at all: ``deployments.service.LivePlanner.observe``). A re-plan may serve the
target alone at every batch size (the cost model finds speculation does not pay at the acceptance estimated),
and then no verdict tries a rank again: the estimate could never move and no re-plan ever restore a tree,
however good acceptance became. So once ``half_life`` blind steps in a row have passed at a temperature (no
tree verified there for as long as an observation takes to lose half its weight), its counts weigh at most
``min_samples`` trials, halving every further ``half_life`` blind steps: every rank is unsettled, and with
``explore`` optimistic by its Wilson upper bound, which grows as the counts fade. ``check`` re-plans then when
that gives a tree to a bucket whose plan is the target alone by the model (not by measurement), and the trials
of that tree settle the ranks again: back to the target alone if acceptance is still low, a tree fitted to it
if it recovered. Exploring costs up to ``min_samples`` trials of a tree (a step tries one inner node or more)
and the steps until the next check, per ``half_life`` blind steps or more: ~2% of the steps with the service's
defaults (400 / 20,000). The target alone stays reachable, and is no trap.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterable
from dataclasses import dataclass, replace

import numpy as np

from sequoia_ray.hardware import NO_OVERHEAD, HardwareProfile, StepOverhead, choose_buckets
from sequoia_ray.plan_store import temperature_bucket
from sequoia_ray.tree.acceptance_vector import AcceptanceVector
from sequoia_ray.tree.dp import solve
from sequoia_ray.tree.plan import carried_leaf, expected_tokens
from sequoia_ray.tree.plan_file import PlannedTree
from sequoia_ray.tree.planning import plan_for


@dataclass(frozen=True)
class LiveSettings:
    min_samples: int = 400  # effective trials a rank needs before its estimate replaces the prior
    z: float = 3.0  # width of the Wilson interval, in standard deviations
    half_life: float = 20_000.0  # inner-node observations after which an observation weighs 1/2
    explore: bool = True  # under-sampled ranks optimistic (upper bound) instead of the prior: see the docstring

    def __post_init__(self) -> None:
        if self.min_samples < 1:
            raise ValueError(f"min_samples {self.min_samples} must be >= 1")
        if not self.z > 0:
            raise ValueError(f"z {self.z} must be > 0 (e.g. 3)")
        if not self.half_life > 0:  # nan too: it passed every comparison below and left p̂ all zeros
            raise ValueError(f"half_life {self.half_life} must be > 0 (observations; inf: no decay)")
        if self.half_life / math.log(2) < self.min_samples:
            raise ValueError(f"half_life {self.half_life} keeps at most {self.half_life / math.log(2):.0f} effective "
                             f"samples < min_samples {self.min_samples}: raise half_life or lower min_samples")


@dataclass(frozen=True)
class Snapshot:
    """A temperature bucket's counts at one moment (a copy: use it without the lock)."""

    tried: np.ndarray  # [W] float64; m[k-1]: effective inner nodes with >= k children
    accepted: np.ndarray  # [W] float64; a[k-1]: of those, the ones that accepted rank k
    settled: np.ndarray  # [W] bool; the rank has had min_samples effective trials (since it last faded blind)
    samples: int  # inner-node observations since the start (not decayed)
    settings: LiveSettings
    blind: int = 0  # verdicts with no inner node since the last that had one (see the module docstring)

    def p_hat(self) -> np.ndarray:  # [W]; nan where nothing was tried
        with np.errstate(invalid="ignore", divide="ignore"):
            return self.accepted / self.tried

    def interval(self) -> tuple[np.ndarray, np.ndarray]:  # ([W], [W]) Wilson bounds; [0, 1] where untried
        n, z = np.maximum(self.tried, 1e-12), self.settings.z
        p = np.clip(np.nan_to_num(self.p_hat()), 0.0, 1.0)
        centre = (p + z * z / (2 * n)) / (1 + z * z / n)
        half = z / (1 + z * z / n) * np.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
        return np.clip(centre - half, 0.0, 1.0), np.clip(centre + half, 0.0, 1.0)

    def enough(self) -> np.ndarray:  # [W] bool: ranks whose estimate is used (settled, kept when not tried)
        return self.settled | (self.tried >= self.settings.min_samples)

    def estimate(self, prior: tuple[float, ...]) -> AcceptanceVector:
        """p̂ where a rank has enough samples; elsewhere the prior's p[k] (0 beyond its width), or with
        ``explore`` the optimistic min(Wilson upper bound, the rank before's value); sum <= 1."""
        width = max(len(prior), len(self.tried))
        p = np.zeros(width)
        p[: len(prior)] = prior
        enough = np.pad(self.enough(), (0, width - len(self.tried)))
        hat = np.pad(np.nan_to_num(self.p_hat()), (0, width - len(self.tried)))
        hi = np.pad(self.interval()[1], (0, width - len(self.tried)), constant_values=1.0)
        p[enough] = hat[enough]
        left = 1.0 - p[enough].sum()  # what the estimated ranks leave to the others
        for k in np.flatnonzero(~enough):
            guess = min(hi[k], p[k - 1] if k else 1.0) if self.settings.explore else p[k]
            p[k] = max(0.0, min(guess, left))
            left -= p[k]
        return AcceptanceVector.from_p(list(p * self.scale()))

    def scale(self) -> float:
        """What ``estimate`` multiplies every rank by so the vector sums to <= 1: 1 / (sum of the estimated
        ranks' p̂) when it exceeds 1, else 1. It can: each rank is estimated on its own nodes (rank 1 on every
        inner node, rank 2 on the nodes 2 or more wide), and the narrow nodes deep in a tree, reached after an
        acceptance, accept rank 1 more often than the wide root (a rank's p is not the same at every node, as
        the model assumes). The bound ``departs`` tests is scaled alike, so a plan made from the estimate stays
        inside it (the Wilson interval holds p̂) and the service does not re-plan again on the same counts."""
        total = float(np.nan_to_num(self.p_hat())[self.enough()].sum())
        return 1.0 / total if total > 1.0 else 1.0

    def departs(self, plan_p: tuple[float, ...]) -> bool:
        """True when ``plan_p`` lies outside the interval (scaled as ``estimate`` scales p̂) at some rank with
        enough samples."""
        lo, hi = self.interval()
        scale = self.scale()
        p = np.zeros(len(self.tried))
        p[: min(len(plan_p), len(p))] = plan_p[: len(p)]
        out = (p < lo * scale - 1e-12) | (p > hi * scale + 1e-12)  # 1e-12: Wilson bounds at p̂ = 0 or 1 come out 1e-18 off
        return bool(np.any(out & (self.tried >= self.settings.min_samples)))


# An unsettled rank's counts stop decaying once its effective trials fall below this (a settled rank's at
# min_samples). Halved forever (a rank the plan no longer tries), they would sink into the subnormals
# (< 2.2e-308), where a[k] / m[k] loses its digits (1.0 for a p̂ of 0.2) and then becomes 0 / 0. Frozen here, p̂
# keeps the value decay leaves it (decay scales a[k] and m[k] alike); a count this small weighs nothing beside
# one new trial.
FROZEN = 1e-200


class _Counts:
    def __init__(self, settings: LiveSettings) -> None:
        self.settings, self.samples = settings, 0
        self.tried, self.accepted = np.zeros(0), np.zeros(0)  # [W], grown on demand
        self.settled = np.zeros(0, dtype=bool)  # [W]
        self.keep = 2.0 ** (-1.0 / settings.half_life)
        self.blind = 0  # verdicts with no inner node since the last trial

    def add(self, children: int, rank: int) -> None:
        if children > len(self.tried):
            grow = children - len(self.tried)
            self.tried, self.accepted = np.pad(self.tried, (0, grow)), np.pad(self.accepted, (0, grow))
            self.settled = np.pad(self.settled, (0, grow))
        floor = np.where(self.settled, self.settings.min_samples, FROZEN)  # [W]; below it a rank stops decaying
        fading = self.tried >= floor
        np.multiply(self.tried, self.keep, out=self.tried, where=fading)
        np.multiply(self.accepted, self.keep, out=self.accepted, where=fading)
        self.tried[:children] += 1.0
        if rank:
            self.accepted[rank - 1] += 1.0
        self.settled |= self.tried >= self.settings.min_samples
        self.samples, self.blind = self.samples + 1, 0

    def fade(self) -> None:
        """A blind step (no inner node verified): past ``half_life`` of them in a row, every rank's counts are
        cut to min_samples x 2 ** -(blind steps beyond half_life / half_life), p̂ kept, and unsettled below
        min_samples (see the module docstring)."""
        self.blind += 1
        beyond = self.blind - self.settings.half_life
        if beyond < 0:
            return
        limit = max(FROZEN, self.settings.min_samples * self.keep ** beyond)
        cut = self.tried > limit
        self.accepted[cut] *= limit / self.tried[cut]
        self.tried[cut] = limit
        self.settled &= self.tried >= self.settings.min_samples

    def snapshot(self) -> Snapshot:
        self.settled |= self.tried >= self.settings.min_samples
        return Snapshot(self.tried.copy(), self.accepted.copy(), self.settled.copy(), self.samples, self.settings,
                        self.blind)


class LiveAcceptance:
    """Rank counts per temperature bucket (``t0.0``, ``t0.6``: the plan store's rounding), fed by verdicts."""

    def __init__(self, settings: LiveSettings = LiveSettings()) -> None:
        self.settings = settings
        self._lock = threading.Lock()
        self._counts: dict[str, _Counts] = {}

    def observe(self, temperature: float, ranks: Iterable[tuple[int, int]]) -> None:
        """``ranks``: a verdict's (children, accepted rank) per visited inner node; none: a blind step (the
        target alone), which fades the counts after ``half_life`` in a row (see the module docstring)."""
        ranks = list(ranks)
        for children, rank in ranks:
            if not 0 <= rank <= children or children < 1:
                raise ValueError(f"observation (children {children}, rank {rank}) needs 0 <= rank <= children, "
                                 "children >= 1; pass Verdict.ranks")
        name = temperature_bucket(temperature)
        with self._lock:
            if not ranks:
                if name in self._counts:  # nothing to fade before the first trial
                    self._counts[name].fade()
                return
            counts = self._counts.setdefault(name, _Counts(self.settings))
            for children, rank in ranks:
                counts.add(children, rank)

    def snapshot(self, temperature: float) -> Snapshot | None:
        with self._lock:
            counts = self._counts.get(temperature_bucket(temperature))
            return None if counts is None else counts.snapshot()

    def temperatures(self) -> list[float]:
        """The temperature buckets observed so far, as temperatures (``t0.6`` -> 0.6)."""
        with self._lock:
            return sorted(float(name[1:]) for name in self._counts)


# ---- re-planning -------------------------------------------------------------------------------------
def replan(acceptance: AcceptanceVector, current: dict[int, PlannedTree], profile: HardwareProfile | None, *,
           samples: int, max_depth: int) -> dict[int, PlannedTree]:
    """New plans for ``acceptance``, per batch bucket. With a hardware ``profile``: the DP over the profiled
    budgets and ``max_depth`` levels, and the cost model's (n, d) per bucket the profile has (with the step
    overhead recorded in the current plans, if any), except a bucket whose plan is the target alone by
    measurement (``measured_alone``), which keeps it: on this CPU the model predicted trees at batch 4 and 8
    (1.15-1.31x) that the main job's check had measured at 0.87x, and a re-plan after 403 verdicts put them
    back. Without a profile: each current bucket keeps its (n, d) budget and only the tree's shape is
    re-solved. Provenance: the current plan's, ``source="live"``, ``live_samples``."""
    base = current[min(current)].provenance
    prov = replace(base, source="live", live_samples=samples, measured_speedup=None, candidates=None,
                   prompts=None, tokens_measured=None, predicted_speedup=None)
    if profile is None:  # (a measured target-alone plan stays, as below: no profile cannot overrule it either)
        return {b: plan_for(acceptance, p.budget, p.max_depth, _for_bucket(prov, b))[0] for b, p in current.items()
                if not measured_alone(p)}
    table = solve(acceptance, max(profile.t), max_depth)
    overhead = recorded_overhead(current)
    out = {}
    for bucket, (best, _) in choose_buckets(table, profile, tuple(profile.t), overhead).items():
        if bucket in current and measured_alone(current[bucket]):
            continue  # the measurement said the target alone: the cost model's pick does not overrule it
        out[bucket] = PlannedTree(best.plan, acceptance, best.n, best.d, table.value(best.n, best.d),
                                  replace(_for_bucket(prov, bucket), predicted_speedup=best.predicted_speedup))
    return out


def _for_bucket(prov, bucket: int):
    """``prov`` (the smallest bucket's, made live) for ``bucket``'s plan: its batch is that bucket's (None = 1)."""
    return replace(prov, batch=None if bucket == 1 else bucket)


def measured_alone(planned: PlannedTree) -> bool:
    """A plan that serves the target alone because its trees were measured slower (the measured choice or the
    main job's bucket check: a root-only winner with a tree among the measured candidates)."""
    candidates = planned.provenance.candidates or []
    return planned.plan.n == 1 and any(c.get("n", 1) > 1 and c.get("measured_speedup") is not None
                                       for c in candidates)


def check(live: LiveAcceptance, temperature: float, current: dict[int, PlannedTree],
          profile: HardwareProfile | None, max_depth: int) -> dict[int, PlannedTree] | None:
    """The re-planned buckets when the served plan's vector (``compared_vector``, root row) has left the live
    estimate's bound at ``temperature``, else None: each rewritten bucket's new tree where it is worth serving
    (``worth_serving``), its served tree with the estimate as its vector (``refit``) where it is not. Also, once no
    tree has been verified there for ``half_life`` steps, the re-plan of the faded estimate when it gives a
    tree to a bucket served by the target alone by the model (see the module docstring)."""
    snap = live.snapshot(temperature)
    if snap is None or not current:
        return None
    prior = compared_vector(current).row(0)
    if snap.departs(prior):
        estimate = snap.estimate(prior)
        fresh = replan(estimate, current, profile, samples=snap.samples, max_depth=max_depth)
        worth = worth_serving(fresh, current, profile)
        kept = {b: refit(current[b], estimate, snap.samples) for b in fresh if b in current and b not in worth}
        return {**kept, **worth} or None  # none: every rewritten bucket measured to serve the target alone
    alone = [b for b, planned in current.items() if planned.plan.n == 1 and not measured_alone(planned)]
    if not alone or snap.blind < snap.settings.half_life:
        return None
    fresh = replan(snap.estimate(prior), current, profile, samples=snap.samples, max_depth=max_depth)
    return fresh if any(b in fresh and fresh[b].plan.n > 1 for b in alone) else None


def refit(planned: PlannedTree, acceptance: AcceptanceVector, samples: int) -> PlannedTree:
    """``planned``'s tree with ``acceptance`` (the live estimate) as its vector: what a bucket serves when the
    estimate has left the served vector's bound but its re-planned tree is not worth serving (the same tree,
    or one within ``MIN_GAIN``). The served vector kept the rejected numbers: every check re-ran the DP and
    found the same, and what reads the vector used them (the dynamic-tree thresholds 15% high, request trees'
    prior, /v1/models; a review's case: p[1] 0.60 served, 0.52 live). Served in place, never published
    (``PlanProvider.adopt``): the tree is the store's, and two replicas' estimates would publish in turn."""
    return replace(planned, acceptance=acceptance, expected_tokens=expected_tokens(planned.plan, acceptance),
                   provenance=replace(planned.provenance, source="live", live_samples=samples))


MIN_GAIN = 0.01  # a re-plan serves a bucket's new tree only when worth this much more than the one served


def worth_serving(fresh: dict[int, PlannedTree], current: dict[int, PlannedTree], profile: HardwareProfile | None
                  ) -> dict[int, PlannedTree]:
    """The buckets of ``fresh`` whose plan, under its own (the estimated) vector, is worth more than ``MIN_GAIN``
    over the plan served there now: tokens a step without a profile (a re-plan then keeps each bucket's n and
    d), tokens per step time with one; a bucket not served yet, or a plan the profile cannot price, is taken."""
    overhead = recorded_overhead(current) if current else NO_OVERHEAD
    out = {}
    for bucket, planned in fresh.items():
        served = current.get(bucket)
        new = _worth(planned.plan, planned.acceptance, profile, bucket, overhead)
        old = None if served is None else _worth(served.plan, planned.acceptance, profile, bucket, overhead)
        if new is None or old is None or new > (1 + MIN_GAIN) * old:
            out[bucket] = planned
    return out


def _worth(plan, acceptance: AcceptanceVector, profile: HardwareProfile | None, batch: int,
           overhead: StepOverhead) -> float | None:
    tokens = expected_tokens(plan, acceptance)
    if profile is None:
        return tokens
    carried = carried_leaf(plan, acceptance)
    if not profile.can_cost(plan, batch, carried):
        return None
    return tokens / profile.step_cost(plan, batch, overhead, carried)


def recorded_overhead(current: dict[int, PlannedTree]) -> StepOverhead:
    """The step overhead the smallest bucket's plan recorded (none: ``NO_OVERHEAD``), which prices a re-plan."""
    base = current[min(current)].provenance.overhead
    return StepOverhead.from_dict(base) if base else NO_OVERHEAD


def compared_vector(current: dict[int, PlannedTree]) -> AcceptanceVector:
    """The vector ``check`` holds against the live estimate: the smallest bucket's that a re-plan rewrites.
    A bucket served by the target alone by measurement (``measured_alone``) keeps its plan and its old vector
    through every re-plan; compared with it, the estimate would stay outside the bound and every check would
    re-plan and publish again on the same counts. When every bucket is such, the smallest one's."""
    rewritten = [b for b, planned in current.items() if not measured_alone(planned)]
    return current[min(rewritten or current)].acceptance
