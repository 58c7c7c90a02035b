"""One forward pass over several requests' KV sessions: the batched step of the draft and the target.

Each request is a ``Segment``: its session (its own committed K/V), its new tokens with explicit positions,
and what they may see (``allowed``, as in ``KVSession.hidden``). ``hidden_many`` runs the model ONCE for all
segments and appends each segment's new K/V to its own session — a token attends only to its own request's
cached context and to what its own ``allowed`` rows grant, never to another request.

Three layouts of the batch (``LAYOUTS``), all exact:

- ``ragged`` (``sequoia_ray.models.ragged``): batch 1, the new tokens one after another as in ``flat``, but
  each request's queries attend to its own session's K/V in place (one attention call per request and
  layer): nothing copied, and attention costs each request's own context. Needs SDPA attention.
- ``padded``: batch dimension B. Each session's cache is right-padded to the longest one and the new tokens
  to the longest segment; a ``[B, 1, Q, P + Q]`` float mask blocks the padding. Cost: B x Q query rows
  (a long segment pads every other one up to it).
- ``flat``: batch 1. The caches are concatenated along the sequence and the new tokens one after another;
  a block-diagonal ``[1, 1, sum q, sum past + sum q]`` mask keeps each request to its own blocks. Cost:
  exactly sum(q) rows through the weights, but attention scores over every request's context.

- ``auto`` (the default): ``ragged`` for a model with SDPA attention. ``benchmarks/layout.py`` with the 1.5B
  target (bf16) on the 2-core EPYC, contexts 64-420, interleaved, medians of 5 (ms a forward, padded / flat /
  ragged; ``benchmarks/results/layout-s20-n{1,4}.json``): decode steps (1 token) at B = 8 117 / 142 / 100, at
  B = 4 94 / 105 / 91; trees of 4 at B = 2 123 / 114 / 102, B = 4 180 / 159 / 128, B = 8 290 / 297 / 205. At
  short contexts (60-160) ragged ties with padded for decode steps. Otherwise (eager
  attention): ``padded`` when every segment is one token (decode steps of the target alone, the draft's
  one-node levels), where nothing pads the queries and each token scores only its own context, unless one
  long context would make the padded copies more than twice flat's; ``flat`` otherwise. Measured with the
  real pair on the 2-core EPYC, lockstep, 40 tokens a request, three interleaved rounds: the target alone at
  B = 8 ran 72.2 tok/s padded against 61.8 flat (1.17x, every round; under ``torch.profiler`` attention 3.3
  against 11.2 ms a step, the K/V copies 4.8 against 7.3 ms); trees of 2 nodes at B = 8 1.08x, of 4 at B = 4
  1.02x; and ``benchmarks/layout.py`` found trees of 4 faster flat when contexts differ widely (64-420
  tokens: 308 against 355 ms at B = 8).

``padded`` and ``flat`` copy every session's K/V into one temporary cache per step and the new K/V back
out: the sessions stay the single home of each request's state, untouched when the forward fails (a failed
batch can be retried request by request; ``ragged`` truncates what it appended). A session's cache is one
``KVStore`` (``sequoia_ray.models.kv_store``: every layer in
one buffer), so each copy is one op per request for keys and one for values, not one per layer: at B = 8
decode steps of the 1.5B target that took a step from 104-107 to 95-98 ms (interleaved, two rounds), the
~2,000 small ``cat``s, copies and fills become ~30 copies; what remains is the data itself (~6 ms of copies
a step at contexts ~130). A single segment runs ragged where a batch would (``_ragged_alone``), else
``KVSession.hidden`` directly.

Devices: all tensors are built on the model's device; segments must carry tensors already on it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from sequoia_ray.models import ragged
from sequoia_ray.models.tree_lm import KVSession, cache_keyword, new_cache

if TYPE_CHECKING:
    from sequoia_ray.models.kv_store import KVStore

LAYOUTS = ("auto", "flat", "padded", "ragged")


@dataclass
class Segment:
    session: KVSession
    tokens: torch.Tensor  # [q] int64
    positions: torch.Tensor  # [q] int64, absolute positions
    allowed: torch.Tensor | None = None  # [q, past + q - tree_start] bool (None: causal over the new tokens)
    tree_start: int | None = None  # cached slots before this are visible to every new token (default: past)

    @property
    def q(self) -> int:
        return self.tokens.shape[0]

    @property
    def sees_all(self) -> bool:
        """Whether every new token may attend to every slot, known on the host (no read of ``allowed``): one
        new token with no tree region in the cache (it attends to itself, so its [1, 1] ``allowed`` is True).
        More tokens never do: the first one cannot see the ones after it."""
        return self.q == 1 and self.tree_start in (None, self.session.length)

    def visible(self) -> torch.Tensor:  # [q, past + q] bool: True = this new token may attend to that slot
        q, past, device = self.q, self.session.length, self.tokens.device
        start = past if self.tree_start is None else self.tree_start
        allowed = self.allowed
        if allowed is None:
            assert start == past, "a causal segment has no tree region in the cache"
            allowed = torch.ones(q, q, dtype=torch.bool, device=device).tril_()
        assert allowed.shape == (q, past + q - start), f"allowed {tuple(allowed.shape)} != {(q, past + q - start)}"
        if allowed.device.type == "cpu":  # free here; on an accelerator the read would sync every forward
            assert bool(allowed[:, past - start :].diagonal().all()), "every token must attend to itself"
        seen = torch.ones(q, past + q, dtype=torch.bool, device=device)
        seen[:, start:] = allowed
        return seen


def check_layout(layout: str) -> str:
    if layout not in LAYOUTS:
        raise ValueError(f"layout {layout!r} must be one of {', '.join(LAYOUTS)}")
    return layout


AUTO_PAD_LIMIT = 2  # auto pads only while B x the longest context is at most this many times the contexts' sum


def resolve_layout(layout: str, segments: list[Segment], model=None) -> str:
    """``ragged``, ``flat`` or ``padded``: ``auto`` is ragged when ``model`` has SDPA attention; otherwise
    padded when every segment is a single token and padding the caches to the longest copies at most
    AUTO_PAD_LIMIT times the K/V that flat copies (one long context among short ones would make every
    request's temporary cache as long as it), and flat for the rest."""
    if layout != "auto":
        return layout
    if model is not None and ragged.supports(model):
        return "ragged"
    pasts = [s.session.length for s in segments]
    short_enough = len(pasts) * max(pasts, default=0) <= AUTO_PAD_LIMIT * max(1, sum(pasts))
    return "padded" if short_enough and all(s.q == 1 for s in segments) else "flat"


def hidden_many(model, segments: list[Segment], layout: str = "auto") -> list[torch.Tensor]:
    """``[q_b, H]`` final hidden states per segment, from one forward; appends each segment's K/V to its session."""
    check_layout(layout)
    if len(segments) == 1 and not _ragged_alone(model, segments[0], layout):
        s = segments[0]
        return [s.session.hidden(s.tokens, s.positions, s.allowed, s.tree_start)]
    device = model.device
    for s in segments:
        for name, t in (("tokens", s.tokens), ("positions", s.positions)):
            assert t.device == device, f"{name} on {t.device}, model on {device}: build it on the model's device"
    chosen = resolve_layout(layout, segments, model)
    with torch.inference_mode():
        if chosen == "ragged":
            return ragged.run(model, segments, _stores(segments), device)
        return (_padded if chosen == "padded" else _flat)(model, segments, device)


def _ragged_alone(model, segment: Segment, layout: str) -> bool:
    """A single segment runs ragged where a batch would (its session one ``KVStore``), else plain
    (``KVSession.hidden``): ragged packs the query heads that share a K/V head as rows of one attention where
    transformers' SDPA path repeats K/V for every head when more than one token is new. Bitwise the same hidden
    states; on the 2-core EPYC (session 33, paired medians of 12, context 300) a draft level (int8) of 1 / 4 /
    32 tokens took 0.97 / 0.93 / 0.95x the time, the bf16 target's forward of 1 / 4 / 16 / 32 tokens 0.99 /
    0.94 / 0.95 / 0.95x (4 tokens after 1,000: 0.86x), prefills of 64-512 tokens 0.98-0.99x."""
    return resolve_layout(layout, [segment], model) == "ragged" and store_of(segment.session.cache) is not None


def store_of(cache) -> KVStore | None:
    from sequoia_ray.models.kv_store import store_of as of  # transformers: only where a forward runs

    return of(cache)


def _stores(segments: list[Segment]) -> list[KVStore]:
    stores = [store_of(s.session.cache) for s in segments]
    if any(store is None for store in stores):
        raise ValueError("a batched forward needs sessions whose cache is one KVStore (KVSession makes them: every "
                         "layer full-attention)")
    return stores


def _like(stores: list[KVStore]) -> KVStore | None:
    """A store that has buffers (their layer count, heads, sizes and dtypes), if any has."""
    return next((store for store in stores if store.keys is not None), None)


def _run_decoder(model, ids, positions, mask, cache, past: int, q: int, device):
    decoder = model.get_decoder()
    out = decoder(input_ids=ids, position_ids=positions, attention_mask=mask, use_cache=True,
                  cache_position=torch.arange(past, past + q, device=device), **{cache_keyword(type(decoder)): cache})
    return out.last_hidden_state


def _padded(model, segments: list[Segment], device) -> list[torch.Tensor]:
    b, dtype = len(segments), model.dtype
    pasts = [s.session.length for s in segments]
    qs = [s.q for s in segments]
    p, q = max(pasts), max(qs)
    ids = torch.zeros(b, q, dtype=torch.long, device=device)  # [B, Q]
    positions = torch.zeros(b, q, dtype=torch.long, device=device)  # [B, Q]
    blocked = torch.finfo(dtype).min
    mask = torch.full((b, 1, q, p + q), blocked, dtype=dtype, device=device)  # [B, 1, Q, P + Q]
    mask[:, 0, torch.arange(q, device=device), p + torch.arange(q, device=device)] = 0  # padding rows: themselves
    for i, s in enumerate(segments):
        ids[i, : qs[i]], positions[i, : qs[i]] = s.tokens, s.positions
        seen = s.visible()  # [q_i, past_i + q_i]
        rows = mask[i, 0, : qs[i]]
        rows[:, : pasts[i]].masked_fill_(seen[:, : pasts[i]], 0)
        rows[:, p : p + qs[i]] = 0
        rows[:, p : p + qs[i]].masked_fill_(~seen[:, pasts[i] :], blocked)
    stores, cache = _stores(segments), new_cache(model)
    like, temp = _like(stores), store_of(cache)  # the step's temporary cache: its K/V, then the new tokens'
    if p:  # one copy per request of its whole context: [layers, B, heads, P + Q, dim], padding zeroed
        keys, values = _buffers(like, b, p + q)
        for i, (store, past) in enumerate(zip(stores, pasts)):
            if past:
                keys[:, i : i + 1, :, :past], values[:, i : i + 1, :, :past] = _filled(store, past)
            keys[:, i, :, past:p], values[:, i, :, past:p] = 0, 0  # finite, and masked
        temp.hold(keys, values, p)
    hidden = _run_decoder(model, ids, positions, mask, cache, p, q, device)  # [B, Q, H]
    for i, store in enumerate(stores):
        store.append(temp.keys[:, i : i + 1, :, p : p + qs[i]], temp.values[:, i : i + 1, :, p : p + qs[i]])
    return [hidden[i, : qs[i]] for i in range(b)]


def _flat(model, segments: list[Segment], device) -> list[torch.Tensor]:
    dtype = model.dtype
    pasts = [s.session.length for s in segments]
    qs = [s.q for s in segments]
    p, q = sum(pasts), sum(qs)
    past_at = [sum(pasts[:i]) for i in range(len(segments))]  # where each segment's cache starts
    new_at = [p + sum(qs[:i]) for i in range(len(segments))]  # where its new tokens go
    blocked = torch.finfo(dtype).min
    mask = torch.full((1, 1, q, p + q), blocked, dtype=dtype, device=device)  # [1, 1, sum q, sum past + sum q]
    for i, s in enumerate(segments):
        seen = s.visible()
        rows = mask[0, 0, new_at[i] - p : new_at[i] - p + qs[i]]
        rows[:, past_at[i] : past_at[i] + pasts[i]].masked_fill_(seen[:, : pasts[i]], 0)
        rows[:, new_at[i] : new_at[i] + qs[i]].masked_fill_(seen[:, pasts[i] :], 0)
    ids = torch.cat([s.tokens for s in segments])[None]  # [1, sum q]
    positions = torch.cat([s.positions for s in segments])[None]  # [1, sum q]
    stores, cache = _stores(segments), new_cache(model)
    like, temp = _like(stores), store_of(cache)  # the step's temporary cache: its K/V, then the new tokens'
    if p:  # one copy per request of its whole context, one after another: [layers, 1, heads, sum past + sum q, dim]
        keys, values = _buffers(like, 1, p + q)
        for at, past, store in zip(past_at, pasts, stores):
            if past:
                keys[:, :, :, at : at + past], values[:, :, :, at : at + past] = _filled(store, past)
        temp.hold(keys, values, p)
    hidden = _run_decoder(model, ids, positions, mask, cache, p, q, device)[0]  # [sum q, H]
    for at, n, store in zip(new_at, qs, stores):
        store.append(temp.keys[:, :, :, at : at + n], temp.values[:, :, :, at : at + n])
    return list(hidden.split(qs))


def _buffers(like: KVStore, batch: int, slots: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Empty keys and values like ``like``'s (layers, heads, dim, dtype, device):
    ``[layers, batch, heads, slots, dim]``."""
    return tuple(t.new_empty(t.shape[0], batch, t.shape[2], slots, t.shape[4]) for t in (like.keys, like.values))


def _filled(store: KVStore, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A store's first ``length`` slots, every layer: ``[layers, 1, heads, length, dim]`` keys and values."""
    return store.keys[..., :length, :], store.values[..., :length, :]
