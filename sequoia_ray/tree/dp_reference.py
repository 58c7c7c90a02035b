"""The Sequoia DP written the obvious way: a triple loop over (depth, nodes, child rank).

Kept as an oracle for tests and as the baseline in ``benchmarks/dp.py``; use ``dp.solve`` in real code.
"""

from __future__ import annotations

import numpy as np


def solve_reference(p: list[float], max_nodes: int, max_depth: int) -> np.ndarray:  # [N + 1, D + 1]
    """G[n, d] for one flat acceptance vector ``p``; no cells skipped."""
    width = len(p)
    G = np.zeros((max_nodes + 1, max_depth + 1))
    G[1:, 1] = 1.0
    for d in range(2, max_depth + 1):
        # T[b, m]: best value of children ranked b+1.. (0-based b) sharing at most m nodes
        T = np.zeros((width + 1, max_nodes))
        for m in range(1, max_nodes):
            for b in range(width - 1, -1, -1):
                sizes = np.arange(1, m + 1)
                gains = p[b] * G[sizes, d - 1] + T[b + 1, m - sizes]
                T[b, m] = max(0.0, gains.max())
        G[1:, d] = 1.0 + T[0, :]
    return G
