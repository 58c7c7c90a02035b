"""K/V of prompt prefixes shared across a worker's requests: a prefix computed once (a system prompt, a chat
template, a few-shot preamble) is copied into the next request that begins with it instead of prefilled again.

Prompts are cut into blocks of ``block`` tokens. A block is cached under (its parent block's id, its tokens), so
a block means its tokens *after exactly that prefix*, as K/V must. ``lookup`` walks a new prompt's blocks from
the first while they are cached (never the block holding the prompt's last token: that token is always
forwarded, the step's root); ``insert``, when a request finishes, caches its prompt's blocks from its session.
Least recently used blocks go first once more than ``max_tokens`` are cached; a chain's first blocks are kept
the most recent, so a prefix is dropped from its end.

The K/V of a block are those of a causal prefill of its prefix: what the request would have computed itself, up
to rounding (computed in another batch, a low-precision forward can round differently; the verifier's exactness
against the target's own logits does not depend on it). One cache per worker (a tensor-parallel rank caches its
own shard; every rank sees the same calls in the same order, so they hit and miss alike).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from sequoia_ray.models.kv_store import KVStore


@dataclass
class Block:
    id: int
    keys: torch.Tensor  # [layers, 1, heads, block, dim]
    values: torch.Tensor


class PrefixCache:
    def __init__(self, block: int = 16, max_tokens: int = 4096) -> None:
        if block < 1:
            raise ValueError(f"prefix block {block} must be >= 1 tokens")
        if max_tokens < block:
            raise ValueError(f"prefix cache of {max_tokens} tokens holds no block of {block}; give >= {block} "
                             "(or no prefix cache)")
        self.block, self.max_tokens = block, max_tokens
        self._blocks: OrderedDict[tuple[int, tuple[int, ...]], Block] = OrderedDict()
        self._ids = 0
        self.reused = 0  # prompt tokens copied from the cache instead of forwarded (statistics)

    @property
    def tokens(self) -> int:
        return len(self._blocks) * self.block

    def lookup(self, prompt: list[int]) -> list[Block]:
        """The cached blocks ``prompt`` begins with, in order (never the block of its last token)."""
        chain, keys = [], []
        for key in self._keys(prompt, (len(prompt) - 1) // self.block):
            if (found := self._blocks.get(key)) is None:
                break
            chain.append(found)
            keys.append(key)
        self._touch(keys)
        self.reused += len(chain) * self.block
        return chain

    def insert(self, prompt: list[int], store: KVStore) -> None:
        """Cache the blocks of ``prompt`` (never the block of its last token) from ``store``, whose first slots
        hold the K/V of a causal prefill of ``prompt``."""
        if store is None or store.keys is None:
            return
        b, keys = self.block, []
        written = min(store.lengths, default=0)  # slots every layer holds (a failed forward may leave some longer)
        for i, key in enumerate(self._keys(prompt, min(len(prompt) - 1, written) // b)):
            if key not in self._blocks:
                self._ids += 1
                self._blocks[key] = Block(self._ids, store.keys[..., i * b : (i + 1) * b, :].clone(),
                                          store.values[..., i * b : (i + 1) * b, :].clone())
            keys.append(key)
        self._touch(keys)
        while self.tokens > self.max_tokens:
            self._blocks.popitem(last=False)

    def _keys(self, prompt: list[int], blocks: int):
        """The keys of ``prompt``'s first ``blocks`` blocks, each made from the previous one's id: a generator
        that reads the cache as it goes (a block not cached ends the chain)."""
        parent = 0
        for i in range(blocks):
            key = (parent, tuple(prompt[i * self.block : (i + 1) * self.block]))
            yield key
            found = self._blocks.get(key)
            if found is None:
                return
            parent = found.id

    def _touch(self, keys: list) -> None:
        """Most recent last, the chain's first block last of all: eviction takes a prefix's end first."""
        for key in reversed(keys):
            self._blocks.move_to_end(key)
