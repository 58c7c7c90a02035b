"""Oracle for the batched forward: one forward over several sessions == each session's own forward, in every
layout, for ragged batches (different context lengths, trees, an empty cache, a prefill beside trees) and for
decode steps of one token each (which ``auto`` runs ragged under SDPA, padded under eager attention)."""

from __future__ import annotations

import pytest
import torch

from sequoia_ray.models import batch_forward
from sequoia_ray.models.batch_forward import LAYOUTS, Segment, hidden_many, resolve_layout
from sequoia_ray.models.tree_lm import KVSession
from sequoia_ray.tree.plan import chain, from_nested, k_ary
from tests.tiny import VOCAB, tiny_model


def _requests(seed: int):
    """(cached prefix length, new segment kind, plan) per request: ragged on every axis."""
    return [(7, "tree", from_nested([[[[]], []], [], [[], [[], []]]])),
            (0, "prefill", None),  # a first call: nothing cached yet, 9 causal tokens
            (12, "tree", k_ary(3, 1)),
            (3, "tree", chain(4)),
            (5, "prefill", None)]


def _segment(session: KVSession, kind: str, plan, gen) -> Segment:
    past = session.length
    if kind == "prefill":
        tokens = torch.randint(0, VOCAB, (9,), generator=gen)
        return Segment(session, tokens, torch.arange(past, past + 9))
    tokens = torch.randint(0, VOCAB, (plan.n,), generator=gen)
    base = past - 1  # the tree hangs below the last cached token, which it sees through the cache
    return Segment(session, tokens, base + 1 + torch.tensor(plan.depth), torch.from_numpy(plan.ancestor_mask()))


def _sessions(model, seed: int):
    gen = torch.Generator().manual_seed(seed)
    built = []
    for prefix, kind, plan in _requests(seed):
        session = KVSession(model)
        if prefix:
            session.forward(torch.randint(0, VOCAB, (prefix,), generator=gen), torch.arange(prefix))
        built.append((session, kind, plan))
    return built, gen


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_batched_hidden_and_cache_equal_each_request_alone(layout, attn):
    model = tiny_model("qwen2", attn=attn, seed=4)
    alone, gen_a = _sessions(model, 11)
    batched, gen_b = _sessions(model, 11)
    expected = [s.hidden(seg.tokens, seg.positions, seg.allowed, seg.tree_start)
                for s, seg in ((s, _segment(s, k, p, gen_a)) for s, k, p in alone)]
    segments = [_segment(s, k, p, gen_b) for s, k, p in batched]
    if layout == "ragged" and attn == "eager":  # named, with the fix; nothing appended
        with pytest.raises(ValueError, match="ragged layout needs SDPA attention, not 'eager'.*layout 'flat'"):
            hidden_many(model, segments, layout)
        assert [s.length for s, _, _ in batched] == [7, 0, 12, 3, 5]
        return
    got = hidden_many(model, segments, layout)
    for e, g in zip(expected, got):
        torch.testing.assert_close(g, e, atol=2e-5, rtol=1e-5)
    for (a, _, _), (b, _, _) in zip(alone, batched):  # each request's cache holds exactly its own K/V
        assert a.length == b.length
        for la, lb in zip(a.cache.layers, b.cache.layers):
            torch.testing.assert_close(lb.keys, la.keys, atol=2e-5, rtol=1e-5)
            torch.testing.assert_close(lb.values, la.values, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_request_never_sees_another_requests_tokens(layout):
    """Changing one request's context or tree leaves every other request's hidden states bit for bit."""
    model = tiny_model("llama", seed=2)
    built, gen = _sessions(model, 3)
    segments = [_segment(s, k, p, gen) for s, k, p in built]
    first = [h.clone() for h in hidden_many(model, segments, layout)]
    built2, gen2 = _sessions(model, 3)
    segments2 = [_segment(s, k, p, gen2) for s, k, p in built2]
    segments2[2].tokens = (segments2[2].tokens + 1) % VOCAB  # another request's tree changes
    second = hidden_many(model, segments2, layout)
    for i in (0, 1, 3, 4):
        torch.testing.assert_close(second[i], first[i], atol=1e-6, rtol=1e-6)
    assert not torch.allclose(second[2], first[2])


def test_unknown_layout_is_named():
    model = tiny_model("qwen2")
    with pytest.raises(ValueError, match="layout 'paged' must be one of auto, flat, padded"):
        hidden_many(model, [], "paged")


def _decode_sessions(model, seed: int):
    """Single-token steps over ragged contexts (6, 0, 14 and 11 cached tokens)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for prefix in (6, 0, 14, 11):
        session = KVSession(model)
        if prefix:
            session.forward(torch.randint(0, VOCAB, (prefix,), generator=gen), torch.arange(prefix))
        out.append(Segment(session, torch.randint(0, VOCAB, (1,), generator=gen), torch.tensor([prefix])))
    return out


@pytest.mark.parametrize("attn, layout", [("eager", "padded"), ("sdpa", "ragged")])
def test_auto_runs_single_token_steps_ragged_under_sdpa_else_padded_and_exact(attn, layout, monkeypatch):
    model = tiny_model("qwen2", attn=attn, seed=5)
    expected = [s.session.hidden(s.tokens, s.positions) for s in _decode_sessions(model, 3)]
    ran = []
    runs = {"padded": batch_forward._padded, "ragged": batch_forward.ragged.run}
    monkeypatch.setattr(batch_forward, "_padded", lambda *a: ran.append("padded") or runs["padded"](*a))
    monkeypatch.setattr(batch_forward.ragged, "run", lambda *a: ran.append("ragged") or runs["ragged"](*a))
    monkeypatch.setattr(batch_forward, "_flat", lambda *a: ran.append("flat"))
    segments = _decode_sessions(model, 3)
    got = hidden_many(model, segments)  # the default layout: auto
    assert ran == [layout]
    for e, g in zip(expected, got):
        torch.testing.assert_close(g, e, atol=2e-5, rtol=1e-5)
    assert [s.session.length for s in segments] == [7, 1, 15, 12]
    assert model.config._attn_implementation == attn  # the ragged forward names its attention only while it runs


def test_a_ragged_forward_that_fails_leaves_every_session_as_it_was():
    """A layer that raises halfway: every store back to its length (nothing half-appended), the model's own
    attention restored, and the same batch then runs exactly."""
    model = tiny_model("qwen2", seed=6)
    built, gen = _sessions(model, 5)
    segments = [_segment(s, k, p, gen) for s, k, p in built]
    lengths = [s.length for s, _, _ in built]
    layer = model.get_decoder().layers[1]
    calls = []

    def fail(*args, **kwargs):
        calls.append(1)
        raise RuntimeError("injected")

    hook = layer.register_forward_pre_hook(lambda *a: fail())
    with pytest.raises(RuntimeError, match="injected"):
        hidden_many(model, segments, "ragged")
    hook.remove()
    assert calls and [s.length for s, _, _ in built] == lengths
    assert model.config._attn_implementation == "sdpa"
    alone, gen_a = _sessions(model, 5)
    expected = [s.hidden(seg.tokens, seg.positions, seg.allowed, seg.tree_start)
                for s, seg in ((s, _segment(s, k, p, gen_a)) for s, k, p in alone)]
    for e, g in zip(expected, hidden_many(model, segments, "ragged")):
        torch.testing.assert_close(g, e, atol=2e-5, rtol=1e-5)


def test_auto_is_ragged_only_for_sdpa_models():
    ones = _decode_sessions(tiny_model("qwen2"), 1)
    assert resolve_layout("auto", ones, tiny_model("qwen2", attn="sdpa")) == "ragged"
    assert resolve_layout("auto", ones, tiny_model("qwen2", attn="eager")) == "padded"
    assert resolve_layout("flat", ones, tiny_model("qwen2", attn="sdpa")) == "flat"


def test_auto_flattens_any_batch_with_a_longer_segment():
    model = tiny_model("qwen2")
    ones = _decode_sessions(model, 1)
    longer = Segment(KVSession(model), torch.tensor([1, 2, 3]), torch.arange(3))
    assert resolve_layout("auto", ones) == "padded"
    assert resolve_layout("auto", ones + [longer]) == "flat"
    assert resolve_layout("flat", ones) == "flat" and resolve_layout("padded", [longer, *ones]) == "padded"


def test_auto_flattens_when_one_long_context_would_pad_every_cache():
    """Contexts 6, 0, 14, 11 (sum 31): padded copies 4 x 14 = 56 slots, within 2 x 31; one context of 40 more
    (sum 71) would pad 5 x 40 = 200 slots, past 2 x 71 = 142."""
    model = tiny_model("qwen2")
    ones = _decode_sessions(model, 1)
    session = KVSession(model)
    session.forward(torch.arange(40) % VOCAB, torch.arange(40))
    assert resolve_layout("auto", ones) == "padded"
    assert resolve_layout("auto", ones + [Segment(session, torch.tensor([5]), torch.tensor([40]))]) == "flat"


def _mixed_sessions(model, seed: int):
    """Ragged requests for the ragged layout's own edges: a store that must grow in the middle of the forward
    (60 cached + 9 new tokens crosses its first 64 slots), a decode token (no mask at all), and a draft-like
    level whose tree already has cached nodes (``tree_start`` < past: two children of cached siblings)."""
    gen = torch.Generator().manual_seed(seed)
    grow, decode, level = KVSession(model), KVSession(model), KVSession(model)
    grow.forward(torch.randint(0, VOCAB, (60,), generator=gen), torch.arange(60))
    decode.forward(torch.randint(0, VOCAB, (20,), generator=gen), torch.arange(20))
    level.forward(torch.randint(0, VOCAB, (8,), generator=gen), torch.arange(8))
    level.forward(torch.randint(0, VOCAB, (3,), generator=gen), torch.tensor([8, 8, 8]), torch.eye(3, dtype=torch.bool))
    children = torch.tensor([[1, 0, 0, 1, 0], [0, 0, 1, 0, 1]], dtype=torch.bool)  # under cached nodes 0 and 2
    return [Segment(grow, torch.randint(0, VOCAB, (9,), generator=gen), torch.arange(60, 69)),
            Segment(decode, torch.randint(0, VOCAB, (1,), generator=gen), torch.tensor([20])),
            Segment(level, torch.randint(0, VOCAB, (2,), generator=gen), torch.tensor([9, 9]), children, 8)]


def _alone(model, seed: int):
    return [s.session.hidden(s.tokens, s.positions, s.allowed, s.tree_start) for s in _mixed_sessions(model, seed)]


def test_ragged_grows_a_store_mid_forward_and_mixes_decode_and_cached_tree_rows():
    model = tiny_model("qwen2", seed=7)
    expected = _alone(model, 2)
    segments = _mixed_sessions(model, 2)
    capacity = batch_forward.store_of(segments[0].session.cache).capacity
    got = hidden_many(model, segments, "ragged")
    for e, g in zip(expected, got):
        torch.testing.assert_close(g, e, atol=2e-5, rtol=1e-5)
    store = batch_forward.store_of(segments[0].session.cache)
    assert capacity == 64 and store.capacity > 64 and store.lengths == [69] * len(store.lengths)
    assert [s.session.length for s in segments] == [69, 21, 13]


def test_a_ragged_forward_that_fails_after_a_store_grew_rolls_back():
    model = tiny_model("qwen2", seed=7)
    segments = _mixed_sessions(model, 2)
    hook = model.get_decoder().layers[1].register_forward_pre_hook(lambda *a: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        hidden_many(model, segments, "ragged")
    hook.remove()
    assert [s.session.length for s in segments] == [60, 20, 11]
    for e, g in zip(_alone(model, 2), hidden_many(model, segments, "ragged")):
        torch.testing.assert_close(g, e, atol=2e-5, rtol=1e-5)


def test_a_layer_that_bypasses_the_ragged_attention_is_an_error_not_a_wrong_answer(monkeypatch):
    """Were a model's layers to attend without the registered function (here: the name never set), stock SDPA
    would see only the batch's new tokens, across requests: the forward raises and appends nothing."""
    import contextlib

    from sequoia_ray.models import ragged

    model = tiny_model("qwen2", seed=7)
    segments = _mixed_sessions(model, 2)
    monkeypatch.setattr(ragged, "_attending", lambda model, forward: contextlib.nullcontext())
    with pytest.raises(RuntimeError, match="0 attention calls for 2 layers.*layout 'flat' or 'padded'"):
        hidden_many(model, segments, "ragged")
    assert [s.session.length for s in segments] == [60, 20, 11]


def test_ragged_takes_an_attention_output_in_any_memory_layout(monkeypatch):
    """A kernel may return its output as a transposed view (CUDA's memory-efficient one does): same values."""
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def transposed(*args, **kwargs):
        return sdpa(*args, **kwargs).transpose(1, 2).contiguous().transpose(1, 2)

    model = tiny_model("qwen2", seed=7)
    expected = _alone(model, 2)
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", transposed)
    for e, g in zip(expected, hidden_many(model, _mixed_sessions(model, 2), "ragged")):
        torch.testing.assert_close(g, e, atol=2e-5, rtol=1e-5)


def test_ragged_forwards_overlapping_in_threads_restore_the_models_own_attention():
    import threading

    model = tiny_model("qwen2", seed=7)
    expected = _alone(model, 2)
    results, errors = [], []

    def run():
        try:
            results.append(hidden_many(model, _mixed_sessions(model, 2), "ragged"))
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=run) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(results) == 4
    for got in results:
        for e, g in zip(expected, got):
            torch.testing.assert_close(g, e, atol=2e-5, rtol=1e-5)
    assert model.config._attn_implementation == "sdpa"


@pytest.mark.parametrize("attn, layout, ran_ragged", [("sdpa", "auto", True), ("sdpa", "flat", False),
                                                     ("eager", "auto", False)])
def test_a_lone_request_runs_ragged_where_a_batch_would_and_matches_its_session(attn, layout, ran_ragged,
                                                                                 monkeypatch):
    """One segment (a tree level with cached siblings, a decode token, a prefill growing its store) takes the
    ragged path under SDPA and ``auto`` (packed GQA, in-place K/V) and ``KVSession.hidden`` otherwise: the same
    hidden states and the same stores either way. fp32, so the two paths agree to rounding."""
    model = tiny_model("qwen2", attn=attn, seed=7)
    expected = _alone(model, 3)
    ran = []
    run = batch_forward.ragged.run
    monkeypatch.setattr(batch_forward.ragged, "run", lambda *a: ran.append(len(a[1])) or run(*a))
    segments = _mixed_sessions(model, 3)
    got = [hidden_many(model, [s], layout)[0] for s in segments]
    assert ran == ([1, 1, 1] if ran_ragged else [])
    for e, g in zip(expected, got):
        torch.testing.assert_close(g, e, atol=2e-5, rtol=1e-5)
    assert [s.session.length for s in segments] == [69, 21, 13]
    again = _mixed_sessions(model, 3)  # and the next forward sees the K/V the lone one wrote
    for s, t in zip(segments, again):
        t.session.hidden(t.tokens, t.positions, t.allowed, t.tree_start)
    nxt = [Segment(s.session, torch.tensor([3]), torch.tensor([s.session.length])) for s in segments + again]
    out = [hidden_many(model, [n], layout)[0] for n in nxt]
    for a, b in zip(out[:3], out[3:]):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-5)
