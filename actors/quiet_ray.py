"""Ray's and Serve's idle timers, slowed for a Ray started on this machine.

An idle local Serve app is ~14 processes whose timers fire every 100-250 ms: the raylet reports its resources
and checks memory for GC every 100 ms, its memory and disk monitors run every 250 and 100 ms, every Serve replica
and router flushes its cached metrics every 100 ms, the Serve controller's loop runs every 100 ms. Each wake-up
on a 2-core host interrupts one of the model's two OpenMP threads, and the other waits for it at the next
barrier: paused with SIGSTOP (``benchmarks/background.py``), the idle app's processes gave the in-process
decoder beside them 1.11-1.17x its speed. With these periods 1 s (0.5 s for Serve's control loop), 1.04x.

They cost nothing the service uses: the raylet's resource reports and idle-worker reaping are for scheduling
new workers (a single node schedules on its own view); the OOM monitor acts within 1 s instead of 0.25 s;
Serve's metrics are scraped every 10-15 s; the controller reacts to a dead replica within 0.5 s. Health checks
(3 s for nodes, 10 s for replicas) are unchanged. A variable already set in the environment wins, so an
operator can restore any default (e.g. ``RAY_SERVE_CONTROL_LOOP_INTERVAL_S=0.1``). A cluster started with
``ray start`` (KubeRay) takes them from its containers' environment, not from here.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

QUIET_RAY: dict[str, str] = {
    # Ray core (RAY_<name> overrides ray_config_def.h's default); defaults in the comments
    "RAY_raylet_report_resources_period_milliseconds": "1000",  # 100
    "RAY_raylet_check_gc_period_milliseconds": "1000",  # 100
    "RAY_memory_monitor_refresh_ms": "1000",  # 250
    "RAY_local_fs_monitor_interval_ms": "1000",  # 100
    "RAY_kill_idle_workers_interval_ms": "1000",  # 200
    # Ray Serve (read by each replica, router and the controller when they start)
    "RAY_SERVE_METRICS_EXPORT_INTERVAL_MS": "1000",  # 100
    "RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "0.5",  # 0.1
}


@contextlib.contextmanager
def quiet_ray_environ(enabled: bool = True) -> Iterator[dict[str, str]]:
    """``os.environ`` with those of ``QUIET_RAY`` not already set, for the block: start a local Ray inside it
    (its GCS and raylet inherit the environment, and every worker the raylet's). Restored after. Yields the
    variables it set (none when ``enabled`` is False)."""
    added = {k: v for k, v in QUIET_RAY.items() if k not in os.environ} if enabled else {}
    os.environ.update(added)
    try:
        yield added
    finally:
        for key in added:
            os.environ.pop(key, None)
