"""Verdict.ranks: (children, accepted rank) per visited inner node of the tree verified, root first."""

from __future__ import annotations

import pytest
import torch

from sequoia_ray.config import SamplingParams
from sequoia_ray.draft import DraftTree
from sequoia_ray.engine import SpeculativeDecoder
from sequoia_ray.sampling import SparseDist
from sequoia_ray.tree.plan import first_levels, from_nested, k_ary
from sequoia_ray.verify import Verdict, verify_tree

VOCAB = 32
# root: children 1, 2, 3 (ranks 1..3); node 1: children 4, 5; node 3: child 6
PLAN = from_nested([[[], []], [], [[]]])
TOKENS = torch.tensor([10 + i for i in range(PLAN.n)])  # node i carries token 10 + i


def greedy_logits(argmax: dict[int, int]) -> torch.Tensor:  # [n, V]
    logits = torch.zeros(PLAN.n, VOCAB)
    for node, token in argmax.items():
        logits[node, token] = 5.0
    return logits


def greedy(argmax: dict[int, int]) -> Verdict:
    return verify_tree(PLAN, DraftTree(TOKENS, {}), greedy_logits(argmax), SamplingParams(),
                       torch.Generator().manual_seed(0))


def test_a_rejection_below_an_accepted_rank_three():
    verdict = greedy({0: 13, 3: 30})  # root accepts node 3 (rank 3); node 3's child (token 16) is rejected
    assert verdict.path == [0, 3] and verdict.tokens == [13, 30]
    assert verdict.ranks == ((3, 3), (1, 0))


def test_an_accepted_leaf_gives_no_observation():
    verdict = greedy({0: 11, 1: 15, 5: 20})  # rank 1, then rank 2 (node 5, a leaf), then the bonus token
    assert verdict.path == [0, 1, 5] and verdict.tokens == [11, 15, 20]
    assert verdict.ranks == ((3, 1), (2, 2))


def test_a_rejected_root_and_the_default():
    assert greedy({0: 31}).ranks == ((3, 0),)
    assert Verdict([0], [5]).ranks == ()  # other code constructing a Verdict still works


def test_sampled_ranks_follow_the_path_on_random_trees():
    plan = k_ary(3, 3)
    gen = torch.Generator().manual_seed(1)
    for seed in range(40):
        tokens = torch.randint(0, VOCAB, (plan.n,), generator=gen)
        dists = {}
        for node, kids in enumerate(plan.children):
            if kids:  # children drawn without replacement: distinct tokens, D uniform over a superset
                picks = torch.randperm(VOCAB, generator=gen)[: len(kids) + 2]
                tokens[list(kids)] = picks[: len(kids)]
                dists[node] = SparseDist(picks, torch.full((len(picks),), 1.0 / len(picks)))
        logits = torch.randn(plan.n, VOCAB, generator=gen) * 2
        verdict = verify_tree(plan, DraftTree(tokens, dists), logits, SamplingParams(temperature=1.0, seed=seed),
                              torch.Generator().manual_seed(seed))
        path = verdict.path
        inner = [node for node in path if plan.children[node]]
        assert len(verdict.ranks) == len(inner)
        for i, (children, rank) in enumerate(verdict.ranks):
            assert children == len(plan.children[path[i]])
            assert rank == (plan.rank[path[i + 1]] if i + 1 < len(path) else 0)


class _Fake:
    """A draft and a target in one: every step grows PLAN; the target answers a fixed verdict."""

    def __init__(self, verdict: Verdict) -> None:
        self.verdict = verdict

    def start(self, *args) -> None: ...
    def finish(self, *args) -> None: ...

    def grow(self, request_id, plan, commits=()) -> DraftTree:
        return DraftTree(TOKENS[: plan.n], {})

    def verify(self, request_id, plan, draft) -> Verdict:
        return self.verdict


def test_the_engine_counts_the_verified_trees_rank_and_tells_the_observer():
    # the verifier saw a tree whose accepted root child has rank 2 (node 1 is rank 1 in the engine's plan)
    fake, seen = _Fake(Verdict([0, 1], [11, 7], ((4, 2), (2, 0)))), []
    decoder = SpeculativeDecoder(fake, fake, PLAN, on_verdict=lambda plan, v, params: seen.append((plan, v, params)))
    out = decoder.generate([1, 2], SamplingParams(max_tokens=6, seed=3))
    assert out.stats.steps == 3 and out.stats.root_rank_hist == {2: 3}
    assert [v.ranks for _, v, _ in seen] == [((4, 2), (2, 0))] * 3
    # the tree verified: the last step's is cut to the 2 tokens left (its first 2 levels)
    assert [plan for plan, _, _ in seen] == [PLAN, PLAN, first_levels(PLAN, 2)]
    assert all(params.seed == 3 for _, _, params in seen)


class _Ruled(_Fake):
    """A fake whose draft records each step's dynamic rule (None: the plan's tree as it is)."""

    def __init__(self, verdict: Verdict) -> None:
        super().__init__(verdict)
        self.rules = []

    def grow(self, request_id, plan, commits=(), rule=None) -> DraftTree:
        self.rules.append(rule)
        return super().grow(request_id, plan, commits)


def test_with_dynamic_trees_only_the_unpruned_steps_tell_their_ranks():
    """Seven tree steps of 2 tokens (max_tokens 14) with a rule for every step and unpruned_every 3: steps 1, 4
    and 7 grow the plan as it is, and only their ranks reach the observer and the policy; every step's tokens
    do (the other verdicts come without ranks). Without a rule every step tells its ranks (the test above)."""
    from sequoia_ray.draft import DynamicTrees

    rule = DynamicTrees(0.2)
    fake, seen, told = _Ruled(Verdict([0, 1], [11, 7], ((4, 1), (2, 0)))), [], []

    class Policy:
        def plan(self, base):
            return base

        def observe(self, plan, verdict, seconds):
            told.append(verdict.ranks)

    decoder = SpeculativeDecoder(fake, fake, PLAN, on_verdict=lambda plan, v, params: seen.append(v.ranks),
                                 policy=lambda params: Policy(), dynamic=lambda plan: rule, unpruned_every=3)
    out = decoder.generate([1, 2], SamplingParams(max_tokens=14, seed=0))
    assert out.stats.steps == 7 and len(out.token_ids) == 14
    assert fake.rules == [None, rule, rule, None, rule, rule, None]
    ranks = ((4, 1), (2, 0))
    assert seen == [ranks, (), (), ranks, (), (), ranks] and told == seen
    assert out.stats.root_rank_hist == {1: 7}  # the engine's own statistics see every step


def test_unpruned_every_zero_rules_every_step_and_negative_is_refused():
    from sequoia_ray.draft import DynamicTrees

    rule, fake, seen = DynamicTrees(0.2), _Ruled(Verdict([0, 1], [11, 7], ((4, 1), (2, 0)))), []
    SpeculativeDecoder(fake, fake, PLAN, on_verdict=lambda plan, v, params: seen.append(v.ranks),
                       dynamic=lambda plan: rule, unpruned_every=0).generate([1], SamplingParams(max_tokens=6, seed=0))
    assert fake.rules == [rule] * 3 and seen == [()] * 3
    with pytest.raises(ValueError, match="unpruned_every -1 must be >= 0"):
        SpeculativeDecoder(fake, fake, PLAN, unpruned_every=-1)


def test_a_failing_observer_never_fails_the_request():
    fake = _Fake(Verdict([0], [7], ((3, 0),)))

    def broken(*_):
        raise RuntimeError("metrics down")

    out = SpeculativeDecoder(fake, fake, PLAN, on_verdict=broken).generate([1], SamplingParams(max_tokens=2, seed=0))
    assert out.token_ids == [7, 7]


class _Counting(_Fake):
    def __init__(self, verdict: Verdict) -> None:
        super().__init__(verdict)
        self.grown: list[int] = []
        self.verified: list[int] = []

    def grow(self, request_id, plan, commits=()) -> DraftTree:
        self.grown.append(plan.n)
        return super().grow(request_id, plan, commits)

    def verify(self, request_id, plan, draft) -> Verdict:
        self.verified.append(plan.n)
        return self.verdict if plan.n > 1 else Verdict([0], [self.verdict.tokens[-1]], ((1, 0),))


class _EveryOther:
    """A step policy: the plan on even steps, the target alone (root-only) on odd ones; records what it saw."""

    def __init__(self, params) -> None:
        self.params, self.steps, self.seen = params, 0, []

    def plan(self, base):
        from sequoia_ray.engine import ROOT_ONLY

        self.steps += 1
        return base if self.steps % 2 else ROOT_ONLY

    def observe(self, plan, verdict, seconds) -> None:
        self.seen.append((plan.n, len(verdict.tokens), seconds))


def test_a_step_policy_picks_each_steps_tree_and_sees_its_verdict_and_time():
    fake, made = _Counting(Verdict([0, 1], [11, 7], ((3, 1), (2, 0)))), []

    def factory(params):
        made.append(_EveryOther(params))
        return made[-1]

    out = SpeculativeDecoder(fake, fake, PLAN, policy=factory).generate([1], SamplingParams(max_tokens=7, seed=5))
    assert len(made) == 1 and made[0].params.seed == 5  # one policy per request, with its parameters
    # steps: tree (2 tokens), root-only (1), tree (2), root-only (1), tree cut to the 1 token left
    assert fake.verified == [PLAN.n, 1, PLAN.n, 1, 1] and fake.grown == [PLAN.n, PLAN.n]
    assert [(n, k) for n, k, _ in made[0].seen] == [(PLAN.n, 2), (1, 1), (PLAN.n, 2), (1, 1), (1, 1)]
    assert all(s >= 0 for _, _, s in made[0].seen)
    assert out.token_ids == [11, 7, 7, 11, 7, 7, 7]


def test_a_failing_step_policy_is_dropped_and_the_request_keeps_the_plan():
    fake = _Counting(Verdict([0, 1], [11, 7], ((3, 1), (2, 0))))

    class Broken:
        def plan(self, base):
            raise RuntimeError("policy bug")

        def observe(self, *_):
            raise AssertionError("a dropped policy is not called again")

    out = SpeculativeDecoder(fake, fake, PLAN, policy=lambda params: Broken()).generate(
        [1], SamplingParams(max_tokens=4, seed=0))
    assert out.token_ids == [11, 7, 11, 7] and fake.grown == [PLAN.n, first_levels(PLAN, 2).n]


def test_a_greedy_walk_on_the_cpu_takes_the_first_of_tied_maxima_as_argmax_does():
    """The CPU walk reads a row's maximum with ``max(0).indices`` (faster than ``argmax``): on rows whose maxima
    tie (at 2-5 random places, bfloat16 and float32) or hold a NaN, the token it keeps is ``argmax``'s.
    A walk that took any other of the tied maxima would differ on most of these 200 rows."""
    gen = torch.Generator().manual_seed(0)
    plan = first_levels(k_ary(1, 2), 2)  # root -> one child
    for trial in range(200):
        row = torch.randn(2, 500, generator=gen).to(torch.bfloat16 if trial % 2 else torch.float32)
        at = torch.randperm(500, generator=gen)[: 2 + trial % 4]
        row[0, at] = row[0].max() + 1
        if trial % 5 == 0:
            row[0, int(at[-1])] = float("nan")
        draft = DraftTree(torch.tensor([7, -1]), {})  # a child no row picks: the walk stops at the root
        verdict = verify_tree(plan, draft, row, SamplingParams(temperature=0.0), torch.Generator())
        assert verdict.tokens == [int(row[0].argmax())], trial


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_bonus_token_at_an_accepted_leaf_follows_the_leafs_p(temperature):
    """A root and one leaf, D = P at the root so the leaf is always accepted: the bonus token after it is drawn
    from the leaf's P at the request's temperature (its argmax, or T = 1 at T = 0.5, passed every fast test: a
    mutation review). 6,000 seeds; each token's frequency within 5 standard errors + 2e-3."""
    plan = from_nested([[]])  # root -> one leaf
    v = 5
    root = torch.tensor([0.0, 4.0, 0.0, 0.0, 0.0])  # P(root) ~ token 1 with 0.93
    leaf = torch.tensor([1.0, 0.0, 0.5, 0.2, 0.0])
    logits = torch.stack([root, leaf])
    d = torch.softmax(root / temperature, -1)
    dists = {0: SparseDist(torch.arange(v), d)}  # D == P at the root: the child is always accepted
    tree = DraftTree(torch.tensor([3, 1]), dists)
    n, counts = 6000, torch.zeros(v)
    for seed in range(n):
        verdict = verify_tree(plan, tree, logits, SamplingParams(temperature=temperature),
                              torch.Generator().manual_seed(seed))
        assert verdict.path == [0, 1]
        counts[verdict.tokens[1]] += 1
    want = torch.softmax(leaf / temperature, -1)
    se = torch.sqrt(want * (1 - want) / n)
    assert torch.all((counts / n - want).abs() <= 5 * se + 2e-3)


@pytest.mark.parametrize("greedy", [[True, False, True], [False, True, False, False], [True, True], [False]])
def test_the_accelerators_batch_inputs_give_each_request_its_own_verdict(greedy):
    """``batch_inputs``' accelerator path (one argmax and one transfer for the whole batch) never ran on the CPU
    and the GPU tests sent it one request: a request taking another's rows in a mixed batch would pass (a
    mutation review). Run here on CPU tensors: each verdict equals verifying that request alone."""
    from sequoia_ray.verify import batch_inputs

    plans = [from_nested([[[]], []]), from_nested([[]]), from_nested([[], [[]]]), from_nested([[[[]]]])]
    vocab, rng = 11, torch.Generator().manual_seed(3)
    requests = []
    for i, _ in enumerate(greedy):
        plan = plans[i % len(plans)]
        logits = torch.randn(plan.n, vocab, generator=rng) * 3
        tokens = torch.randint(vocab, (plan.n,), generator=rng)
        dists = {node: SparseDist(torch.arange(vocab), torch.softmax(torch.randn(vocab, generator=rng), -1))
                 for node in range(plan.n) if plan.children[node]}
        requests.append((plan, DraftTree(tokens, dists), logits))
    params = [SamplingParams(temperature=0.0 if g else 0.7) for g in greedy]
    parts = batch_inputs(torch.cat([r[2] for r in requests]), [r[0].n for r in requests], greedy, gather=True)
    for i, ((plan, tree, logits), part) in enumerate(zip(requests, parts)):
        assert isinstance(part, list) == greedy[i]
        alone = verify_tree(plan, tree, logits, params[i], torch.Generator().manual_seed(i))
        assert verify_tree(plan, tree, part, params[i], torch.Generator().manual_seed(i)) == alone, i


def test_a_tree_the_requests_own_policy_chose_tells_the_estimate_its_rank_one_trials_alone():
    """A request's own tree (``request_trees``) is as wide as the request's acceptance makes it, so its ranks 2 and
    up are tried mostly on prose and biased the live estimate (p̂[2] 0.139 against 0.072 in a review's simulation).
    Its nodes still tell rank 1 (accepted or not) to the estimate, and every rank to the policy; a step on the
    served plan tells every rank to both."""
    wide = k_ary(2, 3)
    fake, seen, told = _Fake(Verdict([0, 2], [11, 7], ((2, 2), (2, 0)))), [], []

    class Policy:
        steps = 0

        def plan(self, base):
            self.steps += 1
            return base if self.steps == 1 else wide  # the served plan first, then the request's own tree

        def observe(self, plan, verdict, seconds):
            told.append(verdict.ranks)

    decoder = SpeculativeDecoder(fake, fake, PLAN, on_verdict=lambda plan, v, params: seen.append(v.ranks),
                                 policy=lambda params: Policy())
    out = decoder.generate([1, 2], SamplingParams(max_tokens=6, seed=0))
    assert out.stats.steps == 3
    full = ((2, 2), (2, 0))
    assert told == [full] * 3
    assert seen == [full, ((1, 0), (1, 0)), ((1, 0), (1, 0))]  # rank 2 accepted: rank 1's trial rejected
