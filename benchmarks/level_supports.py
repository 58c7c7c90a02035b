"""A sampled draft's supports read once per tree level against once per node, side by side in one process.

    .venv/bin/python benchmarks/level_supports.py [--tiny] [--rounds 12] [--batch 8] [--temperature 0.6]

At a sampled tree's inner node the draft truncates its distribution to its top ``support`` tokens with the zeros
dropped; how many are left is read on the host (a sync on a GPU). ``sampling.truncate_rows`` does it for a whole
level with one read; before session 52 each node did its own. Both ways run here on the same ``DraftWorker`` (the
int8 draft as served; ``--tiny``: the tiny pair's), switched per batched grow and alternated round by round: the
median time of a batched grow (8 prompts of ``benchmarks/prompts.jsonl``, specinfer(4, 4)), the paired median of
level / node, and whether both ways grew the same trees (they must: same draws). Table + JSON
(``benchmarks/results/level-supports.json``).
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
from sequoia_ray.draft import DraftWorker  # noqa: E402
from sequoia_ray.local import LocalPair  # noqa: E402
from sequoia_ray.prompts import load_prompts  # noqa: E402
from sequoia_ray.sampling import SparseDist, target_probs, truncate_rows  # noqa: E402
from sequoia_ray.tree.plan import specinfer  # noqa: E402

PROMPTS = Path(__file__).resolve().parent / "prompts.jsonl"
PER_LEVEL = DraftWorker._dists


def per_node(self, logits, params):  # the way before: one truncation (and one host read) per node
    out = []
    for row in logits:
        (dist,) = truncate_rows(target_probs(row, params.temperature, params.top_p)[None], self.support)
        out.append(SparseDist(self._ids(dist.tokens), dist.probs))
    return out


def grow_once(worker: DraftWorker, prompts, params, plan, tag: str):
    """(seconds of one batched grow of every prompt's tree, the trees' tokens) on fresh requests."""
    ids = [f"{tag}-{i}" for i in range(len(prompts))]
    for i, (rid, prompt) in enumerate(zip(ids, prompts)):
        worker.start(rid, prompt, params, seed=i)
    worker.grow_batch([(rid, plan) for rid in ids])  # the prompts' prefill, then a first tree (not timed)
    start = time.perf_counter()
    trees = worker.grow_batch([(rid, plan) for rid in ids])
    seconds = time.perf_counter() - start
    for rid in ids:
        worker.finish(rid)
    return seconds, [t.tokens.tolist() for t in trees]


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--temperature", type=float, default=0.6)
    ap.add_argument("--top-p", type=float, default=0.95)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    pair = LocalPair.tiny(device="cpu") if args.tiny else LocalPair.load(dtype="bfloat16", draft_quantize="int8",
                                                                          progress=False)
    worker, plan = DraftWorker(pair.draft.model), specinfer(4, 4)
    texts = load_prompts(PROMPTS)
    prompts = [pair.encode(p.text, chat=p.chat) for p in (texts * args.batch)[: args.batch]]
    params = SamplingParams(max_tokens=64, temperature=args.temperature, top_p=args.top_p)
    times, same = {"node": [], "level": []}, True
    try:
        for r in range(args.rounds):
            trees = {}
            for way in ("node", "level") if r % 2 else ("level", "node"):
                DraftWorker._dists = per_node if way == "node" else PER_LEVEL
                seconds, trees[way] = grow_once(worker, prompts, params, plan, f"{way}{r}")
                times[way].append(seconds)
            same = same and trees["node"] == trees["level"]
    finally:
        DraftWorker._dists = PER_LEVEL
    paired = sorted(b / a for a, b in zip(times["node"], times["level"]))
    row = {"batch": args.batch, "nodes": plan.n, "levels": plan.num_levels, "T": args.temperature,
           "node ms": 1e3 * statistics.median(times["node"]), "level ms": 1e3 * statistics.median(times["level"]),
           "level / node": statistics.median(paired), "q1": paired[len(paired) // 4],
           "q3": paired[(3 * len(paired)) // 4], "same trees": same}
    print_table([row], list(row))
    write_json("level-supports", {"args": {k: str(v) for k, v in vars(args).items()},
                                  "threads": torch.get_num_threads(), "row": row, "seconds": times}, args.out)
    return row


if __name__ == "__main__":
    main()
