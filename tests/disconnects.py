"""Clients that go away, without Ray: a decoder whose steps block a Runner thread as a step's calls to the actors
do, and Starlette's StreamingResponse driven as uvicorn / Serve drive it."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time


class SlowDecoder:
    """Steps of ``step_s`` (the first of ``first_s``, if given), each yielding ``chunk(i)``; keeps every generator
    it makes, so only an explicit close can run its ``finally`` (``freed``)."""

    max_context = None

    def __init__(self, step_s: float = 0.05, first_s: float | None = None, chunk=lambda i: i) -> None:
        self.step_s, self.first_s, self.chunk = step_s, first_s, chunk
        self.kept, self.freed = [], threading.Event()
        self.steps_after_free = 0

    def stream(self, prompt, params, request_id):
        gen = self._steps()
        self.kept.append(gen)
        return gen

    def _steps(self):
        try:
            for i in range(1000):
                time.sleep(self.first_s if i == 0 and self.first_s is not None else self.step_s)
                if self.freed.is_set():
                    self.steps_after_free += 1
                yield self.chunk(i)
        finally:
            self.freed.set()


async def drive(response, disconnect_after: float, spec_version: str = "2.3", sends_before_failing: int | None = None):
    """``response`` (a StreamingResponse) served to a client that goes away after ``disconnect_after`` seconds:
    ASGI spec 2.3 servers tell it by ``http.disconnect`` (the body then runs under an anyio task group whose cancel
    scope cancels every await in the stream's ``finally``); 2.4 servers by failing a send
    (``sends_before_failing``). Whatever Starlette raises is swallowed: the request must be freed anyway."""
    calls = sent = 0

    async def receive():
        nonlocal calls
        calls += 1
        if calls == 1:
            return {"type": "http.request", "body": b"", "more_body": False}
        await asyncio.sleep(disconnect_after)
        return {"type": "http.disconnect"}

    async def send(message):
        nonlocal sent
        sent += 1
        if sends_before_failing is not None and sent > sends_before_failing:
            raise OSError("the client went away")

    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": spec_version}, "method": "POST", "path": "/",
             "headers": []}
    with contextlib.suppress(Exception):
        await response(scope, receive, send)
