"""Dynamic trees (``DraftWorker(dynamic=DynamicTrees(...))``): the grown tree's shape, its draws against the
static tree's, batching, the cap, the thresholds from the cost model. Exactness: tests/unit/test_engine.py
(greedy), test_sampling.py (enumeration of the stopping rule), test_lossless_statistical.py (joint law)."""

from __future__ import annotations

import pytest
import torch

from sequoia_ray.config import SamplingParams
from sequoia_ray.draft import DraftWorker, DynamicTrees, _kept_prefix
from sequoia_ray.sampling import expected_draw_probability, target_probs, truncate
from sequoia_ray.target import TargetWorker
from sequoia_ray.tree.plan import TreePlan, k_ary, specinfer
from tests.tiny import agreeing_pair

PROMPTS = {"a": [3, 1, 4, 1, 5], "b": [2, 7, 1], "c": [9, 9, 8, 2, 6, 5]}


@pytest.fixture(scope="module")
def models():
    return agreeing_pair()


def grow_all(draft_model, plan, temperature, dynamic, *, batch: bool):
    """The first tree of every prompt (seed = its index), grown together (one forward per level) or alone."""
    worker = DraftWorker(draft_model, dynamic=dynamic)
    params = SamplingParams(max_tokens=50, temperature=temperature)
    for seed, (rid, prompt) in enumerate(PROMPTS.items()):
        worker.start(rid, prompt, params, seed)
    if batch:
        return dict(zip(PROMPTS, worker.grow_batch([(rid, plan) for rid in PROMPTS])))
    return {rid: worker.grow(rid, plan) for rid in PROMPTS}


def same_tree(a, b, atol: float = 0.0) -> bool:
    """Same shape, tokens and D's support; D's probabilities equal to ``atol`` (a batch rounds differently)."""
    if not torch.equal(a.tokens, b.tokens) or a.plan != b.plan or a.dists.keys() != b.dists.keys():
        return False
    return all(torch.equal(a.dists[k].tokens, b.dists[k].tokens)
               and torch.allclose(a.dists[k].probs, b.dists[k].probs, rtol=0, atol=atol) for k in a.dists)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_threshold_zero_without_extension_is_the_static_tree_draw_for_draw(models, temperature):
    _, draft = models
    static = grow_all(draft, k_ary(3, 2), temperature, None, batch=True)
    zero = grow_all(draft, k_ary(3, 2), temperature, DynamicTrees(0.0), batch=True)
    assert all(same_tree(static[r], zero[r]) and zero[r].plan is None for r in PROMPTS)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_root_children_are_the_static_draws_cut_by_the_rule(models, temperature):
    """Same seed: the dynamic root's children are the first m of the static tree's root children (the same
    without-replacement sequence), m decided by worth * E_i >= threshold with E_i from the draws before."""
    _, draft = models
    plan, rule = specinfer(6, 2), DynamicTrees(0.06)
    static = grow_all(draft, plan, temperature, None, batch=False)
    dynamic = grow_all(draft, plan, temperature, rule, batch=False)
    cuts = set()
    for rid in PROMPTS:
        drawn = static[rid].tokens[1:7]  # [6] the root's children in draw order
        kept = dynamic[rid].plan.children[0]
        assert dynamic[rid].tokens[list(kept)].tolist() == drawn[: len(kept)].tolist()
        assert len(kept) == _kept_prefix(root_expectations(draft, PROMPTS[rid], drawn, temperature), rule.threshold)
        cuts.add(len(kept))
    assert cuts - {0, 6}, "the rule must cut some root for the test to bite"


def root_expectations(draft, prompt, drawn, temperature) -> list[float]:
    with torch.inference_mode():
        logits = draft(input_ids=torch.tensor([prompt])).logits[0, -1]
    if temperature == 0:
        return torch.softmax(logits.float(), -1)[drawn].tolist()
    return expected_draw_probability(truncate(target_probs(logits, temperature), 64), drawn).tolist()


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_batched_dynamic_trees_are_the_trees_grown_alone(models, temperature):
    """Each request has its own shape in a batch (one forward per level) and the same tree as alone."""
    _, draft = models
    rule = DynamicTrees(0.005, extend=3, extend_threshold=0.001)
    alone = grow_all(draft, k_ary(2, 3), temperature, rule, batch=False)
    together = grow_all(draft, k_ary(2, 3), temperature, rule, batch=True)
    assert all(same_tree(alone[r], together[r], atol=1e-5) for r in PROMPTS)
    assert len({together[r].plan for r in PROMPTS}) > 1, "the requests' shapes should differ"


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("thresholds", [(0.01, 0.001), (1e-5, 0.0)])
def test_grown_tree_is_breadth_first_within_the_cap_and_extends_one_path(models, temperature, thresholds):
    """At most plan.n + extend nodes and plan.num_levels + extend levels; one node per level beyond the plan;
    the D of every node with children and of no other node; the tree's tokens fit its plan. The tiny draft is
    near uniform (97 ids): at thresholds (0.01, 0.001) whether a path is kept to the plan's last level and then
    extended rests on the draws; at (1e-5, 0) every planned node is worth keeping (path probabilities ~1e-4 at
    the last level) and every tree extends, whatever the draws."""
    _, draft = models
    plan, rule = k_ary(2, 2), DynamicTrees(thresholds[0], extend=4, extend_threshold=thresholds[1])
    trees = grow_all(draft, plan, temperature, rule, batch=True)
    for tree in trees.values():
        grown = tree.plan
        assert isinstance(grown, TreePlan) and tree.tokens.shape == (grown.n,)
        assert grown.n <= plan.n + rule.extend and grown.num_levels <= plan.num_levels + rule.extend
        assert all(len(level) == 1 for level in grown.levels[plan.num_levels :])
        if temperature:
            assert set(tree.dists) == {i for i in range(grown.n) if grown.children[i]}
    if thresholds[1] == 0.0:
        assert all(t.plan.num_levels == plan.num_levels + rule.extend for t in trees.values()), "a tree not extended"


def test_a_high_threshold_keeps_the_root_alone_and_the_target_still_verifies(models):
    target, draft = models
    dw, tw = DraftWorker(draft, dynamic=DynamicTrees(1.0)), TargetWorker(target)
    params = SamplingParams(max_tokens=10, temperature=1.0)
    dw.start("r", [1, 2, 3], params, 1)
    tw.start("r", [1, 2, 3], params, 2)
    tree = dw.grow("r", k_ary(3, 3))
    assert tree.plan == TreePlan((-1,)) and tree.dists == {}
    assert tw.tokens_of("verify", "r", (k_ary(3, 3), tree)) == 3  # the grown tree's size, not the plan's
    verdict = tw.verify("r", k_ary(3, 3), tree)
    assert verdict.path == [0] and len(verdict.tokens) == 1
    dw.commit("r", verdict.path, verdict.tokens)
    assert dw.requests["r"].cached == 3  # prompt's tokens; the root [3] is re-forwarded with the next token


def test_steps_whose_tree_was_pruned_to_its_root_are_not_counted_as_tree_steps(models):
    """A rule that prunes every tree to its root verifies no draft token: such steps were counted as tree steps
    whose root child was rejected (``tree_steps`` and the root-rank histogram: every step rank 0)."""
    from sequoia_ray.engine import SpeculativeDecoder
    from sequoia_ray.tree.plan import from_nested

    target, draft = models
    sizes = []
    spec = SpeculativeDecoder(TargetWorker(target), DraftWorker(draft), from_nested([[[[]], []], [[]], []]),
                              unpruned_every=0, dynamic=lambda plan: DynamicTrees(threshold=1.0),
                              on_verdict=lambda plan, verdict, stats: sizes.append(verdict.nodes))
    stats = spec.generate([(i * 7) % 97 for i in range(11)], SamplingParams(max_tokens=12)).stats
    assert set(sizes) == {1} and stats.steps == len(sizes) > 1
    assert stats.tree_steps == 0 and not stats.root_rank_hist and stats.tree_nodes == stats.steps


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("extend", [0, 2])
def test_a_root_only_plan_grows_the_root_alone_unless_it_may_extend(models, temperature, extend):
    """A request's last token plans the root alone (``first_levels(plan, 1)``): without extension levels that
    is the tree; with them the root may grow a confident path."""
    target, draft = models
    dw = DraftWorker(draft, dynamic=DynamicTrees(threshold=0.01, extend=extend, extend_threshold=0.0))
    dw.start("r", [1, 2, 3], SamplingParams(max_tokens=10, temperature=temperature), 1)
    tree = dw.grow("r", TreePlan((-1,)))
    grown = tree.plan or TreePlan((-1,))
    assert tree.tokens.shape == (grown.n,) and int(tree.tokens[0]) == 3
    assert grown.n == 1 + extend and grown.num_levels == 1 + extend  # every extension is worth its 0


def test_thresholds_from_the_cost_model_and_bad_values():
    rule = DynamicTrees.from_cost_model(expected_tokens=3.0, step_cost=2.0, token_cost=0.02, level_cost=0.5, extend=2)
    assert rule.threshold == pytest.approx(0.03) and rule.extend_bound == pytest.approx(0.78) and rule.extend == 2
    assert rule.level_threshold == pytest.approx(0.75)
    assert DynamicTrees(0.1).extend_bound == 0.1
    for bad in (dict(threshold=-0.1), dict(threshold=float("nan")), dict(threshold=0.1, extend=-1),
                dict(threshold=0.1, extend_threshold=-1.0), dict(threshold=0.1, level_threshold=-1.0)):
        with pytest.raises(ValueError, match="must be >= 0"):
            DynamicTrees(**bad)
    with pytest.raises(ValueError, match="step_cost"):
        DynamicTrees.from_cost_model(3.0, 0.0, 0.02)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_the_level_rule_stops_where_the_level_is_worth_less_than_a_draft_forward(models, temperature):
    """With level_threshold L the tree stops at the first level whose inner nodes' path probabilities sum
    below L: cut trees are the unbounded rule's trees truncated at that level (same draws, same ids)."""
    _, draft = models
    free, cut = DynamicTrees(0.001), DynamicTrees(0.001, level_threshold=0.3)
    unbounded = grow_all(draft, k_ary(2, 4), temperature, free, batch=True)
    stopped = grow_all(draft, k_ary(2, 4), temperature, cut, batch=True)
    shorter = 0
    for rid in PROMPTS:
        full, short = unbounded[rid].plan, stopped[rid].plan
        assert short.parents == full.parents[: short.n]
        assert torch.equal(stopped[rid].tokens, unbounded[rid].tokens[: short.n])
        shorter += short.num_levels < full.num_levels
    assert shorter, "the level rule must cut some tree for the test to bite"


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_calls_rule_overrides_the_workers_and_one_batch_mixes_rules(models, temperature):
    """``grow_batch`` calls carry their own rule (what serving sends): a static call and two dynamic ones in one
    batch give each the tree a worker with that rule grows alone; the batcher's token count has the call's
    extension."""
    _, draft = models
    plan = k_ary(2, 3)
    # a keeps every planned node and extends 3 levels whatever it draws (path probabilities ~1e-4 at depth 3)
    rules = {"a": DynamicTrees(1e-5, extend=3, extend_threshold=0.0), "b": None, "c": DynamicTrees(0.05)}
    params = SamplingParams(max_tokens=50, temperature=temperature)
    mixed = DraftWorker(draft, dynamic=DynamicTrees(0.5))  # the worker's own rule: for calls without one
    for seed, (rid, prompt) in enumerate(PROMPTS.items()):
        mixed.start(rid, prompt, params, seed)
    assert mixed.tokens_of("grow", "a", (plan, (), rules["a"])) == len(PROMPTS["a"]) + plan.n + 3
    assert mixed.tokens_of("grow", "b", (plan, ())) == len(PROMPTS["b"]) + plan.n
    together = dict(zip(PROMPTS, mixed.grow_batch([("a", plan, (), rules["a"]), ("b", plan, ()),
                                                   ("c", plan, (), rules["c"])])))
    for seed, (rid, prompt) in enumerate(PROMPTS.items()):
        alone = DraftWorker(draft, dynamic=rules[rid] or DynamicTrees(0.5))
        alone.start(rid, prompt, params, seed)
        assert same_tree(alone.grow(rid, plan), together[rid], atol=1e-5), rid
    assert len({(together[r].plan or plan).n for r in PROMPTS}) == 3, "the three rules should give three sizes"
