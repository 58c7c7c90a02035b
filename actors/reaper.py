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

    def due(self, method: str, request_ids: list[str]) -> list[str]:
        """Mark ``request_ids`` alive (or gone, for ``finish``) FIRST — a call that waited in a queue is not
        idle — then the requests idle for longer than ``timeout_s``, forgotten here; the caller frees them."""
        for rid in request_ids:
            if method == "finish":
                self.done(rid)
            else:
                self.touch(rid)
        return self.stale()

    def stale(self) -> list[str]:
        now = self.clock()
        out = [rid for rid, t in self.last.items() if now - t > self.timeout_s]
        for rid in out:
            self.done(rid)
        return out
