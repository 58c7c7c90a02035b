"""StepRates: the tree or the target alone per batch bucket (every temperature together), measured on live steps."""

from __future__ import annotations

import time

import pytest

from sequoia_ray.config import SamplingParams
from sequoia_ray.draft import DraftTree, DraftWorker
from sequoia_ray.engine import ROOT_ONLY, SpeculativeDecoder
from sequoia_ray.live_cost import ALONE, FIRST_STEP_PROBES, TREE, CostSettings, StepRates
from sequoia_ray.target import TargetWorker
from sequoia_ray.tree.plan import k_ary
from sequoia_ray.verify import Verdict
from tests.tiny import agreeing_pair

SETTINGS = CostSettings(probe_every=20, probe_rounds=2, window=64, min_steps=2)


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def drive(rates: StepRates, key, batch: int, rounds: int, rate: dict[str, float], clock: FakeClock | None = None
          ) -> list[str]:
    """``rounds`` rounds of ``batch`` interleaved requests, each step taking 1 / rate[arm] s for one token (and
    ``clock`` moving on by the round's longest step); the arm of every step."""
    arms, pending = [], []
    for _ in range(rounds):
        for request in range(batch):
            step = rates.begin(key, batch, request)
            arms.append(step.arm)
            pending.append(step)
        if clock is not None:
            clock.now += max(1.0 / rate[step.arm] for step in pending)
        for step in pending:  # the round's steps end after all of them began
            rates.record(step, 1, 1.0 / rate[step.arm])
        pending.clear()
    return arms


@pytest.mark.parametrize("batch, faster", [(1, TREE), (8, ALONE)])
def test_the_faster_arm_serves_and_the_other_is_probed_rarely(batch, faster):
    rates = StepRates(SETTINGS)
    speed = {TREE: 3.0, ALONE: 2.0} if faster == TREE else {TREE: 0.77, ALONE: 1.0}
    arms = drive(rates, ("t0.0", batch), batch, 300, speed)
    first = (1 + SETTINGS.probe_rounds) * batch * 2  # the tree's phase, then the target alone's
    assert arms[:first] == [TREE] * (first // 2) + [ALONE] * (first // 2)
    share = arms[first:].count(faster) / len(arms[first:])
    bound = 1 - (1 + SETTINGS.probe_rounds) / (SETTINGS.probe_every + 1 + SETTINGS.probe_rounds)
    assert bound - 0.02 <= share < 1  # the other arm is still probed, no more than the stated share
    assert rates.summary()[f"t0.0-b{batch}"]["serving"] == faster


def test_keys_learn_apart_and_follow_a_change():
    rates = StepRates(SETTINGS)
    drive(rates, ("t0.0", 1), 1, 200, {TREE: 3.0, ALONE: 2.0})
    drive(rates, ("t0.0", 8), 8, 200, {TREE: 0.7, ALONE: 1.0})
    summary = rates.summary()
    assert summary["t0.0-b1"]["serving"] == TREE and summary["t0.0-b8"]["serving"] == ALONE
    # the machine changes (the draft got cheaper): the window forgets and the next probes find it
    arms = drive(rates, ("t0.0", 8), 8, 400, {TREE: 1.5, ALONE: 1.0})
    last = arms[-8 * 2 * SETTINGS.probe_every:]  # two served phases' worth: at most two probes of the other
    assert last.count(TREE) >= len(last) - 2 * (1 + SETTINGS.probe_rounds) * 8


def _step(rates: StepRates, key, request, tokens: int | None = None, arm: str | None = None):
    """One step of ``request`` at batch 1, ended with ``tokens`` in 1 s (None: left running)."""
    step = rates.begin(key, 1, request)
    assert arm is None or step.arm == arm
    if tokens is not None:
        rates.record(step, tokens, 1.0)
    return step


@pytest.mark.parametrize("settle", [1, 2, 3])
def test_a_phases_first_settle_rounds_are_not_measured(settle):
    """At batch 2 (a round is 2 steps), the first phase (the tree's) lasts ``settle`` + 2 rounds and measures only
    its last 2 rounds' 4 steps; then the target alone's phase begins."""
    rates, key = StepRates(CostSettings(probe_every=5, probe_rounds=2, window=64, min_steps=1,
                                        settle_rounds=settle)), ("t0.0", 2)
    measured = []
    for i in range(2 * (settle + 2)):
        step = rates.begin(key, 2, f"r{i % 2}")
        assert step.arm == TREE
        measured.append(step.measured)
        rates.record(step, 3, 1.0)
    assert measured == [False] * (2 * settle) + [True] * 4
    assert rates.summary()["t0.0-b2"]["steps"] == {TREE: 4, ALONE: 0}
    assert rates.begin(key, 2, "r0").arm == ALONE


def test_a_step_that_ends_after_its_phase_is_not_measured():
    """Even when the next phase runs the same arm: the target alone's probe wins, and its last step ends after
    the target alone's served phase began."""
    rates, key = StepRates(CostSettings(probe_every=1, probe_rounds=2, window=8, min_steps=1)), ("t0.0", 1)
    for arm, tokens, steps in ((TREE, 5, 3), (ALONE, 1, 3), (TREE, 5, 2)):  # 2 probes; the tree serves (5 > 1)
        for _ in range(steps):
            _step(rates, key, "a", tokens, arm)
    assert rates.summary()["t0.0-b1"]["serving"] == TREE
    _step(rates, key, "a", 0, ALONE)  # the next probe of the target alone: its settle step
    _step(rates, key, "a", 20, ALONE)  # its last 2 phases: 22 tokens in 3 s, now above the tree's 5/s
    late = _step(rates, key, "a", None, ALONE)
    _step(rates, key, "b", None, ALONE)  # the probe has ended: the target alone serves
    assert rates.summary()["t0.0-b1"]["serving"] == ALONE
    rates.record(late, 100, 1.0)  # the same arm beside it, but its phase has ended
    assert rates.summary()["t0.0-b1"]["steps"] == {TREE: 3, ALONE: 3}


def test_a_step_beside_a_step_of_the_other_arm_is_not_measured():
    """A phase's switch reaches the requests one step apart: while ``a`` still runs its tree step, ``b``'s
    target-alone steps share its forwards. Neither counts; steps beside their own kind do. Fails if steps
    of the two arms that overlap are measured."""
    rates, key = StepRates(CostSettings(probe_every=50, probe_rounds=3, window=64, min_steps=1)), ("t0.0", 2)
    settle = [rates.begin(key, 2, r) for r in "ab"]
    for step in settle:
        rates.record(step, 1, 1.0)
    a, b = (rates.begin(key, 2, r) for r in "ab")  # measured tree steps, side by side
    assert (a.arm, b.arm, a.measured, b.measured) == (TREE, TREE, True, True)
    rates.record(b, 3, 1.0)
    for _ in range(4):  # b's tree steps go on beside a's long one, to the end of the tree's probe
        rates.record(rates.begin(key, 2, "b"), 3, 1.0)
    for _ in range(2):  # the target alone's probe: its settle steps
        step = rates.begin(key, 2, "b")
        assert (step.arm, step.measured) == (ALONE, False)
        rates.record(step, 1, 1.0)
    alone = rates.begin(key, 2, "b")
    assert (alone.arm, alone.measured) == (ALONE, True)
    rates.record(alone, 1, 0.5)  # beside a's tree step: not counted
    rates.record(a, 3, 9.0)  # the tree step that straddled the switch (its phase has ended, too)
    assert rates.summary()["t0.0-b2"]["steps"] == {TREE: 5, ALONE: 0}
    both = [rates.begin(key, 2, r) for r in "ab"]  # both on the target alone now: measured
    for step in both:
        rates.record(step, 1, 0.1)
    assert rates.summary()["t0.0-b2"]["steps"] == {TREE: 5, ALONE: 2}


def test_a_step_never_ended_stops_marking_others_once_stale():
    """A request that failed mid-step never ends its step: after ``stale_s`` it no longer keeps the other arm's
    steps from being measured."""
    settings = CostSettings(probe_every=50, probe_rounds=1, window=8, min_steps=1, stale_s=0.2)
    rates, key = StepRates(settings), ("t0.0", 2)
    for request in ("a", "lost", "a", "a"):  # the tree's probe: 2 settle steps, 2 measured
        step = rates.begin(key, 2, request)
        if request == "a":
            rates.record(step, 1, 1.0)  # "lost" never ends its step
    for _ in range(3):  # the target alone's probe: 2 settle steps, then one beside the lost tree step
        step = rates.begin(key, 2, "a")
        assert step.arm == ALONE
        rates.record(step, 1, 1.0)
    assert rates.summary()["t0.0-b2"]["steps"] == {TREE: 2, ALONE: 0}
    time.sleep(0.3)
    rates.record(rates.begin(key, 2, "a"), 1, 1.0)
    assert rates.summary()["t0.0-b2"]["steps"] == {TREE: 2, ALONE: 1}


FIRST_STEP_S = {TREE: 1.2, ALONE: 0.35}  # a request's first step (its prefill): the tree's draft prefills too


def _serve(rates: StepRates, seconds: float, tokens: int = 48) -> dict[str, int]:
    """Two clients, each sending requests of ``tokens`` tokens one after another, in simulated time for
    ``seconds``; each step's cost is fixed when it begins. A request's first step gives 1 token in
    ``FIRST_STEP_S[arm]``, and a step beginning beside it waits as long (beside a prefill: its admission cost). A
    tree step gives 3 tokens in 0.3 s (10 tokens/s), a target-alone step 1 token in 0.11 s (9.1/s). With the
    first steps, a request of 48 tokens takes ~7.1 s with the tree and ~5.9 s with the target alone. Steps
    run per arm."""
    running: dict[str, tuple] = {}  # client -> (end time, seconds, step, tokens, first, beside a first step)
    left = dict.fromkeys("ab", 0)  # client -> tokens its request still generates (0: a new one begins)
    now, runs = 0.0, dict.fromkeys((TREE, ALONE), 0)

    def start(client: str) -> None:
        first = left[client] == 0
        left[client] = left[client] or tokens
        step = rates.begin(("t0.0", 2), 2, client)
        beside_first = any(r[4] for c, r in running.items() if c != client)
        if first or beside_first:
            took, got = FIRST_STEP_S[step.arm], 1
        else:
            took, got = (0.3, 3) if step.arm == TREE else (0.11, 1)
        got = min(got, left[client])
        running[client] = (now + took, took, step, got, first, beside_first)
        runs[step.arm] += 1

    for client in "ab":
        start(client)
    while now < seconds:
        client = min(running, key=lambda c: running[c][0])
        now, took, step, got, first, beside = running.pop(client)
        rates.record(step, got, took, first=first, beside=beside)
        left[client] -= got
        if not left[client]:
            rates.finished("t0.0", tokens)
        start(client)
    return runs


def test_the_arm_with_the_cheaper_first_steps_wins_when_they_outweigh_its_slower_steps():
    """The tree's steps are faster (10 against 9.1 tokens/s) but its first steps cost 1.2 s against 0.35, and
    48-token requests see about two each: the target alone serves ~1.2x more, and is served (1200 simulated
    s, ~10000 steps); the tree runs at most its probes' share of the steps. Fails if the first steps are
    left out: then the tree measures faster and serves."""
    rates = StepRates(SETTINGS)
    runs = _serve(rates, 1200.0)
    summary = rates.summary()["t0.0-b2"]
    assert summary["serving"] == ALONE, summary
    assert summary["first_step_s"] == pytest.approx(FIRST_STEP_S, rel=0.01)
    assert runs[TREE] < 0.15 * (runs[TREE] + runs[ALONE]), runs


def _lockstep(rates: StepRates, seconds: float, batch: int = 8) -> dict[str, int]:
    """``batch`` clients in lockstep, in simulated time: every round each request steps once, and the round
    lasts the arm's cycle: a tree step gives 4 tokens in 1.5 s (2.67 tokens/s), a target-alone step 1 token in
    0.45 s (2.22/s). A request of 40-54 tokens ends and a new one joins: its first step gives 1 token in a
    whole cycle (the prefill, root-only), and the others' steps beside it take 0.1 s longer. The steps run
    per arm."""
    left, done, runs, now = [0] * batch, [0] * batch, dict.fromkeys((TREE, ALONE), 0), 0.0
    sizes = iter(40 + (7 * i) % 15 for i in range(10**6))
    while now < seconds:
        firsts = [n == 0 for n in left]
        steps = [rates.begin(("t0.0", batch), batch, client) for client in range(batch)]
        cycle = 1.5 if steps[0].arm == TREE else 0.45
        for client, (step, first) in enumerate(zip(steps, firsts)):
            left[client] = left[client] or next(sizes)
            got = min(left[client], 1 if first else 4 if step.arm == TREE else 1)
            beside = any(firsts) and not first
            rates.record(step, got, cycle + (0.1 if beside else 0.0), first=first, beside=beside)
            left[client] -= got
            runs[step.arm] += 1
            done[client] += got
            if not left[client]:
                rates.finished("t0.0", done[client])
                done[client] = 0
        now += cycle + (0.1 if any(firsts) else 0.0)
    return runs


def test_in_lockstep_a_first_step_is_charged_its_excess_not_a_whole_cycle_per_request():
    """In lockstep a joining request's first step lasts a whole cycle of the batch (1.5 s with the tree, 0.45
    without), while the other requests' steps beside it take 0.1 s longer. The tree gives ~2.4 tokens/s a
    request with its admissions, the target alone ~2.1: the tree serves (1500 simulated s, ~12000 steps). Fails
    when each request is charged the batch's B first steps (B x 1.5 s against B x 0.45 s: the target alone then
    measures faster), as it was."""
    rates = StepRates(SETTINGS)
    runs = _lockstep(rates, 1500.0)
    summary = rates.summary()["t0.0-b8"]
    assert summary["serving"] == TREE, summary
    assert summary["first_step_s"] == pytest.approx({TREE: 1.5, ALONE: 0.45}, rel=0.01)
    assert runs[ALONE] < 0.15 * (runs[TREE] + runs[ALONE]), runs


def test_admission_costs_count_once_requests_have_ended_with_their_length():
    """A request's length L comes from the requests that ended. While none has, the arms are judged on their
    steps alone (counting each running request at its tokens so far, the first requests of a burst looked ~5
    tokens long and their admissions outweighed steps 2.5x faster). Then an arm's rate r counts as L / (L / r
    + X), X its first steps' and beside steps' excess over r per request admitted: here the tree's steps give
    4 tokens/s and its one first step 1 token in 2 s (excess 1.75 s), the target alone 2 tokens/s with a first
    step at its rate and a step beside a prefill 0.5 s slower."""
    rates, key = StepRates(CostSettings(probe_every=20, probe_rounds=4, window=64, min_steps=2)), ("t0.0", 1)
    steps = {TREE: [(1, 0.25, False, False), (1, 2.0, True, False), (4, 1.0, False, False), (4, 1.0, False, False),
                    (4, 1.0, False, False)],
             ALONE: [(1, 0.25, False, False), (1, 0.5, False, False), (1, 0.5, True, False), (1, 1.0, False, True),
                     (1, 0.5, False, False)]}
    for arm in (TREE, ALONE):  # the first phase probes the tree (1 settling step + 4), the second the target alone
        for i, (tokens, seconds, first, beside) in enumerate(steps[arm]):
            step = rates.begin(key, 1, f"{arm}{i}")
            assert step.arm == arm
            rates.record(step, tokens, seconds, first=first, beside=beside)
    summary = rates.summary()["t0.0-b1"]
    assert summary["tok_s"] == summary["step_tok_s"] == {TREE: 4.0, ALONE: 2.0}  # no request has ended
    assert summary["admission_s"] == {TREE: None, ALONE: None}
    rates.finished("t0.0", 6)
    rates.finished("t0.0", 10)  # L = 8
    summary = rates.summary()["t0.0-b1"]
    assert summary["tok_s"] == pytest.approx({TREE: 8 / (8 / 4 + 1.75), ALONE: 8 / (8 / 2 + 0.5)}, abs=1e-3)
    assert summary["step_tok_s"] == {TREE: 4.0, ALONE: 2.0}  # the steps' own rates, and what admitting adds:
    assert summary["admission_s"] == pytest.approx({TREE: 1.75, ALONE: 0.5}, abs=1e-3)


def test_a_first_request_alone_runs_mostly_the_faster_tree_while_the_first_step_probes_wait():
    """A fresh service's one request (the main job's demo): its first step is the tree's, and no request begins
    in the target alone's probes. Those probes come after short served phases of the tree (probe_every // 8 =
    12 rounds), not back to back: of its first 48 steps at most 12 run the target alone — the first probe and
    two more (back to back, 40 did). The probes for first steps stop after FIRST_STEP_PROBES."""
    rates, key = StepRates(CostSettings()), ("t0.0", 1)
    arms = []
    for i in range(400):
        step = rates.begin(key, 1, "only")
        arms.append(step.arm)
        rates.record(step, 3 if step.arm == TREE else 1, 0.3 if step.arm == TREE else 0.11, first=i == 0)
    assert arms[:4] == [TREE] * 4 and arms[4:8] == [ALONE] * 4  # the first two probes measure both arms
    assert arms[:48].count(ALONE) <= 12, arms[:48]
    probes = sum(1 for i in range(1, 400) if arms[i] == ALONE and arms[i - 1] == TREE)
    assert probes == 1 + FIRST_STEP_PROBES, probes  # then one per probe_every rounds: none more in 400 steps
    assert rates.summary()["t0.0-b1"]["serving"] == TREE


@pytest.mark.parametrize("bad", [{"probe_every": 0}, {"probe_rounds": 0}, {"settle_rounds": 0}, {"window": 0},
                                 {"min_steps": 0}, {"stale_s": 0}, {"wide": -0.1}, {"wide": 1.5}])
def test_settings_are_checked(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        CostSettings(**bad)


class _Timed:
    """Draft and target in one: a tree step takes 20 ms for 2 tokens, a root-only step 2 ms for 1."""

    def start(self, *args) -> None: ...
    def finish(self, *args) -> None: ...

    def grow(self, request_id, plan, commits=()) -> DraftTree:
        import torch

        return DraftTree(torch.arange(plan.n), {})

    def verify(self, request_id, plan, draft) -> Verdict:
        time.sleep(0.02 if plan.n > 1 else 0.002)
        return Verdict([0, 1], [4, 5], ((3, 1),)) if plan.n > 1 else Verdict([0], [6], ())


class _BesidePrefills(_Timed):
    """The target alone takes 2 ms a step, but every other one of its steps shares its forward with another
    request's prefill and takes 60 ms; a tree step takes 20 ms for 2 tokens and never meets a prefill."""

    alone_steps = 0

    def verify(self, request_id, plan, draft) -> Verdict:
        if plan.n > 1:
            return super().verify(request_id, plan, draft)
        self.alone_steps += 1
        beside = self.alone_steps % 2 == 0
        time.sleep(0.06 if beside else 0.002)
        return Verdict([0], [6], (), prefill_beside=256 if beside else 0)


def test_steps_beside_another_requests_prefill_are_not_measured():
    """Counting the prefill-slowed steps, the target alone would measure ~32 tokens/s against the tree's ~100
    and lose; without them it measures ~500 and serves (80 tokens, probes of 2 steps). The bound is "faster",
    not a ratio: 2 ms sleeps on a loaded host overshoot by as much again."""
    rates, fake = StepRates(CostSettings(probe_every=10, probe_rounds=2, window=256, min_steps=2)), _BesidePrefills()
    SpeculativeDecoder(fake, fake, k_ary(2, 2), policy=rates.policy).generate(
        [1], SamplingParams(max_tokens=80, seed=0, ignore_eos=True))
    summary = rates.summary()["all-b1"]
    assert summary["serving"] == ALONE and summary["tok_s"][ALONE] > summary["tok_s"][TREE], summary
    assert 0 < summary["steps"][ALONE] <= fake.alone_steps // 2  # at most the half not beside a prefill


def test_the_engine_measures_cycles_and_moves_to_the_target_alone_when_it_is_faster():
    rates, fake = StepRates(CostSettings(probe_every=10, probe_rounds=2, window=32, min_steps=2)), _Timed()
    decoder = SpeculativeDecoder(fake, fake, k_ary(2, 2), policy=rates.policy)
    out = decoder.generate([1], SamplingParams(max_tokens=80, seed=0, ignore_eos=True))
    summary = rates.summary()["all-b1"]
    assert summary["serving"] == ALONE and summary["tok_s"][ALONE] > summary["tok_s"][TREE], summary
    assert summary["first_step_s"][TREE] > 0 and summary["first_step_s"][ALONE] is None  # its one request's
    steps_alone = out.token_ids.count(6)  # a step of the target alone gives token 6, a tree step 4, 5
    steps_tree = (len(out.token_ids) - steps_alone) // 2
    assert steps_alone > 2 * steps_tree, (steps_alone, steps_tree)


def test_a_bucket_whose_plan_is_the_target_alone_has_nothing_to_choose():
    """The planner published the target alone for the bucket: every step is root-only, and no key appears
    (before, the key's "tree" arm was that root-only plan, never measured, and reported as speculating)."""
    target, draft = agreeing_pair()
    params = SamplingParams(max_tokens=12, seed=0, ignore_eos=True)
    rates = StepRates(SETTINGS)
    out = SpeculativeDecoder(TargetWorker(target), DraftWorker(draft), ROOT_ONLY, policy=rates.policy).generate(
        [3, 1, 4], params)
    alone = SpeculativeDecoder(TargetWorker(target), None, ROOT_ONLY).generate([3, 1, 4], params)
    assert out.token_ids == alone.token_ids and out.stats.steps == 12
    assert rates.summary() == {}


def test_greedy_text_is_the_target_alones_whatever_the_arms():
    target, draft = agreeing_pair()
    params = SamplingParams(max_tokens=40, seed=0)
    alone = SpeculativeDecoder(TargetWorker(target), None, ROOT_ONLY).generate([3, 1, 4, 1, 5], params)
    rates = StepRates(CostSettings(probe_every=2, probe_rounds=1, window=4, min_steps=1))  # switches often
    mixed = SpeculativeDecoder(TargetWorker(target), DraftWorker(draft), k_ary(2, 3), policy=rates.policy)
    out = mixed.generate([3, 1, 4, 1, 5], params)
    assert out.token_ids == alone.token_ids
    steps = rates.summary()["all-b1"]["steps"]
    assert steps[TREE] > 0 and steps[ALONE] > 0  # both arms ran


@pytest.mark.parametrize("smaller_faster, first", [(ALONE, ALONE), (TREE, TREE), (None, TREE)])
def test_a_larger_batch_starts_with_the_arm_a_smaller_one_found_faster(smaller_faster, first):
    """The target alone faster at batch 2 (both arms measured): batch 4 serves it first and probes the tree
    only after ``probe_every`` rounds; the tree faster, or batch 2 not measured yet: batch 4 starts with the
    tree. The other temperature learns on its own."""
    rates = StepRates(SETTINGS)
    if smaller_faster is not None:
        speed = {TREE: 3.0, ALONE: 2.0} if smaller_faster == TREE else {TREE: 0.7, ALONE: 1.0}
        drive(rates, ("t0.0", 2), 2, 60, speed)
        assert rates.summary()["t0.0-b2"]["serving"] == smaller_faster
    else:
        drive(rates, ("t0.0", 2), 2, 1, {TREE: 0.7, ALONE: 1.0})  # the tree's phase has not ended
    arms = drive(rates, ("t0.0", 4), 4, SETTINGS.probe_every + 4, {TREE: 0.7, ALONE: 1.0})
    if first == ALONE:
        served = 4 * (1 + SETTINGS.probe_every)  # the settle round and probe_every rounds, all the target alone
        assert arms[:served] == [ALONE] * served and arms[served:] == [TREE] * (len(arms) - served)
    else:
        assert arms[:4 * (1 + SETTINGS.probe_rounds)] == [TREE] * 4 * (1 + SETTINGS.probe_rounds)
    assert drive(rates, ("t0.6", 4), 4, 1, {TREE: 0.7, ALONE: 1.0}) == [TREE] * 4


def test_a_served_arm_that_turns_slower_is_left_before_its_phase_ends():
    """The tree measures faster on its probe, then slows (through Serve at 2 clients: 6 fast steps, then
    0.77x the target alone): the served tree phase ends after a probe's worth of slow steps, not after
    ``probe_every`` rounds; the target alone is probed, then serves."""
    rates, key, batch = StepRates(SETTINGS), ("t0.0", 2), 2
    probes = 2 * batch * (1 + SETTINGS.probe_rounds)  # the tree's probe, then the target alone's
    arms = drive(rates, key, batch, probes // batch, {TREE: 3.0, ALONE: 2.0})
    assert arms == [TREE] * (probes // 2) + [ALONE] * (probes // 2)
    arms = drive(rates, key, batch, SETTINGS.probe_every, {TREE: 0.5, ALONE: 2.0})
    switched = arms.index(ALONE)
    # the settle round and the slow rounds that bring the tree's windowed rate below the target alone's
    assert batch * (1 + SETTINGS.probe_rounds) <= switched < batch * SETTINGS.probe_every // 2
    assert arms[switched:].count(TREE) == 0 and rates.summary()["t0.0-b2"]["serving"] == ALONE


@pytest.mark.parametrize("b1, b2, first", [
    (TREE, ALONE, ALONE),  # the nearest smaller bucket decides, not any
    (ALONE, TREE, TREE),
    (ALONE, None, ALONE),  # b2 has only its tree measured: the nearest with both arms is b1
])
def test_the_nearest_smaller_bucket_with_both_arms_measured_decides(b1, b2, first):
    rates = StepRates(SETTINGS)
    speeds = {TREE: {TREE: 3.0, ALONE: 2.0}, ALONE: {TREE: 0.7, ALONE: 1.0}}
    drive(rates, ("t0.0", 1), 1, 40, speeds[b1])
    if b2 is None:
        drive(rates, ("t0.0", 2), 2, 1 + SETTINGS.probe_rounds, speeds[ALONE])  # one arm's steps only
        assert sorted(rates.summary()["t0.0-b2"]["steps"].values()) == [0, 2 * SETTINGS.probe_rounds]
    else:
        drive(rates, ("t0.0", 2), 2, 40, speeds[b2])
    assert drive(rates, ("t0.0", 4), 4, 1, speeds[ALONE]) == [first] * 4


def test_a_served_target_alone_that_turns_slower_has_the_tree_probed_again():
    """The other way round: the target alone serves, then its steps slow down (a longer context, another
    load on the host); the tree is probed again before ``probe_every`` rounds, and serves."""
    rates, key, batch = StepRates(SETTINGS), ("t0.0", 1), 1
    drive(rates, key, batch, 2 * (1 + SETTINGS.probe_rounds), {TREE: 1.0, ALONE: 2.0})  # both probes
    arms = drive(rates, key, batch, SETTINGS.probe_every, {TREE: 1.0, ALONE: 0.25})
    probed = arms.index(TREE)
    assert SETTINGS.probe_rounds <= probed < SETTINGS.probe_every // 2
    assert rates.summary()["t0.0-b1"]["serving"] == TREE


def _runs(arms: list[str]) -> list[tuple[str, int]]:
    """``arms`` as (arm, consecutive steps) runs."""
    runs: list[tuple[str, int]] = []
    for arm in arms:
        runs[-1:] = [(arm, runs[-1][1] + 1)] if runs and runs[-1][0] == arm else [*runs[-1:], (arm, 1)]
    return runs


def test_probes_that_confirm_the_served_arm_back_off_and_a_winning_probe_resets_it():
    """The tree stays faster: each served phase after a confirming probe lasts twice the one before (the
    settle step, then 20, 40, 80, 80 rounds with ``backoff`` 4), each probe 1 + ``probe_rounds`` steps. Then
    the target alone turns faster: the next probes find it (its rate over its last 2 phases), it serves, and
    its served phases start again at ``probe_every``. (``wide`` 0: every confirming probe doubles, however wide
    its loss; the next test covers ``wide``.)"""
    settings = CostSettings(probe_every=20, probe_rounds=2, window=64, min_steps=2, backoff=4, wide=0.0)
    rates, key = StepRates(settings), ("t0.0", 1)
    runs = _runs(drive(rates, key, 1, 6 + 21 + 3 + 41 + 3 + 81 + 3 + 81 + 3 + 81, {TREE: 3.0, ALONE: 2.0}))
    probe = 1 + settings.probe_rounds
    assert runs == [(TREE, probe), (ALONE, probe), (TREE, 21), (ALONE, probe), (TREE, 41), (ALONE, probe),
                    (TREE, 81), (ALONE, probe), (TREE, 81), (ALONE, probe), (TREE, 81)]
    runs = _runs(drive(rates, key, 1, 3 + 21 + 3 + 41 + 3, {TREE: 3.0, ALONE: 10.0}))
    # the probe after the change: the target alone's last 2 phases (2.0 then 10.0 tok/s) give 3.3 > 3.0;
    # it serves (a run with its probe), probe_every rounds first, then twice that after the tree's probe
    assert runs == [(ALONE, probe + 21), (TREE, probe), (ALONE, 41), (TREE, probe)]


@pytest.mark.parametrize("alone, served", [(2.0, [21, 81, 81]), (2.4, [21, 41, 81])])
def test_a_probe_that_loses_widely_backs_off_fully_at_once(alone, served):
    """The tree serves at 3.0 tok/s. A target alone at 2.0 (0.67x, below ``wide`` 0.7) lost widely: after its
    first confirming probe the served phase is ``backoff`` x ``probe_every`` at once. At 2.4 (0.8x) it doubles
    (20, 40, 80 rounds, plus the settle step)."""
    settings = CostSettings(probe_every=20, probe_rounds=2, window=64, min_steps=2, backoff=4, wide=0.7)
    rates, key = StepRates(settings), ("t0.0", 1)
    probe = 1 + settings.probe_rounds
    runs = _runs(drive(rates, key, 1, 2 * probe + sum(served) + 2 * probe, {TREE: 3.0, ALONE: alone}))
    assert runs == [(TREE, probe), (ALONE, probe), (TREE, served[0]), (ALONE, probe), (TREE, served[1]),
                    (ALONE, probe), (TREE, served[2])]


def test_a_served_phase_that_ends_early_resets_the_backoff():
    """A served arm that turns slower ends its backed-off phase early; the probe then confirms it after all
    (the other arm is slower still), and the next served phase is twice ``probe_every`` (backoff from 1
    again), not twice the backed-off one. (``wide`` 0: the probes' losses here are wide.)"""
    settings = CostSettings(probe_every=20, probe_rounds=2, window=64, min_steps=2, backoff=4, wide=0.0)
    rates, key = StepRates(settings), ("t0.0", 1)
    drive(rates, key, 1, 6 + 21 + 3 + 41 + 3, {TREE: 3.0, ALONE: 2.0})  # served phase 3 (81 steps) begins
    slow = 0
    while drive(rates, key, 1, 1, {TREE: 0.5, ALONE: 2.0}) == [TREE]:
        slow += 1
    assert slow < 40  # left early (the probe's settle step has begun)
    assert drive(rates, key, 1, settings.probe_rounds, {TREE: 3.0, ALONE: 0.1}) == [ALONE] * settings.probe_rounds
    runs = _runs(drive(rates, key, 1, 41 + 1, {TREE: 3.0, ALONE: 2.0}))
    assert runs == [(TREE, 41), (ALONE, 1)]


def test_probes_shorter_than_min_steps_still_measure_both_arms():
    """One measured step a probe (``probe_rounds`` 1 at batch 1) and ``min_steps`` 3: an arm's rate reaches
    back over older phases until it has 3 steps, so both arms get measured and the faster serves (judged on
    the last two phases only, the tree would stay "not measured enough" and be probed for ever)."""
    rates = StepRates(CostSettings(probe_every=1, probe_rounds=1, window=64, min_steps=3))
    arms = drive(rates, ("t0.0", 1), 1, 40, {TREE: 1.0, ALONE: 2.0})
    assert arms.count(ALONE) > arms.count(TREE) > 0
    assert rates.summary()["t0.0-b1"]["serving"] == ALONE


@pytest.mark.parametrize("max_age_s, served", [(10.0, 38), (0.0, 81)])
def test_the_other_arms_rate_ages_and_is_probed_again(max_age_s, served):
    """The tree (4 tokens/s, a step 0.25 s) beats the target alone (2/s) widely, so after the first served
    phase (``probe_every`` rounds and the settle step) the served phases back off to ``backoff`` x
    ``probe_every`` (80 rounds, plus the settle step) at once. With ``max_age_s`` 10 the target alone is probed
    again once its last step began 10 s ago: after its 0.5 s and 38 tree steps of 0.25 s, whatever the
    backoff; with 0 the phase runs its 81 steps."""
    settings = CostSettings(probe_every=20, probe_rounds=2, window=64, min_steps=2, backoff=4, max_age_s=max_age_s)
    clock = FakeClock()
    rates, key = StepRates(settings, clock), ("t0.0", 1)
    probe = 1 + settings.probe_rounds
    runs = _runs(drive(rates, key, 1, 5 * probe + 21 + 3 * served, {TREE: 4.0, ALONE: 2.0}, clock))
    assert runs == [(TREE, probe), (ALONE, probe), (TREE, 21), (ALONE, probe)] + [(TREE, served), (ALONE, probe)] * 2 + [
        (TREE, served)]
    summary = rates.summary()["t0.0-b1"]
    assert summary["serving"] == TREE and summary["age_s"][TREE] == 0.0
    assert summary["age_s"][ALONE] == pytest.approx(served * 0.25, abs=0.1)  # its probe ended before the tree's run


def test_an_arm_measured_slow_early_is_found_faster_once_its_rate_ages():
    """Session 24 through Serve at 8 clients: the target alone's rate inside the tree's run was measured once,
    early and slow, and never again while the tree served. Here the target alone is first measured at 0.6
    tokens/s a request (the tree 1.0), then runs at 1.6. After the first served tree phase (20 rounds of 1 s
    and the settle round) its probe's rate over its last 2 phases mixes the slow one in (0.87 < 1.0): the tree
    serves on, backed off to 40 rounds. With ``max_age_s`` 30 the target alone is probed again after 30 of them,
    measures 1.6 on both phases and serves; without the age the tree's phase runs on."""
    for max_age_s, serves in ((30.0, ALONE), (0.0, TREE)):
        settings = CostSettings(probe_every=20, probe_rounds=2, window=512, min_steps=2, backoff=4,
                                max_age_s=max_age_s)
        clock = FakeClock()
        rates, key, batch = StepRates(settings, clock), ("t0.0", 8), 8
        probe = 1 + settings.probe_rounds
        drive(rates, key, batch, 2 * probe, {TREE: 1.0, ALONE: 0.6}, clock)
        arms = _runs(drive(rates, key, batch, 21 + probe + 30 + probe + 1, {TREE: 1.0, ALONE: 1.6}, clock))
        assert arms[:2] == [(TREE, 21 * batch), (ALONE, probe * batch)]
        # with the age: 30 rounds of the tree, a probe, then the target alone; without: the tree to the end
        assert arms[2:] == ([(TREE, 30 * batch), (ALONE, (probe + 1) * batch)] if max_age_s else [(TREE, 34 * batch)])
        assert rates.summary()["t0.0-b8"]["serving"] == serves


def test_a_phase_changes_only_between_rounds_so_a_round_runs_one_arm():
    """Lockstep rounds whose batch changes: 3 requests, then a fourth joins, later two leave. The first phase
    (the tree's, settle 1 + 1 round at batch 3: 6 steps) ends inside the round the fourth request joined, at
    its fourth step; that step still runs the tree and the next round the target alone. Over 60 rounds every
    round's steps ran one arm (each arm several times), and the arms still alternate as the phases say."""
    rates, key = StepRates(CostSettings(probe_every=2, probe_rounds=1, window=64, min_steps=1)), ("t0.0", 4)
    members = [["r0", "r1", "r2"]] + [["r0", "r1", "r2", "r3"]] * 30 + [["r1", "r3"]] * 29
    rounds = []
    for k, requests in enumerate(members):
        steps = [rates.begin(key, len(requests), r) for r in requests]
        for step in steps:
            rates.record(step, 2 if step.arm == TREE else 1, 1.0)
        rounds.append([step.arm for step in steps])
    assert rounds[0] == [TREE] * 3 and rounds[1] == [TREE] * 4 and rounds[2] == [ALONE] * 4
    assert all(len(set(arms)) == 1 for arms in rounds), rounds
    assert {arms[0] for arms in rounds} == {TREE, ALONE}
    assert sum(a[0] != b[0] for a, b in zip(rounds, rounds[1:])) >= 4  # phases still change


def test_a_probe_whose_steps_go_unmeasured_does_not_start_a_probe_storm():
    """The tree (4 tokens/s) serves, the target alone (2/s) is probed; from t = 300 s every target-alone step is
    beside a prefill (not a sample), so its newest measured step stops moving. The age counted from that step:
    once it was ``max_age_s`` old, every served phase ended for a probe as soon as its settle step was done,
    and the slower arm ran 78% of the steps. Counted from the target alone's last run, a probe comes once per
    ``max_age_s`` (180 s): 4 steps (settle 1 + probe 3) in 180, 2.2%."""
    clock = FakeClock()
    rates, key = StepRates(CostSettings(probe_every=100, probe_rounds=3, max_age_s=180.0), clock), ("t0.0", 1)
    start, late = clock.now, []
    for _ in range(4_000):
        step = rates.begin(key, 1, "r")
        if clock.now - start > 400:
            late.append(step.arm)
        beside = step.arm == ALONE and clock.now - start > 300
        rates.record(step, 4 if step.arm == TREE else 2, 1.0, beside=beside)
        clock.now += 1.0
    assert late.count(ALONE) / len(late) < 0.03
    assert rates.summary()["t0.0-b1"]["serving"] == TREE


def test_requests_of_two_temperatures_in_one_batch_run_one_arm_and_keep_measuring():
    """A greedy and a sampled request share the batch. Keyed by temperature, the greedy one's key served the tree
    and the sampled one's the target alone: every round ran both arms (the batch split), each key's steps beside
    the other arm, so neither measured again, and when the sampled request's tree became 2x faster (round 1,000
    of 3,000) the target alone still served it. One key per batch bucket: no round is split, and the tree serves
    after the change (the pooled rate: the batch's tokens over its seconds)."""
    clock = FakeClock()
    rates = StepRates(CostSettings(probe_every=100, probe_rounds=3, settle_rounds=2), clock=clock)
    speed = {0.0: {TREE: (3, 1.0), ALONE: (1, 0.5)}, 0.6: {TREE: (1, 1.0), ALONE: (1, 0.5)}}  # (tokens, s) a step
    arms = {t: rates.policy(SamplingParams(temperature=t), batch=lambda: 2) for t in speed}
    tree, split, served = k_ary(2, 2), 0, []
    for round_ in range(3000):
        if round_ == 1000:
            speed[0.6][TREE] = (4, 1.0)
        plans = {t: arm.plan(tree) for t, arm in arms.items()}
        kinds = {t: TREE if p.n > 1 else ALONE for t, p in plans.items()}
        split += len(set(kinds.values())) > 1
        served.append(kinds[0.6])
        clock.now += max(speed[t][k][1] for t, k in kinds.items())
        for t, arm in arms.items():
            tokens, seconds = speed[t][kinds[t]]
            arm.observe(plans[t], Verdict(list(range(tokens)), [7] * tokens), seconds)
    assert split == 0
    assert served[-500:].count(TREE) > 450, served[-500:].count(TREE)  # the faster tree serves (probes aside)
    assert set(rates.summary()) == {"all-b2"}


def test_the_request_length_is_the_latest_requests_mean():
    """L was the mean since the start: 3,000 requests of 8 tokens, then 300 of 40, still read ~11 tokens."""
    rates, key = StepRates(CostSettings(probe_every=20, probe_rounds=4, window=64, min_steps=2)), ("all", 1)
    for arm in (TREE, ALONE):  # both arms measured, with a first step each (so admissions are charged)
        for i in range(5):
            step = rates.begin(key, 1, f"{arm}{i}")
            rates.record(step, 1, 0.5, first=i == 1)
    for tokens, count in ((8, 3000), (40, 300)):
        for _ in range(count):
            rates.finished("all", tokens)
    assert rates._request_tokens(rates._keys[key]) == 40.0


def test_an_admissions_excess_is_taken_against_the_rate_it_was_measured_at():
    """Against the current rate, every first step measured while the host was 2x slower read as excess once it sped
    up (the tree 0.93 s an admission where it cost 0.25). Each event keeps the excess over the rate of its time."""
    rates, key = StepRates(CostSettings(probe_rounds=10, window=64, min_steps=2)), ("all", 1)
    for i in range(6):  # the tree's first phase; the host slow: 1 token a second, a first step 0.25 s more
        step = rates.begin(key, 1, f"a{i}")
        assert step.arm == TREE
        rates.record(step, 1, 1.25 if i == 5 else 1.0, first=i == 5)
    state = rates._keys[key]
    assert rates._admission(state, TREE, 2.0) == pytest.approx(0.25)  # as measured: 1.25 - 1 / 1.0, not 1.25 - 0.5


def test_a_served_arm_within_its_noise_of_the_other_is_not_cut_short():
    """``_losing`` runs at every round of a served phase: with a plain "below", the noisier arm's phase ended on
    its first dip (a review's simulation, batch 1, the tree 1 + Poisson(2) tokens a step at 1.05x the target
    alone's rate: the tree served 27% of the steps over 8 seeds; with the margin 64%, and unchanged where one arm
    is 5% or 20% faster for sure). The tree's steps (1, 5, 2 tokens in 1 s each: 2.67 tokens/s, standard error
    1.20) against the target alone's 3.03 (no spread): 0.36 below, within 2 standard errors, goes on; steps of
    1 token a second each (no spread) end the phase."""
    from collections import deque

    from sequoia_ray.live_cost import LOSING_Z, _Key

    rates = StepRates(CostSettings(probe_rounds=3))
    state = _Key(("all", 1), arm=TREE, probing=False, phase=5, recorded=3)
    state.samples[ALONE] = deque([(1, 0.33, 4)] * 3)
    state.samples[TREE] = deque([(1, 1.0, 5), (5, 1.0, 5), (2, 1.0, 5)])
    rate, error = state.rate_error(TREE, 3, 2)
    assert rate == pytest.approx(8 / 3) and error == pytest.approx((13 ** 0.5) / 3)
    assert 1 / 0.33 - rate < LOSING_Z * error and not rates._losing(state, 1)
    state.samples[TREE] = deque([(1, 1.0, 5)] * 3)
    assert state.rate_error(TREE, 3, 2) == (1.0, 0.0) and rates._losing(state, 1)
