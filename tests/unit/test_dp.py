"""The DP against brute force over every rank-labelled tree of <= 8 nodes, closed forms and the references.

Unsorted vectors get their own cases: the DP skips cells by exchange bounds that depend on the order of p
(increasing, zigzag, ties, zeros, noisy tails, shuffled), so each shape is checked against brute force and,
on bigger tables, against the full-range sweep that skips nothing.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from sequoia_ray.tree.acceptance_vector import AcceptanceVector
from sequoia_ray.tree.dp import DPError, solve
from sequoia_ray.tree.dp_reference import solve_full_range, solve_reference
from sequoia_ray.tree.plan import expected_tokens, from_nested

MAX_NODES = 8


def ordered_trees(n: int) -> list:
    """Every ordered (rank-labelled) tree with exactly n nodes, as nested child lists."""
    return [children for children in ordered_forests(n - 1)]


def ordered_forests(m: int) -> list:
    if m == 0:
        return [[]]
    out = []
    for first in range(1, m + 1):  # size of the rank-1 child's subtree
        for head in ordered_trees(first):
            for rest in ordered_forests(m - first):
                out.append([head] + rest)
    return out


ALL_TREES = [from_nested(t) for n in range(1, MAX_NODES + 1) for t in ordered_trees(n)]


def test_enumeration_counts_catalan():
    counts = [sum(1 for t in ALL_TREES if t.n == n) for n in range(1, MAX_NODES + 1)]
    assert counts == [math.comb(2 * (n - 1), n - 1) // n for n in range(1, MAX_NODES + 1)]


def random_vector(rng: np.random.Generator, rows: int = 1, sort: bool = True) -> AcceptanceVector:
    width = int(rng.integers(1, 6))
    out = []
    for _ in range(rows):
        p = rng.dirichlet(np.ones(width + 1))[:width]
        out.append(sorted(p, reverse=True) if sort else list(p))
    return AcceptanceVector.from_rows(out)


def brute_force(acceptance: AcceptanceVector, n: int, d: int) -> float:
    return max(expected_tokens(t, acceptance) for t in ALL_TREES if t.n <= n and t.num_levels <= d)


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("rows,sort", [(1, True), (1, False), (3, True), (2, False)])
def test_dp_equals_brute_force_and_tree_attains_it(seed: int, rows: int, sort: bool):
    acceptance = random_vector(np.random.default_rng(seed), rows, sort)
    table = solve(acceptance, MAX_NODES, MAX_NODES)
    for n, d in itertools.product(range(1, MAX_NODES + 1), range(1, MAX_NODES + 1)):
        best = brute_force(acceptance, n, d)
        assert table.value(n, d) == pytest.approx(best, abs=1e-12), (n, d)
        tree = table.tree(n, d)
        assert tree.n <= n and tree.num_levels <= d
        assert expected_tokens(tree, acceptance) == pytest.approx(best, abs=1e-12)


@pytest.mark.parametrize("seed", range(6))
def test_unbounded_equals_deepest(seed: int):
    acceptance = random_vector(np.random.default_rng(100 + seed), rows=int(seed % 3) + 1)
    bounded = solve(acceptance, MAX_NODES, MAX_NODES)
    unbounded = solve(acceptance, MAX_NODES, None)
    for n in range(1, MAX_NODES + 1):
        assert unbounded.value(n) == pytest.approx(bounded.value(n, n), abs=1e-12)
        assert unbounded.value(n, 50) == pytest.approx(brute_force(acceptance, n, MAX_NODES), abs=1e-12)
        assert expected_tokens(unbounded.tree(n), acceptance) == pytest.approx(unbounded.value(n), abs=1e-12)


@pytest.mark.parametrize("a", [0.1, 0.5, 0.8, 0.95])
def test_chain_closed_form(a: float):
    table = solve(AcceptanceVector.from_p([a]), 12, 12)
    for length in range(12):  # a chain of L draft tokens is L + 1 nodes and L + 1 levels
        expected = (1 - a ** (length + 1)) / (1 - a)
        assert table.value(length + 1, length + 1) == pytest.approx(expected, rel=1e-14)
        assert table.value(12, length + 1) == pytest.approx(expected, rel=1e-14)


@pytest.mark.parametrize("sort", [True, False])
def test_matches_reference_on_larger_tables(sort: bool):
    rng = np.random.default_rng(7)
    for _ in range(3):
        acceptance = random_vector(rng, sort=sort)
        fast = solve(acceptance, 60, 9).G
        slow = solve_reference(list(acceptance.rows[0]), 60, 9)
        np.testing.assert_allclose(fast, slow, rtol=0, atol=1e-12)


def test_monotone_in_n_and_d_on_a_big_table():
    p = sorted(np.random.default_rng(3).dirichlet(np.ones(17))[:16], reverse=True)
    G = solve(AcceptanceVector.from_p(p), 300, 12).G[1:, 1:]
    assert np.all(np.diff(G, axis=0) >= -1e-12)
    assert np.all(np.diff(G, axis=1) >= -1e-12)
    assert G[-1, -1] > G[-1, 1]


def test_zero_acceptance_never_grows_the_tree():
    table = solve(AcceptanceVector.from_p([0.0, 0.0]), 10, 4)
    assert table.value(10, 4) == 1.0
    assert table.tree(10, 4).n == 1


def test_width_wider_than_budget():
    p = [0.05] * 20
    table = solve(AcceptanceVector.from_p(p), 5, 3)
    assert table.value(5, 3) == pytest.approx(brute_force(AcceptanceVector.from_p(p[:8]), 5, 3), abs=1e-12)


@pytest.mark.parametrize(
    "n,d,message",
    [(0, 3, "budget n = 0"), (11, 3, "max_nodes >= 11"), (5, 0, "depth d = 0"), (5, 9, "max_depth >= 9")],
)
def test_out_of_table_queries_name_the_fix(n: int, d: int, message: str):
    table = solve(AcceptanceVector.from_p([0.5]), 10, 4)
    with pytest.raises(DPError, match=message):
        table.value(n, d)


@pytest.mark.parametrize("nodes,depth", [(0, 3), (5, 0), (2.5, 3), (True, 3), (5, np.float64(3.0))])
def test_bad_arguments(nodes, depth):
    with pytest.raises(DPError):
        solve(AcceptanceVector.from_p([0.5]), nodes, depth)


def test_numpy_integers_are_integers():
    """A budget taken from a numpy array (np.int64) was refused as 'must be an integer'."""
    p = AcceptanceVector.from_p([0.6, 0.2])
    assert solve(p, np.int64(8), np.int32(4)).value(8, 4) == solve(p, 8, 4).value(8, 4)


# ---- unsorted vectors: the exchange bounds must stay exact whatever the order of p --------------------
SHAPES = ["increasing", "zigzag", "noisy_tail", "ties_and_zeros", "shuffled", "last_largest"]


def shaped(rng: np.random.Generator, shape: str, width: int) -> list[float]:
    """A vector of ``width`` probabilities (sum 0.95) whose order has the named shape."""
    decaying = np.sort(rng.dirichlet(np.ones(width)))[::-1]
    p = {
        "increasing": decaying[::-1],
        "zigzag": np.array([decaying[-1 - k // 2] if k % 2 == 0 else decaying[k // 2] for k in range(width)]),
        "noisy_tail": decaying * np.exp(rng.normal(0.0, 0.7, width)),
        "ties_and_zeros": rng.choice([0.0, 0.1, 0.1, 0.3], size=width),
        "shuffled": rng.permutation(decaying),
        "last_largest": np.concatenate([decaying[1:], decaying[:1]]),
    }[shape]
    return list(0.95 * p / p.sum()) if p.sum() > 0 else list(p)


def brute_table(acceptance: AcceptanceVector) -> np.ndarray:  # [MAX_NODES + 1, MAX_NODES + 1]; [n, d]
    values = np.array([expected_tokens(t, acceptance) for t in ALL_TREES])
    sizes = np.array([t.n for t in ALL_TREES])
    levels = np.array([t.num_levels for t in ALL_TREES])
    table = np.zeros((MAX_NODES + 1, MAX_NODES + 1))
    for n, d in itertools.product(range(1, MAX_NODES + 1), range(1, MAX_NODES + 1)):
        table[n, d] = values[(sizes <= n) & (levels <= d)].max()
    return table


def test_sorting_p_is_not_a_valid_shortcut():
    """Children are always ranks 1..k: p = [0.1, 0.9] cannot use its 0.9 child without the 0.1 one."""
    unsorted, flipped = AcceptanceVector.from_p([0.1, 0.9]), AcceptanceVector.from_p([0.9, 0.1])
    assert solve(unsorted, 2, 2).value(2, 2) == pytest.approx(1.1, abs=1e-15)
    assert solve(flipped, 2, 2).value(2, 2) == pytest.approx(1.9, abs=1e-15)
    assert solve(unsorted, 3, 2).value(3, 2) == pytest.approx(2.0, abs=1e-15)
    np.testing.assert_allclose(solve(unsorted, MAX_NODES, MAX_NODES).G[1:, 1:], brute_table(unsorted)[1:, 1:],
                               rtol=0, atol=1e-12)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("width", [3, 7])
def test_unsorted_shapes_equal_brute_force(seed: int, shape: str, width: int):
    acceptance = AcceptanceVector.from_p(shaped(np.random.default_rng(seed), shape, width))
    table = solve(acceptance, MAX_NODES, MAX_NODES)
    best = brute_table(acceptance)
    np.testing.assert_allclose(table.G[1:, 1:], best[1:, 1:], rtol=0, atol=1e-12)
    for n, d in itertools.product(range(2, MAX_NODES + 1), (2, 3, MAX_NODES)):
        assert expected_tokens(table.tree(n, d), acceptance) == pytest.approx(best[n, d], abs=1e-12), (n, d)


@pytest.mark.parametrize("seed", range(4))
def test_depth_indexed_unsorted_equals_brute_force(seed: int):
    rng = np.random.default_rng(50 + seed)
    rows = [shaped(rng, shape, 4) for shape in rng.choice(SHAPES, size=3)]
    acceptance = AcceptanceVector.from_rows(rows)
    table = solve(acceptance, MAX_NODES, MAX_NODES)
    best = brute_table(acceptance)
    np.testing.assert_allclose(table.G[1:, 1:], best[1:, 1:], rtol=0, atol=1e-12)
    tree = table.tree(MAX_NODES, 4)
    assert expected_tokens(tree, acceptance) == pytest.approx(best[MAX_NODES, 4], abs=1e-12)


@pytest.mark.parametrize("shape", SHAPES)
def test_unsorted_matches_full_range_on_larger_tables(shape: str):
    rng = np.random.default_rng(11)
    acceptance = AcceptanceVector.from_p(shaped(rng, shape, 12))
    table = solve(acceptance, 150, 10)
    np.testing.assert_allclose(table.G, solve_full_range(acceptance, 150, 10), rtol=0, atol=1e-12)
    for n, d in [(150, 10), (97, 4), (40, 10), (13, 3)]:
        assert expected_tokens(table.tree(n, d), acceptance) == pytest.approx(table.value(n, d), abs=1e-12)


@pytest.mark.parametrize("seed", range(3))
def test_depth_indexed_unsorted_matches_full_range(seed: int):
    rng = np.random.default_rng(20 + seed)
    acceptance = AcceptanceVector.from_rows([shaped(rng, shape, 9) for shape in ("noisy_tail", "zigzag", "increasing")])
    table = solve(acceptance, 120, 8)
    np.testing.assert_allclose(table.G, solve_full_range(acceptance, 120, 8), rtol=0, atol=1e-12)
    assert expected_tokens(table.tree(120, 8), acceptance) == pytest.approx(table.value(120, 8), abs=1e-12)


def test_full_range_oracle_agrees_with_the_triple_loop():
    p = shaped(np.random.default_rng(4), "zigzag", 6)
    np.testing.assert_allclose(solve_full_range(AcceptanceVector.from_p(p), 40, 6), solve_reference(p, 40, 6),
                               rtol=0, atol=1e-12)


@pytest.mark.parametrize("shape", ["noisy_tail", "increasing"])
def test_unbounded_unsorted_equals_deepest(shape: str):
    acceptance = AcceptanceVector.from_p(shaped(np.random.default_rng(8), shape, 5))
    bounded, unbounded = solve(acceptance, 60, 60), solve(acceptance, 60, None)
    for n in (1, 2, 7, 31, 60):
        assert unbounded.value(n) == pytest.approx(bounded.value(n, n), abs=1e-12)
        assert expected_tokens(unbounded.tree(n), acceptance) == pytest.approx(unbounded.value(n), abs=1e-12)


@pytest.mark.parametrize("block_cells", [8, 64, 1 << 16])
@pytest.mark.parametrize("shape", ["increasing", "noisy_tail", "zigzag"])
def test_block_layouts_agree_with_full_range(block_cells: int, shape: str, monkeypatch):
    """Small blocks force both reductions (along rows and along sizes) and many block edges."""
    monkeypatch.setattr("sequoia_ray.tree.dp.BLOCK_CELLS", block_cells)
    acceptance = AcceptanceVector.from_p(shaped(np.random.default_rng(9), shape, 6))
    np.testing.assert_allclose(solve(acceptance, 90, 7).G, solve_full_range(acceptance, 90, 7), rtol=0, atol=1e-12)


@pytest.mark.parametrize("shape", ["increasing", "noisy_tail"])
def test_budget_of_hundreds_matches_full_range(shape: str):
    """N = 600: blocks wider than tall, the layout the big tables (N ~ 1024) run on."""
    acceptance = AcceptanceVector.from_p(shaped(np.random.default_rng(12), shape, 5))
    table = solve(acceptance, 600, 5)
    np.testing.assert_allclose(table.G, solve_full_range(acceptance, 600, 5), rtol=0, atol=1e-12)
    assert expected_tokens(table.tree(600, 5), acceptance) == pytest.approx(table.value(600, 5), abs=1e-12)


@pytest.mark.parametrize("seed", range(6))
def test_ranks_and_rows_no_tree_can_use_change_nothing(seed: int):
    """The DP drops ranks past max_nodes - 1 and rows past max_depth - 1 before it runs: exact, checked against
    brute force on a vector wider than any tree of MAX_NODES nodes with more rows than MAX_NODES levels use."""
    rng = np.random.default_rng(300 + seed)
    rows = [list(rng.dirichlet(np.ones(13))[:12]) for _ in range(6)]
    acceptance = AcceptanceVector.from_rows(rows)
    for depth in (1, 3, MAX_NODES):
        table = solve(acceptance, MAX_NODES, depth)
        assert table.acceptance == acceptance  # callers still get the vector they gave
        for n, d in itertools.product(range(1, MAX_NODES + 1), range(1, depth + 1)):
            best = brute_force(acceptance, n, d)
            assert table.value(n, d) == pytest.approx(best, abs=1e-12), (depth, n, d)
            assert expected_tokens(table.tree(n, d), acceptance) == pytest.approx(best, abs=1e-12)
    unbounded = solve(acceptance, MAX_NODES, None)
    assert unbounded.value(MAX_NODES) == pytest.approx(brute_force(acceptance, MAX_NODES, MAX_NODES), abs=1e-12)


def test_a_very_wide_vector_costs_what_the_budget_can_use():
    """A plan file's vector 6,000 ranks wide: the table held [6001, N] floats per level (2 s, 141 MB at N = 256).
    Cut to the N - 1 ranks a tree can use, it costs what a vector N - 1 wide costs, and gives the same table."""
    import tracemalloc

    wide = AcceptanceVector.from_p([0.6, 0.2] + [1e-5] * 5_998)
    cut = AcceptanceVector.from_p([0.6, 0.2] + [1e-5] * 61)
    tracemalloc.start()
    table = solve(wide, 64, 6)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 4 * 2**20, f"{peak / 2**20:.0f} MB"  # the uncut table: ~28 MB
    np.testing.assert_array_equal(table.G, solve(cut, 64, 6).G)
    assert table.tree(64, 6) == solve(cut, 64, 6).tree(64, 6)


@pytest.mark.parametrize("p,n,d,value", [((0.5, 0.5), 4, 3, 2.25), ((0.4, 0.4, 0.1), 4, 3, 1.96),
                                          ((0.3, 0.3, 0.3), 6, 3, 2.08)])
def test_dp_with_tied_ranks_at_the_tables_budget(p, n, d, value):
    """Adjacent ranks tied at the table's own budget (live acceptance's exploring sets p[k] = p[k-1]): the
    exchange bound for ties must not cut the optimum (a mutation review: 2.0 for 2.25). Values: brute force."""
    assert solve(AcceptanceVector.from_p(list(p)), n, d).value(n, d) == pytest.approx(value, abs=1e-12)


# ---- deep trees, the tree rebuilt without recursion, and what a table may be asked -------------------
@pytest.mark.parametrize("p", [1.0, 0.999])
def test_a_chain_of_1024_levels_is_rebuilt(p: float):
    """tree() recursed once per level: an optimal chain ~1,000 deep (p[1] near 1, no depth limit, a budget a
    plan file allows) raised RecursionError, which the CLI reported as an input file nested too deeply."""
    acceptance = AcceptanceVector.from_p([p])
    table = solve(acceptance, 1024, None)
    tree = table.tree(1024)
    assert (tree.n, tree.num_levels) == (1024, 1024)
    assert tree.parents == tuple(range(-1, 1023))
    assert expected_tokens(tree, acceptance) == pytest.approx(table.value(1024), rel=1e-12)
    assert table.value(1024) == pytest.approx((1 - p**1024) / (1 - p) if p < 1 else 1024.0, rel=1e-12)


def recursive_tree(table, n: int, d: int):
    """The tree as the recursive rebuild made it (the reference for the queue): each child's subtree is the
    smallest size s maximising p[b] V(s) + T_{b+1}(left - s), children added while T_b(left) > 0."""
    def children(j: int, r: int, size: int) -> list:
        if r <= 1 or size <= 1:
            return []
        suffix = table._levels[(table._row(j), r)].suffix
        value = table._levels[(table._row(j + 1), r - 1)].value
        out, left, p = [], size - 1, table._used.row(j)
        for b in range(len(p)):
            if left <= 0 or suffix[b, left] <= 0.0:
                break
            s = 1 + int(np.argmax([p[b] * value[s] + suffix[b + 1, left - s] for s in range(1, left + 1)]))
            out.append(children(j + 1, r - 1, s))
            left -= s
        return out
    return from_nested(children(0, d, n))


@pytest.mark.parametrize("seed", range(40))
def test_the_queue_rebuilds_the_trees_the_recursion_did(seed: int):
    rng = np.random.default_rng(900 + seed)
    acceptance = random_vector(rng, rows=int(rng.integers(1, 4)), sort=bool(rng.integers(2)))
    nodes = int(rng.integers(1, 30))
    for depth in (None, int(rng.integers(1, 8))):
        table = solve(acceptance, nodes, depth)
        for n, d in itertools.product(range(1, nodes + 1), range(1, table.max_depth + 1)):
            assert table.tree(n, d) == recursive_tree(table, n, d), (n, d)


@pytest.mark.parametrize("call,named", [(lambda t: t.value(4.0), "budget n = 4.0"),
                                        (lambda t: t.value(4, 2.0), "depth d = 2.0"),
                                        (lambda t: t.value(2.5), "budget n = 2.5"),
                                        (lambda t: t.value(True, 2), "budget n = True"),
                                        (lambda t: t.tree(4.0, 2), "budget n = 4.0"),
                                        (lambda t: t.tree(4, np.float64(3.0)), r"depth d = (np\.float64\()?3\.0")])
def test_a_query_that_is_not_an_integer_is_a_dp_error(call, named):
    """value(4.0) and tree(4, 2.5) reached numpy's indexing: a bare IndexError, not the DPError naming the value."""
    table = solve(AcceptanceVector.from_p([0.6, 0.2]), 8, 4)
    with pytest.raises(DPError, match=f"^{named}.* must be an integer$"):
        call(table)
    assert table.value(np.int64(8), np.int32(4)) == table.value(8, 4)  # numpy's integers are integers


@pytest.mark.parametrize("rows,width,nodes,depth", [(1, 3, 50, 7), (5, 2, 30, 4), (2, 40, 10, 3), (1, 1, 40, None),
                                                     (3, 4, 25, None)])
def test_table_bytes_is_what_the_table_keeps(rows: int, width: int, nodes: int, depth: int | None):
    """check_plan_size refuses sizes by this estimate before solving: exact for a bounded depth, an upper bound
    (the depth where V may stop changing, max_nodes levels) for an unbounded one."""
    from sequoia_ray.tree.dp import table_bytes

    acceptance = AcceptanceVector.from_rows([[0.9 / width] * width] * rows)
    table = solve(acceptance, nodes, depth)
    kept = sum(level.suffix.nbytes + level.value.nbytes for level in table._levels.values())
    estimate = table_bytes(acceptance, nodes, depth)
    assert kept == estimate if depth else kept <= estimate
