"""deployments.service.Runner: a request's next step runs while its last chunk is handed on, never more than one
step ahead of the reader, and the request is freed (its generator closed) once the step in flight has ended."""

from __future__ import annotations

import asyncio
import threading

from deployments.service import Runner

WAIT_S = 5.0  # a generous bound for a thread to reach a point that needs no computation


class SteppingDecoder:
    """A decoder whose ``stream`` yields one chunk a step and records, in order, each step's start and end and its
    closing; ``gate`` (when given) holds step ``k`` until it is set."""

    def __init__(self, steps: int, gate: dict[int, threading.Event] | None = None) -> None:
        self.steps, self.gate = steps, gate or {}
        self.log: list[str] = []
        self.started = {k: threading.Event() for k in range(steps)}
        self.lock = threading.Lock()

    def _note(self, event: str) -> None:
        with self.lock:
            self.log.append(event)

    def stream(self, prompt, params, request_id):
        try:
            for k in range(self.steps):
                self._note(f"start {k}")
                self.started[k].set()
                if k in self.gate:
                    assert self.gate[k].wait(WAIT_S), f"step {k} was never let through"
                self._note(f"end {k}")
                yield k
        finally:
            self._note("closed")


def _run(coro):
    return asyncio.run(coro)


def test_the_next_step_runs_while_the_reader_holds_the_last_chunk():
    """The reader, holding chunk 0, sees step 1 start: the step does not wait for the chunk's delivery. (Before
    the read-ahead the reader would wait here in vain: the next step began only when it asked for chunk 1.)"""
    decoder = SteppingDecoder(3)
    runner = Runner(2)

    async def read() -> list[int]:
        got = []
        async for chunk in runner.stream(decoder, [1], None, "r"):
            got.append(chunk)
            if chunk == 0:
                started = await asyncio.to_thread(decoder.started[1].wait, WAIT_S)
                assert started, "step 1 did not start while chunk 0 was being handed on"
        return got

    assert _run(read()) == [0, 1, 2]
    assert decoder.log == ["start 0", "end 0", "start 1", "end 1", "start 2", "end 2", "closed"]


def test_a_reader_that_stops_reading_stops_its_request_one_step_later():
    """Holding chunk 0 and never asking for more, the reader lets step 1 run and nothing after it; closing the
    stream then waits for step 1 to end and closes the decoder's generator (the request is freed)."""
    gate = {1: threading.Event()}
    decoder = SteppingDecoder(5, gate)
    runner = Runner(2)

    async def read_one_then_stop() -> None:
        stream = runner.stream(decoder, [1], None, "r")
        assert await anext(stream) == 0
        assert await asyncio.to_thread(decoder.started[1].wait, WAIT_S)
        closing = asyncio.ensure_future(stream.aclose())
        await asyncio.sleep(0.2)
        assert not closing.done(), "the stream closed while its step was still running"
        gate[1].set()
        await asyncio.wait_for(closing, WAIT_S)

    _run(read_one_then_stop())
    assert decoder.log == ["start 0", "end 0", "start 1", "end 1", "closed"]
    assert not decoder.started[2].is_set()


def test_a_step_that_fails_reaches_the_reader_after_the_chunks_before_it():
    class FailingDecoder(SteppingDecoder):
        def stream(self, prompt, params, request_id):
            yield 0
            raise RuntimeError("step 1 failed")

    runner = Runner(2)

    async def read() -> tuple[list[int], BaseException | None]:
        got = []
        try:
            async for chunk in runner.stream(FailingDecoder(2), [1], None, "r"):
                got.append(chunk)
        except RuntimeError as exc:
            return got, exc
        return got, None

    got, exc = _run(read())
    assert got == [0] and str(exc) == "step 1 failed"
