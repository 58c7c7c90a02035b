"""Where the cost model's prediction misses: predicted against measured speedup of every tree a profile measured.

    .venv/bin/python benchmarks/prediction.py STORE [STORE ...] [--out results/prediction.json]
    .venv/bin/python benchmarks/prediction.py STORE --measure [--repeats 3] [--prompts FILE]

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

``--measure`` runs the published tree again instead, with more work than the profile could afford: the latest
batch-1 plan of every temperature for this machine's hardware id, against the target alone, at batch 1 on every
prompt (the profiler's built-in set, or ``--prompts``, round-robin by kind as the profiler takes them; one prompt
a round, tree and target alone alternating), ``--repeats`` times over all of them. The pair is loaded as the
plan's provenance records it (dtype, draft quantisation, Linear kernels): the prediction is only right for the
configuration it was profiled with — measuring an int8 draft's plan with a bf16 draft puts its draft levels
~40% slower here (session 31). Columns: ``profile`` = what the profile's own measured choice recorded (its
``measure_rounds`` prompts), ``measured`` = the median over the repeats (``lo``/``hi`` their range), ``err`` =
predicted / measured - 1.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import print_table, write_json  # noqa: E402

from sequoia_ray.config import ProfileJobConfig, SamplingParams  # noqa: E402
from sequoia_ray.engine import ROOT_ONLY  # noqa: E402
from sequoia_ray.hardware import NO_OVERHEAD, Choice, StepOverhead, hardware_id  # noqa: E402
from sequoia_ray.local import LocalPair  # noqa: E402
from sequoia_ray.measured_choice import measure_choices  # noqa: E402
from sequoia_ray.plan_store import PlanStore  # noqa: E402
from sequoia_ray import profiling  # noqa: E402
from sequoia_ray.profiling import profile_prompts  # noqa: E402
from sequoia_ray.prompts import Prompt  # noqa: E402
from sequoia_ray.tree.dp import solve  # noqa: E402
from sequoia_ray.tree.plan import carried_leaf, chain  # noqa: E402
from sequoia_ray.tree.plan_file import PlannedTree, Provenance  # noqa: E402

COLUMNS = ["store", "T", "tree", "G", "tok/step", "G err", "step", "measured step", "step err", "predicted",
           "pred check", "measured", "err"]
MEASURE_COLUMNS = ["store", "T", "tree", "config", "G", "tok/step", "predicted", "profile", "measured", "lo", "hi",
                   "err"]


def latest_batch_one(store: PlanStore) -> list[PlannedTree]:
    """The latest plan of every (hardware, pair, temperature) folder that is a batch-1 plan (the publisher
    writes ``batch`` None for it), in path order."""
    latest: dict[str, str] = {}  # folder (one per key) -> its latest plan (names sort by time)
    for path in store.list_plans():
        folder = path.rsplit("/", 1)[0]
        latest[folder] = max(latest.get(folder, ""), path)
    plans = (store.read_plan(path) for path in sorted(latest.values()))
    return [p for p in plans if p.provenance.batch in (None, 1)]


def rows_of(uri: str) -> list[dict]:
    store = PlanStore(uri)
    rows, profiles = [], {}
    for planned in latest_batch_one(store):
        prov = planned.provenance
        measured = [c for c in prov.candidates or [] if c["n"] > 1]
        if not measured:
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
            tree = table.tree(c["n"], c["d"])
            step = profile.step_cost(tree, 1, overhead, carried_leaf(tree, planned.acceptance)) / alone
            measured_step = c["tokens_per_step"] / c["measured_speedup"]
            rows.append({"store": uri, "T": prov.temperature, "tree": f"n={c['n']} d={c['d']}", "G": G,
                         "tok/step": c["tokens_per_step"], "G err": c["tokens_per_step"] / G - 1, "step": step,
                         "measured step": measured_step, "step err": measured_step / step - 1,
                         "predicted": c["predicted_speedup"], "pred check": G / step - c["predicted_speedup"],
                         "measured": c["measured_speedup"],
                         "err": c["predicted_speedup"] / c["measured_speedup"] - 1,
                         "tokens measured": prov.tokens_measured})
    return rows


def load_as_recorded(prov: Provenance) -> LocalPair:
    """The pair in the configuration the plan was profiled with."""
    device = (prov.device or "cpu").split(":")[0]
    return LocalPair.load(prov.target, prov.draft, dtype=prov.dtype or "float32", draft_quantize=prov.draft_quantize,
                          device=device, linears=prov.linears or "auto", layers=prov.layers or "auto",
                          draft_vocab=prov.draft_vocab, progress=False)  # a plan that does not say: auto, full


def measure_rows(uri: str, prompts: list[Prompt], *, repeats: int, max_tokens: int, hardware: str,
                 load=load_as_recorded, served_calls: bool = True) -> list[dict]:
    """Every latest batch-1 plan of ``uri`` for ``hardware`` whose tree is more than the root, run against the
    target alone on all ``prompts`` ``repeats`` times (see the module docstring); ``load(provenance)`` gives the
    pair (one load per configuration). With ``served_calls`` each step is charged the served actor calls the
    plan's prediction counted (its provenance's ``overhead.calls``), as the profiler's measured choice is."""
    store = PlanStore(uri)
    pairs: dict[tuple, LocalPair] = {}
    rows = []
    for planned in latest_batch_one(store):
        prov = planned.provenance
        if prov.hardware != hardware:
            print(f"skipped the T = {prov.temperature} plan of {prov.hardware}: this machine is {hardware}")
            continue
        if planned.plan.n == 1:  # the target alone: nothing to measure against it
            continue
        config = (prov.target, prov.draft, prov.dtype, prov.draft_quantize, prov.linears, prov.device, prov.layers,
                  prov.draft_vocab)
        if config not in pairs:
            pairs[config] = load(prov)
        pair = pairs[config]
        ids = [pair.encode(p.text, chat=p.chat) for p in prompts]
        params = SamplingParams(max_tokens=max_tokens, temperature=prov.temperature or 0.0)
        n, d = planned.budget, planned.max_depth or planned.plan.num_levels
        root = Choice(1, 1, 1.0, 1.0, ROOT_ONLY)
        tree = Choice(n, d, planned.expected_tokens, prov.predicted_speedup or math.nan, planned.plan)
        calls = (0.0, 0.0)
        if served_calls and prov.overhead:
            calls = profiling.served_calls(store.fetch_profile(prov.hardware), StepOverhead.from_dict(prov.overhead))
        runs = [measure_choices(pair.target.model, pair.draft.model, [root, tree], ids, params, batch=1,
                                rounds=len(ids), calls=calls)[1] for _ in range(repeats)]
        speedups = [m.measured_speedup for m in runs]
        measured = statistics.median(speedups)
        rows.append({"store": uri, "T": prov.temperature, "tree": f"n={n} d={d}",
                     "config": f"{prov.dtype}/{prov.draft_quantize or '-'}/{prov.linears or '-'}",
                     "G": planned.expected_tokens, "tok/step": statistics.mean(m.tokens_per_step for m in runs),
                     "predicted": tree.predicted_speedup, "profile": prov.measured_speedup, "measured": measured,
                     "lo": min(speedups), "hi": max(speedups), "err": tree.predicted_speedup / measured - 1,
                     "repeats": speedups, "prompts": len(ids), "max tokens": max_tokens,
                     "calls ms": [round(1e3 * c, 3) for c in calls]})
    return rows


def measure_main(args) -> None:
    prompts = profile_prompts(ProfileJobConfig(storage="unused", prompts=args.prompts, max_prompts=args.max_prompts))
    hardware = hardware_id()
    rows = [row for uri in args.stores
            for row in measure_rows(uri, prompts, repeats=args.repeats, max_tokens=args.max_tokens, hardware=hardware,
                                   served_calls=args.served_calls)]
    if not rows:
        raise SystemExit(f"prediction.py --measure: no batch-1 tree plan for this machine ({hardware}) in the stores")
    print_table(rows, MEASURE_COLUMNS)
    within = sum(abs(r["err"]) <= 0.10 for r in rows)
    print(f"err within 10%: {within} of {len(rows)} ({len(prompts)} prompts x {args.repeats} repeats, "
          f"{args.max_tokens} tokens each)")
    write_json("prediction-measured", {"stores": args.stores, "rows": rows, "within 10%": within}, args.out)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("stores", nargs="+", help="plan stores (paths or URIs) a profile published to")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--measure", action="store_true", help="run the published trees again on every prompt")
    ap.add_argument("--repeats", type=int, default=3, help="--measure: passes over all the prompts")
    ap.add_argument("--prompts", help="--measure: a prompt file (default: the profiler's built-in set)")
    ap.add_argument("--max-prompts", type=int, default=6, help="--measure: prompts used (the profiler's default)")
    ap.add_argument("--max-tokens", type=int, default=48, help="--measure: tokens a prompt (the profiler's default)")
    ap.add_argument("--no-served-calls", dest="served_calls", action="store_false",
                    help="--measure: charge no actor calls (default: the calls each plan's prediction counted)")
    args = ap.parse_args(argv)
    if args.measure:
        measure_main(args)
        return
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
