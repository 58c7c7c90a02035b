"""A client that goes away is no server error, and every request is counted by how it ended: a disconnect logged a
22-frame traceback at ERROR ("unexpected error": Serve cancels the request's task, an awaited Ray call raises
TaskCancelledError) and counted a 500; a stream was counted 200 when its response started, whatever followed
(failed, cut off)."""

from __future__ import annotations

import asyncio
import json
import logging
from types import SimpleNamespace

import pytest
from fastapi.responses import StreamingResponse
from ray.exceptions import TaskCancelledError

from deployments import openai_api as api
from deployments.ingress import OpenAIIngress, _sse, _unexpected


def _errors(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]


@pytest.mark.parametrize("exc, status, logged", [(TaskCancelledError(), 499, False), (RuntimeError("bug"), 500, True)])
def test_a_client_gone_is_a_499_without_a_traceback(caplog, exc, status, logged):
    with caplog.at_level(logging.DEBUG, logger="sequoia_ray.serve"):
        response = asyncio.run(_unexpected(None, exc))
    assert response.status_code == status and json.loads(response.body)["error"]["message"]
    assert bool(_errors(caplog)) == logged


async def _events(fail: BaseException | None, n: int = 3):
    for i in range(n):
        yield {"i": i}
    if fail is not None:
        raise fail


@pytest.mark.parametrize("fail, status, last, logged", [
    (None, "200", "[DONE]", False),
    (api.APIError(429, "busy"), "429", "[DONE]", False),
    (RuntimeError("the target broke"), "503", "[DONE]", True),
    (TaskCancelledError(), "499", '{"i": 2}', False),  # the client went away: nobody to send [DONE] to
])
def test_a_stream_is_counted_by_how_it_ended(caplog, fail, status, last, logged):
    ended: list[str] = []

    async def read() -> list[str]:
        return [e async for e in _sse(_events(fail), ended.append)]

    with caplog.at_level(logging.DEBUG, logger="sequoia_ray.serve"):
        sent = asyncio.run(read())
    assert ended == [status] and sent[-1] == f"data: {last}\n\n" and bool(_errors(caplog)) == logged


def test_a_stream_closed_by_its_reader_is_counted_once_as_the_client_gone():
    ended: list[str] = []

    async def read_one() -> None:
        stream = _sse(_events(None), ended.append)
        await stream.__anext__()
        await stream.aclose()  # Starlette closes it when the client disconnects

    asyncio.run(read_one())
    assert ended == ["499"]


class _Metrics:
    def __init__(self) -> None:
        self.counted: list[dict] = []
        self.requests = SimpleNamespace(inc=lambda tags: self.counted.append(tags))


def _ingress(serve):
    """The ingress without its constructor: what ``_counted`` reads, ``_serve`` given."""
    class Held(OpenAIIngress.func_or_class):  # Serve awaits ``__del__``; garbage collection must not start it
        def __del__(self) -> None:
            pass

    replica = object.__new__(Held)
    replica.expected_auth, replica.metrics = None, _Metrics()
    replica.cfg = SimpleNamespace(max_body_bytes=1 << 20)
    replica._serve = serve
    return replica


def _request():
    async def receive():
        return {"type": "http.request", "body": b'{"model": "m", "prompt": "hi"}', "more_body": False}

    from starlette.requests import Request

    return Request({"type": "http", "method": "POST", "headers": [], "path": "/v1/completions"}, receive)


@pytest.mark.parametrize("raised, status", [(TaskCancelledError(), "499"), (asyncio.CancelledError(), "499"),
                                            (api.APIError(400, "bad"), "400"), (RuntimeError("bug"), "500")])
def test_a_request_is_counted_by_how_it_ended(raised, status):
    async def serve(req, chat, ended, received):
        raise raised

    replica = _ingress(serve)
    with pytest.raises(type(raised)):
        asyncio.run(replica._counted("completions", _request(), api.CompletionRequest, chat=False))
    assert replica.metrics.counted == [{"route": "completions", "status": status}]


def test_a_streams_request_is_counted_when_the_stream_ends():
    async def serve(req, chat, ended, received):
        return StreamingResponse(_sse(_events(RuntimeError("the target broke")), ended))

    replica = _ingress(serve)

    async def scenario():
        response = await replica._counted("completions", _request(), api.CompletionRequest, chat=False)
        assert replica.metrics.counted == []  # not when the response starts
        return [chunk async for chunk in response.body_iterator]

    sent = asyncio.run(scenario())
    assert sent[-1] == "data: [DONE]\n\n"
    assert replica.metrics.counted == [{"route": "completions", "status": "503"}]


def test_the_services_log_lines_go_where_serves_do():
    """In a replica "ray.serve" has Serve's handlers (file and stderr, with time and request id) and the service's
    logger had none: its INFO lines (the plan chosen per bucket) were dropped, its warnings printed bare."""
    from deployments.ingress import log_where_serve_does

    ours, serves = logging.getLogger("sequoia_ray"), logging.getLogger("ray.serve")
    saved = [(logger, logger.handlers[:], logger.propagate, logger.level) for logger in (ours, serves)]
    seen: list[str] = []

    class Serves(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(f"{record.levelname} {record.name}: {record.getMessage()}")

    try:
        ours.handlers[:], serves.handlers[:] = [], [Serves()]
        ours.setLevel(logging.NOTSET)
        serves.setLevel(logging.INFO)
        log_where_serve_does()
        log_where_serve_does()  # a second replica in the process: still one handler
        logging.getLogger("sequoia_ray.serve").info("plan for t0.0: builtin")
        logging.getLogger("sequoia_ray.serve").debug("below Serve's level")
        assert seen == ["INFO sequoia_ray.serve: plan for t0.0: builtin"] and not ours.propagate
        again: list[str] = []

        class Renewed(logging.Handler):
            def emit(self, record: logging.LogRecord) -> None:
                again.append(record.getMessage())

        serves.handlers[:] = [Renewed()]  # Serve configures its logger again (a deployment's new logging_config)
        logging.getLogger("sequoia_ray.serve").warning("through the new handlers")
        assert again == ["through the new handlers"] and len(seen) == 1  # not the replaced handler
    finally:
        for logger, handlers, propagate, level in saved:
            logger.handlers[:], logger.propagate = handlers, propagate
            logger.setLevel(level)  # (setLevel clears the loggers' cached levels)
