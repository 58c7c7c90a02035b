"""Per-request state shared by the draft and target workers: a KV session, the committed tokens, the
sampling parameters and the request's own random generator, in a table keyed by request id.

The generator lives where the worker samples (``generator_device``): the draft draws children on its model's
device, so its generator is created there (a CUDA sampling op needs a CUDA generator); the target walks the
verified tree on the host, so its generator is a host generator."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from sequoia_ray.batching import CHUNK_FLOOR
from sequoia_ray.config import SamplingParams
from sequoia_ray.forward_clock import ForwardClock
from sequoia_ray.models.tree_lm import KVSession, new_cache
from sequoia_ray.request_errors import UnknownRequest

if TYPE_CHECKING:
    from sequoia_ray.prefix_cache import PrefixCache


def check_prefill_chunk(chunk: int | None) -> int | None:
    """A worker's ``prefill_chunk``: tokens of a prompt forwarded per step (None: the whole prompt at once)."""
    if chunk is not None and chunk < 1:
        raise ValueError(f"prefill_chunk {chunk} must be >= 1 (or None: the whole prompt in one step)")
    return chunk


@dataclass
class RequestState:
    session: KVSession
    committed: list[int]
    params: SamplingParams
    generator: torch.Generator


class RequestTable:
    """Base of the workers: ``start`` / ``finish`` requests; subclasses pick the state type."""

    state_type: type[RequestState] = RequestState

    def __init__(self, model, prefix_cache: PrefixCache | None = None) -> None:
        check_full_attention(model)
        self.model = model
        self.requests: dict[str, RequestState] = {}
        self.prefix_cache = prefix_cache  # K/V of prompt prefixes shared across requests (None: none)
        self._prompts: dict[str, int] = {}  # request -> its prompt's length (what the prefix cache may keep)
        self.forward_clock = ForwardClock(model.device)  # time inside the model's forwards (off unless turned on)

    prefill_chunk: int | None = None  # a worker's (``check_prefill_chunk``): None, a prompt in one forward

    def _chunked(self, pending: int) -> bool:
        """Whether ``pending`` uncached tokens go a chunk per forward (more than ``prefill_chunk``)."""
        return self.prefill_chunk is not None and pending > self.prefill_chunk

    def _chunk_size(self, cap: int | None) -> int:
        """A prefill chunk's tokens in one forward: ``prefill_chunk``, cut to ``cap`` (the batcher's budget left)."""
        return self.prefill_chunk if cap is None else max(1, min(cap, self.prefill_chunk))

    def _fewest(self, whole: int, pending: int) -> int:
        """The fewest tokens a call of ``whole`` tokens with ``pending`` uncached can run with: a prefill chunk may be
        cut to ``CHUNK_FLOOR`` (the batcher's ``fewest``), a step may not."""
        return min(whole, CHUNK_FLOOR) if self._chunked(pending) else whole

    @property
    def device(self) -> torch.device:
        """The model's device: every tensor this worker builds for its model is built there."""
        return self.model.device

    @property
    def max_context(self) -> int | None:
        """The positions the model reads (its config's ``max_position_embeddings``; None: the config has none)."""
        return getattr(self.model.config, "max_position_embeddings", None)

    @property
    def generator_device(self) -> torch.device:
        """Where this worker's sampling ops run; the request generators are created there."""
        return self.device

    def start(self, request_id: str, prompt: list[int], params: SamplingParams, seed: int) -> None:
        gen = torch.Generator(device=self.generator_device).manual_seed(seed)
        session = KVSession(self.model)
        if self.prefix_cache is not None:  # the session starts past its prompt's cached prefix
            from sequoia_ray.models.kv_store import store_of

            for block in self.prefix_cache.lookup(prompt):
                store_of(session.cache).append(block.keys, block.values)
            self._prompts[request_id] = len(prompt)
        self.requests[request_id] = self.state_type(session, list(prompt), params, gen)

    def finish(self, request_id: str) -> None:
        req, prompt = self.requests.pop(request_id, None), self._prompts.pop(request_id, None)
        if req is not None and prompt is not None:
            from sequoia_ray.models.kv_store import store_of

            self.prefix_cache.insert(req.committed[:prompt], store_of(req.session.cache))

    def get(self, request_id: str) -> RequestState:
        try:
            return self.requests[request_id]
        except KeyError:
            raise UnknownRequest(f"request {request_id!r} is not active here (finished, reaped after idling, "
                                 "or never started)") from None


def check_full_attention(model) -> None:
    """Tree forwards, batching and KV compaction move cache slots around: a sliding-window layer's cache drops
    old slots by itself, so its slots would silently mean other tokens. Such a model is refused up front."""
    sliding = [i for i, layer in enumerate(new_cache(model).layers) if getattr(layer, "is_sliding", False)]
    if sliding:
        raise ValueError(f"{type(model).__name__} has sliding-window attention in layers {sliding}; tree decoding "
                         "here supports full-attention layers only (for Qwen2, set use_sliding_window false)")
    rope = rope_type(model.config)
    if rope in POSITION_DEPENDENT_ROPE:
        raise ValueError(f"{type(model).__name__} uses rope_type {rope!r}, whose rotary frequencies depend on the "
                         "largest position in each forward: a tree's deeper nodes, a batchmate or a cached prefix "
                         "would change a token's K/V and the output would not be the target's. Use a model with a "
                         "fixed rotary scaling (default, linear, yarn, llama3)")


POSITION_DEPENDENT_ROPE = ("longrope", "dynamic")  # transformers' dynamic_rope_update: frequencies from max(position)


def rope_type(config) -> str:
    """The config's rotary scaling type ('default' when none): ``rope_parameters`` (transformers 5) or
    ``rope_scaling`` (before)."""
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if isinstance(params, dict) and params and all(isinstance(v, dict) for v in params.values()):
        params = next(iter(params.values()))  # per layer type (full / sliding attention): one is enough here
    return str(params.get("rope_type", params.get("type", "default"))) if isinstance(params, dict) else "default"
