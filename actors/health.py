"""What a model actor is doing, for its deployment's health check.

A call that never returns (a hung GPU kernel, a TP rank waiting in a collective on a peer that died or
hung) shows up as a call running longer than ``step_timeout_s``; a TP rank whose call failed part-way
through a collective no longer knows the group's state, so it marks itself broken and refuses further
calls until the group is replaced. ``health()`` runs in its own concurrency group, so it answers while
a call is in flight.
"""

from __future__ import annotations

import time
from contextlib import contextmanager

from sequoia_ray.request_errors import UnknownRequest, poisons_device


class CallTracker:
    def __init__(self, *, fatal_errors: bool, clock=time.monotonic) -> None:
        self.fatal_errors, self.clock = fatal_errors, clock
        self.started: float | None = None
        self.broken: str | None = None

    @contextmanager
    def running(self, method: str):
        if self.broken is not None:
            raise RuntimeError(f"this actor is broken ({self.broken}); it is waiting to be replaced")
        self.started = self.clock()
        try:
            yield
        except UnknownRequest:
            raise  # a finished or reaped request: the caller's problem, the actor is fine
        except Exception as exc:
            if self.fatal_errors or poisons_device(exc):  # a CUDA error fails every later call of this process
                self.broken = f"{method} failed: {type(exc).__name__}: {exc}"
            raise
        finally:
            self.started = None

    def health(self) -> dict:
        started = self.started  # read once: the call may end (None) between two reads, on the compute thread
        return {"busy_s": 0.0 if started is None else self.clock() - started, "broken": self.broken}


def raise_if_unhealthy(states: list[dict], step_timeout_s: float, what: str) -> None:
    """Fail a Serve health check (so Serve replaces the replica with all its actors) on a broken actor
    or one stuck in a call for longer than ``step_timeout_s``."""
    for i, state in enumerate(states):
        if state["broken"]:
            raise RuntimeError(f"{what} {i} is broken: {state['broken']}")
        if state["busy_s"] > step_timeout_s:
            raise RuntimeError(f"{what} {i} has been in one call for {state['busy_s']:.0f} s "
                               f"(step_timeout_s {step_timeout_s:g})")
