"""End to end on the real pair: target alone vs transformers' assisted generation vs Sequoia trees.

    .venv/bin/python benchmarks/e2e.py [--dtype bfloat16] [--limit 6] [--max-tokens 64] [--temperatures 0,0.6]
                                       [--device auto|cpu|cuda]

Same prompts (benchmarks/prompts.jsonl: code and prose) for every configuration, in one run. For each
temperature: the target alone; assisted generation with the same draft (num_assistant_tokens 3, 5, 8);
ours with fixed plans (chain, SpecInfer k×L, DP trees of several budgets) and with the plan chosen for
this machine (profile t(n) and c here, DP on the measured acceptance vector, argmax of predicted speedup).
Prints tokens/s (total tokens ÷ total wall time, prefill included), tokens per step and the ratio to the
target alone, split by prompt kind; writes benchmarks/results/e2e.json.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import print_table, write_json  # noqa: E402

from sequoia_ray.config import SamplingParams  # noqa: E402
from sequoia_ray.devices import DEVICE_CHOICES, synchronize  # noqa: E402
from sequoia_ray.hardware import accelerator_name, choose, hardware_id, profile  # noqa: E402
from sequoia_ray.local import LocalPair  # noqa: E402
from sequoia_ray.prompts import load_prompts  # noqa: E402
from sequoia_ray.tree.acceptance_vector import AcceptanceVector  # noqa: E402
from sequoia_ray.tree.builtin import DEFAULT_ACCEPTANCE  # noqa: E402
from sequoia_ray.tree.dp import solve  # noqa: E402
from sequoia_ray.tree.plan import chain, specinfer  # noqa: E402

HERE = Path(__file__).resolve().parent


def run_ours(pair: LocalPair, plan, prompts, temperature: float, max_tokens: int, speculate: bool = True):
    decoder = pair.decoder(plan, speculate=speculate)
    tokens = steps = 0
    seconds = 0.0
    for i, prompt in enumerate(prompts):
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=i)
        start = time.perf_counter()
        out = decoder.generate(prompt, params)
        seconds += time.perf_counter() - start
        tokens += out.stats.tokens
        steps += out.stats.steps
    return tokens, seconds, steps


def run_assisted(pair: LocalPair, k: int, prompts, temperature: float, max_tokens: int):
    target, draft = pair.target.model, pair.draft.model
    device = target.device
    draft.generation_config.num_assistant_tokens = k
    draft.generation_config.num_assistant_tokens_schedule = "constant"
    tokens, seconds = 0, 0.0
    for i, prompt in enumerate(prompts):
        torch.manual_seed(i)  # transformers' sampling reads the global generator
        ids = torch.tensor([prompt], device=device)
        sample = {"do_sample": True, "temperature": temperature, "top_p": 1.0, "top_k": 0} if temperature > 0 else {
            "do_sample": False}
        start = time.perf_counter()
        out = target.generate(ids, attention_mask=torch.ones_like(ids), assistant_model=draft,
                              max_new_tokens=max_tokens, eos_token_id=list(pair.target.eos_ids),
                              pad_token_id=pair.target.eos_ids[0], **sample)
        synchronize(device)  # generate returns before a GPU has finished; our decoder returns python ints
        seconds += time.perf_counter() - start
        tokens += out.shape[1] - ids.shape[1]
    return tokens, seconds, None


def _hardware(pair: LocalPair) -> str:
    return hardware_id(accelerator_name(pair.target.model.device))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--draft-quantize", default=None, choices=[None, "int8"])
    ap.add_argument("--limit", type=int, default=6, help="prompts per kind")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--temperatures", default="0,0.6")
    ap.add_argument("--acceptance", action="append", default=[], help="T=file measured vectors, e.g. 0=acc.json")
    ap.add_argument("--budgets", default="8,16,32", help="tree sizes n of the fixed Sequoia plans")
    ap.add_argument("--depths", default="6", help="max depths d of the fixed Sequoia plans")
    ap.add_argument("--device", default="auto", choices=DEVICE_CHOICES, help="auto = a GPU if torch sees one")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()

    pair = LocalPair.load(dtype=args.dtype, draft_quantize=args.draft_quantize, device=args.device)
    print(f"target on {pair.target.model.device}, draft on {pair.draft.model.device}", flush=True)
    prompts = load_prompts(HERE / "prompts.jsonl")
    by_kind = defaultdict(list)
    for p in prompts:
        if len(by_kind[p.kind]) < args.limit:
            by_kind[p.kind].append(pair.encode(p.text, chat=p.chat))
    acceptance = dict(DEFAULT_ACCEPTANCE)
    for item in args.acceptance:
        t, path = item.split("=", 1)
        acceptance[float(t)] = AcceptanceVector.parse(path)

    print("profiling t(n) and c on this machine ...", flush=True)
    prof = profile(pair.target.model, pair.draft.model, hardware=_hardware(pair), budgets=(1, 2, 4, 8, 12, 16, 24, 32, 48, 64),
                   widths=(1, 2, 4, 8, 16, 32), context=128, repeats=3, dtype=args.dtype)
    print(f"t(n) = {prof.t}\nc(w) = {prof.c}\ntarget step = {prof.target_step_s * 1000:.0f} ms")

    rows, record = [], {"profile": prof.to_dict(), "args": vars(args) | {"out": str(args.out)}, "results": []}
    for temperature in [float(x) for x in args.temperatures.split(",")]:
        acc = acceptance[min(acceptance, key=lambda t: abs(t - temperature))]
        table = solve(acc, 64, 10)
        chosen, _ = choose(table, prof, budgets=(2, 4, 6, 8, 12, 16, 24, 32, 48, 64))
        configs = [("target alone", lambda ps: run_ours(pair, chain(0), ps, temperature, args.max_tokens, False))]
        configs += [(f"assisted k={k}", lambda ps, k=k: run_assisted(pair, k, ps, temperature, args.max_tokens))
                    for k in (3, 5, 8)]
        plans = [("chain 4", chain(4)), ("specinfer 2x4", specinfer(2, 4))]
        plans += [(f"sequoia n={n} d={d}", table.tree(n, d)) for d in map(int, args.depths.split(","))
                  for n in map(int, args.budgets.split(","))]
        plans += [(f"sequoia chosen n={chosen.n} d={chosen.d}", chosen.plan)]
        configs += [(name, lambda ps, plan=plan: run_ours(pair, plan, ps, temperature, args.max_tokens))
                    for name, plan in plans]
        base = {}
        for name, fn in configs:
            fn([by_kind["code"][0][:8]])  # warm-up: first-call kernel selection is not part of any config's time
            for kind, ps in by_kind.items():
                tokens, seconds, steps = fn(ps)
                tps = tokens / seconds
                base.setdefault(kind, tps)
                row = {"T": temperature, "kind": kind, "config": name, "tok/s": tps, "x target": tps / base[kind],
                       "tok/step": tokens / steps if steps else "-", "tokens": tokens}
                rows.append(row)
                print(f"  {temperature} {kind:5s} {name:28s} {tps:6.2f} tok/s  x{tps / base[kind]:.2f}", flush=True)
        record["results"].append({"temperature": temperature, "acceptance": acc.to_dict(),
                                  "chosen": {"n": chosen.n, "d": chosen.d, "G": chosen.expected_tokens,
                                             "predicted_speedup": chosen.predicted_speedup}})
    for kind in by_kind:
        for temperature in sorted({r["T"] for r in rows}):
            sub = [r for r in rows if r["kind"] == kind and r["T"] == temperature]
            best_assisted = max(r["tok/s"] for r in sub if r["config"].startswith("assisted"))
            for r in sub:
                r["x assisted"] = r["tok/s"] / best_assisted
    print()
    print_table(rows, ["T", "kind", "config", "tok/s", "x target", "x assisted", "tok/step", "tokens"])
    record["rows"] = rows
    write_json("e2e", record, args.out)


if __name__ == "__main__":
    main()
