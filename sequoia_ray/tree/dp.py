"""The Sequoia dynamic program: acceptance vector p -> best tree of n nodes and at most d levels.

G(n, d) is the largest F(T) over trees T with at most n nodes and at most d levels (root included), where
F(T) = 1 + sum over children c of the root of p[rank(c)] * F(subtree(c)) — the expected tokens of one
target call, bonus included (a root-only tree is worth 1).

Recurrence. A subtree rooted at depth j with r levels and n nodes is worth ``V[j, r](n) = 1 + T_1(n - 1)``,
where T_b(m) is the best value of children ranked b, b+1, ... sharing m nodes (children are contiguous in
rank: child b exists only if child b - 1 does)::

    T_b(m) = max(0, max_{1 <= s <= m} p_j[b] * V[j+1, r-1](s) + T_{b+1}(m - s)),   T_{W+1} = 0.

For each (j, r) the sweep over b is a max-plus convolution, done in vectorised blocks of rows.

Skipped cells, for any p (exact). Fix a node whose children are ranks 1..k. Swapping the subtrees of
ranks a and b changes F by (p[a] - p[b]) (V(s_b) - V(s_a)), so some optimal tree gives its children sizes
in the order of p: p[a] > p[b] => s_a >= s_b (ties: the lower rank gets the larger subtree). Every node
of that tree obeys, for child b with m nodes left for ranks b..:
  - the c_b - 1 lower ranks a < b with p[a] >= p[b] each hold >= s_b nodes and the other lower ranks >= 1,
    so s_b <= (N - 1 - m - (b - c_b)) / (c_b - 1), where c_b = 1 + #{a < b : p[a] >= p[b]};
  - if p[b+1] > p[b], either b is the last child (s_b = m) or s_{b+1} >= s_b, so s_b <= m / 2;
  - s_b <= the smallest size at which V(s) reaches its maximum (more nodes add nothing);
  - children b.. share m <= N - b nodes (ranks 1..b-1 hold >= 1 each).
For a non-increasing p this is s_b <= min(m, (N - 1 - m) / (b - 1)): about N^2 H_W / 2 cells per (j, r)
instead of N^2 W / 2; for an unsorted p the cost grows only where p has inversions. Tree reconstruction
recomputes each child's argmax over all s <= m from the stored T rows, so it never depends on the bounds.
Each block of rows is a view of T_{b+1} (no copy), reduced along whichever axis is longer.

Depth-indexed p (one row per parent depth, the last row repeating): V depends on (min(j, L - 1), r), so
the table costs L times the flat one. Ranks past N - 1 and rows past D - 1 are never used by a tree of N
nodes and D levels and are dropped first (``_usable``), so a vector's width and rows cost at most that.
``max_depth=None`` means unbounded: levels are added until V stops changing (a tree of n nodes never needs
more than n levels).
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass, field

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from sequoia_ray.tree.acceptance_vector import AcceptanceVector
from sequoia_ray.tree.plan import TreePlan

BLOCK_CELLS = 1 << 16  # cells per vectorised block: big enough to hide numpy's per-call cost, small for cache


class DPError(ValueError):
    """A budget or depth the DP cannot serve; the message names the value and the fix."""


@dataclass(frozen=True)
class _Level:
    value: np.ndarray  # [N + 1] float64; V(n) for n = 0..N (V(0) = 0)
    suffix: np.ndarray  # [W + 1, N] float64; suffix[b-1, m] = T_b(m); row W is T_{W+1} = 0


@dataclass(frozen=True)
class _RankBounds:
    """Where child b looks: rows m = 0..rows-1 of T_b, cut into blocks of rows with their largest s_b."""

    rows: int
    widest: int  # the largest s_b over all rows
    blocks: tuple[tuple[int, int, int], ...]  # (m0, m1, hi): rows m0..m1-1 try s_b = 1..hi
    last_may_take_all: bool  # the bound m / 2 applies: add the candidate s_b = m (b is the last child)


@dataclass(frozen=True)
class DPTable:
    """G(n, d) for every n <= max_nodes and d <= max_depth, with what is needed to rebuild each tree."""

    acceptance: AcceptanceVector
    max_nodes: int
    max_depth: int  # columns d = 1..max_depth; for an unbounded DP, the depth at which G stopped changing
    unbounded: bool
    G: np.ndarray  # [max_nodes + 1, max_depth + 1] float64; G[n, d]; row 0 and column 0 are 0
    _levels: dict[tuple[int, int], _Level] = field(repr=False)
    _used: AcceptanceVector = field(repr=False)  # ``acceptance`` cut to what the table's trees can use (``_usable``)

    def value(self, n: int, d: int | None = None) -> float:
        n, d = self._check(n, d)
        return float(self.G[n, d])

    def tree(self, n: int, d: int | None = None) -> TreePlan:
        """The optimal tree for budget n and depth d (``None`` = the deepest the table holds)."""
        n, d = self._check(n, d)
        # breadth-first, as plan.from_nested numbers nodes; a queue, not recursion: an optimal tree may be a
        # chain of ~1,000 levels (p[1] near 1, no depth limit), past Python's recursion limit
        parents, queue = [-1], [(0, d, n)]  # queue[i]: node i's depth, levels left (its own included), nodes
        for node, (j, r, size) in enumerate(queue):  # the loop reads the children appended below too
            for s in self._child_sizes(j, r, size):
                parents.append(node)
                queue.append((j + 1, r - 1, s))
        return TreePlan(tuple(parents))

    def _child_sizes(self, j: int, r: int, n: int) -> list[int]:
        """The subtree sizes of the optimal children, in rank order, of a node at depth j with r levels and n
        nodes (itself included)."""
        sizes: list[int] = []
        if r <= 1 or n <= 1:
            return sizes
        suffix = self._levels[(self._row(j), r)].suffix
        child = self._levels[(self._row(j + 1), r - 1)].value
        p = self._used.row(j)
        left = n - 1
        for b in range(1, len(p) + 1):
            if left <= 0 or suffix[b - 1, left] <= 0.0:
                break
            sizes.append(_best_size(p[b - 1], child, suffix[b], left))
            left -= sizes[-1]
        return sizes

    def _row(self, j: int) -> int:
        return min(j, len(self._used.rows) - 1)

    def _check(self, n: int, d: int | None) -> tuple[int, int]:
        d = self.max_depth if d is None else d
        for name, v in (("budget n", n), ("depth d", d)):
            if not _integer(v):  # 4.0 or 2.5 would reach numpy's indexing: a bare IndexError
                raise DPError(f"{name} = {v!r} must be an integer")
        n, d = int(n), int(d)
        if not 1 <= n <= self.max_nodes:
            raise DPError(f"budget n = {n} is outside 1..{self.max_nodes}; rebuild the table with max_nodes >= {n}")
        if d < 1:
            raise DPError(f"depth d = {d} must be >= 1 (levels, root included)")
        return n, min(d, self.max_depth) if self.unbounded else self._in_range(d)

    def _in_range(self, d: int) -> int:
        if d > self.max_depth:
            raise DPError(f"depth d = {d} > table depth {self.max_depth}; rebuild with max_depth >= {d}")
        return d


def _best_size(
    p_b: float,
    child: np.ndarray,  # [N + 1] V of a child subtree by size
    nxt: np.ndarray,  # [N] T_{b+1}(m)
    left: int,
) -> int:
    """The smallest s in 1..left maximising p_b V(s) + T_{b+1}(left - s)."""
    total = p_b * child[1 : left + 1] + nxt[:left][::-1]
    return int(np.argmax(total)) + 1


def solve(acceptance: AcceptanceVector, max_nodes: int, max_depth: int | None = None) -> DPTable:
    """G(n, d) for n = 1..max_nodes, d = 1..max_depth (None: unbounded depth)."""
    if not _integer(max_nodes) or max_nodes < 1:
        raise DPError(f"max_nodes = {max_nodes!r} must be an integer >= 1")
    if max_depth is not None and (not _integer(max_depth) or max_depth < 1):
        raise DPError(f"max_depth = {max_depth!r} must be an integer >= 1 or None (unbounded)")
    max_nodes, max_depth = int(max_nodes), None if max_depth is None else int(max_depth)  # numpy's ints too
    limit = max_nodes if max_depth is None else max_depth  # a tree of n nodes has at most n levels
    used = _usable(acceptance, max_nodes, limit)
    n_rows = len(used.rows)
    bounds = [_rank_bounds(np.asarray(used.rows[j]), max_nodes) for j in range(n_rows)]
    levels: dict[tuple[int, int], _Level] = {}
    columns = [np.zeros(max_nodes + 1)]
    for r in range(1, limit + 1):
        for j in reversed(range(n_rows)):
            child = levels[(min(j + 1, n_rows - 1), r - 1)].value if r > 1 else None
            levels[(j, r)] = _level(np.asarray(used.rows[j]), child, bounds[j], max_nodes)
        columns.append(levels[(0, r)].value)
        if max_depth is None and r > 1 and _converged(levels, r, n_rows):
            break
    G = np.stack(columns, axis=1)
    return DPTable(acceptance, max_nodes, G.shape[1] - 1, max_depth is None, G, levels, used)


def _integer(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _usable(acceptance: AcceptanceVector, max_nodes: int, max_levels: int) -> AcceptanceVector:
    """``acceptance`` without what no tree of ``max_nodes`` nodes and ``max_levels`` levels can use: ranks past
    max_nodes - 1 (a node has at most that many children) and rows past max_levels - 1 (row j is for the
    children of depth-j nodes, and nodes at depth max_levels - 1 are leaves). Exact, and it bounds the table:
    every level holds [W + 1, N] floats per row, so a plan file's vector 6,000 wide took 2 s and 141 MB at
    N = 256. The reject mass is not used by the DP."""
    width, rows = _usable_size(acceptance, max_nodes, max_levels)
    if acceptance.width <= width and len(acceptance.rows) <= rows:
        return acceptance
    return AcceptanceVector.from_rows([row[:width] for row in acceptance.rows[:rows]])


def _usable_size(acceptance: AcceptanceVector, max_nodes: int, max_levels: int) -> tuple[int, int]:
    """(ranks, rows) of ``acceptance`` that ``_usable`` keeps."""
    return min(acceptance.width, max(1, max_nodes - 1)), min(len(acceptance.rows), max(1, max_levels - 1))


def table_bytes(acceptance: AcceptanceVector, max_nodes: int, max_depth: int | None = None) -> int:
    """The most memory ``solve`` keeps for these sizes: per kept row and level, a [W + 1, N] suffix table and
    [N + 1] values (float64; 8.4 MB per (row, level) at W = N - 1 = 1023). An unbounded depth is counted as
    max_nodes levels, the most it can run before V stops changing (a chain at p[1] near 1 gets there)."""
    levels = max_nodes if max_depth is None else max_depth
    width, rows = _usable_size(acceptance, max_nodes, levels)
    return 8 * rows * levels * ((width + 1) * max_nodes + max_nodes + 1)


def _converged(levels: dict[tuple[int, int], _Level], r: int, n_rows: int) -> bool:
    return all(np.array_equal(levels[(j, r)].value, levels[(j, r - 1)].value) for j in range(n_rows))


def _rank_bounds(p: np.ndarray, max_nodes: int) -> list[_RankBounds]:  # p: [W]; one entry per rank b
    """The exchange-argument bounds of the module docstring, for each rank b = 1..W."""
    out = []
    for b in range(1, len(p) + 1):
        m = np.arange(max(max_nodes - b + 1, 0))  # [rows]
        c = 1 + int(np.sum(p[: b - 1] >= p[b - 1]))
        cap = m.copy()
        if c >= 2:
            cap = np.minimum(cap, (max_nodes - 1 - m - (b - c)) // (c - 1))
        later = b < len(p) and bool(p[b] > p[b - 1])
        if later:
            cap = np.minimum(cap, m // 2)
        cap = np.where(m >= 1, np.maximum(cap, 1), 0)  # keep one feasible candidate per row
        out.append(_blocks(cap, later))
    return out


def _blocks(cap: np.ndarray, later: bool) -> _RankBounds:  # cap: [rows] largest s_b per row
    rows = len(cap)
    widest = int(cap.max()) if rows > 1 else 0
    step = max(1, BLOCK_CELLS // max(widest, 1))
    blocks = tuple((m0, min(m0 + step, rows), int(cap[m0 : m0 + step].max())) for m0 in range(1, rows, step))
    return _RankBounds(rows, widest, blocks, later)


def _level(
    p: np.ndarray,  # [W] acceptance row for this parent depth
    child: np.ndarray | None,  # [N + 1] V of a child subtree by size; None at r = 1 (a leaf level)
    bounds: list[_RankBounds],
    max_nodes: int,
) -> _Level:
    """V[j, r]: the best subtree rooted at depth class j with at most r levels, for every size."""
    width = len(p)
    value = np.ones(max_nodes + 1)
    value[0] = 0.0
    if child is None:
        return _Level(value, np.zeros((width + 1, max_nodes)))
    # work[b-1] = [-inf] * N ++ T_b(0..N-1) ++ [0] * N: the -inf third makes s > m impossible without a
    # concatenate; the last third lets every window of the Hankel views below be full length
    work = np.full((width + 1, 3 * max_nodes), -np.inf)
    work[:, max_nodes:] = 0.0
    saturated = int(np.argmax(child[1:] >= child[1:].max())) + 1  # V(s) is at its maximum from here on
    scratch = np.empty(BLOCK_CELLS + max_nodes)
    for b in range(width, 0, -1):
        out = work[b - 1, max_nodes : 2 * max_nodes]
        _suffix_row(p[b - 1], child, work[b], out, bounds[b - 1], saturated, scratch)
    suffix = work[:, max_nodes : 2 * max_nodes].copy()
    value[1:] = 1.0 + suffix[0]
    return _Level(value, suffix)


def _suffix_row(
    p_b: float,
    child: np.ndarray,  # [N + 1] V of a child subtree by size
    nxt: np.ndarray,  # [3N] -inf * N ++ T_{b+1}(0..N-1) ++ 0 * N
    out: np.ndarray,  # [N] written: T_b(m); rows past bound.rows hold T_b(rows - 1)
    bound: _RankBounds,
    saturated: int,
    scratch: np.ndarray,  # [>= BLOCK_CELLS + N] float64 work space
) -> None:
    widest = min(bound.widest, saturated)
    if bound.rows <= 1:
        return
    gain = p_b * child[widest:0:-1]  # [widest] p_b V(s) for s = widest..1
    # T_{b+1}(m - s) = nxt[N + m - s], -inf where s > m: for rows m0..m1-1 and s = hi..1 (t = hi - s), a block
    # is the Hankel matrix nxt[N + m0 - hi + i + t], a view read as [rows, hi] or as [hi, rows]
    by_row = sliding_window_view(nxt, widest)  # [3N - widest + 1, widest]
    by_size = sliding_window_view(nxt, max(m1 - m0 for m0, m1, _ in bound.blocks))  # [.., tallest block]
    for m0, m1, hi in bound.blocks:
        hi = min(hi, widest)
        _block_max(by_row, by_size, gain[widest - hi :], out[m0:m1], len(out) + m0 - hi, scratch)
    rows = bound.rows
    if bound.last_may_take_all:
        np.maximum(out[:rows], p_b * child[:rows], out=out[:rows])
    out[rows:] = out[rows - 1]


def _block_max(
    by_row: np.ndarray,  # [.., widest] by_row[x, t] = nxt[x + t]
    by_size: np.ndarray,  # [.., tallest] by_size[x, i] = nxt[x + i]
    gain: np.ndarray,  # [hi] gain[t] = p_b V(hi - t)
    out: np.ndarray,  # [rows] written: max_t gain[t] + nxt[base + i + t] for each row i
    base: int,
    scratch: np.ndarray,
) -> None:
    rows, hi = len(out), len(gain)
    if hi > rows:  # wide rows: reduce each contiguous row
        buf = scratch[: rows * hi].reshape(rows, hi)
        np.add(by_row[base : base + rows, :hi], gain, out=buf)
        buf.max(axis=1, out=out)
    else:  # narrow rows: an elementwise max over hi long vectors is faster
        buf = scratch[: rows * hi].reshape(hi, rows)
        np.add(by_size[base : base + hi, :rows], gain[:, None], out=buf)
        buf.max(axis=0, out=out)
