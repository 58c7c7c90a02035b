"""Idle-request reaping for the model actors: a request whose client vanished without ``finish`` (a
crashed ingress, a lost network) has its KV state freed after ``timeout_s`` without any call. A request
finished is remembered as long: a ``start`` that arrives after its ``finish`` (the caller gave up waiting on
it and abandoned the request, and the actor ran the two out of order) is not one to hold state for.

An actor frees idle requests when a call reaches it; one that nobody calls any more (its ingress crashed with
requests in flight, then traffic stopped) held them for ever — their KV memory, and the autoscaler's count of
held requests, which kept replicas up. Its deployment's health check therefore sends it a ``REAP`` call now and
then (``IdleReaping``)."""

from __future__ import annotations

import logging
import time

import ray

logger = logging.getLogger(__name__)

REAP = "reap"  # a model actor's call that only frees the requests idle too long


class Reaper:
    def __init__(self, timeout_s: float, clock=time.monotonic) -> None:
        self.timeout_s, self.clock = timeout_s, clock
        self.last: dict[str, float] = {}
        self.finished: dict[str, float] = {}  # request -> when its finish came (kept ``timeout_s``)

    def touch(self, request_id: str) -> None:
        self.last[request_id] = self.clock()

    def done(self, request_id: str) -> None:
        self.last.pop(request_id, None)

    def due(self, method: str, request_ids: list[str], waiting: list[str] = ()) -> list[str]:
        """Mark ``request_ids`` alive (or gone, for ``finish``) FIRST — a call that waited in a queue is not
        idle — and so the held requests with a call still ``waiting`` in the queue (singles, a reap among them,
        run before the queued forwards: a request whose verify had arrived within the timeout was freed under
        it, and the verify failed as forgotten); then the requests idle for longer than ``timeout_s``, forgotten
        here; the caller frees them."""
        for rid in waiting:
            if rid in self.last:
                self.touch(rid)
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


class IdleReaping:
    """A deployment's ``REAP`` call to its actor (a TP group's rank 0, which frees the same requests on every
    rank), at most every ``every_s`` and never while the last one is unanswered (it may queue behind a long
    prefill: a call each health check would pile up in the actor's threads). ``tick`` from the health check."""

    def __init__(self, actor, every_s: float, clock=time.monotonic) -> None:
        self.actor, self.every_s, self.clock = actor, every_s, clock
        self.pending = None  # the last REAP call's reference, until it has answered
        self.last = -float("inf")

    def tick(self) -> None:
        if self.pending is not None:
            ready, _ = ray.wait([self.pending], timeout=0)
            if not ready:
                return
            try:
                ray.get(self.pending)  # fetched: an error never read is reported by Ray as unhandled
            except Exception as exc:  # noqa: BLE001 - the health check judges the actor, not this
                logger.debug("idle reaping call failed: %s", exc)
            self.pending = None
        if self.clock() - self.last >= self.every_s:
            self.last = self.clock()
            self.pending = self.actor.call.remote(REAP, "")
