"""Linear kernels side by side in one run: transformers' ``F.linear`` (aten) against weights packed once for
oneDNN (``sequoia_ray.models.packed_linear``), on the same pair, prompts and plan.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/linears.py [--tiny] [--limit 4] [--max-tokens 48]
        [--sizes 1,8,16,32] [--repeats 7] [--context 256] [--budget 16] [--depth 6]

Two parts, both interleaved (aten, packed, aten, packed, ...) so load on a shared machine hits each alike:
1. the target's forward of q tree tokens at a cached context (median ms over ``--repeats``), and the largest
   difference between the two kernels' logits;
2. greedy generation of ``benchmarks/prompts.jsonl`` (``--limit``): the target alone and the built-in tree
   (n = ``--budget``, d = ``--depth``), tokens/s per prompt (median) and whether the texts are identical.
Default: the real pair as served (bf16 target, int8 draft: the draft is int8 in both columns, so only the
target's kernels differ); ``--tiny``: the tiny pair in fp32 with ``packed`` forced. Table + JSON
(benchmarks/results/linears.json).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import print_table, write_json  # noqa: E402

from sequoia_ray.config import SamplingParams  # noqa: E402
from sequoia_ray.local import LocalPair  # noqa: E402
from sequoia_ray.models.packed_linear import pack_linears, packed_count  # noqa: E402
from sequoia_ray.models.tree_lm import KVSession  # noqa: E402
from sequoia_ray.prompts import load_prompts  # noqa: E402
from sequoia_ray.tree.builtin import builtin_plan  # noqa: E402
from sequoia_ray.tree.plan import chain  # noqa: E402

HERE = Path(__file__).resolve().parent
KERNELS = ("aten", "packed")


def load(args) -> dict[str, LocalPair]:
    if args.tiny:
        pairs = {k: LocalPair.tiny() for k in KERNELS}
        pack_linears(pairs["packed"].target.model, "packed")
        pack_linears(pairs["packed"].draft.model, "packed")
        return pairs
    return {k: LocalPair.load(dtype="bfloat16", draft_quantize="int8", progress=False, linears=k) for k in KERNELS}



def forwards(pairs, sizes, context: int, repeats: int) -> list[dict]:
    gen = torch.Generator().manual_seed(0)
    vocab = pairs["aten"].target.model.config.vocab_size
    prompt = torch.randint(5, vocab, (context,), generator=gen)
    sessions = {}
    for k, pair in pairs.items():
        sessions[k] = KVSession(pair.target.model)
        sessions[k].hidden(prompt, torch.arange(context))
    rows = []
    for q in sizes:
        tokens = torch.randint(5, vocab, (q,), generator=gen)
        positions, allowed = torch.arange(context, context + q), torch.ones(q, q, dtype=torch.bool).tril_()
        times, logits = {k: [] for k in pairs}, {}
        for r in range(repeats + 1):  # the first round warms up
            for k in (KERNELS if r % 2 == 0 else KERNELS[::-1]):
                start = time.perf_counter()
                logits[k] = sessions[k].forward(tokens, positions, allowed)
                if r:
                    times[k].append(time.perf_counter() - start)
                sessions[k].truncate(context)
        aten, packed = (1000 * statistics.median(times[k]) for k in KERNELS)
        rows.append({"q": q, "aten ms": aten, "packed ms": packed, "speedup": aten / packed,
                     "max |logit diff|": float((logits["aten"] - logits["packed"]).abs().max()),
                     "argmax equal": bool((logits["aten"].argmax(-1) == logits["packed"].argmax(-1)).all())})
    return rows


def generation(pairs, prompts, plan, max_tokens: int) -> list[dict]:
    decoders = {(k, mode): pair.decoder(plan if mode == "tree" else chain(0), speculate=mode == "tree")
                for k, pair in pairs.items() for mode in ("alone", "tree")}
    for (k, _), d in decoders.items():
        d.generate(pairs[k].encode("warm up", chat=False), SamplingParams(max_tokens=4))
    runs = {key: [] for key in decoders}
    for i, p in enumerate(prompts):
        order = list(decoders) if i % 2 == 0 else list(decoders)[::-1]
        for key in order:
            ids = pairs[key[0]].encode(p.text, chat=p.chat)
            start = time.perf_counter()
            out = decoders[key].generate(ids, SamplingParams(max_tokens=max_tokens))
            runs[key].append({"tok/s": out.stats.tokens / (time.perf_counter() - start), "text": out.text,
                              "tok/step": out.stats.tokens_per_step})
    rows = []
    for mode in ("alone", "tree"):
        a, b = runs[("aten", mode)], runs[("packed", mode)]
        med = {k: statistics.median(r["tok/s"] for r in runs[(k, mode)]) for k in KERNELS}
        rows.append({"mode": mode, "aten tok/s": med["aten"], "packed tok/s": med["packed"],
                     "speedup": med["packed"] / med["aten"],
                     "tok/step": statistics.median(r["tok/step"] for r in b),
                     "same text": f"{sum(x['text'] == y['text'] for x, y in zip(a, b))}/{len(a)}"})
    alone, tree = runs[("packed", "alone")], runs[("packed", "tree")]
    rows.append({"mode": "tree = alone (packed)", "aten tok/s": float("nan"), "packed tok/s": float("nan"),
                 "speedup": float("nan"), "tok/step": float("nan"),
                 "same text": f"{sum(x['text'] == y['text'] for x, y in zip(alone, tree))}/{len(alone)}"})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--limit", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--sizes", default="1,8,16,32")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--budget", type=int, default=16)
    ap.add_argument("--depth", type=int, default=6)
    args = ap.parse_args()
    torch.set_num_threads(torch.get_num_threads())
    pairs = load(args)
    print({k: packed_count(p.target.model) for k, p in pairs.items()}, "packed target layers")
    fwd = forwards(pairs, [int(s) for s in args.sizes.split(",")], args.context, args.repeats)
    print_table(fwd, list(fwd[0]))
    prompts = load_prompts(HERE / "prompts.jsonl")[: args.limit]
    plan = builtin_plan(0.0, args.budget, args.depth).plan
    gen = generation(pairs, prompts, plan, args.max_tokens)
    print_table(gen, list(gen[0]))
    write_json("linears" + ("-tiny" if args.tiny else ""), {
        "args": vars(args), "threads": torch.get_num_threads(), "torch": torch.__version__,
        "packed target layers": {k: packed_count(p.target.model) for k, p in pairs.items()},
        "forward": fwd, "generation": gen})


if __name__ == "__main__":
    main()
