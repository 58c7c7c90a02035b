"""benchmarks/background.py: Ray's processes are grouped by what they are, and a paused group is resumed
whatever happens in the block."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import background  # noqa: E402

RAY = "/venv/lib/python3.11/site-packages/ray"


@pytest.mark.parametrize(("cmdline", "group"), [
    ([f"{RAY}/core/src/ray/gcs/gcs_server", "--log_dir=/tmp/ray"], "GCS"),
    # the raylet's arguments name the agents' scripts: it is the raylet by its executable
    ([f"{RAY}/core/src/ray/raylet/raylet", f"--dashboard_agent_command=python {RAY}/dashboard/agent.py"], "raylet"),
    (["ray::DashboardAgent", ""], "dashboard agent"),
    (["ray::RuntimeEnvAgent"], "runtime-env agent"),
    (["python", "-u", f"{RAY}/autoscaler/_private/monitor.py", "--logs-dir=x"], "head daemons"),
    (["python", f"{RAY}/dashboard/dashboard.py", "--disable-frontend"], "head daemons"),
    (["python", "-u", f"{RAY}/_private/log_monitor.py"], "head daemons"),
    (["ray::ServeController.listen_for_change"], "Serve controller"),
    (["ray::ProxyActor"], "proxy"),
    (["ray::ServeReplica:sequoia:Ingress"], "replicas"),
    (["ray::IDLE"], "idle workers"),
    (["ray::TargetRank.verify"], "model actors"),
    (["python", "benchmarks/serve.py"], None),
    ([], None),
])
def test_role_of(cmdline, group):
    assert background.role_of(cmdline) == group


def reaches(proc, stopped: bool, timeout: float = 10.0) -> bool:
    """Whether ``proc`` shows as stopped (or as not stopped) within ``timeout`` s: SIGSTOP and SIGCONT are
    delivered asynchronously, and /proc can show the old state just after on a loaded machine."""
    deadline = time.monotonic() + timeout
    while (proc.status() == psutil.STATUS_STOPPED) != stopped:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def test_paused_stops_and_always_resumes():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        proc = psutil.Process(child.pid)
        with pytest.raises(RuntimeError, match="inside"):
            with background.paused([proc]):
                assert reaches(proc, stopped=True)
                raise RuntimeError("inside")
        assert reaches(proc, stopped=False)
    finally:
        child.kill()
        child.wait()


def test_paired_ratios_are_per_prompt_and_round():
    base = [{"seconds": s} for s in (2.0, 4.0, 8.0, 1.0)]
    runs = [{"seconds": s} for s in (1.0, 4.0, 4.0, 2.0)]  # 2x, 1x, 2x, 0.5x faster
    out = background.paired(base, runs)
    assert out["paired median"] == 1.5
    assert out["paired IQR"] == "0.88-2.00"


def test_while_paused_pauses_for_each_call_only():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        proc = psutil.Process(child.pid)
        call = background.while_paused([proc], lambda x: (x, reaches(proc, stopped=True)))
        assert call(7) == (7, True)
        assert reaches(proc, stopped=False)
    finally:
        child.kill()
        child.wait()
