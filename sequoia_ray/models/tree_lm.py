"""Tree forward passes and KV compaction over any transformers causal LM that accepts 4D masks.

One ``KVSession`` per request and model: a ``DynamicCache`` (its layers views of one ``KVStore``) whose first
``length`` slots hold the K/V of committed tokens. ``forward`` appends q new tokens that may attend to every cached slot plus the new
tokens allowed by ``allowed`` (a tree: each node sees its ancestors), with explicit positions; the mask is a
*float additive* 4D mask (0 = attend, finfo.min = blocked), correct under both eager and SDPA attention.
``keep`` compacts the cache to a chosen list of slots (the accepted path), contiguous, in place.

Devices: the session works on its model's device (``device``); the mask and cache positions are built
there, and the callers pass ``tokens``, ``positions``, ``allowed`` and ``slots`` already on it.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # transformers is imported where a cache is made: a process that only routes calls
    from transformers import DynamicCache, PreTrainedModel  # (the ingress, a deployment) never loads it


@functools.cache
def cache_keyword(decoder_class: type) -> str:
    """A decoder's keyword for its cache: ``cache`` where its forward has one (transformers 5.x, which
    deprecates ``past_key_values`` and warns at every call), else ``past_key_values`` (4.x)."""
    return "cache" if "cache" in inspect.signature(decoder_class.forward).parameters else "past_key_values"


def new_cache(model: PreTrainedModel) -> DynamicCache:
    """An empty transformers cache for ``model``; its layers share one ``KVStore`` when they are all
    full-attention (``sequoia_ray.models.kv_store``: appends in place, one copy per request per step)."""
    from transformers import DynamicCache

    from sequoia_ray.models.kv_store import use_store

    cache = DynamicCache(config=model.config)
    use_store(cache)
    return cache


@dataclass
class KVSession:
    model: PreTrainedModel
    cache: DynamicCache = field(init=False)

    def __post_init__(self) -> None:
        self.cache = new_cache(self.model)

    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def length(self) -> int:
        return self.cache.get_seq_length()

    def forward(
        self,
        tokens: torch.Tensor,  # [q] int64
        positions: torch.Tensor,  # [q] int64, absolute positions
        allowed: torch.Tensor | None = None,  # [q, past + q - tree_start] bool, True = may attend
        tree_start: int | None = None,  # slots before this are visible to all new tokens (default: past)
    ) -> torch.Tensor:  # [q, V] float32 logits
        """``hidden`` then ``head`` for every new token."""
        return self.head(self.hidden(tokens, positions, allowed, tree_start))

    @torch.inference_mode()
    def hidden(
        self,
        tokens: torch.Tensor,  # [q] int64
        positions: torch.Tensor,  # [q] int64, absolute positions
        allowed: torch.Tensor | None = None,  # [q, past + q - tree_start] bool, True = may attend
        tree_start: int | None = None,  # slots before this are visible to all new tokens (default: past)
    ) -> torch.Tensor:  # [q, H] final hidden states (after the last norm, before the LM head)
        """Append ``tokens``; slots >= ``tree_start`` (cached or new) are visible as ``allowed`` says."""
        q, past, device = tokens.shape[0], self.length, self.device
        start = past if tree_start is None else tree_start
        if allowed is None:
            assert start == past, "a causal forward has no tree region in the cache"
            allowed = torch.ones(q, q, dtype=torch.bool, device=device).tril_()
        assert allowed.shape == (q, past + q - start), f"allowed {tuple(allowed.shape)} != {(q, past + q - start)}"
        for name, t in (("tokens", tokens), ("positions", positions), ("allowed", allowed)):
            assert t.device == device, f"{name} on {t.device}, model on {device}: build it with device=session.device"
        if device.type == "cpu":  # free here; on an accelerator the read would sync every forward
            assert bool(allowed[:, past - start :].diagonal().all()), "every token must attend to itself"
        dtype = self.model.dtype
        mask = torch.zeros(1, 1, q, past + q, dtype=dtype, device=device)
        mask[0, 0, :, start:].masked_fill_(~allowed, torch.finfo(dtype).min)
        decoder = self.model.get_decoder()
        try:
            out = decoder(
                input_ids=tokens[None],
                position_ids=positions[None],
                attention_mask=mask,
                cache_position=torch.arange(past, past + q, device=device),
                use_cache=True,
                **{cache_keyword(type(decoder)): self.cache},
            )
        except BaseException:  # an interrupt too, as the ragged layout's rollback
            # layers before the failing one have appended their K/V: every layer back to ``past``, or the cache
            # holds slots some layers never wrote (a prefix cache then kept them for every later request)
            try:
                self.truncate(past)
            except Exception:  # noqa: BLE001 - a device the error left unusable: the original error says why
                pass
            raise
        return out.last_hidden_state[0]

    @torch.inference_mode()
    def head(self, hidden: torch.Tensor) -> torch.Tensor:  # [k, H] -> [k, V] float32 logits
        """The LM head (with the model's final logit soft-capping, if it has one) on chosen rows only; an id a
        draft's head leaves out (``models.draft_vocab``) stays at -inf through the capping."""
        logits = self.model.get_output_embeddings()(hidden)
        cap = getattr(self.model.config, "final_logit_softcapping", None)
        if cap:
            logits = torch.where(logits == float("-inf"), logits, torch.tanh(logits / cap) * cap)
        return logits.float()

    def keep(self, slots) -> None:  # slots: [m] ints, increasing, into the current cache (host sequence or tensor)
        """Compact the cache to ``slots`` (in order), dropping every other slot. The slots are checked and
        compared on the host (the callers build them there): on an accelerator, each read of a device tensor
        would be a sync."""
        from sequoia_ray.models.kv_store import first_moved, store_of

        slots = slots.tolist() if isinstance(slots, torch.Tensor) else slots
        first = first_moved(slots)
        tail = slots[first:]  # the slots that move: after the first one, each past the one before
        assert first <= self.length and all(a < b for a, b in zip(tail, tail[1:])) and (
            not tail or tail[-1] < self.length), "bad slots"
        if first == len(slots) == self.length:
            return  # every slot, in place
        store = store_of(self.cache)
        if store is not None:
            store.keep(slots)
            return
        index = torch.tensor(slots, dtype=torch.long, device=self.device)
        for layer in self.cache.layers:
            if not getattr(layer, "is_initialized", False):
                continue
            assert not layer.is_sliding, "KV compaction supports full-attention layers only"
            layer.keys = layer.keys.index_select(-2, index)
            layer.values = layer.values.index_select(-2, index)

    def truncate(self, length: int) -> None:
        """Drop every slot at or after ``length``, in every layer: a store's layers are cut whatever layer 0's
        length says (after a failed forward layer 0 may be one the forward did not reach)."""
        from sequoia_ray.models.kv_store import store_of

        store = store_of(self.cache)
        if store is not None:
            store.truncate(length)  # moves no data: each layer's length is min(its length, ``length``)
        elif length < self.length:
            self.keep(range(length))


