"""The plan of each batch-size bucket, predicted and measured in one process: how n and d shrink as B grows.

    .venv/bin/python benchmarks/batch_plans.py --plan-store STORE [--batches 1,2,4,8] [--rounds 3]
        [--max-tokens 48] [--temperature 0] [--no-served-calls]

For each batch size B: the stored plan of B's bucket (its predicted speedup over the target alone at B, from
the plan's provenance), the B = 1 plan run at B too, and the root-only tree (the target alone, the baseline),
run for real in lockstep at B (``sequoia_ray.measured_choice.measure_choices``: round-robin, ``rounds``
rounds of B prompts of ``benchmarks/prompts.jsonl``, the same prompts and seeds for every candidate). The
models are the serving pair as the store's plans were profiled: the default pair, bf16 target, int8 draft,
``--threads`` torch threads (2). In process, so without Serve's costs (``benchmarks/load.py`` measures
those), except the actor calls a served step makes: each timed step is charged the calls the bucket plan's
prediction included (its provenance's ``overhead.calls``, as the profiler's measured choice charges them), so
"predicted" and "measured" count the same costs; ``--no-served-calls`` charges none. Prints a table and writes
``benchmarks/results/batch-plans.json``.
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import print_table, write_json  # noqa: E402

HERE = Path(__file__).resolve().parent
COLUMNS = ["B", "plan", "n", "d", "predicted", "measured", "tok/s", "tok/step", "calls ms"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--plan-store", required=True, help="the store whose per-bucket plans are measured")
    ap.add_argument("--batches", default="1,2,4,8", help="batch sizes (each a bucket with a stored plan)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds of B prompts per candidate")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-served-calls", dest="served_calls", action="store_false",
                    help="charge no actor calls (default: the calls each bucket plan's prediction counted)")
    ap.add_argument("--out", type=Path, help="JSON path (default benchmarks/results/batch-plans.json)")
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]

    import torch

    from sequoia_ray.config import SamplingParams
    from sequoia_ray.hardware import Choice, StepOverhead, batch_bucket, hardware_id
    from sequoia_ray.local import LocalPair
    from sequoia_ray.measured_choice import measure_choices
    from sequoia_ray.plan_store import PlanKey, PlanNotFound, PlanStore
    from sequoia_ray.profiling import served_calls
    from sequoia_ray.prompts import load_prompts
    from sequoia_ray.tree.plan import TreePlan

    torch.set_num_threads(args.threads)
    store, hardware = PlanStore(args.plan_store), hardware_id(threads=args.threads)

    def stored(batch: int):
        key = PlanKey(hardware, "default-draft", "default-target", args.temperature, batch_bucket(batch))
        try:
            return store.fetch_plan(key)[0]
        except PlanNotFound as exc:
            raise SystemExit(f"batch_plans.py: {exc}") from None

    plans = {b: stored(b) for b in sorted({1, *batches})}

    @functools.cache
    def profile():
        return store.fetch_profile(hardware)

    def calls_of(planned) -> tuple[float, float]:
        """(root-only, tree) seconds of a request's served calls that ``planned``'s prediction counted."""
        overhead = planned.provenance.overhead
        if not args.served_calls or not overhead:
            return 0.0, 0.0
        return served_calls(profile(), StepOverhead.from_dict(overhead))

    pair = LocalPair.load(dtype="bfloat16", draft_quantize="int8", progress=False)
    prompts = [pair.encode(p.text, chat=p.chat) for p in load_prompts(HERE / "prompts.jsonl")]  # as served
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens)
    root = TreePlan((-1,))
    rows = []
    for batch in batches:
        mine, first = plans[batch], plans[1]
        candidates = [root, mine.plan] + ([first.plan] if first.plan != mine.plan else [])
        choices = [Choice(p.n, p.num_levels, 0.0, 1.0, p, batch=batch) for p in candidates]
        calls = calls_of(mine)
        measured = measure_choices(pair.target.model, pair.draft.model, choices, prompts, params, batch=batch,
                                   rounds=args.rounds, calls=calls)
        for m, label in zip(measured, ["target alone", f"bucket {batch_bucket(batch)}'s plan", "B = 1's plan"]):
            predicted = mine.provenance.predicted_speedup if label.startswith("bucket") else None
            rows.append({"B": batch, "plan": label, "n": m.choice.n, "d": m.choice.d,
                         "predicted": predicted if predicted is not None else "-",
                         "measured": round(m.measured_speedup, 3), "tok/s": round(m.tokens_per_s, 2),
                         "tok/step": round(m.tokens_per_step, 2),
                         "calls ms": "%.2f" % (1e3 * calls[int(m.choice.n > 1)])})
        print_table(rows[-len(measured):], COLUMNS)
    print()
    print_table(rows, COLUMNS)
    write_json("batch-plans", {"hardware": hardware, "args": {k: str(v) for k, v in vars(args).items()},
                               "rows": rows}, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
