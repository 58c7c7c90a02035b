"""Idle-request reaping for the model actors: a request whose client vanished without ``finish`` (a
crashed ingress, a lost network) has its KV state freed after ``timeout_s`` without any call. A request
finished is remembered as long: a ``start`` that arrives after its ``finish`` (the caller gave up waiting on
it and abandoned the request, and the actor ran the two out of order) is not one to hold state for."""

from __future__ import annotations

import time


class Reaper:
    def __init__(self, timeout_s: float, clock=time.monotonic) -> None:
        self.timeout_s, self.clock = timeout_s, clock
        self.last: dict[str, float] = {}
        self.finished: dict[str, float] = {}  # request -> when its finish came (kept ``timeout_s``)

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
                self.finished[rid] = self.clock()
            else:
                self.touch(rid)
        return self.stale()

    def finished_before(self, request_id: str) -> bool:
        """Whether ``request_id`` was finished here within the last ``timeout_s``."""
        return request_id in self.finished

    def stale(self) -> list[str]:
        now = self.clock()
        for rid in [rid for rid, t in self.finished.items() if now - t > self.timeout_s]:
            del self.finished[rid]
        out = [rid for rid, t in self.last.items() if now - t > self.timeout_s]
        for rid in out:
            self.done(rid)
        return out
