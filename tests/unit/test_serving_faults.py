"""Serving-side fault handling without a cluster: plan-store faults never reach a request (the last good
or the built-in plan stays, the error is counted), and model-actor health (stuck, broken)."""

from __future__ import annotations

import json

import pytest

from actors.health import CallTracker, raise_if_unhealthy
from deployments.config import ServeConfig
from deployments.service import PlanProvider
from sequoia_ray.plan_store import PlanKey, PlanStore
from sequoia_ray.request_errors import UnknownRequest
from sequoia_ray.tree.acceptance_vector import AcceptanceVector
from sequoia_ray.tree.builtin import builtin_plan
from sequoia_ray.tree.planning import plan_for
from tests.serving import Clock, free_port

HW = "cpu-test-2c"


def provider(uri: str) -> PlanProvider:
    return PlanProvider(ServeConfig(draft="tiny-draft", target="tiny-target", plan_store=uri), HW)


def publish(store: PlanStore, budget: int) -> str:
    planned = plan_for(AcceptanceVector.from_p([0.8, 0.1]), budget, 4)[0]
    return store.publish_plan(planned, PlanKey(HW, "tiny-draft", "tiny-target", 0.0))


def newer_file(good_path: str, text: str) -> None:
    """A plan file that sorts after ``good_path`` (the store serves the newest)."""
    folder = good_path.rsplit("/", 1)[0]
    with open(f"{folder}/99990101T000000000000Z-deadbeef.json", "w") as f:
        f.write(text)


def test_no_store_serves_builtin(tmp_path):
    plans = PlanProvider(ServeConfig(target="tiny-target", plan_store=None), HW)
    assert plans.get(0.0).source == "builtin" and plans.get(0.0).planned == builtin_plan(0.0)
    assert plans.errors == 0


def test_missing_plan_is_not_an_error(tmp_path):
    plans = provider(str(tmp_path))
    assert plans.get(0.0).source == "builtin" and plans.errors == 0


@pytest.mark.parametrize("corrupt", ["garbage", "truncated", "bad tree"])
def test_corrupt_newer_plan_keeps_the_last_good_one(tmp_path, corrupt):
    store = PlanStore(str(tmp_path))
    good = publish(store, 6)
    plans = provider(str(tmp_path))
    assert plans.get(0.0).source == f"store:{good}"
    text = open(good).read()
    if corrupt == "garbage":
        bad = "\x00\xff not json"
    elif corrupt == "truncated":
        bad = text[: len(text) // 2]
    else:  # valid JSON, but node 1's parent is a later node: not a tree
        doc = json.loads(text)
        doc["parents"][1] = len(doc["parents"]) - 1
        bad = json.dumps(doc)
    newer_file(good, bad)
    plans.refresh()
    assert plans.get(0.0).source == f"store:{good}"  # never the broken one
    assert plans.errors == 1 and "99990101T000000000000Z-deadbeef.json" in plans.last_error


def test_unreachable_store_serves_builtin_and_counts(tmp_path):
    plans = provider(f"s3://plans/x?endpoint_override=127.0.0.1:{free_port()}&scheme=http&region=us-east-1")
    assert plans.get(0.0).source == "builtin"
    assert plans.errors == 1 and "unreachable" in plans.last_error
    plans.refresh()
    assert plans.get(0.0).source == "builtin" and plans.errors == 2


def test_store_that_cannot_even_open_is_not_fatal():
    plans = provider("nosuchscheme://bucket/plans")
    assert plans.get(0.6).source == "builtin" and plans.errors == 1


def test_store_that_goes_away_keeps_the_plan(tmp_path):
    store = PlanStore(str(tmp_path / "store"))
    good = publish(store, 6)
    plans = provider(str(tmp_path / "store"))
    assert plans.get(0.0).source == f"store:{good}"
    (tmp_path / "store").rename(tmp_path / "gone")
    plans.refresh()
    assert plans.get(0.0).source == f"store:{good}"


def test_tracker_reports_a_stuck_call():
    clock = Clock()
    tracker = CallTracker(fatal_errors=True, clock=clock)
    with tracker.running("verify"):
        clock.now = 7.0
        assert tracker.health() == {"busy_s": 7.0, "broken": None}
        with pytest.raises(RuntimeError, match="target rank 0 has been in one call for 7 s"):
            raise_if_unhealthy([tracker.health()], 5.0, "target rank")
        raise_if_unhealthy([tracker.health()], 10.0, "target rank")  # within the step timeout: healthy
    assert tracker.health()["busy_s"] == 0.0


def test_failed_collective_breaks_a_rank_but_an_unknown_request_does_not():
    tracker = CallTracker(fatal_errors=True)
    with pytest.raises(UnknownRequest):
        with tracker.running("verify"):
            raise UnknownRequest("request 'x' is not active here")
    assert tracker.health()["broken"] is None
    with pytest.raises(RuntimeError):
        with tracker.running("verify"):
            raise RuntimeError("Connection closed by peer")
    with pytest.raises(RuntimeError, match="target rank 1 is broken: verify failed: RuntimeError"):
        raise_if_unhealthy([{"busy_s": 0.0, "broken": None}, tracker.health()], 5.0, "target rank")
    with pytest.raises(RuntimeError, match="waiting to be replaced"):
        with tracker.running("start"):
            pass


def test_draft_errors_are_not_fatal():
    tracker = CallTracker(fatal_errors=False)
    with pytest.raises(ValueError):
        with tracker.running("grow"):
            raise ValueError("boom")
    assert tracker.health()["broken"] is None


def test_a_cuda_error_breaks_even_an_actor_whose_errors_are_not_fatal():
    """A CUDA error poisons the process's context: every later call would fail while a draft (or a single-rank
    target) reported itself healthy, and Serve would never replace it."""
    import torch

    tracker = CallTracker(fatal_errors=False)
    with pytest.raises(torch.OutOfMemoryError):  # out of memory is not one: a smaller batch may fit
        with tracker.running("grow"):
            raise torch.OutOfMemoryError("CUDA out of memory")
    assert tracker.health()["broken"] is None
    with pytest.raises(torch.AcceleratorError):
        with tracker.running("grow"):
            raise torch.AcceleratorError("CUDA error: an illegal memory access was encountered")
    with pytest.raises(RuntimeError, match="draft actor 0 is broken: grow failed: AcceleratorError"):
        raise_if_unhealthy([tracker.health()], 5.0, "draft actor")


def test_health_reads_a_call_that_ends_while_it_is_asked():
    """``health`` runs in its own concurrency group while the compute thread ends a call (``started`` -> None):
    read twice, the start could be gone at the second read (TypeError: a failed health check, and a drain's
    group check read as a missing rank)."""
    tracker = CallTracker(fatal_errors=False)
    tracker.started = 5.0

    def clock() -> float:  # the call ends at this moment, on the other thread
        tracker.started = None
        return 12.0

    tracker.clock = clock
    assert tracker.health() == {"busy_s": 7.0, "broken": None}
