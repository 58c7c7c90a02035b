"""An ingress replica's ``max_concurrent`` slots, over the count of requests in flight (``InFlight``).

A request takes a slot at once or is refused (429). A batch's or ``n``'s choices are admitted or refused as a
whole, at once (``admit``): the choices that find a slot free hold it from then, the others are put in line, and
a freed slot goes straight to the first choice in line — the count never drops between them, so no request
arriving in between takes it. Before, waiting choices looked again every 50 ms: each waited up to that long for
a slot already free, and steady single requests, arriving in those gaps, could take every freed slot while a
batch's last choices waited on; and the choices took their slots only when their tasks first ran, so several
batches arriving together were all admitted past a full replica, and a streamed batch could wait for a choice
it had counted as starting at once.

Everything here runs on the replica's event loop (``release`` is called from a task's done callback).
"""

from __future__ import annotations

import asyncio
from collections import deque

from sequoia_ray.in_flight import InFlight


class Ticket:
    """A batch's choice's place: its slot held already (``holds``), or in line for one."""

    def __init__(self, turn: asyncio.Future) -> None:
        self.turn = turn  # its result set: the slot is this choice's
        self.claimed = False  # its choice has started: the choice gives the slot back, not ``Slots.drop``

    @property
    def holds(self) -> bool:
        return self.turn.done() and not self.turn.cancelled()


class Slots:
    def __init__(self, in_flight: InFlight, limit: int) -> None:
        if limit < 1:
            raise ValueError(f"limit {limit} must be >= 1 (max_concurrent: the requests a replica runs at once)")
        self.in_flight, self.limit = in_flight, limit
        self._line: deque[asyncio.Future] = deque()  # choices waiting for a slot, first come first

    @property
    def waiting(self) -> int:
        return sum(not f.done() for f in self._line)

    def full(self) -> bool:
        """Whether a request arriving now is refused: every slot taken, or choices already waiting for one."""
        return self.in_flight.count >= self.limit or self.waiting > 0

    def take(self) -> bool:
        """A slot now, if one is free and no choice waits for it."""
        if self.full():
            return False
        self.in_flight.enter()
        return True

    def admit(self, choices: int) -> list[Ticket] | None:
        """``choices`` admitted together (None: refused, the replica full): a ticket each, the first ones holding
        the free slots, the others in line. Every ticket is ``claim``-ed by its choice or ``drop``-ped."""
        if self.full():
            return None
        loop, tickets = asyncio.get_running_loop(), []
        for _ in range(choices):
            turn = loop.create_future()
            if self.take():
                turn.set_result(None)
            else:
                self._line.append(turn)
            tickets.append(Ticket(turn))
        return tickets

    async def claim(self, ticket: Ticket) -> None:
        """The ticket's slot, once its turn comes. Cancelled in line, it holds none; cancelled just as a slot was
        handed to it, it passes the slot on."""
        ticket.claimed = True
        try:
            await ticket.turn
        except asyncio.CancelledError:
            if ticket.holds:  # handed a slot that nobody will use
                self.release()
            raise

    def drop(self, tickets: list[Ticket | None]) -> None:
        """The tickets whose choices never started (the request failed or its client left first): out of line,
        their slots given back. None (a request of one choice, which takes its slot itself): nothing."""
        for ticket in tickets:
            if ticket is not None and not ticket.claimed:
                ticket.claimed = True
                if ticket.holds:
                    self.release()
                else:
                    ticket.turn.cancel()

    def release(self) -> None:
        """A slot given back: to the first choice still in line (the count unchanged), else freed."""
        while self._line:
            turn = self._line.popleft()
            if not turn.done():  # one out of line is done (cancelled)
                turn.set_result(None)
                return
        self.in_flight.leave()
