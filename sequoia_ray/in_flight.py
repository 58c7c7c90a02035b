"""Requests in flight, and the batch size a step plans for.

Each step picks its tree from the batch-size bucket of the requests in flight (``TreePlans``, ``live_cost``).
When a request ends, its client's next one usually arrives a few tens of milliseconds later; steps planned in
that gap for the smaller batch run the smaller bucket's choice — at 2 clients, a tree (the draft first
catching up on every token since its last tree) in a batch that runs the target alone, and the joining
request's prompt then waits for that longer step. So a step plans for the largest count of the last
``hold_s`` seconds: a batch that really shrinks is planned for ``hold_s`` later. No more than ``cap`` (the
model actors' ``max_batch_requests``) share a forward, however many are in flight: with one request per forward
and 8 in flight, every step served the plan priced for a forward of 8 (a tree of 2 nodes, or none).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable


class InFlight:
    def __init__(self, hold_s: float = 1.0, clock: Callable[[], float] = time.monotonic, cap: int | None = None
                 ) -> None:
        if hold_s < 0:
            raise ValueError(f"hold_s {hold_s} must be >= 0 (0: plan for the count right now)")
        if cap is not None and cap < 1:
            raise ValueError(f"cap {cap} must be >= 1 (the most requests a forward carries) or None")
        self.hold_s, self.clock, self.cap = hold_s, clock, cap
        self.count = 0
        self._left: deque[tuple[float, int]] = deque()  # (when a request left, the count before it left)
        self._lock = threading.Lock()

    def enter(self) -> None:
        with self._lock:
            self.count += 1

    def leave(self) -> None:
        with self._lock:
            self._left.append((self.clock(), self.count))
            self.count -= 1

    def batch(self) -> int:
        """The batch size to plan a step for: the largest count of the last ``hold_s`` seconds (at least 1, at
        most ``cap``)."""
        with self._lock:
            now = self.clock()
            while self._left and now - self._left[0][0] > self.hold_s:
                self._left.popleft()
            held = max(1, self.count, *(count for _, count in self._left))
            return held if self.cap is None else min(held, self.cap)
