"""Pictures of a DP table and a tree: G(n) per depth beside the chain and k×L baselines, and the tree."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from sequoia_ray.tree.dp import DPTable  # noqa: E402
from sequoia_ray.tree.plan import TreePlan, chain, expected_tokens, specinfer  # noqa: E402


def baseline_curves(table: DPTable) -> dict[str, list[float]]:
    """F of the best chain and best SpecInfer k×L (k >= 2) within each budget n and the table's depth."""
    a, depth = table.acceptance, table.max_depth
    chains = [expected_tokens(chain(min(n, depth) - 1), a) for n in range(1, table.max_nodes + 1)]
    kxl = {}
    for k in (2, 4, 8, 16):
        for length in range(1, depth):
            if k * length + 1 <= table.max_nodes:
                kxl[(k, length)] = expected_tokens(specinfer(k, length), a)
    best = [max([1.0] + [v for (k, L), v in kxl.items() if k * L + 1 <= n]) for n in range(1, table.max_nodes + 1)]
    return {"chain": chains, "k×L (best)": best}


def draw_tree(ax, plan: TreePlan) -> None:
    x = {}
    for level in plan.levels:
        for i, node in enumerate(level):
            x[node] = (i + 0.5) / len(level)
    for node in range(1, plan.n):
        parent = plan.parents[node]
        ax.plot([x[parent], x[node]], [-plan.depth[parent], -plan.depth[node]], color="0.6", lw=0.6)
    ax.scatter([x[i] for i in range(plan.n)], [-d for d in plan.depth], s=max(4, 400 / plan.n), zorder=3)
    ax.set_title(f"optimal tree: {plan.n} nodes, {plan.num_levels} levels")
    ax.set_ylabel("depth")
    ax.set_yticks([-d for d in range(plan.num_levels)], [str(d) for d in range(plan.num_levels)])
    ax.set_xticks([])


def plot_plan(table: DPTable, plan: TreePlan, out: Path) -> None:
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 5))
    ns = list(range(1, table.max_nodes + 1))
    depths = sorted({d for d in (2, 3, 4, 6, 8, 12, 16, 24, 32) if d < table.max_depth} | {table.max_depth})
    for d in depths:
        left.plot(ns, table.G[1:, d], label=f"Sequoia d≤{d}")
    for name, values in baseline_curves(table).items():
        left.plot(ns, values, "--", label=name)
    left.set_xscale("log", base=2)
    left.set_xlabel("tree budget n (nodes, root included)")
    left.set_ylabel("G(n, d): expected tokens per target call")
    left.legend(fontsize=8)
    left.grid(alpha=0.3)
    draw_tree(right, plan)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
