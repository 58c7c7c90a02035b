"""The serving glue of live acceptance, without Ray: PlanProvider serves a live re-plan without a restart,
publishes it as a live plan, keeps it across refreshes; LivePlanner feeds and ticks; the metrics export it."""

from __future__ import annotations

import numpy as np
import pytest

from deployments.config import ServeConfig
from deployments.metrics import ServiceMetrics
from deployments.service import LivePlanner, PlanProvider
from deployments.slots import Slots
from sequoia_ray.live_acceptance import LiveSettings
from sequoia_ray.config import SamplingParams
from sequoia_ray.plan_store import PlanKey, PlanStore
from sequoia_ray.tree.acceptance_vector import AcceptanceVector
from sequoia_ray.tree.builtin import builtin_plan
from sequoia_ray.tree.dp import solve
from sequoia_ray.verify import Verdict
from tests.recorders import Recorder as _Recorder
from tests.unit.test_live_acceptance import P_TRUE, walk

HW = "cpu-test-2c"
KEY = PlanKey(HW, "tiny-draft", "tiny-target", 0.0)


def config(store: str | None, **kw) -> ServeConfig:
    return ServeConfig(draft="tiny-draft", target="tiny-target", plan_store=store, **kw)


def feed(planner: LivePlanner, plans: PlanProvider, verdicts: int, seed: int = 0) -> None:
    """Requests at T=0 whose draft follows P_TRUE, on whatever tree is served now (as the ingress does)."""
    rng, params = np.random.default_rng(seed), SamplingParams(seed=1)
    for _ in range(verdicts):
        plan = plans.get(0.0).planned.plan
        planner.observe(plan, Verdict([0], [1], tuple(walk(plan, P_TRUE, rng))), params)


def want(budget: int = 16, depth: int = 6):
    return solve(AcceptanceVector.from_p(P_TRUE), budget, depth).tree(budget, depth)


def test_a_live_plan_is_served_published_and_kept_until_the_store_has_a_newer_one(tmp_path):
    store = PlanStore(str(tmp_path))
    store.publish_plan(builtin_plan(0.0), KEY)  # the profiled plan, built from the wrong vector
    plans = PlanProvider(config(str(tmp_path)), HW)
    planner = LivePlanner(config(str(tmp_path)), plans)
    start = plans.get(0.0)
    assert start.source.startswith("store:") and plans.get(0.0, 2).bucket == 1  # bucket 2 follows batch 1
    assert planner.tick() == []  # nothing observed yet
    for _ in range(30):  # 30 checks of 200 verdicts (the ingress: one check per live_replan_s)
        feed(planner, plans, 200)
        planner.tick()
    served = plans.get(0.0)
    assert served.source.startswith("live:/") and served.planned.plan == want()
    assert plans.get(0.0, 2).planned.plan == want()  # the follower moved with it, at once
    published, path = store.fetch_plan(KEY)
    assert served.source == f"live:{path}" and published.plan == want()
    assert published.provenance.source == "live" and published.provenance.live_samples >= 400
    plans.refresh()
    assert plans.get(0.0) is served  # the store's latest is the live plan: nothing to swap
    newer = store.publish_plan(builtin_plan(0.0, budget=8), KEY)  # e.g. tuning published a new plan
    plans.refresh()
    assert plans.get(0.0).source == f"store:{newer}"
    summary = planner.summary()["0.0"]
    assert summary["samples"] > 10_000 and summary["replans"] >= 1 and abs(summary["p"][0] - 0.6) < 0.03


def test_without_a_store_the_live_plan_is_served_and_refresh_keeps_it():
    plans = PlanProvider(config(None), HW)
    planner = LivePlanner(config(None), plans)
    assert plans.get(0.0).source == "builtin"
    feed(planner, plans, 2_000)
    assert planner.tick() == [0.0]
    plans.refresh()
    assert plans.get(0.0).source == "live" and plans.get(0.0).planned.provenance.source == "live"


def test_a_store_that_cannot_take_the_live_plan_still_serves_it(tmp_path):
    store = PlanStore(str(tmp_path / "store"))
    store.publish_plan(builtin_plan(0.0), KEY)
    plans = PlanProvider(config(str(tmp_path / "store")), HW)
    planner = LivePlanner(config(str(tmp_path / "store")), plans)
    plans.get(0.0)
    (tmp_path / "store").rename(tmp_path / "gone")
    (tmp_path / "store").write_text("not a folder")  # publishing fails
    feed(planner, plans, 2_000)
    assert planner.tick() == [0.0]
    assert plans.get(0.0).source == "live" and plans.errors >= 1
    plans.refresh()  # the store is unreadable: the live plan stays
    assert plans.get(0.0).source == "live"


def test_traffic_that_matches_the_plan_never_re_plans():
    plans = PlanProvider(config(None), HW)
    planner = LivePlanner(config(None), plans)
    p_plan = plans.get(0.0).planned.acceptance.rows[0]
    rng = np.random.default_rng(5)
    for _ in range(20):
        for _ in range(300):
            plan = plans.get(0.0).planned.plan
            planner.observe(plan, Verdict([0], [1], tuple(walk(plan, p_plan, rng))), SamplingParams())
        assert planner.tick() == []
    assert plans.get(0.0).source == "builtin"


@pytest.mark.parametrize("bad", [dict(live_min_samples=1_000, live_half_life=500), dict(live_replan_s=0),
                                 dict(live_z=-1)])
def test_live_settings_are_validated(bad):
    with pytest.raises(ValueError, match="live_"):
        config(None, live_acceptance=True, **bad)


def test_the_estimate_is_exported_as_metrics():
    plans = PlanProvider(config(None), HW)
    planner = LivePlanner(config(None), plans)
    planner.observe(None, Verdict([0, 1], [1, 2], ((2, 1), (1, 0))), SamplingParams(temperature=0.6))
    metrics = ServiceMetrics()
    for name in ("live_p", "live_trials", "live_samples", "live_replans"):
        setattr(metrics, name, _Recorder())
    metrics.live(planner.live, [0.6])
    assert metrics.live_replans.calls == [(1, {"temperature": "0.6"})]
    assert metrics.live_samples.calls == [(2, {"temperature": "0.6"})]
    assert metrics.live_trials.calls == [(pytest.approx(2.0, rel=1e-4), {"temperature": "0.6", "rank": "1"}),
                                         (pytest.approx(1.0, rel=1e-4), {"temperature": "0.6", "rank": "2"})]
    assert metrics.live_p.calls == []  # no rank settled: a rank of one or two trials read 0.0 or 1.0 here
    for _ in range(2 * LiveSettings().min_samples):  # rank 2 is tried at one node a verdict, and counts decay
        planner.observe(None, Verdict([0, 1], [1, 2], ((2, 1), (1, 0))), SamplingParams(temperature=0.6))
    metrics.live(planner.live, [])
    assert metrics.live_p.calls == [(pytest.approx(0.5, rel=1e-3), {"temperature": "0.6", "rank": "1"}),
                                    (0.0, {"temperature": "0.6", "rank": "2"})]  # decay: ~, not ==


def test_the_step_rates_are_exported_as_metrics():
    from sequoia_ray.live_cost import CostSettings, StepRates

    rates = StepRates(CostSettings(probe_every=1, probe_rounds=1, window=8, min_steps=1))
    key = ("t0.6", 4)
    for tokens, seconds in ((3, 1.0), (3, 1.0), (1, 0.25), (1, 0.25)):  # one phase per pair of steps (batch 1)
        rates.record(rates.begin(key, 1, "a"), tokens, seconds)
    metrics = ServiceMetrics()
    metrics.step_rate, metrics.speculating = _Recorder(), _Recorder()
    metrics.step_rates(rates.summary())
    tags = {"temperature": "0.6", "batch": "4"}
    assert metrics.speculating.calls == [(0.0, tags)]  # the target alone: 4 tok/s against the tree's 3
    assert metrics.step_rate.calls == [(3.0, tags | {"arm": "tree"}), (4.0, tags | {"arm": "alone"})]


def test_tree_families_follow_the_served_plan_and_read_the_profile_once_per_plan(tmp_path):
    from deployments.service import TreeFamilies
    from sequoia_ray.hardware import HardwareProfile

    store = PlanStore(str(tmp_path))
    store.publish_plan(builtin_plan(0.0), KEY)
    plans = PlanProvider(config(str(tmp_path)), HW)
    families = TreeFamilies(plans, 8, max_batch=2)
    first = families.get(0.0)
    assert first.profile is None and first.planned is plans.get(0.0).planned  # no profile: the served plan
    assert families.get(0.0) is first  # cached while the plan stays
    t = {n: 1 + 0.01 * (n - 1) for n in (1, 2, 4, 8, 16)}
    store.publish_profile(HardwareProfile(HW, t, {w: 0.05 * v for w, v in t.items()}, 0.1, 64, "float32"))
    store.publish_plan(builtin_plan(0.0, budget=8), KEY)  # a new plan: the family is rebuilt, with the profile
    plans.refresh()
    second = families.get(0.0)
    assert second is not first and second.profile is not None and second.planned.plan == plans.get(0.0).planned.plan
    assert second.max_batch == 2 and second.max_depth == 8  # the config's, on every family built


def test_grow_rules_read_the_profile_at_refresh_and_follow_the_served_plan(tmp_path):
    """``dynamic_trees``: no profile, no rule (the plan's tree); once one is published, a refresh builds the
    rules and each step gets the rule for its bucket's plan; an unchanged profile keeps the cached rules."""
    from deployments.service import GrowRules
    from sequoia_ray.dynamic_rules import DynamicRules
    from sequoia_ray.hardware import HardwareProfile

    store = PlanStore(str(tmp_path))
    store.publish_plan(builtin_plan(0.0), KEY)
    plans = PlanProvider(config(str(tmp_path)), HW)
    rules = GrowRules(plans, extend=2)
    batch = [1]
    rule = rules.for_request(0.0, lambda: batch[0])
    plan = plans.get(0.0).planned.plan
    assert rules.rules is None and rule(plan) is None
    t = {n: 1 + 0.01 * (n - 1) for n in (1, 2, 4, 8, 16, 32, 64)}
    prof = HardwareProfile(HW, t, {w: 0.05 * v for w, v in t.items()}, 0.1, 64, "float32")
    store.publish_profile(prof)
    rules.refresh()
    built = rules.rules
    assert built is not None and built.extend == 2
    assert rule(plan) == DynamicRules(prof, extend=2).of(plan, 1, plans.get(0.0).planned) and rule(plan).extend == 2
    batch[0] = 4  # bucket 4 has no plan of its own here: it follows batch 1's, costed at batch 4
    assert rule(plan) == DynamicRules(prof, extend=2).of(plan, 4, plans.get(0.0, 4).planned) != rules.rules.of(
        plan, 1, plans.get(0.0).planned)
    batch[0] = 8  # 8 trees of 16 nodes: beyond the profile's 64 tokens, so no rule (the plan's tree)
    assert rule(plan) is None
    rules.refresh()
    assert rules.rules is built  # the same profile: its cached rules stay
    plans.cfg = config(str(tmp_path / "gone"))  # the store unreadable: the last profile's rules stay
    rules.plans.store = None
    rules.refresh()
    assert rules.rules is built and rules.summary()["extend"] == 2


def test_a_live_re_plan_for_buckets_never_served_yet_is_adopted_and_refreshed(tmp_path):
    """With a hardware profile the re-plan covers every profiled batch bucket (here 1-16) while the service
    has only served batch 1 so far: each new bucket is adopted as its own live plan, and later refreshes
    and re-plans go on (a bucket unknown to the provider once raised KeyError in adopt, and then in every
    refresh, so the service stopped following the store)."""
    from sequoia_ray.hardware import HardwareProfile

    store = PlanStore(str(tmp_path))
    store.publish_plan(builtin_plan(0.0), KEY)
    t = {n: 1 + 0.01 * (n - 1) for n in (1, 2, 4, 8, 16, 32, 64)}
    store.publish_profile(HardwareProfile(HW, t, {w: 0.05 * v for w, v in t.items()}, 0.1, 64, "float32"))
    plans = PlanProvider(config(str(tmp_path)), HW)
    planner = LivePlanner(config(str(tmp_path)), plans)
    assert plans.get(0.0).source.startswith("store:") and set(plans.plans) == {"t0.0"}
    for _ in range(30):
        feed(planner, plans, 200)
        if planner.tick():
            break
    assert planner.replans[0.0] == 1
    for bucket in (1, 2, 4, 8, 16):
        active = plans.get(0.0, bucket)
        assert active.source.startswith("live:/") and active.bucket == bucket
        assert store.fetch_plan(PlanKey(HW, "tiny-draft", "tiny-target", 0.0, bucket))[1] in active.source
    plans.refresh()  # the store's latest is each live plan: nothing to swap, nothing raised
    assert plans.get(0.0, 16).source.startswith("live:/")
    newer = store.publish_plan(builtin_plan(0.0, budget=8), PlanKey(HW, "tiny-draft", "tiny-target", 0.0, 16))
    plans.refresh()
    assert plans.get(0.0, 16).source == f"store:{newer}" and plans.errors == 0


def test_a_live_re_plan_keeps_the_buckets_measured_to_serve_the_target_alone(tmp_path):
    """Batch 4's stored plan is the target alone because its tree measured slower (a root-only winner with a
    measured tree among its candidates); batch 8's is root-only by the model alone (nothing measured). A
    re-plan from departing traffic, before either bucket was ever served: batch 4 keeps the measurement,
    batch 8 and the rest take the DP's new picks."""
    from sequoia_ray.hardware import HardwareProfile
    from sequoia_ray.live_acceptance import measured_alone
    from sequoia_ray.tree.plan_file import Provenance
    from sequoia_ray.tree.planning import plan_for

    store = PlanStore(str(tmp_path))
    store.publish_plan(builtin_plan(0.0), KEY)
    t = {n: 1 + 0.01 * (n - 1) for n in (1, 2, 4, 8, 16, 32, 64)}
    store.publish_profile(HardwareProfile(HW, t, {w: 0.05 * v for w, v in t.items()}, 0.1, 64, "float32"))
    tried = [{"n": 1, "d": 1, "predicted_speedup": 1.0, "measured_speedup": 1.0},
             {"n": 4, "d": 4, "predicted_speedup": 1.14, "measured_speedup": 0.87}]
    vector = builtin_plan(0.0).acceptance
    alone_measured = plan_for(vector, 1, 1, Provenance(measured_speedup=1.0, candidates=tried))[0]
    alone_by_model = plan_for(vector, 1, 1, Provenance())[0]
    assert measured_alone(alone_measured) and not measured_alone(alone_by_model)
    kept = store.publish_plan(alone_measured, PlanKey(HW, "tiny-draft", "tiny-target", 0.0, 4))
    store.publish_plan(alone_by_model, PlanKey(HW, "tiny-draft", "tiny-target", 0.0, 8))
    plans = PlanProvider(config(str(tmp_path)), HW)
    planner = LivePlanner(config(str(tmp_path)), plans)
    plans.get(0.0)
    for _ in range(30):
        feed(planner, plans, 200)
        if planner.tick():
            break
    assert planner.replans[0.0] == 1
    assert plans.get(0.0, 4).source == f"store:{kept}" and plans.get(0.0, 4).planned.plan.n == 1
    for bucket in (1, 2, 8):
        assert plans.get(0.0, bucket).source.startswith("live:/")
    assert plans.get(0.0, 8).planned.plan.n > 1  # the profile here makes trees pay at every batch size


class _NoDecoder(Exception):
    """Ends ``_chunks`` right after it exported the plan in use."""


def _served_plan_tags(source: str, temperature: float) -> dict:
    """The tags ``OpenAIIngress._chunks`` gives ``sequoia_plan_nodes`` for a request served the plan from
    ``source`` (the ingress made without its constructor or Ray: what ``_chunks`` reads before decoding)."""
    import asyncio
    from types import SimpleNamespace

    from deployments.ingress import OpenAIIngress
    from deployments.service import ActivePlan
    from sequoia_ray.in_flight import InFlight

    class Held(OpenAIIngress.func_or_class):  # Serve awaits ``__del__``; garbage collection would not
        def __del__(self) -> None:
            pass

    plans = SimpleNamespace(hardware=HW, get=lambda t, size=1: ActivePlan(builtin_plan(t), source))

    async def served_plans():
        return plans

    async def no_decoder(*args, **kwargs):
        raise _NoDecoder

    replica = object.__new__(Held)
    replica.cfg, replica.in_flight = config(None), InFlight(0.0)
    replica.slots = Slots(replica.in_flight, replica.cfg.max_concurrent)
    replica.families = replica.rules = None
    replica._plans, replica._decoder = served_plans, no_decoder
    replica.metrics = ServiceMetrics()
    replica.metrics.plan, replica.metrics.active = _Recorder(), _Recorder()

    async def run():
        with pytest.raises(_NoDecoder):
            async for _ in replica._chunks([1], SamplingParams(temperature=temperature), "r",
                                               SimpleNamespace(speculative=True), False):
                pass

    asyncio.run(run())
    [(_, tags)] = replica.metrics.plan.calls
    return tags


@pytest.mark.parametrize("source,kind", [("store:/plans/cpu/t0.6/20250101T000000Z-ab.json", "store"),
                                         ("live:/plans/cpu/t0.6/20250102T000000Z-cd.json", "live"),
                                         ("live", "live"), ("builtin", "builtin")])
def test_the_plan_gauge_is_tagged_with_the_plans_kind_not_its_path(source, kind):
    """A path is new at every publish and live re-plan: as a tag, one time series per plan ever served."""
    assert _served_plan_tags(source, 0.6) == {"hardware": HW, "source": kind, "temperature": "0.6", "batch": "1"}


def test_a_live_re_plan_to_the_target_alone_is_undone_when_acceptance_recovers(tmp_path):
    """Acceptance falls to p[1] 0.1 and the live re-plan serves the target alone at every batch size (the
    profile's draft costs 0.3 of a target step a level). Its verdicts carry no ranks, and the service never
    re-planned again. Now they are blind steps: after half_life of them the estimate fades, a tick gives
    batch 1 a tree again, and once acceptance is back at P_TRUE the live plans speculate and stay."""
    from sequoia_ray.hardware import HardwareProfile

    store = PlanStore(str(tmp_path))
    store.publish_plan(builtin_plan(0.0), KEY)
    t = {n: 1 + 0.01 * (n - 1) for n in (1, 2, 4, 8, 16)}
    store.publish_profile(HardwareProfile(HW, t, {w: 0.3 for w in t}, 0.1, 64, "float32"))
    cfg = config(str(tmp_path), live_acceptance=True, live_min_samples=50, live_half_life=200)
    plans = PlanProvider(cfg, HW)
    planner, rng, params = LivePlanner(cfg, plans), np.random.default_rng(0), SamplingParams(seed=1)
    for p, ticks in (((0.1, 0.05), 4), (P_TRUE, 8)):
        for _ in range(ticks):
            for _ in range(100):
                plan = plans.get(0.0).planned.plan
                planner.observe(plan, Verdict([0], [1], tuple(walk(plan, p, rng))), params)
            planner.tick()
        if p != P_TRUE:
            assert all(plans.get(0.0, b).planned.plan.n == 1 for b in (1, 2, 4, 8, 16))  # speculation stopped
    assert plans.get(0.0).source.startswith("live:/") and plans.get(0.0).planned.plan.n > 1
    assert store.fetch_plan(KEY)[0].plan.n > 1


@pytest.fixture
def gauge_sets(monkeypatch) -> list[tuple]:
    """Every gauge value set, as (name, value, tags): Ray's Gauge recorded."""
    from deployments import metrics as metrics_module

    sets = []

    class Gauge:
        def __init__(self, name, description, tag_keys=()):
            self.name = name

        def set(self, value, tags=None):
            sets.append((self.name, value, tags))

    monkeypatch.setattr(metrics_module.metrics, "Gauge", Gauge)
    return sets


def test_gauges_are_set_again_with_their_last_values(gauge_sets):
    """Ray drops a gauge value two report intervals (~20 s) after it was set: values set per request or per live
    check were mostly gone at a scrape. ``refresh`` sets every gauge's last value per series again; the plan
    size keeps one series per hardware and temperature, the kind served last."""
    sets = gauge_sets
    m = ServiceMetrics()
    m.active.set(3)
    m.plan.set(16, tags=m.plan_tags("hw", "store:/p/1.json", 0.0))
    m.plan.set(8, tags=m.plan_tags("hw", "live:/p/2.json", 0.0))  # a live re-plan replaces the store's series
    m.plan.set(12, tags=m.plan_tags("hw", "builtin", 0.6))
    sets.clear()
    m.refresh()
    assert sorted(sets, key=str) == sorted([
        ("sequoia_active_requests", 3, None),
        ("sequoia_plan_nodes", 8, {"hardware": "hw", "source": "live", "temperature": "0.0", "batch": "1"}),
        ("sequoia_plan_nodes", 12, {"hardware": "hw", "source": "builtin", "temperature": "0.6", "batch": "1"})],
        key=str)


def test_the_plan_gauge_follows_every_held_bucket_without_a_request(gauge_sets):
    """A refresh or a live re-plan replaces a bucket's plan between requests: the gauge, set per request only,
    showed the old plan until the bucket's next request. Every refresh of the gauges sets each bucket held."""
    sets = gauge_sets
    m, plans = ServiceMetrics(), PlanProvider(config(None), HW)
    plans.get(0.6, 4)
    plans.adopt(0.0, {1: builtin_plan(0.0, budget=4), 8: builtin_plan(0.0, budget=2)})
    m.plans(HW, plans.held())
    m.refresh()
    shown = {(tags["temperature"], tags["batch"]): (value, tags["source"]) for name, value, tags in sets
             if name == "sequoia_plan_nodes"}
    assert shown == {("0.0", "1"): (4, "live"), ("0.0", "8"): (2, "live"),  # and 0.6's bucket 4 follows 0.0's
                     ("0.6", "4"): (4, "live"), ("0.0", "4"): (4, "live")}  # (its nearest), which follows batch 1


def test_a_slow_first_token_lands_in_a_bucket_of_its_own(monkeypatch):
    """TTFT shared the step histograms' bounds (up to 5 s): every first token of a long prompt under load on CPU
    (tens of seconds) fell in +Inf, where no quantile can be read. Measured values up to two minutes resolve."""
    from bisect import bisect_left

    from deployments import metrics as metrics_module

    made = {}

    class Histogram:
        def __init__(self, name, description, boundaries=(), tag_keys=()):
            made[name] = list(boundaries)

    monkeypatch.setattr(metrics_module.metrics, "Histogram", Histogram)
    ServiceMetrics()
    bounds = made["sequoia_time_to_first_token_s"]
    buckets = [bisect_left(bounds, seconds) for seconds in (0.004, 3.0, 8.0, 25.0, 45.0, 100.0)]
    assert buckets == sorted(set(buckets)) and buckets[-1] < len(bounds)  # each its own, none past the last bound


def test_a_live_re_plan_does_not_overwrite_a_plan_a_refresh_swapped_in_while_it_ran(tmp_path):
    """The live check reads the plans served, runs the DP, then adopts: a refresh meanwhile swapped in a newer
    store plan (a new profile's), and the adopt put the re-plan of the old plans over it and published it as the
    store's latest, on every replica. The re-plan is now dropped; the next check starts from the new plan."""
    from sequoia_ray import live_acceptance

    store = PlanStore(str(tmp_path))
    store.publish_plan(builtin_plan(0.0), KEY)
    plans = PlanProvider(config(str(tmp_path)), HW)
    planner = LivePlanner(config(str(tmp_path)), plans)
    planner.live.observe(0.0, [(3, 1)] * 300 + [(3, 2)] * 300 + [(3, 3)] * 300 + [(3, 0)] * 100)  # wide, not deep
    check, newer = live_acceptance.check, []

    def check_while_refreshing(*args, **kwargs):
        fresh = check(*args, **kwargs)
        newer.append(store.publish_plan(builtin_plan(0.0, budget=4), KEY))  # the main job publishes ...
        plans.refresh()  # ... and the refresh loop swaps it in, while the DP ran
        return fresh

    live_acceptance.check = check_while_refreshing
    try:
        assert planner.tick() == []
    finally:
        live_acceptance.check = check
    assert plans.get(0.0).source == f"store:{newer[0]}" and store.fetch_plan(KEY)[1] == newer[0]
    assert planner.tick() == [0.0] and plans.get(0.0).source.startswith("live:")  # the next check re-plans from it


def test_tree_families_follow_every_live_re_plan_without_a_store():
    """Without a store every live re-plan has source "live": the families were keyed by source, so from the second
    re-plan on a batch-1 request got trees from the first one's vector."""
    from deployments.service import TreeFamilies

    plans = PlanProvider(config(None), HW)
    families = TreeFamilies(plans, 8)
    for budget in (4, 6):
        plans.adopt(0.0, {1: builtin_plan(0.0, budget=budget)})
        assert families.get(0.0).planned is plans.get(0.0).planned


def test_the_service_prunes_the_store_with_its_plan_keep(tmp_path):
    """Live plans published by a service leave each folder its newest ``plan_keep`` files."""
    plans = PlanProvider(config(str(tmp_path), plan_keep=6), HW)
    for budget in range(4, 14):
        plans.adopt(0.0, {1: builtin_plan(0.0, budget=budget)})
    published = PlanStore(str(tmp_path), keep=0).list_plans()
    assert len(published) == 6 and plans.get(0.0).source == f"live:{max(published)}"


def test_dynamic_tree_steps_whose_ranks_are_withheld_are_not_blind_steps():
    """With dynamic trees every step (``dynamic_unpruned_every`` 0) the engine withholds each verdict's ranks
    (a pruned tree's acceptance is biased): trees are served, so the estimate must not fade as if the target
    alone ran (after half_life such steps it turned every rank optimistic and unsettled). A root-only step
    still is blind."""
    cfg = config(None, live_half_life=100, live_min_samples=10)
    plans = PlanProvider(cfg, HW)
    planner = LivePlanner(cfg, plans)
    feed(planner, plans, 300)
    settled = planner.live.snapshot(0.0)
    assert settled.settled[:2].all()
    tree, params = plans.get(0.0).planned.plan, SamplingParams(seed=1)
    for _ in range(300):
        planner.observe(tree, Verdict([0], [1], ()), params)
    after = planner.live.snapshot(0.0)
    assert after.blind == 0 and np.array_equal(after.tried, settled.tried) and after.settled[:2].all()
    for _ in range(300):
        planner.observe(builtin_plan(0.0, budget=1).plan, Verdict([0], [1], ()), params)
    assert not planner.live.snapshot(0.0).settled[:2].any()  # the target alone: faded


def test_a_live_vector_on_the_served_tree_is_served_but_never_published(tmp_path):
    """The estimate left the bound of the served vector and the re-plan gave the same tree: the bucket serves its
    tree with the estimate as its vector (what the dynamic-tree rules and request trees read), and the store keeps
    its one file: two replicas whose estimates sit a little apart would publish in turn, each re-planning the
    other's. A refresh keeps it; the next check, with traffic as before, has nothing to do."""
    from sequoia_ray.tree.planning import plan_for

    store = PlanStore(str(tmp_path))
    store.publish_plan(plan_for(AcceptanceVector.from_p((0.60, 0.25, 0.10)), 16, 6)[0], KEY)
    files = sorted(tmp_path.rglob("*.json"))
    plans, cfg = PlanProvider(config(str(tmp_path)), HW), config(str(tmp_path))
    planner = LivePlanner(cfg, plans)
    start = plans.get(0.0)
    rng = np.random.default_rng(0)
    for _ in range(15_000):
        plan = plans.get(0.0).planned.plan
        planner.observe(plan, Verdict([0], [1], tuple(walk(plan, (0.52, 0.25, 0.10), rng))), SamplingParams())
    assert planner.tick() == [0.0]
    served = plans.get(0.0)
    assert served.planned.plan == start.planned.plan and served.source == start.source  # the tree's file
    assert served.planned.provenance.source == "live"  # and a live vector
    assert served.planned.acceptance.row(0)[0] == pytest.approx(0.52, abs=0.015)
    assert sorted(tmp_path.rglob("*.json")) == files  # nothing published
    plans.refresh()
    assert plans.get(0.0) is served
    assert planner.tick() == []


def test_a_live_vector_for_a_temperature_serving_another_ones_plan_is_kept(tmp_path):
    """A review: the store has T=0 alone and requests come at T=0.5, which serves T=0's plan. The estimate left
    its bound with the same tree: the refit was swapped in, then ``_refollow`` put T=0's plan back, and every tick
    re-planned and counted a re-plan, the served p[1] staying 0.60 (traffic at 0.52). A borrowed plan refit is
    published as T=0.5's own: one re-plan, then quiet."""
    from sequoia_ray.tree.planning import plan_for

    store = PlanStore(str(tmp_path))
    store.publish_plan(plan_for(AcceptanceVector.from_p((0.60, 0.25, 0.10)), 16, 6)[0], KEY)  # T=0 only
    cfg = config(str(tmp_path))
    plans = PlanProvider(cfg, HW)
    planner = LivePlanner(cfg, plans)
    start = plans.get(0.5)
    assert start.source.startswith("store:") and start is plans.get(0.0)  # T=0's plan, borrowed
    rng, params = np.random.default_rng(0), SamplingParams(temperature=0.5)
    for _ in range(15_000):
        plan = plans.get(0.5).planned.plan
        planner.observe(plan, Verdict([0], [1], tuple(walk(plan, (0.52, 0.25, 0.10), rng))), params)
    assert planner.tick() == [0.5]
    served = plans.get(0.5)
    assert served.planned.plan == start.planned.plan and served.source.startswith("live:")
    assert served.planned.acceptance.row(0)[0] == pytest.approx(0.52, abs=0.015)
    assert plans.get(0.0) is not served and plans.get(0.0).planned.acceptance.row(0)[0] == pytest.approx(0.60)
    assert planner.tick() == [] and planner.tick() == [] and planner.replans[0.5] == 1
