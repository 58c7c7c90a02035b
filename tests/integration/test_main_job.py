"""The main job's plan end to end with tiny models: the launcher's profile-when-missing publishes plans
under the hardware id the served app's TargetDeployment computes, so the app serves them (its
/v1/models shows a ``store:`` plan source with the serving configuration in the plan's provenance)."""

from __future__ import annotations

import math

import pytest
import requests

pytest.importorskip("ray")

from deployments.config import ServeConfig  # noqa: E402
from deployments.launch import ensure_plans, serving_hardware_id  # noqa: E402
from sequoia_ray.hardware import BATCH_BUCKETS  # noqa: E402
from sequoia_ray.plan_store import PlanStore  # noqa: E402
from tests.serving import BASE, served_metadata, serving  # noqa: E402

pytestmark = pytest.mark.integration


def _any_noise(job, hardware, serving, **kwargs):
    """``run_bounded`` accepting any timing noise: the tiny models' sub-ms forwards, timed while the other test
    worker loads the same two cores, drifted 47% and 66% between rounds in one CI run (the bound is 25%), and
    the built-in plan was served. What is tested here is which plan serves, not the noise check
    (tests/unit/test_cost_model.py has that); the Tune job's smoke test skips it for tiny models too."""
    from sequoia_ray.profiling import run_bounded

    return run_bounded(job.model_copy(update={"max_noise": math.inf}), hardware, serving, **kwargs)


def test_profiled_plan_is_the_one_served(tmp_path):
    args = {**BASE, "plan_store": str(tmp_path / "plans"), "num_cpus": 1, "threads": 1}
    assert ensure_plans(ServeConfig.model_validate(args), 15.0, run=_any_noise) == "profiled"
    published = PlanStore(args["plan_store"]).list_plans()
    assert len(published) == 2 * len(BATCH_BUCKETS)  # T=0.0 and T=0.6, a plan per batch bucket each
    with serving({"main": args}) as url:
        meta = served_metadata(f"{url}/main")
        greedy = [p for p in published if "/t0.0/" in p]
        assert meta["plan_source"] == f"store:{greedy[0]}", meta
        assert meta["hardware_id"] == serving_hardware_id(ServeConfig.model_validate(args))
        r = requests.post(f"{url}/main/v1/completions", json={"model": "tiny", "prompt": "hello", "max_tokens": 8,
                                                               "temperature": 0}, timeout=120)
        assert r.status_code == 200, r.text
    assert ensure_plans(ServeConfig.model_validate(args), 30.0) == "present"
