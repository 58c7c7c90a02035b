"""Linear layers packed for oneDNN: the same products as ``F.linear``, packed only where asked and possible,
and a packed pair still decodes token for token what the unpacked target decodes."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from sequoia_ray.config import SamplingParams
from sequoia_ray.draft import DraftWorker
from sequoia_ray.engine import SpeculativeDecoder
from sequoia_ray.models.batch_forward import LAYOUTS, Segment, hidden_many
from sequoia_ray.models.packed_linear import PackedLinear, pack_linears, packed_count, why_not
from sequoia_ray.models.tree_lm import KVSession
from sequoia_ray.target import TargetWorker
from sequoia_ray.tree.plan import chain, from_nested, k_ary
from tests.tiny import agreeing_pair, tiny_model

BF16 = torch.ops.mkldnn._is_mkldnn_bf16_supported()
needs_bf16 = pytest.mark.skipif(not BF16, reason="this CPU has no oneDNN bf16 support")


def _linears(model) -> int:
    return sum(type(m) is torch.nn.Linear for m in model.modules())


@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.bfloat16, marks=needs_bf16)])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(1, 48), (7, 48), (1, 5, 48), (3, 4, 48)])
def test_packed_linear_is_f_linear(dtype, bias, shape):
    gen = torch.Generator().manual_seed(0)
    linear = torch.nn.Linear(48, 80, bias=bias)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(80, 48, generator=gen))
        if bias:
            linear.bias.copy_(torch.randn(80, generator=gen))
    linear = linear.to(dtype)
    x = torch.randn(*shape, generator=gen).to(dtype)
    expected = F.linear(x, linear.weight, linear.bias)
    got = PackedLinear(linear)(x)
    assert got.shape == expected.shape and got.dtype == dtype
    tol = dict(atol=1e-4, rtol=1e-5) if dtype == torch.float32 else dict(atol=0.05, rtol=0.01)  # bf16: 8-bit mantissa
    torch.testing.assert_close(got, expected, **tol)


def test_a_wrong_input_dtype_is_named():
    packed = PackedLinear(torch.nn.Linear(8, 4))
    with pytest.raises(TypeError, match="torch.float32 weights but got a torch.bfloat16 input"):
        packed(torch.ones(1, 8, dtype=torch.bfloat16))


def test_modes_decide_what_is_packed():
    model = tiny_model("qwen2", seed=0)  # fp32, tied embeddings off in the tiny config: lm_head is its own
    n = _linears(model)
    assert n > 0
    assert pack_linears(copy.deepcopy(model), "aten") == 0
    assert pack_linears(copy.deepcopy(model), "auto") == 0  # auto packs bf16 only
    assert "bfloat16 models only" in why_not(model, "auto")
    packed = copy.deepcopy(model)
    assert pack_linears(packed, "packed") == n
    assert _linears(packed) == 0 and packed_count(packed) == n
    assert not any(hasattr(m, "weight") for m in packed.modules() if isinstance(m, PackedLinear))  # freed
    with pytest.raises(ValueError, match="linears 'fast' must be one of auto, packed, aten"):
        pack_linears(model, "fast")


@needs_bf16
def test_auto_packs_a_bf16_model_and_keeps_a_tied_embedding():
    model = tiny_model("qwen2", seed=0).to(torch.bfloat16)
    model.lm_head.weight = model.model.embed_tokens.weight  # tie, as Qwen2.5 0.5B / 1.5B do
    n = _linears(model)
    assert why_not(model, "auto") is None
    assert pack_linears(model, "auto") == n
    assert isinstance(model.get_output_embeddings(), PackedLinear)
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16  # the embedding still has its weight
    assert model.dtype == torch.bfloat16


def test_other_devices_and_dtypes_are_declined_or_refused():
    meta = tiny_model("qwen2", seed=0).to("meta")  # stands in for an accelerator: not a CPU tensor
    assert "oneDNN packing is a CPU kernel" in why_not(meta, "auto")
    assert pack_linears(meta, "auto") == 0
    with pytest.raises(ValueError, match="linears 'packed': the model is on meta"):
        pack_linears(meta, "packed")
    half = tiny_model("qwen2", seed=0).to(torch.float16)
    assert pack_linears(half, "auto") == 0
    with pytest.raises(ValueError, match="float16 has no packed kernel"):
        pack_linears(half, "packed")


def test_load_model_packs_what_it_is_asked_to():
    from sequoia_ray.models.loading import load_model

    assert packed_count(load_model("tiny-target", linears="packed", progress=False).model) > 0
    assert packed_count(load_model("tiny-target", progress=False).model) == 0  # fp32 + auto
    int8 = load_model("tiny-draft", quantize="int8", linears="packed", progress=False).model
    assert packed_count(int8) == 0 and _linears(int8) == 0  # int8 layers are not nn.Linear: nothing to pack
    with pytest.raises(ValueError, match="linears 'fast' must be one of"):
        load_model("tiny-target", linears="fast", progress=False)


@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.bfloat16, marks=needs_bf16)])
def test_tree_forward_logits_match_unpacked(dtype):
    model = tiny_model("qwen2", seed=3).to(dtype)
    packed = copy.deepcopy(model)
    pack_linears(packed, "packed")
    plan = from_nested([[[[]], []], [], [[], [[], []]]])
    gen = torch.Generator().manual_seed(0)
    prompt, tree = torch.randint(0, 97, (11,), generator=gen), torch.randint(0, 97, (plan.n,), generator=gen)
    out = []
    for m in (model, packed):
        s = KVSession(m)
        s.forward(prompt, torch.arange(11))
        out.append(s.forward(tree, 10 + 1 + torch.tensor(plan.depth), torch.from_numpy(plan.ancestor_mask())))
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=0.1, rtol=0.02)
    torch.testing.assert_close(out[1], out[0], **tol)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_batched_forward_on_packed_layers_equals_each_request_alone(layout):
    model = tiny_model("qwen2", seed=4)
    pack_linears(model, "packed")
    plans = [k_ary(3, 1), chain(4), from_nested([[[]], []])]
    gen = torch.Generator().manual_seed(1)
    contexts = [torch.randint(0, 97, (n,), generator=gen) for n in (5, 9, 2)]
    trees = [torch.randint(0, 97, (p.n,), generator=gen) for p in plans]

    def segments():
        out = []
        for ctx, tree, plan in zip(contexts, trees, plans):
            s = KVSession(model)
            s.forward(ctx, torch.arange(len(ctx)))
            base = len(ctx) - 1
            out.append(Segment(s, tree, base + 1 + torch.tensor(plan.depth), torch.from_numpy(plan.ancestor_mask())))
        return out

    alone = [seg.session.hidden(seg.tokens, seg.positions, seg.allowed, seg.tree_start) for seg in segments()]
    batched = hidden_many(model, segments(), layout)
    for a, b in zip(alone, batched):
        torch.testing.assert_close(b, a, atol=2e-5, rtol=1e-5)


def test_a_packed_pair_decodes_the_unpacked_targets_greedy_tokens():
    """fp32, packed on request: tree speculation over packed layers gives token for token the greedy decoding
    of the unpacked target (the reference every exactness test uses)."""
    target, draft = agreeing_pair()
    fast_target, fast_draft = copy.deepcopy(target), copy.deepcopy(draft)
    pack_linears(fast_target, "packed")
    pack_linears(fast_draft, "packed")
    reference = SpeculativeDecoder(TargetWorker(target), None, chain(0))
    spec = SpeculativeDecoder(TargetWorker(fast_target), DraftWorker(fast_draft), k_ary(2, 3))
    for seed in range(3):
        prompt = [(seed * 13 + i * 7) % 97 for i in range(3 + seed)]
        expected = reference.generate(prompt, SamplingParams(max_tokens=24)).token_ids
        got = spec.generate(prompt, SamplingParams(max_tokens=24, seed=seed))
        assert got.token_ids == expected, seed
        assert got.stats.tokens_per_step > 1.2  # the draft is used, not bypassed
