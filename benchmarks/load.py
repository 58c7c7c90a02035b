"""Load test: N concurrent streaming clients against the local Serve app for a bounded time.

    .venv/bin/python benchmarks/load.py [--clients 16] [--duration 120] [--max-tokens 64] [--tp-size 1]
    .venv/bin/python benchmarks/load.py --real --clients 4 --duration 60 --max-tokens 32 [--draft-quantize int8]

Starts Ray Serve on loopback with the tiny random models in float32 (default, ``--tiny``) or the default
pair in bfloat16 (``--real``; ``--dtype float32`` for exact greedy identity). Then:

1. references: each prompt of benchmarks/prompts.jsonl once, target alone (``"speculative": false``), one
   request at a time: the greedy text every loaded request must reproduce;
2. warm-up: one round of ``--clients`` concurrent requests; then the RSS of every actor (Serve controller,
   proxy and replicas, the draft actor, each TP rank), measured inside the actor;
3. load: ``--clients`` clients, each sending streaming greedy requests back to back (the prompts in turn,
   starting at a different one per client) until ``--duration`` seconds have passed;
4. after: wait until no actor holds a request, settle, RSS again.

Reports p50/p99 latency (request sent -> ``[DONE]``), p50/p99 time to first token, tokens/s over all
clients (for scale: the target alone's tokens/s over the sequential references), errors (a non-200, an
``error`` event, no ``[DONE]``, a client-side exception), mismatches (text differing from the prompt's
reference: cross-request leaks; in bfloat16 a near-tie may legitimately flip under multi-token
verification, so there they are counted, not failed), the requests still held by the ingress, the draft
actor and the TP ranks afterwards (leaked KV caches), and each actor's RSS before/after (an actor that died
or was replaced shows as such). Prints the tables, writes benchmarks/results/load-<tiny|real>.json; exits 1
when a goal is missed (an error, a held request or dead actor, a float32 mismatch).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import psutil
import ray
import requests
from ray import serve

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import print_table, write_json  # noqa: E402

from deployments.app import build_app  # noqa: E402
from deployments.config import ServeConfig  # noqa: E402
from deployments.launch import app_args, override  # noqa: E402
from actors.quiet_ray import quiet_ray_environ  # noqa: E402
from actors.target import free_port  # noqa: E402
from sequoia_ray.prompts import Prompt, load_prompts  # noqa: E402

HERE = Path(__file__).resolve().parent
APP = "sequoia"
MODEL = "bench"
TINY = {"model_name": MODEL, "draft": "tiny-draft", "target": "tiny-target", "dtype": "float32", "num_cpus": 0.5}
REAL = {"model_name": MODEL, "draft": "default-draft", "target": "default-target", "dtype": "bfloat16", "num_cpus": 2}
KEEP_ERRORS = 5
DEAD = "dead"


@dataclass(frozen=True)
class Result:
    prompt: int  # index into the prompt list
    ok: bool
    latency: float  # request sent -> [DONE] (or -> failure), seconds
    ttft: float | None = None  # request sent -> first non-empty text
    tokens: int = 0
    text: str = ""
    tokens_per_step: float | None = None
    error: str | None = None
    finish_reason: str | None = None  # the stream's, and vLLM's stop_reason (None: EOS; a token id; a string)
    stop_reason: int | str | None = None
    temperature: float = 0.0  # the request's: only greedy texts are compared with the target alone's

    def differs(self, refs: list[str]) -> bool:
        """A greedy text that is not the target alone's (``refs``: the greedy references per prompt)."""
        return self.ok and self.temperature == 0 and self.text != refs[self.prompt]


# ---- the service ------------------------------------------------------------------------------------
def service_config(real: bool, clients: int, tp_size: int = 1, dtype: str | None = None,
                   draft_quantize: str | None = None, num_cpus: float | None = None) -> dict:
    """The ServeConfig dict: one replica per deployment, ``max_concurrent`` >= clients (no 429s)."""
    cfg = {**(REAL if real else TINY), "tp_size": tp_size, "max_concurrent": clients, "draft_quantize": draft_quantize}
    if dtype:
        cfg["dtype"] = dtype
    if num_cpus:
        cfg["num_cpus"] = num_cpus
    return cfg


@contextlib.contextmanager
def serving(cfg: dict) -> Iterator[str]:
    """Local Ray + Serve with the app on a free loopback port (as ``deployments.launch.start``, without
    per-request access logs); yields its base URL, shuts everything down afterwards."""
    port, quiet = free_port(), {"enable_access_log": False}
    with quiet_ray_environ():  # Ray's idle timers as the service starts them
        ray.init(num_cpus=max(4, int((cfg["tp_size"] + 1) * cfg["num_cpus"]) + 1), include_dashboard=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port}, logging_config=quiet)
        serve.run(build_app(cfg), name=APP, route_prefix="/", logging_config=quiet)
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


# ---- one streaming request --------------------------------------------------------------------------
def request_body(prompt: Prompt, max_tokens: int, **extra) -> tuple[str, dict]:
    body = {"model": MODEL, "max_tokens": max_tokens, "temperature": 0, "stream": True, **extra}
    if prompt.chat:
        return "/v1/chat/completions", {**body, "messages": [{"role": "user", "content": prompt.text}]}
    return "/v1/completions", {**body, "prompt": prompt.text}


def stream_request(session: requests.Session, url: str, prompts: list[Prompt], index: int, max_tokens: int,
                   timeout: float, **extra) -> Result:
    """One streaming greedy request for ``prompts[index]``; every failure is a Result with ``error``."""
    route, body = request_body(prompts[index], max_tokens, **extra)
    start = time.perf_counter()
    try:
        with session.post(url + route, json=body, stream=True, timeout=timeout) as r:
            if r.status_code != 200:
                result = _failed(index, start, f"HTTP {r.status_code}: {r.text[:300]}")
            else:
                result = read_stream(r.iter_lines(chunk_size=None), index, start)
    except (requests.RequestException, ValueError) as exc:  # connection, timeout, bad JSON: counted as errors
        result = _failed(index, start, f"{type(exc).__name__}: {exc}")
    return replace(result, temperature=body["temperature"])


def read_stream(lines: Iterable[bytes], index: int, start: float) -> Result:
    """Parse the server-sent events of a completion or chat stream up to ``data: [DONE]``."""
    pieces, ttft, usage, finish = [], None, None, (None, None)
    for line in lines:
        if not line.startswith(b"data: "):
            continue
        data = line[len(b"data: "):]
        if data == b"[DONE]":
            if usage is None:
                return _failed(index, start, "[DONE] without a final event carrying usage")
            return Result(index, True, time.perf_counter() - start, ttft, usage["completion_tokens"], "".join(pieces),
                          usage.get("speculative", {}).get("tokens_per_step"), finish_reason=finish[0],
                          stop_reason=finish[1])
        event = json.loads(data)
        if "error" in event:
            return _failed(index, start, f"error event: {event['error']}")
        usage = event.get("usage") or usage
        if not event.get("choices"):  # a usage-only last event (vLLM's stream_options.include_usage)
            continue
        choice = event["choices"][0]
        if choice.get("finish_reason"):
            finish = choice["finish_reason"], choice.get("stop_reason")
        piece = choice["text"] if "text" in choice else choice["delta"].get("content") or ""
        if piece and ttft is None:
            ttft = time.perf_counter() - start
        pieces.append(piece)
    return _failed(index, start, "stream ended without [DONE]")


def _failed(index: int, start: float, error: str) -> Result:
    return Result(index, False, time.perf_counter() - start, error=error)


# ---- clients ----------------------------------------------------------------------------------------
def client(url: str, prompts: list[Prompt], first: int, deadline: float, max_tokens: int,
           timeout: float, **extra) -> list[Result]:
    """Requests back to back, the prompts in turn from ``first``, until ``deadline`` (at least one)."""
    results: list[Result] = []
    with requests.Session() as session:
        while not results or time.perf_counter() < deadline:
            index = (first + len(results)) % len(prompts)
            results.append(stream_request(session, url, prompts, index, max_tokens, timeout, **extra))
    return results


def run_clients(url: str, prompts: list[Prompt], clients: int, duration: float, max_tokens: int,
                timeout: float, temperatures: tuple[float, ...] = (0.0,), **extra) -> tuple[list[Result], float]:
    """All clients at once for ``duration`` seconds (requests in flight then still finish); (results, wall s).
    Client i asks for ``temperatures[i % len(temperatures)]`` (a mix: greedy and sampled requests share batches;
    a sampled one with its own seed)."""
    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=clients) as pool:
        futures = [pool.submit(client, url, prompts, i, start + duration, max_tokens, timeout,
                               **_sampling(temperatures[i % len(temperatures)], i), **extra)
                   for i in range(clients)]
        results = [r for f in futures for r in f.result()]
    return results, time.perf_counter() - start


def _sampling(temperature: float, client_index: int) -> dict:
    return {"temperature": temperature} if temperature == 0 else {"temperature": temperature, "seed": client_index}


def references(url: str, prompts: list[Prompt], max_tokens: int, timeout: float) -> list[Result]:
    """Each prompt's target-only greedy result, one request at a time (the yardstick of losslessness)."""
    out = []
    with requests.Session() as session:
        for i in range(len(prompts)):
            res = stream_request(session, url, prompts, i, max_tokens, timeout, speculative=False)
            if not res.ok:
                raise RuntimeError(f"reference request for prompt {i} failed: {res.error}")
            out.append(res)
    return out


# ---- actors: memory and held requests ---------------------------------------------------------------
def serve_actors() -> dict[str, object]:
    """Serve's named actors (controller, proxy, one per replica), labelled without the app prefix."""
    named = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["namespace"] == "serve"]
    return {_label(name): ray.get_actor(name, namespace="serve") for name in named}


def _label(name: str) -> str:
    """``SERVE_REPLICA::<app>#DraftDeployment#<id>`` -> ``DraftDeployment#<id>``; the proxy without its node id."""
    return name.split("-")[0] if name.startswith("SERVE_PROXY_ACTOR") else name.removeprefix(f"SERVE_REPLICA::{APP}#")


def model_actors() -> dict[str, object]:
    """The draft actor and every TP rank, from the (single) DraftDeployment and TargetDeployment replicas."""
    draft = serve.get_deployment_handle("DraftDeployment", APP).actors.remote().result()
    ranks = serve.get_deployment_handle("TargetDeployment", APP).actors.remote().result()["ranks"]
    return {"DraftActor": draft, **{f"TargetRank {i}": r for i, r in enumerate(ranks)}}


def ask(actors: dict[str, object], call: Callable) -> dict[str, object]:
    """``ray.get(call(actor))`` for every actor at once; ``DEAD`` for one that died (reported, not raised)."""
    refs = {label: call(actor) for label, actor in actors.items()}
    out = {}
    for label, ref in refs.items():
        try:
            out[label] = ray.get(ref)
        except ray.exceptions.RayActorError:
            out[label] = DEAD
    return out


def memory(actors: dict[str, object]) -> dict[str, dict | str]:
    """pid and resident set size (MB) of each actor, measured inside it (a lambda runs on the actor)."""
    probed = ask(actors, lambda a: a.__ray_call__.remote(lambda _: (os.getpid(), psutil.Process().memory_info().rss)))
    return {label: DEAD if got == DEAD else {"pid": got[0], "rss_mb": got[1] / 2**20} for label, got in probed.items()}


def active_requests(url: str) -> dict[str, int | str]:
    """Requests the ingress has in flight and each model actor holds state (a KV cache) for."""
    ingress = requests.get(f"{url}/health", timeout=30).json()["active_requests"]
    return {"OpenAIIngress": ingress, **ask(model_actors(), lambda a: a.active.remote())}


def wait_idle(url: str, timeout: float) -> dict[str, int | str]:
    """Poll until nothing is held anywhere (and no actor is dead) or ``timeout`` passes; the last counts."""
    deadline = time.monotonic() + timeout
    counts = active_requests(url)
    while any(counts.values()) and time.monotonic() < deadline:
        time.sleep(0.5)
        counts = active_requests(url)
    return counts


# ---- the whole run ----------------------------------------------------------------------------------
def load_test(url: str, prompts: list[Prompt], clients: int, duration: float, max_tokens: int,
              timeout: float = 300.0, settle: float = 2.0) -> dict:
    """References, warm-up, RSS, load, drain, RSS; the report (see ``summarize`` and ``actor_rows``)."""
    log(f"references: {len(prompts)} prompts, target alone, one at a time")
    alone = references(url, prompts, max_tokens, timeout)
    refs = [r.text for r in alone]
    log(f"warm-up: {clients} concurrent requests")
    warm, _ = run_clients(url, prompts, clients, 0.0, max_tokens, timeout)
    if failed := [r.error for r in warm if not r.ok]:
        raise RuntimeError(f"warm-up: {len(failed)} of {len(warm)} requests failed, first: {failed[0]}")
    wait_idle(url, 30.0)
    before = memory({**serve_actors(), **model_actors()})
    log(f"load: {clients} clients for {duration:g} s")
    results, seconds = run_clients(url, prompts, clients, duration, max_tokens, timeout)
    log(f"load done: {len(results)} requests in {seconds:.1f} s; draining")
    held = wait_idle(url, 30.0)
    time.sleep(settle)
    after = memory({**serve_actors(), **model_actors()})  # looked up again: a replaced actor shows up
    mismatched = [r for r in results if r.differs(refs)]
    return {"summary": summarize(results, alone, len(mismatched), seconds, clients, duration, max_tokens),
            "actors": actor_rows(before, after, held), "active_after": held,
            "errors_by_message": dict(Counter(r.error for r in results if not r.ok).most_common(KEEP_ERRORS)),
            "first_mismatches": [{"prompt": r.prompt, "reference": refs[r.prompt], "got": r.text}
                                 for r in mismatched[:KEEP_ERRORS]]}


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def percentile(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def pooled_tokens_per_step(ok: list[Result]) -> float | None:
    """All the streams' tokens over all their steps (each stream's steps: its tokens over its tokens/step), as
    vLLM's counters pool its requests; the mean of the streams' own ratios weighs a short stream as a long one.
    Ours count the step that ends on EOS without the EOS; vLLM's accepted tokens include it."""
    counted = [r for r in ok if r.tokens_per_step and r.tokens]
    steps = sum(r.tokens / r.tokens_per_step for r in counted)
    return sum(r.tokens for r in counted) / steps if steps else None


def summarize(results: list[Result], alone: list[Result], mismatches: int, seconds: float, clients: int,
              duration: float, max_tokens: int) -> dict:
    """The load's numbers; ``alone`` (the sequential target-only references) gives tokens/s for scale."""
    ok = [r for r in results if r.ok]
    latency, ttft = [r.latency for r in ok], [r.ttft for r in ok if r.ttft is not None]
    steps = [r.tokens_per_step for r in ok if r.tokens_per_step]
    tokens = sum(r.tokens for r in ok)
    return {"clients": clients, "duration s": duration, "wall s": seconds, "max tokens": max_tokens,
            "requests": len(results), "completed": len(ok), "errors": len(results) - len(ok),
            "mismatches": mismatches, "p50 latency s": percentile(latency, 50),
            "p99 latency s": percentile(latency, 99), "p50 TTFT s": percentile(ttft, 50),
            "p99 TTFT s": percentile(ttft, 99), "tokens": tokens, "tokens/s": tokens / seconds,
            "tokens/step (mean)": float(np.mean(steps)) if steps else None,
            "tokens/step (pooled)": pooled_tokens_per_step(ok),
            "target alone tokens/s": sum(r.tokens for r in alone) / sum(r.latency for r in alone) if alone else None}


def actor_rows(before: dict[str, dict | str], after: dict[str, dict | str], held: dict[str, int | str]
               ) -> list[dict]:
    """One row per actor label seen before or after: a replaced replica has a new label, a replaced model
    actor a new pid (``before -> after``; ``-`` = not there, ``dead``); no delta unless alive throughout."""
    rows = []
    for label in {**before, **after}:
        b, a = before.get(label, "-"), after.get(label, "-")
        pid = [str(x["pid"]) if isinstance(x, dict) else x for x in (b, a)]
        rss = [x["rss_mb"] if isinstance(x, dict) else None for x in (b, a)]
        same = pid[0] == pid[1] and None not in rss
        rows.append({"actor": label, "pid": pid[0] if pid[0] == pid[1] else " -> ".join(pid),
                     "held after": held.get(label.split("#")[0], "-"), "RSS before MB": rss[0],
                     "RSS after MB": rss[1], "delta MB": rss[1] - rss[0] if same else None})
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    pair = ap.add_mutually_exclusive_group()
    pair.add_argument("--tiny", action="store_true", help="tiny random models, float32 (the default)")
    pair.add_argument("--real", action="store_true", help="the default pair default-draft -> default-target")
    ap.add_argument("--clients", default="16", help="concurrent clients; with --modes a list: 1,2,4,8")
    ap.add_argument("--modes", help="compare batching modes side by side (benchmarks/load_sweep.py): any of a,b,c,d")
    ap.add_argument("--plan-store", help="plan store URI the service reads its (per-batch-size) plans from")
    ap.add_argument("--batch-layout", choices=["auto", "ragged", "padded", "flat"],
                    help="how a batch shares a forward")
    ap.add_argument("--prefill-chunk", type=int, help="prefill long prompts this many tokens per step")
    ap.add_argument("--threads", type=int, help="torch threads per model actor (default: num_cpus)")
    ap.add_argument("--batch-wait-ms", type=float,
                    help="how long a forward may wait for the previous one's target-alone requests")
    ap.add_argument("--live-cost", action="store_true", help="serve the tree or the target alone per batch size, "
                    "whichever measures faster on live steps (ServeConfig.live_cost)")
    ap.add_argument("--vllm", help="with --modes: then vLLM's OpenAI server (benchmarks/vllm_server.py) with these "
                    "settings at the same client counts: plain and/or kK (chain speculation, K draft tokens), e.g. plain,k3")
    ap.add_argument("--vllm-python", type=Path, help="the vLLM venv's python (default /work/.vllm-venv/bin/python)")
    ap.add_argument("--duration", type=float, default=120.0, help="seconds of load (requests in flight finish)")
    ap.add_argument("--repeats", type=int, default=1, help="with --modes: rounds of (a) and (c) per client count, "
                    "in alternating order; (c)/(a) is the median of the rounds' ratios")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--temperatures", default="0", help="with --modes: client i samples at the i-th of these in "
                    "turn (e.g. 0,0.6: greedy and sampled requests share batches; only greedy texts are compared)")
    ap.add_argument("--dtype", choices=["float32", "bfloat16", "float16"],
                    help="default: float32 (tiny), bfloat16 (real); only float32 makes mismatches errors")
    ap.add_argument("--draft-quantize", choices=["int8"], help="dynamically quantise the draft (CPU)")
    ap.add_argument("--tp-size", type=int, help="tensor-parallel ranks of the target (default 1)")
    ap.add_argument("--num-cpus", type=float, help="CPUs per model actor (default: 0.5 tiny, 2 real)")
    ap.add_argument("--timeout", type=float, default=300.0, help="HTTP read timeout per request (s)")
    ap.add_argument("--settle", type=float, default=2.0, help="seconds between the drain and the last RSS")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="any other ServeConfig field, as sequoia-ray serve --set takes it (e.g. live_cost_backoff=1)")
    ap.add_argument("--out", type=Path, help="JSON path (default benchmarks/results/load-<tiny|real>.json)")
    ap.add_argument("--config", type=Path, help="start from a serve config's app args instead (e.g. "
                    "deployments/config.yaml: the configuration that ships, with the real pair); the flags given "
                    "here and --set override it")
    args = ap.parse_args()
    counts = [int(c) for c in args.clients.split(",")]
    cfg = build_config(args, max(counts))
    prompts = load_prompts(HERE / "prompts.jsonl")
    if args.vllm and not args.modes:
        raise SystemExit("load.py: --vllm needs --modes (vLLM's server runs after our modes, in the same sweep)")
    if args.repeats < 1 or (args.repeats > 1 and not args.modes):
        raise SystemExit(f"--repeats {args.repeats}: give a count >= 1, and more than 1 only with --modes (a sweep)")
    if args.modes:
        return run_sweep(args, cfg, prompts, counts)
    if len(counts) > 1:
        raise SystemExit("several client counts need --modes (a sweep); give one count for a load test")
    args.clients = counts[0]
    log(f"starting Ray Serve: {cfg['draft']} -> {cfg['target']} ({cfg['dtype']}, tp_size {cfg['tp_size']})")
    with serving(cfg) as url:
        report = load_test(url, prompts, args.clients, args.duration, args.max_tokens, args.timeout, args.settle)
    print_table(report["actors"], ["actor", "pid", "held after", "RSS before MB", "RSS after MB", "delta MB"])
    print()
    print_table([{"metric": k, "value": v} for k, v in report["summary"].items()], ["metric", "value"])
    for error, count in report["errors_by_message"].items():
        print(f"error ({count}x): {error}")
    exact = cfg["dtype"] == "float32"
    s = report["summary"]
    missed = s["errors"] > 0 or any(report["active_after"].values()) or (exact and s["mismatches"] > 0)
    print(f"{cfg['draft']} -> {cfg['target']} ({cfg['dtype']}, tp_size {cfg['tp_size']}): "
          f"{s['mismatches']} of {s['completed']} texts differ from the target alone"
          f"{'' if exact else ' (not float32: near-ties may flip, counted, not failed)'}; goals "
          f"{'MISSED' if missed else 'met'}")
    write_json(f"load-{pair_name(cfg)}",
               {"config": cfg, **report, "prompts": len(prompts)}, args.out)
    return 1 if missed else 0


def pair_name(cfg: dict) -> str:
    """``tiny`` or ``real``: the default JSON name's part."""
    return "tiny" if cfg["target"] == TINY["target"] else "real"


def build_config(args, clients: int) -> dict:
    """The ServeConfig dict from the command line: the benchmark's own (``service_config``) or, with
    ``--config``, that file's app args (a relative plan store resolved as ``sequoia-ray serve`` does), then
    every flag given and every ``--set``; validated (SystemExit naming the field)."""
    flags = {"plan_store": args.plan_store, "batch_layout": args.batch_layout, "prefill_chunk": args.prefill_chunk,
             "threads": args.threads, "batch_wait_ms": args.batch_wait_ms, "live_cost": args.live_cost or None}
    if args.config is None:
        cfg = service_config(args.real, clients, args.tp_size or 1, args.dtype, args.draft_quantize, args.num_cpus)
    else:
        if args.tiny:
            raise SystemExit("load.py: --config runs the file's model pair; leave out --tiny")
        try:
            cfg = {**app_args(args.config, []), "model_name": MODEL, "max_concurrent": clients}
        except (OSError, ValueError) as exc:  # app_args: a ValueError naming what is wrong with the file
            raise SystemExit(f"load.py: --config {args.config}: not a serve config with an application's args "
                             f"({exc}); give e.g. deployments/config.yaml") from None
        flags.update(dtype=args.dtype, draft_quantize=args.draft_quantize, tp_size=args.tp_size,
                     num_cpus=args.num_cpus)
    cfg.update({k: v for k, v in flags.items() if v is not None})
    try:
        cfg.update(override(item) for item in args.set)
    except ValueError as exc:
        raise SystemExit(f"load.py: {exc}") from None
    try:
        ServeConfig.model_validate(cfg)  # a bad --set fails here, naming the field, before Ray starts
    except ValueError as exc:
        raise SystemExit(f"load.py: {exc}") from None
    return cfg


def vllm_differs(cfg: dict) -> str | None:
    """How our config's pair or dtype differs from what vLLM's server runs (None: the same; our draft's int8 and
    65,536-id head are ours alone, said in the README)."""
    from vllm_peer import DRAFT, TARGET

    cfg = ServeConfig.model_validate(cfg)  # the fields a config leaves out at their defaults
    for role, default, path in (("target", "default-target", TARGET), ("draft", "default-draft", DRAFT)):
        if getattr(cfg, role) not in (default, str(path)):
            return f"our {role} is {getattr(cfg, role)!r}"
    return None if cfg.dtype == "bfloat16" else f"our dtype is {cfg.dtype!r}"


def run_sweep(args, cfg: dict, prompts: list[Prompt], counts: list[int]) -> int:
    from load_sweep import cycle_rows, ratios, sweep
    from vllm_server import VLLM_PYTHON, parse_settings, provenance

    modes = [m.strip() for m in args.modes.split(",")]
    if bad := [m for m in modes if m not in ("a", "b", "c", "d")]:
        raise SystemExit(f"--modes {args.modes!r}: {bad[0]!r} is not one of a, b, c, d")
    log(f"sweep {','.join(modes)} at {counts} clients: {cfg['draft']} -> {cfg['target']} ({cfg['dtype']})")
    try:
        vllm = parse_settings(args.vllm) if args.vllm else []
    except ValueError as exc:
        raise SystemExit(f"load.py: --vllm: {exc}") from None
    if vllm and (why := vllm_differs(cfg)):
        raise SystemExit(f"load.py: --vllm serves the default pair in bfloat16 (benchmarks/vllm_server.py), but {why}: "
                         "the cells would compare different models; give --real (or --config deployments/config.yaml) "
                         "and --dtype bfloat16")
    options = {"python": args.vllm_python} if args.vllm_python else {}
    options["prefix_caching"] = cfg.get("prefix_cache_tokens", ServeConfig().prefix_cache_tokens) > 0  # as ours
    try:
        temperatures = tuple(float(t) for t in args.temperatures.split(","))
    except ValueError:
        temperatures = ()
    if not temperatures or any(not 0 <= t <= 2 for t in temperatures):
        raise SystemExit(f"load.py: --temperatures {args.temperatures!r}: give temperatures in [0, 2], e.g. 0,0.6")
    rows, _ = sweep(cfg, prompts, counts, modes, args.duration, args.max_tokens, args.timeout, vllm, options,
                    repeats=args.repeats, temperatures=temperatures)
    columns = ["mode", "clients", "round", "tokens/s", "p50 latency s", "p99 latency s", "p50 TTFT s", "tokens/step",
               "requests/forward", "target busy", "completed", "errors", "mismatches", "held after"]
    print_table(rows, columns)
    print()
    print_table(cycle_rows(rows), ["mode", "clients", "round", "target only", "draft only", "both", "neither",
                                   "verify ms (trees)", "verify ms (alone)", "grow ms", "grow tokens",
                                   "gap after trees ms", "gap after alone ms"])
    print()
    print_table(ratios(rows), ["clients", "(c)/(b)", "(c)/(a)", "(d)/(c)", "(c)/vLLM best"]
                + (["(c)/(a) rounds"] if args.repeats > 1 else []))
    write_json(f"load-sweep-{pair_name(cfg)}",
               {"config": cfg, "rows": rows, "ratios": ratios(rows), "prompts": len(prompts),
                "temperatures": temperatures,
                **({"vllm": provenance(Path(options.get("python", VLLM_PYTHON)), vllm, **options)} if vllm else {}),
                "duration s": args.duration, "max tokens": args.max_tokens}, args.out)
    failed = any(r["errors"] or r["held after"] or (cfg["dtype"] == "float32" and r["mismatches"]) for r in rows)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
