"""A streaming client that disconnects: the request is freed on the actors (the decoder's generator closed, which
runs its ``finally``: target and draft ``finish``) by the Runner itself, not left to garbage collection.
Starlette's StreamingResponse is driven as uvicorn drives it: ASGI spec 2.3, where the body runs under an anyio
task group whose cancel scope cancels every await in the stream's ``finally`` (the case that lost the close),
and 2.4, where a send fails. No Ray."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from starlette.responses import StreamingResponse

from deployments.service import Runner


class Decoder:
    """Steps of 50 ms; keeps every generator it makes, so only an explicit close can run its ``finally``."""

    def __init__(self) -> None:
        self.kept, self.freed = [], threading.Event()
        self.steps_after_free = 0

    def stream(self, prompt, params, request_id):
        gen = self._steps()
        self.kept.append(gen)
        return gen

    def _steps(self):
        try:
            for i in range(1000):
                time.sleep(0.05)
                if self.freed.is_set():
                    self.steps_after_free += 1
                yield i
        finally:
            self.freed.set()


@pytest.mark.parametrize("spec_version", ["2.3", "2.4"])
def test_a_disconnected_stream_frees_its_request(spec_version):
    decoder, runner = Decoder(), Runner(2)

    async def main():
        async def body():
            async for chunk in runner.stream(decoder, [1], None, "r"):
                yield f"data: {chunk}\n\n"

        calls = 0

        async def receive():
            nonlocal calls
            calls += 1
            if calls == 1:
                return {"type": "http.request", "body": b"", "more_body": False}
            await asyncio.sleep(0.3)  # a few chunks, then the client goes away
            return {"type": "http.disconnect"}

        sent = 0

        async def send(message):  # ASGI 2.4 servers tell a disconnect by failing the send
            nonlocal sent
            sent += 1
            if sent > 6:
                raise OSError("the client went away")

        scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": spec_version}, "method": "POST",
                 "path": "/", "headers": []}
        try:
            await StreamingResponse(body(), media_type="text/event-stream")(scope, receive, send)
        except Exception:  # noqa: BLE001 - Starlette may raise ClientDisconnect; the request must be freed anyway
            pass
        for _ in range(40):  # up to 2 s for the step in flight and the close
            if decoder.freed.is_set():
                break
            await asyncio.sleep(0.05)

    asyncio.run(main())
    assert decoder.freed.is_set(), "the generator was never closed: the request stays held on the actors"
    assert not runner.closing and decoder.steps_after_free == 0
