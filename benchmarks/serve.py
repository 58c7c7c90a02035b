"""In-process engine vs Ray Serve (draft and target on separate actors), same prompts, same plan.

    .venv/bin/python benchmarks/serve.py [--tiny] [--limit 4] [--max-tokens 48] [--tp-size 1]

Greedy decoding of the same prompts with the built-in plan, first in-process, then through the HTTP API
of the local Serve app, then in-process again while that app is up and idle (Ray's and Serve's background
processes running as they do under the Serve row: this row separates what the background costs from what
separate processes and calls cost). Between the first two, the draft and the target each in a process of
their own without Ray (plain pipes, ``benchmarks/processes.py``): what the separation costs by itself. Prints tokens/s, per-step latency (median over requests) and their
ratio, and where a step's time goes: the draft's call (``grow``) and the target's (``verify``) per step, as the
decoder saw them (through Serve: the actor's forward plus the call's round trip); writes
benchmarks/results/serve.json. The goal is Serve within 10% of in-process.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import print_table, write_json  # noqa: E402

from sequoia_ray.config import SamplingParams  # noqa: E402
from sequoia_ray.local import LocalPair  # noqa: E402
from sequoia_ray.prompts import load_prompts  # noqa: E402
from sequoia_ray.tree.builtin import builtin_plan  # noqa: E402

HERE = Path(__file__).resolve().parent


def load_pair(args) -> LocalPair:
    import torch

    torch.set_num_threads(args.threads)
    return LocalPair.load(args.target, args.draft, dtype=args.dtype, draft_quantize=args.draft_quantize,
                          progress=False)


def in_process(pair: LocalPair, args, prompts) -> list[dict]:
    decoder = pair.decoder(builtin_plan(0.0).plan)
    decoder.generate(pair.encode("warm up", chat=False), SamplingParams(max_tokens=4))
    runs = []
    for p in prompts:
        start = time.perf_counter()
        out = decoder.generate(pair.encode(p.text, chat=p.chat), SamplingParams(max_tokens=args.max_tokens))
        seconds = time.perf_counter() - start
        runs.append({"tokens": out.stats.tokens, "seconds": seconds, "steps": out.stats.steps, "text": out.text,
                     "draft_s": out.stats.draft_s, "verify_s": out.stats.verify_s})
    return runs


def two_processes(pair: LocalPair, args, prompts) -> list[dict]:
    """The draft and the target each in a process of its own, without Ray (``benchmarks/processes.py``): what
    the separation costs by itself."""
    from processes import apart, run

    decoder, workers = apart(pair, args)
    try:
        decoder.generate(pair.encode("warm up", chat=False), SamplingParams(max_tokens=4))
        return [run(decoder, pair, p, args.max_tokens) for p in prompts]
    finally:
        for w in workers:
            w.close()


def through_serve(args, prompts, pair: LocalPair) -> tuple[list[dict], list[dict]]:
    """The Serve row, then the in-process row again with the app still up and idle."""
    import requests
    from ray import serve

    from deployments.launch import start

    cfg = {"model_name": "bench", "draft": args.draft, "target": args.target, "dtype": args.dtype,
           "draft_quantize": args.draft_quantize, "tp_size": args.tp_size, "num_cpus": args.num_cpus,
           "threads": args.threads}
    url = start(cfg, args.port, None)
    post = lambda body: requests.post(f"{url}/v1/{'chat/' if 'messages' in body else ''}completions",  # noqa: E731
                                      json={"model": "bench", "temperature": 0, **body}, timeout=900).json()
    post({"prompt": "warm up", "max_tokens": 4})
    runs = []
    for p in prompts:
        body = ({"messages": [{"role": "user", "content": p.text}]} if p.chat else {"prompt": p.text})
        start_t = time.perf_counter()
        out = post({**body, "max_tokens": args.max_tokens})
        seconds = time.perf_counter() - start_t
        spec = out["usage"]["speculative"]
        text = out["choices"][0]["message"]["content"] if p.chat else out["choices"][0]["text"]
        runs.append({"tokens": out["usage"]["completion_tokens"], "seconds": seconds, "steps": spec["steps"],
                     "text": text, "draft_s": spec["draft_s"], "verify_s": spec["verify_s"]})
    beside = in_process(pair, args, prompts)
    serve.shutdown()
    return runs, beside


def summary(name: str, runs: list[dict]) -> dict:
    tokens, seconds = sum(r["tokens"] for r in runs), sum(r["seconds"] for r in runs)
    return {"mode": name, "tok/s": tokens / seconds,
            "step ms (median)": 1000 * statistics.median(r["seconds"] / r["steps"] for r in runs),
            "draft ms": 1000 * statistics.median(r["draft_s"] / r["steps"] for r in runs),
            "verify ms": 1000 * statistics.median(r["verify_s"] / r["steps"] for r in runs),
            "tok/step": tokens / sum(r["steps"] for r in runs), "tokens": tokens}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="tiny random models (seconds)")
    ap.add_argument("--limit", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--tp-size", type=int, default=1)
    ap.add_argument("--num-cpus", type=float, default=1, help="logical CPUs each model actor reserves")
    ap.add_argument("--threads", type=int, default=2, help="torch threads per model actor (in-process: 2 too)")
    ap.add_argument("--port", type=int, default=8011)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    args.draft, args.target = ("tiny-draft", "tiny-target") if args.tiny else ("default-draft", "default-target")
    args.dtype, args.draft_quantize = ("float32", None) if args.tiny else ("bfloat16", "int8")
    prompts = load_prompts(HERE / "prompts.jsonl")[: args.limit]
    pair = load_pair(args)
    local = in_process(pair, args, prompts)
    split = two_processes(pair, args, prompts)
    served, beside = through_serve(args, prompts, pair)
    rows = [summary("in-process", local), summary("two processes, no Ray", split), summary("Ray Serve (HTTP)", served),
            summary("in-process, Serve app idle beside it", beside)]
    for row in rows:
        row["vs in-process"] = row["tok/s"] / rows[0]["tok/s"]
    same = sum(a["text"] == b["text"] for a, b in zip(local, served))
    same_split = sum(a["text"] == b["text"] for a, b in zip(local, split))
    print_table(rows, ["mode", "tok/s", "step ms (median)", "draft ms", "verify ms", "tok/step", "tokens",
                       "vs in-process"])
    print(f"identical text on {same}/{len(prompts)} prompts through Serve, {same_split}/{len(prompts)} in two "
          f"processes ({args.dtype})")
    write_json("serve", {"rows": rows, "identical": same, "identical_two_processes": same_split, "prompts": len(prompts),
                         "args": {k: str(v) for k, v in vars(args).items()}}, args.out)


if __name__ == "__main__":
    main()
