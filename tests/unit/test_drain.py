"""A model replica being stopped waits for the requests its actors hold while they progress (``drain``), and no
longer: not past its timeout, not for requests no forward serves any more, not for a dead actor."""

from __future__ import annotations

import asyncio
import time

from deployments.model_deployments import drain, group_whole


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


class _Rank:
    """A rank handle whose ``health.remote()`` answers, raises (a dead actor) or never returns (a stuck one)."""

    def __init__(self, answer: str) -> None:
        self.health = self
        self.answer = answer

    async def remote(self) -> dict:
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
