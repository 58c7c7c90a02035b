"""A batch bucket's predicted step against its measured one, part by part: where the prediction goes wrong.

    .venv/bin/python benchmarks/step_split.py --plan-store STORE [--batch 8] [--temperature 0] [--rounds 3]
        [--max-tokens 32] [--threads 2] [--prompts FILE] [--plan n,d]

The cost model predicts a tree's speedup over the target alone at batch B as ``G·A / T``: G the tokens a
request keeps a step (the DP's expectation under the plan's acceptance vector), A the root-only step (the
target's forward over B tokens, T_B(B), plus the overhead O_alone(B)) and T the tree step (the target's forward
over the B trees, T_B(B·n), the draft's levels, the first carrying the last tree's accepted leaf, and the
overhead O_tree(B)). This runs the bucket's stored plan (or ``--plan``'s (n, d) from the same acceptance) and the
root-only tree for real in lockstep at B (``sequoia_ray.lockstep``, in process: the serving pair as profiled,
bf16 target and int8 draft; the profiler's own prompts unless ``--prompts``; rounds round-robin, the order
rotated each round), timing each step's forwards inside it, and sets every part beside its prediction. Every
part is in units of the root-only step's target forward: predicted ones over the profile's T_B(B), measured
ones over the median measured root-only forward, so a host faster or slower than when it was profiled moves no
row. Measured parts are medians over the steps that held the whole batch, and tokens a request and step are
over them too (a run's tail, once a request has finished, runs a smaller batch; near ``max_tokens`` a tree is
cut to the tokens left, so a short run reads fewer tokens a step than G). The actor calls a served step adds are left out on both sides (in
process). The last rows split the error of the predicted speedup (predicted over measured, steady) into the
factors of G, A and T. Prints the table and writes ``benchmarks/results/step-split.json``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import print_table, write_json  # noqa: E402

PARTS = ("target forward", "draft forwards", "outside the forwards")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--plan-store", required=True, help="the store whose plan and profile are checked")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--rounds", type=int, default=3, help="lockstep runs of B prompts per tree, round-robin")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompts", type=Path, help="a prompt file (default: the profiler's built-in prompts)")
    ap.add_argument("--plan", help="n,d: the DP's tree for the stored plan's acceptance instead of the stored tree")
    ap.add_argument("--out", type=Path, help="JSON path (default benchmarks/results/step-split.json)")
    args = ap.parse_args()
    if args.batch < 1 or args.rounds < 1 or args.max_tokens < 2:
        raise SystemExit("step_split.py: --batch and --rounds must be >= 1 and --max-tokens >= 2")
    if args.plan:
        try:
            n, d = (int(x) for x in args.plan.split(","))
        except ValueError:
            raise SystemExit(f"step_split.py: --plan {args.plan!r}: give n,d as two integers, e.g. 4,3") from None
        if n < 2 or d < 2:
            raise SystemExit(f"step_split.py: --plan {args.plan!r}: a tree needs n >= 2 nodes and d >= 2 levels")

    import torch

    from sequoia_ray.config import ProfileJobConfig, SamplingParams
    from sequoia_ray.draft import DraftWorker
    from sequoia_ray.hardware import StepOverhead, batch_bucket, hardware_id
    from sequoia_ray.local import LocalPair
    from sequoia_ray.lockstep import run_lockstep
    from sequoia_ray.plan_store import PlanKey, PlanNotFound, PlanStore
    from sequoia_ray.profiling import profile_prompts
    from sequoia_ray.prompts import load_prompts
    from sequoia_ray.target import TargetWorker
    from sequoia_ray.tree.dp import solve
    from sequoia_ray.tree.plan import TreePlan, carried_leaf, expected_tokens

    torch.set_num_threads(args.threads)
    store, hardware = PlanStore(args.plan_store), hardware_id(threads=args.threads)
    key = PlanKey(hardware, "default-draft", "default-target", args.temperature, batch_bucket(args.batch))
    try:
        stored, prof = store.fetch_plan(key)[0], store.fetch_profile(hardware)
    except PlanNotFound as exc:
        raise SystemExit(f"step_split.py: {exc}") from None
    acceptance, plan = stored.acceptance, stored.plan
    if args.plan:
        plan = solve(acceptance, n, d).tree(n, d)
    if plan.n == 1:
        raise SystemExit(f"step_split.py: bucket {key.batch}'s plan is the root-only tree; give --plan n,d")
    overhead = StepOverhead.from_dict(stored.provenance.overhead or {})
    overhead = StepOverhead(alone=overhead.alone, tree=overhead.tree)  # in process: no actor calls
    B, carried = args.batch, carried_leaf(plan, acceptance)
    unit = prof.target_cost(B, B)  # T_B(B): the root-only step's target forward
    predicted = {
        "alone": {"tokens": 1.0, "target forward": 1.0, "draft forwards": 0.0,
                  "outside the forwards": overhead.of(B, False) / unit},
        "tree": {"tokens": expected_tokens(plan, acceptance), "target forward": prof.target_cost(B, B * plan.n) / unit,
                 "draft forwards": prof.draft_cost(plan, B, carried) / unit,
                 "outside the forwards": overhead.of(B, True) / unit},
    }

    texts = load_prompts(args.prompts) if args.prompts else profile_prompts(ProfileJobConfig(storage=args.plan_store))
    pair = LocalPair.load(dtype="bfloat16", draft_quantize="int8", progress=False)
    prompts = [pair.encode(p.text, chat=p.chat) for p in texts]
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens)
    trees = {"alone": TreePlan((-1,)), "tree": plan}
    runs: dict[str, list] = {k: [] for k in trees}
    for r in range(args.rounds):
        work = [prompts[(r * B + i) % len(prompts)] for i in range(B)]
        for kind in (list(trees) if r % 2 == 0 else list(trees)[::-1]):
            runs[kind].append(run_lockstep(TargetWorker(pair.target.model), DraftWorker(pair.draft.model), work,
                                           trees[kind], params, seed=r, time_forwards=True))
            print(f"round {r}, {kind}: {runs[kind][-1].tokens_per_step:.2f} tokens a request and step", flush=True)

    measured = {kind: _parts(done) for kind, done in runs.items()}
    scale = measured["alone"]["target forward"]  # seconds: every part in units of it
    measured = {kind: {k: (v / scale if k in PARTS else v) for k, v in parts.items()} for kind, parts in measured.items()}
    rows, summary = _rows(predicted, measured)
    every = {kind: sum(r.timed_tokens for r in done) / sum(r.seconds for r in done) for kind, done in runs.items()}
    full = {kind: [sum(x) for x in zip(*(r.full_rate() for r in done))] for kind, done in runs.items()}
    full = {kind: tokens / seconds for kind, (tokens, seconds, _) in full.items()}
    summary["measured speedup, full steps' tokens/s (the measured choice)"] = full["tree"] / full["alone"]
    summary["measured speedup, every timed step's (with the tail)"] = every["tree"] / every["alone"]
    summary["published prediction (with served calls)"] = stored.provenance.predicted_speedup
    print(f"\nB = {B}, T = {args.temperature}: plan n = {plan.n} d = {plan.num_levels}, carried leaf {carried:.2f}; "
          f"parts in units of the root-only step's target forward (T_B(B) = {unit:.3f} target steps predicted, "
          f"{1e3 * scale:.1f} ms measured)")
    print_table(rows, ["step", "part", "predicted", "measured", "measured / predicted"])
    print()
    print_table([{"what": k, "value": round(v, 4) if isinstance(v, float) else v} for k, v in summary.items()],
                ["what", "value"])
    write_json("step-split", {"args": {k: str(v) for k, v in vars(args).items()}, "plan": list(plan.parents),
                              "carried": carried, "predicted": predicted, "measured": measured, "rows": rows,
                              "summary": summary}, args.out)
    return 0


def _parts(done: list) -> dict[str, float]:
    """Medians over the steps that held the whole batch, in seconds, and tokens a request and step."""
    step, target, draft, outside = [], [], [], []
    for run in done:
        top = max(run.batch)
        for s, f, d, b in zip(run.step_s, run.forward_s, run.draft_forward_s, run.batch):
            if b == top:
                step.append(s), target.append(f - d), draft.append(d), outside.append(s - f)
    rates = [run.full_rate() for run in done]
    tokens = sum(k for k, _, _ in rates) / sum(steps for _, _, steps in rates)
    return {"tokens": tokens, "target forward": statistics.median(target), "draft forwards": statistics.median(draft),
            "outside the forwards": statistics.median(outside), "step s": statistics.median(step)}


def _rows(predicted: dict, measured: dict) -> tuple[list[dict], dict]:
    rows = []
    for kind in ("alone", "tree"):
        for part in ("tokens", *PARTS):
            p, m = predicted[kind][part], measured[kind][part]
            rows.append({"step": kind, "part": part, "predicted": round(p, 4), "measured": round(m, 4),
                         "measured / predicted": round(m / p, 3) if p else "-"})
        p_step = sum(predicted[kind][k] for k in PARTS)
        m_step = sum(measured[kind][k] for k in PARTS)
        rows.append({"step": kind, "part": "the step", "predicted": round(p_step, 4), "measured": round(m_step, 4),
                     "measured / predicted": round(m_step / p_step, 3)})
    step = {src: {kind: sum(parts[kind][k] for k in PARTS) for kind in parts} for src, parts in
            (("predicted", predicted), ("measured", measured))}
    speedup = {src: parts["tree"]["tokens"] * step[src]["alone"] / step[src]["tree"] for src, parts in
               (("predicted", predicted), ("measured", measured))}
    summary = {
        "predicted speedup (in process)": speedup["predicted"],
        "measured speedup, from the parts' medians": speedup["measured"],
        "predicted / measured": speedup["predicted"] / speedup["measured"],
        "factor of G (tokens)": predicted["tree"]["tokens"] / measured["tree"]["tokens"],
        "factor of the root-only step": step["predicted"]["alone"] / step["measured"]["alone"],
        "factor of the tree step": step["measured"]["tree"] / step["predicted"]["tree"],
    }
    return rows, summary


if __name__ == "__main__":
    sys.exit(main())
