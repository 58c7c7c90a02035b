"""A model source that cannot load says which value and what to give instead: an empty source, a path that does
not exist here (a relative one was taken for a hub id, and transformers' offline error named neither), a checkpoint
without tokenizer files (transformers made an empty tokenizer: every prompt encoded to nothing)."""

from __future__ import annotations

import pytest

from sequoia_ray.models import loading
from sequoia_ray.models.tiny import tiny_model


@pytest.mark.parametrize("source", ["", "   "])
def test_an_empty_source_is_refused_by_name(source):
    with pytest.raises(ValueError, match="is empty; give a checkpoint directory"):
        loading.load_model(source, progress=False)


def test_a_relative_path_that_is_not_here_nor_on_the_hub_is_named(monkeypatch, tmp_path):
    import huggingface_hub

    # offline (read at import, so the module's constant): no hub in CI either, and an unknown id errs alike
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(OSError, match=r"'models/qwen' is neither a path on this machine nor a hub id .* give a"):
        loading.load_model("models/qwen", progress=False)
    with pytest.raises(OSError, match=r"'models/qwen' is neither a path"):
        loading.load_tokenizer("models/qwen", progress=False)


def test_a_checkpoint_without_tokenizer_files_is_refused(tmp_path):
    tiny_model("qwen2").save_pretrained(tmp_path / "weights-only")
    for load in (loading.load_model, loading.load_tokenizer):
        with pytest.raises(FileNotFoundError, match=r"weights-only has no tokenizer .*tokenizer.json"):
            load(str(tmp_path / "weights-only"), progress=False)


def test_a_users_gguf_file_loads_dense(tmp_path, monkeypatch):
    """A .gguf source is loaded with its weights unpacked (transformers keeps them in GGUF blocks when a matmul
    kernel is at hand, which packing, int8 and a draft's head skip) and comes back a plain model, as the default
    pair's conversion makes it."""
    from transformers import AutoModelForCausalLM

    (tmp_path / "model.gguf").write_bytes(b"GGUF")
    seen = {}

    def from_pretrained(where, **kwargs):
        seen.update(kwargs, where=where)
        model = tiny_model("qwen2")
        model.hf_quantizer, model.config.quantization_config = object(), kwargs["quantization_config"]
        return model

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", from_pretrained)
    monkeypatch.setattr(loading, "_tokenizer", lambda where, gguf: None)
    model, _ = loading._from_pretrained(str(tmp_path / "model.gguf"), "float32", "sdpa", None, progress=False)
    assert seen["gguf_file"] == "model.gguf" and seen["quantization_config"].dequantize is True
    assert model.hf_quantizer is None and not hasattr(model.config, "quantization_config")


def test_a_mistyped_built_in_name_is_pointed_at(monkeypatch):
    import huggingface_hub

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(OSError, match=r"did you mean 'tiny-draft'\? give .* one of default-draft, default-target, "
                                      r"tiny-draft, tiny-target"):
        loading.load_tokenizer("tiny-drafts", progress=False)


def test_a_users_gguf_stops_at_every_end_token_its_vocabulary_has(tmp_path, monkeypatch):
    """A GGUF names one EOS id: a user's Qwen instruct file loaded with (<|im_end|>,) and generated on past
    <|endoftext|>, which the built-in pair made from the same file stops at (its conversion adds it)."""
    from transformers import AutoModelForCausalLM

    from sequoia_ray.models.tiny import char_tokenizer

    (tmp_path / "model.gguf").write_bytes(b"GGUF")
    tokenizer = char_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_end|>", "<|endoftext|>"]})
    im_end, endoftext = tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    tokenizer.eos_token = "<|im_end|>"

    def from_pretrained(where, **kwargs):
        model = tiny_model("qwen2")
        model.generation_config.eos_token_id = im_end
        return model

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", from_pretrained)
    monkeypatch.setattr(loading, "_tokenizer", lambda where, gguf: tokenizer)
    monkeypatch.setattr("sequoia_ray.models.fetch.strip_gguf_quantization", lambda model: None)
    model, tok = loading._from_pretrained(str(tmp_path / "model.gguf"), "float32", "sdpa", None, progress=False)
    assert loading.eos_ids(tok, model.generation_config) == (im_end, endoftext)


def test_a_truncated_gguf_is_named_with_the_fix(tmp_path):
    """A GGUF cut short (an interrupted download) failed with a bare struct.error naming neither file nor fix."""
    import struct

    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF" + struct.pack("<I", 3) + b"\x00" * 5)  # the magic, a version, then cut short
    with pytest.raises(ValueError, match=rf"GGUF file {gguf} \(13 bytes\) looks truncated or damaged .* download "
                                         r"it again"):
        loading.load_model(str(gguf), progress=False)
