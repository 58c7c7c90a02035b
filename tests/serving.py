"""Helpers for tests of the serving side: the Serve application on local Ray with the tiny models (one Ray
and Serve for the test session), its metrics, faults injected into its actors, and a fake clock."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time
from collections.abc import Iterator

import requests

BASE = {"model_name": "tiny", "draft": "tiny-draft", "target": "tiny-target", "dtype": "float32", "num_cpus": 0.5,
        "max_tokens_limit": 512, "max_prompt_tokens": 200}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


METRICS_PORT = free_port()  # where the test session's Ray exports metrics (``metrics_text``)
_SESSION: dict = {"port": None}  # Serve's HTTP port while the session's Ray runs


def session_ray() -> None:
    """The test session's local Ray, started on first use and kept: every start and shutdown costs ~15 s
    here, so modules share it. Always a new Ray of its own (``address="local"``): a bare ``ray.init()``
    would attach to any Ray already running on the machine (a killed run's, another job's) and then refuse
    ``num_cpus``. Ray exports metrics to ``METRICS_PORT`` every second. Its workers run at nice 0, as the
    other pytest worker does: at Ray's default nice 15 a model load or a forward in the other worker took
    them ~30x longer (a tiny draft loaded in 33.5 s) and a 5-second step timeout of the fault app fired.
    Ray's idle timers are the service's (``actors.quiet_ray``)."""
    import ray

    from actors.quiet_ray import quiet_ray_environ

    if not ray.is_initialized():  # first use, or ``stop_ray`` ended it since
        _SESSION["port"] = None
        with quiet_ray_environ():
            ray.init(address="local", num_cpus=8, include_dashboard=False, _metrics_export_port=METRICS_PORT,
                     _system_config={"metrics_report_interval_ms": 1000, "worker_niceness": 0})


def _ray_and_serve() -> int:
    """The session's Ray (``session_ray``) and Serve, kept for the test session: modules only deploy and
    delete their own apps. Returns Serve's HTTP port."""
    from ray import serve

    session_ray()
    if _SESSION["port"] is None:
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        _SESSION["port"] = port
    return _SESSION["port"]


def stop_ray() -> None:
    """End the session's Ray and Serve, if running (at the end of the session)."""
    import sys

    if "ray" not in sys.modules:
        return
    import ray
    from ray import serve

    if ray.is_initialized():
        serve.shutdown()
        ray.shutdown()
    _SESSION["port"] = None


@contextlib.contextmanager
def own_cluster(num_cpus: int, env: dict, cwd) -> Iterator[tuple[str, str]]:
    """``ray start --head`` as a user starts a cluster, for tests of ``serve run`` and ``ray job submit``.
    Every port Ray would otherwise take at a fixed number is a free one, so a Ray already running on the
    machine (the session's, another test worker's, a killed run's) does not take the dashboard agent's
    (52365: "No available agent to submit job") or the client server's (10001). Ended with
    ``stop_own_cluster``, which kills this cluster's processes only (``ray stop`` would kill every Ray of
    the machine). Yields the GCS address and the dashboard URL. A ``ray start`` that fails (a port taken
    between ``free_port`` and Ray binding it: another worker's Ray starts alongside) is stopped and tried
    once more on fresh ports; failing again, the error carries Ray's own output."""
    import shutil
    import subprocess
    import sys
    import tempfile
    from pathlib import Path

    ray = str(Path(sys.executable).parent / "ray")
    env = {**env, "RAY_worker_niceness": "0"}  # as the session's Ray (``session_ray``)
    for attempt in (1, 2):
        port, dash = free_port(), free_port()
        temp_dir = tempfile.mkdtemp(prefix="ray-", dir="/tmp")  # short: Ray's socket paths live under it
        start = [ray, "start", "--head", f"--num-cpus={num_cpus}", f"--port={port}", "--dashboard-host=127.0.0.1",
                 f"--dashboard-port={dash}", f"--dashboard-agent-listen-port={free_port()}",
                 f"--ray-client-server-port={free_port()}", "--include-dashboard=true", "--disable-usage-stats",
                 f"--temp-dir={temp_dir}"]
        done = subprocess.run(start, env=env, cwd=cwd, capture_output=True, text=True, timeout=180)
        if done.returncode == 0:
            break
        stop_own_cluster(temp_dir, port)
        shutil.rmtree(temp_dir, ignore_errors=True)
        if attempt == 2:
            raise RuntimeError(f"`ray start --head` failed twice (exit {done.returncode}); its output:\n"
                               f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    try:
        yield f"127.0.0.1:{port}", f"http://127.0.0.1:{dash}"
    finally:
        stop_own_cluster(temp_dir, port)
        shutil.rmtree(temp_dir, ignore_errors=True)


def stop_own_cluster(temp_dir: str, gcs_port: int) -> None:
    """Kill the processes of the cluster ``own_cluster`` started, and only those, as ``ray stop --force``
    kills every Ray process: the ones whose command line names its temp dir or its GCS address or port
    (GCS, raylet, dashboard, monitors, client server), with all their descendants (workers and agents, whose
    titles Ray rewrites); never this process or its ancestors. Scanned again until nothing matches, for a
    worker forked meanwhile."""
    import re

    import psutil

    mark = re.compile(rf"{re.escape(temp_dir)}(?=/|\s|$)|(?:address|gcs_server_port)[= ]\S*\b{gcs_port}\b")
    spared = {os.getpid(), *(p.pid for p in psutil.Process().parents())}
    for _ in range(5):
        roots = [proc for proc in psutil.process_iter(["cmdline"])
                 if proc.pid not in spared and mark.search(" ".join(proc.info["cmdline"] or ()))]
        procs = {p.pid: p for root in roots for p in [root, *_descendants(root)] if p.pid not in spared}
        if not procs:
            return
        for proc in procs.values():
            with contextlib.suppress(psutil.Error):
                proc.kill()
        psutil.wait_procs(list(procs.values()), timeout=30)


def _descendants(proc) -> list:
    import psutil

    try:
        return proc.children(recursive=True)
    except psutil.NoSuchProcess:
        return []


@contextlib.contextmanager
def serving(apps: dict[str, dict]) -> Iterator[str]:
    """The session's Ray and Serve on a free loopback port with ``apps`` (name -> ServeConfig dict, served
    under ``/<name>``). Yields the base URL and deletes the apps afterwards."""
    from ray import serve

    from deployments.app import build_app

    port = _ray_and_serve()
    try:
        for name, cfg in apps.items():
            serve.run(build_app(cfg), name=name, route_prefix=f"/{name}")
        yield f"http://127.0.0.1:{port}"
    finally:
        for name in apps:
            with contextlib.suppress(Exception):  # a failed deploy, or Ray already gone
                serve.delete(name)


def complete(url: str, prompt, headers: dict | None = None, **kw) -> dict:
    """A non-streamed greedy completion that must succeed."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 24, "temperature": 0, **kw}
    r = requests.post(f"{url}/v1/completions", json=body, headers=headers, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def served_metadata(url: str, headers: dict | None = None, timeout_s: float = 60.0) -> dict:
    """``/v1/models``' metadata once the app has set up its plans (until then it says ``status: loading``)."""
    deadline = time.monotonic() + timeout_s
    while True:
        meta = requests.get(f"{url}/v1/models", headers=headers, timeout=30).json()["data"][0]["metadata"]
        if meta.get("status") != "loading" or time.monotonic() > deadline:
            return meta
        time.sleep(0.2)


def sse_events(lines) -> list[dict]:
    """The JSON events of a server-sent-event stream (``[DONE]`` dropped)."""
    return [json.loads(line[len(b"data: "):]) for line in lines if line and line != b"data: [DONE]"]


_LONG_PROMPTS: dict[tuple, str] = {}  # (target, draft, dtype, max_tokens) -> prompt


def greedy_long_prompt(local, max_tokens: int = 500) -> str:
    """A prompt whose greedy continuation runs to ``max_tokens`` (no EOS), for mid-stream faults. Found once
    per pair and length in the test session (the models are loaded from fixed seeds; a search costs ~5 s)."""
    from sequoia_ray.config import SamplingParams
    from sequoia_ray.tree.builtin import builtin_plan

    key = (local.target.name, local.draft.name, str(local.target.model.dtype), max_tokens)
    if key not in _LONG_PROMPTS:
        decoder = local.decoder(builtin_plan(0.0).plan)
        _LONG_PROMPTS[key] = next(
            p for p in ("a long story", "hello world", "x", "abc")
            if decoder.generate(local.encode(p, chat=False), SamplingParams(max_tokens=max_tokens)).finish_reason
            == "length")
    return _LONG_PROMPTS[key]


def metrics_text(port: int) -> str:
    return requests.get(f"http://127.0.0.1:{port}/metrics", timeout=30).text


def app_metric_values(name: str, app: str) -> list[float]:
    """The values of metric ``name`` (every series whose name starts so) that Serve application ``app``
    exported (its ``application`` tag) to the session's Ray: counters live as long as that Ray does, so a
    test reads only its own app's, whatever ran before it."""
    tag = f'application="{app}"'
    return [float(line.rsplit(" ", 1)[1]) for line in metrics_text(METRICS_PORT).splitlines()
            if line.startswith(name) and tag in line]


def wait_for_speculation(url: str, timeout_s: float = 120.0) -> dict:
    """Send requests until one speculates again with a live draft (after a draft replica was replaced);
    returns its ``usage.speculative``."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = complete(url, "hello", max_tokens=20)["usage"]["speculative"]
        if (stats["draft_failures"] == 0 and stats["tokens_per_step"] > 1.0) or time.monotonic() > deadline:
            return stats
        time.sleep(1)


def stall(actor, method: str) -> None:
    """Make the model actor's next ``method`` call (on its worker) block for a minute before it runs, as a
    stuck kernel or a lost peer would; also its batched form (``grow_batch``, ``verify_batch``), which is what
    the actors' batchers call."""
    import ray

    def patch(instance):
        import time as t

        for name in (method, f"{method}_batch"):
            real = getattr(instance.worker, name, None)
            if real is None:
                continue

            def stuck(*args, _real=real, **kwargs):
                t.sleep(60)
                return _real(*args, **kwargs)

            setattr(instance.worker, name, stuck)

    ray.get(actor.__ray_call__.remote(patch))


class Clock:
    """A clock tests set by hand (``clock.now = 6``)."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now
