"""The real default pair (Qwen2.5-Coder 0.5B -> 1.5B) in fp32: greedy output is exactly the target's."""

from __future__ import annotations

import pytest
import torch

from sequoia_ray.config import SamplingParams
from sequoia_ray.local import LocalPair
from sequoia_ray.tree.builtin import builtin_plan
from sequoia_ray.tree.plan import chain

pytestmark = pytest.mark.slow

PROMPTS = [
    ("def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n", False),
    ("Explain what a hash map is in two sentences.", True),
]
STACK = ("class Stack:\n", False)
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def pair():
    return LocalPair.load(dtype="float32", progress=False)


def assert_target_greedy(pair, prompt: list[int], tokens: list[int]) -> None:
    """``tokens`` are the target alone's greedy continuation of ``prompt``: each is the target's argmax after the
    prompt and the tokens before it, read from one teacher-forced forward of the model over the whole sequence
    (not from the engine, whose decoding is under test), and they end where greedy decoding ends: at
    ``MAX_TOKENS``, or where the target's next pick is an end-of-sequence token (which the engine does not emit).
    (The target alone decoded incrementally, 16 forwards a prompt, took ~28 s of this module's ~115 s.)"""
    with torch.inference_mode():
        logits = pair.target.model(input_ids=torch.tensor([prompt + tokens]), use_cache=False).logits
    picks = logits[0, len(prompt) - 1:].argmax(-1).tolist()  # [len(tokens) + 1]: the target's pick at each step
    differ = [i for i, (a, b) in enumerate(zip(picks, tokens)) if a != b]
    assert not differ, f"the target picks another token at {differ[0]} of {len(tokens)}"
    assert len(tokens) == MAX_TOKENS or picks[-1] in pair.target.eos_ids, (len(tokens), picks[-1])


@pytest.mark.parametrize("text,chat", PROMPTS)
def test_greedy_tree_decoding_is_the_target_greedy_output(pair, text, chat):
    prompt = pair.encode(text, chat=chat)
    params = SamplingParams(max_tokens=MAX_TOKENS)
    first = pair.decoder(builtin_plan(0.0).plan).generate(prompt, params)
    assert_target_greedy(pair, prompt, first.token_ids)
    assert first.stats.tokens_per_step > 1.5, first.stats.to_dict()
    if not chat:  # a chain too on the code prompt (the prose prompt's tree is decoded again, batched, below)
        spec = pair.decoder(chain(3)).generate(prompt, params)
        assert (spec.token_ids, spec.text) == (first.token_ids, first.text)
        assert spec.stats.tokens_per_step > 1.5, spec.stats.to_dict()


def test_sampling_same_seed_same_text(pair):
    prompt = pair.encode("Write a haiku about trees.", chat=True)
    params = SamplingParams(max_tokens=5, temperature=0.6, seed=7)
    decoder = pair.decoder(builtin_plan(0.6).plan)
    assert decoder.generate(prompt, params).token_ids == decoder.generate(prompt, params).token_ids


def test_batched_greedy_is_the_target_greedy_output(pair):
    """Both prompts and a third decode at once through the batchers (one target forward for all their trees,
    one draft forward per level): each text is the target alone's, token for token (fp32)."""
    import threading

    from sequoia_ray.batching import BatchedWorker, Batcher, BatchLimits
    from sequoia_ray.draft import DraftWorker
    from sequoia_ray.engine import SpeculativeDecoder
    from sequoia_ray.target import TargetWorker

    keys = PROMPTS + [STACK]
    prompts = [pair.encode(text, chat=chat) for text, chat in keys]
    params = SamplingParams(max_tokens=MAX_TOKENS)
    # every forward waits (up to 5 s) for all of the previous forward's requests, trees included, so requests
    # share the target's forwards whatever the timing (pipelined, nobody waits for trees: they may alternate)
    batchers = [Batcher.over(TargetWorker(pair.target.model), BatchLimits(wait_s=5.0),
                             comes_back=lambda method, args: True),
                Batcher.over(DraftWorker(pair.draft.model), BatchLimits())]
    got = [None] * len(prompts)

    def run(i):
        spec = SpeculativeDecoder(BatchedWorker(batchers[0]), BatchedWorker(batchers[1]), builtin_plan(0.0).plan)
        got[i] = spec.generate(prompts[i], params).token_ids

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for b in batchers:
        b.close()
    for prompt, tokens in zip(prompts, got):
        assert_target_greedy(pair, prompt, tokens)
    # the first forward runs alone (nobody to wait for yet); later ones wait for the previous one's requests,
    # so at least two requests share one (all three need not: their steps and lengths differ)
    assert max(batchers[0].stats()) > 1, "the target never verified two requests in one forward"
