"""Does acceptance depend on depth? The profile's pooled vector against depth-indexed rows, on real trees.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/acceptance_depth.py [--real] [--max-tokens 64]
        [--temperatures 0,0.6] [--width 8] [--depth 5] [--trees 4:4,8:5,16:6,32:8,8:10] [--prompts FILE]

The profile measures p[k] on a star (the root and ``width`` children: ``sequoia_ray.acceptance``), so its vector
is the acceptance of a step's first token, and the DP applies it at every depth as if acceptances along a path
were independent. If they are positively correlated (text the draft follows stays easy for a while), deeper
trees accept more than G(n, d) says. This measures, per temperature, on the profile's own prompts
(``sequoia_ray.profiling.BUILTIN_PROMPTS``, or ``--prompts``):

1. a *spine* tree: ``width`` children at the root and at every rank-1 child, ``depth`` levels deep. Its walks
   give the rank accepted at each depth on the rank-1 path: row 0 is what the star measures, row j the
   acceptance at depth j given the j tokens before it were accepted (each the draft's first choice);
2. for each of ``--trees`` (n:d, the DP's tree under the pooled row), the tokens per step decoded for real, and
   from its walks the rank-1 acceptance at each depth given the path so far was accepted (by any rank);
3. G(n, d) of each tree under the pooled row (what the planner predicts today) and under the depth rows.

Greedy texts do not depend on the tree, so at T = 0 every tree decodes the same text and the differences are
the model's (and where steps happen to start). Columns: ``G err`` = measured tokens per step / G - 1.
JSON: benchmarks/results/acceptance-depth[-real].json. Default: the tiny pair (seconds; its numbers mean nothing).
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import print_table, write_json  # noqa: E402

from sequoia_ray.config import SamplingParams  # noqa: E402
from sequoia_ray.local import LocalPair  # noqa: E402
from sequoia_ray.profiling import BUILTIN_PROMPTS  # noqa: E402
from sequoia_ray.prompts import load_prompts  # noqa: E402
from sequoia_ray.tree.acceptance_vector import AcceptanceVector  # noqa: E402
from sequoia_ray.tree.dp import solve  # noqa: E402
from sequoia_ray.tree.plan import TreePlan, expected_tokens, from_nested  # noqa: E402


def spine(width: int, depth: int) -> TreePlan:
    """``width`` children at the root and at each rank-1 child, ``depth`` levels below the root."""
    node: list = []
    for _ in range(depth):
        node = [node] + [[] for _ in range(width - 1)]
    return from_nested(node)


def decode(pair: LocalPair, plan: TreePlan, prompts: list[list[int]], temperature: float, max_tokens: int
           ) -> tuple[float, list[tuple[tuple[int, int], ...]]]:
    """(tokens per step, every step's walk: (children, rank accepted) per visited inner node, root first)."""
    decoder, walks = pair.decoder(plan), []
    decoder.on_verdict = lambda _plan, verdict, _params: walks.append(verdict.ranks)
    tokens = steps = 0
    for i, prompt in enumerate(prompts):
        out = decoder.generate(prompt, SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=i))
        tokens, steps = tokens + out.stats.tokens, steps + out.stats.steps
    return tokens / steps, walks


def depth_rows(walks, width: int, depth: int) -> AcceptanceVector:
    """Row j: the ranks accepted at the j-th visited inner node of the walks (its depth), the last row every
    deeper one; a walk of the spine visits depth j only when ranks 1 were accepted above it."""
    counts = [Counter() for _ in range(depth)]
    for walk in walks:
        for j, (_, rank) in enumerate(walk):
            counts[min(j, depth - 1)][rank] += 1
    if any(sum(c.values()) == 0 for c in counts):
        raise SystemExit(f"acceptance_depth.py: no walk reached depth {depth - 1}; lower --depth or raise --max-tokens")
    rows = [[c[k] / sum(c.values()) for k in range(1, width + 1)] for c in counts]
    return AcceptanceVector.from_rows(rows, [c[0] / sum(c.values()) for c in counts])


def rank1_by_depth(walks, depth: int) -> list[tuple[float, int]]:
    """Per depth < ``depth``: (share of visited inner nodes that accepted rank 1, nodes visited)."""
    tried, first = Counter(), Counter()
    for walk in walks:
        for j, (_, rank) in enumerate(walk[:depth]):
            tried[j] += 1
            first[j] += rank == 1
    return [(first[j] / tried[j], tried[j]) for j in sorted(tried)]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--real", action="store_true", help="the default real pair (bf16 target, int8 draft)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--temperatures", default="0,0.6")
    ap.add_argument("--width", type=int, default=8, help="children of each spine node (the profile's width)")
    ap.add_argument("--depth", type=int, default=5, help="levels of the spine below the root (depth rows)")
    ap.add_argument("--trees", default="4:4,8:5,16:6,32:8,8:10", help="n:d of the DP trees decoded for real")
    ap.add_argument("--prompts", help="a prompt file (default: the profile's built-in prompts)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    trees = [tuple(int(x) for x in t.split(":")) for t in args.trees.split(",")]
    pair = (LocalPair.load(dtype="bfloat16", draft_quantize="int8", progress=False) if args.real
            else LocalPair.tiny(device="cpu"))
    texts = load_prompts(args.prompts) if args.prompts else BUILTIN_PROMPTS
    prompts = [pair.encode(p.text, chat=p.chat) for p in texts]
    rows, record = [], {"args": vars(args) | {"out": str(args.out)}, "temperatures": []}
    for temperature in (float(t) for t in args.temperatures.split(",")):
        _, walks = decode(pair, spine(args.width, args.depth), prompts, temperature, args.max_tokens)
        depth = depth_rows(walks, args.width, args.depth)
        pooled = AcceptanceVector.from_p(depth.rows[0], depth.reject[0])  # what the star measures
        spine_p1 = rank1_by_depth(walks, args.depth)
        print(f"T={temperature}: spine rank-1 acceptance by depth "
              + " ".join(f"{p:.2f} ({n})" for p, n in spine_p1), flush=True)
        table = solve(pooled, max(n for n, _ in trees), max(d for _, d in trees))
        per_tree = []
        for n, d in trees:
            plan = table.tree(n, d)
            measured, tree_walks = decode(pair, plan, prompts, temperature, args.max_tokens)
            g_pooled, g_depth = expected_tokens(plan, pooled), expected_tokens(plan, depth)
            row = {"T": temperature, "tree": f"n={n} d={d}", "nodes": plan.n, "levels": plan.num_levels,
                   "tok/step": measured, "G pooled": g_pooled, "G err pooled": measured / g_pooled - 1,
                   "G depth": g_depth, "G err depth": measured / g_depth - 1}
            rows.append(row)
            per_tree.append(row | {"rank1 by depth": rank1_by_depth(tree_walks, plan.num_levels - 1)})
            print(f"  {row['tree']}: {measured:.2f} tokens/step; G {g_pooled:.2f} pooled, {g_depth:.2f} by depth",
                  flush=True)
        record["temperatures"].append({"T": temperature, "depth rows": [list(r) for r in depth.rows],
                                       "reject": list(depth.reject), "spine rank1 by depth": spine_p1,
                                       "walks": len(walks), "trees": per_tree})
    print_table(rows, ["T", "tree", "nodes", "tok/step", "G pooled", "G err pooled", "G depth", "G err depth"])
    write_json("acceptance-depth-real" if args.real else "acceptance-depth", record | {"rows": rows}, args.out)


if __name__ == "__main__":
    main()
