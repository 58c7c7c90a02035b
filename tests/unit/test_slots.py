"""``deployments.slots``: a batch's choices wait for slots first come first served, and a freed slot goes straight
to the first one waiting (before, they looked again every 50 ms, and a request arriving in a gap took the slot)."""

from __future__ import annotations

import asyncio

import pytest

from deployments.slots import Slots
from sequoia_ray.in_flight import InFlight


async def _settle() -> None:
    for _ in range(3):
        await asyncio.sleep(0)


def test_a_freed_slot_goes_to_the_first_waiting_choice_and_no_newcomer_takes_it():
    async def scenario():
        slots, order = Slots(InFlight(0.0), limit=1), []
        assert slots.take() and not slots.take()  # one slot, held

        async def choice(name):
            await slots.wait()
            order.append(name)

        waiting = [asyncio.ensure_future(choice(n)) for n in "abc"]
        await _settle()
        assert (slots.waiting, slots.in_flight.count, order) == (3, 1, [])
        seen = []
        for _ in "abc":
            slots.release()  # the holder ends: the slot is handed on, the count unchanged
            seen.append((slots.in_flight.count, slots.take()))  # a request arriving now is refused
            await _settle()
        slots.release()
        await asyncio.gather(*waiting)
        return order, seen, slots.in_flight.count, slots.waiting

    assert asyncio.run(scenario()) == (list("abc"), [(1, False)] * 3, 0, 0)


def test_a_choice_cancelled_while_waiting_or_just_handed_its_slot_holds_none():
    async def scenario():
        slots = Slots(InFlight(0.0), limit=1)
        slots.take()
        gone, handed, last = (asyncio.ensure_future(slots.wait()) for _ in range(3))
        await _settle()
        gone.cancel()  # cancelled while waiting: skipped by the hand-off
        await _settle()
        slots.release()  # handed to the second, which is cancelled before it runs: it passes the slot on
        handed.cancel()
        await _settle()
        assert last.done() and not last.cancelled() and slots.in_flight.count == 1
        slots.release()
        return gone.cancelled(), handed.cancelled(), slots.in_flight.count, slots.waiting

    assert asyncio.run(scenario()) == (True, True, 0, 0)


def test_a_free_slot_is_taken_at_once_and_a_limit_below_one_is_refused():
    async def scenario():
        slots = Slots(InFlight(0.0), limit=2)
        await slots.wait()  # a slot free: no waiting
        assert slots.take() and slots.full() and slots.in_flight.count == 2
        slots.release()
        return slots.full(), slots.in_flight.count

    assert asyncio.run(scenario()) == (False, 1)
    with pytest.raises(ValueError, match="limit 0 must be >= 1"):
        Slots(InFlight(0.0), limit=0)
