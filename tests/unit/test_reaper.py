"""Idle requests are freed on the model actors (their client vanished without a finish)."""

from __future__ import annotations

from actors.draft import DraftActor
from actors.reaper import Reaper
from actors.spec import ModelActorSpec
from sequoia_ray.config import SamplingParams
from tests.serving import Clock


def test_reaper_frees_only_idle_requests():
    clock = Clock()
    r = Reaper(10.0, clock)
    r.touch("a")
    clock.now = 6
    r.touch("b")
    clock.now = 11
    assert r.stale() == ["a"]
    r.done("b")
    clock.now = 100
    assert r.stale() == []


def test_draft_actor_reaps_on_the_next_call():
    actor = DraftActor(ModelActorSpec("tiny-draft", idle_timeout_s=5.0))
    assert actor.info()["device"] == "cpu"  # auto without an assigned GPU
    clock = Clock()
    actor.reaper.clock = clock
    params = SamplingParams(max_tokens=8)
    actor.call("start", "old", [3, 4, 5], params, 1)
    clock.now = 4
    actor.call("start", "new", [3, 4], params, 2)
    assert actor.active() == 2
    clock.now = 7  # "old" idle for 7 s > 5 s, "new" for 3 s
    actor.call("finish", "new")
    assert actor.active() == 0 and actor.reaper.last == {}


def test_a_start_after_its_requests_finish_holds_nothing():
    """A caller that timed out on a ``start`` abandons the request (a finish it does not wait for); the actor may
    run that finish first. The late start then held the request until the reaper freed it (300 s by default);
    now it is not started. A finished id is remembered as long as an idle one; a reaped request starts again."""
    actor = DraftActor(ModelActorSpec("tiny-draft", idle_timeout_s=5.0))
    clock = Clock()
    actor.reaper.clock = clock
    params = SamplingParams(max_tokens=8)
    actor.call("finish", "late")  # the abandon, run before the start it follows
    assert actor.call("start", "late", [3, 4, 5], params, 1) is None and actor.active() == 0
    actor.call("start", "idle", [3, 4], params, 2)
    clock.now = 6  # both past the timeout: "late" forgotten, "idle" reaped by this call
    actor.call("start", "other", [3], params, 3)
    assert actor.reaper.finished == {} and actor.active() == 1
    actor.call("start", "idle", [3, 4], params, 2)  # a reaped request comes back (the draft link restarts it)
    actor.call("start", "late", [3, 4, 5], params, 1)  # and an id finished long ago is an id like any other
    assert actor.active() == 3


def test_a_reap_call_frees_idle_requests_on_an_actor_nobody_else_calls():
    """Idle requests were freed only when another call came: an actor left without calls (its ingress crashed
    with requests in flight, then traffic stopped) held them for ever, its KV memory and the autoscaler's count of
    held requests with them. The deployment's health check now sends ``REAP``; on a TP group rank 0 decides
    and every rank frees the same requests."""
    from actors.reaper import REAP
    from actors.target import TargetRank, free_port

    draft = DraftActor(ModelActorSpec("tiny-draft", idle_timeout_s=5.0))
    rank = TargetRank(0, 1, "127.0.0.1", free_port(), "gloo", ModelActorSpec("tiny-target", idle_timeout_s=5.0))
    rank.lead([])
    params = SamplingParams(max_tokens=8)
    for actor in (draft, rank):
        actor.reaper.clock = clock = Clock()
        actor.call("start", "gone-0", [3, 4, 5], params, 1)
        actor.call("start", "gone-1", [3, 4], params, 2)
        clock.now = 3
        assert actor.call(REAP, "") == [] and actor.active() == 2  # not idle long enough: kept
        clock.now = 6
        assert sorted(actor.call(REAP, "")) == ["gone-0", "gone-1"] and actor.active() == 0
        assert actor.reaper.finished == {} and actor.health()["broken"] is None
        actor.batcher.close()


def test_idle_reaping_sends_at_most_one_call_at_a_time_and_no_more_often_than_asked(monkeypatch):
    import actors.reaper as reaper

    sent, answered = [], set()

    class Actor:
        class call:
            @staticmethod
            def remote(method, request_id):
                sent.append((method, request_id))
                return len(sent)

    monkeypatch.setattr(reaper.ray, "wait", lambda refs, timeout: ([r for r in refs if r in answered], []))
    monkeypatch.setattr(reaper.ray, "get", lambda ref: None)
    clock = Clock()
    reaping = reaper.IdleReaping(Actor(), every_s=75.0, clock=clock)
    reaping.tick()
    clock.now = 100
    reaping.tick()  # the first still unanswered (queued behind a long prefill): none sent
    answered.add(1)
    reaping.tick()  # answered, and 75 s passed: the next one
    clock.now = 120
    answered.add(2)
    reaping.tick()  # answered, but only 20 s since: none
    assert sent == [(reaper.REAP, "")] * 2


def test_a_request_whose_call_waits_in_the_queue_is_not_reaped():
    """A review: request ``a``'s verify arrived within the idle timeout while a forward ran, and the health check's
    reap queued behind it; singles run before the queued forwards, so the reap freed ``a`` (idle by the clock) and
    its verify failed as forgotten (the client's 503 ``request_idle_timeout``). Queued calls now count as alive."""
    import threading
    import time

    import torch

    from actors.reaper import REAP
    from actors.target import TargetRank, free_port
    from sequoia_ray.draft import DraftTree
    from sequoia_ray.engine import ROOT_ONLY

    rank = TargetRank(0, 1, "127.0.0.1", free_port(), "gloo", ModelActorSpec("tiny-target", idle_timeout_s=5.0))
    rank.lead([])
    clock = Clock()
    rank.reaper.clock = clock
    params = SamplingParams(max_tokens=8, temperature=0)
    rank.call("start", "a", [3, 4, 5], params, 1)  # t = 0
    gate, real_start = threading.Event(), rank.worker.start

    def slow_start(rid, *args):  # holds the compute thread, as a long forward does
        if rid == "b":
            gate.wait(30)
        return real_start(rid, *args)

    rank.worker.start = slow_start
    out = {}

    def run(key, *call):
        try:
            out[key] = rank.call(*call)
        except Exception as exc:  # noqa: BLE001 - recorded for the assertion
            out[key] = exc

    def queued(rid):
        for _ in range(300):
            if rid in [c.request_id for c in list(rank.batcher.queue)]:
                return
            time.sleep(0.01)
        raise AssertionError(f"{rid!r} never queued")

    try:
        threads = [threading.Thread(target=run, args=("b", "start", "b", [3, 4], params, 2))]
        threads[0].start()
        clock.now = 4.0  # a's client comes back within the timeout
        threads.append(threading.Thread(target=run, args=("a", "verify", "a", ROOT_ONLY,
                                                          DraftTree(torch.tensor([5]), {}))))
        threads[-1].start()
        queued("a")
        threads.append(threading.Thread(target=run, args=("reap", REAP, "")))
        threads[-1].start()
        queued("")
        clock.now = 6.0  # the forward in flight ends after the timeout
        gate.set()
        for t in threads:
            t.join(30)
        assert "a" not in out["reap"] and not isinstance(out["a"], Exception), out
        assert out["a"].tokens  # its verify ran
    finally:
        gate.set()
        rank.batcher.close()
