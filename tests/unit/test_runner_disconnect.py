"""A streaming client that disconnects: the request is freed on the actors (the decoder's generator closed, which
runs its ``finally``: target and draft ``finish``) by the Runner itself, not left to garbage collection.
Starlette's StreamingResponse is driven as uvicorn drives it: ASGI spec 2.3, where the body runs under an anyio
task group whose cancel scope cancels every await in the stream's ``finally`` (the case that lost the close),
and 2.4, where a send fails. No Ray."""

from __future__ import annotations

import asyncio

import pytest
from starlette.responses import StreamingResponse

from deployments.service import Runner
from tests.disconnects import SlowDecoder, drive


@pytest.mark.parametrize("spec_version", ["2.3", "2.4"])
def test_a_disconnected_stream_frees_its_request(spec_version):
    decoder, runner = SlowDecoder(), Runner(2)

    async def main():
        async def body():
            async for chunk in runner.stream(decoder, [1], None, "r"):
                yield f"data: {chunk}\n\n"

        # a few chunks, then the client goes away (ASGI 2.4 servers tell it by failing the send)
        await drive(StreamingResponse(body(), media_type="text/event-stream"), 0.3, spec_version,
                    sends_before_failing=6)
        for _ in range(40):  # up to 2 s for the step in flight and the close
            if decoder.freed.is_set():
                break
            await asyncio.sleep(0.05)

    asyncio.run(main())
    assert decoder.freed.is_set(), "the generator was never closed: the request stays held on the actors"
    assert not runner.closing and decoder.steps_after_free == 0
