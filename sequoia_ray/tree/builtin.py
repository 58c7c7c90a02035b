"""Built-in plans: what serving and the CLI use when no measured or profiled plan is available."""

from __future__ import annotations

from pathlib import Path

from sequoia_ray.tree.acceptance_vector import AcceptanceVector
from sequoia_ray.tree.plan_file import PlannedTree, Provenance
from sequoia_ray.tree.planning import plan_for

# Measured on the default pair (Qwen2.5-Coder 0.5B -> 1.5B, bf16) with `sequoia-ray measure --width 8
# --max-tokens 48` over benchmarks/prompts.jsonl (~270 steps each; the files are examples/acceptance-default-*.json),
# the noisy tail pooled into a non-increasing vector.
DEFAULT_ACCEPTANCE = {
    0.0: AcceptanceVector.from_p([0.831, 0.081, 0.026, 0.0092, 0.0092, 0.0074, 0.0074, 0.0074]),
    0.6: AcceptanceVector.from_p([0.812, 0.081, 0.044, 0.015, 0.011, 0.011, 0.0037, 0.0]),
}
DEFAULT_BUDGET = 16
DEFAULT_DEPTH = 6


def builtin_acceptance(temperature: float) -> AcceptanceVector:
    """The default pair's measured acceptance vector at the temperature nearest ``temperature``."""
    return DEFAULT_ACCEPTANCE[min(DEFAULT_ACCEPTANCE, key=lambda t: abs(t - temperature))]


def builtin_plan(temperature: float = 0.0, budget: int = DEFAULT_BUDGET, max_depth: int | None = DEFAULT_DEPTH,
                 acceptance: AcceptanceVector | None = None) -> PlannedTree:
    """The DP's best tree for the default pair's measured acceptance at the nearest temperature."""
    if acceptance is None:
        acceptance = builtin_acceptance(temperature)
    return plan_for(acceptance, budget, max_depth, Provenance(temperature=temperature))[0]


def load_or_build(plan_file: str | Path | None, *, temperature: float, budget: int | None,
                  max_depth: int | None, acceptance: AcceptanceVector | None = None) -> PlannedTree:
    if plan_file is not None:
        return PlannedTree.load(Path(plan_file))
    return builtin_plan(temperature, budget or DEFAULT_BUDGET, max_depth, acceptance)
