"""Where Serve's per-step overhead comes from: the same decoder with its draft and target in one process, and
with each in a process of its own (plain multiprocessing pipes, no Ray), side by side.

    .venv/bin/python benchmarks/processes.py [--tiny] [--limit 4] [--max-tokens 48] [--rounds 2] [--worker-env K=V]

Through Serve a step costs 1.3-1.4x what it costs in process on the 2-core Xeon (``benchmarks/serve.py``:
0.71-0.79x the tokens/s), and the draft's and target's forwards themselves run slower in their actors than in
one process; the actor calls measured ~1-4 ms. Two causes were left open: Ray's and Serve's processes (the
proxy, controller, GCS, raylet: ~10 processes on 2 cores), or the separation itself (each model's OpenMP
pool and caches going cold while the other process computes). This runs greedy decoding of the same prompts
with the built-in plan both ways, round by round with the order rotating, without Ray: what the two
processes lose here, Ray does not explain. Prints tokens/s, ms a step and the draft's and target's calls
(as the decoder saw them: with the pipe's round trip) and the ratio; writes benchmarks/results/processes.json.
"""

from __future__ import annotations

import argparse
import functools
import multiprocessing as mp
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import print_table, write_json  # noqa: E402

from sequoia_ray.batching import WORKER_CALLS  # noqa: E402
from sequoia_ray.config import DEFAULT_DRAFT_VOCAB, SamplingParams  # noqa: E402
from sequoia_ray.engine import SpeculativeDecoder  # noqa: E402
from sequoia_ray.local import LocalPair  # noqa: E402
from sequoia_ray.prompts import Prompt, load_prompts  # noqa: E402
from sequoia_ray.tree.builtin import builtin_plan  # noqa: E402

HERE = Path(__file__).resolve().parent


def serve_worker(conn, role: str, name: str, dtype: str, quantize: str | None, threads: int,
                 draft_vocab: int | None = None) -> None:
    """A process holding one model's worker: loads it (a draft's head restricted to ``draft_vocab`` ids, as the
    in-process pair's) and answers (method, args) calls on ``conn``, all on its main thread (load and run on one
    thread: ``benchmarks/threads.py``), until ``None`` arrives."""
    import torch

    from sequoia_ray.draft import DraftWorker
    from sequoia_ray.models.loading import load_model
    from sequoia_ray.target import TargetWorker

    torch.set_num_threads(threads)
    model = load_model(name, dtype=dtype, quantize=quantize, progress=False, draft_vocab=draft_vocab).model
    worker = TargetWorker(model) if role == "target" else DraftWorker(model)
    conn.send("ready")
    while (call := conn.recv()) is not None:
        method, args = call
        try:
            conn.send((True, getattr(worker, method)(*args)))
        except Exception as exc:  # noqa: BLE001 - the caller raises it
            conn.send((False, exc))


class PipeWorker:
    """The engine's Draft / Target protocol over a pipe to a ``serve_worker`` process."""

    def __init__(self, role: str, name: str, dtype: str, quantize: str | None, threads: int,
                 env: dict[str, str] | None = None, draft_vocab: int | None = None) -> None:
        """``env``: variables for the worker process only (e.g. OpenMP's, read when the process loads torch);
        ``draft_vocab``: see ``serve_worker``."""
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=serve_worker, args=(child, role, name, dtype, quantize, threads, draft_vocab),
                                   daemon=True)
        saved = {k: os.environ.get(k) for k in env or {}}
        os.environ.update(env or {})  # a spawned process starts with this environment
        try:
            self.process.start()
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        if self.conn.recv() != "ready":
            raise RuntimeError(f"the {role} process did not start")

    def __getattr__(self, method: str):
        if method not in WORKER_CALLS:
            raise AttributeError(method)  # only the protocol's calls go over the pipe

        def call(*args):
            self.conn.send((method, args))
            ok, value = self.conn.recv()
            if not ok:
                raise value
            return value
        return call

    def close(self) -> None:
        self.conn.send(None)
        self.process.join(timeout=30)


def apart(pair: LocalPair, args, env: dict[str, str] | None = None) -> tuple[SpeculativeDecoder, list[PipeWorker]]:
    """A decoder whose target and draft each run in a process of their own (the tokenizer stays here), with
    ``env`` set in those processes."""
    target = PipeWorker("target", args.target, args.dtype, None, args.threads, env)
    draft = PipeWorker("draft", args.draft, args.dtype, args.draft_quantize, args.threads, env, args.draft_vocab)
    draft.max_context = pair.draft.max_context  # the draft's context, as the in-process pair's DraftWorker has it
    t = pair.target
    return SpeculativeDecoder(target, draft, builtin_plan(0.0).plan, tokenizer=t.tokenizer, eos_ids=t.eos_ids,
                              max_context=t.max_context), [target, draft]


def run(decoder: SpeculativeDecoder, pair: LocalPair, prompt: Prompt, max_tokens: int) -> dict:
    start = time.perf_counter()
    out = decoder.generate(pair.encode(prompt.text, chat=prompt.chat), SamplingParams(max_tokens=max_tokens))
    return {"tokens": out.stats.tokens, "seconds": time.perf_counter() - start, "steps": out.stats.steps,
            "text": out.text, "draft_s": out.stats.draft_s, "verify_s": out.stats.verify_s}


def summary(name: str, runs: list[dict]) -> dict:
    """A mode's row; ``forwards ms`` a step is the runs' ``forward_s`` where they carry it (a served run: the
    actors' forwards), else their worker calls' time (in process a call is its forward; in two processes it
    includes the pipe)."""
    tokens, seconds, steps = (sum(r[k] for r in runs) for k in ("tokens", "seconds", "steps"))
    forward_s = sum(r.get("forward_s", r["draft_s"] + r["verify_s"]) for r in runs)
    return {"mode": name, "tok/s": tokens / seconds, "step ms": 1000 * seconds / steps,
            "draft ms": 1000 * sum(r["draft_s"] for r in runs) / steps,
            "verify ms": 1000 * sum(r["verify_s"] for r in runs) / steps, "forwards ms": 1000 * forward_s / steps,
            "tok/step": tokens / steps, "tokens": tokens}


def interleave(modes: dict[str, Callable[[Prompt], dict]], prompts: list[Prompt], rounds: int) -> dict[str, list[dict]]:
    """Each mode's runs (``modes[name](prompt)`` -> a run dict) over ``prompts`` for ``rounds`` rounds, prompt by
    prompt, every mode in turn, the order rotated by one mode per prompt: the host's drift hits all alike."""
    names, runs = list(modes), {name: [] for name in modes}
    for r in range(rounds):
        for i, prompt in enumerate(prompts):
            shift = (r * len(prompts) + i) % len(names)
            for name in names[shift:] + names[:shift]:
                runs[name].append(modes[name](prompt))
    return runs


def rows_of(runs: dict[str, list[dict]], base: str, column: str | None = None) -> list[dict]:
    """A summary row per mode, each with its tokens/s over ``base``'s (in ``column``, default ``vs <base>``)."""
    rows = [summary(name, done) for name, done in runs.items()]
    base_rate = next(row["tok/s"] for row in rows if row["mode"] == base)
    for row in rows:
        row[column or f"vs {base}"] = row["tok/s"] / base_rate
    return rows


def warm(*decoders: SpeculativeDecoder, pair: LocalPair) -> None:
    """One short generation per decoder, before anything is timed."""
    for decoder in decoders:
        decoder.generate(pair.encode("warm up", chat=False), SamplingParams(max_tokens=4))


def pair_args(args) -> None:
    """``args.draft``, ``args.target``, ``args.dtype``, ``args.draft_quantize``, ``args.draft_vocab`` from
    ``args.tiny``: the tiny pair in float32, or the default pair as served (bf16 target, int8 draft); either way
    the draft's head restricted as served (``DEFAULT_DRAFT_VOCAB``), in this process and in a worker's."""
    args.draft, args.target = ("tiny-draft", "tiny-target") if args.tiny else ("default-draft", "default-target")
    args.dtype, args.draft_quantize = ("float32", None) if args.tiny else ("bfloat16", "int8")
    args.draft_vocab = DEFAULT_DRAFT_VOCAB


def load_pair(args) -> LocalPair:
    """The pair in this process, with ``args.threads`` torch threads."""
    import torch

    torch.set_num_threads(args.threads)
    return LocalPair.load(args.target, args.draft, dtype=args.dtype, draft_quantize=args.draft_quantize,
                          progress=False, draft_vocab=args.draft_vocab)


def compare(pair: LocalPair, args, prompts) -> tuple[list[dict], int]:
    """One process, two processes, and two processes with ``args.worker_env`` in them when given, interleaved
    over ``prompts`` for ``args.rounds`` rounds; the rows and how many runs gave the one-process text."""
    decoders = {"one process": pair.decoder(builtin_plan(0.0).plan)}
    decoders["two processes"], workers = apart(pair, args)
    env = dict(item.split("=", 1) for item in getattr(args, "worker_env", None) or [])
    if env:
        name = f"two processes, {' '.join(f'{k}={v}' for k, v in env.items())}"
        decoders[name], more = apart(pair, args, env)
        workers += more
    try:
        warm(*decoders.values(), pair=pair)
        runs = interleave({name: functools.partial(run, d, pair, max_tokens=args.max_tokens)
                           for name, d in decoders.items()}, prompts, args.rounds)
    finally:
        for w in workers:
            w.close()
    same = sum(a["text"] == b["text"] for a, b in zip(runs["one process"], runs["two processes"]))
    return rows_of(runs, "one process"), same


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="tiny random models (seconds)")
    ap.add_argument("--limit", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2, help="torch threads in every process")
    ap.add_argument("--worker-env", action="append", metavar="KEY=VALUE",
                    help="an environment variable for the two worker processes only (e.g. OMP_WAIT_POLICY=PASSIVE)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    pair_args(args)
    prompts = load_prompts(HERE / "prompts.jsonl")[: args.limit]
    rows, same = compare(load_pair(args), args, prompts)
    print_table(rows, ["mode", "tok/s", "step ms", "draft ms", "verify ms", "tok/step", "tokens", "vs one process"])
    runs = args.rounds * len(prompts)
    print(f"identical text in {same}/{runs} runs ({args.dtype})")
    write_json("processes", {"rows": rows, "identical": same, "runs": runs,
                             "args": {k: str(v) for k, v in vars(args).items()}}, args.out)


if __name__ == "__main__":
    main()
