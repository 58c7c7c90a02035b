"""A model replica being stopped waits for the requests its actors hold while they progress (``drain``), and no
longer: not past its timeout, not for requests no forward serves any more, not for a dead actor."""

from __future__ import annotations

import asyncio
import time

from deployments.model_deployments import actor_state, drain, group_whole


def _states(*states):
    """``state()`` answering each of ``states`` in turn (the last one ever after), counting its calls."""
    calls = []

    async def state():
        calls.append(1)
        return states[min(len(calls), len(states)) - 1]

    return state, calls


def test_waits_until_the_held_requests_end():
    state, calls = _states((2, 1.0), (2, 1.5), (1, 2.0), (0, 2.5))
    assert asyncio.run(drain(state, 10.0, poll_s=0.01)) == 0
    assert len(calls) == 4


def test_stops_waiting_for_requests_no_forward_serves():
    state, calls = _states((1, 3.0))  # held, but the batcher's busy time never moves: abandoned
    start = time.monotonic()
    assert asyncio.run(drain(state, 10.0, stall_s=0.1, poll_s=0.01)) == 1
    assert 0.1 <= time.monotonic() - start < 2.0 and len(calls) >= 2  # after the stall, long before the timeout


def test_stops_at_the_timeout_even_while_requests_progress():
    busy = iter(range(10_000))

    async def state():
        return 3, float(next(busy))

    assert asyncio.run(drain(state, 0.1, stall_s=10.0, poll_s=0.01)) == 3


def test_a_dead_actor_holds_nothing():
    async def state():
        raise RuntimeError("ActorDiedError")

    assert asyncio.run(drain(state, 10.0)) == 0


def test_a_frozen_actor_is_not_waited_for_past_one_call():
    """An actor that never answers (frozen: the health check fails it by its timeout) kept the drain, and the
    replica's bundles, for the whole drain timeout (300 s by default)."""
    async def state():
        await asyncio.sleep(3600)

    start = time.monotonic()
    assert asyncio.run(drain(state, 10.0, call_s=0.2)) == 0
    assert time.monotonic() - start < 2.0


class _Method:
    """An actor method as the code calls it: ``method.remote()``, awaited."""

    def __init__(self, fn) -> None:
        self.remote = fn


class _InOneLongForward:
    """An actor in one forward (a long prefill) since it was made: its batcher's busy time moves only when a
    forward ends, so it stays put; ``health()`` shows the time in the current call growing. Its one request
    ends after ``ends_after_s``."""

    def __init__(self, ends_after_s: float) -> None:
        self.start = time.monotonic()
        self.ends_after_s = ends_after_s

        async def active():
            return 0 if time.monotonic() - self.start >= self.ends_after_s else 1

        async def utilization():
            return {"busy_s": 2.0}

        async def health():
            return {"busy_s": time.monotonic() - self.start, "broken": None}

        self.active, self.utilization, self.health = _Method(active), _Method(utilization), _Method(health)


def test_a_forward_in_progress_is_progress():
    """A forward longer than the stall window (a CPU prefill) must not read as an abandoned request."""
    actor = _InOneLongForward(ends_after_s=0.4)
    assert asyncio.run(drain(lambda: actor_state(actor), 10.0, stall_s=0.1, poll_s=0.01)) == 0
    assert time.monotonic() - actor.start >= 0.4  # it waited for the forward and its request to end


def test_a_call_stuck_past_the_step_timeout_is_no_progress():
    actor = _InOneLongForward(ends_after_s=60.0)
    start = time.monotonic()
    assert asyncio.run(drain(lambda: actor_state(actor, 0.05), 10.0, stall_s=0.1, poll_s=0.01)) == 1
    assert time.monotonic() - start < 2.0  # stuck: the stall window ends the wait, not the drain's timeout


class _Rank:
    """A rank handle whose ``health.remote()`` answers, raises (a dead actor) or never returns (a stuck one)."""

    def __init__(self, answer: str) -> None:
        self.answer = answer
        self.health = _Method(self._health)

    async def _health(self) -> dict:
        if self.answer == "dead":
            raise RuntimeError("the actor died")
        if self.answer == "stuck":
            await asyncio.sleep(60)
        return {}


def test_a_group_is_whole_only_while_every_rank_answers():
    assert asyncio.run(group_whole([_Rank("ok"), _Rank("ok")], 1.0))
    assert not asyncio.run(group_whole([_Rank("ok"), _Rank("dead")], 1.0))  # nothing it holds can finish
    start = time.monotonic()
    assert not asyncio.run(group_whole([_Rank("stuck"), _Rank("ok")], 0.1))
    assert time.monotonic() - start < 5.0  # the timeout bounds the wait


class _GroupRank(_Rank):
    """A rank that also answers the drain's calls: it holds ``held`` requests and its batcher never moves."""

    def __init__(self, answer: str, held: int = 0) -> None:
        super().__init__(answer)

        async def active():
            return held

        async def utilization():
            return {"busy_s": 1.0}

        self.active, self.utilization = _Method(active), _Method(utilization)


class _Group:
    def __init__(self, ranks) -> None:
        self.ranks, self.killed = ranks, 0

    def kill(self) -> None:
        self.killed += 1


def _stopping_replica(group, drain_timeout_s: float = 30.0):
    """A ``TargetDeployment`` instance as Serve holds it when stopping it, made without its constructor."""
    from types import SimpleNamespace

    from deployments.model_deployments import TargetDeployment

    cls = TargetDeployment.func_or_class

    class Held(cls):  # Serve awaits ``__del__`` itself; garbage collection must not start another (unawaited)
        def __del__(self) -> None:
            pass

    replica = object.__new__(Held)
    replica.cfg = SimpleNamespace(health_check_timeout_s=1.0, drain_timeout_s=drain_timeout_s, step_timeout_s=60.0)
    if group is not None:
        replica.group = group
    return cls, replica


def test_a_stopping_target_replica_drains_a_whole_group_then_ends_its_ranks():
    group = _Group([_GroupRank("ok", held=1), _GroupRank("ok", held=1)])
    cls, replica = _stopping_replica(group, drain_timeout_s=0.3)
    start = time.monotonic()
    asyncio.run(cls.__del__(replica))
    assert time.monotonic() - start >= 0.3  # it waited for the held request (up to the drain's timeout)
    assert group.killed == 1


def test_a_stopping_target_replica_with_a_dead_rank_ends_at_once():
    group = _Group([_GroupRank("ok", held=1), _GroupRank("dead")])
    cls, replica = _stopping_replica(group, drain_timeout_s=30.0)
    start = time.monotonic()
    asyncio.run(cls.__del__(replica))
    assert time.monotonic() - start < 3.0  # no drain: the held request can never finish
    assert group.killed == 1


def test_a_target_replica_whose_constructor_failed_stops_quietly():
    cls, replica = _stopping_replica(None)
    asyncio.run(cls.__del__(replica))  # no group: nothing to drain or end, and no AttributeError
