"""Predicted and measured plan per batch bucket on this machine (no Ray): how n and d shrink as B grows.

    PYTHONPATH=. python tuning/batch_table.py --smoke-test
    PYTHONPATH=. python tuning/batch_table.py --dtype bfloat16 --draft-quantize int8 --acceptance builtin

Profiles t(n), c(w) and the batched T_B, C_B (``sequoia_ray.hardware.profile``), takes the acceptance vector
(measured on a few prompts, or ``builtin`` = the default pair's measured vector), chooses the tree per batch
bucket, then times for real (``time_steps``: the step's draft and target forwards over B requests with
``hidden_many``, round-robin) the chosen tree, the batch-1 tree and the root-only tree (the target alone
batched) at every bucket. Measured throughput = B·G / measured step time, G the DP's expected tokens per step (the acceptance
of a request does not depend on the batch); a row's measured speedup is over the measured root-only step.
Sampling, the verify walk and KV compaction are not in the measured step (per request, not per token).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]  # see tuning/profile.py
sys.path.insert(0, str(_HERE.parent))

from sequoia_ray.arguments import (EXIT_BAD_INPUT, Parser, check_output, nonneg_float, one_line,  # noqa: E402
                                   positive_int)
from sequoia_ray.hardware import (BATCH_BUCKETS, Choice, HardwareProfile, ProfileError, choose, profile,  # noqa: E402
                                  time_steps)
from sequoia_ray.tree.plan import chain  # noqa: E402


def sizes(text: str) -> tuple[int, ...]:
    """``--sizes 1,2,4``: tree sizes, each a positive integer."""
    try:
        return tuple(positive_int(x.strip()) for x in text.split(",") if x.strip())
    except argparse.ArgumentTypeError as exc:
        raise argparse.ArgumentTypeError(f"{text!r}: {exc}; give tree sizes like 1,2,4,8") from None


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="tuning/batch_table.py", description=__doc__.splitlines()[0])
    p.add_argument("--smoke-test", action="store_true", help="the tiny random pair")
    p.add_argument("--target", default="default-target")
    p.add_argument("--draft", default="default-draft")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--draft-quantize", choices=["int8"])
    p.add_argument("--sizes", type=sizes, default=(1, 2, 4, 8, 16, 32),
                   help="tree sizes n profiled (the largest bounds B·n)")
    p.add_argument("--context", type=positive_int, default=64, help="cached tokens per request when timing")
    p.add_argument("--repeats", type=positive_int, default=3)
    p.add_argument("--max-depth", type=positive_int, default=8)
    p.add_argument("--temperature", type=nonneg_float, default=0.0)
    p.add_argument("--acceptance", default="measure", help="measure | builtin | a list '0.8,0.1' or JSON file")
    p.add_argument("--json", help="write the profile and the rows here")
    p.add_argument("--profile", help="a profile written by --json (or the store) to use instead of profiling")
    return p


def load(args):
    from sequoia_ray.local import LocalPair

    if args.smoke_test:
        return LocalPair.tiny(device="cpu")
    return LocalPair.load(args.target, args.draft, dtype=args.dtype, draft_quantize=args.draft_quantize,
                          device="cpu", progress=False)


def acceptance_of(args, pair):
    from sequoia_ray.acceptance import measure
    from sequoia_ray.profiling import BUILTIN_PROMPTS
    from sequoia_ray.tree.acceptance_vector import AcceptanceVector
    from sequoia_ray.tree.builtin import DEFAULT_ACCEPTANCE

    if args.acceptance == "builtin":
        return DEFAULT_ACCEPTANCE[min(DEFAULT_ACCEPTANCE, key=lambda t: abs(t - args.temperature))]
    if args.acceptance != "measure":
        return AcceptanceVector.parse(args.acceptance)
    prompts = [pair.encode(p.text, chat=p.chat) for p in BUILTIN_PROMPTS[:3]]
    return measure(pair.decoder, prompts, width=8, temperature=args.temperature, max_tokens=24, progress=False)[0]


def measured_row(pair, prof: HardwareProfile, best: Choice, one: Choice, args) -> dict:
    """The chosen tree, the batch-1 tree and the root-only tree at ``best.batch``, timed for real."""
    b, kw = best.batch, {"context": args.context, "repeats": args.repeats}
    target, draft = pair.target.model, pair.draft.model
    alone_s, chosen_s, one_s = time_steps(target, draft, [chain(0), best.plan, one.plan], b, **kw)
    return {"batch": b, "n": best.n, "d": best.d, "nodes": best.plan.n, "G": best.expected_tokens,
            "pred_step_ms": 1e3 * best.step_cost * prof.target_step_s, "meas_step_ms": 1e3 * chosen_s,
            "pred_tok_s": best.throughput / prof.target_step_s, "meas_tok_s": b * best.expected_tokens / chosen_s,
            "pred_speedup": best.predicted_speedup, "meas_speedup": best.expected_tokens * alone_s / chosen_s,
            "alone_tok_s": b / alone_s, "one_plan_n": one.n, "one_plan_meas_speedup": one.expected_tokens * alone_s / one_s,
            "one_plan_pred_speedup": _predicted_speedup(prof, one, b)}


def _predicted_speedup(prof: HardwareProfile, choice: Choice, batch: int) -> float:
    """``choice``'s tree at ``batch``: nan when B·n is beyond what the profile timed at that batch."""
    try:
        return (choice.expected_tokens * prof.step_cost(chain(0), batch)
                / prof.step_cost(choice.plan, batch, carried=choice.carried))
    except ProfileError:
        return float("nan")


def format_rows(rows: list[dict]) -> str:
    head = (f"{'B':>3s} {'n':>3s} {'d':>2s} {'G':>5s} {'step ms pred/meas':>17s} {'tok/s pred/meas':>15s} "
            f"{'speedup pred/meas':>17s} {'alone tok/s':>11s} {'batch-1 tree n=? pred/meas':>26s}")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['batch']:3d} {r['n']:3d} {r['d']:2d} {r['G']:5.2f} {r['pred_step_ms']:8.1f}/{r['meas_step_ms']:<8.1f} "
                     f"{r['pred_tok_s']:7.1f}/{r['meas_tok_s']:<7.1f} {r['pred_speedup']:8.2f}/{r['meas_speedup']:<8.2f} "
                     f"{r['alone_tok_s']:11.1f} {'n=' + str(r['one_plan_n']):>8s} "
                     f"{r['one_plan_pred_speedup']:8.2f}/{r['one_plan_meas_speedup']:<8.2f}")
    return "\n".join(lines)


def _given_profile(path: str) -> HardwareProfile:
    try:
        obj = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"--profile {path}: {one_line(exc)}") from None
    if not isinstance(obj, dict):
        raise ValueError(f"--profile {path}: expected a JSON object (a profile, or --json's output)")
    return HardwareProfile.from_dict(obj.get("profile", obj), source=path)


def main(argv: list[str] | None = None) -> int:
    from sequoia_ray.hardware import hardware_id
    from sequoia_ray.profiling import monotone
    from sequoia_ray.tree.dp import solve

    args = build_parser().parse_args(argv)
    try:  # every input read before the models load (a bad one failed after loading, or after profiling)
        given = _given_profile(args.profile) if args.profile else None
        if given is not None and not any(n <= max(given.t) for n in args.sizes):
            raise ValueError(f"--sizes {','.join(map(str, args.sizes))}: --profile {args.profile} ({given.hardware_id})"
                             f" has step costs up to {max(given.t)} tokens; give sizes within it")
        if args.acceptance not in ("measure", "builtin"):
            acceptance_of(args, None)
        if args.json:
            check_output(args.json, "--json")
    except (ValueError, OSError, ProfileError) as exc:
        print(f"tuning/batch_table.py: error: {one_line(exc)}", file=sys.stderr)
        return EXIT_BAD_INPUT
    sizes = args.sizes
    began = time.perf_counter()
    pair = load(args)
    loaded = time.perf_counter()
    if given is not None:
        prof = given
        sizes = tuple(n for n in sizes if n <= max(prof.t))
    else:
        prof = monotone(profile(pair.target.model, pair.draft.model, hardware=hardware_id(), budgets=sizes,
                                widths=sizes, context=args.context, repeats=args.repeats, dtype=args.dtype,
                                batches=BATCH_BUCKETS))
    if args.json:
        Path(args.json).write_text(json.dumps({"profile": prof.to_dict()}, indent=1))
    profiled = time.perf_counter()
    acceptance = acceptance_of(args, pair)
    table = solve(acceptance, max(sizes), args.max_depth)
    chosen = {b: choose(table, prof, sizes, batch=b)[0] for b in prof.buckets()}
    rows = [measured_row(pair, prof, best, chosen[1], args) for best in chosen.values()]
    print(f"{prof.hardware_id}, dtype {args.dtype}, draft {args.draft_quantize or 'not quantised'}, context "
          f"{args.context}, T={args.temperature}, p={[round(x, 3) for x in acceptance.rows[0]]}\n"
          f"target step {1e3 * prof.target_step_s:.1f} ms; load {loaded - began:.0f}s, profile {profiled - loaded:.0f}s, "
          f"measure {time.perf_counter() - profiled:.0f}s")
    print(format_rows(rows))
    if args.json:
        Path(args.json).write_text(json.dumps({"profile": prof.to_dict(), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
