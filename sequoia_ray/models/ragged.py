"""The ``ragged`` batch layout: one forward for several requests, each attending to its own K/V in place.

``padded`` and ``flat`` (``batch_forward``) copy every request's whole context into a temporary cache each step
and the new K/V back out: at B = 8 decode steps of the 1.5B target (contexts 64-420) ``torch.profiler`` put
those copies and fills at ~24 of ~112 ms a step, more than attention itself, and they grow with the context.
Here nothing is copied. The weights still run once over every request's new tokens, one after another
(``[1, sum q]``, as ``flat``); only attention is per request:

- the layers' cache is a ``RaggedCache``: its ``update`` writes each request's new K/V rows straight into that
  request's own ``KVStore`` (every layer one buffer, ``kv_store``) and hands the layer's inputs back;
- the attention function (registered with transformers' ``AttentionInterface`` as ``sequoia_ragged``; the
  model's config names it for the duration of the forward only) runs, per request, one SDPA call of that
  request's query rows over its store, a view of its ``past + q`` slots, with the request's additive mask
  (``None`` for a decode token that sees every slot: nothing to build). The query heads that share a K/V
  head are packed as rows of that call (GQA without repeating K/V).

So a token attends only to its own request's context and to what its own ``allowed`` rows grant, and
attention costs each request's own context, not the batch's longest (``padded``) or its sum (``flat``). The
cost is one small attention call per request and layer (~30 us on the CPU here). What each layer does per request
beyond it is kept to views made once a forward (at the first layer, where each store also gets room for its new
rows): one ``_foreach_copy_`` writes every request's new K/V of a layer, one ``split`` hands out the queries.
Against slicing and writing store by store in every layer (sessions 20-32), at B = 8 that took a draft level
(int8 0.5B, a token a request) from 43.5 to 40.0 ms (0.92x) and a decode step of the bf16 1.5B target from 166.0
to 157.4 ms (0.95x): paired medians of 15 in one process, contexts 64-420, bitwise the same hidden states
(session 33; README, "Session 33").

A forward that fails leaves every store as long as it was (the rows written are truncated away), so the
sessions stay the single home of each request's state and a failed batch can be retried request by request.
A forward in which some layer did not go through this cache and attention (a model whose layers dispatch
another way would attend over the batch's new tokens only, across requests) fails the same way, by name.
The config's name is counted per config, so forwards overlapping in threads restore it only when the last ends.

Needs a model whose attention goes through transformers' ``AttentionInterface`` with SDPA (``supports``):
the padded and flat layouts remain for the others (eager attention, custom modelling code).
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from sequoia_ray.models.tree_lm import cache_keyword

if TYPE_CHECKING:
    from sequoia_ray.models.batch_forward import Segment
    from sequoia_ray.models.kv_store import KVStore

NAME = "sequoia_ragged"
SUPPORTED = ("sdpa", NAME)  # the model's own attention implementation must be one of these


@dataclass
class Rows:
    """One request's rows of the flat batch: queries ``start : start + q``, K/V in ``store``."""
    store: KVStore
    start: int
    q: int
    mask: torch.Tensor | None  # [1, 1, groups * q, past + q] additive float, tiled per GQA group; None = all visible


@dataclass
class _Forward:
    """One ragged forward in flight: its rows, how many layers went through its cache and attention, and per
    request the views of its store that every layer writes and reads (made at the first layer)."""
    rows: list[Rows]
    updates: int = 0
    attends: int = 0
    sizes: list[int] = field(default_factory=list)  # new tokens per request: the split of the flat batch
    ends: list[int] = field(default_factory=list)  # each store's length once a layer is written
    # per request, per layer, views of its store: the new rows [1, kv heads, q, dim] and all rows [.., past + q, ..]
    new_keys: list[tuple[torch.Tensor, ...]] = field(default_factory=list)
    new_values: list[tuple[torch.Tensor, ...]] = field(default_factory=list)
    keys: list[tuple[torch.Tensor, ...]] = field(default_factory=list)
    values: list[tuple[torch.Tensor, ...]] = field(default_factory=list)

    def prepare(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Room in every store for its new rows, and the per-layer views of them; ``key_states`` /
        ``value_states``: the first layer's new K/V, ``[1, kv heads, sum q, dim]`` (what a store is made like)."""
        self.sizes = [r.q for r in self.rows]
        for r in self.rows:
            store, rows = r.store, slice(r.start, r.start + r.q)
            start, end = store.length, store.length + r.q
            store.reserve(key_states[:, :, rows], value_states[:, :, rows], end)
            self.ends.append(end)
            self.new_keys.append(store.keys[:, :, :, start:end].unbind(0))
            self.new_values.append(store.values[:, :, :, start:end].unbind(0))
            self.keys.append(store.keys[:, :, :, :end].unbind(0))
            self.values.append(store.values[:, :, :, :end].unbind(0))


_active: ContextVar[_Forward | None] = ContextVar("sequoia_ragged_forward", default=None)


class RaggedCache:
    """The cache a ragged forward's layers see: ``update`` appends each request's new K/V to its own store."""

    def __init__(self, forward: _Forward) -> None:
        self.forward = forward

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs
               ) -> tuple[torch.Tensor, torch.Tensor]:  # [1, kv heads, sum q, dim] each, handed back
        forward = self.forward  # runs inside ``run``'s inference mode
        if not forward.updates:
            forward.prepare(key_states, value_states)
        forward.updates += 1
        targets = [views[layer_idx] for views in forward.new_keys] + [views[layer_idx] for views in forward.new_values]
        torch._foreach_copy_(targets, [*key_states.split(forward.sizes, 2), *value_states.split(forward.sizes, 2)])
        for r, end in zip(forward.rows, forward.ends):
            r.store.lengths[layer_idx] = end
        return key_states, value_states

    def get_seq_length(self, layer_idx: int = 0) -> int:  # positions are always given: no model reads this
        return 0


def attention(module, query, key, value, attention_mask, scaling: float | None = None, **kwargs):
    """transformers' attention signature; per request under a ragged forward, plain SDPA otherwise."""
    forward = _active.get()
    if forward is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, **kwargs)
    if kwargs.get("softcap") is not None or kwargs.get("sliding_window") is not None:
        raise ValueError("the ragged layout has no logit soft-capping or sliding window: use layout 'flat' or 'padded'")
    layer, (_, heads, _, dim) = module.layer_idx, query.shape  # query: [1, heads, sum q, dim]
    forward.attends += 1
    out = []
    for r, queries, keys_of, values_of in zip(forward.rows, query.split(forward.sizes, 2), forward.keys,
                                              forward.values):
        keys, values = keys_of[layer], values_of[layer]  # [1, kv heads, past + q, dim], store views: nothing copied
        kv_heads = keys.shape[1]
        # GQA without repeating K/V: the query heads that share a K/V head become rows of one attention
        # ([1, kv heads, groups * q, dim]) under the request's mask tiled per group; far cheaper on the CPU
        # kernel than SDPA's enable_gqa (20 against 195 us for one decode token over 200 slots)
        packed = queries.reshape(1, kv_heads, heads // kv_heads * r.q, dim)
        assert r.mask is None or r.mask.shape[2] == packed.shape[2], "the mask is tiled for another GQA grouping"
        o = torch.nn.functional.scaled_dot_product_attention(packed, keys, values, attn_mask=r.mask, scale=scaling)
        # [1, kv heads, groups * q, value dim] -> [1, heads, q, value dim]; reshape, not view: a kernel may hand
        # back another memory layout (CUDA's memory-efficient kernel returns a transposed view)
        out.append(o.reshape(1, heads, r.q, values.shape[-1]))
    return torch.cat(out, dim=2).transpose(1, 2), None  # [1, sum q, heads, value dim]


def supports(model) -> bool:
    return getattr(model.config, "_attn_implementation", None) in SUPPORTED


_lock = threading.Lock()
_users: dict[int, list] = {}  # id(config) -> [ragged forwards in flight on it, its own attention implementation]


@contextmanager
def _attending(model, forward: _Forward):
    """The model's layers name the ragged attention while this forward runs (counted per config, so that
    overlapping forwards on one model in several threads restore the model's own name only when the last
    ends; a thread's forward that is not ragged still gets plain SDPA from ``attention``)."""
    from transformers import AttentionInterface

    configs = list({id(c): c for c in (model.config, model.get_decoder().config)}.values())
    with _lock:
        if NAME not in AttentionInterface._global_mapping:
            AttentionInterface.register(NAME, attention)
        for config in configs:
            entry = _users.setdefault(id(config), [0, config._attn_implementation_internal])
            entry[0] += 1
            config._attn_implementation_internal = NAME  # every layer reads its config at each call
    token = _active.set(forward)
    try:
        yield
    finally:
        _active.reset(token)
        with _lock:
            for config in configs:
                entry = _users[id(config)]
                entry[0] -= 1
                if not entry[0]:
                    config._attn_implementation_internal = entry[1]
                    del _users[id(config)]


@torch.inference_mode()
def run(model, segments: list[Segment], stores: list[KVStore], device) -> list[torch.Tensor]:
    """``[q_b, H]`` final hidden states per segment; each segment's K/V appended to its own store."""
    if not supports(model):
        raise ValueError(f"the ragged layout needs SDPA attention, not {model.config._attn_implementation!r}: "
                         "load the model with attn_implementation='sdpa' or use layout 'flat' or 'padded'")
    dtype, blocked = model.dtype, torch.finfo(model.dtype).min
    config = model.config
    groups = config.num_attention_heads // (getattr(config, "num_key_value_heads", None) or config.num_attention_heads)
    rows, start = [], 0
    for s, store in zip(segments, stores):
        mask = None
        if not s.sees_all:  # a tree, or causal new tokens: the request's own additive mask, once per forward
            seen = s.visible()  # [q, past + q] bool
            mask = torch.zeros(1, 1, *seen.shape, dtype=dtype, device=device).masked_fill_(~seen, blocked)
            # [1, 1, groups * q, past + q]: the rows of every query head sharing a K/V head, as attention packs them
            mask = mask.repeat(1, 1, groups, 1)
        rows.append(Rows(store, start, s.q, mask))
        start += s.q
    ids = torch.cat([s.tokens for s in segments])[None]  # [1, sum q]
    positions = torch.cat([s.positions for s in segments])[None]  # [1, sum q]
    placeholder = torch.zeros(1, 1, 1, 1, dtype=dtype, device=device)  # 4D: models take it as prepared, unused
    lengths = [store.length for store in stores]
    forward, decoder = _Forward(rows), model.get_decoder()
    try:
        with _attending(model, forward):
            hidden = decoder(input_ids=ids, position_ids=positions, attention_mask=placeholder, use_cache=True,
                             **{cache_keyword(type(decoder)): RaggedCache(forward)}).last_hidden_state[0]
        _check(forward, stores, lengths, segments)
    except BaseException:
        for store, length in zip(stores, lengths):
            store.truncate(length)  # layers written before the failure: back to the forward's start
        raise
    return list(hidden.split([s.q for s in segments]))  # sum q x [H] -> [q_b, H] each


def _check(forward: _Forward, stores: list[KVStore], lengths: list[int], segments: list[Segment]) -> None:
    """Every layer went through the ragged cache and attention, and every store grew by its segment's tokens
    in every layer: else some layer attended another way (over the batch's new tokens only, across requests)."""
    layers = len(stores[0].lengths)
    grown = all(store.lengths == [n + s.q] * layers for store, n, s in zip(stores, lengths, segments))
    if forward.updates != layers or forward.attends != layers or not grown:
        raise RuntimeError(f"the ragged layout saw {forward.updates} cache updates and {forward.attends} attention "
                           f"calls for {layers} layers: this model's layers do not all attend through transformers' "
                           "AttentionInterface and cache; use layout 'flat' or 'padded'")
