"""A stopping ingress replica ends its background loops (plan refresh, live re-plans) in ``__del__``, which Serve
awaits through its ASGI wrapper. Left running, a loop's next tick met the executor Serve had shut down and
logged a "plan refresh failed" traceback while the replica stopped."""

from __future__ import annotations

import asyncio
import logging
from types import SimpleNamespace

from deployments.ingress import OpenAIIngress


class _Plans:
    errors = 0

    def __init__(self) -> None:
        self.refreshes = 0

    def refresh(self) -> None:
        self.refreshes += 1


def _stopping_ingress():
    """The ingress as Serve holds it (its ASGI wrapper class), made without its constructor: the refresh loop's
    attributes only."""
    wrapper = OpenAIIngress.func_or_class

    class Held(wrapper):  # Serve awaits ``__del__`` itself; garbage collection must not start another (unawaited)
        def __del__(self) -> None:
            pass

    replica = object.__new__(Held)
    replica.cfg = SimpleNamespace(plan_refresh_s=0.01)
    replica.plans, replica.rules, replica.rates, replica.background = _Plans(), None, None, []
    return wrapper, replica


def test_a_stopping_ingress_ends_its_background_loops(caplog):
    wrapper, replica = _stopping_ingress()

    async def scenario() -> int:
        replica._start(replica._refresh_plans())
        while replica.plans.refreshes < 3:  # the loop runs: refreshes every plan_refresh_s
            await asyncio.sleep(0.01)
        await wrapper.__del__(replica)  # as Serve's replica calls it when it stops
        assert replica.background and all(task.done() for task in replica.background)
        ended = replica.plans.refreshes
        await asyncio.sleep(0.1)  # ten refresh periods
        return replica.plans.refreshes - ended

    with caplog.at_level(logging.ERROR):
        assert asyncio.run(scenario()) == 0  # no tick after __del__
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


def test_an_ingress_whose_constructor_failed_stops_quietly():
    wrapper, replica = _stopping_ingress()
    del replica.background  # the constructor raised before it set them
    asyncio.run(wrapper.__del__(replica))  # nothing to end, and no AttributeError


def test_health_is_ready_once_the_target_has_answered():
    """``/health`` said ok while the models were still loading (a readiness probe sent traffic 7 s early, the
    request then hung 23 s): now 503 ``loading`` until the target's first answer, found by one background call."""
    wrapper, replica = _stopping_ingress()
    replica.plans, replica.warming, replica.HEALTH_WAIT_S = None, None, 0.05
    replica.in_flight = SimpleNamespace(count=0)
    calls, loaded = [], asyncio.Event()

    async def plans():
        calls.append(1)
        await loaded.wait()  # the target's replica still loading its model
        replica.plans = _Plans()
        return replica.plans

    replica._plans = plans

    async def scenario():
        first = await wrapper.health(replica)
        again = await wrapper.health(replica)  # the look already under way: not a second one
        await asyncio.sleep(0)
        loaded.set()
        await replica.warming
        return first, again, await wrapper.health(replica)

    first, again, ready = asyncio.run(scenario())
    assert (first.status_code, again.status_code) == (503, 503) and b'"loading"' in first.body
    assert ready == {"status": "ok", "active_requests": 0} and len(calls) == 1


def test_health_of_a_loaded_target_is_ok_at_the_first_call():
    """A replica's first /health waits (briefly) for the target's answer: a loaded target is ready at once."""
    wrapper, replica = _stopping_ingress()
    replica.plans, replica.warming, replica.HEALTH_WAIT_S = None, None, 5.0
    replica.in_flight = SimpleNamespace(count=0)

    async def plans():
        replica.plans = _Plans()
        return replica.plans

    replica._plans = plans
    assert asyncio.run(wrapper.health(replica)) == {"status": "ok", "active_requests": 0}


def _loading_ingress():
    """The ingress before its plans are set up: what /health and /v1/models read."""
    wrapper, replica = _stopping_ingress()
    replica.plans, replica.warming, replica.HEALTH_WAIT_S = None, None, 0.05
    replica.cfg = SimpleNamespace(model_name="served", api_key=None)
    replica.created, replica._authorize = 123, lambda request: None
    replica.in_flight = SimpleNamespace(count=0)
    return wrapper, replica


def test_models_answers_at_once_while_the_target_loads():
    """``/v1/models`` awaited the target's first answer for up to ``step_timeout_s`` (60 s) and then answered 503:
    a UI polling it with a short timeout saw the server down while it loaded. Now its entry at once, "loading";
    one background call finds out (shared with /health)."""
    wrapper, replica = _loading_ingress()
    calls, loaded = [], asyncio.Event()

    async def plans():
        calls.append(1)
        await loaded.wait()
        replica.plans = _Plans()
        return replica.plans

    replica._plans = plans

    async def scenario():
        first = await asyncio.wait_for(wrapper.models(replica, None), 1.0)
        health = await wrapper.health(replica)  # the same look, not a second one
        return first, health

    first, health = asyncio.run(scenario())
    assert first == {"object": "list", "data": [{"id": "served", "object": "model", "created": 123,
                                                 "owned_by": "sequoia-ray", "metadata": {"status": "loading"}}]}
    assert health.status_code == 503 and len(calls) == 1


def test_models_and_health_say_why_when_the_plans_cannot_be_set_up():
    """A look that failed (the plan store unreadable, ...) read "loading" for ever on /v1/models and /health; a
    target not ready within step_timeout_s is still loading (a model may load for minutes), its error shown."""
    from deployments import openai_api as api
    from deployments.ingress import _unavailable

    wrapper, replica = _loading_ingress()
    errors = [_unavailable("no target model replica is ready (it may be restarting)"), OSError("store unreadable")]

    async def plans():
        raise errors[0]

    replica._plans = plans

    async def scenario():
        loading = await wrapper.models(replica, None)
        health = await wrapper.health(replica)
        errors.pop(0)
        await wrapper.health(replica)  # the look that fails for good
        try:
            await wrapper.models(replica, None)
        except api.APIError as error:
            return loading, health, error, await wrapper.health(replica)
        raise AssertionError("no error")

    loading, health, error, failed = asyncio.run(scenario())
    meta = loading["data"][0]["metadata"]
    assert meta["status"] == "loading" and "no target model replica" in meta["last_error"]
    assert health.status_code == 503 and b'"loading"' in health.body
    assert error.status == 503 and "OSError: store unreadable" in error.message
    assert failed.status_code == 503 and b'"failed"' in failed.body and b"store unreadable" in failed.body
