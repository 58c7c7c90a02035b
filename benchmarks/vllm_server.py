"""vLLM's OpenAI server as a peer *service*: started from its own virtual environment, driven by the same
streaming clients as ours (``benchmarks/load.py --modes ... --vllm plain,k3``).

``benchmarks/vllm_peer.py`` measures vLLM's offline engine (no HTTP, batches submitted together): a figure
to set beside our in-process ones. A user choosing a service compares services: this runs
``vllm.entrypoints.openai.api_server`` (the ``vllm serve`` entry point) on loopback, and the load
benchmark's clients send it the same prompts, at the same client counts, for the same time as our service,
in the same run. Settings: ``plain`` (the target alone) and ``kK`` (vLLM's chain speculation with the same
draft, ``num_speculative_tokens`` K). Both engines serve bfloat16, greedy, ``max_model_len`` 2048, and
prefix caching as ours is set (``prefix_caching``: load.py passes whether our service's ``prefix_cache_tokens``
is above 0): the clients cycle over 12 prompts, so a cache on one side only would skip prefills the other
pays. Each request asks for ``stream_options.include_usage`` so the stream ends with its token count, as
ours does. The speculative settings' tokens/step come from vLLM's Prometheus counters (``/metrics``).

The child's environment is vllm_peer's (``VLLM_CPU_OMP_THREADS_BIND`` = every core, the KV-cache space,
Intel OpenMP preloaded when the venv has it), without this process's ``PYTHONPATH``.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import requests

from actors.target import free_port
from vllm_peer import ALL_CORES, DRAFT, TARGET, log_tail, vllm_env

VLLM_PYTHON = Path("/work/.vllm-venv/bin/python")
SPEC_PREFIX = "vllm:spec_decode_num_"
USAGE = {"stream_options": {"include_usage": True}}


def provenance(python: Path, settings: list[str], **options) -> dict:
    """What the JSON keeps of the vLLM side: its version (asked of its venv), each setting's server command
    (port 0 for the free port it got) and the options given (prefix caching, threads, KV space)."""
    try:
        version = subprocess.run([str(python), "-c", "import vllm; print(vllm.__version__)"], capture_output=True,
                                 text=True, timeout=300).stdout.strip() or None
    except (OSError, subprocess.TimeoutExpired):
        version = None
    commands = {s: server_command(python, s, 0, model_name="bench",
                                  prefix_caching=options.get("prefix_caching", False)) for s in settings}
    return {"version": version, "commands": commands, "options": {k: str(v) for k, v in options.items()}}


def parse_settings(text: str) -> list[str]:
    """``plain,k3`` -> ["plain", "k3"]; anything else names the value and the form."""
    out = [s.strip() for s in text.split(",") if s.strip()]
    bad = [s for s in out if s != "plain" and not re.fullmatch(r"k[1-9][0-9]?", s)]
    if not out or bad:
        raise ValueError(f"vLLM settings {text!r}: each must be 'plain' or kK (K draft tokens, e.g. k3)")
    return out


def server_command(python: Path, setting: str, port: int, *, model_name: str, target: Path = TARGET,
                   draft: Path = DRAFT, max_model_len: int = 2048, prefix_caching: bool = False) -> list[str]:
    cmd = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(target),
           "--served-model-name", model_name, "--dtype", "bfloat16", "--max-model-len", str(max_model_len),
           "--host", "127.0.0.1", "--port", str(port), "--seed", "0",
           "--enable-prefix-caching" if prefix_caching else "--no-enable-prefix-caching",
           "--uvicorn-log-level", "warning"]
    if setting != "plain":
        spec = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": int(setting[1:])}
        cmd += ["--speculative-config", json.dumps(spec)]
    return cmd


@contextlib.contextmanager
def vllm_serving(setting: str, *, model_name: str, python: Path = VLLM_PYTHON, threads_bind: str | None = None,
                 kv_cache_gb: int = 2, start_timeout: float = 1800.0, log_dir: Path | None = None,
                 prefix_caching: bool = False) -> Iterator[str]:
    """The server for ``setting`` on a free loopback port; yields its base URL once ``/health`` answers,
    stops it afterwards. A server that exits or does not come up raises with the tail of its log."""
    if not python.exists():
        raise FileNotFoundError(f"{python}: no vLLM virtual environment; make one with scripts/vllm_venv.sh")
    port = free_port()
    log_dir = log_dir or Path(tempfile.gettempdir()) / "vllm-served"
    log_dir.mkdir(parents=True, exist_ok=True)
    log = log_dir / f"vllm-server-{setting}.log"
    env = vllm_env(threads_bind or ALL_CORES, kv_cache_gb, python.parent.parent)
    env.pop("PYTHONPATH", None)
    with open(log, "w") as fh:
        proc = subprocess.Popen(server_command(python, setting, port, model_name=model_name,
                                               prefix_caching=prefix_caching), env=env, stdout=fh,
                                stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(proc, url, start_timeout, log)
        yield url
    finally:
        _stop(proc)


def _wait_healthy(proc: subprocess.Popen, url: str, timeout: float, log: Path) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"vLLM server exited ({proc.returncode}); its log {log} ends:\n{_tail(log)}")
        with contextlib.suppress(requests.RequestException):
            if requests.get(f"{url}/health", timeout=5).status_code == 200:
                return
        time.sleep(2.0)
    raise TimeoutError(f"vLLM server not healthy after {timeout:.0f} s; its log {log} ends:\n{_tail(log)}")


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, 15)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, 9)
        proc.wait(timeout=30)


def _tail(log: Path) -> str:
    return "\n".join(log_tail(log, 25)) if log.exists() else "(no log)"


def spec_counters(url: str) -> dict[str, float]:
    """vLLM's cumulative ``spec_decode_num_{drafts,draft_tokens,accepted_tokens}`` (empty without them)."""
    return parse_spec_counters(requests.get(f"{url}/metrics", timeout=30).text)


def parse_spec_counters(metrics: str) -> dict[str, float]:
    """The ``spec_decode_num_*`` counters of a Prometheus text exposition, summed over their labels."""
    out: dict[str, float] = {}
    for line in metrics.splitlines():
        name, _, value = line.rpartition(" ")
        name = name.split("{")[0]
        if name.startswith(SPEC_PREFIX) and name.endswith("_total"):  # not the *_created timestamps
            key = name.removeprefix(SPEC_PREFIX).removesuffix("_total")
            out[key] = out.get(key, 0.0) + float(value)
    return out


def tokens_per_step(before: dict[str, float], after: dict[str, float]) -> float | None:
    """Mean tokens a request gains per target forward between two ``spec_counters`` readings: 1 +
    accepted / drafts (None without speculation)."""
    drafts = after.get("drafts", 0.0) - before.get("drafts", 0.0)
    accepted = after.get("accepted_tokens", 0.0) - before.get("accepted_tokens", 0.0)
    return 1 + accepted / drafts if drafts > 0 else None
