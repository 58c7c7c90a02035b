"""The batched KV layouts side by side: B requests' trees in one target forward, ragged vs padded vs flat vs B forwards.

    .venv/bin/python benchmarks/layout.py [--tiny] [--batches 1,2,4,8] [--n 4] [--repeats 5]

Each request has its own cached context (ragged: 64 to ~420 tokens) and a tree of ``--n`` nodes (a chain).
For each batch size B: the median time of one step's target forward (``hidden_many`` + the LM head over
all tree rows) in the ``ragged``, ``padded`` and ``flat`` layouts, and of B separate forwards (one request per forward,
as without batching: ``hidden_many`` of one segment, ragged under SDPA since session 33), interleaved round-robin
so drift hits each alike. ``plain``: the B separate forwards through each session's own ``KVSession.hidden``
(transformers' SDPA path, what a lone request ran before session 33), with whether its hidden states equal the
separate forwards' bit for bit. Table + JSON.
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

from sequoia_ray.local import LocalPair  # noqa: E402
from sequoia_ray.models.batch_forward import Segment, hidden_many  # noqa: E402
from sequoia_ray.models.tree_lm import KVSession  # noqa: E402
from sequoia_ray.tree.plan import chain  # noqa: E402

CONTEXTS = [64, 420, 180, 300, 96, 250, 140, 360]
LAYOUTS = ("ragged", "padded", "flat")


def sessions(model, batch: int, vocab: int) -> list[KVSession]:
    gen = torch.Generator().manual_seed(0)
    out = []
    for ctx in CONTEXTS[:batch]:
        s = KVSession(model)
        s.hidden(torch.randint(5, vocab, (ctx,), generator=gen), torch.arange(ctx))
        out.append(s)
    return out


def segments(ss: list[KVSession], n: int, vocab: int) -> list[Segment]:
    plan = chain(n - 1)
    mask = torch.from_numpy(plan.ancestor_mask())
    return [Segment(s, torch.randint(5, vocab, (n,)), s.length + torch.tensor(plan.depth), mask) for s in ss]


def step(model, ss, n: int, vocab: int, how: str) -> tuple[float, list[torch.Tensor]]:
    """Seconds of one step's forward and LM head in ``how``, and the hidden states it gave."""
    lengths = [s.length for s in ss]
    segs = segments(ss, n, vocab)
    start = time.perf_counter()
    if how in ("separate", "plain"):
        hidden = [hidden_many(model, [seg])[0] if how == "separate" else
                  seg.session.hidden(seg.tokens, seg.positions, seg.allowed) for seg in segs]
        [ss[0].head(h) for h in hidden]
    else:
        hidden = hidden_many(model, segs, how)
        ss[0].head(torch.cat(hidden))
    seconds = time.perf_counter() - start
    for s, length in zip(ss, lengths):
        s.truncate(length)
    return seconds, hidden


def compare(model, batch: int, n: int, vocab: int, repeats: int) -> dict:
    """One table row: every way of running ``batch`` requests' trees of ``n`` nodes, interleaved."""
    ss = sessions(model, batch, vocab)
    hows = ["separate", "plain", *LAYOUTS] if batch > 1 else ["separate", "plain"]
    times = {how: [] for how in hows}
    same = True
    for _ in range(repeats + 1):  # the first round warms up
        for how in hows:
            torch.manual_seed(len(times[how]))  # every way gets the same tokens in a round
            seconds, hidden = step(model, ss, n, vocab, how)
            times[how].append(seconds)
            if how == "separate":
                separate = hidden
            elif how == "plain":
                same = same and all(torch.equal(a, b) for a, b in zip(separate, hidden))
    med = {how: statistics.median(t[1:]) for how, t in times.items()}
    row = {"B": batch, "tokens": batch * n, "separate ms": 1000 * med["separate"], "plain ms": 1000 * med["plain"],
           "separate vs plain": med["plain"] / med["separate"], "plain bitwise separate": same}
    row.update({f"{how} ms": 1000 * med.get(how, med["separate"]) for how in LAYOUTS})
    row.update({f"{how} vs separate": med["separate"] / med.get(how, med["separate"]) for how in LAYOUTS})
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--batches", default="1,2,4,8")
    ap.add_argument("--n", type=int, default=4, help="tree nodes per request")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    pair = LocalPair.tiny() if args.tiny else LocalPair.load(dtype="bfloat16", draft=None, progress=False)
    model = pair.target.model
    vocab = min(model.config.vocab_size, 5000)
    rows = [compare(model, int(b), args.n, vocab, args.repeats) for b in args.batches.split(",")]
    print_table(rows, list(rows[0]))
    write_json("layout-tiny" if args.tiny else "layout", {"n": args.n, "contexts": CONTEXTS, "rows": rows,
                                                          "repeats": args.repeats}, args.out)


if __name__ == "__main__":
    main()
