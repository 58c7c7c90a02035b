"""The same decode with the models run on one thread or on two (why the actors run everything on one).

    .venv/bin/python benchmarks/threads.py [--tiny] [--limit 4] [--max-tokens 48] [--threads 2] [--rounds 2]

Greedy decoding of the same prompts with the built-in plan, each case in a fresh process (libgomp's thread
pools live as long as their threads): the models loaded and run on the main thread; loaded on the main
thread and run on another (what a Ray actor did before ``sequoia_ray.compute_thread``: it loads in one of
Ray's threads and forwards in its batcher's); loaded and run on the process's compute thread (what the
actors do now). Every case runs once a round, ``--rounds`` rounds, the order rotated by one case a round (the
host's speed drifts over minutes: a case run once carries whatever phase it met). Prints the draft's and the
target's milliseconds per step (medians over prompts), the voluntary context switches of the whole decode and
tokens/s, each the median over the rounds, and tokens/s over one thread's in the same round (the median over
the rounds); writes benchmarks/results/threads.json, every round's figures included.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import print_table, rotated, round_medians, write_json  # noqa: E402

HERE = Path(__file__).resolve().parent
CASES = {"one thread": "main", "loaded on one thread, run on another": "other",
         "the compute thread": "compute"}


def decode(args) -> dict:
    """Load and decode as ``args.case`` says; per-step draft / verify ms, context switches, tokens/s."""
    import torch

    from sequoia_ray.compute_thread import compute_thread
    from sequoia_ray.config import SamplingParams
    from sequoia_ray.local import LocalPair
    from sequoia_ray.prompts import load_prompts
    from sequoia_ray.tree.builtin import builtin_plan

    def load():
        torch.set_num_threads(args.threads)
        tiny = ("tiny-target", "tiny-draft", "float32", None)
        target, draft, dtype, quantize = tiny if args.tiny else ("default-target", "default-draft", "bfloat16", "int8")
        return LocalPair.load(target, draft, dtype=dtype, draft_quantize=quantize, progress=False)

    def run(pair) -> dict:
        torch.set_num_threads(args.threads)
        decoder = pair.decoder(builtin_plan(0.0).plan)
        decoder.generate(pair.encode("warm up", chat=False), SamplingParams(max_tokens=4))
        draft, verify, tokens, seconds = [], [], 0, 0.0
        before = resource.getrusage(resource.RUSAGE_SELF)
        for p in load_prompts(HERE / "prompts.jsonl")[: args.limit]:
            start = time.perf_counter()
            out = decoder.generate(pair.encode(p.text, chat=p.chat), SamplingParams(max_tokens=args.max_tokens))
            seconds += time.perf_counter() - start
            tokens += out.stats.tokens
            draft.append(1000 * out.stats.draft_s / out.stats.steps)
            verify.append(1000 * out.stats.verify_s / out.stats.steps)
        switches = resource.getrusage(resource.RUSAGE_SELF).ru_nvcsw - before.ru_nvcsw
        return {"draft ms": statistics.median(draft), "verify ms": statistics.median(verify),
                "context switches": switches, "tok/s": tokens / seconds, "tokens": tokens}

    if args.case == "compute":
        compute = compute_thread()
        return compute.run(run, compute.run(load))
    pair = load()
    if args.case == "main":
        return run(pair)
    box: dict = {}
    worker = threading.Thread(target=lambda: box.update(run(pair)))
    worker.start()
    worker.join()
    return box


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="tiny random models (seconds)")
    ap.add_argument("--limit", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--threads", type=int, default=2, help="torch threads")
    ap.add_argument("--rounds", type=int, default=2, help="runs of every case, the order rotated each round")
    ap.add_argument("--case", choices=sorted(CASES.values()), help=argparse.SUPPRESS)  # a child process
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    if args.case:
        print(json.dumps(decode(args)))
        return
    runs = {name: [] for name in CASES}  # case -> its figures, one dict a round
    for r in range(args.rounds):
        for name in rotated(list(CASES), r):
            child = [sys.executable, __file__, "--case", CASES[name], "--limit", str(args.limit), "--max-tokens",
                     str(args.max_tokens), "--threads", str(args.threads)] + (["--tiny"] if args.tiny else [])
            out = subprocess.run(child, capture_output=True, text=True, check=True).stdout
            runs[name].append(json.loads(out.strip().splitlines()[-1]))
    rows = round_medians(runs, "case", "one thread", {"vs one thread": "tok/s"})
    print_table(rows, ["case", "draft ms", "verify ms", "context switches", "tok/s", "tokens", "vs one thread"])
    write_json("threads", {"rows": rows, "rounds": runs, "args": {k: str(v) for k, v in vars(args).items()}},
               args.out)


if __name__ == "__main__":
    main()
