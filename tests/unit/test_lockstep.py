"""Lockstep decoding in process (what the profile measures overhead and candidate plans with): greedy texts
equal the target alone at every batch size, a sampled seed gives the same tokens in a batch as alone,
every request gets exactly max_tokens, and a failing request fails the run loudly."""

from __future__ import annotations

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
