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


def test_quantize_int8_is_torch_aos_quantize_dynamic_bit_for_bit():
    """The conversion packs each weight once, two layers at a time; the modules are the ones torch.ao's
    ``quantize_dynamic`` makes with the per-channel dynamic qconfig: the same int8 weights, scales, zero
    points and bias, and the same logits bit for bit."""
    import warnings

    from torch.ao.quantization import quantize_dynamic
    from torch.ao.quantization.qconfig import per_channel_dynamic_qconfig

    ids = torch.tensor([[5, 17, 42, 8, 60, 3]])
    ours = quantize_int8(tiny_model(seed=4))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = quantize_dynamic(tiny_model(seed=4), {torch.nn.Linear: per_channel_dynamic_qconfig},
                                  dtype=torch.qint8, inplace=True)
    ours_q = {name: m for name, m in ours.named_modules() if "quantized" in type(m).__module__}
    theirs_q = {name: m for name, m in theirs.named_modules() if "quantized" in type(m).__module__}
    assert ours_q.keys() == theirs_q.keys() and len(ours_q) > 0
    for name, mine in ours_q.items():
        other = theirs_q[name]
        assert type(mine) is type(other) and str(mine) == str(other), name
        (w1, b1), (w2, b2) = mine._weight_bias(), other._weight_bias()
        assert torch.equal(w1.int_repr(), w2.int_repr()), name
        assert torch.equal(w1.q_per_channel_scales(), w2.q_per_channel_scales()), name
        assert torch.equal(w1.q_per_channel_zero_points(), w2.q_per_channel_zero_points()), name
        assert (b1 is None and b2 is None) or torch.equal(b1, b2), name
    with torch.no_grad():
        assert torch.equal(ours(ids).logits, theirs(ids).logits)


def test_load_model_int8_and_bad_value():
    loaded = load_model("tiny-draft", dtype="bfloat16", quantize="int8", progress=False)
    assert not any(type(m) is torch.nn.Linear for m in loaded.model.modules())
    with pytest.raises(ValueError, match="quantize 'int4' is not supported"):
        load_model("tiny-draft", quantize="int4", progress=False)



def test_the_deprecation_filter_holds_around_the_quantising_threads(monkeypatch):
    """Each layer's quantisation silences torch.ao's deprecation warning, but catch_warnings saves and restores
    the process-wide filters and two threads' restores interleave, so one thread could drop the other's filter
    (the warning reached session 35's main job log). quantize_int8 sets the filter around its pool: here each
    layer's conversion warns with no filter of its own, and nothing gets through (57 Linear layers)."""
    import warnings

    from sequoia_ray.models import loading
    from sequoia_ray.models.tiny import tiny_model

    def warns(linear):
        warnings.warn("torch.quantize_per_channel and other quantized tensor creation functions are deprecated",
                      UserWarning)
        return linear

    monkeypatch.setattr(loading, "int8_linear", warns)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loading.quantize_int8(tiny_model(layers=8))
        warnings.warn("another warning", UserWarning)  # the filter is scoped: other warnings still show
    assert [str(w.message) for w in caught] == ["another warning"]
