"""A tree per request: each request's own acceptance picks its tree from a family the cost model solved.

Why. One plan per temperature bucket serves every request. But code and prose differ: at T = 0 with the
default pair, p[1] is 0.945 on code and 0.64 on prose. So the best fixed tree differs too: n = 16, d = 12 on
code against n = 8, d = 6 on prose (``benchmarks/e2e.py``). The pooled plan is n = 8, d = 4, and it reached
0.70x / 0.75x of those. A request shows which kind it is after a few steps.

How. Per request, p̂[1] = (w·p[1] + a) / (w + m): the served vector's p[1] as a prior worth ``prior_weight``
trials, plus the request's own trials. m counts the visited inner nodes (every one is a fair trial for rank
1, whatever its width, see ``live_acceptance``) and a those that accepted rank 1. The request's vector is
the served one *tilted* to p[1] = q: p'[1] = q, and every other rank and the reject mass are scaled by
(1 - q) / (1 - p[1]). So what happens after rank 1 is rejected keeps the served vector's law. q is p̂[1]
rounded to a ``grid`` step. For each (q, batch bucket) the tree is what the cost model picks for the
tilted vector at that batch size: the DP (``solve``), then ``hardware.choose`` with the profile, its budgets
and the served plan's overhead. It is solved once, on first use (~5 ms here), and cached. Until a request
has ``min_trials`` trials of its own, and without a profile, it gets the served plan; so does every request
of a batch in a bucket above ``max_batch``. In a batch, one request's deeper tree makes every request wait
for its extra draft levels (the draft forwards one level of all the batch's trees at a time), and the step
cost the cost model charges it does not see that: in process at batch 1 (``benchmarks/e2e.py``, session 24)
a tree per request on top of the shipped dynamic trees gave 1.00-1.18x on 4 rows, through Serve at 8
clients 0.98x against 1.02x without (another run).

A request whose p̂[1] makes the cost model pick the target alone (the root-only tree) sees no more trials: its
estimate would stay where it was for the rest of the request, though its text may turn predictable (prose, then
code). Each such step fades its counts by ``FADE`` until it has fewer than ``min_trials`` again and gets the
served plan, whose steps measure it afresh: a probe about every 11 steps after 12 trials.

Exactness. A step's tree is a function of the request's earlier verdicts only, and the verifier is exact
for any tree. So the output is the target's (greedy) or has the target's law (sampled), as with any plan.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable

from sequoia_ray.config import SamplingParams
from sequoia_ray.engine import StepPolicy
from sequoia_ray.hardware import NO_OVERHEAD, HardwareProfile, StepOverhead, batch_bucket, choose
from sequoia_ray.tree.acceptance_vector import AcceptanceVector
from sequoia_ray.tree.dp import solve
from sequoia_ray.tree.plan import TreePlan
from sequoia_ray.tree.plan_file import PlannedTree
from sequoia_ray.verify import Verdict


def tilt(p: tuple[float, ...], q: float) -> AcceptanceVector:
    """``p`` with p[1] moved to ``q``: the other ranks and the reject mass scaled by (1 - q) / (1 - p[1]). A
    vector whose sum is above 1 by round-off (``AcceptanceVector`` allows 1e-6) is scaled by (1 - q) / sum(p[2:])
    instead, so the tilted one sums to 1: scaled by 1 / (1 - p[1]), p = (0.95, 0.0500001) tilted to 0.2 summed
    to 1.0000016 and was refused."""
    if not 0.0 <= q < 1.0:
        raise ValueError(f"q {q} must be in [0, 1)")
    rest = 1.0 - p[0]
    scale = (1.0 - q) / max(rest, math.fsum(p[1:])) if rest > 0 else 0.0  # after rank 1: its law, mass 1 - q
    others = tuple(x * scale for x in p[1:])
    return AcceptanceVector.from_p((q, *others), max(0.0, 1.0 - q - math.fsum(others)))


class RequestTrees:
    """The family of trees for one temperature bucket's served plan (see the module docstring)."""

    def __init__(self, planned: PlannedTree, profile: HardwareProfile | None, *, max_depth: int = 12,
                 grid: float = 0.05, prior_weight: float = 4.0, min_trials: int = 4, max_batch: int | None = None
                 ) -> None:
        if not 0 < grid <= 0.5:
            raise ValueError(f"grid {grid} must be in (0, 0.5]")
        if prior_weight < 0 or min_trials < 0:
            raise ValueError(f"prior_weight {prior_weight} and min_trials {min_trials} must be >= 0")
        if max_batch is not None and max_batch < 1:
            raise ValueError(f"max_batch {max_batch} must be >= 1 (None: every batch size)")
        self.planned, self.profile, self.max_depth, self.max_batch = planned, profile, max_depth, max_batch
        self.grid, self.prior_weight, self.min_trials = grid, prior_weight, min_trials
        self._top = int(1.0 / grid)  # the largest step whose q = step * grid is below 1 (tilt needs q < 1)
        while self._top * grid >= 1.0:
            self._top -= 1
        self.p = planned.acceptance.row(0)
        overhead = planned.provenance.overhead
        self.overhead = StepOverhead.from_dict(overhead) if overhead else NO_OVERHEAD
        self._trees: dict[tuple[int, int], TreePlan] = {}
        self._lock = threading.Lock()

    def level(self, accepted: float, trials: float) -> int:
        """The grid step of p̂[1] (an int: q = level * grid) for ``accepted`` of ``trials`` rank-1 trials."""
        weight = self.prior_weight + trials
        q = (self.prior_weight * self.p[0] + accepted) / weight if weight else self.p[0]  # nothing seen: the prior
        return min(self._top, max(0, int(round(q / self.grid))))

    def tree(self, level: int, batch: int) -> TreePlan:
        """The cost model's tree for p[1] = level * grid at ``batch`` requests per step (cached)."""
        key = (level, batch_bucket(batch, self.profile.buckets()))
        with self._lock:
            found = self._trees.get(key)
            if found is None:
                vector = tilt(self.p, level * self.grid)
                table = solve(vector, max(self.profile.t), self.max_depth)
                best, _ = choose(table, self.profile, tuple(self.profile.t), key[1], self.overhead)
                found = self._trees[key] = best.plan
            return found

    def policy(self, params: SamplingParams, batch: Callable[[], int] = lambda: 1) -> StepPolicy:
        """A request's step policy (``SpeculativeDecoder(policy=...)``)."""
        return _RequestTree(self, batch)


FADE = 0.9  # a step on the target alone the request's own tree chose: its counts x FADE (see the docstring)


class _RequestTree:
    def __init__(self, trees: RequestTrees, batch: Callable[[], int]) -> None:
        self.trees, self.batch = trees, batch
        self.accepted = self.trials = 0.0
        self.alone = False  # the last plan was the target alone, chosen for this request's p̂[1]

    def plan(self, base: TreePlan) -> TreePlan:
        self.alone = False
        if self.trees.profile is None or self.trials < self.trees.min_trials or base.n <= 1:
            return base  # not enough of its own yet; or no cost model; or the target alone was chosen
        batch = max(1, self.batch())
        if self.trees.max_batch is not None and batch_bucket(batch, self.trees.profile.buckets()) > self.trees.max_batch:
            return base  # a batch this large: the bucket's plan (one request's deeper tree would hold up the rest)
        chosen = self.trees.tree(self.trees.level(self.accepted, self.trials), batch)
        self.alone = chosen.n <= 1
        return chosen

    def observe(self, plan: TreePlan, verdict: Verdict, seconds: float) -> None:
        if self.alone and not verdict.ranks:  # no trial: the estimate fades until the served plan probes again
            self.accepted, self.trials = self.accepted * FADE, self.trials * FADE
        for _children, rank in verdict.ranks:
            self.trials += 1
            self.accepted += rank == 1
