"""InFlight: the batch a step plans for holds the larger count for ``hold_s`` after a request leaves."""

from __future__ import annotations

import asyncio
import threading

import pytest

from sequoia_ray.in_flight import InFlight


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_batch_is_planned_for_its_size_until_hold_s_after_a_request_left():
    clock = Clock()
    flight = InFlight(hold_s=1.0, clock=clock)
    assert flight.batch() == 1 and flight.count == 0  # nobody in flight: plan for one
    for _ in range(4):
        flight.enter()
    assert flight.batch() == 4
    flight.leave()  # one ends; its client's next request has not arrived yet
    clock.now = 0.5
    assert (flight.count, flight.batch()) == (3, 4)
    flight.enter()  # it arrives
    clock.now = 0.9
    flight.leave()
    flight.leave()
    clock.now = 1.2  # the first leave is over a second old; the later ones still hold 4 (then 3)
    assert (flight.count, flight.batch()) == (2, 4)
    clock.now = 2.0  # the batch has really shrunk: planned for 2 from here
    assert flight.batch() == 2


def test_no_hold_plans_for_the_count_right_now():
    flight = InFlight(hold_s=0.0, clock=Clock())
    flight.enter()
    flight.enter()
    flight.leave()
    flight.clock.now = 1e-9
    assert flight.batch() == 1


def test_a_negative_hold_is_refused():
    with pytest.raises(ValueError, match="hold_s -1"):
        InFlight(hold_s=-1)


def test_threads_entering_and_leaving_keep_the_count():
    flight = InFlight(hold_s=0.0)

    def churn() -> None:
        for _ in range(2000):
            flight.enter()
            flight.batch()
            flight.leave()

    threads = [threading.Thread(target=churn) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert flight.count == 0 and flight.batch() == 1


def test_the_batch_is_capped_at_what_a_forward_carries():
    """With max_batch_requests 1 (one request per forward) and 8 requests in flight, every step served the plan
    priced for a forward of 8 (a 2-node tree, or the target alone) while each forward carried one request: the
    ingress caps the batch a step plans for at the model actors' max_batch_requests."""
    from deployments.ingress import OpenAIIngress
    from sequoia_ray.models.loading import TINY_TARGET

    class Replica(OpenAIIngress.func_or_class):
        def __del__(self) -> None:  # no background loops were started
            pass

    async def replica(cap: int):
        built = object.__new__(Replica)  # Serve's ingress wrapper makes __init__ a coroutine
        await built.__init__({"target": TINY_TARGET, "draft": None, "max_batch_requests": cap, "batch_hold_s": 0.0},
                             None, None)
        return built

    for cap, expected in ((1, 1), (4, 4), (16, 8)):
        built = asyncio.run(replica(cap))
        for _ in range(8):
            built.in_flight.enter()
        assert (built.active, built.in_flight.batch()) == (8, expected), cap
    with pytest.raises(ValueError, match="cap 0 must be >= 1"):
        InFlight(cap=0)
