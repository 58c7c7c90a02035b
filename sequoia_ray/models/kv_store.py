"""Every layer's K/V of one cache in one buffer with room to grow: a step copies a request's K/V in one op.

transformers' ``DynamicLayer`` holds each layer's K/V in its own tensor and appends with ``torch.cat`` (a copy
of the whole cache per call). A batched step (``batch_forward``) copies each request's K/V into the step's
temporary cache and the new K/V back: per layer and request, so at B = 8 on the 28-layer target some 2,000
small copies, ``cat``s and fills a step (~16 of ~95 ms a decode step on the 2-core EPYC). Here a cache's
layers are views of one ``KVStore``: keys ``[layers, batch, heads, capacity, dim]`` and values alike, grown by
doubling. Copying a request's whole context into a batch, or its new K/V back, is one op for keys and one for
values; an append writes in place; a compaction (``keep``) is one gather; a truncation moves no data.

``StoreLayer`` keeps ``DynamicLayer``'s interface (``keys`` / ``values``: ``[batch, heads, length, dim]``,
views; ``update`` appends and returns them) so transformers' models use it unchanged. Every layer must have
the same K (and V) head count and size (an error otherwise). Writes run in inference mode (the buffers are
made there, during forwards; this project only infers).
"""

from __future__ import annotations

import bisect

import torch
from transformers.cache_utils import DynamicLayer

MIN_CAPACITY = 64  # slots a store starts with


def first_moved(slots) -> int:
    """The first i with ``slots[i] != i`` (``len(slots)`` if none), for increasing ``slots`` >= 0: ``slots[i] - i``
    never decreases, so a binary search finds it (a verdict keeps thousands of context slots, then a path)."""
    return bisect.bisect_left(range(len(slots)), True, key=lambda i: slots[i] != i)


class KVStore:
    def __init__(self, layers: int) -> None:
        self.keys: torch.Tensor | None = None  # [layers, batch, heads, capacity, key dim]
        self.values: torch.Tensor | None = None  # [layers, batch, heads, capacity, value dim]
        self.lengths = [0] * layers  # filled slots per layer (equal between forwards)

    def hold(self, keys: torch.Tensor, values: torch.Tensor, length: int) -> None:
        """Take ``keys`` / ``values`` (``[layers, batch, heads, capacity, dim]``) as the buffers, their first
        ``length`` slots filled: the next writes go after them."""
        layers = len(self.lengths)
        assert keys.shape[0] == layers, f"{keys.shape[0]} layers of K/V for a {layers}-layer store"
        self.keys, self.values, self.lengths = keys, values, [length] * layers

    @property
    def length(self) -> int:
        return max(self.lengths, default=0)

    @property
    def capacity(self) -> int:
        return 0 if self.keys is None else self.keys.shape[-2]

    @torch.inference_mode()
    def reserve(self, key_states: torch.Tensor, value_states: torch.Tensor, end: int) -> None:
        """Room for ``end`` slots of K/V shaped like ``key_states`` / ``value_states`` (``[batch, heads, q, dim]``)."""
        if self.keys is not None:
            if _rows(self.keys) != _rows(key_states, stored=False) or _rows(self.values) != _rows(value_states,
                                                                                            stored=False):
                raise ValueError(f"K/V {tuple(key_states.shape)} / {tuple(value_states.shape)} do not match the "
                                 f"cache's {tuple(self.keys.shape)} / {tuple(self.values.shape)} ([layers, batch, "
                                 "heads, slots, dim]): every layer needs the same K/V heads and size")
            if end <= self.capacity:
                return
        capacity = max(end, 2 * self.length, MIN_CAPACITY)
        layers, filled = len(self.lengths), self.length
        keys = key_states.new_empty(layers, *key_states.shape[:2], capacity, key_states.shape[3])
        values = value_states.new_empty(layers, *value_states.shape[:2], capacity, value_states.shape[3])
        if filled:
            keys[..., :filled, :], values[..., :filled, :] = self.keys[..., :filled, :], self.values[..., :filled, :]
        self.keys, self.values = keys, values

    @torch.inference_mode()
    def write(self, layer: int, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Append ``key_states`` / ``value_states`` (``[batch, heads, q, dim]``) to one layer, during a forward."""
        start = self.lengths[layer]
        end = start + key_states.shape[-2]
        self.reserve(key_states, value_states, end)
        self.keys[layer, :, :, start:end], self.values[layer, :, :, start:end] = key_states, value_states
        self.lengths[layer] = end

    @torch.inference_mode()
    def append(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Append ``keys`` / ``values`` (``[layers, batch, heads, q, dim]``) to every layer at once."""
        length, q = self.length, keys.shape[-2]
        assert all(n == length for n in self.lengths), "append between forwards only (every layer equally long)"
        self.reserve(keys[0], values[0], length + q)
        self.keys[..., length : length + q, :], self.values[..., length : length + q, :] = keys, values
        self.lengths = [length + q] * len(self.lengths)

    @torch.inference_mode()
    def keep(self, slots) -> None:  # slots: [m] ints, increasing (a host sequence, or a tensor: read once)
        """Compact every layer to ``slots`` (in order), in place. Only the slots from the first one that moves
        are copied: a verdict keeps the whole context and a path of the tree after it, and copying the context
        onto itself cost ~1 ms a request and step at 300 tokens on the 28-layer target (2-core Xeon). Which
        slot moves first is found on the host: on an accelerator, reading it back would be a sync per keep."""
        if self.keys is None:
            return
        slots = slots.tolist() if isinstance(slots, torch.Tensor) else slots
        length, m = self.length, len(slots)
        first = first_moved(slots)
        if first > length:  # "in place" past the end: the store would grow by slots never written
            raise ValueError(f"keep: slot {length} and on are not in the cache of {length} slots")
        if first < m:
            tail = torch.tensor(slots[first:], dtype=torch.long, device=self.keys.device)
            self.keys[..., first:m, :] = self.keys[..., :length, :].index_select(-2, tail)
            self.values[..., first:m, :] = self.values[..., :length, :].index_select(-2, tail)
        self.lengths = [m] * len(self.lengths)

    def truncate(self, length: int) -> None:
        """Drop every slot at or after ``length`` (no data moves)."""
        self.lengths = [min(n, length) for n in self.lengths]


def _rows(t: torch.Tensor, stored: bool = True) -> tuple:
    """(batch, heads, dim, dtype) of a store's ``[layers, batch, heads, slots, dim]``, or of new K/V
    ``[batch, heads, q, dim]``."""
    b, h, d = (t.shape[1], t.shape[2], t.shape[4]) if stored else (t.shape[0], t.shape[1], t.shape[3])
    return b, h, d, t.dtype


class StoreLayer(DynamicLayer):
    """Layer ``index`` of a ``KVStore``, as transformers' models expect a cache layer."""

    def __init__(self, store: KVStore, index: int) -> None:
        self.store, self.index = store, index
        super().__init__()
        self.is_initialized = store.keys is not None

    @property
    def keys(self) -> torch.Tensor | None:
        store = self.store
        return None if store.keys is None else store.keys[self.index, :, :, : store.lengths[self.index]]

    @keys.setter
    def keys(self, tensor: torch.Tensor | None) -> None:
        if tensor is not None:
            raise NotImplementedError("a StoreLayer's K/V change through update, or its KVStore's methods")

    @property
    def values(self) -> torch.Tensor | None:
        store = self.store
        return None if store.values is None else store.values[self.index, :, :, : store.lengths[self.index]]

    @values.setter
    def values(self, tensor: torch.Tensor | None) -> None:
        if tensor is not None:
            raise NotImplementedError("a StoreLayer's K/V change through update, or its KVStore's methods")

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device, self.is_initialized = key_states.device, True

    @torch.inference_mode()
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append ``key_states`` / ``value_states`` (``[batch, heads, q, dim]``); the layer's whole K/V back."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.store.write(self.index, key_states, value_states)
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.store.lengths[self.index]

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError(f"crop({tokens_to_remove}): give a negative count of tokens to remove")
        self.store.lengths[self.index] = max(0, self.store.lengths[self.index] + tokens_to_remove)

    def reset(self) -> None:
        self.store.lengths[self.index] = 0
        self.is_initialized = self.store.keys is not None


def use_store(cache, store: KVStore | None = None) -> KVStore | None:
    """Make ``cache``'s layers views of one ``store`` (a new one by default), in place, when every layer is a
    full-attention ``DynamicLayer`` not yet filled; the store, or None (the cache is left as it was)."""
    if not cache.layers or any(type(layer) is not DynamicLayer or layer.is_initialized for layer in cache.layers):
        return None
    store = store if store is not None else KVStore(len(cache.layers))
    cache.layers = [StoreLayer(store, i) for i in range(len(cache.layers))]
    return store


def store_of(cache) -> KVStore | None:
    """The ``KVStore`` behind ``cache``'s layers (None: its layers are transformers' own)."""
    first = cache.layers[0] if cache.layers else None
    return first.store if isinstance(first, StoreLayer) else None
