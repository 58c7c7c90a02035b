"""Faults through the Serve application (local Ray, tiny models): a target rank that dies or hangs, and a
plan store that serves a corrupt plan. (The draft dying mid-stream is in test_serve.py.)

The fault app has short timeouts (step 5 s, collective 8 s, health checks every 1 s) so a test sees a
whole fail -> 503 -> restart -> serving-again cycle in well under a minute; the recovery times are
printed (run with ``-s``) and quoted in the README (Faults).
"""

from __future__ import annotations

import time

import pytest
import requests
import torch

ray = pytest.importorskip("ray")
from ray import serve  # noqa: E402

from actors.adapters import RanksTarget, TargetUnavailable  # noqa: E402
from actors.placement import ActorResources  # noqa: E402
from actors.spec import ModelActorSpec  # noqa: E402
from actors.target import TargetGroup  # noqa: E402
from sequoia_ray.config import SamplingParams  # noqa: E402
from sequoia_ray.draft import DraftTree  # noqa: E402
from sequoia_ray.engine import ROOT_ONLY  # noqa: E402
from tests.serving import (BASE, app_metric_values, complete, greedy_long_prompt, served_metadata, serving,  # noqa: E402
                           sse_events, stall, wait_for_speculation)

pytestmark = pytest.mark.integration
FAULTS = {**BASE, "tp_size": 2, "step_timeout_s": 5.0, "collective_timeout_s": 8.0, "health_check_period_s": 1.0,
          "health_check_timeout_s": 5.0}


@pytest.fixture(scope="module")
def server(store_dir):
    # one app (every app costs ~25 s of start-up here); the corrupt-plan test, which changes the plan served,
    # runs last
    apps = {"ft": {**FAULTS, "plan_store": str(store_dir), "plan_refresh_s": 0.5}}
    with serving(apps) as url:
        yield url


def target_ranks(app: str) -> list:
    return serve.get_deployment_handle("TargetDeployment", app).actors.remote().result(timeout_s=120)["ranks"]


def wait_until_serving(url: str, prompt: str, expected: str, since: float, timeout_s: float = 180.0) -> float:
    """Send the request until it succeeds; every failure on the way must be a retryable OpenAI-style 503.
    Returns the seconds from ``since`` to the first success (the recovery time)."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 24, "temperature": 0}
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        r = requests.post(f"{url}/v1/completions", json=body, timeout=60)
        if r.status_code == 200:
            assert r.json()["choices"][0]["text"] == expected  # the restarted group is a correct one
            return time.monotonic() - since
        assert r.status_code == 503, r.text
        err = r.json()["error"]
        assert err["type"] == "server_error" and err["code"] == "target_unavailable" and "retry" in err["message"]
        assert r.headers["retry-after"] == "5"
        time.sleep(0.5)
    raise AssertionError(f"the service did not recover within {timeout_s} s")


def test_rank_death_mid_stream_is_a_503_then_the_group_restarts(server, local):
    url = f"{server}/ft"
    prompt = greedy_long_prompt(local)
    undisturbed = complete(url, prompt, max_tokens=500)["choices"][0]["text"]
    short = complete(url, "hello", max_tokens=24)["choices"][0]["text"]
    old = target_ranks("ft")
    r = requests.post(f"{url}/v1/completions", stream=True, timeout=120,
                      json={"model": "tiny", "prompt": prompt, "max_tokens": 500, "temperature": 0, "stream": True})
    lines = r.iter_lines()
    first = next(line for line in lines if line)
    ray.kill(old[1])
    killed = time.monotonic()
    rest = [line for line in lines if line]
    assert rest[-1] == b"data: [DONE]"  # the stream is closed properly
    events = sse_events([first, *rest])
    err = events[-1]["error"]
    assert err["code"] == "target_unavailable" and err["type"] == "server_error", err
    text = "".join(e["choices"][0]["text"] for e in events[:-1])
    assert undisturbed.startswith(text) and len(text) < len(undisturbed)  # what was sent was right
    recovery = wait_until_serving(url, "hello", short, killed)
    print(f"\nrank death: serving again {recovery:.1f} s after the kill")
    new = target_ranks("ft")
    assert {a._actor_id for a in new}.isdisjoint(a._actor_id for a in old)  # the whole group is new
    # the surviving rank goes with its group: the old replica, stopped while its successor starts, ends it
    deadline = time.monotonic() + 60
    while True:
        try:
            ray.get(old[0].health.remote(), timeout=30)
        except ray.exceptions.RayActorError:
            print(f"rank death: the old rank 0 gone {time.monotonic() - killed:.1f} s after the kill")
            break
        assert time.monotonic() < deadline, "the old group's rank 0 outlived its replica by a minute"
        time.sleep(0.5)


def test_hung_draft_is_dropped_after_the_step_timeout(server, local):
    """A draft whose grow never returns: the request goes on with the target alone after step_timeout_s
    and completes with the exact greedy text; the stuck DraftDeployment replica is then replaced."""
    url = f"{server}/ft"
    expected = complete(url, "hello world", max_tokens=40)["choices"][0]["text"]
    draft = serve.get_deployment_handle("DraftDeployment", "ft").actors.remote().result(timeout_s=60)

    stall(draft, "grow")
    body = complete(url, "hello world", max_tokens=40)
    assert body["choices"][0]["text"] == expected and body["usage"]["speculative"]["draft_failures"] == 1
    stats = wait_for_speculation(url)
    assert stats["draft_failures"] == 0 and stats["tokens_per_step"] > 1.0, stats


def test_hung_rank_is_bounded_by_timeouts_then_the_group_restarts(server):
    url = f"{server}/ft"
    short = complete(url, "hello", max_tokens=24)["choices"][0]["text"]
    stall(target_ranks("ft")[1], "verify")
    start = time.monotonic()
    r = requests.post(f"{url}/v1/completions", timeout=60,  # a hang would raise ReadTimeout here
                      json={"model": "tiny", "prompt": "hello", "max_tokens": 24, "temperature": 0})
    failed = time.monotonic() - start
    assert r.status_code == 503 and r.json()["error"]["code"] == "target_unavailable", r.text
    recovery = wait_until_serving(url, "hello", short, start)
    print(f"\nhung rank: 503 after {failed:.1f} s (step_timeout_s 5), serving again after {recovery:.1f} s")


def test_collective_timeout_breaks_the_waiting_rank(server):
    """Below Serve: with one rank stuck, the other's all-reduce gives up after collective_timeout_s and the
    rank reports itself broken (so its replica is replaced), while the caller gave up at step_timeout_s."""
    spec = ModelActorSpec("tiny-target", collective_timeout_s=4.0)
    group = TargetGroup(spec, 2, "gloo", ActorResources(num_cpus=0.5))
    try:
        RanksTarget(group.ranks, timeout_s=60.0).start("r", [5, 6, 7], SamplingParams(max_tokens=8, temperature=0), 0)
        target = RanksTarget(group.ranks, timeout_s=2.0)  # the healthy prefill above is not held to 2 s
        stall(group.ranks[1], "verify")
        start = time.monotonic()
        with pytest.raises(TargetUnavailable, match="GetTimeoutError"):
            target.verify("r", ROOT_ONLY, DraftTree(torch.tensor([7]), {}))
        assert time.monotonic() - start < 30
        deadline = time.monotonic() + 60
        state = ray.get(group.ranks[0].health.remote())
        while state["broken"] is None and time.monotonic() < deadline:
            time.sleep(0.5)
            state = ray.get(group.ranks[0].health.remote())
        assert state["broken"] and "verify failed" in state["broken"], state
        assert ray.get(group.ranks[1].health.remote())["busy_s"] > 2.0  # the stuck one shows as stuck
    finally:
        group.kill()


def test_corrupt_plan_in_the_store_keeps_the_last_good_one(server, store_dir):
    from sequoia_ray.plan_store import PlanKey, PlanStore
    from sequoia_ray.tree.acceptance_vector import AcceptanceVector
    from sequoia_ray.tree.planning import plan_for

    url = f"{server}/ft"

    def meta() -> dict:
        return served_metadata(url)

    def wait_for(predicate, timeout_s: float = 60.0) -> dict:
        deadline, m = time.monotonic() + timeout_s, meta()
        while not predicate(m) and time.monotonic() < deadline:
            time.sleep(0.5)
            m = meta()
        return m

    planned = plan_for(AcceptanceVector.from_p([0.9, 0.05]), 7, 7)[0]
    good = PlanStore(str(store_dir)).publish_plan(planned, PlanKey(meta()["hardware_id"], "tiny-draft",
                                                                   "tiny-target", 0.0))
    assert wait_for(lambda m: m["plan_source"] == f"store:{good}")["plan_source"] == f"store:{good}"
    folder = good.rsplit("/", 1)[0]
    with open(f"{folder}/99990101T000000000000Z-deadbeef.json", "w") as f:
        f.write('{"schema_version": 1, "parents": [')
    m = wait_for(lambda m: m["plan_store_errors"] >= 2)
    assert m["plan_store_errors"] >= 2 and "deadbeef" in m["plan_store_last_error"]
    assert m["plan_source"] == f"store:{good}"  # never the corrupt one
    assert complete(url, "hello")["usage"]["speculative"]["plan_nodes"] == planned.plan.n
    deadline, values = time.monotonic() + 60, []
    while time.monotonic() < deadline and not any(v >= 1 for v in values):
        time.sleep(1)
        values = app_metric_values("ray_sequoia_plan_store_errors", "ft")
    assert any(v >= 1 for v in values), values
