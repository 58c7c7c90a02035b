"""The ingress's Python handle methods (``generate``, ``generate_stream``: what a DeploymentHandle's caller gets)
without Ray: the real request path (_prepare, _chunks, _events) over a tiny in-process pair standing in for the
actors. Each test failed on the code before session 56's review of these surfaces."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
from ray.exceptions import RayError, RayTaskError

from deployments import openai_api as api
from deployments.config import ServeConfig
from deployments.ingress import OpenAIIngress
from deployments.service import ActivePlan, Runner
from deployments.slots import Slots
from sequoia_ray.in_flight import InFlight
from sequoia_ray.local import LocalPair
from sequoia_ray.models.loading import TINY_TARGET
from sequoia_ray.tree.builtin import builtin_plan


class Held(OpenAIIngress.func_or_class):  # Serve awaits __del__ itself; garbage collection must not start one
    def __del__(self) -> None:
        pass


@pytest.fixture(scope="module")
def pair():
    return LocalPair.tiny(device="cpu")


def replica(pair, **cfg):
    """The ingress as Serve holds it, made without its constructor; its decoders run ``pair`` in process."""
    r = object.__new__(Held)
    r.cfg = ServeConfig(model_name="m", draft=None, target=TINY_TARGET, **cfg)
    r.tokenizer = pair.target.tokenizer
    nop = lambda *a, **k: None  # noqa: E731
    r.metrics = SimpleNamespace(active=SimpleNamespace(set=nop), plan=SimpleNamespace(set=nop),
                                plan_tags=lambda *a: {}, finished=nop, generated=nop,
                                ttft=SimpleNamespace(observe=nop), requests=SimpleNamespace(inc=nop))
    r.in_flight, r.runner = InFlight(0.0), Runner(r.cfg.max_concurrent)
    r.slots = Slots(r.in_flight, r.cfg.max_concurrent)
    r.families = r.rules = r.live = r.rates = None
    r.background, r.expected_auth = [], None
    plans = SimpleNamespace(hardware="hw", get=lambda t, size=1: ActivePlan(builtin_plan(t), "builtin"))

    async def served_plans():
        return plans

    async def decoder(plan, speculate, family=None, rules=None):
        return pair.decoder(plan(), speculate=speculate)

    r._plans, r._decoder = served_plans, decoder
    return r


def test_an_api_error_reaches_a_handle_caller_whole():
    """Ray pickles what a replica method raises: APIError did not rebuild (its args are the message alone), and
    the caller got an UnserializableException without the status, so a 429 or 503 read like any error."""
    raised = api.APIError(429, "busy", type="rate_limit_error", code="overloaded", retry_after_s=1)
    sent = RayTaskError("OpenAIIngress.generate", "traceback", raised).to_bytes()
    back = RayError.from_bytes(sent).as_instanceof_cause()  # what ray.get raises in the caller
    assert isinstance(back, api.APIError) and back.status == 429  # ``except APIError`` works there
    assert back.cause.body() == raised.body() and back.cause.headers == {"Retry-After": "1"}


def test_generate_stream_is_a_stream_whatever_the_body_says(pair):
    """``stream_options`` without ``stream: true`` was a 400, though the call streams."""
    body = {"model": "m", "prompt": "x", "max_tokens": 3, "temperature": 0,
            "stream_options": {"include_usage": True}}

    async def collect():
        return [e async for e in replica(pair).generate_stream(body)]

    events = asyncio.run(collect())
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] <= 3


def test_a_chat_stream_refused_sends_no_event_first(pair):
    """A chat's role event went out before the admission check: a 429 arrived after one chunk, where over HTTP
    the same request is a plain error."""
    r = replica(pair, max_concurrent=1)
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 300, "ignore_eos": True}

    async def scenario():
        busy = r.generate_stream(chat)
        await busy.__anext__()  # it holds the one slot
        got = []
        with pytest.raises(api.APIError) as refused:
            async for event in r.generate_stream(chat):
                got.append(event)
        await busy.aclose()
        return got, refused.value.status

    assert asyncio.run(scenario()) == ([], 429)


def test_a_handle_result_has_the_shape_json_gives_an_http_client(pair):
    """The histograms had int keys through a handle and string keys over HTTP (JSON): code written against one
    met a KeyError on the other."""
    out = asyncio.run(replica(pair).generate({"model": "m", "prompt": "hello", "max_tokens": 4, "temperature": 0}))
    spec = out["usage"]["speculative"]
    assert spec["accepted_histogram"] and all(isinstance(k, str) for k in spec["accepted_histogram"])
    assert all(isinstance(k, str) for k in spec["root_rank_histogram"])


@pytest.mark.parametrize("prompt, params, error, fragment", [
    ([500, 3, 4], None, "PromptError", "[0, "),  # was torch's IndexError from the embedding
    ([5, 96, 300], None, "PromptError", "[300]"),  # an id past the vocabulary last: was a "draft failure"
    ([-5, 3], None, "PromptError", "[-5]"),  # was the tokenizer's OverflowError
    ("hello", None, "PromptError", "encode text"),  # was the tokenizer's TypeError
    ([5, 3], {"max_tokens": 4}, "TypeError", "SamplingParams"),  # was AttributeError: 'dict' ... 'seed'
])
def test_an_in_process_prompt_or_params_the_models_cannot_read_is_refused_by_name(pair, prompt, params, error,
                                                                                     fragment):
    from sequoia_ray.config import SamplingParams

    decoder = pair.decoder(builtin_plan(0.0).plan)
    with pytest.raises(Exception) as info:
        decoder.generate(prompt, SamplingParams(max_tokens=4) if params is None else params)
    assert type(info.value).__name__ == error and fragment in str(info.value)


def test_handle_calls_are_counted_by_how_they_ended(pair):
    """``sequoia_requests`` counted only HTTP requests: a handle's traffic and its errors were invisible."""
    r = replica(pair, max_concurrent=1)
    counted: list[dict] = []
    r.metrics.requests = SimpleNamespace(inc=lambda tags: counted.append(tags))
    body = {"model": "m", "prompt": "hi", "max_tokens": 3, "temperature": 0}

    async def scenario():
        await r.generate(body)
        with pytest.raises(api.APIError):
            await r.generate({**body, "model": "other"})  # 404
        [e async for e in r.generate_stream(body)]
        stream = r.generate_stream({**body, "max_tokens": 50, "ignore_eos": True})
        await stream.__anext__()
        await stream.aclose()  # its caller stopped reading

    asyncio.run(scenario())
    assert [(c["route"], c["status"]) for c in counted] == [
        ("handle_generate", "200"), ("handle_generate", "404"), ("handle_generate_stream", "200"),
        ("handle_generate_stream", "499")]


def test_a_request_the_target_freed_as_idle_says_so_not_that_the_target_failed(pair):
    """A request the target freed after request_idle_timeout_s without a step was a 503 saying the target had
    failed and was being restarted: the operator looked for a failure that never happened."""
    from actors.adapters import RequestForgotten

    r = replica(pair)

    class Forgotten:
        max_context = 512

        def stream(self, prompt, params, request_id):
            raise RequestForgotten("the target no longer holds the request during verify")
            yield  # a generator, as the decoder's stream is

    async def decoder(plan, speculate, family=None, rules=None):
        return Forgotten()

    r._decoder = decoder
    with pytest.raises(api.APIError) as info:
        asyncio.run(r.generate({"model": "m", "prompt": "hi", "max_tokens": 4}))
    error = info.value
    assert (error.status, error.code) == (503, "request_idle_timeout") and "request_idle_timeout_s (300 s)" in str(
        error.message) and r.active == 0



@pytest.mark.parametrize("n, spec_version, sends", [(2, "2.3", None), (2, "2.3", 3), (2, "2.4", 3),
                                                    (1, "2.3", None), (1, "2.4", 3)])  # n 1: guards (held before)
def test_a_stream_whose_client_left_frees_its_slots_and_stops_without_a_collection(pair, monkeypatch, n,
                                                                                      spec_version, sends):
    """A stream's generation starts before the response (its first chunk is awaited for errors). A client gone
    before the response's first byte (spec 2.3: the start's ``send`` held up, the disconnect first) left that
    generation running — Starlette never iterates the body, and an async generator closed before its first step
    skips its ``finally`` — with its slots taken until a garbage collection: with ``n`` 2 both choices ran all 300
    tokens for nobody. A client gone mid-stream (after ``sends`` body chunks: spec 2.3 by a disconnect, 2.4 by a
    failing ``send``) did the same: under 2.4 Starlette does not close a body it stopped, and under 2.3 the cancel
    left ``n``'s merged choices to a collection. Driven through the FastAPI app, collections off, as between a
    replica's collections."""
    import gc
    import json

    from ray import serve
    from starlette.requests import ClientDisconnect

    from deployments.ingress import app

    r = replica(pair, max_concurrent=4)
    monkeypatch.setattr(serve, "get_replica_context", lambda: SimpleNamespace(servable_object=r))
    counted, made = [], []
    r.metrics.requests = SimpleNamespace(inc=lambda tags: counted.append(tags["status"]))
    r.metrics.generated = made.append
    body = json.dumps({"model": "m", "prompt": "hello", "max_tokens": 300, "ignore_eos": True, "temperature": 0,
                       "stream": True, "n": n}).encode()
    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": spec_version}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": "/v1/completions", "raw_path": b"/v1/completions",
             "query_string": b"", "root_path": "", "client": ("127.0.0.1", 1), "server": ("test", 80),
             "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]}

    async def main():
        asked, chunks, left = 0, 0, asyncio.Event()

        async def receive():
            nonlocal asked
            asked += 1
            if asked == 1:
                return {"type": "http.request", "body": body, "more_body": False}
            if sends is not None:
                await (left.wait() if spec_version == "2.3" else asyncio.sleep(60))  # 2.4: told by a failed send
            return {"type": "http.disconnect"}

        async def send(message):
            nonlocal chunks
            if sends is None:
                await asyncio.sleep(60)  # the start held up on the way: the disconnect comes first
            chunks += message["type"] == "http.response.body"
            if chunks >= sends:
                left.set()
            if chunks > sends and spec_version == "2.4":
                raise OSError("the client went away")
            await asyncio.sleep(0)  # a send yields to the loop, as a server's does

        try:
            await app(scope, receive, send)
        except ClientDisconnect:  # the failed send, raised on as Starlette's (the server's to catch)
            assert sends is not None
        for _ in range(40):  # up to 2 s for the step in flight and the close
            if r.active == 0:
                break
            await asyncio.sleep(0.05)
        before = sum(made)
        await asyncio.sleep(0.5)  # time for a few more steps, were any choice still generating
        return before, sum(made)

    gc.disable()
    try:
        before, after = asyncio.run(main())
    finally:
        gc.enable()
    assert r.active == 0, f"{r.active} slots still held"
    assert counted == ["499"] and after == before < 300 * n, (counted, before, after)


def test_a_handle_stream_closed_after_its_first_event_stops_its_choices(pair):
    """A handle caller that stops reading (``aclose`` on ``generate_stream``) frees the slots of all ``n`` choices
    and stops their generation at once, collections off (a guard: it held before ``generate_stream`` closed its
    stream itself too, by reference counting)."""
    import gc

    r = replica(pair, max_concurrent=4)
    made = []
    r.metrics.generated = made.append

    async def main():
        stream = r.generate_stream({"model": "m", "prompt": "hello", "max_tokens": 300, "ignore_eos": True,
                                    "temperature": 0, "n": 2})
        await stream.__anext__()
        held = r.active
        await stream.aclose()
        before = sum(made)
        await asyncio.sleep(0.5)
        return held, before, sum(made)

    gc.disable()
    try:
        held, before, after = asyncio.run(main())
    finally:
        gc.enable()
    assert held == 2 and r.active == 0 and after == before < 600, (held, r.active, before, after)
