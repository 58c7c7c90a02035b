"""DynamicRules: the cost model's dynamic-tree thresholds for a tree at a batch size, worked out by hand on small
profiles; the rule a decoder's steps get (``SpeculativeDecoder(dynamic=...)``) and greedy exactness with it."""

from __future__ import annotations

import pytest

from sequoia_ray.config import SamplingParams
from sequoia_ray.draft import DraftWorker
from sequoia_ray.dynamic_rules import DynamicRules
from sequoia_ray.engine import SpeculativeDecoder
from sequoia_ray.hardware import HardwareProfile, StepOverhead
from sequoia_ray.target import TargetWorker
from sequoia_ray.tree.acceptance_vector import AcceptanceVector
from sequoia_ray.tree.plan import carried_leaf, chain, expected_tokens, k_ary
from sequoia_ray.tree.planning import plan_for
from sequoia_ray.tree.plan_file import Provenance
from tests.tiny import noisy_copy, sharpen, tiny_model

T = {1: 1.0, 2: 1.1, 4: 1.2, 8: 1.4, 16: 1.8}
C = {1: 0.3, 2: 0.34, 4: 0.4, 8: 0.5, 16: 0.7}
P = AcceptanceVector.from_p([0.7, 0.2])


def profile(**batch) -> HardwareProfile:
    return HardwareProfile("cpu-test-2c", T, C, 0.1, 64, "float32", **batch)


def test_at_batch_one_the_thresholds_are_the_cost_models():
    """k_ary(2, 2): 7 nodes, inner levels 1 and 2 nodes wide. G = 1 + 0.9 + (0.7 + 0.2)·0.9 = 2.71; the four
    leaves are accepted with 0.9·0.9 = 0.81 in all, tokens the first draft level carries besides the root;
    S = t(7) + c(1.81) + c(2) + overhead = 1.35 + 0.3324 + 0.34 + (0.5 + 0.1) = 2.6224; delta = t(8) - t(7) =
    0.05; c(1) = 0.3."""
    plan, overhead = k_ary(2, 2), StepOverhead(tree=(0.5, 0.1), alone=(9.0, 9.0))
    assert expected_tokens(plan, P) == pytest.approx(2.71)
    rule = DynamicRules(profile(), extend=3).rule(plan, 1, P, overhead)
    per_cost = 2.71 / 2.6224
    assert rule.threshold == pytest.approx(per_cost * 0.05)
    assert rule.level_threshold == pytest.approx(per_cost * 0.3)
    assert rule.extend_bound == pytest.approx(per_cost * 0.35) and rule.extend == 3


def test_in_a_batch_the_step_is_the_batchs_and_a_level_is_shared():
    """B = 2, k_ary(2, 1): 6 tokens in the batch's forward, T_2(6) = 1.225 and delta = T_2(7) - T_2(6) = 0.0375;
    one draft level, a root and 0.9 carried leaves a request: 3.8 nodes wide across the batch, C_2(3.8) = 0.374;
    a level of a node a request C_2(2) = 0.32, a request's share 0.16; G = 1.9 a request."""
    prof = profile(batch_t={2: {2: 1.05, 4: 1.15, 8: 1.3, 16: 1.7, 32: 2.6}},
                   batch_c={2: {2: 0.32, 4: 0.38, 8: 0.45, 16: 0.6, 32: 0.8}})
    rules = DynamicRules(prof)
    rule = rules.rule(k_ary(2, 1), 2, P)
    per_cost = 2 * 1.9 / (1.225 + 0.374)
    assert rule.threshold == pytest.approx(per_cost * 0.0375)
    assert rule.level_threshold == pytest.approx(per_cost * 0.16) and rule.extend == 0
    assert rules.rule(k_ary(2, 1), 3, P) is rule  # batch 3 runs bucket 2's costs; computed once


def test_in_a_batch_a_level_beyond_the_plan_costs_a_whole_forward():
    """The same B = 2 step with extend 2: a node on an extra level pays delta + c(1) = 0.0375 + 0.3, the one-node
    forward the other request waits for, not its share of a shared level (0.16). At B = 8 (24 tokens: T_8(24) =
    1.8, delta 0.025; the level 15.2 nodes wide: C_8(15.2) = 0.54) the bound is 8·1.9 / 2.34 · 0.325 = 2.11, above
    1: no path is sure enough to extend, while alone (B = 1: t(3) = 1.15, c(1.9) = 0.336, delta 0.05) the same
    plan extends paths worth more than 1.9 / 1.486 · 0.35 = 0.45."""
    prof = profile(batch_t={2: {2: 1.05, 4: 1.15, 8: 1.3, 16: 1.7, 32: 2.6}, 8: {8: 1.4, 16: 1.6, 32: 2.0}},
                   batch_c={2: {2: 0.32, 4: 0.38, 8: 0.45, 16: 0.6, 32: 0.8}, 8: {8: 0.45, 16: 0.55, 32: 0.7}})
    rules = DynamicRules(prof, extend=2)
    two = rules.rule(k_ary(2, 1), 2, P)
    assert two.extend_bound == pytest.approx(2 * 1.9 / (1.225 + 0.374) * (0.0375 + 0.3))
    assert two.level_threshold == pytest.approx(2 * 1.9 / (1.225 + 0.374) * 0.16)  # in-plan levels: a share
    eight = rules.rule(k_ary(2, 1), 8, P)
    assert eight.extend_bound == pytest.approx(8 * 1.9 / (1.8 + 0.54) * (0.025 + 0.3)) and eight.extend_bound > 1
    alone = rules.rule(k_ary(2, 1), 1, P)
    assert alone.extend_bound == pytest.approx(1.9 / (1.15 + 0.336) * (0.05 + 0.3)) and alone.extend == 2


def test_the_largest_profiled_tree_takes_the_slope_below_it_and_root_only_has_no_rule():
    rules = DynamicRules(profile())
    plan = plan_for(P, 16, 6)[0].plan
    assert plan.n == 16
    rule = rules.rule(plan, 1, P)
    per_cost = expected_tokens(plan, P) / profile().step_cost(plan, carried=carried_leaf(plan, P))
    assert rule.threshold == pytest.approx(per_cost * (1.8 - 1.4) / 8)  # t(16) - t(15)
    assert rules.rule(chain(0), 1, P) is None
    other = AcceptanceVector.from_p([0.3, 0.2])
    assert rules.rule(plan, 1, other).threshold < rule.threshold  # a worse draft: each tree is worth less


def test_the_cache_keeps_the_most_recently_used_rules(monkeypatch):
    monkeypatch.setattr("sequoia_ray.dynamic_rules.MAX_RULES", 2)
    rules, plan = DynamicRules(profile()), k_ary(2, 1)
    vectors = [AcceptanceVector.from_p([p, 0.1]) for p in (0.5, 0.6, 0.7)]
    first = rules.rule(plan, 1, vectors[0])
    second = rules.rule(plan, 1, vectors[1])
    assert rules.rule(plan, 1, vectors[0]) is first  # used again: now the most recent
    rules.rule(plan, 1, vectors[2])  # evicts the least recently used: vectors[1]'s
    assert rules.rule(plan, 1, vectors[0]) is first and rules.rule(plan, 1, vectors[1]) is not second
    assert rules.rule(plan, 1, vectors[1]) == second  # recomputed, equal


def test_for_planned_reads_the_plans_vector_and_overhead_and_bad_extend_is_refused():
    overhead = StepOverhead(tree=(1.0, 0.2))
    planned = plan_for(P, 8, 4, Provenance(overhead=overhead.to_dict()))[0]
    rules = DynamicRules(profile(), extend=2)
    assert rules.for_planned(planned)(k_ary(2, 1)) == rules.rule(k_ary(2, 1), 1, P, overhead)
    assert rules.for_planned(planned)(k_ary(2, 1)) != rules.rule(k_ary(2, 1), 1, P)  # the overhead counts
    for bad in (-1, 17):
        with pytest.raises(ValueError, match=f"extend {bad} must be in"):
            DynamicRules(profile(), extend=bad)


@pytest.fixture(scope="module")
def models():
    target = sharpen(tiny_model("qwen2", seed=0), 12.0)
    return target, noisy_copy(target, scale=0.03, seed=1)


def test_greedy_with_the_cost_models_rules_is_the_target_and_trees_are_pruned(models):
    """End to end in process: each step's tree grown by the rule for the served plan (a cheap-token profile so
    that the tiny draft's unsure branches are dropped); tokens equal the target alone's, fewer nodes verified."""
    target, draft = models
    planned = plan_for(P, 16, 6)[0]
    cheap = HardwareProfile("cpu-test-2c", {1: 1.0, 32: 1.1}, {1: 0.5, 32: 0.6}, 0.1, 64, "float32")
    rules = DynamicRules(cheap, extend=2)
    spec = SpeculativeDecoder(TargetWorker(target), DraftWorker(draft), planned.plan,
                              dynamic=rules.for_planned(planned))
    static = SpeculativeDecoder(TargetWorker(target), DraftWorker(draft), planned.plan)
    alone = SpeculativeDecoder(TargetWorker(target), None, chain(0))
    per_step = {"dynamic": [0, 0], "static": [0, 0]}  # nodes verified, steps
    for seed in range(4):
        prompt = [(seed * 13 + i * 7) % 97 for i in range(3 + seed)]
        expected = alone.generate(prompt, SamplingParams(max_tokens=30)).token_ids
        for name, decoder in (("dynamic", spec), ("static", static)):
            got = decoder.generate(prompt, SamplingParams(max_tokens=30, seed=seed))
            assert got.token_ids == expected, (name, seed)
            per_step[name][0] += got.stats.tree_nodes
            per_step[name][1] += got.stats.steps
    (nodes, steps), (static_nodes, static_steps) = per_step["dynamic"], per_step["static"]
    assert nodes / steps < 0.8 * static_nodes / static_steps, per_step  # the rule pruned the trees
