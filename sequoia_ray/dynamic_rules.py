"""The cost model's rule for dynamic trees: what a node and a draft level must be worth in the tree a step grows.

``DynamicTrees.from_cost_model`` turns a tree's expected tokens G, its step cost S, the cost delta of one more
tree token and the cost c of one more draft level into the draft's thresholds (see ``sequoia_ray/draft.py``).
``DynamicRules`` reads them off a hardware profile, for the tree a step grows, at the batch size it runs in
(every cost in target steps, as the profile's):
- B·G / S_B is the batch's tokens per target step, with S_B = ``profile.step_cost(plan, B, overhead)``: a
  node worth g tokens pays iff g / delta_B > B·G / S_B;
- delta_B = T_B(B·n + 1) - T_B(B·n): one more token in the batch's target forward (the profile's slope there);
- c_B = C_B(B) / B: a request's share of a draft forward one node wide in each request;
- a level beyond the plan's depth (``extend``) costs c(1), a whole draft forward of one node: only the
  requests extending run it, while the batch's other requests wait for it (so at B > 1 a node there must be
  worth about B times what it must be worth alone).
  Measured through Serve at 8 clients (session 38, static trees against the same with ``extend`` 4 priced at
  c_B, every step a tree): the draft's time a step 82 against 168 ms, 0.80x the throughput.
At B = 1 these are G / S, t(n + 1) - t(n) and c(1). A rule is computed once per (acceptance vector, overhead,
tree, batch bucket) and cached (the ``MAX_RULES`` most recently used: live re-plans bring new vectors). The
verifier is exact for any grown tree, so a rule only moves speed.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable

from sequoia_ray.draft import DynamicTrees
from sequoia_ray.hardware import NO_OVERHEAD, HardwareProfile, ProfileError, StepOverhead, batch_bucket
from sequoia_ray.tree.acceptance_vector import AcceptanceVector
from sequoia_ray.tree.plan import TreePlan, carried_leaf, expected_tokens
from sequoia_ray.tree.plan_file import PlannedTree

MAX_EXTEND = 16
MAX_RULES = 1024  # cached rules (a few trees per bucket and temperature; each live re-plan adds its own)
logger = logging.getLogger(__name__)


class DynamicRules:
    """Rules for the trees of one hardware ``profile``; ``extend``: levels a confident path may grow beyond
    its plan (0: prune only)."""

    def __init__(self, profile: HardwareProfile, *, extend: int = 0) -> None:
        if not 0 <= extend <= MAX_EXTEND:
            raise ValueError(f"extend {extend} must be in [0, {MAX_EXTEND}] (levels beyond the plan's depth)")
        self.profile, self.extend = profile, extend
        self._rules: OrderedDict[tuple, DynamicTrees | None] = OrderedDict()  # least recently used first
        self._lock = threading.Lock()

    def rule(self, plan: TreePlan, batch: int, acceptance: AcceptanceVector,
             overhead: StepOverhead = NO_OVERHEAD) -> DynamicTrees | None:
        """The rule for growing ``plan`` in a batch of ``batch`` requests; None for the root-only tree and for a
        tree the profile cannot cost (more tokens than it timed: the plan's tree as it is)."""
        if plan.n <= 1:
            return None
        bucket = batch_bucket(max(1, batch), self.profile.buckets())
        key = (plan, bucket, acceptance, overhead)
        with self._lock:
            if key in self._rules:
                self._rules.move_to_end(key)
                return self._rules[key]
            rule = self._rules[key] = self._solve(plan, bucket, acceptance, overhead)
            if len(self._rules) > MAX_RULES:
                self._rules.popitem(last=False)
            return rule

    def of(self, plan: TreePlan, batch: int, planned: PlannedTree) -> DynamicTrees | None:
        """``rule`` with the acceptance vector and the step overhead of the plan served (``planned``)."""
        overhead = planned.provenance.overhead
        return self.rule(plan, batch, planned.acceptance, StepOverhead.from_dict(overhead) if overhead else NO_OVERHEAD)

    def for_planned(self, planned: PlannedTree, batch: Callable[[], int] = lambda: 1
                    ) -> Callable[[TreePlan], DynamicTrees | None]:
        """A decoder's ``dynamic``: each step's tree gets the rule for ``planned`` at the current ``batch()``."""
        return lambda plan: self.of(plan, batch(), planned)

    def _solve(self, plan: TreePlan, batch: int, acceptance: AcceptanceVector,
               overhead: StepOverhead) -> DynamicTrees | None:
        prof, tokens = self.profile, batch * plan.n
        try:
            step = prof.step_cost(plan, batch, overhead, carried_leaf(plan, acceptance))
        except ProfileError as exc:
            logger.info("no dynamic rule for a tree of %d nodes at batch %d: %s", plan.n, batch, exc)
            return None
        try:
            delta = prof.target_cost(batch, tokens + 1) - prof.target_cost(batch, tokens)
        except ProfileError:  # the tree is the largest the profile has: the slope just below it
            delta = prof.target_cost(batch, tokens) - prof.target_cost(batch, tokens - 1)
        level = prof.level_cost(batch, batch) / batch
        return DynamicTrees.from_cost_model(batch * expected_tokens(plan, acceptance), step, max(0.0, delta),
                                            level, self.extend, extend_cost=prof.level_cost(1, 1))
