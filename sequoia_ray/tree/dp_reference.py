"""The Sequoia DP with no cell skipped: oracles for tests and baselines for ``benchmarks/dp.py``.

``solve_reference`` is the obvious triple loop over (depth, nodes, child rank) for one flat vector.
``solve_full_range`` is the vectorised sweep over every child size (the code path ``dp.solve`` took for
unsorted vectors before the exchange bounds covered them), for flat or depth-indexed vectors: an oracle
for tables too big for brute force. Use ``dp.solve`` in real code.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from sequoia_ray.tree.acceptance_vector import AcceptanceVector


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


def solve_full_range(acceptance: AcceptanceVector, max_nodes: int, max_depth: int) -> np.ndarray:  # [N + 1, D + 1]
    """G[n, d] for a flat or depth-indexed vector, every child size 1..m tried at every rank."""
    rows = [np.asarray(r) for r in acceptance.rows]
    leaf = np.concatenate([[0.0], np.ones(max_nodes)])  # [N + 1] V at r = 1
    values = [leaf] * len(rows)  # values[j]: V[j, r] by size
    G = np.zeros((max_nodes + 1, max_depth + 1))
    G[:, 1] = leaf
    for r in range(2, max_depth + 1):
        values = [_full_level(rows[j], values[min(j + 1, len(rows) - 1)]) for j in range(len(rows))]
        G[:, r] = values[0]
    return G


def _full_level(
    p: np.ndarray,  # [W] acceptance row of the parent depth
    child: np.ndarray,  # [N + 1] V of a child subtree by size
) -> np.ndarray:  # [N + 1] V of this subtree by size
    n = len(child) - 1
    T = np.zeros(n)  # T_{W+1}(m), m = 0..N-1
    if n > 1:
        for p_b in p[::-1]:
            padded = np.concatenate([np.full(n - 1, -np.inf), T[: n - 1]])
            window = sliding_window_view(padded, n - 1)  # [N, N-1]; window[m, N-1-s] = T_{b+1}(m - s)
            T = np.maximum(0.0, (window + p_b * child[n - 1 : 0 : -1]).max(axis=1))
    return np.concatenate([[0.0], 1.0 + T])
