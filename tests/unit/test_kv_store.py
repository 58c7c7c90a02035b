"""KVStore / StoreLayer: every layer's K/V in one buffer; a session on it computes what one on transformers'
DynamicCache computes, and a batched forward copies each request's context in one op."""

from __future__ import annotations

import pytest
import torch
from transformers.cache_utils import DynamicCache, DynamicLayer

from sequoia_ray.models.batch_forward import Segment, hidden_many
from sequoia_ray.models.kv_store import MIN_CAPACITY, KVStore, StoreLayer, store_of, use_store
from sequoia_ray.models.tree_lm import KVSession
from tests.tiny import tiny_model

LAYERS = 3


def _kv(gen: torch.Generator, q: int, batch: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(batch, 2, q, 8, generator=gen), torch.randn(batch, 2, q, 8, generator=gen)


def _cache() -> tuple[DynamicCache, KVStore]:
    cache = DynamicCache()
    cache.layers = [DynamicLayer() for _ in range(LAYERS)]
    return cache, use_store(cache)


def test_layers_append_compact_and_crop_as_dynamic_layers_do():
    """The same forwards (every layer appends), keeps and truncations on a store and on DynamicLayers: equal
    K/V after each, past the first buffer (growth keeps what was there)."""
    gen = torch.Generator().manual_seed(0)
    cache, store = _cache()
    refs = [DynamicLayer() for _ in range(LAYERS)]
    for step in range(50):
        q = 1 + step % 5
        for layer, ref in zip(cache.layers, refs):  # a forward: layer by layer
            k, v = _kv(gen, q)
            got, want = layer.update(k, v), ref.update(k, v)
            assert all(torch.equal(g, w) for g, w in zip(got, want))
        length = refs[0].get_seq_length()
        if step % 3 == 2:  # a tree step: keep a path of the slots
            slots = torch.tensor(sorted(set(range(length - 4)) | {length - 2}))
            store.keep(slots)
            for ref in refs:
                ref.keys, ref.values = ref.keys.index_select(-2, slots), ref.values.index_select(-2, slots)
        if step % 7 == 6:
            store.truncate(store.length - 2)
            for ref in refs:
                ref.crop(-2)
        for layer, ref in zip(cache.layers, refs):
            assert layer.get_seq_length() == ref.get_seq_length() == store.length
            assert torch.equal(layer.keys, ref.keys) and torch.equal(layer.values, ref.values)
    assert store.capacity > MIN_CAPACITY  # the buffer grew


def test_appends_write_in_place_while_there_is_room():
    gen = torch.Generator().manual_seed(1)
    store = KVStore(LAYERS)
    store.append(*(torch.stack([t] * LAYERS) for t in _kv(gen, 3)))
    buffer = store.keys.data_ptr()
    for _ in range(MIN_CAPACITY - 3):
        store.append(*(torch.stack([t] * LAYERS) for t in _kv(gen, 1)))
    assert store.keys.data_ptr() == buffer and store.length == MIN_CAPACITY  # no copy of the cache
    store.keep(torch.arange(0, MIN_CAPACITY, 2))
    store.truncate(10)
    assert store.keys.data_ptr() == buffer and store.length == 10
    k, v = (torch.stack([t] * LAYERS) for t in _kv(gen, MIN_CAPACITY))
    store.append(k, v)  # beyond the room: a larger buffer, the old contents kept
    assert store.keys.data_ptr() != buffer and store.length == 10 + MIN_CAPACITY
    assert torch.equal(store.keys[..., 10:, :], k)


def test_k_and_v_unlike_the_store_are_refused():
    cache, _ = _cache()
    cache.layers[0].update(*_kv(torch.Generator().manual_seed(2), 2))
    with pytest.raises(ValueError, match="every layer needs the same K/V heads and size"):
        cache.layers[1].update(torch.zeros(1, 4, 1, 8), torch.zeros(1, 4, 1, 8))  # 4 heads, not 2


def test_k_and_v_change_only_through_the_store():
    cache, _ = _cache()
    with pytest.raises(NotImplementedError, match="through update"):
        cache.layers[0].keys = torch.zeros(1, 2, 3, 8)


def test_a_cache_with_filled_or_other_layers_keeps_them():
    cache = DynamicCache()
    cache.layers = [DynamicLayer(), DynamicLayer()]
    cache.layers[0].update(*_kv(torch.Generator().manual_seed(3), 2))
    assert use_store(cache) is None and store_of(cache) is None
    assert all(type(layer) is DynamicLayer for layer in cache.layers)


def test_a_session_computes_what_a_dynamic_cache_session_computes():
    """Prefill, tree steps, compactions and a truncation on the tiny model (fp32): the same logits, to rounding,
    as a session on transformers' own DynamicCache."""
    model = tiny_model("qwen2", seed=0)
    ours, ref = KVSession(model), KVSession(model)
    ref.cache = DynamicCache(config=model.config)
    assert isinstance(ours.cache.layers[0], StoreLayer) and store_of(ref.cache) is None
    gen = torch.Generator().manual_seed(4)
    prompt = torch.randint(3, 90, (70,), generator=gen)
    for session in (ours, ref):
        session.forward(prompt, torch.arange(70))
    tree = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)  # a root and its two children
    for step in range(6):
        tokens = torch.randint(3, 90, (3,), generator=gen)
        length = ours.length
        positions = torch.tensor([length, length + 1, length + 1])
        got, want = (s.forward(tokens, positions, tree) for s in (ours, ref))
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        keep = torch.cat([torch.arange(length), torch.tensor([length, length + 1 + step % 2])])
        for session in (ours, ref):
            session.keep(keep)
        if step == 3:
            for session in (ours, ref):
                session.truncate(length + 1)
        assert ours.length == ref.length


def test_a_batched_forward_needs_store_sessions():
    model = tiny_model("qwen2", seed=0)
    plain = KVSession(model)
    plain.cache = DynamicCache(config=model.config)
    segments = [Segment(s, torch.tensor([5]), torch.tensor([0])) for s in (KVSession(model), plain)]
    with pytest.raises(ValueError, match="KVStore"):
        hidden_many(model, segments)


@pytest.mark.parametrize("case", ["identity", "first moves", "prefix then path", "random"])
def test_a_keep_leaves_every_slot_as_a_gather_would(case):
    """``keep`` copies only from the first slot that moves: whatever ``slots`` (none moving, the first, a kept
    prefix then a path, random increasing), the store equals the gather of every slot."""
    gen = torch.Generator().manual_seed(2)
    store = KVStore(LAYERS)
    store.append(*(torch.stack([t] * LAYERS) for t in _kv(gen, 40)))
    before_k, before_v = store.keys[..., :40, :].clone(), store.values[..., :40, :].clone()
    slots = {"identity": torch.arange(40), "first moves": torch.arange(1, 40),
             "prefix then path": torch.tensor([*range(30), 31, 34, 39]),
             "random": torch.randperm(40, generator=gen)[:17].sort().values}[case]
    store.keep(slots)
    assert store.length == slots.numel()
    assert torch.equal(store.keys[..., : slots.numel(), :], before_k.index_select(-2, slots))
    assert torch.equal(store.values[..., : slots.numel(), :], before_v.index_select(-2, slots))


def test_a_keep_of_slots_past_the_end_is_refused():
    """Slots 0..n-1 with n past the cache read as "every slot in place": the cache grew by slots never written."""
    gen = torch.Generator().manual_seed(2)
    store = KVStore(LAYERS)
    store.append(*(torch.stack([t] * LAYERS) for t in _kv(gen, 3)))
    with pytest.raises(ValueError, match="slot 3 and on are not in the cache of 3 slots"):
        store.keep(range(6))
    assert store.length == 3
    session = KVSession(tiny_model("qwen2", seed=0))
    session.forward(torch.tensor([5, 6, 7]), torch.arange(3))
    with pytest.raises((AssertionError, ValueError)):
        session.keep(list(range(6)))
    assert session.length == 3
