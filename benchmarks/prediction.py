"""Where the cost model's prediction misses: predicted against measured speedup of every tree a profile measured.

    .venv/bin/python benchmarks/prediction.py STORE [STORE ...] [--out results/prediction.json]

Reads no model and times nothing: the profile job (``tuning/profile.py``, the main job's bounded profile,
``benchmarks/e2e.py``) already ran each measured candidate for real and recorded its predicted speedup,
measured speedup and tokens per step in the plan's provenance. For the latest batch-1 plan of every
(hardware, pair, temperature) in each store, and each candidate tree but the target alone, this splits the
error of the predicted speedup into its two factors

    predicted speedup = G(n, d) / step           measured speedup = tokens per step / measured step

with G from the DP over the plan's acceptance vector and ``step`` = step(1, n, d) / step(1, 1, 1) from the store's
latest hardware profile and the plan's recorded overhead (both in target-alone steps); the measured step is
tokens per step over measured speedup. ``pred check`` recomputes the recorded prediction from them (a store
whose latest profile is not the one its plans were chosen with shows a mismatch there).
Columns: ``G err`` = measured tokens per step / G - 1 (acceptance), ``step err`` = measured step / predicted
step - 1 (cost), ``err`` = predicted / measured speedup - 1 (the goal: within 10%).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import print_table, write_json  # noqa: E402

from sequoia_ray.hardware import NO_OVERHEAD, StepOverhead  # noqa: E402
from sequoia_ray.plan_store import PlanStore  # noqa: E402
from sequoia_ray.tree.dp import solve  # noqa: E402
from sequoia_ray.tree.plan import chain  # noqa: E402

COLUMNS = ["store", "T", "tree", "G", "tok/step", "G err", "step", "measured step", "step err", "predicted",
           "pred check", "measured", "err"]


def rows_of(uri: str) -> list[dict]:
    store = PlanStore(uri)
    latest: dict[str, str] = {}  # folder (one per key) -> its latest plan (names sort by time)
    for path in store.list_plans():
        folder = path.rsplit("/", 1)[0]
        latest[folder] = max(latest.get(folder, ""), path)
    rows, profiles = [], {}
    for path in sorted(latest.values()):
        planned = store.read_plan(path)
        prov = planned.provenance
        measured = [c for c in prov.candidates or [] if c["n"] > 1]
        if prov.batch not in (None, 1) or not measured:  # batch 1 only (the publisher writes None for it)
            continue
        if prov.hardware not in profiles:
            profiles[prov.hardware] = store.fetch_profile(prov.hardware)
        profile = profiles[prov.hardware]
        overhead = StepOverhead.from_dict(prov.overhead) if prov.overhead else NO_OVERHEAD
        depth = max(c["d"] for c in measured)
        table = solve(planned.acceptance, max(c["n"] for c in measured), depth)
        alone = profile.step_cost(chain(0), 1, overhead)
        for c in measured:
            G = table.value(c["n"], c["d"])
            step = profile.step_cost(table.tree(c["n"], c["d"]), 1, overhead) / alone
            measured_step = c["tokens_per_step"] / c["measured_speedup"]
            rows.append({"store": uri, "T": prov.temperature, "tree": f"n={c['n']} d={c['d']}", "G": G,
                         "tok/step": c["tokens_per_step"], "G err": c["tokens_per_step"] / G - 1, "step": step,
                         "measured step": measured_step, "step err": measured_step / step - 1,
                         "predicted": c["predicted_speedup"], "pred check": G / step - c["predicted_speedup"],
                         "measured": c["measured_speedup"],
                         "err": c["predicted_speedup"] / c["measured_speedup"] - 1,
                         "tokens measured": prov.tokens_measured})
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("stores", nargs="+", help="plan stores (paths or URIs) a profile published to")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    rows = [row for uri in args.stores for row in rows_of(uri)]
    if not rows:
        raise SystemExit("prediction.py: no batch-1 plan with measured candidates in the stores given")
    print_table(rows, COLUMNS)
    summary = {name: {"median": statistics.median(r[name] for r in rows),
                      "mean": statistics.mean(r[name] for r in rows),
                      "within 10%": sum(abs(r[name]) <= 0.10 for r in rows)}
               for name in ("G err", "step err", "err")}
    for name, s in summary.items():
        print(f"{name}: median {s['median']:+.1%}, mean {s['mean']:+.1%}, within 10%: {s['within 10%']} of {len(rows)}")
    write_json("prediction", {"stores": args.stores, "rows": rows, "summary": summary}, args.out)


if __name__ == "__main__":
    main()
