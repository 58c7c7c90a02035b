"""The draft's draws on its head's kept logits against draws on the whole vocabulary, side by side in one process.

    .venv/bin/python benchmarks/draft_draws.py [--tiny] [--rounds 12] [--temperatures 0,0.6]

A draft whose head keeps part of the vocabulary (``sequoia_ray.models.draft_vocab``, 65,536 of the real draft's
151,936 ids) draws its children on the kept logits ([K]) and maps positions to ids (``kept_logits``); before,
its head scattered them into [V] logits, -inf elsewhere, and every top-k, softmax and nucleus ran over V. Both
ways run here on the same worker (``DraftWorker`` of the int8 draft, as served; ``--tiny``: the tiny draft with a
40-id head), switched per grow and alternated: for several batches, trees and tree rules, the median time of a
grow (commit the root, then grow the tree), the paired median of kept / whole with its quartiles, and whether the
two ways grew the same trees (greedy: they must). Table + JSON (``benchmarks/results/draft-draws.json``).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import print_table, write_json  # noqa: E402

from sequoia_ray import draft as draft_module  # noqa: E402
from sequoia_ray.config import SamplingParams  # noqa: E402
from sequoia_ray.draft import DraftWorker, DynamicTrees  # noqa: E402
from sequoia_ray.local import LocalPair  # noqa: E402
from sequoia_ray.prompts import load_prompts  # noqa: E402
from sequoia_ray.tree.plan import TreePlan, chain, k_ary  # noqa: E402

PROMPTS = Path(__file__).resolve().parent / "prompts.jsonl"
KEPT = draft_module.kept_logits


def whole(model, hidden, head):  # the whole head's logits, -inf outside the kept ids: the draws before
    return head(hidden), None


def use(way: str) -> None:
    """The draft worker's logits from here on: ``kept`` (as served) or ``whole`` (as before)."""
    draft_module.kept_logits = KEPT if way == "kept" else whole


CASES = [  # (requests, tree, rule)
    (1, chain(4), None),
    (8, chain(4), None),
    (1, k_ary(2, 3), None),
    (1, chain(4), DynamicTrees(0.0, extend=2, extend_threshold=0.0)),
]


def load(tiny: bool) -> LocalPair:
    if tiny:
        from sequoia_ray.models.draft_vocab import restrict_head

        pair = LocalPair.tiny(device="cpu")
        assert restrict_head(pair.draft.model, pair.draft.tokenizer, 40)
        return pair
    return LocalPair.load(dtype="bfloat16", draft_quantize="int8", progress=False)


class Grower:
    """``requests`` requests on one draft worker; ``grow`` commits each tree's root with its first child as the
    next token (a step that accepted no child and drew that token), then grows the next trees."""

    def __init__(self, model, prompts: list[list[int]], requests: int, plan: TreePlan, rule, temperature: float):
        self.worker, self.plan = DraftWorker(model, dynamic=rule), plan
        params = SamplingParams(max_tokens=64, temperature=temperature)
        self.ids = [f"r{i}" for i in range(requests)]
        for i, rid in enumerate(self.ids):
            self.worker.start(rid, prompts[i % len(prompts)], params, i)
        self.trees: list = []

    def grow(self) -> None:
        calls = []
        for rid, tree in zip(self.ids, self.trees or [None] * len(self.ids)):
            commits = [([0], [int(tree.tokens[1])], len(self.worker.requests[rid].committed))] if tree else []
            calls.append((rid, self.plan, commits))
        self.trees = self.worker.grow_batch(calls)
        bad = [t for t in self.trees if isinstance(t, Exception)]
        if bad:
            raise bad[0]


def run_case(model, prompts, requests: int, plan: TreePlan, rule, temperature: float, rounds: int) -> dict:
    growers = {name: Grower(model, prompts, requests, plan, rule, temperature) for name in ("kept", "whole")}
    seconds: dict[str, list[float]] = {"kept": [], "whole": []}
    same = 0
    try:
        for name, g in growers.items():  # a warm-up each
            use(name)
            g.grow()
        for r in range(rounds):
            for name in ("kept", "whole") if r % 2 == 0 else ("whole", "kept"):
                use(name)
                start = time.perf_counter()
                growers[name].grow()
                seconds[name].append(time.perf_counter() - start)
            same += all(a.tokens.tolist() == b.tokens.tolist()
                        for a, b in zip(growers["kept"].trees, growers["whole"].trees))
    finally:
        use("kept")
    ratios = sorted(k / w for k, w in zip(seconds["kept"], seconds["whole"]))
    return {"requests": requests, "n": plan.n, "rule": "dynamic" if rule else "static", "T": temperature,
            "whole_ms": 1000 * statistics.median(seconds["whole"]), "kept_ms": 1000 * statistics.median(seconds["kept"]),
            "kept/whole": statistics.median(ratios), "q1": ratios[len(ratios) // 4], "q3": ratios[3 * len(ratios) // 4],
            "same_trees": f"{same}/{rounds}"}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tiny", action="store_true", help="the tiny draft with a 40-id head (a smoke run)")
    ap.add_argument("--rounds", type=int, default=12, help="grows of each way per case, alternated")
    ap.add_argument("--temperatures", default="0,0.6")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    pair = load(args.tiny)
    prompts = [pair.encode(p.text, chat=p.chat) for p in load_prompts(PROMPTS)[:8]]
    rows = [run_case(pair.draft.model, prompts, b, plan, rule, float(t), args.rounds)
            for t in args.temperatures.split(",") for b, plan, rule in CASES]
    print_table(rows, ["T", "requests", "n", "rule", "whole_ms", "kept_ms", "kept/whole", "q1", "q3", "same_trees"])
    write_json("draft-draws", {"tiny": args.tiny, "rounds": args.rounds, "rows": rows}, args.out)
    return {"rows": rows}


if __name__ == "__main__":
    main()
