"""An ingress replica's ``max_concurrent`` slots, over the count of requests in flight (``InFlight``).

A request takes a slot at once or is refused (429). A batch's or ``n``'s choices were admitted as a whole, so each
waits its turn instead, first come first served, and a freed slot goes straight to the first choice waiting: the
count never drops between them, so no request arriving in between takes it. Before, waiting choices looked again
every 50 ms: each waited up to that long for a slot already free, and steady single requests, arriving in those
gaps, could take every freed slot while a batch's last choices waited on.

Everything here runs on the replica's event loop (``release`` is called from a task's done callback).
"""

from __future__ import annotations

import asyncio
from collections import deque

from sequoia_ray.in_flight import InFlight


class Slots:
    def __init__(self, in_flight: InFlight, limit: int) -> None:
        if limit < 1:
            raise ValueError(f"limit {limit} must be >= 1 (max_concurrent: the requests a replica runs at once)")
        self.in_flight, self.limit = in_flight, limit
        self._waiting: deque[asyncio.Future] = deque()  # choices waiting for a slot, first come first

    @property
    def waiting(self) -> int:
        return sum(not f.done() for f in self._waiting)

    def full(self) -> bool:
        """Whether a request arriving now is refused: every slot taken, or choices already waiting for one."""
        return self.in_flight.count >= self.limit or self.waiting > 0

    def take(self) -> bool:
        """A slot now, if one is free and no choice waits for it."""
        if self.full():
            return False
        self.in_flight.enter()
        return True

    async def wait(self) -> None:
        """A slot, after the choices that waited before this one. Cancelled while waiting, it holds none; cancelled
        just as a slot was handed to it, it passes the slot on."""
        if self.take():
            return
        turn = asyncio.get_running_loop().create_future()
        self._waiting.append(turn)
        try:
            await turn
        except asyncio.CancelledError:
            if turn.done() and not turn.cancelled():  # handed a slot that nobody will use
                self.release()
            raise

    def release(self) -> None:
        """A slot given back: to the first choice still waiting (the count unchanged), else freed."""
        while self._waiting:
            turn = self._waiting.popleft()
            if not turn.done():  # a cancelled waiter's future is done (cancelled)
                turn.set_result(None)
                return
        self.in_flight.leave()
