"""Live acceptance through the real ingress on local Ray: the verdicts of served requests reach the
estimator, the background loop re-plans, and the live plan is served (and published) without a restart."""

from __future__ import annotations

import time

import pytest
import requests

ray = pytest.importorskip("ray")

from sequoia_ray.config import SamplingParams  # noqa: E402
from sequoia_ray.plan_store import PlanKey, PlanStore  # noqa: E402
from sequoia_ray.tree.acceptance_vector import AcceptanceVector  # noqa: E402
from sequoia_ray.tree.planning import plan_for  # noqa: E402
from tests.serving import BASE, complete, served_metadata, serving  # noqa: E402

pytestmark = pytest.mark.integration


def test_served_verdicts_feed_the_estimate_and_a_live_plan_is_served(store_dir, local):
    """The store's plan was made for p = (0.4, 0.3, 0.2); the tiny pair accepts rank 1 ~85% of the time
    (measured in-process: p̂ = (0.86, 0.065) over 840 nodes), so a few requests' verdicts leave the bound.
    The step rates (``live_cost``) run too, probing the target alone every other round: both arms get measured
    through Serve and the texts stay the target's. A tree per request (``request_trees``) is on too; the store has
    no profile here, so each request keeps the served plan. Both actors run packed Linear layers
    (``linears: packed``; fp32, so the greedy text is still compared with the unpacked target in-process)."""
    app = {**BASE, "plan_store": str(store_dir), "live_acceptance": True, "live_min_samples": 30,
           "live_replan_s": 1.0, "live_half_life": 1000.0, "hardware_id": "test-live-hw",
           "live_cost": True, "live_cost_probe_every": 1, "live_cost_probe_rounds": 1, "request_trees": True,
           "linears": "packed"}
    key = PlanKey("test-live-hw", "tiny-draft", "tiny-target", 0.0)
    wrong = plan_for(AcceptanceVector.from_p([0.4, 0.3, 0.2]), 12, 4)[0]
    first = PlanStore(str(store_dir)).publish_plan(wrong, key)
    with serving({"live": app}) as url:
        url = f"{url}/live"
        meta = served_metadata(url)
        assert meta["plan_source"] == f"store:{first}" and meta["live_acceptance"] == {}, meta
        assert meta["step_rates"] == {}
        deadline = time.time() + 180
        while time.time() < deadline and not meta["plan_source"].startswith("live"):
            complete(url, "the live traffic", max_tokens=48)
            meta = served_metadata(url)
        live = meta["live_acceptance"]["0.0"]
        assert meta["plan_source"].startswith("live:"), meta
        assert live["samples"] >= 30 and live["replans"] >= 1 and live["p"][0] > 0.6
        planned, path = PlanStore(str(store_dir)).fetch_plan(key)
        assert path != first and planned.provenance.source == "live" and planned.provenance.live_samples >= 30
        rates = meta["step_rates"]["all-b1"]
        assert rates["steps"]["tree"] > 0 and rates["steps"]["alone"] > 0 and rates["tok_s"]["tree"] > 0, rates
        body = complete(url, "after the re-plan", max_tokens=24)  # greedy under the live plan: the target's
        alone = local.decoder(planned.plan, speculate=False).generate(local.encode("after the re-plan", chat=False),
                                                                      SamplingParams(max_tokens=24))
        assert body["choices"][0]["text"] == alone.text
