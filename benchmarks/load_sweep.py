"""The batching comparison of ``benchmarks/load.py --modes a,b,c --clients 1,2,4,8``, side by side in one run:

- (a) the target alone with continuous batching: requests with ``"speculative": false`` (root-only trees,
  every waiting request's token in one target forward);
- (b) trees, one request per forward, as before batching: the same service with ``max_batch_requests: 1``
  and every step a tree (``live_cost`` off);
- (c) batched trees with the plan of the current batch size (``plan_store`` given: the store's per-bucket
  plans; else the built-in plan at every batch size);
- (d) as (c), with dynamic trees (``dynamic_trees: true``: each step's tree pruned by the cost model's rule;
  it needs the store's hardware profile, else (d) is (c)).

(a) and (c) share one deployment, (b) and (d) each have their own. For each client count and mode: total tokens/s, p50/p99
latency, p50 TTFT, tokens per step, requests per target forward (from rank 0's batcher), errors, and greedy
texts that differ from the target alone (one request at a time, same dtype); in the JSON, after each (c)
cell, the service's measured tree-or-target-alone choice so far (``step rates``, with ``live_cost``). Then
the ratios (c)/(b), (c)/(a) and (d)/(c) per client count. With ``--vllm plain,k3``, vLLM's OpenAI server
(``benchmarks/vllm_server.py``) then takes the same clients at the same counts, and (c) over vLLM's best
setting is a third ratio.
"""

from __future__ import annotations

import time
from dataclasses import replace
from statistics import median

import ray
import requests

from load import MODEL, log, model_actors, references, run_clients, serving, summarize, wait_idle
from step_cycle import cycle, trace_rows
from vllm_peer import output_tokens
from vllm_server import USAGE, spec_counters, tokens_per_step, vllm_serving

MODES = {"a": "target alone, batched", "b": "trees, 1 request/forward", "c": "batched trees, per-batch plans",
         "d": "batched trees, dynamic"}


def forwards(actor) -> dict[int, int]:
    return {int(k): v for k, v in ray.get(actor.batch_sizes.remote()).items()}


def busy_share(actor, before: dict[str, float]) -> float | None:
    """The share of the time since ``before`` (the actor's ``utilization()`` then) its batcher ran batches."""
    after = ray.get(actor.utilization.remote())
    running = after["running_s"] - before["running_s"]
    return (after["busy_s"] - before["busy_s"]) / running if running > 0 else None


def mean_batch(before: dict[int, int], after: dict[int, int]) -> float | None:
    runs = {b: after.get(b, 0) - before.get(b, 0) for b in after}
    count = sum(runs.values())
    return sum(b * n for b, n in runs.items()) / count if count else None


def point(url: str, prompts, refs: list[str], mode: str, clients: int, duration: float, max_tokens: int,
          timeout: float, temperatures: tuple[float, ...] = (0.0,)) -> dict:
    """One (mode, clients) measurement: ``duration`` seconds of back-to-back streaming requests."""
    actors = model_actors()
    rank0 = actors["TargetRank 0"]
    before, busy = forwards(rank0), ray.get(rank0.utilization.remote())
    log(f"({mode}) {MODES[mode]}: {clients} clients for {duration:g} s")
    start = time.monotonic()  # the actors' clock too: a local cluster, one host
    results, seconds = run_clients(url, prompts, clients, duration, max_tokens, timeout, temperatures,
                                   speculative=mode != "a")
    end = time.monotonic()
    target_busy = busy_share(rank0, busy)
    target, draft = (ray.get(a.batch_trace.remote(start)) for a in (rank0, actors["DraftActor"]))
    steps = {**cycle(target, draft, start, end),
             "forwards": {"target": trace_rows(target, start), "draft": trace_rows(draft, start)}}
    held = wait_idle(url, 30.0)
    return {**_row(mode, results, refs, seconds, clients, duration, max_tokens, tokens_per_step=None,
                   requests_per_forward=mean_batch(before, forwards(rank0)), target_busy=target_busy,
                   held=held_after(held),
                   step_rates=step_rates(url) if mode in "cd" else None), "cycle": steps}


def held_after(counts: dict[str, int | str]) -> int | str:
    """What the service still holds after a cell: the requests, or ``dead`` when an actor died (it read 0 before,
    and the run's failure check passed it)."""
    return "dead" if "dead" in counts.values() else sum(counts.values())


def _row(mode: str, results, refs: list[str], seconds: float, clients: int, duration: float, max_tokens: int, *,
         tokens_per_step: float | None, requests_per_forward: float | None, target_busy: float | None, held: int,
         step_rates: dict | None) -> dict:
    """A sweep row: the cell's summary (texts compared with the target alone's ``refs``) and what was measured
    beside it (``tokens_per_step`` None: the streams' own, pooled: their tokens over their steps, as vLLM's
    counters pool theirs)."""
    mismatched = sum(r.differs(refs) for r in results)
    s = summarize(results, [], mismatched, seconds, clients, duration, max_tokens)
    return {"mode": mode, "clients": clients, "tokens/s": s["tokens/s"], "p50 latency s": s["p50 latency s"],
            "p99 latency s": s["p99 latency s"], "p50 TTFT s": s["p50 TTFT s"],
            "tokens/step": s["tokens/step (pooled)"] if tokens_per_step is None else tokens_per_step,
            "requests/forward": requests_per_forward, "target busy": target_busy, "completed": s["completed"],
            "errors": s["errors"], "mismatches": mismatched, "held after": held, "step rates": step_rates}


def step_rates(url: str) -> dict | None:
    """The service's measured tree-or-target-alone choice so far (``live_cost``; None when off): per
    temperature and batch bucket, the arm serving and each arm's tokens/s per request and steps."""
    try:
        return requests.get(f"{url}/v1/models", timeout=30).json()["data"][0]["metadata"]["step_rates"]
    except (requests.RequestException, ValueError, KeyError, IndexError) as exc:
        log(f"step rates not read: {type(exc).__name__}: {exc}")
        return None


def vllm_point(url: str, prompts, refs: list[str], setting: str, clients: int, duration: float, max_tokens: int,
               timeout: float, temperatures: tuple[float, ...] = (0.0,)) -> dict:
    """One (vLLM setting, clients) measurement, as ``point`` (texts compared with our target alone's; tokens
    counted as ours, without the EOS vLLM counts: ``vllm_peer.output_tokens``)."""
    before = spec_counters(url)
    log(f"(vLLM {setting}): {clients} clients for {duration:g} s")
    results, seconds = run_clients(url, prompts, clients, duration, max_tokens, timeout, temperatures, **USAGE)
    results = [replace(r, tokens=output_tokens(r.tokens, r.finish_reason, r.stop_reason)) for r in results]
    return _row(f"vLLM {setting}", results, refs, seconds, clients, duration, max_tokens,
                tokens_per_step=tokens_per_step(before, spec_counters(url)), requests_per_forward=None,
                target_busy=None, held=0, step_rates=None)


def sweep(cfg: dict, prompts, counts: list[int], modes: list[str], duration: float, max_tokens: int,
          timeout: float, vllm: list[str] = (), vllm_options: dict | None = None,
          repeats: int = 1, temperatures: tuple[float, ...] = (0.0,)) -> tuple[list[dict], list[str]]:
    """Every mode at every client count, then every vLLM setting's server (``vllm_server``) at every client
    count (client i at ``temperatures[i % len]``: greedy and sampled requests in one batch), each count after a
    warm-up at that count (one request a client: at the largest count only, a
    deployment's first cell at 1 client ran its batch-1 path cold); the references come from the first
    deployment. vLLM runs after our rounds, not between them: (c) over vLLM is not a paired ratio, and moves
    with the host between the two (both services up at once would share the two cores while idle). ``repeats``: (a) and (c), which share a deployment,
    run that many rounds per client count, in alternating order (a, c, then c, a, ...): the host's speed moves
    up to 2x within minutes here, and a ratio of cells side by side, in both orders, is what holds still. Each
    row carries its ``round``."""
    rows, refs = [], None
    # (b) is the service as it was before batching: trees at every step, whatever ``live_cost`` says for (c)
    # (measured in session 14 with it on: the target alone one request per forward, 8-9 tok/s from 2 clients)
    before = {**cfg, "max_concurrent": max(counts), "max_batch_requests": 1, "live_cost": False}
    deployments = [({**cfg, "max_concurrent": max(counts)}, [m for m in modes if m in "ac"]),
                   (before, [m for m in modes if m == "b"]),
                   ({**cfg, "max_concurrent": max(counts), "dynamic_trees": True}, [m for m in modes if m == "d"])]
    for deployment, its_modes in deployments:
        if not its_modes:
            continue
        with serving(deployment) as url:
            if refs is None:
                log(f"references: {len(prompts)} prompts, target alone, one at a time")
                refs = [r.text for r in references(url, prompts, max_tokens, timeout)]
            for clients in counts:
                run_clients(url, prompts, clients, 0.0, max_tokens, timeout, temperatures)  # warm-up, this batch
                for round_ in range(repeats if its_modes[0] in "ac" else 1):
                    for mode in its_modes if round_ % 2 == 0 else its_modes[::-1]:
                        row = point(url, prompts, refs, mode, clients, duration, max_tokens, timeout, temperatures)
                        rows.append({**row, "round": round_})
        time.sleep(2.0)
    if vllm and refs is None:
        raise ValueError("vLLM settings need at least one of our modes (its texts are compared with ours)")
    for setting in vllm:
        log(f"starting vLLM's server ({setting}); on CPU this takes minutes")
        with vllm_serving(setting, model_name=MODEL, **(vllm_options or {})) as url:
            for clients in counts:
                run_clients(url, prompts, clients, 0.0, max_tokens, timeout, temperatures, **USAGE)  # as ours
                rows.append({**vllm_point(url, prompts, refs, setting, clients, duration, max_tokens, timeout,
                                          temperatures), "round": 0})
    rows.sort(key=lambda r: (r["clients"], r["mode"], r.get("round", 0)))
    return rows, refs


def cycle_rows(rows: list[dict]) -> list[dict]:
    """Per row of ours, where the window went (``step_cycle.cycle``), flat for a table."""
    out = []
    for r in rows:
        c = r.get("cycle")
        if c:
            out.append({"mode": r["mode"], "clients": r["clients"], "round": r.get("round", 0),
                        **{k: c[k] for k in ("target only", "draft only", "both", "neither")},
                        "verify ms (trees)": c["target with trees"]["median ms"],
                        "verify ms (alone)": c["target alone"]["median ms"], "grow ms": c["draft"]["median ms"],
                        "grow tokens": c["draft"]["tokens"],
                        "gap after trees ms": c["gap after trees ms"], "gap after alone ms": c["gap after alone ms"]})
    return out


def ratios(rows: list[dict]) -> list[dict]:
    """(c)/(b), (c)/(a), (d)/(c) and (c) over vLLM's best setting in total tokens/s per client count (None
    where a mode was not run). With rounds (``sweep(repeats=...)``), (c)/(a) is the median of each round's
    ratio, and ``(c)/(a) rounds`` lists them; the other modes' ratios take (c)'s median cell."""
    by: dict[tuple[str, int], dict[int, float]] = {}
    for r in rows:
        by.setdefault((r["mode"], r["clients"]), {})[r.get("round", 0)] = r["tokens/s"]
    one = {key: median(cells.values()) for key, cells in by.items()}
    out = []
    for clients in sorted({r["clients"] for r in rows}):
        c = one.get(("c", clients))
        peers = [v for (mode, n), v in one.items() if n == clients and mode.startswith("vLLM ")]
        a, cs = by.get(("a", clients), {}), by.get(("c", clients), {})
        rounds = [cs[i] / a[i] for i in sorted(a.keys() & cs.keys()) if a[i]]
        out.append({"clients": clients,
                    "(c)/(b)": c / one[("b", clients)] if c and one.get(("b", clients)) else None,
                    "(c)/(a)": median(rounds) if rounds else None,
                    "(d)/(c)": one[("d", clients)] / c if c and one.get(("d", clients)) else None,
                    "(c)/vLLM best": c / max(peers) if c and peers else None,
                    **({"(c)/(a) rounds": [round(x, 3) for x in rounds]} if len(rounds) > 1 else {})})
    return out
