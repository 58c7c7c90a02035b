"""From an acceptance vector and a budget to a saved-ready ``PlannedTree`` (DP + rebuild + provenance)."""

from __future__ import annotations

from sequoia_ray.tree.acceptance_vector import AcceptanceVector
from sequoia_ray.tree.dp import DPTable, solve
from sequoia_ray.tree.plan_file import PlannedTree, Provenance


def plan_for(
    acceptance: AcceptanceVector,
    budget: int,
    max_depth: int | None,
    provenance: Provenance | None = None,
) -> tuple[PlannedTree, DPTable]:
    """The optimal tree with at most ``budget`` nodes and ``max_depth`` levels, and the table behind it."""
    table = solve(acceptance, budget, max_depth)
    plan = table.tree(budget, max_depth)
    planned = PlannedTree(
        plan=plan,
        acceptance=acceptance,
        budget=budget,
        max_depth=max_depth,
        expected_tokens=table.value(budget, max_depth),
        provenance=provenance or Provenance(),
    )
    return planned, table
