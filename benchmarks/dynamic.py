"""Dynamic trees against the static plan, side by side in one run: tokens/step, tree nodes/step, tokens/s.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/dynamic.py [--real] [--limit 3] [--max-tokens 48]
        [--temperatures 0,0.6] [--thresholds 0.03,0.1] [--levels 0.25,0.5] [--extend 2]
        [--repeats 1] [--budget 16] [--depth 6] [--dtype bfloat16]

Default: the tiny pair (``LocalPair.tiny``: random weights, the draft is the target's first layers; a
minute). ``--real``: the default real pair of benchmarks/e2e.py. The plan is the built-in DP tree (budget n,
depth d) at each temperature. Every configuration decodes the same prompts (benchmarks/prompts.jsonl,
``--limit`` per kind) with the same seeds, interleaved prompt by prompt (load on a shared machine comes in
bursts; interleaving spreads them over every configuration): the static plan; pruning at each node threshold
(``DynamicTrees(threshold)``); the first node threshold with each level threshold (the tree stops at a level
worth less than a draft forward), then also extended (``--extend`` levels at most, a path extends when its
next node is worth node + level threshold). Per prompt: tokens/step,
tree nodes/step (root included, the trees actually verified), draft levels/step, tokens/s (wall time of the
whole generation); the table shows medians over prompts (and repeats: every other repeat runs the
configurations in reverse order) and the total tokens/s. JSON:
benchmarks/results/dynamic[-real].json.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import print_table, write_json  # noqa: E402

from sequoia_ray.config import SamplingParams  # noqa: E402
from sequoia_ray.draft import DraftWorker, DynamicTrees  # noqa: E402
from sequoia_ray.engine import SpeculativeDecoder  # noqa: E402
from sequoia_ray.local import LocalPair  # noqa: E402
from sequoia_ray.prompts import load_prompts  # noqa: E402
from sequoia_ray.target import TargetWorker  # noqa: E402
from sequoia_ray.tree.builtin import builtin_plan  # noqa: E402

HERE = Path(__file__).resolve().parent


class CountingDraft(DraftWorker):
    """A draft worker that counts the nodes and levels of the trees it grows."""

    def __init__(self, model, **kw) -> None:
        super().__init__(model, **kw)
        self.nodes = self.levels = self.trees = 0

    def grow(self, request_id, plan, commits=(), rule=None):
        tree = super().grow(request_id, plan, commits, rule)
        grown = tree.plan or plan
        self.nodes, self.levels, self.trees = self.nodes + grown.n, self.levels + grown.num_levels - 1, self.trees + 1
        return tree


def configurations(thresholds: list[float], levels: list[float], extend: int) -> list[tuple[str, DynamicTrees | None]]:
    """static; pruning at each node threshold; the first node threshold with each level threshold, without
    and with extension (a node beyond the plan pays a token and a level: extend_threshold = node + level)."""
    configs: list[tuple[str, DynamicTrees | None]] = [("static", None)]
    configs += [(f"prune {t:g}", DynamicTrees(t)) for t in thresholds]
    t = thresholds[0]
    configs += [(f"prune {t:g} level {lv:g}", DynamicTrees(t, level_threshold=lv)) for lv in levels]
    if extend:
        configs += [(f"prune {t:g} level {lv:g} extend {extend}", DynamicTrees(t, extend, t + lv, lv)) for lv in levels]
    return configs


def run_prompt(pair: LocalPair, plan, dynamic, prompt: list[int], params: SamplingParams) -> dict:
    draft = CountingDraft(pair.draft.model)
    # the rule through the decoder, on every step (unpruned_every 0), as served: the engine caps its extension to
    # the tokens left and the draft's context (a worker's own rule grew 7 levels for 3 tokens left)
    decoder = SpeculativeDecoder(TargetWorker(pair.target.model), draft, plan, tokenizer=pair.target.tokenizer,
                                 eos_ids=pair.target.eos_ids, max_context=pair.target.max_context,
                                 dynamic=None if dynamic is None else lambda _plan: dynamic, unpruned_every=0)
    start = time.perf_counter()
    out = decoder.generate(prompt, params)
    seconds = time.perf_counter() - start
    steps = out.stats.steps
    return {"tokens": out.stats.tokens, "steps": steps, "seconds": seconds, "tok/step": out.stats.tokens / steps,
            "nodes/step": draft.nodes / max(draft.trees, 1), "levels/step": draft.levels / max(draft.trees, 1),
            "tok/s": out.stats.tokens / seconds}


def summarise(name: str, temperature: float, runs: list[dict]) -> dict:
    def median(key: str) -> float:
        return statistics.median(r[key] for r in runs)

    tokens, seconds = sum(r["tokens"] for r in runs), sum(r["seconds"] for r in runs)
    return {"T": temperature, "config": name, "tok/step": median("tok/step"), "nodes/step": median("nodes/step"),
            "levels/step": median("levels/step"), "tok/s": median("tok/s"), "total tok/s": tokens / seconds,
            "tokens": tokens}


def encoded_prompts(pair: LocalPair, limit: int, real: bool) -> list[list[int]]:
    by_kind: dict[str, list[list[int]]] = {}
    for p in load_prompts(HERE / "prompts.jsonl"):
        if len(by_kind.setdefault(p.kind, [])) < limit:
            by_kind[p.kind].append(pair.encode(p.text, chat=p.chat and real))
    return [ids for kind in sorted(by_kind) for ids in by_kind[kind]]


def real_pair(dtype: str) -> LocalPair:
    """e2e.py's default real pair, as served: its draft int8 on the CPU (``e2e.pair_options``), the draft's head
    restricted as ``LocalPair.load`` does by default."""
    from e2e import pair_options

    quantize, device = pair_options("auto", "auto")
    return LocalPair.load(dtype=dtype, draft_quantize=quantize, device=device)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--real", action="store_true", help="the default real pair instead of the tiny one")
    ap.add_argument("--dtype", default="bfloat16", help="dtype of the real pair")
    ap.add_argument("--limit", type=int, default=3, help="prompts per kind")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--temperatures", default="0,0.6")
    ap.add_argument("--thresholds", default="0.03,0.1", help="node thresholds (expected tokens a node must be worth)")
    ap.add_argument("--levels", default="0.25,0.5", help="level thresholds (worth a draft forward must have)")
    ap.add_argument("--extend", type=int, default=2, help="extra levels beyond the plan (0: no extension)")
    ap.add_argument("--repeats", type=int, default=1, help="passes over the prompts (odd passes in reverse order)")
    ap.add_argument("--budget", type=int, default=16)
    ap.add_argument("--depth", type=int, default=6)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)

    pair = real_pair(args.dtype) if args.real else LocalPair.tiny(device="cpu")
    prompts = encoded_prompts(pair, args.limit, args.real)
    configs = configurations([float(t) for t in args.thresholds.split(",")],
                             [float(x) for x in args.levels.split(",")], args.extend)
    rows = []
    record = {"args": vars(args) | {"out": str(args.out)}, "pair": "real" if args.real else "tiny", "runs": []}
    for temperature in [float(t) for t in args.temperatures.split(",")]:
        plan = builtin_plan(temperature, args.budget, args.depth).plan
        print(f"T={temperature}: plan of {plan.n} nodes, {plan.num_levels} levels", flush=True)
        for name, dynamic in configs:  # warm-up: first-call kernel selection is not part of any config's time
            run_prompt(pair, plan, dynamic, prompts[0][:8], SamplingParams(max_tokens=4, temperature=temperature))
        runs: dict[str, list[dict]] = {name: [] for name, _ in configs}
        for repeat in range(args.repeats):  # every other repeat in reverse order: no configuration always goes first
            order = configs if repeat % 2 == 0 else configs[::-1]
            for i, prompt in enumerate(prompts):  # configurations interleaved: a burst of load hits them all alike
                params = SamplingParams(max_tokens=args.max_tokens, temperature=temperature, seed=i, ignore_eos=True)
                for name, dynamic in order:
                    runs[name].append(run_prompt(pair, plan, dynamic, prompt, params))
        for name, dynamic in configs:
            rows.append(summarise(name, temperature, runs[name]))
            record["runs"].append({"T": temperature, "config": name, "dynamic": dynamic and vars(dynamic),
                                   "plan_nodes": plan.n, "plan_levels": plan.num_levels, "per_prompt": runs[name]})
            print("  " + "  ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in rows[-1].items()),
                  flush=True)
    print()
    print_table(rows, ["T", "config", "tok/step", "nodes/step", "levels/step", "tok/s", "total tok/s", "tokens"])
    record["rows"] = rows
    write_json("dynamic-real" if args.real else "dynamic", record, args.out)


if __name__ == "__main__":
    main()
