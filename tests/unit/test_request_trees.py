"""RequestTrees: each request's own p̂[1] picks its tree from the family the cost model solves."""

from __future__ import annotations

import threading

import pytest

from sequoia_ray.config import SamplingParams
from sequoia_ray.draft import DraftWorker
from sequoia_ray.engine import ROOT_ONLY, SpeculativeDecoder
from sequoia_ray.hardware import HardwareProfile
from sequoia_ray.request_trees import RequestTrees, tilt
from sequoia_ray.target import TargetWorker
from sequoia_ray.tree.acceptance_vector import AcceptanceVector
from sequoia_ray.tree.planning import plan_for
from sequoia_ray.verify import Verdict
from tests.tiny import agreeing_pair

SIZES = (1, 2, 4, 8, 16, 32)
P = (0.7, 0.1, 0.05)


def profile(**batched) -> HardwareProfile:
    """t(n) = 1 + 0.01·(n - 1), a draft level 0.05 of a target step: depth is cheap, so acceptance decides.
    ``batched``: ``batch_t`` / ``batch_c``, what a batch's steps cost."""
    t = {n: 1 + 0.01 * (n - 1) for n in SIZES}
    return HardwareProfile("test-hw", t, {w: 0.05 * v for w, v in t.items()}, 0.1, 64, "float32", **batched)


def trees(prof=profile(), **kw) -> RequestTrees:
    planned, _ = plan_for(AcceptanceVector.from_p(P), 8, 4)
    return RequestTrees(planned, prof, **kw)


@pytest.mark.parametrize("q", [0.0, 0.3, 0.7, 0.95])
def test_tilt_moves_rank_one_and_keeps_the_law_after_it(q):
    v = tilt(P, q)
    assert v.rows[0][0] == pytest.approx(q)
    assert sum(v.rows[0]) + v.reject[0] == pytest.approx(1.0)
    rest = [x / (1 - q) for x in (*v.rows[0][1:], v.reject[0])]  # the law after rank 1 is rejected
    assert rest == pytest.approx([x / (1 - P[0]) for x in (*P[1:], 1 - sum(P))])
    assert tilt((1.0, 0.0), 0.4).rows[0] == (0.4, 0.0)


def test_the_estimate_starts_at_the_served_p1_and_follows_the_request():
    family = trees(grid=0.05, prior_weight=4)
    assert family.level(0, 0) * 0.05 == pytest.approx(0.7)
    assert family.level(40, 40) * 0.05 == pytest.approx(0.95)  # (2.8 + 40) / 44 = 0.97 -> capped below 1
    assert family.level(0, 40) == 1  # 2.8 / 44 = 0.064 -> 0.05
    with pytest.raises(ValueError, match="grid"):
        trees(grid=0.0)
    unweighted = trees(grid=0.05, prior_weight=0, min_trials=0)  # the request's own counts only
    assert unweighted.level(0, 0) * 0.05 == pytest.approx(0.7)  # none yet: the served p[1]
    assert unweighted.level(3, 10) * 0.05 == pytest.approx(0.3)


def feed(policy, rank: int, steps: int) -> None:
    for _ in range(steps):
        policy.observe(None, Verdict([0], [1], ((3, rank), (2, rank))), 0.1)


@pytest.mark.parametrize("grid", [0.05, 0.1, 0.2, 0.3, 0.5])
def test_a_request_that_accepts_everything_stays_below_one(grid):
    """p̂[1] -> 1 rounds to the last grid step below 1, never to 1 (tilt needs q < 1): with 0.05, round(19.98)
    was 20 and every such request's policy failed."""
    family = trees(grid=grid)
    level = family.level(10_000, 10_000)
    assert level * grid < 1.0 and (level + 1) * grid >= 1.0 - 1e-12
    assert family.tree(level, 1).n >= 1


def test_a_confident_request_gets_a_deeper_tree_and_an_unsure_one_a_shallower():
    family = trees(min_trials=4)
    base = family.planned.plan
    sure, unsure = family.policy(SamplingParams()), family.policy(SamplingParams())
    feed(sure, 1, 1)
    assert sure.plan(base) is base  # 2 trials < min_trials: the served plan
    feed(sure, 1, 20)
    feed(unsure, 0, 20)
    deep, shallow = sure.plan(base), unsure.plan(base)
    assert deep.num_levels > base.num_levels > shallow.num_levels
    assert unsure.plan(ROOT_ONLY) is ROOT_ONLY  # the target alone, when chosen, stays
    assert deep == family.tree(family.level(42, 42), 1)  # cached: one tree per (level, bucket)


def test_without_a_profile_every_request_keeps_the_served_plan():
    family = trees(prof=None)
    policy = family.policy(SamplingParams())
    feed(policy, 1, 20)
    assert policy.plan(family.planned.plan) is family.planned.plan


def test_concurrent_requests_share_one_solve_per_level():
    family, out = trees(), []
    threads = [threading.Thread(target=lambda: out.append(family.tree(15, 1))) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(out) == 8 and all(plan is out[0] for plan in out) and len(family._trees) == 1


def test_greedy_text_is_the_target_alones_with_per_request_trees():
    target, draft = agreeing_pair()
    params, prompt = SamplingParams(max_tokens=40, seed=0), [3, 1, 4, 1, 5]
    alone = SpeculativeDecoder(TargetWorker(target), None, ROOT_ONLY).generate(prompt, params)
    family = trees(min_trials=1)
    seen = []
    original = family.tree
    family.tree = lambda level, batch: seen.append(level) or original(level, batch)
    out = SpeculativeDecoder(TargetWorker(target), DraftWorker(draft), family.planned.plan,
                             policy=family.policy).generate(prompt, params)
    assert out.token_ids == alone.token_ids and seen  # the family's trees were used


def test_above_max_batch_every_request_gets_the_buckets_plan():
    """With ``max_batch`` 2 a confident request gets its own (deeper) tree at batch sizes 1-3 (buckets 1, 2)
    and the plan it is given from 4 on (bucket 4); without, at every size."""
    size = {"batch": 1}
    base = trees().planned.plan
    for max_batch, own in ((2, {1: True, 2: True, 3: True, 4: False, 9: False}), (None, dict.fromkeys((1, 4, 9), True))):
        policy = trees(min_trials=4, max_batch=max_batch).policy(SamplingParams(), batch=lambda: size["batch"])
        feed(policy, 1, 20)
        for batch, mine in own.items():
            size["batch"] = batch
            assert (policy.plan(base) is not base) == mine, (max_batch, batch)
    with pytest.raises(ValueError, match="max_batch 0"):
        trees(max_batch=0)


@pytest.mark.parametrize("q", [0.0, 0.2, 0.9])
def test_tilt_of_a_vector_summing_just_above_one(q):
    """A vector may sum to 1 + 1e-6 (round-off in a file); tilted by 1 / (1 - p[1]) the excess grew with
    (1 - q) / (1 - p[1]) and the tilted vector (sum 1.0000016) was refused. It sums to 1 now, rank 1 at q."""
    served = AcceptanceVector.from_dict({"p": [0.95, 0.0500001]})
    v = tilt(served.row(0), q)
    assert v.rows[0][0] == q and sum(v.rows[0]) <= 1.0 + 1e-12
    assert v.rows[0][1] == pytest.approx(1 - q) and v.reject[0] == pytest.approx(0.0, abs=1e-12)


def test_a_request_moved_to_the_target_alone_is_probed_again():
    """A draft level at 0.6 of a target step and 12 rejected rank-1 trials: the cost model gives the request the
    target alone, whose steps carry no trials, so before it stayed there for the rest of the request (1,000 steps
    later still n = 1). Its counts fade on those steps: within 12 steps it gets the served plan again, and a
    text that turned predictable earns its trees back."""
    t = {n: 1 + 0.05 * (n - 1) for n in SIZES}
    slow_draft = HardwareProfile("hw", t, {w: 0.6 * v for w, v in t.items()}, 0.1, 64, "float32")
    family = trees(slow_draft)
    base, policy = family.planned.plan, family.policy(SamplingParams())
    for _ in range(12):
        policy.plan(base)
        policy.observe(base, Verdict([0], [1], ((3, 0),)), 0.1)
    assert policy.plan(base).n == 1
    served = []
    for _ in range(12):
        policy.observe(ROOT_ONLY, Verdict([0], [1], ()), 0.1)
        served.append(policy.plan(base))
    probe = next(i for i, p in enumerate(served) if p is base)  # 12 x 0.9^11 = 3.77 < min_trials 4
    assert probe == 10 and all(p.n == 1 for p in served[:probe])  # 11 steps on the target alone, then a probe
    for _ in range(30):  # the text turned predictable: every rank-1 trial accepted
        policy.observe(base, Verdict([0, 1], [1, 2], ((3, 1), (3, 1))), 0.1)
    assert policy.plan(base).n > 1


def test_a_rank_two_acceptance_is_a_rank_one_failure():
    family = trees(min_trials=4)
    base = family.planned.plan
    twos, zeros = family.policy(SamplingParams()), family.policy(SamplingParams())
    for _ in range(20):
        twos.observe(None, Verdict([0, 2], [5, 6], ((3, 2),)), 0.1)
        zeros.observe(None, Verdict([0], [5], ((3, 0),)), 0.1)
    assert twos.plan(base) == zeros.plan(base)  # rank 2 says nothing good about rank 1


def test_blind_steps_the_request_did_not_choose_do_not_fade_its_estimate():
    family = trees(min_trials=4)
    base = family.planned.plan
    sure = family.policy(SamplingParams())
    for _ in range(20):
        sure.observe(None, Verdict([0, 1], [5, 6], ((3, 1),)), 0.1)
    deep = sure.plan(base)
    assert deep != base
    for _ in range(30):  # e.g. the served bucket's plan is the target alone for a while
        assert sure.plan(ROOT_ONLY) is ROOT_ONLY
        sure.observe(ROOT_ONLY, Verdict([0], [5]), 0.1)
    assert sure.plan(base) == deep


def test_a_requests_tree_is_chosen_for_its_batch_bucket():
    """At batch 8 a tree token costs more here: a request's tree there is smaller than at batch 1 (a family that
    ignored the batch bucket passed, the test profile pricing every bucket alike: a mutation review)."""
    tokens = (8, 16, 32, 64, 128, 256)
    batch_t = {8: {k: 1 + 0.03 * k for k in tokens}}  # at batch 8 every tree token costs: smaller trees pay
    batch_c = {8: {k: 0.05 * (1 + 0.03 * k) for k in tokens}}
    family = trees(profile(batch_t=batch_t, batch_c=batch_c))
    level = family.level(40, 40)
    assert family.tree(level, 8).n < family.tree(level, 1).n
