"""SpeculativeDecoder on tiny models: greedy identity with the target, exact stops, seeds, errors."""

from __future__ import annotations

import threading

import pytest

from sequoia_ray.config import SamplingParams
from sequoia_ray.draft import DraftWorker, DynamicTrees
from sequoia_ray.engine import ContextLengthError, SpeculativeDecoder
from sequoia_ray.target import TargetWorker
from sequoia_ray.tree.plan import chain, from_nested, k_ary, specinfer
from tests.tiny import noisy_copy, sharpen, tiny_model

PLANS = {
    "chain4": chain(4),
    "wide": k_ary(8, 1),
    "binary3": k_ary(2, 3),
    "specinfer": specinfer(3, 3),
    "deep-ragged": from_nested([[[[[[]]]], []], [[]], []]),
}


@pytest.fixture(scope="module")
def models():
    target = sharpen(tiny_model("qwen2", seed=0), 12.0)
    good = noisy_copy(target, scale=0.03, seed=1)
    bad = tiny_model("qwen2", seed=7)
    return target, good, bad


def decoder(target, draft, plan, **kw):
    return SpeculativeDecoder(TargetWorker(target), DraftWorker(draft) if draft is not None else None, plan, **kw)


def target_greedy(target, prompt, n, eos=()):
    return decoder(target, None, chain(0), eos_ids=eos).generate(prompt, SamplingParams(max_tokens=n)).token_ids


@pytest.mark.parametrize("plan_name", list(PLANS))
@pytest.mark.parametrize("which", ["good", "bad"])
def test_greedy_is_token_for_token_the_target(models, plan_name, which):
    target, good, bad = models
    draft = good if which == "good" else bad
    spec = decoder(target, draft, PLANS[plan_name])
    for seed in range(4):
        prompt = [(seed * 13 + i * 7) % 97 for i in range(3 + seed)]
        expected = target_greedy(target, prompt, 30)
        got = spec.generate(prompt, SamplingParams(max_tokens=30, seed=seed))
        assert got.token_ids == expected, (plan_name, which, seed)
        assert got.finish_reason == "length"
        assert got.stats.tokens == 30
    if which == "good" and PLANS[plan_name].num_levels > 2:
        assert got.stats.tokens_per_step > 1.5  # the noisy copy is accepted most of the time


DYNAMIC = {  # the tiny draft's top probabilities are ~0.1-0.6, so these prune often and extend sometimes
    "pruned": DynamicTrees(0.03),
    "extended": DynamicTrees(0.02, extend=3, extend_threshold=0.005),
    "levels": DynamicTrees(0.002, extend=2, extend_threshold=0.003, level_threshold=0.1),
}


class RecordingDraft(DraftWorker):
    """Keeps (plan asked, tree grown) of every grow."""

    def __init__(self, model, **kw) -> None:
        super().__init__(model, **kw)
        self.shapes, self.rules = [], []

    def grow(self, request_id, plan, commits=(), rule=None):
        tree = super().grow(request_id, plan, commits, rule)
        self.shapes.append((plan, tree.plan or plan))
        self.rules.append((rule, len(self.requests[request_id].committed)))  # tokens committed at the grow
        return tree


@pytest.mark.parametrize("rule", list(DYNAMIC))
@pytest.mark.parametrize("plan_name", ["binary3", "specinfer", "deep-ragged"])
@pytest.mark.parametrize("which", ["good", "bad"])
def test_greedy_dynamic_trees_are_token_for_token_the_target(models, plan_name, which, rule):
    """Pruned and extended trees (their own shapes, verified as sent) give the target's greedy tokens; the
    trees really were pruned (and, with a good draft, extended) and stay within plan.n + extend nodes."""
    target, good, bad = models
    dynamic = DYNAMIC[rule]
    draft = RecordingDraft(good if which == "good" else bad, dynamic=dynamic)
    spec = SpeculativeDecoder(TargetWorker(target), draft, PLANS[plan_name])
    for seed in range(4):
        prompt = [(seed * 13 + i * 7) % 97 for i in range(3 + seed)]
        got = spec.generate(prompt, SamplingParams(max_tokens=30, seed=seed))
        assert got.token_ids == target_greedy(target, prompt, 30), (plan_name, which, rule, seed)
    shapes = draft.shapes
    assert all(t.n <= p.n + dynamic.extend and t.num_levels <= p.num_levels + dynamic.extend for p, t in shapes)
    assert any(t.n < p.n for p, t in shapes), "no tree was pruned: the test would not bite"
    if rule != "pruned" and which == "good":
        assert any(t.num_levels > p.num_levels for p, t in shapes), "no tree was extended"


def test_a_decoders_rule_reaches_the_draft_and_never_extends_past_the_tokens_left(models):
    """``dynamic``: every step's rule goes with its grow; its extension is cut so the deepest path plus the bonus
    token fits what the request has left; greedy stays the target's."""
    target, good, _ = models
    rule, plan, prompt = DynamicTrees(0.02, extend=3, extend_threshold=0.005), PLANS["binary3"], [5, 3, 8, 1]
    draft = RecordingDraft(good)
    spec = SpeculativeDecoder(TargetWorker(target), draft, plan, dynamic=lambda p: rule, unpruned_every=0)
    got = spec.generate(prompt, SamplingParams(max_tokens=12, seed=0))
    assert got.token_ids == target_greedy(target, prompt, 12)
    for (sent, committed), (asked, grown) in zip(draft.rules, draft.shapes):
        left = 12 - (committed - len(prompt))
        assert sent.threshold == rule.threshold and sent.extend == min(3, max(0, left - asked.num_levels))
        assert grown.num_levels <= left
    assert {sent.extend for sent, _ in draft.rules} > {3}, "no step had its extension cut: the test would not bite"
    assert got.stats.tree_nodes == sum(grown.n for _, grown in draft.shapes)


def test_a_rule_prunes_the_tree_the_step_policy_chose(models):
    """A step policy (a tree per request) and a rule compose: the rule is asked for, and grows, the policy's tree."""
    target, good, _ = models
    draft, chosen, rule = RecordingDraft(good), PLANS["deep-ragged"], DynamicTrees(0.03)
    asked = []

    class Policy:
        def plan(self, base):
            return chosen

        def observe(self, plan, verdict, seconds):
            pass

    def dynamic(plan):
        asked.append(plan)
        return rule

    spec = SpeculativeDecoder(TargetWorker(target), draft, PLANS["wide"], policy=lambda params: Policy(),
                              dynamic=dynamic, unpruned_every=0)
    got = spec.generate([5, 3, 8, 1], SamplingParams(max_tokens=12, seed=0))
    assert got.token_ids == target_greedy(target, [5, 3, 8, 1], 12)
    assert asked and all(p == chosen or p.n < chosen.n for p in asked)  # the last steps: its first levels
    assert [a for a, _ in draft.shapes] == asked and all(r is rule for r, _ in draft.rules)


def test_a_failing_rule_is_logged_once_and_the_requests_steps_grow_their_plans(models, caplog):
    target, good, _ = models
    draft = RecordingDraft(good)
    calls = []

    def broken(plan):
        calls.append(plan)
        raise KeyError("no profile bucket")

    spec = SpeculativeDecoder(TargetWorker(target), draft, PLANS["binary3"], dynamic=broken)
    for request in range(2):
        got = spec.generate([5, 3, 8, 1], SamplingParams(max_tokens=12, seed=0))
        assert got.token_ids == target_greedy(target, [5, 3, 8, 1], 12)
    assert all(rule is None for rule, _ in draft.rules) and all(a == g for a, g in draft.shapes)
    assert len(draft.shapes) > 2 * 2, "too few steps: the test would not bite"
    assert len(calls) == 2  # once per request: dropped after its failure
    assert caplog.text.count("dynamic rule failed (KeyError") == 2


@pytest.mark.parametrize("cut", [1, 4, 7, 13])
def test_eos_inside_an_accepted_path_stops_exactly(models, cut):
    target, good, _ = models
    prompt = [3, 1, 4, 1, 5]
    reference = target_greedy(target, prompt, 20)
    eos = reference[cut]
    first = reference.index(eos)  # EOS ends at its first occurrence
    got = decoder(target, good, k_ary(3, 4), eos_ids=(eos,)).generate(prompt, SamplingParams(max_tokens=20))
    assert got.token_ids == reference[:first]
    assert got.finish_reason == "stop"
    ignored = decoder(target, good, k_ary(3, 4), eos_ids=(eos,)).generate(
        prompt, SamplingParams(max_tokens=20, ignore_eos=True))
    assert ignored.token_ids == reference


@pytest.mark.parametrize("max_tokens", [1, 2, 3, 5, 9])
def test_max_tokens_inside_a_path(models, max_tokens):
    target, good, _ = models
    prompt = [9, 9, 8]
    got = decoder(target, good, chain(6)).generate(prompt, SamplingParams(max_tokens=max_tokens))
    assert got.token_ids == target_greedy(target, prompt, 20)[:max_tokens]
    assert got.finish_reason == "length"


class CharTokenizer:
    """token t <-> the letter chr(97 + t % 26); enough to test stop strings."""

    def decode(self, ids, skip_special_tokens=True, clean_up_tokenization_spaces=None):
        return "".join(chr(97 + t % 26) for t in ids)


def test_stop_string_inside_a_path_is_cut_and_not_returned(models):
    target, good, _ = models
    prompt = [2, 7, 1, 8]
    reference = target_greedy(target, prompt, 24)
    text = CharTokenizer().decode(reference)
    stop = text[9:12]
    at = text.find(stop)
    spec = decoder(target, good, k_ary(2, 4), tokenizer=CharTokenizer())
    chunks = list(spec.stream(prompt, SamplingParams(max_tokens=24, stop=[stop, "zzzzzzz"])))
    assert "".join(c.text for c in chunks) == text[:at]
    assert chunks[-1].finish_reason == "stop"
    assert [t for c in chunks for t in c.token_ids] == reference[: at + len(stop)]


def test_same_seed_same_tokens_and_different_seed_differs(models):
    target, good, _ = models
    spec = decoder(target, good, k_ary(3, 3))
    runs = [spec.generate([1, 2, 3], SamplingParams(max_tokens=40, temperature=1.0, seed=s)).token_ids
            for s in (5, 5, 6)]
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]


def test_random_seed_is_reported_and_replays(models):
    target, good, _ = models
    spec = decoder(target, good, k_ary(2, 2))
    first = spec.generate([4, 4], SamplingParams(max_tokens=25, temperature=1.0))
    again = spec.generate([4, 4], SamplingParams(max_tokens=25, temperature=1.0, seed=first.seed))
    assert first.token_ids == again.token_ids


def test_prompt_errors(models):
    target, good, _ = models
    spec = decoder(target, good, chain(3), max_context=32)
    with pytest.raises(ContextLengthError, match="prompt of 30 tokens \\+ max_tokens 5 exceeds"):
        spec.generate(list(range(30)), SamplingParams(max_tokens=5))
    with pytest.raises(ValueError, match="prompt is empty"):
        spec.generate([], SamplingParams(max_tokens=5))
    with pytest.raises(ValueError, match="need a tokenizer"):
        spec.generate([1], SamplingParams(max_tokens=5, stop=["x"]))


def test_requests_are_freed(models):
    target, good, _ = models
    t, d = TargetWorker(target), DraftWorker(good)
    spec = SpeculativeDecoder(t, d, chain(3))
    stream = spec.stream([1, 2, 3], SamplingParams(max_tokens=50, ignore_eos=True))
    next(stream)
    assert len(t.requests) == 1 and len(d.requests) == 1
    stream.close()  # a client that goes away
    assert not t.requests and not d.requests
    spec.generate([1, 2], SamplingParams(max_tokens=5))
    assert not t.requests and not d.requests


@pytest.mark.parametrize("rule", [None, "extended"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_draft_cache_after_commits_equals_a_fresh_forward(models, temperature, rule):
    """A wrong draft cache would only lower acceptance (output stays right), so check it directly (also
    after dynamic trees, whose node ids are the grown tree's)."""
    import torch

    from tests.unit.test_tree_forward import plain_logits

    target, good, _ = models
    t, d = TargetWorker(target), DraftWorker(good, dynamic=DYNAMIC.get(rule))
    params = SamplingParams(max_tokens=100, temperature=temperature)
    plan = from_nested([[[[[]]], [[]]], [[]], []])
    t.start("r", [5, 6, 7], params, 1)
    d.start("r", [5, 6, 7], params, 2)
    for _ in range(6):
        verdict = t.verify("r", plan, d.grow("r", plan))
        d.commit("r", verdict.path, verdict.tokens)
        req = d.requests["r"]
        committed = req.committed
        pending = torch.tensor(committed[req.cached:])
        got = req.session.forward(pending, torch.arange(req.cached, len(committed)))
        torch.testing.assert_close(got, plain_logits(good, committed)[req.cached:], atol=2e-5, rtol=1e-5)
        req.session.truncate(req.cached)
    assert t.requests["r"].committed == committed
    assert t.requests["r"].session.length == len(committed) - 1


class DyingDraft(DraftWorker):
    """A draft that fails on its n-th grow (as a killed actor would) and on every call after."""

    def __init__(self, model, fail_at: int) -> None:
        super().__init__(model)
        self.grows, self.fail_at, self.dead = 0, fail_at, False

    def grow(self, request_id, plan):
        self.grows += 1
        if self.grows >= self.fail_at:
            self.dead = True
        if self.dead:
            raise ConnectionError("the draft actor died")
        return super().grow(request_id, plan)

    def commit(self, request_id, path, new_tokens):
        if self.dead:
            raise ConnectionError("the draft actor died")
        return super().commit(request_id, path, new_tokens)

    def finish(self, request_id):
        if self.dead:
            raise ConnectionError("the draft actor died")
        return super().finish(request_id)


@pytest.mark.parametrize("fail_at", [1, 2, 4])
def test_a_dying_draft_degrades_to_the_target_alone_with_the_same_tokens(models, fail_at):
    target, good, _ = models
    prompt = [2, 4, 6, 8]
    expected = target_greedy(target, prompt, 40)
    t = TargetWorker(target)
    spec = SpeculativeDecoder(t, DyingDraft(good, fail_at), k_ary(2, 3))
    out = spec.generate(prompt, SamplingParams(max_tokens=40))
    assert out.token_ids == expected
    assert out.stats.draft_failures == 1
    # before the failure at most fail_at - 1 speculative steps of <= 4 tokens; every later step is the
    # target alone (0 accepted draft tokens, 1 token)
    assert out.stats.accepted_hist[0] >= 40 - 4 * (fail_at - 1)
    assert not t.requests  # the target's state is freed although the draft's finish failed


class CallLog(DraftWorker):
    """Records the request calls the engine makes (start, grow, finish); ``fail`` makes one of them raise."""

    def __init__(self, model, fail: str | None = None) -> None:
        super().__init__(model)
        self.calls, self.fail = [], fail

    def _log(self, method: str) -> None:
        self.calls.append(method)
        if method == self.fail:
            raise RuntimeError(f"draft {method} broke")

    def start(self, request_id, prompt, params, seed):
        self._log("start")
        super().start(request_id, prompt, params, seed)

    def grow(self, request_id, plan, commits=(), rule=None):
        self._log("grow")
        return super().grow(request_id, plan, commits, rule)

    def finish(self, request_id):
        self._log("finish")
        super().finish(request_id)


class AloneFirst:
    """A step policy: the target alone for the first ``steps`` steps, then the plan."""

    def __init__(self, steps: int) -> None:
        self.left = steps

    def plan(self, base):
        self.left -= 1
        return chain(0) if self.left >= 0 else base

    def observe(self, plan, verdict, seconds) -> None:
        pass


@pytest.mark.parametrize("alone_steps", [0, 3, 1000])
def test_the_draft_starts_at_the_first_grow_and_only_then(models, alone_steps):
    """The draft is started by the request's first tree step (its commits then catch it up), so steps of the
    target alone before it wait for no draft call, and a request that never grows a tree never starts (or
    finishes) the draft. Greedy tokens are the target alone's either way."""
    target, good, _ = models
    draft = CallLog(good)
    spec = SpeculativeDecoder(TargetWorker(target), draft, PLANS["binary3"],
                              policy=lambda params: AloneFirst(alone_steps))
    got = spec.generate([5, 3, 8, 1], SamplingParams(max_tokens=16, seed=0))
    assert got.token_ids == target_greedy(target, [5, 3, 8, 1], 16)
    if alone_steps == 1000:
        assert draft.calls == [] and not draft.requests
    else:
        grows = got.stats.steps - alone_steps
        assert draft.calls == ["start"] + ["grow"] * grows + ["finish"] and grows > 0
        assert got.stats.accepted_hist.total() - got.stats.accepted_hist[0] > 0  # the late draft caught up


class GatedTarget(TargetWorker):
    """A target whose first ``verify`` (the prompt's prefill) waits up to 5 s for the draft's ``start``."""

    def __init__(self, model, started: threading.Event) -> None:
        super().__init__(model)
        self.started, self.first_saw_start = started, None

    def verify(self, request_id, plan, tree):
        if self.first_saw_start is None:
            self.first_saw_start = self.started.wait(5.0)
        return super().verify(request_id, plan, tree)


class StartSignal(CallLog):
    def __init__(self, model, started: threading.Event, fail: str | None = None) -> None:
        super().__init__(model, fail)
        self.signal = started

    def start(self, request_id, prompt, params, seed):
        try:
            super().start(request_id, prompt, params, seed)
        finally:
            self.signal.set()


@pytest.mark.parametrize("max_tokens, fail", [(16, None), (1, None), (16, "start")])
def test_with_the_first_step_alone_the_draft_starts_while_the_target_prefills(models, max_tokens, fail):
    """The draft's ``start`` runs beside the first step (the target's first verify sees it begin), before the
    first ``grow``; a request done in its first step still finishes the draft it started; a start that fails
    leaves the request to the target alone. Greedy tokens are the target alone's in every case."""
    target, good, _ = models
    started = threading.Event()
    draft, gated = StartSignal(good, started, fail), GatedTarget(target, started)
    spec = SpeculativeDecoder(gated, draft, PLANS["binary3"], first_step_alone=True)
    got = spec.generate([5, 3, 8, 1], SamplingParams(max_tokens=max_tokens, seed=0))
    assert gated.first_saw_start is True
    assert got.token_ids == target_greedy(target, [5, 3, 8, 1], max_tokens)
    if fail:  # the failed start is followed by a finish: the draft frees whatever the start left
        assert draft.calls == ["start", "finish"] and got.stats.draft_failures == 1 and not draft.requests
    else:
        assert draft.calls == ["start"] + ["grow"] * (got.stats.steps - 1) + ["finish"] and not draft.requests


def test_a_draft_whose_start_fails_leaves_the_request_to_the_target_alone(models):
    target, good, _ = models
    draft = CallLog(good, fail="start")
    spec = SpeculativeDecoder(TargetWorker(target), draft, PLANS["binary3"])
    got = spec.generate([5, 3, 8, 1], SamplingParams(max_tokens=12, seed=0))
    assert got.token_ids == target_greedy(target, [5, 3, 8, 1], 12)
    assert draft.calls == ["start", "finish"] and got.stats.draft_failures == 1


class GrowFailsOnce(CallLog):
    """The second ``grow`` raises after the request's state exists (as a batched forward that failed does)."""

    def grow(self, request_id, plan, commits=(), rule=None):
        if self.calls.count("grow") == 1:
            self.calls.append("grow")
            raise RuntimeError("one request's grow failed")
        return super().grow(request_id, plan, commits, rule)


def test_a_draft_that_fails_a_request_is_told_to_free_it(models):
    """After a failed grow the request goes on with the target alone and the draft is sent a finish (through
    ``abandon`` when the draft has one: an actor's finish not awaited), so its KV session is not held until the
    idle reaper runs."""
    target, good, _ = models
    draft, abandoned = GrowFailsOnce(good), []
    spec = SpeculativeDecoder(TargetWorker(target), draft, PLANS["binary3"])
    got = spec.generate([5, 3, 8, 1], SamplingParams(max_tokens=12, seed=0))
    assert got.token_ids == target_greedy(target, [5, 3, 8, 1], 12)
    assert got.stats.draft_failures == 1 and draft.calls == ["start", "grow", "grow", "finish"]
    assert not draft.requests
    draft = GrowFailsOnce(good)
    draft.abandon = lambda rid: abandoned.append(rid) or DraftWorker.finish(draft, rid)
    SpeculativeDecoder(TargetWorker(target), draft, PLANS["binary3"]).generate([5, 3, 8, 1], SamplingParams(
        max_tokens=12, seed=0), request_id="r1")
    assert abandoned == ["r1"] and "finish" not in draft.calls and not draft.requests


class StartRunsThenFails(TargetWorker):
    """As ``RanksTarget`` sees a start that timed out: rank 0 ran it, the caller got an error."""

    def start(self, request_id, prompt, params, seed):
        super().start(request_id, prompt, params, seed)
        raise TimeoutError("start timed out")


def test_a_target_start_that_fails_after_it_ran_is_finished(models):
    target, good, _ = models
    worker, draft = StartRunsThenFails(target), CallLog(good)
    with pytest.raises(TimeoutError):
        SpeculativeDecoder(worker, draft, PLANS["binary3"]).generate([5, 3, 8, 1], SamplingParams(max_tokens=4))
    assert not worker.requests and draft.calls == []  # freed; the draft was never started


def test_the_first_step_alone_prefills_with_the_target_only_and_the_draft_joins_next(models):
    """``first_step_alone``: the prompt's step is root-only (one token, no tree; the draft is only started beside
    it), the draft grows from the second step and catches up; greedy tokens are the target alone's and trees are accepted afterwards."""
    target, good, _ = models
    draft = CallLog(good)
    spec = SpeculativeDecoder(TargetWorker(target), draft, PLANS["binary3"], first_step_alone=True)
    chunks = list(spec.stream([5, 3, 8, 1], SamplingParams(max_tokens=16, seed=0)))
    assert len(chunks[0].token_ids) == 1  # the first step's one token, before any draft call
    stats = chunks[-1].stats
    assert [t for c in chunks for t in c.token_ids] == target_greedy(target, [5, 3, 8, 1], 16)
    assert draft.calls == ["start"] + ["grow"] * (stats.steps - 1) + ["finish"]
    assert stats.accepted_hist.total() - stats.accepted_hist[0] > 0


class ForgetsOnThirdGrow(CallLog):
    """A draft whose idle reaper freed the request just before its third grow (a long run of target-alone steps)."""

    def grow(self, request_id, *args):
        if self.calls.count("grow") == 2:
            DraftWorker.finish(self, request_id)
        return super().grow(request_id, *args)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_draft_that_forgot_the_request_is_started_again_and_speculates_on(models, temperature):
    target, good, _ = models
    draft = ForgetsOnThirdGrow(good)
    params = SamplingParams(max_tokens=24, temperature=temperature, seed=3)
    got = SpeculativeDecoder(TargetWorker(target), draft, PLANS["binary3"]).generate([5, 3, 8, 1], params)
    assert got.stats.draft_failures == 0 and draft.calls.count("start") == 2  # started again, from every token
    assert draft.calls[:5] == ["start", "grow", "grow", "grow", "start"] and draft.calls.count("grow") > 5
    if not temperature:
        assert got.token_ids == target_greedy(target, [5, 3, 8, 1], 24)


class FinishFails(TargetWorker):
    def finish(self, request_id):
        super().finish(request_id)
        raise RuntimeError("the group was replaced")


def test_a_target_finish_that_fails_after_the_last_token_does_not_fail_the_request(models, caplog):
    target, good, _ = models
    got = SpeculativeDecoder(FinishFails(target), DraftWorker(good), PLANS["binary3"]).generate(
        [5, 3, 8, 1], SamplingParams(max_tokens=8))
    assert got.token_ids == target_greedy(target, [5, 3, 8, 1], 8) and got.finish_reason == "length"
    assert "target finish failed" in caplog.text


def test_early_starts_do_not_queue_behind_a_draft_that_stopped_answering():
    """Each early start waits on the draft in a thread of its own: with a pool of 8, the ninth request's start
    queued until one of eight starts stuck on a hung draft reached its deadline (a minute each by default)."""
    from sequoia_ray.engine import _DraftLink

    release, reached = threading.Event(), threading.Event()

    class Hung:
        def start(self, request_id, *args):
            if request_id == "r8":
                reached.set()
            else:
                release.wait(30)  # stuck until the test ends

        def finish(self, request_id):
            pass

    opening = ([1, 2, 3], SamplingParams(max_tokens=4), 0)
    links = [_DraftLink(Hung(), f"r{i}", opening, early=True) for i in range(9)]
    try:
        assert reached.wait(10), "the ninth start never reached the draft"
    finally:
        release.set()
    for link in links:
        link.call("finish")
    assert all(link.alive for link in links)


class _ContextDraft(DraftWorker):
    """A draft reading ``context`` positions that records the deepest position of every tree it grows."""

    def __init__(self, model, context: int) -> None:
        super().__init__(model)
        self.context, self.deepest, self.started = context, [], 0

    @property
    def max_context(self) -> int:
        return self.context

    def start(self, request_id, prompt, params, seed) -> None:
        self.started += 1
        super().start(request_id, prompt, params, seed)

    def grow(self, request_id, plan, commits=(), rule=None):
        tree = super().grow(request_id, plan, commits, rule)
        root = len(self.requests[request_id].committed) - 1  # the root's position: the last committed token's
        self.deepest.append(root + plan.num_levels - 1)
        return tree


def test_a_request_outgrowing_the_drafts_context_goes_on_with_the_target_alone(models):
    target, good, _ = models
    t, d = TargetWorker(target), _ContextDraft(good, context=20)
    stream = SpeculativeDecoder(t, d, chain(4)).stream([3, 1, 4, 1, 5], SamplingParams(max_tokens=40, ignore_eos=True))
    ids, held = [], []
    for chunk in stream:
        ids += chunk.token_ids
        held.append(len(d.requests))
    assert ids == target_greedy(target, [3, 1, 4, 1, 5], 40)
    assert d.deepest and max(d.deepest) == 19  # trees right up to the draft's last position, never past it
    assert chunk.stats.draft_failures == 0  # not a failure: the draft was retired
    assert held[-1] == 0 and 0 in held[:-1]  # the draft freed the request long before it ended
    assert chunk.stats.steps > 40 - 20  # the last ~20 tokens came from the target alone, a step each


def test_a_prompt_past_the_drafts_context_never_starts_the_draft(models):
    target, good, _ = models
    d = _ContextDraft(good, context=6)
    out = SpeculativeDecoder(TargetWorker(target), d, chain(4), first_step_alone=True).generate(
        list(range(2, 10)), SamplingParams(max_tokens=5, ignore_eos=True))
    assert out.token_ids == target_greedy(target, list(range(2, 10)), 5)
    assert (d.started, d.deepest, out.stats.draft_failures) == (0, [], 0)


def test_a_draft_whose_max_context_is_no_number_is_refused_by_name(models):
    """A proxy draft answering every attribute (``max_context`` too) with a call: a clear TypeError naming the
    value, not an arithmetic error deep in the step loop (CI failure of stop 58)."""
    target, good, _ = models

    class Proxy(DraftWorker):
        max_context = staticmethod(lambda *args: None)

    decoder = SpeculativeDecoder(TargetWorker(target), Proxy(good), chain(2))
    with pytest.raises(TypeError, match="the draft's max_context is .*an int"):
        decoder.generate([3, 1, 4], SamplingParams(max_tokens=4))


def test_a_cancelled_request_on_bare_workers_stops_at_its_next_step():
    """In process (workers that take no call from another thread) a cancel is seen at the next step: without
    that check a stream whose caller had gone ran on to max_tokens (a mutation review)."""
    from sequoia_ray.request_errors import RequestCancelled
    from tests.tiny import agreeing_pair

    target, draft = agreeing_pair()
    calls = []

    class Counting(TargetWorker):
        def verify(self, *args):
            calls.append(args[0])
            return super().verify(*args)

    spec = SpeculativeDecoder(Counting(target), DraftWorker(draft), k_ary(2, 2))
    stream = spec.stream([1, 2, 3], SamplingParams(max_tokens=60, ignore_eos=True), request_id="r")
    next(stream)
    assert spec.cancel("r")
    before = len(calls)
    with pytest.raises(RequestCancelled):
        next(stream)
    assert len(calls) == before  # no verify ran for a caller that has gone
