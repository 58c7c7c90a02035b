"""Long prompts arrive while others decode: how long are they stalled? Whole, apart, or in chunks.

    .venv/bin/python benchmarks/prefill.py [--tiny] [--decoders 3] [--prompt-tokens 1024] [--chunks 64,256]
        [--rounds 2] [--long-prompts 1] [--budget TOKENS] [--uncut] [--chunked-only]

In-process, continuous batching (``sequoia_ray.batching``) over the default pair (bf16 target, int8 draft,
greedy, the built-in plan) or the tiny pair. ``--decoders`` requests decode back to back; once they are
running, one request with a ``--prompt-tokens`` prompt joins. Settings, side by side in one run:

- ``whole/padded``, ``whole/flat``, ``whole/ragged``: its whole prompt in the next forward, beside the others'
  trees (padded: every tree row is padded up to the prompt's length; flat: no padding, one sequence; ragged:
  one sequence, each request's attention over its own K/V only);
- ``chunk N/flat``, ``chunk N/ragged``: N prompt tokens per step, beside the others' trees;
- with ``--uncut``, ``chunk N/<layout> uncut`` too: chunks never cut to the token budget a forward leaves
  (``sequoia_ray.batching`` before session 64: whole chunks, and a call passed over goes first). With
  ``--long-prompts K`` K such requests arrive at once, and ``--budget`` is the batchers' ``max_batch_tokens``
  (unbounded by default): K chunks past the budget are what a cut changes. ``--chunked-only`` leaves out the
  ``whole/*`` settings.

("Apart", a forward of its own before the batch, stalls the others exactly as long as ``whole/flat``'s
prefill rows do: the prompt's forward runs between two of their steps either way.)

Every setting runs once a round, ``--rounds`` rounds, the order rotated by one setting a round (the host's
speed drifts over minutes: a setting run once carries whatever phase it met). Per setting: the decoders'
longest gap between two tokens while the long request prefills (the stall), their median gap, the long
request's time to first token, and total tokens/s, each the median over the rounds; and the stall and
tokens/s over the first setting's (``whole/padded``) in the same round, the median over the rounds. Table +
JSON (every round's figures included).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import print_table, rotated, round_medians, write_json  # noqa: E402

from sequoia_ray.batching import BatchedWorker, Batcher, BatchLimits  # noqa: E402
from sequoia_ray.config import SamplingParams  # noqa: E402
from sequoia_ray.draft import DraftWorker  # noqa: E402
from sequoia_ray.engine import SpeculativeDecoder  # noqa: E402
from sequoia_ray.local import LocalPair  # noqa: E402
from sequoia_ray.target import TargetWorker  # noqa: E402
from sequoia_ray.tree.builtin import builtin_plan  # noqa: E402


def run(pair: LocalPair, layout: str, chunk: int | None, decoders: int, prompt_tokens: int, max_tokens: int, *,
        long_prompts: int = 1, budget: int = 1 << 20, cut: bool = True) -> dict:
    tw = TargetWorker(pair.target.model, layout=layout, prefill_chunk=chunk)
    dw = DraftWorker(pair.draft.model, layout=layout, prefill_chunk=chunk)
    batchers = [Batcher.over(w, BatchLimits(max_batch_tokens=budget)) for w in (tw, dw)]
    for b in batchers if not cut else ():
        b.fewest = None  # every chunk whole: the scheduling before chunks were cut
    plan = builtin_plan(0.0).plan
    vocab = min(pair.target.model.config.vocab_size, 5000)
    times: list[list[float]] = [[] for _ in range(decoders)]
    first_tokens: list[float] = []

    def decode(i: int) -> None:
        spec = SpeculativeDecoder(BatchedWorker(batchers[0]), BatchedWorker(batchers[1]), plan)
        for chunk_ in spec.stream([10 + i, 20 + i, 30 + i], SamplingParams(max_tokens=max_tokens, ignore_eos=True)):
            times[i] += [time.perf_counter()] * max(1, len(chunk_.token_ids))

    def long_request(j: int) -> None:
        spec = SpeculativeDecoder(BatchedWorker(batchers[0]), BatchedWorker(batchers[1]), plan)
        prompt = [(7 * k + 3 * j) % (vocab - 10) + 5 for k in range(prompt_tokens)]
        next(iter(spec.stream(prompt, SamplingParams(max_tokens=2, ignore_eos=True))))
        first_tokens.append(time.perf_counter())

    threads = [threading.Thread(target=decode, args=(i,)) for i in range(decoders)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    while min(len(t) for t in times) < 4:  # everyone is decoding
        time.sleep(0.01)
    late = [threading.Thread(target=long_request, args=(j,)) for j in range(long_prompts)]
    lo = time.perf_counter()
    for t in late:
        t.start()
    for t in late + threads:
        t.join()
    wall = time.perf_counter() - start
    for b in batchers:
        b.close()
    hi = max(first_tokens)
    gaps = [b - a for ts in times for a, b in zip(ts, ts[1:]) if b > a]
    stall = [b - a for ts in times for a, b in zip(ts, ts[1:]) if b > a and b > lo and a < hi]
    return {"setting": setting_name(layout, chunk, cut), "stall max s": max(stall, default=0.0),
            "median gap s": statistics.median(gaps), "long TTFT s": statistics.median(first_tokens) - lo,
            "last TTFT s": hi - lo, "tokens/s": sum(len(t) for t in times) / wall}


def setting_name(layout: str, chunk: int | None, cut: bool = True) -> str:
    return (f"chunk {chunk}/{layout}" + ("" if cut else " uncut")) if chunk else f"whole/{layout}"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="the tiny random pair (a smoke run)")
    ap.add_argument("--decoders", type=int, default=3)
    ap.add_argument("--prompt-tokens", type=int, default=1024)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--chunks", default="64,256", help="prefill chunk sizes to compare")
    ap.add_argument("--rounds", type=int, default=2, help="runs of every setting, the order rotated each round")
    ap.add_argument("--long-prompts", type=int, default=1, help="long requests arriving at once")
    ap.add_argument("--budget", type=int, default=1 << 20, help="the batchers' max_batch_tokens")
    ap.add_argument("--uncut", action="store_true", help="every chunk setting uncut too (whole chunks)")
    ap.add_argument("--chunked-only", action="store_true", help="leave out the whole/* settings")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    if args.tiny:
        pair = LocalPair.tiny()
        args.prompt_tokens = min(args.prompt_tokens, 400)
    else:
        pair = LocalPair.load(dtype="bfloat16", draft_quantize="int8", progress=False)
    chunks = [int(c) for c in args.chunks.split(",")]
    settings = [] if args.chunked_only else [("padded", None, True), ("flat", None, True), ("ragged", None, True)]
    settings += [(layout, c, cut) for c in chunks for layout in ("flat", "ragged")
                 for cut in ((True, False) if args.uncut else (True,))]
    runs = {setting_name(*s): [] for s in settings}  # setting -> its figures, one dict a round
    for r in range(args.rounds):
        for layout, chunk, cut in rotated(settings, r):
            runs[setting_name(layout, chunk, cut)].append(
                run(pair, layout, chunk, args.decoders, args.prompt_tokens, args.max_tokens,
                    long_prompts=args.long_prompts, budget=args.budget, cut=cut))
    base = setting_name(*settings[0])
    rows = round_medians(runs, "setting", base, {f"stall vs {base}": "stall max s", f"tokens/s vs {base}": "tokens/s"})
    print_table(rows, ["setting", "stall max s", "median gap s", "long TTFT s", "last TTFT s", "tokens/s",
                       f"stall vs {base}", f"tokens/s vs {base}"])
    write_json("prefill-tiny" if args.tiny else "prefill", {"decoders": args.decoders, "prompt tokens": args.prompt_tokens,
                                                            "max tokens": args.max_tokens, "rounds": args.rounds,
                                                            "long prompts": args.long_prompts, "budget": args.budget,
                                                            "rows": rows, "runs": runs}, args.out)


if __name__ == "__main__":
    main()
