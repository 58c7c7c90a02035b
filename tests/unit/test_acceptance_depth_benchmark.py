"""benchmarks/acceptance_depth.py: the spine tree and the per-depth estimates from walks."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from acceptance_depth import depth_rows, rank1_by_depth, spine  # noqa: E402


def test_the_spine_branches_only_at_rank_one_children():
    plan = spine(3, 2)
    assert plan.n == 7 and plan.num_levels == 3
    assert [len(plan.children[node]) for node in range(plan.n)] == [3, 3, 0, 0, 0, 0, 0]


def test_depth_rows_count_each_visited_depth_and_pool_the_deepest():
    # (children, rank) per visited inner node, root first: a walk reaches depth j only past rank-1 acceptances
    walks = [((3, 1), (3, 1), (3, 2)), ((3, 2),), ((3, 1), (3, 0)), ((3, 0),)]
    rows = depth_rows(walks, width=3, depth=2)
    assert rows.rows[0] == pytest.approx((2 / 4, 1 / 4, 0.0)) and rows.reject[0] == pytest.approx(1 / 4)
    assert rows.rows[1] == pytest.approx((1 / 3, 1 / 3, 0.0)) and rows.reject[1] == pytest.approx(1 / 3)
    assert rank1_by_depth(walks, 3) == [(0.5, 4), (0.5, 2), (0.0, 1)]
    with pytest.raises(SystemExit, match="no walk reached depth 3"):
        depth_rows(walks, width=3, depth=4)
