"""The session's local Ray (started as the service starts its own) hands the slowed timers to every worker it
spawns, Serve's included, while the driver's environment is as it was."""

from __future__ import annotations

import os

from actors.quiet_ray import QUIET_RAY
from tests.serving import session_ray


def test_workers_run_with_the_slowed_timers():
    import ray

    session_ray()

    @ray.remote(num_cpus=0)
    def seen() -> tuple[dict, float, int]:
        from ray.serve._private import constants

        return ({k: os.environ.get(k) for k in QUIET_RAY}, constants.CONTROL_LOOP_INTERVAL_S,
                constants.RAY_SERVE_METRICS_EXPORT_INTERVAL_MS)

    env, loop_s, export_ms = ray.get(seen.remote(), timeout=120)
    mine = {k: v for k, v in QUIET_RAY.items() if k not in os.environ}  # what the driver did not set itself
    assert mine, "the test's environment already sets every variable: nothing to check"
    assert {k: env[k] for k in mine} == mine
    if "RAY_SERVE_CONTROL_LOOP_INTERVAL_S" in mine:
        assert loop_s == 0.5
    if "RAY_SERVE_METRICS_EXPORT_INTERVAL_MS" in mine:
        assert export_ms == 1000
