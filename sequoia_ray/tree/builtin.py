"""Built-in plans: what serving and the CLI use when no measured or profiled plan is available."""

from __future__ import annotations

from pathlib import Path

from sequoia_ray.tree.acceptance_vector import AcceptanceVector
from sequoia_ray.tree.plan_file import PlannedTree, Provenance
from sequoia_ray.tree.planning import plan_for

# Measured on the default pair (Qwen2.5-Coder 0.5B -> 1.5B, bf16) with `sequoia-ray measure`, width 8,
# over benchmarks/prompts.jsonl; see README "Measured acceptance".
DEFAULT_ACCEPTANCE = {
    0.0: AcceptanceVector.from_p([0.80, 0.08, 0.03, 0.015, 0.008, 0.005, 0.003, 0.002]),
    0.6: AcceptanceVector.from_p([0.72, 0.09, 0.04, 0.025, 0.015, 0.01, 0.007, 0.005]),
}
DEFAULT_BUDGET = 16
DEFAULT_DEPTH = 6


def builtin_plan(temperature: float = 0.0, budget: int = DEFAULT_BUDGET, max_depth: int | None = DEFAULT_DEPTH,
                 acceptance: AcceptanceVector | None = None) -> PlannedTree:
    """The DP's best tree for the default pair's measured acceptance at the nearest temperature."""
    if acceptance is None:
        nearest = min(DEFAULT_ACCEPTANCE, key=lambda t: abs(t - temperature))
        acceptance = DEFAULT_ACCEPTANCE[nearest]
    return plan_for(acceptance, budget, max_depth, Provenance(temperature=temperature))[0]


def load_or_build(plan_file: str | Path | None, *, temperature: float, budget: int | None,
                  max_depth: int | None, acceptance: AcceptanceVector | None = None) -> PlannedTree:
    if plan_file is not None:
        return PlannedTree.load(Path(plan_file))
    return builtin_plan(temperature, budget or DEFAULT_BUDGET, max_depth, acceptance)
