"""PlanProvider per batch bucket: a batch of B requests gets its bucket's plan (the largest bucket <= B);
a bucket without a plan of its own follows its temperature's largest smaller bucket with one, else the nearest
profiled temperature's, else built-in; store faults never reach a request, refresh picks up every bucket's new
plan reading only what the store has, and a loaded bucket costs no I/O."""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest

from deployments.config import ServeConfig
from deployments.service import PlanProvider
from sequoia_ray.plan_store import PlanKey, PlanStore, StoreError
from sequoia_ray.tree.acceptance_vector import AcceptanceVector
from sequoia_ray.tree.builtin import builtin_plan
from sequoia_ray.tree.planning import plan_for

HW = "cpu-test-2c"


def provider(uri: str | None) -> PlanProvider:
    return PlanProvider(ServeConfig(draft="tiny-draft", target="tiny-target", plan_store=uri), HW)


def publish(store: PlanStore, budget: int, batch: int, temperature: float = 0.0) -> str:
    planned = plan_for(AcceptanceVector.from_p([0.8, 0.1]), budget, 4)[0]
    return store.publish_plan(planned, PlanKey(HW, "tiny-draft", "tiny-target", temperature, batch))


@pytest.fixture
def store(tmp_path) -> PlanStore:
    return PlanStore(str(tmp_path / "plans"))


def test_each_batch_size_gets_its_buckets_plan(store):
    paths = {b: publish(store, budget, b) for b, budget in ((1, 16), (2, 8), (4, 6), (8, 4), (16, 1))}
    plans = provider(store.uri)
    expected = {1: 1, 2: 2, 3: 2, 4: 4, 7: 4, 8: 8, 15: 8, 16: 16, 64: 16}
    for size, bucket in expected.items():
        active = plans.get(0.0, size)
        assert (active.source, active.bucket) == (f"store:{paths[bucket]}", bucket), size
    assert plans.get(0.0, 16).planned.plan.n == 1  # the root-only plan is served as any other
    assert plans.get(0.0) is plans.get(0.0, 1)
    assert set(plans.plans) == {"t0.0", "t0.0-b2", "t0.0-b4", "t0.0-b8", "t0.0-b16"}


def test_a_bucket_without_a_plan_uses_the_batch_one_plan(store):
    one = publish(store, 16, 1)
    publish(store, 8, 2, temperature=0.6)  # another temperature's bucket 2 is not this one's
    plans = provider(store.uri)
    active = plans.get(0.0, 2)
    assert (active.source, active.bucket) == (f"store:{one}", 1) and plans.errors == 0
    assert provider(None).get(0.6, 8) == provider(None).get(0.6, 1)
    assert provider(None).get(0.6, 8).planned == builtin_plan(0.6) and provider(None).get(0.6, 8).source == "builtin"


def test_a_store_fault_falls_back_and_is_counted(store):
    one = publish(store, 16, 1)
    four = publish(store, 6, 4)
    with open(four.rsplit("/", 1)[0] + "/99990101T000000000000Z-deadbeef.json", "w") as f:
        f.write('{"schema_version": 1, "parents": [')  # bucket 4's newest file is corrupt
    plans = provider(store.uri)
    active = plans.get(0.0, 4)  # the corrupt file is skipped for bucket 4's good plan before it, and counted
    assert (active.source, active.bucket) == (f"store:{four}", 4) and plans.errors == 1
    assert "not valid JSON" in plans.last_error
    plans.refresh()  # still corrupt: skipped again, the error counted again
    assert plans.get(0.0, 4).source == f"store:{four}" and plans.errors == 2
    Path(four).unlink()  # bucket 4 holds only the corrupt file now: the plan loaded stays, one more error
    plans.refresh()
    assert plans.get(0.0, 4).source == f"store:{four}" and plans.errors == 3
    fresh = provider(store.uri)  # a new replica: bucket 4 unreadable, so batch 1's plan
    assert fresh.get(0.0, 4).source == f"store:{one}" and fresh.errors == 1


def test_refresh_follows_every_bucket(store):
    plans = provider(store.uri)
    assert plans.get(0.0, 4).source == "builtin"
    first = publish(store, 16, 1)
    plans.refresh()
    assert plans.get(0.0, 4).source == f"store:{first}"  # still a fallback: follows batch 1's new plan
    four = publish(store, 6, 4)
    plans.refresh()
    assert (plans.get(0.0, 4).source, plans.get(0.0, 4).bucket) == (f"store:{four}", 4)
    newer_one = publish(store, 12, 1)
    plans.refresh()
    assert plans.get(0.0, 4).source == f"store:{four}" and plans.get(0.0, 1).source == f"store:{newer_one}"


def test_a_loaded_bucket_costs_no_io(store, monkeypatch):
    publish(store, 16, 1)
    publish(store, 8, 2)
    plans = provider(store.uri)
    want = {b: plans.get(0.0, b) for b in (1, 2, 3, 4)}

    def no_io(*args, **kwargs):
        raise AssertionError("the store was read on the hot path")

    monkeypatch.setattr(PlanStore, "fetch_plan", no_io)
    for _ in range(3):
        assert {b: plans.get(0.0, b) for b in (1, 2, 3, 4)} == want


def test_a_bad_batch_size_is_an_error():
    with pytest.raises(ValueError, match="batch size 0 must be >= 1"):
        provider(None).get(0.0, 0)


def _served_kernels() -> str:
    import torch

    from sequoia_ray.models.packed_linear import kernels_for

    return kernels_for("auto", torch.bfloat16, "cpu")  # what ServeConfig's defaults run here


@pytest.mark.parametrize("recorded, why", [
    (dict(dtype="bfloat16", draft_quantize="int8"), "draft_quantize int8, not None"),
    (dict(dtype="float32", linears="aten"), "dtype float32, not bfloat16"),
    (dict(dtype="bfloat16"), None),  # linears: the kernels this machine serves (below); draft_vocab: the default
    (dict(dtype="bfloat16", draft_vocab=None), "draft_vocab full, not 65536"),  # profiled with the full head
    (dict(), None),  # a plan that records no serving configuration is taken as it is
])
def test_a_plan_measured_under_another_configuration_is_served_and_reported(store, caplog, recorded, why):
    from sequoia_ray.tree.plan_file import PlannedTree, Provenance

    if "dtype" in recorded:
        recorded = {"linears": _served_kernels(), "draft_vocab": 65536, **recorded}
    base = plan_for(AcceptanceVector.from_p([0.8, 0.1]), 8, 4)[0]
    planned = PlannedTree(base.plan, base.acceptance, base.budget, base.max_depth, base.expected_tokens,
                          Provenance(**recorded))
    path = store.publish_plan(planned, PlanKey(HW, "tiny-draft", "tiny-target", 0.0, 1))
    plans = provider(store.uri)  # ServeConfig's defaults: bfloat16, the draft not quantised, linears auto
    with caplog.at_level("WARNING", logger="sequoia_ray.serve"):
        active = plans.get(0.0, 1)
        plans.refresh()
        plans.get(0.0, 2)  # bucket 2 falls back to the same plan: still one warning
    assert active.source == f"store:{path}" and active.planned.plan == base.plan  # served all the same
    assert active.measured_otherwise == why
    assert plans.measured_otherwise() == ({"t0.0": why, "t0.0-b2": why} if why else {})  # b2 serves it too
    warnings = [r.getMessage() for r in caplog.records if "was measured with" in r.getMessage()]
    assert warnings == ([f"the plan {path} for T=0.0 batch bucket 1 was measured with {why}: its tree was chosen for "
                         "other costs; profile again with this configuration (scripts/main.sh does, or "
                         "`sequoia-ray profile --dtype bfloat16`)"] if why else [])


def test_a_store_without_a_plan_is_warned_about_once(store, caplog):
    """Every refresh (every plan_refresh_s) looks bucket 1 up again: the same warning each time buried the rest."""
    plans = provider(store.uri)
    with caplog.at_level("DEBUG", logger="sequoia_ray.serve"):
        assert plans.get(0.0, 1).source == "builtin"
        for _ in range(3):
            plans.refresh()
        plans.get(0.6, 1)  # another temperature's bucket: another message, warned about once too
        plans.refresh()
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert ["temperature 0.6" in w for w in warned] == [False, True], warned
    assert sum(r.levelname == "DEBUG" and r.getMessage() == warned[0] for r in caplog.records) == 4  # still logged


def test_a_refresh_beside_a_live_replan_does_not_swap_the_older_plan_back(store):
    """The ingress's refresh loop and the live re-plan run in threads of their own. A refresh that has read the
    store's latest plan (the profiled one) while a live plan is adopted and published must not then swap the
    profiled plan back in (it did, until the next refresh: up to plan_refresh_s of the wrong plan)."""
    import threading
    import time

    from sequoia_ray.tree.builtin import builtin_plan

    publish(store, 8, 1)
    plans = provider(store.uri)
    assert plans.get(0.0).planned.plan.n == 8
    fetch, replan = plans.store.fetch_plan, None

    def fetch_while_replanning(key):
        nonlocal replan
        got = fetch(key)  # the profiled plan, the latest when read
        if replan is None:
            replan = threading.Thread(target=plans.adopt, args=(0.0, {1: builtin_plan(0.0, budget=4)}))
            replan.start()
            time.sleep(0.5)  # the re-plan's adopt and publish happen now, unless it waits for this refresh
        return got

    plans.store.fetch_plan = fetch_while_replanning
    plans.refresh()
    replan.join(timeout=10)
    assert plans.get(0.0).planned.plan.n == 4 and plans.get(0.0).source.startswith("live:")
    plans.store.fetch_plan = fetch
    plans.refresh()  # the live plan is the store's latest now: kept
    assert plans.get(0.0).planned.plan.n == 4


def test_reading_the_plans_while_a_request_adds_a_bucket_does_not_fail():
    """/v1/models reads the plans on the event loop while request threads add buckets (``get``): a loop over the
    dict itself failed with "dictionary changed size during iteration" (a 500). Made deterministic here: reading
    the first plan's fields adds a bucket, as a request thread switched in at that moment would."""
    plans = provider(None)

    class Racing:  # a held plan whose fields, once read, let another thread's request in
        @property
        def source(self) -> str:
            plans.get(0.6, 1)  # a request at another temperature adds its bucket, mid-iteration
            return "builtin"

        measured_otherwise = source

    for read in (plans.measured_otherwise, plans.sources):
        plans.plans = {"t0.0": Racing()}
        read()
    assert set(plans.sources()) == {"t0.0", "t0.6"}


def test_a_temperature_without_a_plan_serves_the_nearest_temperatures(store, caplog):
    """A client's temperature the store has no plan for served the built-in plan, however near a profiled one;
    it serves the nearest profiled temperature's (ties: the lower), each batch bucket its own, warned once."""
    zero, six, six_b4 = publish(store, 16, 1), publish(store, 8, 1, 0.6), publish(store, 6, 4, 0.6)
    plans = provider(store.uri)
    with caplog.at_level("DEBUG", logger="sequoia_ray.serve"):
        assert plans.get(0.7).source == f"store:{six}"
        assert plans.get(0.2).source == plans.get(0.3).source == f"store:{zero}"  # 0.3: a tie, the lower
        assert plans.get(0.7, 4).source == f"store:{six_b4}"  # 0.6's bucket 4, not 0.7's batch 1 plan
        assert plans.get(0.2, 4).source == f"store:{zero}"  # 0.0 has no bucket 4: its batch-1 plan
        assert plans.get(1.7, 5).source == f"store:{six_b4}"  # batch 5 is bucket 4
        plans.refresh()
    assert plans.get(0.6).source == f"store:{six}" and plans.errors == 0
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warned) == 4 and all("nearest temperature" in w for w in warned), warned  # 0.7, 0.2, 0.3, 1.7
    assert "temperature 0.7 in the store: serving the plan of the nearest temperature it has (t0.6)" in warned[0]


def test_a_large_batch_bucket_without_a_plan_follows_the_largest_smaller_one(store):
    """Bucket 16 without a plan (a short profile priced up to batch 8) serves bucket 8's plan, the one measured
    nearest its batch, not batch 1's (which would speculate as if alone at batch 16)."""
    publish(store, 16, 1)
    eight = publish(store, 4, 8)
    plans = provider(store.uri)
    assert (plans.get(0.0, 16).source, plans.get(0.0, 32).source) == (f"store:{eight}", f"store:{eight}")


def test_refresh_reads_only_the_buckets_the_store_has(store, monkeypatch):
    """Clients at every temperature hold 105 buckets (21 temperatures x 5 batch buckets): each refresh read
    them all from the store (every plan_refresh_s, per replica). It lists the pair's folders once and reads the
    one bucket the store has."""
    one = publish(store, 16, 1)
    plans = provider(store.uri)
    for t in range(21):
        for batch in (1, 2, 4, 8, 16):
            plans.get(t / 10, batch)
    reads, listings = [], []
    monkeypatch.setattr(PlanStore, "fetch_plan", lambda self, key, fetch=PlanStore.fetch_plan: (
        reads.append(key.folder()) or fetch(self, key)))
    monkeypatch.setattr(PlanStore, "plan_folders", lambda self, *a, listing=PlanStore.plan_folders: (
        listings.append(a) or listing(self, *a)))
    plans.refresh()
    assert len(plans.plans) == 105 and len(reads) == 1 and reads[0].endswith("/t0.0") and len(listings) == 1
    assert all(active.source == f"store:{one}" for active in plans.plans.values())


def test_a_temperature_profiled_later_takes_over_on_refresh(store):
    """A temperature that followed its nearest serves its own plan once one is published, and the buckets
    nearer it than before follow it."""
    zero = publish(store, 16, 1)
    plans = provider(store.uri)
    assert plans.get(0.7).source == plans.get(0.6, 4).source == plans.get(1.0).source == f"store:{zero}"
    seven = publish(store, 8, 1, 0.7)
    plans.refresh()
    assert plans.get(0.7).source == plans.get(0.6, 4).source == plans.get(1.0).source == f"store:{seven}"
    assert plans.get(0.0).source == f"store:{zero}" and plans.get(0.3).source == f"store:{zero}"


def test_corrupt_temperatures_are_passed_over_without_a_loop(store):
    """A nearest temperature whose folder holds no plan that reads is passed over (counted) for the next one; with
    none that reads, built-in. No bucket ends up following itself or a follower (a loop: recursion)."""
    zero = publish(store, 16, 1)
    for temperature in (0.6, 0.8):
        Path(publish(store, 8, 1, temperature)).write_text("{")  # the folder's only file is corrupt
    plans = provider(store.uri)
    assert plans.get(0.7).source == plans.get(0.7, 4).source == f"store:{zero}" and plans.errors == 2
    plans.refresh()
    assert plans.get(0.7).source == plans.get(0.8, 2).source == f"store:{zero}" and plans.errors == 4
    Path(zero).write_text("{")
    fresh = provider(store.uri)
    assert fresh.get(0.7).source == fresh.get(0.0, 4).source == "builtin" and fresh.errors == 3


def test_every_live_replan_is_served_without_a_store(caplog):
    """Live re-plans that cannot be published (no store) all have source "live": the second and later ones were
    taken for the plan already served and never swapped in, though counted as re-plans."""
    plans = provider(None)
    first, second = (builtin_plan(0.0, budget=budget) for budget in (4, 6))
    with caplog.at_level("INFO", logger="sequoia_ray.serve"):
        plans.adopt(0.0, {1: first})
        assert plans.get(0.0).planned is first and plans.get(0.0, 4).planned is first
        plans.adopt(0.0, {1: second})
        assert plans.get(0.0).planned is second and plans.get(0.0, 4).planned is second
        plans.refresh()
    assert plans.get(0.0).planned is second and plans.get(0.0).source == "live"
    assert not any("new plan" in r.getMessage() and "builtin" in r.getMessage() for r in caplog.records)


def test_parse_bucket_inverts_plan_bucket():
    from sequoia_ray.plan_store import parse_bucket, plan_bucket

    assert parse_bucket(plan_bucket(0.64, 4)) == (0.6, 4) and parse_bucket(plan_bucket(1.0)) == (1.0, 1)
    assert [parse_bucket(n) for n in ("t0.6-b3", "t0.6-b", "profiles", "t1-b4")] == [None] * 4


def test_a_follower_of_a_follower_serves_the_new_plan_at_the_same_refresh(store):
    """T = 0.7's bucket 4 follows 0.6's bucket 4, which follows 0.6's batch-1 plan: after a new 0.6 plan, a
    refresh that re-pointed 0.7's bucket before 0.6's served it the old plan for another plan_refresh_s."""
    publish(store, 16, 1, 0.6)
    plans = provider(store.uri)
    plans.get(0.7, 4)
    newer = publish(store, 8, 1, 0.6)
    plans.refresh()
    assert plans.get(0.7, 4).source == plans.get(0.6, 4).source == f"store:{newer}"


def test_a_first_load_racing_a_refresh_does_not_lose_the_buckets_own_plan(store, monkeypatch):
    """A request's first get() of T = 0.7 loads its leader (0.0) from the store; a refresh running meanwhile found
    0.7's own new plan and swapped it in, then the load's late swap put 0.0's plan back over it, for good (the
    bucket no longer followed anything and ``seen`` said its own plan was served). Loads and refreshes now take
    turns."""
    import threading
    import time

    publish(store, 16, 1)
    plans = provider(store.uri)
    fetch, refreshes = PlanStore.fetch_plan, []

    def fetch_while_refreshing(self, key):
        if key.folder().endswith("/t0.0") and not refreshes:  # the load is reading its leader ...
            refreshes.append(threading.Thread(target=plans.refresh))
            publish(store, 8, 1, 0.7)  # ... when 0.7's own plan is published and a refresh starts
            refreshes[0].start()
            time.sleep(0.3)  # the refresh runs now, unless it waits for the load
        return fetch(self, key)

    monkeypatch.setattr(PlanStore, "fetch_plan", fetch_while_refreshing)
    plans.get(0.7)
    refreshes[0].join(timeout=10)
    plans.refresh()
    assert plans.get(0.7).planned.plan.n == 8 and "/t0.7/" in plans.get(0.7).source


def test_a_tie_between_two_temperatures_goes_to_the_lower_one_at_every_temperature(store):
    """0.4 - 0.3 > 0.5 - 0.4 in floats: T = 0.4 between plans at 0.3 and 0.5 served 0.5's (34 such ties in 0-2)."""
    for low in range(0, 19):
        temperature = (low + 1) / 10
        store = PlanStore(f"{store.uri}-{low}")
        lower, _ = publish(store, 16, 1, low / 10), publish(store, 8, 1, (low + 2) / 10)
        assert provider(store.uri).get(temperature).source == f"store:{lower}", temperature


def test_a_store_gone_after_its_listing_is_no_missing_plan(store, caplog, monkeypatch):
    """A bucket the store lists but cannot read now (unreachable since the listing) was announced "no plan ...
    in the store; run tuning/profile.py": the store error is logged, and nothing sends the operator to profile."""
    zero, _ = publish(store, 16, 1), publish(store, 8, 1, 0.7)
    plans = provider(store.uri)
    plans.get(0.0)

    def unreachable(self, key):
        raise StoreError("plan store is unreachable: timed out")

    monkeypatch.setattr(PlanStore, "fetch_plan", unreachable)
    with caplog.at_level("DEBUG", logger="sequoia_ray.serve"):
        assert plans.get(0.7).source == f"store:{zero}" and plans.errors == 1  # 0.0's, the nearest it can read
    assert not [r for r in caplog.records if "no plan for" in r.getMessage()]
    assert [r.levelname for r in caplog.records if "unreachable" in r.getMessage()] == ["ERROR"]


def test_a_refresh_stalled_in_a_store_read_holds_up_no_first_load_and_no_live_replan(store, monkeypatch):
    """A refresh read the store under the provider's lock: with the store stalled (a hung object-store read),
    a request's first step at another temperature and a live re-plan waited for all of the refresh's reads. They
    go on now; the refresh's late result leaves the live plan adopted meanwhile in place (the store's older plan
    is not swapped back)."""
    import threading

    publish(store, 16, 1)
    six = publish(store, 8, 1, 0.6)
    plans = provider(store.uri)
    assert plans.get(0.0).planned.plan.n > 4
    with _refresh_stalled_in_a_read(plans, monkeypatch) as refresh:
        first = threading.Thread(target=plans.get, args=(0.6,))
        replan = threading.Thread(target=plans.adopt, args=(0.0, {1: builtin_plan(0.0, budget=4)}))
        for thread in (first, replan):
            thread.start()
            thread.join(10)
        stuck = [thread.is_alive() for thread in (first, replan)]
    assert stuck == [False, False] and not refresh.is_alive()
    assert plans.get(0.6).source == f"store:{six}"
    assert plans.get(0.0).planned.plan.n == 4 and plans.get(0.0).source.startswith("live:")


def test_a_file_skipped_by_a_load_beside_a_refresh_is_counted_once(store, monkeypatch):
    """A refresh fetches outside the lock while a request's first load fetches under it: each counted the store's
    skips since its own start, so a corrupt file the load skipped was counted by the stalled refresh too (two
    plan-store errors for one). Each fetch counts its own thread's skips."""
    publish(store, 16, 1)
    four = publish(store, 8, 4)
    newest = publish(store, 6, 4)
    Path(newest).write_text("{")  # bucket 4's newest file does not read
    assert four != newest
    plans = provider(store.uri)
    plans.get(0.0)
    with _refresh_stalled_in_a_read(plans, monkeypatch):
        assert plans.get(0.0, 4).source == f"store:{four}"  # the load skips the corrupt file: one error
    assert plans.store.skips == 1 and plans.errors == 1


@contextlib.contextmanager
def _refresh_stalled_in_a_read(plans, monkeypatch):
    """A refresh in a thread of its own, held inside its first store read (a hung object-store read) for the
    body's length; the refresh thread, joined after."""
    import threading

    entered, release, fetch = threading.Event(), threading.Event(), PlanStore.fetch_plan

    def stalled(self, key):
        if threading.current_thread().name == "refresh" and not release.is_set():
            entered.set()
            release.wait(30)
        return fetch(self, key)

    monkeypatch.setattr(PlanStore, "fetch_plan", stalled)
    refresh = threading.Thread(target=plans.refresh, name="refresh")
    refresh.start()
    try:
        assert entered.wait(10)
        yield refresh
    finally:
        release.set()
        refresh.join(10)
