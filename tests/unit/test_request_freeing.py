"""A request's admission slot and its state on the actors are freed together, and the replica's set-up and stop
wait for what they must (session 56's review of the request path; each test failed on the code before):
- a client gone mid-step: Starlette cancels the stream twice, the Runner's wait for the request's close ended at
  once and its ``max_concurrent`` slot went to a new request while the departed one's step still held a Runner
  thread (the new request's first token waited behind it) and the actors' state;
- a stopping replica returned from ``__del__`` with requests still being freed: the actors held them until their
  idle reaper (and counted them as held, for the autoscaler and the models' drain);
- the first request's client gone during the replica's set-up (a cancel) left the plans set without the
  dynamic-tree rules and the live planner, for the replica's life."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import time
from types import SimpleNamespace

import pytest

from deployments import openai_api as api
from deployments.ingress import OpenAIIngress
from deployments.service import ActivePlan, Runner
from deployments.slots import Slots
from sequoia_ray.config import SamplingParams
from sequoia_ray.engine import Chunk
from sequoia_ray.in_flight import InFlight
from sequoia_ray.tree.builtin import builtin_plan
from tests.disconnects import SlowDecoder, drive


class Held(OpenAIIngress.func_or_class):  # Serve awaits __del__ itself; GC must not start one
    def __del__(self) -> None:
        pass


def Decoder(step_s: float) -> SlowDecoder:
    """A request whose first step is quick and whose later steps each take ``step_s`` (e.g. a chunked prefill)."""
    return SlowDecoder(step_s, first_s=0.01, chunk=lambda i: Chunk([5], "x"))


def _metrics():
    nop = lambda *a, **k: None  # noqa: E731
    return SimpleNamespace(active=SimpleNamespace(set=nop), plan=SimpleNamespace(set=nop), plan_tags=lambda *a: {},
                           finished=nop, generated=nop, ttft=SimpleNamespace(observe=nop))


def _replica(decoders, max_concurrent=1):
    replica = object.__new__(Held)
    replica.cfg = SimpleNamespace(max_concurrent=max_concurrent, model_name="m")
    replica.in_flight, replica.runner, replica.metrics = InFlight(0.0), Runner(max_concurrent), _metrics()
    replica.slots = Slots(replica.in_flight, max_concurrent)
    replica.families = replica.rules = replica.live = None
    replica.background = []
    plans = SimpleNamespace(hardware="hw", get=lambda t, size=1: ActivePlan(builtin_plan(t), "builtin"))

    async def served_plans():
        return plans

    async def decoder(*a, **k):
        return decoders.pop(0)

    async def prepared(req, chat):
        return [[1, 2, 3]], SamplingParams(max_tokens=1000)

    replica._plans, replica._decoder, replica._prepared = served_plans, decoder, prepared
    return replica


REQ = SimpleNamespace(stream=True, id_kind="cmpl", speculative=True, usage_every_chunk=False, usage_chunk=False,
                      choices=1, prompt_param="prompt",
                      logprob_count=None)


def test_a_disconnected_stream_keeps_its_max_concurrent_slot_until_its_request_is_freed():
    """Client A leaves during a 2 s step (max_concurrent 1). Its slot was released at once, while its step still
    ran in the Runner's pool (and on the actors) and its close had not run: B was admitted and its first token
    waited ~1.7 s behind A's step. Now B is refused (429, retry) until A is freed, then served at once."""
    slow, quick = Decoder(step_s=2.0), Decoder(step_s=0.01)
    replica = _replica([slow, quick], max_concurrent=1)

    async def scenario():
        response = await replica._serve(REQ, chat=False)
        await drive(response, disconnect_after=0.3)  # A's second step (2 s) is running now
        held = (replica.in_flight.count, slow.freed.is_set())
        with pytest.raises(api.APIError) as refused:
            await replica._serve(REQ, chat=False)
        for _ in range(60):
            if replica.in_flight.count == 0:
                break
            await asyncio.sleep(0.05)
        freed_then = slow.freed.is_set()
        t0 = time.perf_counter()
        await replica._serve(REQ, chat=False)  # B again: admitted, its first chunk without waiting for A
        return held, refused.value.status, freed_then, time.perf_counter() - t0

    held, status, freed_then, b_first = asyncio.run(scenario())
    assert held == (1, False), "the max_concurrent slot was released while A's step still ran and A held state"
    assert status == 429 and freed_then  # the slot came back when A was freed, not before
    assert b_first < 0.5


def test_stopping_the_ingress_waits_for_the_requests_it_is_freeing():
    """A client left mid-step; the replica stops (Serve awaits __del__ once no request task is left): the close
    still pending in Runner.closing was not awaited, and the actors kept the request until their idle reaper."""
    slow, = [Decoder(step_s=1.0)]
    replica = _replica([slow], max_concurrent=1)

    async def scenario():
        response = await replica._serve(REQ, chat=False)
        await drive(response, disconnect_after=0.2)
        closing = len(replica.runner.closing)
        await OpenAIIngress.func_or_class.__del__(replica)
        return closing, slow.freed.is_set()

    closing, freed = asyncio.run(scenario())
    assert closing == 1 and freed, "__del__ returned with a request still being freed (Runner.closing not awaited)"


def test_a_first_request_cancelled_during_set_up_leaves_the_rules_and_the_live_planner_set_up(monkeypatch):
    """The first request's _plans() set self.plans, then awaited GrowRules (a store read) before self.live: a
    request meanwhile served without them, and the first one's client gone (a cancel) there left the replica
    without them for good."""
    from deployments.config import ServeConfig

    class SlowRules:  # GrowRules reads the hardware profile from the store
        def __init__(self, plans, extend):
            time.sleep(0.3)

    monkeypatch.setitem(OpenAIIngress.func_or_class._plans.__globals__, "GrowRules", SlowRules)  # Serve copied the class
    replica = object.__new__(Held)
    replica.cfg = ServeConfig.model_validate({"model_name": "m", "target": "tiny-target", "draft": "tiny-draft",
                                              "dynamic_trees": True, "live_acceptance": True})
    replica.plans = replica.live = replica.families = replica.rules = None
    replica.background = []

    async def actors():
        return {"hardware_id": "hw"}

    replica.target_deployment = SimpleNamespace(actors=SimpleNamespace(remote=actors))

    async def scenario():
        first = asyncio.create_task(replica._plans())
        await asyncio.sleep(0.1)  # in GrowRules
        second = asyncio.create_task(replica._plans())  # a second request meanwhile
        await asyncio.sleep(0.05)
        first.cancel()  # the first request's client went away
        with contextlib.suppress(asyncio.CancelledError):
            await first
        seen_by_second = (await second, replica.rules, replica.live)
        await replica._plans()  # every later request
        for task in replica.background:
            task.cancel()
        return first.cancelled(), seen_by_second, replica.rules, replica.live

    cancelled, (plans, rules_seen, live_seen), rules, live = asyncio.run(scenario())
    assert cancelled and plans is not None
    assert rules_seen is not None and live_seen is not None, "a request during the set-up served without them"
    assert rules is not None and live is not None, "dynamic trees and live acceptance are off for good"



@pytest.mark.parametrize("where, finish_s", [("target", 0.0), ("draft", 0.0), ("draft", 2.0)])
def test_a_client_gone_during_a_long_prefill_stops_it_at_the_next_chunk(where, finish_s):
    """The client leaves 3 chunks into a prefill of 60 (the draft's at a request's first grow, the target's at
    its first verify). The Runner waited for that step: every chunk ran for nobody (52 after the client left, in
    the review's run) before the stream could close. Now the request is freed under its step (the draft
    abandoned, the target finished) and the prefill stops at its next chunk; nothing is held after. With a
    target whose finish takes ``finish_s`` (busy in a long forward), the draft is abandoned first: told second,
    it ran 40 chunks behind a 2 s finish."""
    from sequoia_ray.batching import BatchedWorker, Batcher, BatchLimits
    from sequoia_ray.draft import DraftWorker
    from sequoia_ray.engine import SpeculativeDecoder
    from sequoia_ray.target import TargetWorker
    from tests.tiny import agreeing_pair

    target_model, draft_model = agreeing_pair()
    target, draft = TargetWorker(target_model, prefill_chunk=2), DraftWorker(draft_model, prefill_chunk=2)
    forwards: list[float] = []
    slowed = target if where == "target" else draft
    method = "verify_batch" if where == "target" else "grow_batch"
    real = getattr(slowed, method)

    def counted(calls, caps=None):  # a chunk of ~40 ms (a CPU prefill chunk of a real model takes far longer)
        time.sleep(0.04)
        forwards.append(time.monotonic())
        return real(calls, caps)

    setattr(slowed, method, counted)
    batchers = [Batcher.over(target, BatchLimits(), name="target"), Batcher.over(draft, BatchLimits(), name="draft")]

    class SlowFinish(BatchedWorker):
        def finish(self, request_id):
            time.sleep(finish_s)
            return self.batcher.call("finish", request_id)

    decoder = SpeculativeDecoder(SlowFinish(batchers[0]), BatchedWorker(batchers[1]) if where == "draft" else None,
                                 builtin_plan(0.0).plan)
    prompt = [(i * 7) % 90 + 3 for i in range(120)]  # 60 chunks of 2 tokens

    async def scenario():
        runner = Runner(1)

        async def client():
            async for _ in runner.stream(decoder, prompt, SamplingParams(max_tokens=8, temperature=0), "r1"):
                pass

        task = asyncio.create_task(client())
        while len(forwards) < 3:  # the prefill has begun (a fixed wait was flaky on a loaded host)
            await asyncio.sleep(0.01)
        gone = time.monotonic()
        task.cancel()  # the client went away
        with contextlib.suppress(asyncio.CancelledError):
            await task
        assert await runner.drain(30.0) == 0
        return gone

    try:
        gone = asyncio.run(scenario())
    finally:
        for batcher in batchers:
            batcher.close()
    after = [t for t in forwards if t > gone]
    assert len(after) <= 3, len(after)  # it stopped at the next chunk (of 57 left)
    assert not target.requests and not draft.requests and not decoder.cancels  # nothing held after


def test_cancels_run_on_threads_of_their_own(monkeypatch):
    """A cancel blocks on the actors (a finish behind a forward); on the event loop's default pool, shared with
    the ingress's prompt tokenising and plan lookups, 8 departing clients stalled a new request's preparation
    2.9 s in the review's run."""
    class Blocking(SlowDecoder):
        def cancel(self, request_id):
            time.sleep(1.0)
            return True

    async def scenario():
        loop = asyncio.get_running_loop()
        loop.set_default_executor(concurrent.futures.ThreadPoolExecutor(max_workers=2))
        runner = Runner(3)

        async def client(decoder):
            async for _ in runner.stream(decoder, [1], None, "r"):
                pass

        tasks = [asyncio.create_task(client(Blocking(step_s=1.0, first_s=0.0))) for _ in range(3)]
        await asyncio.sleep(0.2)  # each in its second, slow step
        for task in tasks:
            task.cancel()  # (each then waits for its close, shielded: not awaited here)
        await asyncio.sleep(0.1)  # the cancels have begun
        start = time.perf_counter()
        await asyncio.to_thread(lambda: None)  # what _prepared does for a new request
        waited = time.perf_counter() - start
        await asyncio.gather(*tasks, return_exceptions=True)
        await runner.drain(10.0)
        return waited

    assert asyncio.run(scenario()) < 0.5


def test_a_stopping_replica_ends_a_set_up_still_in_flight():
    """The first request's client left during the set-up (the target answering late) and the replica stopped:
    the set-up went on and started the background loops after ``__del__`` had returned."""
    from deployments.config import ServeConfig

    replica = object.__new__(Held)
    replica.cfg = ServeConfig.model_validate({"model_name": "m", "target": "tiny-target", "plan_refresh_s": 0.05})
    replica.plans = replica.live = replica.families = replica.rules = None
    replica.background, replica.runner = [], Runner(1)

    async def actors():
        await asyncio.sleep(0.3)  # the target replica is still loading
        return {"hardware_id": "hw"}

    replica.target_deployment = SimpleNamespace(actors=SimpleNamespace(remote=actors))

    async def scenario():
        first = asyncio.create_task(replica._plans())
        await asyncio.sleep(0.05)
        first.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await first
        await OpenAIIngress.func_or_class.__del__(replica)
        await asyncio.sleep(0.5)
        running = [task for task in replica.background if not task.done()]
        for task in running:
            task.cancel()
        return len(running)

    assert asyncio.run(scenario()) == 0
