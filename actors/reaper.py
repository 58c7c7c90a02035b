"""Idle-request reaping for the model actors: a request whose client vanished without ``finish`` (a
crashed ingress, a lost network) has its KV state freed after ``timeout_s`` without any call."""

from __future__ import annotations

import time


class Reaper:
    def __init__(self, timeout_s: float, clock=time.monotonic) -> None:
        self.timeout_s, self.clock = timeout_s, clock
        self.last: dict[str, float] = {}

    def touch(self, request_id: str) -> None:
        self.last[request_id] = self.clock()

    def done(self, request_id: str) -> None:
        self.last.pop(request_id, None)

    def call(self, worker, method: str, request_id: str, *args):
        """``worker.<method>(request_id, *args)`` after freeing every request idle for too long."""
        for stale in self.stale():
            worker.finish(stale)
        if method == "finish":
            self.done(request_id)
        else:
            self.touch(request_id)
        return getattr(worker, method)(request_id, *args)

    def call_batch(self, worker, method: str, calls: list[tuple]):
        """``worker.<method>(calls)`` (a batched method) after freeing every request idle for too long."""
        for stale in self.stale():
            worker.finish(stale)
        for call in calls:
            self.touch(call[0])
        return getattr(worker, method)(calls)

    def stale(self) -> list[str]:
        now = self.clock()
        out = [rid for rid, t in self.last.items() if now - t > self.timeout_s]
        for rid in out:
            self.done(rid)
        return out
