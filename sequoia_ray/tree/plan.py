"""Tree plans: the fixed shape of the token tree the draft grows and the target verifies in one pass.

Node 0 is the root (the last committed token); nodes are in breadth-first order and the children of a
node are in *rank* order (rank k = the k-th token drawn without replacement at that node). ``depth`` counts
from the root (depth 0); a plan's ``num_levels`` counts levels including the root, so a chain of L draft
tokens has L + 1 levels. F(T) = sum over nodes of the product of p along the node's path = the expected
number of tokens one target call yields (accepted draft tokens + one bonus/residual token).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property, lru_cache

import numpy as np

from sequoia_ray.tree.acceptance_vector import AcceptanceVector

# The largest tree a plan file, a profile or a profiling job may name: files from a shared store are read by
# serving, whose DP runs on their sizes (1,024 nodes, 64 levels: 0.17 s here; 4,096: 1.4 s and growing).
MAX_PLAN_NODES = 1024
MAX_PLAN_DEPTH = 128


class PlanError(ValueError):
    """A tree that is not a valid breadth-first, rank-ordered plan."""


@dataclass(frozen=True)
class TreePlan:
    parents: tuple[int, ...]  # [n]; parents[0] == -1, parents[i] < i

    def __post_init__(self) -> None:
        object.__setattr__(self, "parents", tuple(int(x) for x in self.parents))
        _validate_parents(self.parents)

    @property
    def n(self) -> int:
        return len(self.parents)

    @cached_property
    def depth(self) -> tuple[int, ...]:  # [n]; root = 0
        out = [0] * self.n
        for i in range(1, self.n):
            out[i] = out[self.parents[i]] + 1
        return tuple(out)

    @cached_property
    def rank(self) -> tuple[int, ...]:  # [n]; 1-based rank among siblings, root = 0
        out, seen = [0] * self.n, [0] * self.n
        for i in range(1, self.n):
            seen[self.parents[i]] += 1
            out[i] = seen[self.parents[i]]
        return tuple(out)

    @cached_property
    def children(self) -> tuple[tuple[int, ...], ...]:  # [n] -> child ids in rank order
        out: list[list[int]] = [[] for _ in range(self.n)]
        for i in range(1, self.n):
            out[self.parents[i]].append(i)
        return tuple(tuple(c) for c in out)

    @property
    def num_levels(self) -> int:
        return self.depth[-1] + 1

    @cached_property
    def levels(self) -> tuple[tuple[int, ...], ...]:  # [num_levels] -> node ids at that depth
        out: list[list[int]] = [[] for _ in range(self.num_levels)]
        for i, d in enumerate(self.depth):
            out[d].append(i)
        return tuple(tuple(x) for x in out)

    def ancestor_mask(self) -> np.ndarray:  # [n, n] bool, True = node i may attend to node j
        """mask[i, j] is True iff j is i or an ancestor of i (the tree attention pattern). A fresh copy."""
        return self._mask.copy()

    @cached_property
    def _mask(self) -> np.ndarray:
        mask = np.zeros((self.n, self.n), dtype=bool)
        for i in range(self.n):
            if i:
                mask[i] = mask[self.parents[i]]
            mask[i, i] = True
        return mask

    def path(self, node: int) -> tuple[int, ...]:
        """Node ids from the root to ``node``, inclusive."""
        out = [node]
        while self.parents[out[-1]] >= 0:
            out.append(self.parents[out[-1]])
        return tuple(reversed(out))


def _validate_parents(parents: tuple[int, ...]) -> None:
    if not parents or parents[0] != -1:
        raise PlanError(f"parents[0] must be -1 (the root), got {parents[:1]}")
    for i in range(1, len(parents)):
        p = parents[i]
        if not 0 <= p < i:
            raise PlanError(f"parents[{i}] = {p}: a parent must come before its child (0 <= parent < {i})")
        if p < parents[i - 1]:
            raise PlanError(
                f"parents[{i}] = {p} < parents[{i - 1}] = {parents[i - 1]}: nodes must be in breadth-first order"
            )


def reach(plan: TreePlan, acceptance: AcceptanceVector) -> np.ndarray:  # [n] float64
    """The probability that each node is accepted (the root's: 1) if the draft follows ``acceptance``."""
    value = np.zeros(plan.n)
    value[0] = 1.0
    for i in range(1, plan.n):
        parent = plan.parents[i]
        row = acceptance.row(plan.depth[parent])
        k = plan.rank[i]
        value[i] = value[parent] * (row[k - 1] if k <= len(row) else 0.0)
    return value


def expected_tokens(plan: TreePlan, acceptance: AcceptanceVector) -> float:
    """F(T): expected tokens per target call (accepted + bonus) if the draft follows ``acceptance``."""
    return float(np.sum(reach(plan, acceptance)))


def carried_leaf(plan: TreePlan, acceptance: AcceptanceVector) -> float:
    """Expected tokens a request's next draft step forwards beside its new root: the accepted path's last node
    when that is a leaf of ``plan``. The draft forwards only inner nodes while it grows a tree, so an accepted
    inner node's K/V are cached and an accepted leaf's are not: the probability that the path ends at a leaf
    below the root (0 for the root-only tree, which runs no draft). Exact for a static tree in steady state;
    not counted: a dynamic tree's pruned nodes and extension leaves (more unforwarded leaves than the plan's),
    and what a request carries after steps of the target alone (its first step, a failed draft, a switch of the
    live cost), which the draft forwards all at once in its next tree step."""
    if plan.n == 1:
        return 0.0
    value = reach(plan, acceptance)
    return float(sum(value[i] for i in range(1, plan.n) if not plan.children[i]))


# ---- builders and baselines ------------------------------------------------------------------
def from_child_counts(count: Callable[[int, int], int], max_levels: int) -> TreePlan:
    """Breadth-first tree where a node at ``depth`` with ``rank`` gets ``count(depth, rank)`` children."""
    parents, depth, rank = [-1], [0], [0]
    i = 0
    while i < len(parents):
        if depth[i] + 1 < max_levels:
            for k in range(1, count(depth[i], rank[i]) + 1):
                parents.append(i)
                depth.append(depth[i] + 1)
                rank.append(k)
        i += 1
    return TreePlan(tuple(parents))


def from_nested(tree: list) -> TreePlan:
    """A tree given as nested child lists (``[]`` = a leaf; ``[[], [[]]]`` = root with two children)."""
    parents, queue = [-1], [(0, tree)]
    for node_id, children in queue:
        for child in children:
            parents.append(node_id)
            queue.append((len(parents) - 1, child))
    return TreePlan(tuple(parents))


def chain(length: int) -> TreePlan:
    """Root plus a chain of ``length`` draft tokens (classic speculative decoding)."""
    _check_at_least(0, length=length)  # chain(0): the root alone
    return from_child_counts(lambda d, r: 1, max_levels=length + 1)


def specinfer(k: int, length: int) -> TreePlan:
    """SpecInfer's k×L: k independent chains of ``length`` tokens below the root."""
    _check_positive(k=k, length=length)
    return from_child_counts(lambda d, r: k if d == 0 else 1, max_levels=length + 1)


def k_ary(k: int, levels_below_root: int) -> TreePlan:
    """Full k-ary tree with ``levels_below_root`` levels under the root."""
    _check_positive(k=k)
    _check_at_least(0, levels_below_root=levels_below_root)  # 0: the root alone
    return from_child_counts(lambda d, r: k, max_levels=levels_below_root + 1)


def _check_positive(**values: int) -> None:
    _check_at_least(1, **values)


def _check_at_least(least: int, **values: int) -> None:
    """PlanError naming the argument as passed (not a derived count) when it is below ``least``."""
    for name, v in values.items():
        if v < least:
            raise PlanError(f"{name} = {v} must be >= {least}")


@lru_cache(maxsize=256)
def first_levels(plan: TreePlan, levels: int) -> TreePlan:
    """The sub-tree of ``plan``'s first ``levels`` levels (a prefix of the breadth-first node order)."""
    if levels >= plan.num_levels:
        return plan
    _check_positive(levels=levels)
    return TreePlan(plan.parents[: sum(len(x) for x in plan.levels[:levels])])
