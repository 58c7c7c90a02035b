"""Issue 12, item 1-2: the per-step overhead in the cost model (measured on real lockstep steps), the noise
bound on a profile, and the measured choice among the model's best trees."""

from __future__ import annotations

import math

import pytest

from sequoia_ray.config import SamplingParams
from sequoia_ray import hardware
from sequoia_ray.hardware import (Choice, HardwareProfile, ProfileError, StepOverhead, check_noise,
                                  choose, profile, relative_noise, round_drift, timed_rounds)
from sequoia_ray.measured_choice import Measured, measure_choices, pick, top_candidates
from sequoia_ray.overhead import fit_linear, measure_overhead
from sequoia_ray.tree.acceptance_vector import AcceptanceVector
from sequoia_ray.tree.dp import solve
from sequoia_ray.tree.plan import carried_leaf, chain, from_nested
from tests.tiny import agreeing_pair

BUDGETS = (1, 2, 4, 8, 16, 32, 64)


def flat(per_token: float = 0.01) -> HardwareProfile:
    """t(n) = 1 + per_token·(n - 1) alone and in every batch (B requests of s tokens: t(B·s)), c = 0.05·t."""
    t = {n: 1 + per_token * (n - 1) for n in BUDGETS}
    rows = {b: {b * s: 1 + per_token * (b * s - 1) for s in BUDGETS if b * s <= 64} for b in (2, 4, 8, 16)}
    return HardwareProfile("test-hw", t, {w: 0.05 * v for w, v in t.items()}, 0.1, 64, "float32",
                           batch_t=rows, batch_c={b: {k: 0.05 * v for k, v in r.items()} for b, r in rows.items()})


TABLE = solve(AcceptanceVector.from_p([0.7, 0.1, 0.05]), 64, 8)


def test_overhead_is_fixed_plus_per_request_and_adds_to_the_step():
    over = StepOverhead(alone=(0.1, 0.02), tree=(0.3, 0.05), calls=(0.01, 0.04))
    assert over.of(1, False) == pytest.approx(0.1 + 0.02 + 0.01)
    assert over.of(8, True) == pytest.approx(0.3 + 8 * (0.05 + 0.04))  # every request makes its own calls
    prof, plan = flat(), TABLE.tree(8, 4)
    assert prof.step_cost(plan, 4, over) == pytest.approx(prof.step_cost(plan, 4) + over.of(4, True))
    assert prof.step_cost(chain(0), 4, over) == pytest.approx(prof.step_cost(chain(0), 4) + over.of(4, False))
    assert StepOverhead.from_dict(over.to_dict()) == over


@pytest.mark.parametrize("bad", [{"tree": [1.0]}, {"alone": ["x", 1]}, {"calls": [math.inf, 0]}, [1, 2]])
def test_a_malformed_overhead_names_its_fields(bad):
    with pytest.raises(ProfileError, match="overhead"):
        StepOverhead.from_dict(bad)


def test_a_tree_overhead_moves_the_choice_to_smaller_trees_and_the_prediction_down():
    prof = flat()
    free, _ = choose(TABLE, prof, BUDGETS)
    costly, _ = choose(TABLE, prof, BUDGETS, overhead=StepOverhead(tree=(0.5, 0.0)))
    assert free.n > 1 and costly.predicted_speedup < free.predicted_speedup
    # with the overhead, the predicted speedup is G·(1 + O_alone) / (forwards + O_tree): recomputed by hand
    # (the first draft level carries the last tree's accepted leaf: carried_leaf)
    assert costly.carried == pytest.approx(carried_leaf(costly.plan, TABLE.acceptance)) and costly.carried > 0
    forwards = prof.step_cost(costly.plan, carried=costly.carried)
    assert costly.predicted_speedup == pytest.approx(costly.expected_tokens / (forwards + 0.5))


def test_a_per_request_overhead_makes_the_target_alone_win_at_large_batches_only():
    """Issue 11: speculation that stops paying as the batch grows. Each request's tree costs 0.15 target
    steps of walk and drawing per step: at batch 1 a tree still pays, at batch 16 the target alone wins."""
    prof, over = flat(per_token=0.02), StepOverhead(tree=(0.0, 0.15))
    one, _ = choose(TABLE, prof, BUDGETS, batch=1, overhead=over)
    sixteen, _ = choose(TABLE, prof, BUDGETS, batch=16, overhead=over)
    assert one.n > 1 and one.predicted_speedup > 1
    assert sixteen.n == 1 and sixteen.predicted_speedup == pytest.approx(1.0)
    assert choose(TABLE, prof, BUDGETS, batch=16)[0].n > 1  # without the overhead it would still speculate


def test_fit_linear_goes_through_both_batches_and_clamps_at_zero():
    assert fit_linear({1: 0.3, 4: 0.9}) == pytest.approx((0.1, 0.2))
    assert fit_linear({1: 0.5, 4: 0.2}) == pytest.approx((0.5, 0.0))  # less per request at 4: none
    assert fit_linear({1: -0.2, 4: 0.4}) == pytest.approx((0.0, 0.1))  # forwards over-predicted: never below 0
    assert fit_linear({1: 0.007, 4: 0.036}) == pytest.approx((0.0, 0.009))  # through 0 and the largest batch's
    assert fit_linear({1: -0.3, 4: -0.1}) == (0.0, 0.0)
    assert fit_linear({1: 0.4}) == (0.4, 0.0)


def test_relative_noise_is_the_median_relative_mad():
    samples = {"a": [1.0, 1.1, 0.9], "b": [2.0, 2.0, 2.0], "c": [10.0, 13.0, 10.0]}
    # a: MAD 0.1 / 1.0; b: 0; c: MAD 0 (two of three equal) -> median of (0.1, 0, 0) = 0
    assert relative_noise(samples) == pytest.approx(0.0)
    assert relative_noise({"a": [1.0, 1.2, 0.8], "b": [1.0, 1.5, 0.5]}) == pytest.approx((0.2 + 0.5) / 2)
    assert math.isnan(relative_noise({"a": [1.0]}))


def test_a_noisy_profile_is_refused_with_the_bound_and_the_fix():
    prof = HardwareProfile("hw", {1: 1.0}, {1: 0.1}, 0.1, 64, "float32", noise=0.3, drift=0.0)
    check_noise(prof, 0.35)
    with pytest.raises(ProfileError, match=r"noise 30% exceeds the bound 20%.*quieter machine.*--max-noise.*now 0.2\)"):
        check_noise(prof, 0.2)


@pytest.mark.parametrize("noise, drift, name", [(math.nan, 0.0, "noise"), (0.0, math.nan, "drift between rounds")])
def test_a_profile_whose_noise_was_not_measured_is_refused(noise, drift, name):
    """nan passed every bound (``nan > bound`` is False): a tensor-parallel group's profile, which measured neither,
    went through ``check_noise`` unread, however noisy its timings."""
    prof = HardwareProfile("hw-tp2", {1: 1.0}, {1: 0.1}, 0.1, 64, "float32", noise=noise, drift=drift)
    with pytest.raises(ProfileError, match=rf"profile of hw-tp2: timing {name} is nan \(not measured"):
        check_noise(prof, 0.25)
    with pytest.raises(ProfileError, match="is nan"):
        check_noise(prof, math.inf)  # not even the smoke test's bound lets it through


def test_a_target_timed_as_a_group_measures_its_noise_and_drift(monkeypatch):
    """A tensor-parallel target is timed by its ranks (``time_target``): it is now timed a round per call, so the
    profile carries a noise and a drift that ``check_noise`` can judge (they were nan)."""
    factors = [1.0, 1.1, 0.9]  # the group's speed in each round
    calls = []

    def time_target(sizes, context, repeats):
        calls.append((tuple(sizes), context, repeats))
        return {n: factors[len(calls) - 1] * 0.1 * (1 + 0.1 * n) for n in sizes}

    monkeypatch.setattr(hardware, "time_forward", lambda model, widths, *, context, repeats: {w: 0.01 for w in widths})
    prof = profile(None, object(), hardware="hw-tp2", budgets=(1, 2, 4), widths=(1, 2), context=8, repeats=3,
                   time_target=time_target, retries=0)
    assert calls == [((1, 2, 4), 8, 1)] * 3  # one call a round, every size once
    # per size: repeats (1, 1.1, 0.9)·x -> relative MAD 0.1; the draft's widths: 0. Median of (.1, .1, .1, 0, 0)
    assert prof.noise == pytest.approx(0.1)
    assert prof.drift == pytest.approx(1.1 / 0.9 - 1)  # round factors (1, 1.1, 0.9) over the target's sizes
    assert prof.t == pytest.approx({1: 1.0, 2: 1.2 / 1.1, 4: 1.4 / 1.1}) and prof.batch_t == {}
    assert prof.target_step_s == pytest.approx(0.9 * 0.11)  # the quiet (fastest) round
    with pytest.raises(ProfileError, match="drift between rounds 22% exceeds the bound 15%"):
        check_noise(prof, 0.15)


def test_noise_round_trips_and_a_missing_noise_loads_as_nan(tmp_path):
    prof = HardwareProfile("hw", {1: 1.0, 4: 1.2}, {1: 0.1}, 0.1, 64, "float32", noise=0.04)
    prof.save(tmp_path / "p.json")
    assert HardwareProfile.load(tmp_path / "p.json").noise == pytest.approx(0.04)
    old = prof.to_dict()
    del old["noise"]
    assert math.isnan(HardwareProfile.from_dict(old).noise)
    unmeasured = HardwareProfile("hw", {1: 1.0}, {1: 0.1}, 0.1, 64, "float32")
    assert unmeasured.to_dict()["noise"] is None  # JSON has no NaN


def test_round_drift_sees_a_step_change_that_the_mad_does_not():
    # 12 things timed in 3 rounds; the machine halves its speed after the first round
    step = {k: [1.0 + k, 2.0 * (1.0 + k), 2.0 * (1.0 + k)] for k in range(12)}
    assert relative_noise(step) == pytest.approx(0.0)  # two of three repeats agree everywhere
    assert round_drift(step) == pytest.approx(1.0)  # round factors 0.5, 1, 1
    jitter = {k: [1.0 + k, (1.0 + k) * (1.1 if k % 2 else 0.9), 1.0 + k] for k in range(12)}
    assert round_drift(jitter) < 0.15 < round_drift({k: [1.0, 1.2, 1.0] for k in range(3)})
    assert math.isnan(round_drift({"a": [1.0]}))
    # an anchor's extra repeats (``timed_rounds``) follow its per-round ones and belong to no round
    assert round_drift({"a": [1.0, 2.0], "b": [1.0, 2.0, 9.0, 9.0]}) == pytest.approx(1.0)


def test_timed_rounds_times_the_anchor_again_after_every_few_functions():
    calls = []
    steps = {k: (lambda k=k: calls.append(k) or float(len(calls))) for k in "abcdefg"}
    rounds = timed_rounds(steps, repeats=2, warmup=0, anchor="a", every=3)
    assert calls == list("abcadefag") * 2  # after c and f, not after the round's last
    assert rounds["a"] == [1.0, 10.0, 4.0, 8.0, 13.0, 17.0]  # its own per round first, then the extras
    assert [len(v) for k, v in rounds.items() if k != "a"] == [2] * 6
    assert timed_rounds(steps, repeats=1, warmup=0)["a"] == [19.0]  # no anchor: one per round


def _rounds(slow_after: int | None) -> dict:
    """``profile``'s rounds for t(1, 2) and c(1, 2), the machine 2x slower from round ``slow_after`` on."""
    base = {("t", 1, 1): 0.1, ("t", 1, 2): 0.1, ("c", 1, 1): 0.01, ("c", 1, 2): 0.012}
    return {k: [v * (2 if slow_after is not None and i >= slow_after else 1) for i in range(3)] for k, v in base.items()}


def test_a_drifting_profile_is_timed_again_and_the_calm_timing_kept(monkeypatch):
    attempts = [_rounds(slow_after=1), _rounds(slow_after=None)]
    monkeypatch.setattr(hardware, "_time_all", lambda *a, **k: attempts.pop(0))
    prof = profile(object(), object(), hardware="hw", budgets=(1, 2), widths=(1, 2), context=8, repeats=3)
    assert not attempts  # timed twice
    assert prof.drift == pytest.approx(0.0) and prof.target_step_s == pytest.approx(0.1)
    assert prof.c == pytest.approx({1: 0.1, 2: 0.12})


def test_a_profile_still_drifting_keeps_its_least_drifting_timing_and_is_refused(monkeypatch):
    second = {k: [1.5 * x for x in v] for k, v in _rounds(slow_after=2).items()}  # drifts as much: the first is kept
    attempts = [_rounds(slow_after=1), second]
    monkeypatch.setattr(hardware, "_time_all", lambda *a, **k: attempts.pop(0))
    prof = profile(object(), object(), hardware="hw", budgets=(1, 2), widths=(1, 2), context=8, repeats=3)
    assert not attempts and prof.drift == pytest.approx(1.0)
    assert prof.target_step_s == pytest.approx(0.1)  # the first timing's fastest of (0.1, 0.2, 0.2); not 0.15
    with pytest.raises(ProfileError, match=r"drift between rounds 100% exceeds the bound 25%.*--max-noise"):
        check_noise(prof, 0.25)
    monkeypatch.setattr(hardware, "_time_all", lambda *a, **k: _rounds(slow_after=1))
    calls = []
    monkeypatch.setattr(hardware, "round_drift", lambda rounds: calls.append(1) or 1.0)
    profile(object(), object(), hardware="hw", budgets=(1, 2), widths=(1, 2), context=8, repeats=3, retries=0)
    assert len(calls) == 1  # retries=0: timed once


def test_drift_round_trips_and_a_missing_drift_loads_as_nan(tmp_path):
    prof = HardwareProfile("hw", {1: 1.0, 4: 1.2}, {1: 0.1}, 0.1, 64, "float32", noise=0.04, drift=0.07)
    prof.save(tmp_path / "p.json")
    assert HardwareProfile.load(tmp_path / "p.json").drift == pytest.approx(0.07)
    old = prof.to_dict()
    del old["drift"]
    assert math.isnan(HardwareProfile.from_dict(old).drift)
    assert HardwareProfile("hw", {1: 1.0}, {1: 0.1}, 0.1, 64, "float32").to_dict()["drift"] is None


@pytest.fixture(scope="module")
def models():
    return agreeing_pair()


PROMPTS = [[3, 14, 15, 92, 65], [35, 89, 79, 32, 38, 46]]


def test_profile_measures_its_noise(models):
    prof = profile(*models, hardware="hw", budgets=(1, 2, 4), widths=(1, 2), context=8, repeats=3)
    assert 0 <= prof.noise < 10 and 0 <= prof.drift < 10


def test_measured_overhead_is_the_steps_time_outside_the_forwards(models):
    target, draft = models
    prof = profile(target, draft, hardware="hw", budgets=(1, 2, 4, 8, 16, 32), widths=(1, 2, 4, 8, 16, 32),
                   context=8, repeats=2, batches=(4,))
    plan = from_nested([[[[]], []], [[]], []])
    # one run a (kind, batch): every step's time outside is under its step's, so the medians keep that order (with
    # more runs the median outside and the quietest run's step can come from runs at different host speeds)
    m = measure_overhead(target, draft, prof, plan, PROMPTS, SamplingParams(max_tokens=10), repeats=1)
    assert set(m.outside) == set(m.step_s) == {(k, b) for k in ("alone", "tree") for b in (1, 4)}
    for key, seconds in m.step_s.items():
        assert 0 < m.outside[key] < seconds / prof.target_step_s  # part of the step, never all of it
    for kind, (fixed, per_request) in (("alone", m.overhead.alone), ("tree", m.overhead.tree)):
        assert (fixed, per_request) == pytest.approx(fit_linear({b: m.outside[kind, b] for b in (1, 4)}))
        assert fixed >= 0 and per_request >= 0


def test_top_candidates_are_the_target_alone_and_distinct_trees_by_prediction():
    _, candidates = choose(TABLE, flat(), BUDGETS)
    picked = top_candidates(candidates, 3)
    assert picked[0].n == 1 and len(picked) == 4
    assert len({c.plan.parents for c in picked}) == 4
    ranked = sorted((c for c in candidates if c.n > 1), key=lambda c: -c.predicted_speedup)
    assert picked[1].predicted_speedup == pytest.approx(ranked[0].predicted_speedup)
    assert all(a.predicted_speedup >= b.predicted_speedup for a, b in zip(picked[1:], picked[2:]))


def _choice(n: int, predicted: float) -> Choice:
    return Choice(n, 2, 1.0, predicted, chain(min(n, 2) - 1))


def test_pick_is_the_fastest_measured_not_the_best_predicted():
    measured = [Measured(_choice(1, 1.0), 1.0, 10.0, 1.0), Measured(_choice(8, 2.0), 1.3, 13.0, 2.0),
                Measured(_choice(4, 1.8), 1.5, 15.0, 1.8)]
    assert pick(measured).choice.n == 4
    assert pick(measured[:1]).choice.n == 1


def test_pick_passes_over_a_run_with_no_rate():
    """A run with no timed step holding its whole batch has no rate (NaN): ``max`` kept one met first, so a NaN
    root-only baseline was always picked. None with a rate is an error naming the fix."""
    nan = math.nan
    measured = [Measured(_choice(1, 1.0), 1.0, nan, 1.0), Measured(_choice(8, 2.0), nan, 13.0, 2.0),
                Measured(_choice(4, 1.8), nan, 12.0, 1.8)]
    assert pick(measured).choice.n == 8
    with pytest.raises(ValueError, match="none of 1 measured trees had a timed step.*measure_tokens"):
        pick(measured[:1])


def test_measure_choices_runs_each_tree_and_measures_over_the_target_alone(models):
    target, draft = models
    _, candidates = choose(TABLE, flat(), (1, 2, 4, 8))
    choices = top_candidates(candidates, 2)
    measured = measure_choices(target, draft, choices, PROMPTS, SamplingParams(max_tokens=8), batch=2, rounds=2)
    assert [m.choice for m in measured] == choices
    assert measured[0].measured_speedup == 1.0 and measured[0].tokens_per_step == 1.0
    assert all(m.tokens_per_s > 0 for m in measured) and max(m.tokens_per_step for m in measured[1:]) > 1
    with pytest.raises(ValueError, match="root-only"):
        measure_choices(target, draft, choices[1:], PROMPTS, SamplingParams(max_tokens=8), batch=1, rounds=1)


def test_a_measured_run_is_charged_its_served_calls_per_request_and_step_and_not_its_tails_seconds():
    """Two runs' timed steps: 0.1 + 0.1 s holding 2 and 1 requests, 0.3 s holding 3; 4 + 2 + 9 tokens. The
    first run's second step is its tail (a request has left): its seconds are not counted, its tokens are (15
    tokens over 6 request-steps). Each request of each counted step pays 0.05 s of calls: 5 request-steps in
    0.4 + 0.05 * 5 s."""
    from sequoia_ray.lockstep import LockstepRun
    from sequoia_ray.measured_choice import _Runs

    runs = _Runs(None, None, chain(1), [], SamplingParams(), call_s=0.05)
    runs.done = [LockstepRun(8, (0.1, 0.1), (2, 1), (4, 2), 2.0), LockstepRun(12, (0.3,), (3,), (9,), 3.0)]
    assert runs.tokens_per_s == pytest.approx(15 / 6 * 5 / 0.65)
    runs.call_s = 0.0
    assert runs.tokens_per_s == pytest.approx(15 / 6 * 5 / 0.4)


def test_a_measured_batch_of_fast_and_slow_requests_reads_what_serving_with_refill_gives():
    """A batch of 2: a code request at 4 tokens a step and a prose one at 2, 16 tokens each, 1 s a step. Served
    with the batch refilled (code and prose in turn), a slot spends 4 steps on code and 8 on prose: 32 tokens
    in 12 slot-steps, 2 x 32 / 12 = 5.33 tokens/s. The steps until code finished read 6 tokens/s (12.5% high;
    a review's sampled mix: 7.6%); the target alone (every request 1 token a step) reads 2 either way."""
    from sequoia_ray.lockstep import LockstepRun
    from sequoia_ray.measured_choice import _Runs

    runs = _Runs(None, None, chain(1), [], SamplingParams())
    runs.done = [LockstepRun(32, (1.0,) * 8, (2,) * 4 + (1,) * 4, (6,) * 4 + (2,) * 4, 32 / 12)]
    assert runs.tokens_per_s == pytest.approx(2 * 32 / 12)
    runs.done = [LockstepRun(32, (1.0,) * 16, (2,) * 16, (2,) * 16, 1.0)]
    assert runs.tokens_per_s == pytest.approx(2.0)


@pytest.mark.parametrize("calls", [(0.0,), (-0.001, 0.0), (0.0, math.nan), (0.0, math.inf)])
def test_measure_choices_refuses_unusable_call_times(models, calls):
    target, draft = models
    _, candidates = choose(TABLE, flat(), (1, 2, 4, 8))
    with pytest.raises(ValueError, match="actor calls"):
        measure_choices(target, draft, top_candidates(candidates, 1), PROMPTS, SamplingParams(max_tokens=8), batch=1,
                        rounds=1, calls=calls)


def test_served_calls_dear_enough_make_the_measured_choice_the_target_alone(tmp_path, monkeypatch):
    """A tree's served step charged 5 s of calls a request (the target alone's: none): a tree step keeps at most
    d + 1 tokens, so every tree measured runs at most (d + 1) / 5 tokens/s, and the measured choice at batch 1 is
    the target alone, whatever the model predicted (in process the tiny agreeing pair's trees run hundreds of
    tokens/s)."""
    from sequoia_ray.config import ProfileJobConfig
    from sequoia_ray import profiling
    from sequoia_ray.local import LocalPair
    from sequoia_ray.profiling import plan_buckets

    pair = LocalPair.tiny(device="cpu")
    prof = profile(pair.target.model, pair.draft.model, hardware="hw", budgets=(1, 2, 4, 8, 16), widths=(1, 2, 4, 8, 16),
                   context=8, repeats=2, batches=(2,))
    cfg = ProfileJobConfig(storage=str(tmp_path), candidates=1, measure_rounds=1)
    charged = []
    real = profiling.measure_choices

    def measure(*args, calls, **kw):
        charged.append(calls)
        return real(*args, calls=calls, **kw)

    monkeypatch.setattr(profiling, "measure_choices", measure)
    picks = plan_buckets(cfg, pair, prof, TABLE, (1, 2, 4, 8, 16), PROMPTS, SamplingParams(max_tokens=8),
                         measured_buckets=(1,), calls=lambda plan, *, sampled: (0.0, 5.0))
    assert charged == [pytest.approx((0.0, 5.0))]  # seconds, as the probe timed them
    trees = [m for m in picks[1].candidates if m.choice.n > 1]
    assert trees and all(m.tokens_per_s <= (m.choice.d + 1) / 5.0 for m in trees), picks[1].candidates
    assert picks[1].choice.n == 1 and picks[1].measured.choice.n == 1


def test_plan_buckets_measures_the_overhead_and_adds_the_served_calls(tmp_path):
    from sequoia_ray.config import ProfileJobConfig
    from sequoia_ray.local import LocalPair
    from sequoia_ray.profiling import plan_buckets

    pair = LocalPair.tiny(device="cpu")
    prof = profile(pair.target.model, pair.draft.model, hardware="hw", budgets=(1, 2, 4, 8, 16), widths=(1, 2, 4, 8, 16),
                   context=8, repeats=2, batches=(2, 4))
    cfg = ProfileJobConfig(storage=str(tmp_path), candidates=1, measure_rounds=1)
    seen = []

    def calls(plan, *, sampled):
        seen.append((plan.n, sampled))
        return 0.002, 0.005

    picks = plan_buckets(cfg, pair, prof, TABLE, (1, 2, 4, 8, 16), PROMPTS, SamplingParams(max_tokens=8, temperature=0.6),
                         measured_buckets=(1,), calls=calls)
    assert set(picks) == set(prof.buckets()) and seen and seen[0][1] is True
    over = picks[1].overhead
    assert over.calls == pytest.approx((0.002 / prof.target_step_s, 0.005 / prof.target_step_s))
    assert all(p.overhead == over for p in picks.values())
    assert picks[1].measured is not None and len(picks[1].candidates) == 2  # the target alone + 1 tree
    assert all(p.measured is None and p.choice == p.model_choice for b, p in picks.items() if b > 1)
    # every bucket's choice is the model's argmax with that overhead
    for b, p in picks.items():
        if b > 1:
            assert p.choice == choose(TABLE, prof, (1, 2, 4, 8, 16), batch=b, overhead=over)[0]


@pytest.mark.parametrize("t, batch_t, refused", [
    ({1: 1.0, 2: 1.0, 4: 7.58, 8: 7.58}, {}, r"t\(4\) = 7\.58: a forward of 4 tokens timed at more than 4 one-token"),
    ({1: 1.0, 2: 1.1, 4: 1.2}, {2: {2: 1.1, 8: 10.5}}, r"batch 2's T_2\(8\) = 10\.5"),
    ({1: 1.0, 2: 2.4, 4: 4.9, 8: 9.9}, {2: {2: 2.4}}, None),  # at most x·(1 + 25%): compute-bound, within noise
])
def test_a_forward_timed_above_that_many_one_token_forwards_is_refused(t, batch_t, refused):
    """Session 65's main job profiled beside three busy processes: noise 24% passed the 25% bound, t(4) = 7.58 (a
    4-token forward at 7.6 one-token ones: only load between the timings does that), and the plans it published
    served the target alone (1 node, 0.98x) on every later run. x one-token forwards do a forward of x tokens' work."""
    prof = HardwareProfile("hw", t, {1: 0.1}, 0.1, 64, "float32", batch_t=batch_t, noise=0.24, drift=0.07)
    if refused is None:
        check_noise(prof, 0.25)
        return
    with pytest.raises(ProfileError, match=rf"profile of hw: {refused}.*quieter machine.*--max-noise.*now 0\.25\)"):
        check_noise(prof, 0.25)
    check_noise(prof, math.inf)  # the smoke test's bound (tiny models: sub-ms timings, all noise) lets it through
