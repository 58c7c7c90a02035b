"""oneDNN's blocked weight layout for the packed bf16 Linear layers, side by side in one model.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/weight_layout.py [--hints 1,none] [--shapes 1x1,8x1,8x4,1x16]
        [--rounds 10] [--limit 4] [--max-tokens 32] [--tiny]

``sequoia_ray.models.packed_linear`` reorders each weight once with ``mkldnn._reorder_linear_weight(W, hint)``;
the rows hint decides oneDNN's blocking (on the 2-core Xeon with AMX, bf16: a hint of 1 blocks 64 outputs wide,
no hint 32 wide). Every Linear of ONE target model holds the weight in each hinted layout (packed in turns: the
first layout first in even layers, last in odd ones, so allocation order favours neither) and a switch picks
the layout of a forward, so the rounds compare the kernels alone — same model, same caches, same host phase:
1. the logits of a prompt under each layout against ``F.linear`` (aten): bitwise equal or not;
2. forwards of B requests x s new tokens at a cached context of ``--context`` (``hardware.batch_steps``), each
   layout in turn, the order flipped every round; per shape the median and fastest ms, and the paired median
   (and quartiles) of each layout's time over the first's, round by round;
3. greedy generation of ``benchmarks/prompts.jsonl`` (``--limit``), the target alone and the built-in tree
   (the int8 draft, whose kernels do not change), the layouts in turn per prompt: tokens/s (median), and
   whether every layout gives the first one's text.
Default: the real pair as served (bf16 target); ``--tiny``: the tiny pair in bf16. Table + JSON
(benchmarks/results/weight-layout.json).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import print_table, quartiles, write_json  # noqa: E402

from sequoia_ray.config import SamplingParams  # noqa: E402
from sequoia_ray.hardware import batch_steps  # noqa: E402
from sequoia_ray.local import LocalPair  # noqa: E402
from sequoia_ray.models.loading import TINY_DRAFT, TINY_TARGET  # noqa: E402
from sequoia_ray.models.packed_linear import PackedLinear  # noqa: E402
from sequoia_ray.prompts import load_prompts  # noqa: E402
from sequoia_ray.tree.builtin import builtin_plan  # noqa: E402
from sequoia_ray.tree.plan import chain  # noqa: E402

HERE = Path(__file__).resolve().parent


class Layouts(torch.nn.Module):
    """A Linear held as one ``PackedLinear`` per hinted layout (the shipped module, its weight packed with that
    rows hint); ``switch["hint"]`` picks the one used."""

    def __init__(self, linear: torch.nn.Linear, hints: list[int | None], switch: dict) -> None:
        super().__init__()
        self.switch = switch
        self.packed = {hint: PackedLinear(linear, rows_hint=hint) for hint in hints}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.packed[self.switch["hint"]](x)


def install(model: torch.nn.Module, hints: list[int | None]) -> dict:
    """Every plain Linear of ``model`` becomes a ``Layouts`` (in place); the switch that picks the layout."""
    switch = {"hint": hints[0]}
    targets = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
               if type(child) is torch.nn.Linear]
    for i, (parent, name, child) in enumerate(targets):
        setattr(parent, name, Layouts(child, hints if i % 2 == 0 else hints[::-1], switch))
    return switch


def bitwise(model, switch: dict, hints, aten_logits: torch.Tensor, ids: torch.Tensor) -> dict[str, bool]:
    out = {}
    for hint in hints:
        switch["hint"] = hint
        with torch.inference_mode():
            out[name(hint)] = bool(torch.equal(model(ids).logits, aten_logits))
    return out


def forwards(model, switch: dict, hints, shapes, context: int, rounds: int) -> list[dict]:
    gen = torch.Generator().manual_seed(0)
    steps = {(b, s): batch_steps(model, b, (s,), context=context, gen=gen)[b * s] for b, s in shapes}
    times = {shape: {hint: [] for hint in hints} for shape in steps}
    for r in range(rounds + 1):  # round 0 warms up
        for shape, step in steps.items():
            for hint in hints if r % 2 == 0 else hints[::-1]:
                switch["hint"] = hint
                t = min(step() for _ in range(2)) * 1e3
                if r:
                    times[shape][hint].append(t)
    rows = []
    for (b, s), by_hint in times.items():
        row = {"B x s": f"{b}x{s}"}
        first = by_hint[hints[0]]
        for hint, ts in by_hint.items():
            row[f"{name(hint)} median ms"] = statistics.median(ts)
            row[f"{name(hint)} fastest ms"] = min(ts)
        for hint in hints[1:]:
            ratios = [a / f for a, f in zip(by_hint[hint], first)]
            q1, median, q3 = quartiles(ratios)
            row[f"{name(hint)}/{name(hints[0])} paired"] = median
            row[f"{name(hint)}/{name(hints[0])} quartiles"] = f"{q1:.3f}-{q3:.3f}"
        rows.append(row)
    return rows


def generation(pair: LocalPair, switch: dict, hints, prompts, max_tokens: int) -> list[dict]:
    decoders = {"alone": pair.decoder(chain(0), speculate=False), "tree": pair.decoder(builtin_plan(0.0).plan)}
    for d in decoders.values():
        d.generate(pair.encode("warm up", chat=False), SamplingParams(max_tokens=4))
    runs = {(mode, hint): [] for mode in decoders for hint in hints}
    for i, p in enumerate(prompts):
        ids = pair.encode(p.text, chat=p.chat)
        for mode, decoder in decoders.items():
            for hint in hints if i % 2 == 0 else hints[::-1]:
                switch["hint"] = hint
                start = time.perf_counter()
                out = decoder.generate(ids, SamplingParams(max_tokens=max_tokens))
                runs[mode, hint].append((out.stats.tokens / (time.perf_counter() - start), out.text))
    rows = []
    for mode in decoders:
        first = runs[mode, hints[0]]
        row = {"mode": mode}
        for hint in hints:
            row[f"{name(hint)} tok/s"] = statistics.median(t for t, _ in runs[mode, hint])
        for hint in hints[1:]:
            row[f"{name(hint)}/{name(hints[0])} paired"] = statistics.median(
                a / f for (a, _), (f, _) in zip(runs[mode, hint], first))
            row[f"same text as {name(hints[0])}"] = f"{sum(a == f for (_, a), (_, f) in zip(runs[mode, hint], first))}"\
                                                    f"/{len(first)}"
        rows.append(row)
    return rows


def name(hint: int | None) -> str:
    return "no hint" if hint is None else f"hint {hint}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hints", default="1,none", help="rows hints to compare, the first is the reference")
    ap.add_argument("--shapes", default="1x1,8x1,8x4,1x16", help="B x s: requests x new tokens a forward")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--limit", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--tiny", action="store_true")
    args = ap.parse_args()
    hints = [None if h.strip().lower() == "none" else int(h) for h in args.hints.split(",")]
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]
    if args.tiny:
        pair = LocalPair.load(TINY_TARGET, TINY_DRAFT, dtype="bfloat16", progress=False, linears="aten")
    else:
        pair = LocalPair.load(dtype="bfloat16", draft_quantize="int8", progress=False, linears="aten")
    model = pair.target.model
    ids = torch.tensor([pair.encode("def fibonacci(n):\n    return", chat=False)])
    with torch.inference_mode():
        aten_logits = model(ids).logits
    switch = install(model, hints)
    same = bitwise(model, switch, hints, aten_logits, ids)
    print("logits bitwise equal to aten:", same)
    fwd = forwards(model, switch, hints, shapes, args.context, args.rounds)
    print_table(fwd, list(fwd[0]))
    gen = generation(pair, switch, hints, load_prompts(HERE / "prompts.jsonl")[: args.limit], args.max_tokens)
    print_table(gen, list(gen[0]))
    write_json("weight-layout" + ("-tiny" if args.tiny else ""), {
        "args": vars(args), "threads": torch.get_num_threads(), "torch": torch.__version__,
        "bitwise equal to aten": same, "forward": fwd, "generation": gen})


if __name__ == "__main__":
    main()
