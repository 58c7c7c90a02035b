"""The Sequoia dynamic program: acceptance vector p -> best tree of n nodes and at most d levels.

G(n, d) is the largest F(T) over trees T with at most n nodes and at most d levels (root included), where
F(T) = 1 + sum over children c of the root of p[rank(c)] * F(subtree(c)) — the expected tokens of one
target call, bonus included (a root-only tree is worth 1).

Recurrence. A subtree rooted at depth j with r levels and n nodes is worth ``V[j, r](n) = 1 + T_1(n - 1)``,
where T_b(m) is the best value of children ranked b, b+1, ... sharing m nodes (children are contiguous in
rank: child b exists only if child b - 1 does)::

    T_b(m) = max(0, max_{1 <= s <= m} p_j[b] * V[j+1, r-1](s) + T_{b+1}(m - s)),   T_{W+1} = 0.

For each (j, r) the sweep over b is a max-plus convolution, done as one vectorised [rows, s] array.

Skipped cells. When p is non-increasing (the usual case), an exchange argument shows some optimal tree
gives lower-ranked children no smaller subtrees (swapping sizes of ranks a < b changes F by
(p[a] - p[b]) (V(s_b) - V(s_a)) >= 0). So the child of rank b has at most (N - 1) // b nodes and the
children ranked b.. share at most N - b nodes: about N^2 * H_W cells per (j, r) instead of N^2 * W.
Unsorted vectors use the full range (exact either way).

Depth-indexed p (one row per parent depth, the last row repeating): V depends on (min(j, L - 1), r), so
the table costs L times the flat one. ``max_depth=None`` means unbounded: levels are added until V stops
changing (a tree of n nodes never needs more than n levels).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from sequoia_ray.tree.acceptance_vector import AcceptanceVector
from sequoia_ray.tree.plan import TreePlan, from_nested


class DPError(ValueError):
    """A budget or depth the DP cannot serve; the message names the value and the fix."""


@dataclass(frozen=True)
class _Sweep:
    value: np.ndarray  # [N + 1] float64; V(n) for n = 0..N (V(0) = 0)
    choice: np.ndarray  # [W, N] int32; choice[b-1, m] = size of child b given m nodes left, 0 = stop


@dataclass(frozen=True)
class DPTable:
    """G(n, d) for every n <= max_nodes and d <= max_depth, with what is needed to rebuild each tree."""

    acceptance: AcceptanceVector
    max_nodes: int
    max_depth: int  # columns d = 1..max_depth; for an unbounded DP, the depth at which G stopped changing
    unbounded: bool
    G: np.ndarray  # [max_nodes + 1, max_depth + 1] float64; G[n, d]; row 0 and column 0 are 0
    _sweeps: dict[tuple[int, int], _Sweep] = field(repr=False)

    def value(self, n: int, d: int | None = None) -> float:
        n, d = self._check(n, d)
        return float(self.G[n, d])

    def tree(self, n: int, d: int | None = None) -> TreePlan:
        """The optimal tree for budget n and depth d (``None`` = the deepest the table holds)."""
        n, d = self._check(n, d)
        return from_nested(self._nested(0, d, n))

    def _nested(self, j: int, r: int, n: int) -> list:
        children: list = []
        if r <= 1 or n <= 1:
            return children
        sweep = self._sweeps[(self._row(j), r)]
        left = n - 1
        for b in range(1, sweep.choice.shape[0] + 1):
            s = int(sweep.choice[b - 1, left]) if left < sweep.choice.shape[1] else 0
            if s == 0:
                break
            children.append(self._nested(j + 1, r - 1, s))
            left -= s
        return children

    def _row(self, j: int) -> int:
        return min(j, len(self.acceptance.rows) - 1)

    def _check(self, n: int, d: int | None) -> tuple[int, int]:
        d = self.max_depth if d is None else d
        if not 1 <= n <= self.max_nodes:
            raise DPError(f"budget n = {n} is outside 1..{self.max_nodes}; rebuild the table with max_nodes >= {n}")
        if d < 1:
            raise DPError(f"depth d = {d} must be >= 1 (levels, root included)")
        return n, min(d, self.max_depth) if self.unbounded else self._in_range(d)

    def _in_range(self, d: int) -> int:
        if d > self.max_depth:
            raise DPError(f"depth d = {d} > table depth {self.max_depth}; rebuild with max_depth >= {d}")
        return d


def solve(acceptance: AcceptanceVector, max_nodes: int, max_depth: int | None = None) -> DPTable:
    """G(n, d) for n = 1..max_nodes, d = 1..max_depth (None: unbounded depth)."""
    if not isinstance(max_nodes, int) or max_nodes < 1:
        raise DPError(f"max_nodes = {max_nodes!r} must be an integer >= 1")
    if max_depth is not None and (not isinstance(max_depth, int) or max_depth < 1):
        raise DPError(f"max_depth = {max_depth!r} must be an integer >= 1 or None (unbounded)")
    sorted_p = acceptance.is_non_increasing()
    limit = max_nodes if max_depth is None else max_depth
    sweeps: dict[tuple[int, int], _Sweep] = {}
    columns = [np.zeros(max_nodes + 1)]
    for r in range(1, limit + 1):
        for j in reversed(range(len(acceptance.rows))):
            sweeps[(j, r)] = _level(acceptance, j, r, max_nodes, sweeps, sorted_p)
        columns.append(sweeps[(0, r)].value)
        if max_depth is None and r > 1 and _converged(sweeps, r, len(acceptance.rows)):
            break
    G = np.stack(columns, axis=1)
    return DPTable(acceptance, max_nodes, G.shape[1] - 1, max_depth is None, G, sweeps)


def _converged(sweeps: dict[tuple[int, int], _Sweep], r: int, n_rows: int) -> bool:
    return all(np.array_equal(sweeps[(j, r)].value, sweeps[(j, r - 1)].value) for j in range(n_rows))


def _level(
    acceptance: AcceptanceVector, j: int, r: int, max_nodes: int, sweeps: dict, sorted_p: bool
) -> _Sweep:
    """V[j, r]: the best subtree rooted at depth class j with at most r levels, for every size."""
    width = acceptance.width
    value = np.ones(max_nodes + 1)
    value[0] = 0.0
    if r == 1:
        return _Sweep(value, np.zeros((width, max_nodes), dtype=np.int32))
    child = sweeps[(min(j + 1, len(acceptance.rows) - 1), r - 1)].value
    best, choice = _children_sweep(np.asarray(acceptance.row(j)), child, max_nodes, sorted_p)
    value[1:] = 1.0 + best
    return _Sweep(value, choice)


def _children_sweep(
    p: np.ndarray,  # [W] acceptance row for this parent depth
    child: np.ndarray,  # [N + 1] value of a child subtree by its size (child[0] unused)
    max_nodes: int,
    sorted_p: bool,
) -> tuple[np.ndarray, np.ndarray]:  # T_1 over m = 0..N-1 [N]; choice [W, N] int32
    n_left = max_nodes - 1  # nodes below the root
    width = len(p)
    choice = np.zeros((width, max_nodes), dtype=np.int32)
    nxt = np.zeros(max(n_left - width + 1, 0) + 1)  # T_{W+1}(m) = 0
    for b in range(width, 0, -1):
        rows = n_left - (b - 1) + 1  # children b.. share m <= N - b nodes: m = 0..N-b
        if rows <= 0:
            continue
        cap = max(rows - 1, 0) if not sorted_p else min(rows - 1, n_left // b)
        nxt = _pad_to(nxt, rows)
        if cap == 0:
            nxt = nxt[:rows].copy() * 0.0
            continue
        nxt, choice[b - 1, :rows] = _max_plus(p[b - 1] * child[1 : cap + 1], nxt, rows)
    return _pad_to(nxt, max_nodes), choice


def _max_plus(
    gain: np.ndarray,  # [cap] p_b * V(s) for s = 1..cap
    nxt: np.ndarray,  # [>= rows] T_{b+1}(m)
    rows: int,
) -> tuple[np.ndarray, np.ndarray]:  # T_b(m) [rows], best s or 0 [rows]
    """T_b(m) = max(0, max_s gain[s] + T_{b+1}(m - s)) for m = 0..rows-1, as one vectorised array."""
    cap = len(gain)
    padded = np.concatenate([np.full(cap, -np.inf), nxt[: rows - 1]])
    window = sliding_window_view(padded, cap)[:rows, ::-1]  # [rows, cap]; window[m, s-1] = T_{b+1}(m - s)
    total = window + gain
    arg = np.argmax(total, axis=1)
    best = total[np.arange(rows), arg]
    take = best > 0.0
    return np.where(take, best, 0.0), np.where(take, arg + 1, 0).astype(np.int32)


def _pad_to(x: np.ndarray, length: int) -> np.ndarray:
    """Extend a non-decreasing T by its last value (more nodes never hurt: T is 'at most m nodes')."""
    if len(x) >= length:
        return x
    return np.concatenate([x, np.full(length - len(x), x[-1] if len(x) else 0.0)])
