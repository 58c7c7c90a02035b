"""DP speed on sorted and unsorted acceptance vectors: ``dp.solve`` next to the sweep that skips nothing.

    .venv/bin/python benchmarks/dp.py [--repeats 5] [--baseline-repeats 2] [--reference-max-nodes 128]
        [--out results/dp.json]

For each size (N, D, W) and vector, prints the median wall and CPU seconds of one full G(n, d) table for
``dp.solve`` and for ``dp_reference.solve_full_range`` (every child size tried: the path ``dp.solve`` took for
unsorted vectors before the exchange bounds covered them), their ratio, and the largest |difference| of
the two tables (exactness; expect 0). The plain triple loop (``solve_reference``) is timed up to
``--reference-max-nodes``. The load average is recorded: the machine may be shared, timings move with it.

Vectors. The Llama3 8B->70B vector of the Sequoia paper's appendix E is not in this repository, so
``measured_like`` stands in for it: a realistic unsorted vector (a sorted head, a tail with sampling-noise
inversions, sum 0.93), typed in below — not the paper's numbers. ``shuffled`` is the same values in random
order; ``increasing`` is the adversarial order (the exchange bounds skip least there).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import print_table, write_json  # noqa: E402

from sequoia_ray.tree.acceptance_vector import AcceptanceVector  # noqa: E402
from sequoia_ray.tree.dp import solve  # noqa: E402
from sequoia_ray.tree.dp_reference import solve_full_range, solve_reference  # noqa: E402

SIZES = [(128, 10, 32), (512, 20, 32), (1024, 32, 32)]
MEASURED_LIKE = [  # 32 ranks; inversions from rank 7 on, as a measured tail looks
    0.712, 0.083, 0.036, 0.021, 0.013, 0.0105, 0.0069, 0.0074, 0.0048, 0.0041, 0.0046, 0.0029, 0.0031,
    0.0022, 0.0025, 0.0016, 0.0019, 0.0011, 0.0014, 0.0009, 0.0012, 0.0007, 0.0010, 0.0006, 0.0004,
    0.0008, 0.0005, 0.0003, 0.0006, 0.0002, 0.0004, 0.0001,
]


def realistic_p(width: int) -> list[float]:
    """A decaying vector like a measured draft/target pair: p[1] = 0.7, the rest geometric, sum 0.95."""
    tail = 0.55 ** np.arange(1, width)
    return [0.7] + list(0.25 * tail / tail.sum())


def vectors(width: int) -> dict[str, list[float]]:
    measured = (MEASURED_LIKE + [0.0] * width)[:width]
    return {
        "sorted": realistic_p(width),
        "measured_like": measured,
        "shuffled": list(np.random.default_rng(0).permutation(measured)),
        "increasing": sorted(measured),
    }


def medians(fn, repeats: int) -> tuple[float, float]:
    """Median wall and CPU seconds of ``fn()`` over ``repeats`` runs."""
    wall, cpu = [], []
    for _ in range(repeats):
        w0, c0 = time.perf_counter(), time.process_time()
        fn()
        wall.append(time.perf_counter() - w0)
        cpu.append(time.process_time() - c0)
    return statistics.median(wall), statistics.median(cpu)


def measure(name: str, p: list[float], n: int, d: int, args: argparse.Namespace) -> dict:
    acceptance = AcceptanceVector.from_p(p)
    fast_wall, fast_cpu = medians(lambda: solve(acceptance, n, d), args.repeats)
    full_wall, full_cpu = medians(lambda: solve_full_range(acceptance, n, d), args.baseline_repeats)
    diff = float(np.abs(solve(acceptance, n, d).G - solve_full_range(acceptance, n, d)).max())
    loop = medians(lambda: solve_reference(p, n, d), 1)[0] if n <= args.reference_max_nodes else "-"
    return {"vector": name, "N": n, "D": d, "W": len(p), "dp_s": fast_wall, "dp_cpu_s": fast_cpu,
            "full_range_s": full_wall, "full_range_cpu_s": full_cpu, "ratio_cpu": full_cpu / fast_cpu,
            "triple_loop_s": loop, "G(N,D)": solve(acceptance, n, d).value(n, d), "max_abs_diff": diff}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--baseline-repeats", type=int, default=2)
    parser.add_argument("--reference-max-nodes", type=int, default=128, help="time the triple loop up to this N")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    load_before = os.getloadavg()
    rows = [measure(name, p, n, d, args) for n, d, w in SIZES for name, p in vectors(w).items()]
    columns = ["vector", "N", "D", "W", "dp_s", "dp_cpu_s", "full_range_s", "full_range_cpu_s", "ratio_cpu",
               "triple_loop_s", "G(N,D)", "max_abs_diff"]
    print_table(rows, columns)
    big = [r for r in rows if r["N"] == SIZES[-1][0]]
    print(f"N = {SIZES[-1][0]}: median dp CPU s over vectors {statistics.median(r['dp_cpu_s'] for r in big):.3f}, "
          f"worst {max(r['dp_cpu_s'] for r in big):.3f}; load average {load_before} -> {os.getloadavg()}")
    write_json("dp", {"rows": rows, "repeats": args.repeats, "baseline_repeats": args.baseline_repeats,
                      "load_average_before": load_before, "load_average_after": os.getloadavg()}, args.out)


if __name__ == "__main__":
    main()
