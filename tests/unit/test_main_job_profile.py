"""The main job's plan for this machine: the launcher profiles when the store has no plan for its hardware
id, pair and temperature buckets (tiny models, a tiny time budget), skips when a plan is there or
profiling is off, falls back to the built-in plan when profiling fails; the bounded trial honours its
time budget (a fake clock); plans record the serving configuration they were measured with."""

from __future__ import annotations

import itertools
import json
import math
import random
from dataclasses import replace
from types import SimpleNamespace

import pytest

from deployments.config import ServeConfig
from deployments import launch
from deployments.launch import SERVED_TEMPERATURES, ensure_plans, missing_temperatures, serving_hardware_id
from deployments.service import PlanProvider
from sequoia_ray import profiling
from sequoia_ray.config import ProfileJobConfig, SamplingParams
from sequoia_ray.hardware import BATCH_BUCKETS, HardwareProfile, choose_buckets, hardware_id
from sequoia_ray.local import LocalPair
from sequoia_ray.plan_store import PlanKey, PlanStore
from sequoia_ray.profiling import (BudgetExhausted, Deadline, Serving, bounded_sizes, measure_within,
                                   run_bounded, tokens_within)
from sequoia_ray.tree.acceptance_vector import AcceptanceVector
from sequoia_ray.tree.builtin import builtin_acceptance, builtin_plan
from sequoia_ray.tree.dp import solve
from sequoia_ray.tree.plan_file import BUILTIN_ACCEPTANCE, PlanFormatError, PlannedTree, Provenance

TINY = {"model_name": "tiny", "draft": "tiny-draft", "target": "tiny-target", "dtype": "float32", "num_cpus": 1,
        "threads": 1}


class FakeClock:
    """Seconds that pass only when a test says so."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture(scope="module")
def pair():
    return LocalPair.load("tiny-target", "tiny-draft", dtype="float32", progress=False)


def _cfg(tmp_path, **kw) -> ServeConfig:
    return ServeConfig.model_validate({**TINY, "plan_store": str(tmp_path / "plans"), **kw})


def _never(*args, **kwargs):
    raise AssertionError("profiling must not run here")


# ---- provenance ------------------------------------------------------------------------------------
def test_provenance_with_serving_config_round_trips():
    prov = Provenance(draft="d", target="t", temperature=0.6, hardware="cpu-x-2c", dtype="bfloat16",
                      draft_quantize="int8", device="cpu", threads=2, time_budget_s=120.0, prompts=3,
                      tokens_measured=96, layers="traced", draft_vocab=65536)
    planned = builtin_plan(0.6)
    planned = PlannedTree(planned.plan, planned.acceptance, planned.budget, planned.max_depth,
                          planned.expected_tokens, prov)
    assert PlannedTree.loads(planned.dumps()).provenance == prov


def test_plan_file_without_the_new_fields_still_loads():
    obj = builtin_plan(0.0).to_dict()
    obj["provenance"] = {"draft": "d", "target": "t", "temperature": 0.0, "hardware": None}  # a file of before
    prov = PlannedTree.from_dict(obj).provenance
    assert (prov.draft, prov.hardware, prov.dtype, prov.threads, prov.time_budget_s) == ("d", None, None, None, None)


@pytest.mark.parametrize("key, value", [("threads", -1), ("threads", 1.5), ("prompts", True), ("dtype", 16),
                                        ("time_budget_s", 0), ("time_budget_s", float("inf"))])
def test_bad_serving_config_in_provenance_is_rejected(key, value):
    obj = builtin_plan(0.0).to_dict()
    obj["provenance"] = {key: value}
    with pytest.raises(PlanFormatError, match=f"provenance.{key}"):
        PlannedTree.from_dict(obj)


def test_store_keeps_measured_provenance_and_stamps_the_key(tmp_path):
    store = PlanStore(str(tmp_path))
    base = builtin_plan(0.0)
    planned = PlannedTree(base.plan, base.acceptance, base.budget, base.max_depth, base.expected_tokens,
                          Provenance(hardware="wrong", dtype="bfloat16", threads=2, tokens_measured=10))
    key = PlanKey("cpu-x-2c", "d", "t", 0.0)
    store.publish_plan(planned, key)
    prov = store.fetch_plan(key)[0].provenance
    assert (prov.hardware, prov.draft, prov.dtype, prov.threads, prov.tokens_measured) == ("cpu-x-2c", "d",
                                                                                          "bfloat16", 2, 10)


# ---- the time budget ---------------------------------------------------------------------------------
def test_tokens_within_counts_one_step_per_token_after_the_fixed_cost():
    assert tokens_within(10.0, 0.5, 2.0) == 16
    assert tokens_within(1.0, 0.5, 2.0) == 0


def test_profiled_sizes_fit_their_share_of_the_budget():
    """0.1 s a token; each forward costs 2 x (warm-up + 3 repeats) x its time = 0.8 s a token. A forward per
    size alone and per batch bucket B at B·1 token decide the sizes; the batch grid (B·s <= batch_total)
    then grows into what is left."""
    probe = {1: 0.1, 8: 0.8}
    assert profiling.BOUNDED_REPEATS == 3 and profiling.BATCH_BUCKETS == (1, 2, 4, 8, 16)
    assert profiling.batch_tokens((1, 2, 4)) == [1, 2, 4, 2, 4, 4, 8, 16]  # B=2: s 1, 2; B=4, 8, 16: s 1
    assert profiling.batch_tokens((1, 2, 4), 1) == [1, 2, 4, 2, 4, 8, 16]  # one token per request
    # all sizes: 63 tokens alone + 62 (B=2) + 60 (B=4) + 56 (B=8) + 48 (B=16) = 289 tokens = 231.2 s
    assert bounded_sizes(probe, 232.0) == ((1, 2, 4, 8, 16, 32), 32)
    # 63 + 30 (B·1) = 93 tokens = 74.4 s; the grid to 8: 63 + 14 + 12 + 8 + 16 = 113 = 90.4 s (to 16: 128.8 s)
    assert bounded_sizes(probe, 100.0) == ((1, 2, 4, 8, 16, 32), 8)
    # the sizes to 16 and the batch buckets before size 32: 31 + 30 = 48.8 s; to 4: 31 + 34 = 52 s
    assert bounded_sizes(probe, 60.0) == ((1, 2, 4, 8, 16), 4)
    # the sizes to 16 fit alone (24.8 s), not with the batch buckets (48.8 s): the sizes, no batch tables. (The
    # batch buckets first gave sizes to 4 here: 7 + 30 = 29.6 s, and with 4 s less budget sizes to 16.)
    assert bounded_sizes(probe, 33.0) == ((1, 2, 4, 8, 16), 0)
    assert bounded_sizes(probe, 29.0) == ((1, 2, 4, 8, 16), 0)  # 31 tokens alone = 24.8 s; to 32: 50.4 s
    assert bounded_sizes(probe, 24.0) == ((1, 2, 4, 8), 0)  # 15 tokens = 12 s
    assert bounded_sizes(probe, 5.7) == ((1, 2, 4), 0)  # 7 tokens = 5.6 s
    with pytest.raises(BudgetExhausted, match="raise the time budget"):
        bounded_sizes(probe, 5.5)


@pytest.mark.parametrize("probe", [{1: 0.1, 8: 0.8}, {1: 0.44, 8: 0.44}, {1: 0.1, 8: 0.2}])
def test_more_profiling_time_never_times_fewer_sizes_or_batches(probe):
    """Over budgets from 1 s to 400 s in steps of 0.5 s, every result fits its budget, and what is timed never
    gets worse as the budget grows, in the order of priority: sizes up to 16, then the batch buckets, then
    larger sizes, then the batch grid (which may shrink when size 32 comes in). The second probe is the 2-core
    Xeon's on a slow moment (flat: 0.44 s for 1 or 8 tokens)."""
    def cost(sizes, total):
        tokens = profiling.batch_tokens(sizes, total) if total else sizes
        return 8 * sum(max(probe[1], probe[8] * s / 8) for s in tokens)

    last = None
    for seconds in (x / 2 for x in range(2, 801)):
        try:
            sizes, total = bounded_sizes(probe, seconds)
        except BudgetExhausted:
            assert last is None
            continue
        assert cost(sizes, total) <= seconds
        rank = (min(max(sizes), 16), total > 0, max(sizes), total)
        assert last is None or rank >= last, (seconds, rank, last)
        if total == 0 and max(sizes) < 32:  # no batch tables: not even sizes to min(16, largest) fit with them
            assert cost(sizes[:sizes.index(min(max(sizes), 16)) + 1], 1) > seconds
        last = rank
    assert last == (16, True, 32, 32)


def test_profile_is_made_monotone_by_the_least_squares_fit_then_renormalised():
    noisy = replace(_profile(step_s=0.2), t={1: 1.0, 2: 0.9, 4: 1.3, 8: 1.2, 16: 2.0}, c={1: 0.2, 2: 0.1},
                    batch_t={4: {4: 1.5, 8: 1.4}}, batch_c={4: {4: 0.3, 8: 0.4}})
    fixed = profiling.monotone(noisy)
    one = 0.95  # t(1) and t(2) pooled: (1.0 + 0.9) / 2; every table is divided by it, the step scaled by it
    assert fixed.t == pytest.approx({1: 1.0, 2: 1.0, 4: 1.25 / one, 8: 1.25 / one, 16: 2.0 / one})
    assert fixed.c == pytest.approx({1: 0.15 / one, 2: 0.15 / one})
    assert fixed.batch_t == {4: pytest.approx({4: 1.45 / one, 8: 1.45 / one})}
    assert fixed.batch_c == {4: pytest.approx({4: 0.3 / one, 8: 0.4 / one})}  # already monotone: only rescaled
    assert fixed.target_step_s == pytest.approx(0.2 * one)
    # seconds are kept: t(n) x target_step_s is the fitted seconds of n tokens
    assert fixed.t[4] * fixed.target_step_s == pytest.approx(1.25 * 0.2)
    # a single slow timing at a small size no longer sets every larger one (a running maximum gave 1.3 to 8, 16)
    spike = profiling.monotone(replace(_profile(), t={1: 1.0, 2: 1.0, 4: 1.6, 8: 1.1, 16: 1.2}, c={1: 0.2}))
    assert spike.t[2] == 1.0 and spike.t[4] == spike.t[8] == spike.t[16] == pytest.approx((1.6 + 1.1 + 1.2) / 3)


@pytest.mark.parametrize("seed", range(40))
def test_isotonic_fit_is_the_least_squares_non_decreasing_fit(seed):
    """Against brute force: the fit is the block means of some split of the keys into runs; try every split."""
    rng = random.Random(seed)
    keys = sorted(rng.sample(range(1, 65), rng.randint(1, 7)))
    table = {k: rng.uniform(0.1, 2.0) for k in keys}
    values = [table[k] for k in keys]
    best = None
    for cuts in itertools.product((False, True), repeat=len(keys) - 1):
        fit, start = [], 0
        for i in range(len(keys)):
            if i == len(keys) - 1 or cuts[i]:
                run = values[start:i + 1]
                fit += [sum(run) / len(run)] * len(run)
                start = i + 1
        if all(a <= b + 1e-12 for a, b in zip(fit, fit[1:])):
            sse = sum((f - v) ** 2 for f, v in zip(fit, values))
            best = min(best or (sse, fit), (sse, fit))
    got = profiling.isotonic(table)
    assert list(got) == keys and all(a <= b for a, b in zip(list(got.values()), list(got.values())[1:]))
    assert list(got.values()) == pytest.approx(best[1])


def test_deadline_reads_the_injected_clock():
    clock = FakeClock()
    deadline = Deadline(60, clock)
    clock.now += 45
    assert (deadline.elapsed(), deadline.left()) == (45, 15)
    with pytest.raises(ValueError, match="must be > 0"):
        Deadline(0, clock)


def _profile(step_s: float = 1.0) -> HardwareProfile:
    return HardwareProfile(hardware_id="cpu-x-2c", t={1: 1.0, 8: 1.0, 16: 1.0, 32: 1.0},
                           c={1: 0.0, 32: 0.0}, target_step_s=step_s, context=64, dtype="float32", versions={},
                           timestamp="2026-01-01T00:00:00+00:00")


class FakePair:
    def decoder(self, plan, **kw):
        raise AssertionError("the fake measure does not decode")


def _measure_taking(clock: FakeClock, seconds_per_unit: float, asked: list):
    """A fake ``measure`` that takes ``seconds_per_unit`` x (1 prefill unit + one unit per token asked)."""
    def fake(decoder_for, prompts, *, width, temperature, max_tokens, seed, progress):
        asked.append(max_tokens)
        clock.now += seconds_per_unit * (1 + max_tokens)
        return AcceptanceVector.from_p([0.5] + [0.0] * (width - 1)), max_tokens  # worst case: a token a step
    return fake


@pytest.mark.parametrize("unit_s, until, expected_asks, pace", [
    # as profiled: a share of 40/6 s fits 4 tokens (< 8), so each prompt gets the minimum 8 (10 s) while the
    # whole time left fits them: four prompts, then nothing is left
    (1.0, 40.0, [8, 8, 8, 8], 1.0),
    # 3x slower than profiled (not yet known): a share of 15 s fits 14 tokens (45 s); then at the pace seen a
    # share of 45/5 s fits 2 tokens, the 45 s left fit 14: the minimum 8 (27 s); 18 s left fit 5: stop
    (3.0, 90.0, [14, 8], 3.0),
    # 4x faster (a profile on a busy machine): after the first prompt (2.25 s), shares of 3.55-3.75 s fit 13-14
    (0.25, 20.0, [8, 13, 13, 13, 13, 14], 0.25),
])
def test_measuring_fits_its_time(monkeypatch, unit_s, until, expected_asks, pace):
    """The profile says 1 s a step and 1 s of prefill (t = 1, a draft that costs nothing); the fake takes
    ``unit_s`` per unit. Every prompt asks
    for what fits its equal share of the time left at the pace seen so far (at least 8 tokens while they fit),
    so p is spread over the prompts and the clock never passes ``until``."""
    clock, asked = FakeClock(), []
    monkeypatch.setattr(profiling, "measure", _measure_taking(clock, unit_s, asked))
    deadline = Deadline(100, clock)
    cfg = ProfileJobConfig(storage="unused", measure_tokens=16, width=2)
    acceptance, used, tokens, seen = measure_within(cfg, FakePair(), [[1] * 10] * 6, 0.0, deadline, until,
                                                    _profile())
    assert asked == expected_asks and (used, tokens) == (len(asked), sum(asked)) and deadline.elapsed() <= until
    assert acceptance.rows[0][0] == pytest.approx(0.5) and seen == pytest.approx(pace)


def test_no_time_to_measure_is_budget_exhausted(monkeypatch):
    monkeypatch.setattr(profiling, "measure", _never)
    cfg = ProfileJobConfig(storage="unused", width=2)
    with pytest.raises(BudgetExhausted, match="raise the time budget"):
        measure_within(cfg, FakePair(), [[1] * 10], 0.0, Deadline(100, FakeClock()), 5.0, _profile())


def test_bounded_trial_without_time_for_p_plans_with_this_machines_profile_and_the_builtin_vector(
        tmp_path, pair, monkeypatch):
    """Profiling t(n) and c took the whole budget: every plan is still chosen for this machine's profile
    (the cost model's choice per batch bucket), with the built-in acceptance vector, and says so."""
    clock, real_profile = FakeClock(), profiling._bounded_profile

    def slow_profile(*args, **kwargs):
        prof = real_profile(*args, **kwargs)
        clock.now += 60.0  # profiling t(n) and c took the whole budget
        return prof

    monkeypatch.setattr(profiling, "_bounded_profile", slow_profile)
    cfg = ProfileJobConfig(storage=str(tmp_path), draft="tiny-draft", target="tiny-target", dtype="float32",
                           max_noise=100.0)  # tiny models' sub-ms timings on a busy machine
    run_bounded(cfg, "cpu-x-1c", Serving(threads=1, time_budget_s=60), clock=clock, progress=False, pair=pair)
    store = PlanStore(str(tmp_path))
    prof = store.fetch_profile("cpu-x-1c")
    # the buckets the profile could plan for: on a busy machine the probe finds less time for sizes, and a
    # bucket larger than the largest size profiled is not planned (a unit run beside another test had 4 of 5)
    assert 1 in prof.buckets() and set(prof.buckets()) <= set(BATCH_BUCKETS)
    assert len(store.list_plans()) == len(cfg.temperatures) * len(prof.buckets())
    for temperature in cfg.temperatures:
        table = solve(builtin_acceptance(temperature), max(prof.t), cfg.max_depth)
        for batch, (best, _) in choose_buckets(table, prof, tuple(prof.t)).items():
            planned, _ = store.fetch_plan(PlanKey("cpu-x-1c", "tiny-draft", "tiny-target", temperature, batch))
            assert planned.acceptance.rows == builtin_acceptance(temperature).rows
            assert (planned.plan.parents, planned.budget) == (best.plan.parents, best.n)
            prov = planned.provenance
            assert (prov.source, prov.prompts, prov.tokens_measured, prov.time_budget_s) == (
                BUILTIN_ACCEPTANCE, 0, 0, 60)


# ---- the launcher --------------------------------------------------------------------------------------
def test_hardware_id_is_the_target_deployments(tmp_path):
    cfg = _cfg(tmp_path, threads=2, num_cpus=1)
    assert serving_hardware_id(cfg) == hardware_id(None, 1, 2)
    assert serving_hardware_id(_cfg(tmp_path, threads=None, num_cpus=1)) == hardware_id(None, 1, 1)
    assert serving_hardware_id(_cfg(tmp_path, hardware_id="pinned")) == "pinned"


def test_the_launcher_files_plans_under_the_actors_device_not_its_own(tmp_path, monkeypatch):
    """On a GPU host with num_gpus 0 the actors run on the CPU: the launcher must look plans up (and profile)
    there, not on the GPU it sees itself (it profiled on the GPU and filed the plans under its id)."""
    import torch

    import sequoia_ray.devices as devices
    import sequoia_ray.hardware as hw

    asked = []
    monkeypatch.setattr(devices, "resolve_device", lambda spec: asked.append(spec) or torch.device(
        "cuda" if spec in ("auto", "cuda") else "cpu"))  # a launcher that sees a GPU
    monkeypatch.setattr(hw, "accelerator_name", lambda device: "L4" if device.type == "cuda" else None)
    cfg = _cfg(tmp_path, threads=2, num_cpus=1)
    assert serving_hardware_id(cfg) == hardware_id(None, 1, 2) and asked == ["cpu"]
    jobs, freed = [], []
    monkeypatch.setattr(launch, "release_accelerator", freed.append)
    ensure_plans(cfg, 60.0, run=lambda job, *args, **kw: jobs.append(job) or [])
    assert jobs[0].device == "cpu" and freed == ["cpu"]


def test_missing_plans_are_profiled_published_and_then_served(tmp_path, pair, capsys):
    cfg = _cfg(tmp_path)
    hardware = serving_hardware_id(cfg)
    assert missing_temperatures(cfg, hardware) == SERVED_TEMPERATURES

    def run(job, hw, serving, *, clock):
        assert (job.dtype, job.draft, job.target, hw, serving.threads) == ("float32", "tiny-draft", "tiny-target",
                                                                           hardware, 1)
        assert job.max_noise == ProfileJobConfig.model_fields["max_noise"].default
        quiet = job.model_copy(update={"max_noise": 100.0})  # tiny models' sub-ms timings on a busy CI machine
        return run_bounded(quiet, hw, serving, clock=clock, progress=True, pair=pair)

    assert ensure_plans(cfg, 60.0, run=run) == "profiled"
    out = capsys.readouterr().out
    assert "profiling [1/6] loading models" in out and "profiled in" in out  # plain lines: not a terminal
    assert missing_temperatures(cfg, hardware) == ()
    provider = PlanProvider(cfg, hardware)
    for temperature in SERVED_TEMPERATURES:
        active = provider.get(temperature)
        prov = active.planned.provenance
        assert active.source.startswith("store:")
        assert (prov.hardware, prov.dtype, prov.threads, prov.device, prov.time_budget_s) == (
            hardware, "float32", 1, "cpu", 60.0)
        assert prov.prompts >= 1 and prov.tokens_measured >= profiling.MIN_TOKENS
        # the measured choice at batch 1: the target alone and the model's best trees run for real, the
        # published tree is the fastest measured; every bucket's choice paid the measured overhead
        measured = {(c["n"], c["d"]): c for c in prov.candidates}
        assert (1, 1) in measured and len(measured) >= 2 and measured[1, 1]["measured_speedup"] == 1.0
        fastest = max(prov.candidates, key=lambda c: c["tokens_per_s"])
        assert (active.planned.budget, active.planned.max_depth) == (fastest["n"], fastest["d"])
        assert prov.measured_speedup == pytest.approx(fastest["measured_speedup"], rel=1e-3)
        assert set(prov.overhead) == {"alone", "tree", "calls"} and min(map(min, prov.overhead.values())) >= 0
        for batch in profiling.BATCH_BUCKETS:  # a plan per batch bucket, each its own
            active = provider.get(temperature, batch)
            assert active.bucket == batch and active.planned.provenance.batch == (None if batch == 1 else batch)
            assert active.planned.provenance.time_budget_s == 60.0
            assert active.planned.provenance.overhead == prov.overhead
    rows = [line.split() for line in out.splitlines() if line.startswith(hardware)]
    assert sorted((float(r[1]), int(r[2])) for r in rows) == sorted(
        (t, b) for t in SERVED_TEMPERATURES for b in profiling.BATCH_BUCKETS)  # the table: a row per bucket
    assert ensure_plans(cfg, 60.0, run=_never) == "present"


def test_a_failing_profile_serves_the_builtin_plan(tmp_path, capsys):
    cfg = _cfg(tmp_path)

    def oom(*args, **kwargs):
        raise MemoryError("cannot allocate 3 GiB")

    assert ensure_plans(cfg, 60.0, run=oom) == "builtin"
    out = capsys.readouterr().out
    assert "profiling failed, serving the built-in plan: MemoryError: cannot allocate 3 GiB" in out
    assert PlanProvider(cfg, serving_hardware_id(cfg)).get(0.0).source == "builtin"


@pytest.mark.parametrize("seconds, extra, address, why", [
    (None, {}, None, "--no-profile"),
    (60.0, {"plan_store": None}, None, "no plan store"),
    (60.0, {"plan_store": "s3://bucket/plans"}, None, "remote"),
    (60.0, {"draft": None}, None, "no draft"),
    (60.0, {}, "ray://head:10001", "on the cluster"),
    (60.0, {"tp_size": 2}, None, "tp_size 2"),
    (60.0, {"num_gpus": 1.0}, None, "GPUs this process does not see"),  # raised "device 'cuda' ..." after Ray started
])
def test_profiling_is_skipped_when_it_cannot_or_must_not_run(tmp_path, capsys, seconds, extra, address, why):
    if extra.get("num_gpus"):
        import torch
        if torch.cuda.is_available():
            pytest.skip("this process sees a GPU: the launcher profiles it")
    cfg = ServeConfig.model_validate({**TINY, "plan_store": str(tmp_path / "plans"), **extra})
    assert ensure_plans(cfg, seconds, address=address, run=_never) == "skipped"
    assert why in capsys.readouterr().out


def test_a_corrupt_stored_plan_counts_as_missing(tmp_path):
    cfg = _cfg(tmp_path)
    hardware = serving_hardware_id(cfg)
    folder = tmp_path / "plans" / PlanKey(hardware, "tiny-draft", "tiny-target", 0.0).folder()
    folder.mkdir(parents=True)
    (folder / "20260101T000000000000Z-deadbeef.json").write_text(json.dumps({"schema_version": 1}))
    assert 0.0 in missing_temperatures(cfg, hardware)


@pytest.mark.parametrize("source, seconds, profiled_again", [
    (BUILTIN_ACCEPTANCE, 300.0, True), (BUILTIN_ACCEPTANCE, 60.0, False), (BUILTIN_ACCEPTANCE, None, False),
    (None, 300.0, False)])  # a plan whose p was measured stays, whatever the budget now
def test_a_plan_without_measured_p_is_profiled_again_only_with_more_time(tmp_path, capsys, source, seconds,
                                                                         profiled_again):
    cfg = _cfg(tmp_path, linears="aten")
    hardware = serving_hardware_id(cfg)
    store, base = PlanStore(cfg.plan_store), builtin_plan(0.0)
    prov = Provenance(dtype="float32", linears="aten", draft_vocab=65536, source=source, time_budget_s=60.0)
    for temperature in SERVED_TEMPERATURES:
        planned = PlannedTree(base.plan, base.acceptance, base.budget, base.max_depth, base.expected_tokens, prov)
        store.publish_plan(planned, PlanKey(hardware, "tiny-draft", "tiny-target", temperature))
    assert missing_temperatures(cfg, hardware, seconds) == (SERVED_TEMPERATURES if profiled_again else ())
    out = capsys.readouterr().out
    assert ("the built-in acceptance vector (60s left no time to measure p; 300s now)" in out) == profiled_again


@pytest.mark.parametrize("recorded, serving, why", [
    (dict(dtype="float32"), dict(linears="packed"), "aten Linear kernels, not packed (linears packed)"),  # pre-packing
    (dict(dtype="float32", linears="packed"), dict(linears="aten"), "packed Linear kernels, not aten"),
    (dict(dtype="bfloat16", linears="aten"), dict(linears="aten"), "dtype bfloat16, not float32"),
    (dict(dtype="float32", linears="aten"), dict(linears="aten", draft_quantize="int8"), "draft_quantize None, not int8"),
    (dict(dtype="float32", linears="packed", draft_vocab=65536), dict(linears="packed"), None),
    (dict(dtype="float32", linears="aten"), dict(linears="aten"), "draft_vocab full, not 65536"),  # pre-subset
    (dict(dtype="float32", linears="aten", draft_vocab=65536), dict(linears="aten", draft_vocab=None),
     "draft_vocab 65536, not full"),
    (dict(), dict(linears="packed"), None),  # a plan that records no serving configuration is taken as it is
])
def test_a_plan_measured_with_another_serving_configuration_counts_as_missing(tmp_path, capsys, recorded, serving,
                                                                             why):
    cfg = _cfg(tmp_path, **serving)
    hardware = serving_hardware_id(cfg)
    store, base = PlanStore(cfg.plan_store), builtin_plan(0.0)
    for temperature in SERVED_TEMPERATURES:
        planned = PlannedTree(base.plan, base.acceptance, base.budget, base.max_depth, base.expected_tokens,
                              Provenance(**recorded))
        store.publish_plan(planned, PlanKey(hardware, "tiny-draft", "tiny-target", temperature))
    assert missing_temperatures(cfg, hardware) == (SERVED_TEMPERATURES if why else ())
    out = capsys.readouterr().out
    assert (why in out and "profiling again" in out) if why else "profiling again" not in out


def test_a_noisy_bounded_profile_publishes_nothing_and_the_builtin_plan_serves(tmp_path, pair, capsys):
    cfg = _cfg(tmp_path)

    def run(job, hw, serving, *, clock):
        noisy = job.model_copy(update={"max_noise": 1e-9})  # any measured spread exceeds it
        return run_bounded(noisy, hw, serving, clock=clock, progress=False, pair=pair)

    assert ensure_plans(cfg, 60.0, run=run) == "builtin"
    assert "exceeds the bound 0%" in capsys.readouterr().out
    assert PlanStore(cfg.plan_store).list_plans() == []


def test_choice_tokens_fit_their_time():
    """1 s a target step everywhere, prompts of 10 tokens: the target prefills one in 1 s, the draft in 0.5 s.
    A round: the overhead runs root-only and with a tree at batch 1 and 4 (5 prompts each: 5 x 1 + 5 x 1.5 s),
    the target alone and 2 trees measured (1 + 2 x 1.5 s); 2 rounds: 33 s of prefill. A token costs
    2 x (2 x (1 + 1) + 3 x 1) = 14 s; with no candidates the overhead runs alone, 25 s of prefill and 8 s a token."""
    prof = replace(_profile(), c={1: 0.5, 32: 0.5})
    assert profiling.choice_tokens(33 + 14 * 5, prof, 1.0, 2, 10) == 5
    assert profiling.choice_tokens(33 + 14 * 5 - 0.1, prof, 1.0, 2, 10) == 4
    assert profiling.choice_tokens(2 * (33 + 14 * 5), prof, 2.0, 2, 10) == 5  # twice as slow as profiled
    assert profiling.choice_tokens(32.9, prof, 1.0, 2, 10) == 0
    assert profiling.choice_tokens(25 + 8 * 5, prof, 1.0, 0, 10) == 5
    assert profiling.choice_tokens(25 + 8 * 5 - 0.1, prof, 1.0, 0, 10) == 4


def test_without_time_for_the_measured_choice_the_overhead_is_measured_alone():
    """The same profile: the overhead runs alone cost 25 s of prefill (2 rounds x 5 prompts x (1 + 1.5 s)) and
    2 x (2 x (1 + 1)) = 8 s a token. The choice (2 candidates) needs 33 + 14 x 8 = 145 s for MIN_TOKENS; 1 s
    less fits the overhead runs alone, with 14 tokens; 25 + 8 x 8 s is their least."""
    prof = replace(_profile(), c={1: 0.5, 32: 0.5})
    cfg = ProfileJobConfig(storage="unused", candidates=2)
    assert profiling.trees_within(145, prof, 1.0, cfg, 10) == (8, cfg)
    ask, overhead_only = profiling.trees_within(144, prof, 1.0, cfg, 10)
    assert (ask, overhead_only.candidates) == (14, 0) and overhead_only.width == cfg.width
    assert profiling.trees_within(25 + 8 * 8, prof, 1.0, cfg, 10)[0] == 8
    assert profiling.trees_within(25 + 8 * 8 - 0.1, prof, 1.0, cfg, 10)[0] == 7  # < MIN_TOKENS: nothing measured
    # no candidates configured: the overhead runs alone, whatever the time
    assert profiling.trees_within(1000, prof, 1.0, cfg.model_copy(update={"candidates": 0}), 10)[1].candidates == 0


@pytest.mark.parametrize("trees_s, candidates, overhead", [(1000.0, 2, True), (150.0, 0, True), (40.0, None, False)])
def test_a_temperatures_trees_stage_measures_what_fits(monkeypatch, pair, trees_s, candidates, overhead):
    """``_bounded_plan`` with p measured at once and ``trees_s`` seconds left for trees (70% of them for the
    batch-1 stage): the measured choice with 2 candidates when it fits, the overhead runs alone when only they
    fit, nothing measured when not even they fit; the published plans carry the overhead whenever it was
    measured."""
    clock, seen = FakeClock(), []
    prof = replace(_profile(), c={1: 0.5, 32: 0.5})
    cfg = ProfileJobConfig(storage="unused", temperatures=(0.0,), candidates=3, max_depth=4)
    deadline = Deadline(10 + trees_s / (1 - profiling.MEASURE_SHARE), clock)
    clock.now += 10  # the profile's time: the temperature's share is the rest, 45% of it for p

    def fake_measure(cfg, pair, prompts, temperature, deadline, until, prof):
        clock.now = deadline.start + until
        return AcceptanceVector.from_p([0.6, 0.2, 0.1]), 3, 30, 1.0

    def fake_plan_buckets(bounded, pair, prof, table, budgets, prompts, params, **kw):
        seen.append(bounded.candidates)
        measured = profiling.StepOverhead(alone=(0.1, 0.0), tree=(0.2, 0.0))
        return {b: replace(p, overhead=measured)
                for b, p in profiling.unmeasured_picks(table, prof, budgets, sampled=False).items()}

    monkeypatch.setattr(profiling, "measure_within", fake_measure)
    monkeypatch.setattr(profiling, "plan_buckets", fake_plan_buckets)
    monkeypatch.setattr(profiling, "check_buckets", lambda picks, measure, fits: picks)
    stages = profiling.Stages(["p", "trees"], deadline, progress=False)
    planned = profiling._bounded_plan(cfg, pair, prof, [[1] * 10] * 3, 0, deadline, stages, Serving(1, 60.0))
    assert seen == ([candidates] if candidates is not None else [])
    assert planned and all((tree.provenance.overhead is not None) == overhead for tree, _ in planned)


# ---- the larger buckets' trees checked against the target alone -----------------------------------
def _bucket_picks() -> dict[int, profiling.Picked]:
    """A tree picked by the model at every bucket up to 8 (16: the target alone), as the bounded job has them."""
    from sequoia_ray.hardware import Choice
    from sequoia_ray.tree.plan import chain

    def choice(batch: int, n: int) -> Choice:
        return Choice(n, n, 1.0 + 0.3 * (n > 1), 1.0 + 0.1 * (n > 1), chain(n - 1), batch)

    picks = {}
    for batch, n in ((1, 8), (2, 6), (4, 4), (8, 2), (16, 1)):
        predicted = [choice(batch, 1)] + ([choice(batch, n)] if n > 1 else [])
        picks[batch] = profiling.Picked(predicted[-1], predicted[-1], predicted)
    return picks


def _measure_with(faster: dict[int, bool], calls: list):
    """A fake ``measure``: the tree runs 1.2x (faster[batch]) or 0.8x the target alone's tokens/s."""
    from sequoia_ray.measured_choice import Measured

    def measure(choices, batch):
        calls.append((batch, [c.n for c in choices]))
        ratio = 1.2 if faster[batch] else 0.8
        return [Measured(choices[0], 1.0, 10.0, 1.0), Measured(choices[1], ratio, 10.0 * ratio, 1.5)]
    return measure


def test_buckets_are_checked_from_the_largest_until_the_tree_pays():
    calls = []
    out = profiling.check_buckets(_bucket_picks(), _measure_with({8: False, 4: True, 2: True}, calls),
                                  fits=lambda batch: True)
    assert calls == [(8, [1, 2]), (4, [1, 4])]  # 16 serves the target alone already; 2 pays since 4 does
    assert out[8].choice.n == 1 and out[8].model_choice.n == 2  # measured slower: the target alone serves
    assert out[8].measured.measured_speedup == 1.0 and [m.choice.n for m in out[8].candidates] == [1, 2]
    assert out[4].choice.n == 4 and out[4].measured.measured_speedup == pytest.approx(1.2)
    assert out[2].measured is None and out[2].choice.n == 6 and out[16].choice.n == 1  # not measured
    assert out[1].choice.n == 8 and out[1].measured is None  # batch 1: plan_buckets' measured choice, untouched


def test_every_bucket_where_the_tree_loses_serves_the_target_alone():
    calls = []
    out = profiling.check_buckets(_bucket_picks(), _measure_with({8: False, 4: False, 2: False}, calls),
                                  fits=lambda batch: True)
    assert [b for b, _ in calls] == [8, 4, 2]
    assert [out[b].choice.n for b in (1, 2, 4, 8, 16)] == [8, 1, 1, 1, 1]


def test_a_check_that_does_not_fit_is_skipped_and_a_smaller_one_still_runs():
    calls = []
    out = profiling.check_buckets(_bucket_picks(), _measure_with({8: False, 4: False, 2: True}, calls),
                                  fits=lambda batch: batch < 8)
    assert [b for b, _ in calls] == [4, 2]
    assert out[8].measured is None and out[8].choice.n == 2  # unmeasured: the model's pick stays
    assert out[4].choice.n == 1 and out[2].choice.n == 6


def test_a_bucket_check_charges_the_buckets_served_calls(monkeypatch):
    """``bucket_check`` measures at the bucket's batch size, one round of MIN_CHOICE_TOKENS a request, each step
    charged the calls of the bucket's overhead in seconds (target steps x the profile's step time)."""
    from sequoia_ray.hardware import StepOverhead

    seen = []
    monkeypatch.setattr(profiling, "measure_choices", lambda *args, **kw: seen.append((args[2:], kw)) or ["m"])
    picks = _bucket_picks()
    picks[8] = replace(picks[8], overhead=StepOverhead(calls=(0.01, 0.03)))
    pair = SimpleNamespace(target=SimpleNamespace(model="target"), draft=SimpleNamespace(model="draft"))
    measure = profiling.bucket_check(pair, _profile(step_s=0.5), picks, ["prompts"], SamplingParams(max_tokens=99))
    assert measure(["choices"], 8) == ["m"] and measure(["choices"], 4) == ["m"]
    (args8, kw8), (_, kw4) = seen
    assert args8[:2] == (["choices"], ["prompts"]) and args8[2].max_tokens == profiling.MIN_CHOICE_TOKENS
    assert (kw8["batch"], kw8["rounds"], kw8["calls"]) == (8, 1, pytest.approx((0.005, 0.015)))
    assert (kw4["batch"], kw4["calls"]) == (4, (0.0, 0.0))  # no overhead measured for it: measured as in process


def test_check_seconds_counts_prefills_and_both_runs():
    """1 s a target step, T_B(B) = 1 with the fake profile: B prompts of 10 tokens prefilled by the target
    alone's run (1 s each) and by the tree's run (1 s, and 0.5 s in the draft) plus (1 + 1.5) x 16 root-only
    steps."""
    prof = replace(_profile(), c={1: 0.5, 32: 0.5})
    assert profiling.check_seconds(prof, 1.0, 4, 10) == pytest.approx(4 * 2.5 + 2.5 * 16 * prof.target_cost(4, 4))
    assert profiling.check_seconds(prof, 2.0, 4, 10) == pytest.approx(2 * profiling.check_seconds(prof, 1.0, 4, 10))


def test_prefill_is_each_models_forward_over_the_prompt():
    """t(n) and c(n) at the prompt's length, in proportion to the largest profiled n beyond it."""
    prof = replace(_profile(step_s=0.1), t={1: 1.0, 16: 2.0, 32: 4.0}, c={1: 0.25, 32: 0.5})
    assert profiling._prefill_s(prof, 16, draft=False) == pytest.approx(0.1 * 2.0)
    assert profiling._prefill_s(prof, 24) == pytest.approx(0.1 * (3.0 + 0.25 + 0.25 * 23 / 31))
    assert profiling._prefill_s(prof, 64) == pytest.approx(0.1 * (8.0 + 1.0))  # twice the largest n: twice


def test_unmeasured_picks_charge_the_served_calls_when_they_can_be_timed():
    """No time to run trees: the model's choice per bucket, charged the actor calls a served step makes, timed on
    the overhead's probe tree. 0.5 target steps of calls a request for a tree step (the target alone's: none):
    uncharged, buckets 1-8 speculate (16 cannot: 16 tokens profiled); charged, every tree predicts less and bucket
    8 serves the target alone."""
    table = solve(AcceptanceVector.from_p([0.9, 0.05]), 16, 6)
    prof = HardwareProfile("cpu-x-2c", {1: 1.0, 2: 1.0, 4: 1.05, 8: 1.1, 16: 1.2}, {1: 0.05, 16: 0.1}, 0.5, 64,
                           "float32")
    seen = []

    def calls(plan, *, sampled):  # seconds: 0.25 s of 0.5 s target steps
        seen.append((plan.n, sampled))
        return 0.0, 0.25

    free = profiling.unmeasured_picks(table, prof, (1, 2, 4, 8, 16), sampled=False)
    charged = profiling.unmeasured_picks(table, prof, (1, 2, 4, 8, 16), calls=calls, sampled=True)
    assert all(p.overhead is None for p in free.values()) and [free[b].choice.n > 1 for b in BATCH_BUCKETS] == [
        True, True, True, True, False]
    probe, _ = profiling._probe(table, prof, free[1].choice)  # the model's batch-1 tree, if the overhead batches fit it
    assert seen == [(probe.n, True)]  # timed once
    assert all(p.overhead.calls == (0.0, 0.5) and p.measured is None for p in charged.values())
    assert all(charged[b].choice.predicted_speedup < free[b].choice.predicted_speedup for b in (1, 2, 4, 8))
    assert charged[8].choice.n == 1 and charged[4].choice.n > 1


def test_the_overhead_probe_runs_only_at_batches_whose_draft_levels_were_profiled():
    """t to 128 tokens, c to 8 wide (no batch tables): the batch-1 choice (32 nodes, a level 8 wide) fits t at
    batch 4 (4 x 32 tokens) but not c (4 x 8 = 32 wide): it was probed at batch 4 all the same, the overhead fitted
    on a step no plan could be. The smaller tree is probed instead, at every batch that can be costed."""
    from sequoia_ray.hardware import choose
    from sequoia_ray.tree.plan import carried_leaf

    sizes = (1, 2, 4, 8, 16, 32, 64, 128)
    prof = HardwareProfile("hw", {s: 1 + 0.003 * (s - 1) for s in sizes},
                           {w: 0.05 * (1 + 0.003 * (w - 1)) for w in (1, 2, 4, 8)}, 0.1, 64, "float32")
    table = solve(AcceptanceVector.from_p([0.45, 0.2, 0.1, 0.05]), 128, 6)
    first = choose(table, prof, sizes)[0]
    assert first.n > 8 and not prof.can_cost(first.plan, 4, first.carried)
    probe, batches = profiling._probe(table, prof, first)
    assert probe.n <= 8 and batches == (1, 4)
    assert all(prof.can_cost(probe, b, carried_leaf(probe, table.acceptance)) for b in batches)


@pytest.mark.parametrize("field, value, message", [("max_depth", 1, "max_depth 1 leaves no level for a draft token"),
                                                   ("budgets", (1,), r"budgets \(1,\) hold no tree with a draft")])
def test_a_profile_job_with_no_room_for_a_tree_is_refused_up_front(field, value, message):
    """max_depth = 1 or budgets = (1,) passed validation, and the job then died after profiling, in the overhead
    probe (a DPError: no 2-node tree in the table). No plan of such a job could be more than the target alone, so
    the config is refused, naming the field and the fix; the smallest room for a tree is accepted and probed."""
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match=message):
        ProfileJobConfig(storage="/tmp/unused", **{field: value})
    cfg = ProfileJobConfig(storage="/tmp/unused", budgets=(2,), max_depth=2)
    assert cfg.budgets == (1, 2)
    t = {1: 1.0, 2: 1.01, 4: 1.02, 8: 1.05, 16: 1.1}
    prof = HardwareProfile("x", t, {w: 0.05 for w in t}, 0.1, 64, "float32")
    table = solve(AcceptanceVector.from_p([0.8, 0.1]), max(cfg.budgets), cfg.max_depth)
    plan, batches = profiling._probe(table, prof, profiling.choose(table, prof, cfg.budgets)[0])
    assert plan.n == 2 and batches


def test_the_profile_job_publishes_and_plans_on_a_non_decreasing_profile(tmp_path, monkeypatch):
    """``run_trial`` fits its profile as the bounded one does (``monotone``): a noisy size that timed cheaper than
    a smaller one made the DP favour bigger trees for free (t(8) < t(4) below)."""
    from types import SimpleNamespace

    from sequoia_ray.config import ProfileJobConfig
    from sequoia_ray.hardware import HardwareProfile
    from sequoia_ray.plan_store import PlanStore

    noisy = HardwareProfile("cpu-test", {1: 1.0, 4: 1.3, 8: 1.1, 16: 1.6}, {1: 0.2, 2: 0.18}, 0.1, 64, "float32")
    monkeypatch.setattr(profiling, "profile", lambda *args, **kwargs: noisy)
    monkeypatch.setattr(profiling, "check_noise", lambda prof, bound: None)

    def stop(cfg, pair, prompts, temperature, progress):  # the first use of the profile after publishing it
        raise StopIteration

    monkeypatch.setattr(profiling, "_acceptance", stop)
    pair = SimpleNamespace(encode=lambda text, chat: [1, 2], draft=SimpleNamespace(model=None),
                           target=SimpleNamespace(model=None), time_target=None)
    cfg = ProfileJobConfig(storage=str(tmp_path / "store"), temperatures=(0.0,))
    with pytest.raises(StopIteration):
        profiling.run_trial(cfg, "cpu-test", progress=False, pair=pair)
    published = PlanStore(cfg.storage).fetch_profile("cpu-test")
    assert list(published.t.values()) == sorted(published.t.values()) and published.t[1] == 1.0
    assert published.t[4] == published.t[8] and published.c[1] == published.c[2]  # pooled violators


def test_a_plan_made_with_a_given_acceptance_vector_says_so(tmp_path, monkeypatch):
    """With ``--acceptance 0=0.8,0.1`` the plan's provenance claimed p measured on every prompt (``prompts`` 2,
    ``tokens_measured`` 48 in a smoke run); p came from the job's input, measured on nothing here."""
    from sequoia_ray.tree.plan_file import ACCEPTANCE_FILE

    prof = HardwareProfile("cpu-test", {1: 1.0, 2: 1.02, 4: 1.05, 8: 1.1}, {1: 0.1, 2: 0.1, 4: 0.11, 8: 0.12}, 0.01,
                           64, "float32", noise=0.01, drift=0.01)
    monkeypatch.setattr(profiling, "profile", lambda *args, **kwargs: prof)
    monkeypatch.setattr(profiling, "validate", lambda pair, best, prompts, temperature, tokens: (1.2, 2.0))
    model = SimpleNamespace(device="cpu")
    pair = SimpleNamespace(encode=lambda text, chat: [1, 2], draft=SimpleNamespace(model=model),
                           target=SimpleNamespace(model=None), time_target=None)
    cfg = ProfileJobConfig(storage=str(tmp_path / "store"), temperatures=(0.0,), budgets=(1, 2, 4, 8),
                           acceptance={0.0: "0.8,0.1"})
    profiling.run_trial(cfg, "cpu-test", progress=False, pair=pair)
    planned, _ = PlanStore(cfg.storage).fetch_plan(PlanKey("cpu-test", cfg.draft, cfg.target, 0.0))
    prov = planned.provenance
    assert (prov.source, prov.prompts, prov.tokens_measured) == (ACCEPTANCE_FILE, 0, 0)
    assert planned.acceptance.rows == AcceptanceVector.parse("0.8,0.1").rows


def test_the_results_table_lines_up_and_shows_a_dash_where_nothing_was_measured():
    """A hardware id longer than the header's 28 characters pushed its rows out of line, and unmeasured cells
    printed "nan" (new-user walkthrough)."""
    from sequoia_ray.profiling import TrialResult, format_results

    hw = "cpu-Intel-R-Xeon-R-Processor-avx512bf16-2c"
    rows = [TrialResult(hw, 0.0, 8, 4, 3.1, 1.9, math.nan, math.nan, "p", "q"),
            TrialResult(hw, 0.6, 16, 6, 3.4, 2.1, 1.8, 3.0, "p", "q", batch=2, step_s=0.1, throughput=68.0)]
    lines = format_results(rows).splitlines()
    assert len({len(line) for line in lines}) == 1, lines  # header, rule and rows of one width
    cells = lines[2].split()  # hardware T B n d G step tok/s pred meas tok/step model
    assert "nan" not in lines[2] and [cells[i] for i in (6, 7, 9, 10)] == ["-"] * 4 and cells[8] == "1.90"
