"""Plan file limits taken together: the memory the DP would need for a budget, a depth and a vector.

Each of budget, max_depth, ranks and rows is bounded on its own (tests/unit/test_plan.py); the DP keeps a
[ranks + 1, budget] table per (row, level), so sizes that pass every bound alone can still need 100+ GB.
"""

from __future__ import annotations

import json
import re

import pytest

from sequoia_ray.tree.acceptance_vector import AcceptanceVector
from sequoia_ray.tree.dp import table_bytes
from sequoia_ray.tree.plan import expected_tokens
from sequoia_ray.tree.plan_file import MAX_DP_BYTES, PlanFormatError, PlannedTree, check_plan_size
from sequoia_ray.tree.planning import plan_for


def vector(rows: int, width: int) -> AcceptanceVector:
    return AcceptanceVector.from_rows([[0.97 * 0.5 ** (k + 1) for k in range(width)]] * rows)


@pytest.mark.parametrize("rows,width,budget,depth,message", [
    (128, 1024, 1024, 128, "128 rows x 1024 ranks at budget 1024 and max_depth 128 need ~136.5 GB of DP tables"),
    (1, 1024, 1024, None, "1 rows x 1024 ranks at budget 1024 and max_depth unbounded (up to 1024 levels) need "
                          "~8.6 GB of DP tables"),
    (16, 512, 1024, 64, "16 rows x 512 ranks at budget 1024 and max_depth 64 need ~4.3 GB of DP tables"),
])
def test_sizes_within_each_limit_but_past_the_dps_memory_are_refused(rows, width, budget, depth, message):
    """128 rows of 1,024 ranks at budget 1,024 and 128 levels passed check_plan_size (each value within its own
    limit), then the DP would have kept 16,256 tables of 8.4 MB: 136 GB. Refused before solving, naming the
    values, the memory and the fix."""
    fix = ", over the 4 GB limit: give fewer rows, a smaller max_depth or budget, or cut the ranks"
    with pytest.raises(PlanFormatError, match=f"^{re.escape(f'acceptance {message}{fix}')}$"):
        check_plan_size(budget, depth, vector(rows, width))


@pytest.mark.parametrize("rows,width,budget,depth", [
    (1, 8, 256, 16),  # the built-in vector at DEFAULT_BUDGETS' largest (hardware.DEFAULT_BUDGETS)
    (1, 64, 1024, 64),  # a profile at its limits: budgets up to 1,024, max_depth and width up to 64 (config)
    (1, 64, 1024, None),  # `sequoia-ray plan` on such a vector, unbounded (~0.55 GB)
    (1, 32, 1024, 32),  # benchmarks/dp.py's largest
    (1, 1, 1024, None),  # `sequoia-ray plan --acceptance 1 --budget 1024`: a 1,024-level chain
    (1, 1024, 1024, 128),  # the widest single-row vector at the largest plan (~1.1 GB)
    (128, 8, 1024, 128),  # a depth-indexed vector with every row a plan can use
])
def test_the_sizes_the_project_uses_are_admitted(rows, width, budget, depth):
    check_plan_size(budget, depth, vector(rows, width))
    assert table_bytes(vector(rows, width), budget, depth) <= MAX_DP_BYTES


def test_a_plan_file_past_the_dps_memory_is_refused_on_load(tmp_path):
    """Serving runs the DP on a stored file's budget, depth and vector (live re-planning), so ``load`` refuses
    what check_plan_size refuses, naming the file and the field; a depth the memory allows loads."""
    planned = plan_for(AcceptanceVector.from_p([0.6, 0.2]), 4, 3)[0]
    wide = vector(128, 1024)
    obj = {**planned.to_dict(), "budget": 1024, "max_depth": 128, "acceptance": wide.to_dict(),
           "expected_tokens": expected_tokens(planned.plan, wide)}
    file = tmp_path / "huge.json"
    file.write_text(json.dumps(obj))
    named = f"{file}: field 'acceptance': 128 rows x 1024 ranks at budget 1024 and max_depth 128 need ~136.5 GB"
    with pytest.raises(PlanFormatError, match=f"^{re.escape(named)}"):
        PlannedTree.load(file)
    file.write_text(json.dumps({**obj, "max_depth": 4}))  # 3 rows x 4 levels x 8.4 MB
    assert PlannedTree.load(file).max_depth == 4
