"""The real default pair (Qwen2.5-Coder 0.5B -> 1.5B) in fp32: greedy output is exactly the target's."""

from __future__ import annotations

import pytest

from sequoia_ray.config import SamplingParams
from sequoia_ray.local import LocalPair
from sequoia_ray.tree.builtin import builtin_plan
from sequoia_ray.tree.plan import chain

pytestmark = pytest.mark.slow

PROMPTS = [
    ("def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n", False),
    ("Explain what a hash map is in two sentences.", True),
]


@pytest.fixture(scope="module")
def pair():
    return LocalPair.load(dtype="float32", progress=False)


@pytest.mark.parametrize("text,chat", PROMPTS)
def test_greedy_tree_decoding_is_the_target_greedy_output(pair, text, chat):
    prompt = pair.encode(text, chat=chat)
    params = SamplingParams(max_tokens=20)
    alone = pair.decoder(chain(0), speculate=False).generate(prompt, params)
    for plan in (builtin_plan(0.0).plan, chain(3)):
        spec = pair.decoder(plan).generate(prompt, params)
        assert spec.token_ids == alone.token_ids
        assert spec.text == alone.text
        assert spec.stats.tokens_per_step > 1.5, spec.stats.to_dict()


def test_sampling_same_seed_same_text(pair):
    prompt = pair.encode("Write a haiku about trees.", chat=True)
    params = SamplingParams(max_tokens=12, temperature=0.6, seed=7)
    decoder = pair.decoder(builtin_plan(0.6).plan)
    assert decoder.generate(prompt, params).token_ids == decoder.generate(prompt, params).token_ids
