"""The profiling job end to end, as a user runs it: `ray start --head`, `ray job submit ...
tuning/profile.py --smoke-test`, wait, read the published plans from the store, stop the cluster."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from sequoia_ray.hardware import BATCH_BUCKETS
from sequoia_ray.plan_store import PlanKey, PlanStore
from tests.serving import own_cluster

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
RUNTIME_ENV_LOST = "Failed to download runtime_env file package"


@pytest.mark.integration
def test_ray_job_submit_smoke_test(tmp_path):
    # a loopback test cluster: no token auth (Ray 2.60 enables it when ~/.ray/auth_token exists)
    env = dict(os.environ, PATH=f"{BIN}:{os.environ['PATH']}", RAY_USAGE_STATS_ENABLED="0", RAY_AUTH_MODE="disabled")
    store = tmp_path / "store"
    with own_cluster(2, env, tmp_path) as (address, dashboard):
        # not the cluster's, though its command line names the cluster's address: stopping must spare it
        decoy = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)", f"--peer={address}"])
        begin = time.time()
        for attempt in range(2):
            job = subprocess.run(
                [str(BIN / "ray"), "job", "submit", "--address", dashboard, "--working-dir", str(REPO), "--",
                 "python", "tuning/profile.py", "--smoke-test", "--storage", str(store), "--temperatures", "0,0.6"],
                env=env, capture_output=True, text=True, timeout=600)
            # Ray's own flake, once in ~5 CI runs here (ray-project/ray#36703, open): the job's working-dir package
            # is gone from the GCS when the job agent downloads it. Its message says to re-submit; the job never ran.
            if job.returncode == 0 or RUNTIME_ENV_LOST not in job.stdout + job.stderr:
                break
            print(f"attempt {attempt + 1} of 2: {RUNTIME_ENV_LOST} (Ray's flake)")
        assert job.returncode == 0, job.stdout[-3000:] + job.stderr[-3000:]
        assert "succeeded" in job.stdout.lower()
        assert "pred" in job.stdout  # the final table
        print(f"job took {time.time() - begin:.0f}s")
    try:  # the cluster's processes are gone, the decoy is not
        left = [p.info["cmdline"] for p in psutil.process_iter(["cmdline"])
                if p.pid != decoy.pid and address in " ".join(p.info["cmdline"] or ())]
        assert not left and decoy.poll() is None, left
    finally:
        decoy.kill()
    plans = PlanStore(str(store)).list_plans()
    assert len(plans) == 2 * len(BATCH_BUCKETS), plans  # a plan per temperature and batch bucket
    hardware = plans[0].split("/plans/")[-1].split("/")[0]
    assert hardware.startswith("cpu-")
    for t in (0.0, 0.6):
        planned, _ = PlanStore(str(store)).fetch_plan(PlanKey(hardware, "tiny-draft", "tiny-target", t))
        assert planned.expected_tokens >= 1.0
        prov = planned.provenance  # the measured choice, its runners-up, and the overhead with the served calls
        assert prov.measured_speedup > 0 and len(prov.candidates) >= 2 and prov.overhead["calls"][1] > 0
    assert list((store / "reports").glob("heatmap-*.png"))
    assert (store / "tune").is_dir()
    shutil.rmtree(store, ignore_errors=True)
