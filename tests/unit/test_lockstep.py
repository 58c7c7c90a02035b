"""Lockstep decoding in process (what the profile measures overhead and candidate plans with): greedy texts
equal the target alone at every batch size, a sampled seed gives the same tokens in a batch as alone,
every request gets exactly max_tokens, and a failing request fails the run loudly."""

from __future__ import annotations

import statistics
import time

import pytest

from sequoia_ray.config import SamplingParams
from sequoia_ray.draft import DraftWorker
from sequoia_ray.engine import ROOT_ONLY, SpeculativeDecoder
from sequoia_ray.lockstep import run_lockstep
from sequoia_ray.target import TargetWorker
from sequoia_ray.tree.plan import from_nested
from tests.tiny import agreeing_pair, ragged_prompts

PLAN = from_nested([[[[]], []], [[]], []])  # 7 nodes, 4 levels, ragged


@pytest.fixture(scope="module")
def models():
    return agreeing_pair()




def _alone(target, prompt, max_tokens):
    spec = SpeculativeDecoder(TargetWorker(target), None, ROOT_ONLY)
    return spec.generate(prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)).token_ids


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("plan", [PLAN, ROOT_ONLY], ids=["tree", "root-only"])
def test_greedy_lockstep_equals_the_target_alone(models, batch, plan):
    target, draft = models
    prompts = ragged_prompts(batch)
    run = run_lockstep(TargetWorker(target), DraftWorker(draft), prompts, plan,
                       SamplingParams(max_tokens=13, temperature=0.0))
    assert run.outputs == tuple(tuple(_alone(target, p, 13)) for p in prompts)
    assert run.tokens == 13 * batch
    assert all(b <= batch for b in run.batch) and len(run.step_s) == len(run.batch)
    if plan is ROOT_ONLY:
        assert run.tokens_per_step == 1.0
    else:
        assert run.tokens_per_step > 1.0  # the draft is a near copy: trees are accepted


def test_a_sampled_seed_gives_the_same_tokens_in_a_batch_as_alone(models):
    target, draft = models
    prompts = ragged_prompts(3)
    params = SamplingParams(max_tokens=10, temperature=0.8)
    batched = run_lockstep(TargetWorker(target), DraftWorker(draft), prompts, PLAN, params, seed=5)
    alone = [run_lockstep(TargetWorker(target), DraftWorker(draft), [p], PLAN, params, seed=5 + i).outputs[0]
             for i, p in enumerate(prompts)]
    assert batched.outputs == tuple(alone)


def test_full_steps_are_the_steps_holding_every_request(models):
    target, draft = models
    run = run_lockstep(TargetWorker(target), DraftWorker(draft), ragged_prompts(3), PLAN,
                       SamplingParams(max_tokens=9, temperature=0.0))
    full = run.full_steps()
    assert full and len(full) == sum(1 for b in run.batch if b == 3)


def test_a_failing_request_fails_the_run(models):
    target, draft = models
    bad = [[target.config.vocab_size + 5]]  # a token id outside the vocabulary
    with pytest.raises(RuntimeError, match="lockstep"):
        run_lockstep(TargetWorker(target), DraftWorker(draft), bad, PLAN, SamplingParams(max_tokens=4))


def test_a_start_that_fails_finishes_the_requests_started_before_it(models):
    """The starts ran outside the try: a prompt the draft refuses (the third here) left the first two held on
    both workers. And no prompts divided by zero steps."""
    target, draft = models
    tw, dw = TargetWorker(target), DraftWorker(draft)
    real, calls = dw.start, []

    def start(rid, prompt, params, seed):
        calls.append(rid)
        if len(calls) == 3:
            raise ValueError("prompt too long for the draft")
        return real(rid, prompt, params, seed)

    dw.start = start
    with pytest.raises(ValueError, match="too long"):
        run_lockstep(tw, dw, ragged_prompts(3), PLAN, SamplingParams(max_tokens=4))
    assert not tw.requests and not dw.requests
    with pytest.raises(ValueError, match="at least one prompt"):
        run_lockstep(tw, dw, [], PLAN, SamplingParams(max_tokens=4))


def _slowed(fn, seconds: float):
    def slow(*args, **kwargs):
        time.sleep(seconds)
        return fn(*args, **kwargs)
    return slow


def test_time_outside_the_forwards_counts_the_walk_not_the_forwards(models, monkeypatch):
    """50 ms slept inside every target forward lengthens the steps, not their time outside the forwards nor the
    draft's part of the forwards; 50 ms slept in every walk lengthens both (each step makes one forward and one
    walk at batch 1); 50 ms slept in every draft forward lengthens the draft's part.

    The bounds are absolute, not relative to an unslowed run: a sleep makes a step take at least 50 ms, so a step
    (and, for the walk, its time outside) under 50 ms means the sleep was not counted there; the forward's time
    outside at 50 ms or more means the forward's sleep was counted outside. An unslowed baseline's own noise (its
    median step moved from ~5 to 16 ms under CI load once) cannot fail them."""
    import sequoia_ray.draft as draft_module
    import sequoia_ray.target as target_module

    target, draft = models
    params = SamplingParams(max_tokens=6, temperature=0.0)

    def run():
        r = run_lockstep(TargetWorker(target), DraftWorker(draft), ragged_prompts(1), PLAN, params, time_forwards=True)
        assert len(r.forward_s) == len(r.step_s) and all(0 < f < s for f, s in zip(r.forward_s, r.step_s))
        assert len(r.draft_forward_s) == len(r.step_s) and all(0 < d < f for d, f in zip(r.draft_forward_s, r.forward_s))
        return (statistics.median(r.full_steps()), statistics.median(r.full_steps_outside()),
                statistics.median(r.draft_forward_s))

    delay = 0.05
    with monkeypatch.context() as m:
        m.setattr(target_module, "hidden_many", _slowed(target_module.hidden_many, delay))
        slow_forward = run()
    with monkeypatch.context() as m:
        m.setattr(target_module, "verify_tree", _slowed(target_module.verify_tree, delay))
        slow_walk = run()
    with monkeypatch.context() as m:
        m.setattr(draft_module, "hidden_many", _slowed(draft_module.hidden_many, delay))
        slow_draft = run()
    assert slow_forward[0] >= delay and slow_forward[1] < delay and slow_forward[2] < delay
    assert slow_walk[0] >= delay and slow_walk[1] >= delay and slow_walk[2] < delay
    assert slow_draft[0] >= delay and slow_draft[1] < delay and slow_draft[2] >= delay


def test_forwards_are_timed_only_when_asked(models):
    target, draft = models
    workers = TargetWorker(target), DraftWorker(draft)
    run = run_lockstep(*workers, ragged_prompts(2), PLAN, SamplingParams(max_tokens=5, temperature=0.0))
    assert run.forward_s == run.draft_forward_s == () and all(w.forward_clock.seconds == 0.0 for w in workers)  # off
    with pytest.raises(ValueError, match="time_forwards"):
        run.full_steps_outside()
