"""Rotary scalings whose frequencies follow the largest position in a forward (transformers' longrope, dynamic)
make a token's K/V depend on the tree's depth, the batchmates and the forward that filled a cached prefix: with
such a model the output was not the target's (a review measured 13 of 20 greedy prompts differing on a tiny
longrope Phi3 with a 2-ary tree of 5 levels). Such a model is refused when a worker takes it; fixed scalings
are served."""

from __future__ import annotations

import pytest
from transformers import LlamaConfig, LlamaForCausalLM, Phi3Config, Phi3ForCausalLM

from sequoia_ray.request_state import rope_type
from sequoia_ray.target import TargetWorker
from tests.tiny import tiny_model


def phi3(rope: dict | None) -> Phi3ForCausalLM:
    cfg = Phi3Config(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                     sliding_window=None, pad_token_id=None, bos_token_id=None, eos_token_id=None,
                     **({"rope_parameters": rope} if rope else {}))
    return Phi3ForCausalLM(cfg).eval()


def llama(rope: dict) -> LlamaForCausalLM:
    cfg = LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, rope_parameters=rope,
                      pad_token_id=None, bos_token_id=None, eos_token_id=None)
    return LlamaForCausalLM(cfg).eval()


LONGROPE = {"rope_type": "longrope", "rope_theta": 1e4, "short_factor": [1.0] * 8, "long_factor": [8.0] * 8,
            "original_max_position_embeddings": 32}


@pytest.mark.parametrize("make, rope, refused", [
    (phi3, LONGROPE, True), (llama, {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 4.0}, True),
    (llama, {"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0}, False), (phi3, None, False)])
def test_position_dependent_rotary_scalings_are_refused(make, rope, refused):
    model = make(rope)
    if refused:
        with pytest.raises(ValueError, match=f"rope_type '{rope['rope_type']}'"):
            TargetWorker(model)
    else:
        TargetWorker(model)


def test_the_default_tiny_model_reads_as_default_rope():
    assert rope_type(tiny_model().config) == "default"
