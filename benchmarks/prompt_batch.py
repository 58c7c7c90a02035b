"""Several prompts in one request (``prompt`` an array) against one request per prompt, through a running service.

    .venv/bin/sequoia-ray serve --no-profile &   # or the main job; any served pair
    .venv/bin/python benchmarks/prompt_batch.py [--url http://127.0.0.1:8000] [--prompts 4] [--max-tokens 48]
                                                [--rounds 2] [--api-key KEY] [--out PATH]

The same greedy completions three ways, each round running every way in turn (the order rotated a round: this
host's speed drifts): one request a prompt, one after another (what a client without batching does); one request
holding every prompt (``prompt`` an array: LangChain's ``OpenAI.generate``, lm-eval's batches); and one request a
prompt, all at once (concurrent clients). Prints the wall time, the completion tokens per second, the ratio to
one-by-one in the same round (medians over the rounds) and whether each way gave every prompt the same text as
one-by-one (bf16 batch shapes may break near-ties: as between concurrent clients); writes
benchmarks/results/prompt-batch.json. The prompts: ``--prompts`` of benchmarks/prompts.jsonl spread over it, each
sent as text.
"""

from __future__ import annotations

import argparse
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import print_table, rotated, round_medians, write_json  # noqa: E402

HERE = Path(__file__).resolve().parent
WAYS = ("one by one", "one batch request", "concurrent requests")


def spread(items: list, count: int) -> list:
    """``count`` items spread evenly over ``items`` (not its first few: the file opens with code)."""
    if not 1 <= count <= len(items):
        raise ValueError(f"--prompts {count}: the file has {len(items)} prompts; ask for 1 to {len(items)}")
    return [items[i * len(items) // count] for i in range(count)]


def run_way(way: str, post, prompts: list[str]) -> dict:
    """One way's figures: wall seconds, completion tokens, tokens/s, and its texts (in the order of prompts)."""
    start = time.perf_counter()
    if way == "one batch request":
        bodies = [post(prompts)]
        texts = [c["text"] for c in sorted(bodies[0]["choices"], key=lambda c: c["index"])]
    elif way == "one by one":
        bodies = [post(p) for p in prompts]
        texts = [b["choices"][0]["text"] for b in bodies]
    else:
        with ThreadPoolExecutor(len(prompts)) as pool:
            bodies = list(pool.map(post, prompts))
        texts = [b["choices"][0]["text"] for b in bodies]
    wall = time.perf_counter() - start
    tokens = sum(b["usage"]["completion_tokens"] for b in bodies)
    return {"wall_s": wall, "tokens": tokens, "tok_s": tokens / wall, "texts": texts}


def compare(runs: dict[str, list[dict]]) -> list[dict]:
    """The table's rows: medians over the rounds, the paired ratio to one-by-one, and in how many rounds every
    text equalled one-by-one's of the same round."""
    rows = round_medians({w: [{k: v for k, v in r.items() if k != "texts"} for r in done] for w, done in runs.items()},
                         "way", "one by one", {"x one by one": "tok_s"})
    for row in rows:
        done, base = runs[row["way"]], runs["one by one"]
        row["same texts"] = f"{sum(r['texts'] == b['texts'] for r, b in zip(done, base))}/{len(done)}"
    return rows


def main(argv: list[str] | None = None) -> int:
    import requests

    from sequoia_ray.prompts import load_prompts

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    prompts = spread([p.text for p in load_prompts(HERE / "prompts.jsonl")], args.prompts)
    headers = {"authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    model = requests.get(f"{args.url}/v1/models", headers=headers, timeout=60).json()["data"][0]["id"]

    def post(prompt):
        r = requests.post(f"{args.url}/v1/completions", headers=headers, timeout=600,
                          json={"model": model, "prompt": prompt, "max_tokens": args.max_tokens, "temperature": 0})
        r.raise_for_status()
        return r.json()

    post(prompts[0])  # warm-up
    runs: dict[str, list[dict]] = {w: [] for w in WAYS}
    for i in range(args.rounds):
        for way in rotated(list(WAYS), i):
            runs[way].append(run_way(way, post, prompts))
            print(f"round {i} {way}: {runs[way][-1]['tok_s']:.2f} tok/s", flush=True)
    rows = compare(runs)
    print_table(rows, ["way", "wall_s", "tokens", "tok_s", "x one by one", "same texts"])
    write_json("prompt-batch", {"url": args.url, "model": model, "prompts": prompts, "max_tokens": args.max_tokens,
                                "rounds": args.rounds, "rows": rows, "runs": runs}, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
