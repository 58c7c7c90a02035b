"""One token from the target's distribution: ``sampling.sample`` (two-level inverse CDF) against torch.multinomial.

    .venv/bin/python benchmarks/sampler.py [--batches 1,8] [--rounds 3] [--max-tokens 24] [--tiny]

First each sampler alone on a softmax over the real vocabulary (151,936 ids; medians of 200 draws), then sampled
decoding (T = 0.6) in lockstep, in process (``sequoia_ray.lockstep``: the batched serving step without Ray), the
target alone and the bucket plan of a tree, at each batch size, the two samplers alternated round by round on
the same prompts and seeds (the profiler's built-in prompts): tokens/s and the paired ratio of step times. Every
sampled step draws one token a request from the target's full distribution (the target alone's token, a tree's
bonus or residual token). ``--tiny`` runs the tiny random pair (seconds, for the test). Prints a table and
writes ``benchmarks/results/sampler.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import print_table, write_json  # noqa: E402

from sequoia_ray import sampling, verify  # noqa: E402
from sequoia_ray.config import SamplingParams  # noqa: E402
from sequoia_ray.lockstep import ROOT_ONLY, run_lockstep  # noqa: E402
from sequoia_ray.tree.plan import k_ary  # noqa: E402

REAL_VOCAB = 151936


def multinomial(probs: torch.Tensor, generator: torch.Generator) -> int:
    """The sampler before session 36."""
    return int(torch.multinomial(probs.float(), 1, generator=generator))


SAMPLERS = {"inverse_cdf": sampling.sample, "multinomial": multinomial}


def draw_us(vocab: int, draws: int = 200) -> dict[str, float]:
    """Median microseconds a draw, each sampler, from one softmax over ``vocab`` ids."""
    probs = torch.softmax(torch.randn(vocab, generator=torch.Generator().manual_seed(0)) * 5, -1)  # [V]
    out = {}
    for name, fn in SAMPLERS.items():
        gen = torch.Generator().manual_seed(0)
        times = []
        for _ in range(draws + 10):
            start = time.perf_counter()
            fn(probs, gen)
            times.append(time.perf_counter() - start)
        out[name] = 1e6 * statistics.median(times[10:])
    return out


@contextlib.contextmanager
def drawing_with(fn):
    """``fn`` draws every token from P meanwhile: the verifier's bonus and residual draws (``verify.sample``)
    and ``verify_node``'s (``sampling.sample``); both put back after."""
    before = sampling.sample, verify.sample
    sampling.sample = verify.sample = fn
    try:
        yield
    finally:
        sampling.sample, verify.sample = before


def decode(pair, plans: dict, batches: list[int], rounds: int, max_tokens: int, prompts: list[list[int]]) -> list[dict]:
    """Lockstep runs at T = 0.6, both samplers alternated per round: a row per (batch, plan, sampler)."""
    runs: dict[tuple, list] = {}
    decoder = pair.decoder(next(iter(plans.values())))
    params = SamplingParams(max_tokens=max_tokens, temperature=0.6, seed=1, ignore_eos=True)
    for r in range(rounds):
        for batch in batches:
            work = [prompts[i % len(prompts)] for i in range(batch)]
            for name, plan in plans.items():
                order = list(SAMPLERS) if r % 2 == 0 else list(SAMPLERS)[::-1]
                for sampler in order:
                    with drawing_with(SAMPLERS[sampler]):
                        run = run_lockstep(decoder.target, decoder.draft if plan is not ROOT_ONLY else None, work,
                                           plan, params, seed=r)
                    runs.setdefault((batch, name, sampler), []).append(run)
    rows = []
    for (batch, name, sampler), rs in runs.items():
        other = runs[(batch, name, "multinomial")]
        ratios = [a.seconds / b.seconds for a, b in zip(rs, other)]
        rows.append({"B": batch, "plan": name, "sampler": sampler,
                     "tok/s": sum(r.timed_tokens for r in rs) / sum(r.seconds for r in rs),
                     "tok/step": statistics.mean(r.tokens_per_step for r in rs),
                     "time / multinomial": statistics.median(ratios)})
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--tiny", action="store_true", help="the tiny random pair (seconds)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    from sequoia_ray.local import LocalPair
    from sequoia_ray.profiling import BUILTIN_PROMPTS

    pair = LocalPair.tiny(device="cpu") if args.tiny else LocalPair.load(dtype="bfloat16", draft_quantize="int8",
                                                                         progress=False)
    prompts = [pair.encode(p.text, chat=p.chat) for p in BUILTIN_PROMPTS]
    micro = draw_us(REAL_VOCAB)
    print(f"one draw at {REAL_VOCAB} ids: " + ", ".join(f"{k} {v:.0f} us" for k, v in micro.items()))
    plans = {"target alone": ROOT_ONLY, "tree k_ary(2, 2)": k_ary(2, 2)}
    rows = decode(pair, plans, [int(b) for b in args.batches.split(",")], args.rounds, args.max_tokens, prompts)
    print_table(rows, ["B", "plan", "sampler", "tok/s", "tok/step", "time / multinomial"])
    write_json("sampler" + ("-tiny" if args.tiny else ""), {"draw us": micro, "rows": rows, "rounds": args.rounds,
                                                           "max tokens": args.max_tokens}, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
