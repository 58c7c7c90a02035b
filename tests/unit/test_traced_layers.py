"""Traced decoder layers: bit for bit the stock layers' hidden states, caches and greedy tokens in every layout
and cache, on the weights the model holds (not a copy), and the stock forward wherever tracing cannot be
trusted (an unknown layer, training, a probe that differs, a deep copy)."""

from __future__ import annotations

import copy

import pytest
import torch

from sequoia_ray.config import SamplingParams
from sequoia_ray.draft import DraftWorker
from sequoia_ray.engine import SpeculativeDecoder
from sequoia_ray.models import traced_layers
from sequoia_ray.models.batch_forward import LAYOUTS, hidden_many
from sequoia_ray.models.loading import TINY_TARGET, load_model, quantize_int8
from sequoia_ray.models.packed_linear import pack_linears
from sequoia_ray.models.traced_layers import trace_layers, traced_count, untrace_layers
from sequoia_ray.models.tree_lm import KVSession
from sequoia_ray.target import TargetWorker
from sequoia_ray.tree.plan import chain, from_nested
from tests.tiny import VOCAB, agreeing_pair, tiny_model
from tests.unit.test_batch_forward import _segment, _sessions

BF16 = torch.ops.mkldnn._is_mkldnn_bf16_supported()


def _variants():
    """(name, model builder): the kinds of layer the traces copy, in the dtypes and kernels served."""
    def bf16_packed():
        model = tiny_model("qwen2", seed=5).to(torch.bfloat16)
        assert pack_linears(model, "packed") > 0
        return model

    built = [("qwen2", lambda: tiny_model("qwen2", seed=5)), ("llama", lambda: tiny_model("llama", seed=6)),
             ("int8", lambda: quantize_int8(tiny_model("qwen2", seed=7)))]
    return built + ([("bf16-packed", bf16_packed)] if BF16 else [])


VARIANTS = _variants()


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("name,build", VARIANTS, ids=[v[0] for v in VARIANTS])
def test_traced_batches_equal_stock_bit_for_bit(name, build, layout):
    """Ragged batches (trees, prefills beside them, an empty cache) through each layout: the same hidden states
    and the same K/V in every request's cache, bit for bit."""
    stock, traced = build(), build()  # fixed seeds: the same weights (a packed model cannot be deep-copied)
    assert trace_layers(traced, "traced") == traced.config.num_hidden_layers == traced_count(traced)
    results = []
    for model in (stock, traced):
        built, gen = _sessions(model, 11)
        segments = [_segment(s, k, p, gen) for s, k, p in built]
        results.append((hidden_many(model, segments, layout), [s for s, _, _ in built]))
    (expected, stock_sessions), (got, traced_sessions) = results
    for e, g in zip(expected, got):
        assert torch.equal(g, e)
    for a, b in zip(stock_sessions, traced_sessions):
        assert a.length == b.length
        for la, lb in zip(a.cache.layers, b.cache.layers):
            assert torch.equal(la.keys, lb.keys) and torch.equal(la.values, lb.values)


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_a_lone_session_and_a_tree_equal_stock(attn):
    """``KVSession`` on its own (transformers' own mask and attention function, eager or SDPA): prompt, then a
    tree below it, bit for bit, whatever the number of new tokens (the traces were made at 3)."""
    stock = tiny_model("llama", attn=attn, seed=3)
    traced = copy.deepcopy(stock)
    trace_layers(traced, "traced")
    plan = from_nested([[[[]], []], [], [[], [[], []]]])
    gen = torch.Generator().manual_seed(0)
    prompt, tree = torch.randint(0, VOCAB, (11,), generator=gen), torch.randint(0, VOCAB, (plan.n,), generator=gen)
    outs = []
    for model in (stock, traced):
        session = KVSession(model)
        first = session.hidden(prompt, torch.arange(11))
        then = session.hidden(tree, 10 + 1 + torch.tensor(plan.depth), torch.from_numpy(plan.ancestor_mask()))
        outs.append((first, then))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])


def test_greedy_speculative_decoding_with_traced_models_is_the_target_alone():
    target, draft = agreeing_pair()
    reference = copy.deepcopy(target)
    for model in (target, draft):
        trace_layers(model, "traced")
    decoder = SpeculativeDecoder(TargetWorker(target), DraftWorker(draft), from_nested([[[[]], []], [[]]]))
    prompt = [5, 17, 33, 2, 60]
    got = decoder.generate(prompt, SamplingParams(max_tokens=24, temperature=0.0)).token_ids
    alone = SpeculativeDecoder(TargetWorker(reference), None, chain(0))
    assert got == alone.generate(prompt, SamplingParams(max_tokens=24, temperature=0.0)).token_ids


def test_traces_run_on_the_models_own_weights():
    """The traces share the layer's parameters: a weight changed in place changes the traced output exactly as
    the stock one (nothing copied, no second copy of the weights in memory)."""
    model = tiny_model("qwen2", seed=1)
    trace_layers(model, "traced")
    ids = torch.arange(1, 8)[None]
    before = model(input_ids=ids).logits
    with torch.no_grad():
        model.model.layers[1].mlp.down_proj.weight.mul_(3.0)
    after = model(input_ids=ids).logits
    untrace_layers(model)
    assert traced_count(model) == 0
    assert not torch.equal(before, after) and torch.equal(after, model(input_ids=ids).logits)


def test_frozen_traces_hold_the_models_own_small_weights():
    """The traces are frozen (the norms' weights and the biases are constants of the graph, not attributes looked
    up at each call), and those constants are the layer's tensors: changed in place, the traced output changes
    exactly as the stock one."""
    model = tiny_model("qwen2", seed=1)
    trace_layers(model, "traced")
    layer = model.model.layers[0]
    assert 'GetAttr[name="norm"]' not in str(layer.forward.before.graph)  # frozen, not read per call
    ids = torch.arange(1, 8)[None]
    before = model(input_ids=ids).logits
    with torch.no_grad():
        layer.input_layernorm.weight.mul_(2.0)
        layer.self_attn.q_proj.bias.add_(0.5)
        layer.post_attention_layernorm.weight.mul_(0.5)
    after = model(input_ids=ids).logits
    untrace_layers(model)
    assert not torch.equal(before, after) and torch.equal(after, model(input_ids=ids).logits)


def test_modes_and_what_is_never_traced():
    model = tiny_model("qwen2", seed=0)
    assert trace_layers(model, "eager") == 0 and traced_count(model) == 0
    with pytest.raises(ValueError, match="layers 'fast' must be one of auto, traced, eager"):
        trace_layers(model, "fast")
    model.train()
    assert trace_layers(model, "auto") == 0  # training: dropout and checkpointing are the stock layer's
    with pytest.raises(ValueError, match="layers 'traced': the model is in training mode; use layers 'auto'"):
        trace_layers(model, "traced")
    model.eval()
    model.model.layers[0].self_attn.q_norm = torch.nn.Identity()  # a Qwen3-like layer: shapes the traces lack
    assert trace_layers(model, "auto") == 0
    del model.model.layers[0].self_attn.q_norm
    model.model.layers[1].mlp.register_forward_hook(lambda *a: None)  # tensor-parallel shards run hooks
    with pytest.raises(ValueError, match="hooks"):
        trace_layers(model, "traced")


def test_a_layer_of_unknown_shape_keeps_its_own_forward():
    model = tiny_model("qwen2", seed=0)
    model.model.layers[0].__class__ = type("GemmaDecoderLayer", (type(model.model.layers[0]),), {})
    assert trace_layers(model, "auto") == 0
    with pytest.raises(ValueError, match="GemmaDecoderLayer is not a layer whose shape the traces copy"):
        trace_layers(model, "traced")


def test_a_probe_that_differs_leaves_the_stock_forward(monkeypatch):
    """Should the traced parts compute anything else than the stock layer (here: the residual added twice),
    ``auto`` keeps the stock forward and ``traced`` fails by name."""
    model = tiny_model("qwen2", seed=2)
    ids = torch.arange(1, 9)[None]
    expected = model(input_ids=ids).logits
    wrong = traced_layers._After.forward
    monkeypatch.setattr(traced_layers._After, "forward", lambda self, a, r: wrong(self, a, r) + r)
    assert trace_layers(model, "auto") == 0 and traced_count(model) == 0
    assert torch.equal(model(input_ids=ids).logits, expected)
    with pytest.raises(RuntimeError, match="traced layers' output differs from the stock layers'"):
        trace_layers(model, "traced")
    assert traced_count(model) == 0


def test_a_deep_copy_runs_the_stock_forward_on_its_own_weights():
    model = tiny_model("qwen2", seed=4)
    trace_layers(model, "traced")
    twin = copy.deepcopy(model)
    assert traced_count(twin) == 0 and traced_count(model) == 2
    ids = torch.arange(1, 6)[None]
    assert torch.equal(twin(input_ids=ids).logits, model(input_ids=ids).logits)
    with torch.no_grad():
        twin.model.layers[0].mlp.up_proj.weight.zero_()
    assert not torch.equal(twin(input_ids=ids).logits, model(input_ids=ids).logits)


def _broken_traces(seed: int):
    """(model, ids, the stock logits) for a tiny model whose traces raise if they run: only the stock path can
    answer; checked here once."""
    model = tiny_model("qwen2", seed=seed)
    ids = torch.arange(1, 6)[None]
    expected = model(input_ids=ids).logits
    trace_layers(model, "traced")

    def broken(*args):
        raise AssertionError("a traced part ran")

    for layer in model.model.layers:
        layer.forward.after = broken
    with pytest.raises(AssertionError, match="a traced part ran"):
        model(input_ids=ids)
    return model, ids, expected


def test_training_mode_after_tracing_takes_the_stock_path():
    model, ids, expected = _broken_traces(8)
    model.train()  # dropout 0 in the tiny config: the same numbers, through transformers' own layer
    logits = model(input_ids=ids).logits
    assert torch.equal(logits, expected)
    logits.sum().backward()
    assert model.model.layers[0].mlp.up_proj.weight.grad is not None


def test_load_model_traces_cpu_models_by_default():
    assert traced_count(load_model(TINY_TARGET, progress=False).model) > 0
    assert traced_count(load_model(TINY_TARGET, progress=False, layers="eager").model) == 0
    with pytest.raises(ValueError, match="layers 'fast' must be one of"):
        load_model(TINY_TARGET, progress=False, layers="fast")


def test_a_traced_layer_takes_the_stock_path_once_the_traces_no_longer_stand_for_it():
    """Hooks added after tracing (transformers' output capture hooks ``self_attn``, which the traced path never
    calls as a module) and another dtype than traced (``model.to``): the stock forward, and the hooks fire."""
    model, ids, expected = _broken_traces(9)
    seen = []
    handles = [layer.self_attn.register_forward_hook(lambda *a: seen.append(1)) for layer in model.model.layers]
    assert torch.equal(model(input_ids=ids).logits, expected) and len(seen) == 2
    for handle in handles:
        handle.remove()
    with pytest.raises(AssertionError, match="a traced part ran"):  # no hooks left: the traces again
        model(input_ids=ids)
    model.to(torch.float64)
    assert model(input_ids=ids).logits.dtype == torch.float64  # traced for float32: the stock path


def test_tracing_again_compares_with_the_stock_layers():
    model = tiny_model("llama", seed=10)
    assert trace_layers(model, "traced") == 2
    first = [layer.forward for layer in model.model.layers]
    assert trace_layers(model, "traced") == 2  # the probe's reference is the stock forward, not the old traces
    assert all(layer.forward is not old for layer, old in zip(model.model.layers, first))
