"""One forward pass over several requests' KV sessions: the batched step of the draft and the target.

Each request is a ``Segment``: its session (its own committed K/V), its new tokens with explicit positions,
and what they may see (``allowed``, as in ``KVSession.hidden``). ``hidden_many`` runs the model ONCE for all
segments and appends each segment's new K/V to its own session — a token attends only to its own request's
cached context and to what its own ``allowed`` rows grant, never to another request.

Two layouts of the batch (``LAYOUTS``), both exact:

- ``padded``: batch dimension B. Each session's cache is right-padded to the longest one and the new tokens
  to the longest segment; a ``[B, 1, Q, P + Q]`` float mask blocks the padding. Cost: B x Q query rows
  (a long segment pads every other one up to it).
- ``flat``: batch 1. The caches are concatenated along the sequence and the new tokens one after another;
  a block-diagonal ``[1, 1, sum q, sum past + sum q]`` mask keeps each request to its own blocks. Cost:
  exactly sum(q) rows through the weights, but attention scores over every request's context.

- ``auto`` (the default): ``padded`` when every segment is one token (decode steps of the target alone, the
  draft's one-node levels), where nothing pads the queries and each token scores only its own context, unless
  one long context would make the padded copies more than twice flat's; ``flat`` otherwise. Measured with
  the real pair on the 2-core EPYC, lockstep, 40 tokens a request, three interleaved rounds: the target alone at B = 8 ran 72.2 tok/s padded against 61.8 flat (1.17x, every round;
  under ``torch.profiler`` attention 3.3 against 11.2 ms a step, the K/V copies 4.8 against 7.3 ms); trees of
  2 nodes at B = 8 1.08x, of 4 at B = 4 1.02x; and ``benchmarks/layout.py`` found trees of 4 faster flat when
  contexts differ widely (64-420 tokens: 308 against 355 ms at B = 8).

Both copy every session's K/V into one temporary cache per step (``torch.cat``) and the new K/V back out:
the sessions stay the single home of each request's state, untouched when the forward fails (a failed batch
can be retried request by request). A single segment skips all of it (``KVSession.hidden`` directly).

Devices: all tensors are built on the model's device; segments must carry tensors already on it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sequoia_ray.models.tree_lm import KVSession, new_cache

LAYOUTS = ("auto", "flat", "padded")


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

    def visible(self) -> torch.Tensor:  # [q, past + q] bool: True = this new token may attend to that slot
        q, past, device = self.q, self.session.length, self.tokens.device
        start = past if self.tree_start is None else self.tree_start
        allowed = self.allowed
        if allowed is None:
            assert start == past, "a causal segment has no tree region in the cache"
            allowed = torch.ones(q, q, dtype=torch.bool, device=device).tril_()
        assert allowed.shape == (q, past + q - start), f"allowed {tuple(allowed.shape)} != {(q, past + q - start)}"
        assert bool(allowed[:, past - start :].diagonal().all()), "every token must attend to itself"
        seen = torch.ones(q, past + q, dtype=torch.bool, device=device)
        seen[:, start:] = allowed
        return seen


def check_layout(layout: str) -> str:
    if layout not in LAYOUTS:
        raise ValueError(f"layout {layout!r} must be one of {', '.join(LAYOUTS)}")
    return layout


AUTO_PAD_LIMIT = 2  # auto pads only while B x the longest context is at most this many times the contexts' sum


def resolve_layout(layout: str, segments: list[Segment]) -> str:
    """``flat`` or ``padded``: ``auto`` is padded when every segment is a single token and padding the caches
    to the longest copies at most AUTO_PAD_LIMIT times the K/V that flat copies (one long context among short
    ones would make every request's temporary cache as long as it)."""
    if layout != "auto":
        return layout
    pasts = [s.session.length for s in segments]
    short_enough = len(pasts) * max(pasts, default=0) <= AUTO_PAD_LIMIT * max(1, sum(pasts))
    return "padded" if short_enough and all(s.q == 1 for s in segments) else "flat"


def hidden_many(model, segments: list[Segment], layout: str = "auto") -> list[torch.Tensor]:
    """``[q_b, H]`` final hidden states per segment, from one forward; appends each segment's K/V to its session."""
    check_layout(layout)
    if len(segments) == 1:
        s = segments[0]
        return [s.session.hidden(s.tokens, s.positions, s.allowed, s.tree_start)]
    device = model.device
    for s in segments:
        for name, t in (("tokens", s.tokens), ("positions", s.positions)):
            assert t.device == device, f"{name} on {t.device}, model on {device}: build it on the model's device"
    run = _padded if resolve_layout(layout, segments) == "padded" else _flat
    with torch.inference_mode():
        return run(model, segments, device)


def _cached_kv(segments: list[Segment], layer: int) -> list[tuple[torch.Tensor, torch.Tensor] | None]:
    out = []
    for s in segments:
        cache_layer = s.session.cache.layers[layer]
        out.append((cache_layer.keys, cache_layer.values) if getattr(cache_layer, "is_initialized", False)
                   and s.session.length else None)
    return out


def _layer_shape(segments: list[Segment], layer: int):
    for kv in _cached_kv(segments, layer):
        if kv is not None:
            return kv[0].shape[1], kv[0].shape[3], kv[0].dtype
    return None


def _append(segments: list[Segment], new_kv) -> None:
    """``new_kv[layer] = [(k_b, v_b) for each segment]``, each ``[1, heads, q_b, dim]``: append to the sessions."""
    for layer, per_segment in enumerate(new_kv):
        for s, (k, v) in zip(segments, per_segment):
            s.session.cache.layers[layer].update(k, v)


def _run_decoder(model, ids, positions, mask, cache, past: int, q: int, device):
    out = model.get_decoder()(input_ids=ids, position_ids=positions, attention_mask=mask, past_key_values=cache,
                              cache_position=torch.arange(past, past + q, device=device), use_cache=True)
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
    cache = new_cache(model)
    if p:
        for layer in range(len(cache.layers)):
            heads, dim, kv_dtype = _layer_shape(segments, layer)
            keys = torch.zeros(b, heads, p, dim, dtype=kv_dtype, device=device)  # [B, heads, P, dim]
            values = torch.zeros_like(keys)
            for i, kv in enumerate(_cached_kv(segments, layer)):
                if kv is not None:
                    keys[i, :, : pasts[i]], values[i, :, : pasts[i]] = kv[0][0], kv[1][0]
            cache.layers[layer].update(keys, values)
    hidden = _run_decoder(model, ids, positions, mask, cache, p, q, device)  # [B, Q, H]
    _append(segments, [[(layer.keys[i : i + 1, :, p : p + qs[i]], layer.values[i : i + 1, :, p : p + qs[i]])
                        for i in range(b)] for layer in cache.layers])
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
    cache = new_cache(model)
    if p:
        for layer in range(len(cache.layers)):
            cached = [kv for kv in _cached_kv(segments, layer) if kv is not None]
            cache.layers[layer].update(torch.cat([k for k, _ in cached], dim=-2),
                                       torch.cat([v for _, v in cached], dim=-2))
    hidden = _run_decoder(model, ids, positions, mask, cache, p, q, device)[0]  # [sum q, H]
    _append(segments, [[(layer.keys[:, :, a : a + n], layer.values[:, :, a : a + n]) for a, n in zip(new_at, qs)]
                       for layer in cache.layers])
    return list(hidden.split(qs))
