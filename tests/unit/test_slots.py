"""``deployments.slots``: a batch's choices are admitted as a whole at once, wait for slots first come first
served, and a freed slot goes straight to the first one waiting (before, they looked again every 50 ms, a request
arriving in a gap took the slot, and several batches arriving together were all admitted past a full replica)."""

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
        assert slots.admit(3) is None  # a batch arriving at a full replica is refused whole
        slots.release()
        tickets = slots.admit(4)  # one holds the freed slot at once, three in line
        assert [t.holds for t in tickets] == [True, False, False, False] and slots.admit(1) is None

        async def choice(name, ticket):
            await slots.claim(ticket)
            order.append(name)

        running = [asyncio.ensure_future(choice(n, t)) for n, t in zip("abcd", tickets)]
        await _settle()
        assert (slots.waiting, slots.in_flight.count, order) == (3, 1, ["a"])
        seen = []
        for _ in "bcd":
            slots.release()  # the holder ends: the slot is handed on, the count unchanged
            seen.append((slots.in_flight.count, slots.take()))  # a request arriving now is refused
            await _settle()
        slots.release()
        await asyncio.gather(*running)
        return order, seen, slots.in_flight.count, slots.waiting

    assert asyncio.run(scenario()) == (list("abcd"), [(1, False)] * 3, 0, 0)


def test_a_choice_cancelled_in_line_or_just_handed_its_slot_holds_none():
    async def scenario():
        slots = Slots(InFlight(0.0), limit=1)
        holder, *tickets = slots.admit(4)
        await slots.claim(holder)
        gone, handed, last = (asyncio.ensure_future(slots.claim(t)) for t in tickets)
        await _settle()
        gone.cancel()  # cancelled in line: skipped by the hand-off
        await _settle()
        slots.release()  # handed to the second, which is cancelled before it runs: it passes the slot on
        handed.cancel()
        await _settle()
        assert last.done() and not last.cancelled() and slots.in_flight.count == 1
        slots.release()
        return gone.cancelled(), handed.cancelled(), slots.in_flight.count, slots.waiting

    assert asyncio.run(scenario()) == (True, True, 0, 0)


def test_the_tickets_of_choices_that_never_started_are_given_back():
    """A batch failing (or its client leaving) before some choices ran: their slots and places are given back;
    the choices that started give back their own."""
    async def scenario():
        slots = Slots(InFlight(0.0), limit=2)
        started, held, in_line = slots.admit(3)
        await slots.claim(started)
        slots.drop([started, held, in_line])  # held's slot freed, in_line out of line; started's not touched
        after_drop = (slots.in_flight.count, slots.waiting)
        slots.release()  # started ends
        return after_drop, slots.in_flight.count, slots.full()

    assert asyncio.run(scenario()) == ((1, 0), 0, False)


def test_a_free_slot_is_taken_at_once_and_a_limit_below_one_is_refused():
    async def scenario():
        slots = Slots(InFlight(0.0), limit=2)
        ticket, = slots.admit(1)
        await slots.claim(ticket)  # a slot free: no waiting
        assert slots.take() and slots.full() and slots.in_flight.count == 2
        slots.release()
        return slots.full(), slots.in_flight.count

    assert asyncio.run(scenario()) == (False, 1)
    with pytest.raises(ValueError, match="limit 0 must be >= 1"):
        Slots(InFlight(0.0), limit=0)
