"""The int8 draft: every Linear becomes a dynamically quantised one, in place, and the logits stay close."""

from __future__ import annotations

import pytest
import torch

from sequoia_ray.models.loading import load_model, quantize_int8
from tests.tiny import tiny_model


def test_quantize_int8_replaces_every_linear_and_keeps_the_logits_close():
    model = tiny_model(seed=3)
    ids = torch.tensor([[5, 17, 42, 8, 60]])
    with torch.no_grad():
        before = model(ids).logits
        quantized = quantize_int8(model)
        after = quantized(ids).logits
    assert quantized is model  # in place: no second copy of the weights
    assert not any(type(m) is torch.nn.Linear for m in quantized.modules())
    assert any(type(m).__name__ == "Linear" and "quantized" in type(m).__module__ for m in quantized.modules())
    assert (after - before).abs().max() < 0.05 * before.abs().max()  # int8 per-channel: a small error
    assert (after.argmax(-1) == before.argmax(-1)).float().mean() >= 0.8


def test_load_model_int8_and_bad_value():
    loaded = load_model("tiny-draft", dtype="bfloat16", quantize="int8", progress=False)
    assert not any(type(m) is torch.nn.Linear for m in loaded.model.modules())
    with pytest.raises(ValueError, match="quantize 'int4' is not supported"):
        load_model("tiny-draft", quantize="int4", progress=False)
