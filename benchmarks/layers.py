"""Decoder layers traced against eager, side by side in one process: forwards of both models, then greedy decoding.

    .venv/bin/python benchmarks/layers.py [--tiny] [--batches 1,8] [--q 1,4,16] [--repeats 12] [--limit 8]
                                          [--rounds 2] [--max-tokens 48]

The pair is loaded once with ``layers='traced'`` (``sequoia_ray.models.traced_layers``); each layer's traced
forward is switched off and on per run, so both ways run the same weights in the same process. Forwards: B
requests (contexts 64 to 420) of q new tokens each (a tree: every token sees the first), one ragged forward
as served, the two ways alternated; the paired median of traced / eager and whether the hidden states are the
same bit for bit. Decoding: greedy, the built-in plan, ``--limit`` prompts of ``benchmarks/prompts.jsonl`` for
``--rounds`` rounds, the two ways in alternating order per prompt; total tokens/s each, the paired median of
the time ratio, and whether the tokens are the same. Table + JSON.
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
from layout import CONTEXTS, sessions  # noqa: E402  (the same requests as the layout benchmark's)

from sequoia_ray.config import SamplingParams  # noqa: E402
from sequoia_ray.local import LocalPair  # noqa: E402
from sequoia_ray.models.batch_forward import Segment, hidden_many  # noqa: E402
from sequoia_ray.models.traced_layers import TracedForward, traced_count  # noqa: E402
from sequoia_ray.prompts import load_prompts  # noqa: E402
from sequoia_ray.tree.builtin import builtin_plan  # noqa: E402

PROMPTS = Path(__file__).resolve().parent / "prompts.jsonl"


class Switch:
    """Every traced layer of some models, switched between its traced and its stock forward."""

    def __init__(self, *models) -> None:
        self.layers = [(layer, layer.forward) for m in models for layer in m.modules()
                       if isinstance(layer.__dict__.get("forward"), TracedForward)]

    def __call__(self, traced: bool) -> None:
        for layer, forward in self.layers:
            if traced:
                layer.forward = forward
            else:
                layer.__dict__.pop("forward", None)


def quantiles(ratios: list[float]) -> tuple[float, float, float]:
    r = sorted(ratios)
    return statistics.median(r), r[len(r) // 4], r[(3 * len(r)) // 4]


def forwards(model, switch: Switch, batch: int, q: int, repeats: int, vocab: int) -> dict:
    requests = sessions(model, batch, vocab)
    allowed = torch.eye(q, dtype=torch.bool)
    allowed[:, 0] = True  # a tree: every token sees the first

    def run(traced: bool, seed: int) -> tuple[float, torch.Tensor]:
        switch(traced)
        tokens = torch.randint(5, vocab, (batch, q), generator=torch.Generator().manual_seed(seed))
        segs = [Segment(s, t, s.length + torch.arange(q), allowed) for s, t in zip(requests, tokens)]
        start = time.perf_counter()
        hidden = hidden_many(model, segs)
        seconds = time.perf_counter() - start
        for s, ctx in zip(requests, CONTEXTS):
            s.truncate(ctx)
        return seconds, torch.cat(hidden)

    eager, traced, same = [], [], True
    for i in range(repeats + 1):  # the first round warms up
        order = (False, True) if i % 2 == 0 else (True, False)
        got = {way: run(way, i) for way in order}
        same = same and torch.equal(got[False][1], got[True][1])
        if i:
            eager.append(got[False][0])
            traced.append(got[True][0])
    switch(True)
    median, low, high = quantiles([t / e for e, t in zip(eager, traced)])
    return {"eager ms": 1000 * statistics.median(eager), "traced ms": 1000 * statistics.median(traced),
            "traced / eager": median, "quartiles": f"{low:.3f}-{high:.3f}", "bitwise": same}


def decoding(pair: LocalPair, switch: Switch, limit: int, rounds: int, max_tokens: int) -> dict:
    decoder = pair.decoder(builtin_plan(0.0).plan)
    prompts = [pair.encode(p.text, chat=p.chat) for p in load_prompts(PROMPTS)][:limit]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    decoder.generate(prompts[0], SamplingParams(temperature=0.0, max_tokens=4))  # warm up
    seconds, tokens, ratios, same = {False: 0.0, True: 0.0}, {False: 0, True: 0}, [], 0
    for r in range(rounds):
        for i, prompt in enumerate(prompts):
            took, out = {}, {}
            for way in ((False, True) if (i + r) % 2 == 0 else (True, False)):
                switch(way)
                start = time.perf_counter()
                out[way] = decoder.generate(prompt, params).token_ids
                took[way] = time.perf_counter() - start
                seconds[way] += took[way]
                tokens[way] += len(out[way])
            ratios.append(took[True] / took[False])
            same += out[True] == out[False]
    switch(True)
    median, low, high = quantiles(ratios)
    return {"eager tok/s": tokens[False] / seconds[False], "traced tok/s": tokens[True] / seconds[True],
            "time traced / eager": median, "quartiles": f"{low:.3f}-{high:.3f}", "runs": len(ratios),
            "same tokens": f"{same}/{len(ratios)}"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="the tiny random pair (seconds; for tests)")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--q", default="1,4,16", help="new tokens per request")
    ap.add_argument("--repeats", type=int, default=12)
    ap.add_argument("--limit", type=int, default=8, help="prompts decoded")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    if args.tiny:
        pair = LocalPair.tiny()
        from sequoia_ray.models.traced_layers import trace_layers

        for m in (pair.target.model, pair.draft.model):
            trace_layers(m, "traced")
    else:
        pair = LocalPair.load(dtype="bfloat16", draft_quantize="int8", progress=False, layers="traced")
    models = {"draft": pair.draft.model, "target": pair.target.model}
    assert all(traced_count(m) for m in models.values()), "every model's layers traced"
    switch = Switch(*models.values())
    rows = []
    for name, model in models.items():
        vocab = min(model.config.vocab_size, 5000)
        for batch in (int(b) for b in args.batches.split(",")):
            for q in (int(x) for x in args.q.split(",")):
                row = {"model": name, "B": batch, "q": q}
                row.update(forwards(model, switch, batch, q, args.repeats, vocab))
                rows.append(row)
                print(row, flush=True)
    print_table(rows, list(rows[0]))
    decode = decoding(pair, switch, args.limit, args.rounds, args.max_tokens)
    print_table([decode], list(decode))
    write_json("layers-tiny" if args.tiny else "layers", {"contexts": CONTEXTS, "forwards": rows,
                                                          "decoding": decode, "args": vars(args) | {"out": None}},
               args.out)


if __name__ == "__main__":
    main()
