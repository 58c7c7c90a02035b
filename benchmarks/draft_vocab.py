"""The draft's LM head on the lowest ids (``sequoia_ray.models.draft_vocab``) against the full head, side by side.

    .venv/bin/python benchmarks/draft_vocab.py [--tiny] [--sizes 32768,65536] [--limit 4] [--rounds 2]
                                               [--max-tokens 64] [--temperatures 0,0.6] [--plan builtin|n8d10]

One draft model, its head switched per run between the full head and a ``SubsetHead`` per size (each made by
loading the draft with that ``draft_vocab``, so quantised exactly as served); the target is shared. Per
temperature and prompt kind (``--limit`` prompts of each kind of ``benchmarks/prompts.jsonl``, ``--rounds``
rounds, the heads in rotating order per prompt): total tokens/s, tokens per step, the draft's and the target's
time per step, the paired median of each subset's time over the full head's, whether greedy tokens are the
full head's (they must be: both are the target's), and the share of the generated tokens a subset leaves out
(what the draft could not have proposed). Besides, one draft forward of 1 token at a 256-token context (the
draft level of a chain) per head, medians of 30. Table + JSON (``results/draft-vocab.json``).
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import print_table, write_json  # noqa: E402

from sequoia_ray.config import SamplingParams  # noqa: E402
from sequoia_ray.local import LocalPair  # noqa: E402
from sequoia_ray.models.draft_vocab import restrict_head  # noqa: E402
from sequoia_ray.models.loading import DEFAULT_DRAFT, load_model  # noqa: E402
from sequoia_ray.models.tree_lm import KVSession  # noqa: E402
from sequoia_ray.prompts import load_prompts  # noqa: E402
from sequoia_ray.tree.builtin import builtin_acceptance, builtin_plan  # noqa: E402
from sequoia_ray.tree.dp import solve  # noqa: E402

PROMPTS = Path(__file__).resolve().parent / "prompts.jsonl"
FULL = "full"


def heads(pair: LocalPair, sizes: list[int], *, tiny: bool, quantize: str | None) -> dict[str, torch.nn.Module]:
    """The full head and one subset head per size, each as loading the draft with that size makes it."""
    out = {FULL: pair.draft.model.get_output_embeddings()}
    for size in sizes:
        if tiny:
            model = copy.deepcopy(pair.draft.model)
            restrict_head(model, pair.draft.tokenizer, size)
        else:
            model = load_model(DEFAULT_DRAFT, dtype="bfloat16", quantize=quantize, progress=False, draft_vocab=size)
            model = model.model
        out[str(size)] = model.get_output_embeddings()
    return out


def kept(head) -> set[int] | None:
    ids = getattr(head, "ids", None)
    return None if ids is None else set(ids.tolist())


def level_ms(model, repeats: int = 30, context: int = 256) -> float:
    """One draft forward of 1 token after ``context`` cached tokens, head included (median ms)."""
    session = KVSession(model)
    vocab = model.get_input_embeddings().num_embeddings
    gen = torch.Generator().manual_seed(0)
    session.hidden(torch.randint(0, vocab, (context,), generator=gen), torch.arange(context))
    token, position = torch.tensor([5]), torch.tensor([context])
    times = []
    for _ in range(repeats + 3):
        t = time.perf_counter()
        session.head(session.hidden(token, position)[-1:])
        times.append(time.perf_counter() - t)
        session.truncate(context)
    return 1e3 * statistics.median(times[3:])


def decode(pair: LocalPair, all_heads: dict, plan, prompts: dict, temperatures: list[float], rounds: int,
           max_tokens: int) -> tuple[list[dict], dict]:
    model, names = pair.draft.model, list(all_heads)
    dec = pair.decoder(plan)
    acc = {}  # (T, kind, head) -> totals
    ratios = {}  # (T, kind, head) -> paired time ratios over the full head
    same = {}
    for temperature in temperatures:
        for kind, encoded in prompts.items():
            for r in range(rounds):
                for i, ids in enumerate(encoded):
                    params = SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=1000 * r + i)
                    shift = (r * len(encoded) + i) % len(names)
                    got = {}
                    for name in names[shift:] + names[:shift]:
                        model.set_output_embeddings(all_heads[name])
                        g = dec.generate(ids, params)
                        got[name] = g
                        a = acc.setdefault((temperature, kind, name), dict(steps=0, tokens=0, total=0.0, draft=0.0,
                                                                          verify=0.0, outside=0, generated=0))
                        s = g.stats
                        a["steps"] += s.steps
                        a["tokens"] += s.tokens
                        a["total"] += s.total_s
                        a["draft"] += s.draft_s
                        a["verify"] += s.verify_s
                    for name, g in got.items():
                        ratio = g.stats.total_s / got[FULL].stats.total_s
                        ratios.setdefault((temperature, kind, name), []).append(ratio)
                        keep = kept(all_heads[name])
                        a = acc[(temperature, kind, name)]
                        a["generated"] += len(got[FULL].token_ids)
                        a["outside"] += 0 if keep is None else sum(t not in keep for t in got[FULL].token_ids)
                        if temperature == 0:
                            same.setdefault((kind, name), []).append(g.token_ids == got[FULL].token_ids)
    model.set_output_embeddings(all_heads[FULL])
    rows = []
    for (temperature, kind, name), a in acc.items():
        r = sorted(ratios[(temperature, kind, name)])
        rows.append({"T": temperature, "kind": kind, "head": name, "tok/s": a["tokens"] / a["total"],
                     "tok/step": a["tokens"] / a["steps"], "draft ms/step": 1e3 * a["draft"] / a["steps"],
                     "target ms/step": 1e3 * a["verify"] / a["steps"],
                     "time / full": statistics.median(r), "q1": r[len(r) // 4], "q3": r[(3 * len(r)) // 4],
                     "left out": a["outside"] / max(1, a["generated"]),
                     "same tokens": (f"{sum(same[(kind, name)])}/{len(same[(kind, name)])}"
                                     if temperature == 0 else "-")})
    return rows, {f"{k[0]}/{k[1]}": v for k, v in same.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="the tiny random pair (seconds; a smoke run)")
    ap.add_argument("--sizes", default="32768,65536", help="subset sizes (ids kept) to compare with the full head")
    ap.add_argument("--limit", type=int, default=4, help="prompts per kind")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--temperatures", default="0")
    ap.add_argument("--plan", default="builtin", choices=["builtin", "n8d10"],
                    help="the tree: the built-in plan, or the DP's 8-node tree of at most 10 levels")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    sizes = [int(x) for x in args.sizes.split(",")]
    temperatures = [float(x) for x in args.temperatures.split(",")]
    quantize = None if args.tiny else "int8"
    pair = LocalPair.tiny(device="cpu") if args.tiny else LocalPair.load(dtype="bfloat16", draft_quantize=quantize,
                                                                       progress=False, draft_vocab=None)
    if args.tiny:
        sizes = [min(s, 40) for s in sizes[:1]] + sizes[1:2]  # the tiny vocabulary has 97 ids
    all_heads = heads(pair, sizes, tiny=args.tiny, quantize=quantize)
    plan = builtin_plan(0.0).plan if args.plan == "builtin" else solve(builtin_acceptance(0.0), 64, 10).tree(8, 10)
    prompts: dict[str, list[list[int]]] = {}
    for p in load_prompts(PROMPTS):
        if len(prompts.setdefault(p.kind, [])) < args.limit:
            prompts[p.kind].append(pair.encode(p.text, chat=p.chat))
    levels = []
    for name, head in all_heads.items():
        pair.draft.model.set_output_embeddings(head)
        rows = len(kept(head)) if kept(head) is not None else head.out_features
        levels.append({"head": name, "kept ids": rows, "draft level ms": level_ms(pair.draft.model)})
    pair.draft.model.set_output_embeddings(all_heads[FULL])
    print_table(levels, ["head", "kept ids", "draft level ms"])
    rows, same = decode(pair, all_heads, plan, prompts, temperatures, args.rounds, args.max_tokens)
    print()
    print_table(rows, ["T", "kind", "head", "tok/s", "tok/step", "draft ms/step", "target ms/step", "time / full",
                       "q1", "q3", "left out", "same tokens"])
    write_json("draft-vocab" + ("-tiny" if args.tiny else ""),
               {"args": vars(args) | {"out": str(args.out)}, "plan": list(plan.parents), "levels": levels,
                "rows": rows, "same_tokens": same}, args.out)


if __name__ == "__main__":
    main()
