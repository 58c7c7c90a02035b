"""Our target alone against vLLM's, decoding in process, the two engines loaded side by side and alternated.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/vllm_decode.py [--rounds 6] [--limit 2] [--tokens 33]
        [--batch 1] [--vllm-python /work/.vllm-venv/bin/python] [--gap-s 2]

The load benchmark (``load.py --vllm``) runs our service and then vLLM's, minutes apart, on a host whose speed
moves up to 2.5x within minutes. This isolates the engines' decoding: this process loads our target as served
(bf16, packed Linear layers: ``LocalPair``, ``speculate=False``), a child process in the vLLM venv holds vLLM's
offline ``LLM`` (bf16, prefix caching off, every core bound, as ``vllm_peer.py`` sets it up), and each round runs
every prompt of ``benchmarks/prompts.jsonl`` (``--limit``) on both engines in turn, the order flipped every
prompt and round, ``--gap-s`` seconds between engines (vLLM's OpenMP threads spin for a while after a call).
Each run is greedy, ignores EOS, once for 1 token and once for ``--tokens``; decode ms a step = (t(tokens) -
t(1)) / (tokens - 1), prefill = t(1). ``--batch B``: a run decodes B prompts together (consecutive prompts of
the ``--limit``; a step is a token for each of them): vLLM's ``generate`` with the B prompts, ours the batched
target alone the served rank runs (``run_lockstep`` over a ``TargetWorker``: one forward per step for every
request); B = 1 is our decoder as served for one request. Reports each engine's median and fastest, the
paired ratios ours / vLLM (median and quartiles over every batch and round), tokens/s at the median step and
how many runs gave the same tokens. Table + JSON (benchmarks/results/vllm-decode[-bB].json).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import print_table, quartiles, write_json  # noqa: E402
from vllm_peer import ALL_CORES, HERE, encode, load_prompts, vllm_env  # noqa: E402  (stdlib only)

DEFAULT_VLLM_PYTHON = Path("/work/.vllm-venv/bin/python")


def vllm_worker(model: str) -> None:
    """In the vLLM venv: load ``model``, then answer ``[ids, n]`` lines with ``[seconds, token ids]``."""
    from vllm import LLM, SamplingParams

    llm = LLM(model=model, dtype="bfloat16", max_model_len=4096, seed=0, enable_prefix_caching=False)
    llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)
    print("ready", flush=True)
    for line in sys.stdin:
        batch, n = json.loads(line)
        params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        start = time.perf_counter()
        out = llm.generate([{"prompt_token_ids": ids} for ids in batch], params, use_tqdm=False)
        print(json.dumps([time.perf_counter() - start, [list(o.outputs[0].token_ids) for o in out]]), flush=True)


class Child:
    """An engine in a child process speaking ``vllm_worker``'s protocol."""

    def __init__(self, argv: list[str], env: dict, log: Path) -> None:
        self.log = log
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log.open("w"),
                                     text=True, env=env)
        while (line := self.proc.stdout.readline()) and line.strip() != "ready":
            pass
        if not line:
            raise RuntimeError(f"the engine process exited before it was ready; its log is {log}")

    def __call__(self, batch: list[list[int]], n: int) -> tuple[float, list[list[int]]]:
        self.proc.stdin.write(json.dumps([batch, n]) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the engine process died; its log is {self.log}")
        seconds, tokens = json.loads(line)
        return seconds, tokens

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=120)


def ours():
    """Our target alone, as served, in this process: a function ``(prompts, n) -> (seconds, token ids of
    each)``; one prompt runs the decoder as served for one request, several the batched steps of the rank."""
    from sequoia_ray.config import SamplingParams
    from sequoia_ray.local import LocalPair
    from sequoia_ray.lockstep import ROOT_ONLY, run_lockstep
    from sequoia_ray.tree.plan import chain

    pair = LocalPair.load(draft=None, dtype="bfloat16", progress=False)
    decoder = pair.decoder(chain(0), speculate=False)
    decoder.generate([1, 2, 3], SamplingParams(max_tokens=4))

    def run(batch: list[list[int]], n: int) -> tuple[float, list[list[int]]]:
        params = SamplingParams(max_tokens=n, ignore_eos=True)
        start = time.perf_counter()
        if len(batch) == 1:
            outs = [list(decoder.generate(batch[0], params).token_ids)]
        else:
            outs = [list(o) for o in run_lockstep(decoder.target, None, batch, ROOT_ONLY, params).outputs]
        return time.perf_counter() - start, outs

    return run


def alternate(engines: dict, batches: list[list[list[int]]], rounds: int, tokens: int, gap_s: float) -> dict:
    """Every batch of prompts on every engine in turn, each round; per engine the (t(1), t(tokens)) pairs and
    the tokens of each prompt."""
    runs = {name: [] for name in engines}
    for r in range(rounds):
        for i, batch in enumerate(batches):
            order = list(engines) if (r + i) % 2 == 0 else list(engines)[::-1]
            for name in order:
                time.sleep(gap_s)
                one, _ = engines[name](batch, 1)
                full, out = engines[name](batch, tokens)
                runs[name].append({"batch": i, "round": r, "t1 s": one, "tn s": full, "tokens": out})
    return runs


def summarize(runs: dict, tokens: int, reference: str = "vllm", batch: int = 1) -> list[dict]:
    """A row per engine: decode ms a step (a token for each of the ``batch`` prompts) and prefill ms (median,
    fastest), tokens/s at the median step, and against ``reference`` the paired ratios (median, quartiles) and
    the runs whose tokens equal the reference's."""
    decode = {name: [(r["tn s"] - r["t1 s"]) / (tokens - 1) * 1e3 for r in rs] for name, rs in runs.items()}
    prefill = {name: [r["t1 s"] * 1e3 for r in rs] for name, rs in runs.items()}
    rows = []
    for name in runs:
        step = statistics.median(decode[name])
        row = {"engine": name, "decode ms/step (median)": step, "decode ms/step (fastest)": min(decode[name]),
               "tokens/s (median step)": batch * 1e3 / step, "prefill ms (median)": statistics.median(prefill[name])}
        ratios = [a / b for a, b in zip(decode[name], decode[reference])]
        q1, median, q3 = quartiles(ratios)
        row[f"decode / {reference} (paired)"] = median
        row["quartiles"] = f"{q1:.3f}-{q3:.3f}"
        row[f"prefill / {reference} (paired)"] = statistics.median(
            a / b for a, b in zip(prefill[name], prefill[reference]))
        same = sum(a["tokens"] == b["tokens"] for a, b in zip(runs[name], runs[reference]))
        row[f"same tokens as {reference}"] = f"{same}/{len(runs[name])}"
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--limit", type=int, default=2, help="the first prompts of benchmarks/prompts.jsonl")
    ap.add_argument("--tokens", type=int, default=33, help="tokens a long run generates (>= 2)")
    ap.add_argument("--batch", type=int, default=1, help="prompts decoded together (--limit a multiple of it)")
    ap.add_argument("--gap-s", type=float, default=2.0)
    ap.add_argument("--vllm-python", type=Path, default=DEFAULT_VLLM_PYTHON)
    ap.add_argument("--vllm-worker", metavar="MODEL", help=argparse.SUPPRESS)  # the child's own mode
    args = ap.parse_args(argv)
    if args.vllm_worker:
        vllm_worker(args.vllm_worker)
        return
    if args.tokens < 2:
        raise SystemExit(f"--tokens {args.tokens}: give at least 2 (decode time is t(tokens) - t(1))")
    if args.batch < 1 or args.limit % args.batch:
        raise SystemExit(f"--batch {args.batch} with --limit {args.limit}: give a batch >= 1 that divides the limit")
    if not args.vllm_python.exists():
        raise SystemExit(f"no vLLM python at {args.vllm_python}; make the venv with scripts/vllm_venv.sh or pass "
                         "--vllm-python")
    from sequoia_ray.models.loading import DEFAULT_TARGET, load_tokenizer, resolve

    model, _ = resolve(DEFAULT_TARGET, progress=False)
    tokenizer = load_tokenizer(DEFAULT_TARGET, progress=False)
    prompts = [encode(tokenizer, p) for p in load_prompts(HERE / "prompts.jsonl", args.limit)]
    env = vllm_env(ALL_CORES, 2, args.vllm_python.parent.parent)
    log = HERE / "results" / "vllm-decode-worker.log"
    log.parent.mkdir(exist_ok=True)
    child = Child([str(args.vllm_python), __file__, "--vllm-worker", model], env, log)
    try:
        batches = [prompts[i:i + args.batch] for i in range(0, len(prompts), args.batch)]
        runs = alternate({"vllm": child, "ours": ours()}, batches, args.rounds, args.tokens, args.gap_s)
    finally:
        child.close()
    rows = summarize(runs, args.tokens, batch=args.batch)
    print_table(rows, list(rows[0]))
    name = "vllm-decode" + (f"-b{args.batch}" if args.batch > 1 else "")
    write_json(name, {"args": {k: str(v) for k, v in vars(args).items()},
                      "prompt lengths": [len(p) for p in prompts], "rows": rows, "runs": runs})


if __name__ == "__main__":
    main()
