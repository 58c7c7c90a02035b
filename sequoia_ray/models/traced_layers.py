"""Decoder layers whose dense parts run as TorchScript traces: a small model's step is mostly per-op Python.

A level of the int8 0.5B draft is ~24-27 ms on the 2-core EPYC here, of which the int8 products are ~12: the rest is
~50 small ops a layer (RMSNorm, rotary, views, SiLU, residuals) each dispatched from Python. Run from a trace,
the same ops in the same order cost a fraction of that: a draft level of 1 / 4 / 16 tokens took 0.81 / 0.82 /
0.87x the time (8 requests of a token each: 0.84x), the bf16 1.5B target's forwards 0.95-0.98x, greedy decoding
with the built-in plan 0.91x; bitwise the same hidden states (``benchmarks/layers.py``, README "Traced layers").

Per layer, traced once at load with ``torch.jit.trace`` over the model's own modules (their weights shared, not
copied):

- ``before``: the input norm, the q / k / v projections as ``[batch, heads, q, dim]``, rotary (the model's own
  ``apply_rotary_pos_emb``);
- ``after``: the o projection, the residual, the post-attention norm, the MLP, the residual.

Each trace is frozen (``torch.jit.freeze``): the small weights (norms, biases) become constants of the graph,
the same tensors, not copies, and the interpreter no longer looks attributes up at every call: a draft forward
0.98x the time of the unfrozen traces, a target forward 0.99-0.994x (1 and 8 tokens, paired medians of 10,
the 2-core Xeon, session 44; the probe below checks the frozen traces).

Between them, in Python as transformers' layer does it: the cache's ``update`` and the attention function the
config names, so every layout (``ragged``, ``flat``, ``padded``), cache and attention implementation works as
before. Sizes are recorded as ops, so one trace serves every batch, length and tree.

Only layers of the shape the traces copy are traced (``KNOWN``: Qwen2's and Llama's decoder layers without
extra norms) and transformers 5.x's calls, and only when the model's decoder gives bitwise its stock output on a
probe (a prompt, then tokens through the cache; three times, as TorchScript optimises a graph after its first
runs); otherwise the stock forward stays (``auto``: logged) or loading fails (``traced``). A traced layer takes
the stock path whenever the traces no longer stand for it: in training, in another dtype or device than traced,
or once hooks were added to its modules (transformers' output capture).
``torch.jit.trace`` is deprecated in torch 2.13 (``torch.compile`` and ``torch.export`` replace it; compiled
layers measured 1.38x slower here, session 33): should it fail or be gone, ``auto`` keeps the stock forward.
A deep copy of a traced model runs the stock forward (the traces hold the original's weights).
"""

from __future__ import annotations

import inspect
import logging
import sys
import types
import warnings

import torch

logger = logging.getLogger(__name__)

MODES = ("auto", "traced", "eager")
KNOWN = ("Qwen2DecoderLayer", "LlamaDecoderLayer")


def check_mode(mode: str) -> str:
    if mode not in MODES:
        raise ValueError(f"layers {mode!r} must be one of {', '.join(MODES)} (auto: traced on a CPU where "
                         "bitwise the same, else eager)")
    return mode


class _Before(torch.nn.Module):
    """Input norm, q / k / v projections and rotary: ``[b, q, H]`` -> 3 x ``[b, heads, q, dim]``."""

    def __init__(self, layer: torch.nn.Module) -> None:
        super().__init__()
        self.norm, self.attn = layer.input_layernorm, layer.self_attn
        self.rotary = sys.modules[type(layer).__module__].apply_rotary_pos_emb

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        x, shape = self.norm(hidden), (hidden.shape[0], hidden.shape[1], -1, self.attn.head_dim)
        query = self.attn.q_proj(x).view(shape).transpose(1, 2)
        key = self.attn.k_proj(x).view(shape).transpose(1, 2)
        value = self.attn.v_proj(x).view(shape).transpose(1, 2)
        query, key = self.rotary(query, key, cos, sin)
        return query, key, value


class _After(torch.nn.Module):
    """o projection, residual, post-attention norm, MLP, residual: attention's ``[b, q, heads, dim]`` and the
    layer's input ``[b, q, H]`` -> ``[b, q, H]``."""

    def __init__(self, layer: torch.nn.Module) -> None:
        super().__init__()
        self.o_proj, self.norm, self.mlp = layer.self_attn.o_proj, layer.post_attention_layernorm, layer.mlp

    def forward(self, attended: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        hidden = residual + self.o_proj(attended.reshape(residual.shape[0], residual.shape[1], -1).contiguous())
        return hidden + self.mlp(self.norm(hidden))


class TracedForward:
    """A layer's ``forward`` (set on the instance): the traced parts around its cache update and attention,
    called as transformers' own layer and attention forwards call them."""

    def __init__(self, layer: torch.nn.Module, before, after, like: torch.Tensor) -> None:
        self.layer, self.before, self.after = layer, before, after
        self.dtype, self.device = like.dtype, like.device  # what the traces were made for
        self.modules = list(layer.modules())
        module = sys.modules[type(layer).__module__]
        self.eager_attention = module.eager_attention_forward
        self.interfaces = module.ALL_ATTENTION_FUNCTIONS

    def stale(self, hidden: torch.Tensor) -> bool:
        """Whether the traces no longer stand for the layer: training (dropout, checkpointing), another dtype or
        device than traced (``model.to``), or hooks added since (transformers' output capture hooks ``self_attn``,
        which a traced layer never calls as a module)."""
        return (self.layer.training or hidden.dtype != self.dtype or hidden.device != self.device
                or any(m._forward_hooks or m._forward_pre_hooks for m in self.modules))

    def __call__(self, hidden_states, attention_mask=None, position_ids=None, cache=None, use_cache=False,
                 position_embeddings=None, **kwargs):
        layer, attn = self.layer, self.layer.self_attn
        if self.stale(hidden_states):
            return type(layer).forward(layer, hidden_states, attention_mask=attention_mask, position_ids=position_ids,
                                       cache=cache, use_cache=use_cache, position_embeddings=position_embeddings,
                                       **kwargs)
        kwargs = {"position_ids": position_ids, "use_cache": use_cache, **kwargs}  # what the attention's are
        query, key, value = self.before(hidden_states, *position_embeddings)
        if cache is not None:
            key, value = cache.update(key, value, attn.layer_idx, kwargs=kwargs)
        interface = self.interfaces.get_interface(attn.config._attn_implementation, self.eager_attention)
        # Qwen2 passes its sliding window, Llama does not; not into ``kwargs``, which the cache saw
        extra = {"sliding_window": attn.sliding_window} if hasattr(attn, "sliding_window") else {}
        attended, _ = interface(attn, query, key, value, attention_mask, dropout=0.0, scaling=attn.scaling, **extra,
                                **kwargs)
        return self.after(attended, hidden_states)

    def __deepcopy__(self, memo):
        copied = memo.get(id(self.layer))  # the layer being copied (deepcopy memoises it before its __dict__)
        if copied is None:
            raise TypeError("a traced layer's forward is copied with its layer (copy.deepcopy of the model)")
        return types.MethodType(type(copied).forward, copied)  # the copy runs the stock forward


def why_not(model: torch.nn.Module, mode: str) -> str | None:
    """Why ``model``'s layers are not traced under ``mode`` (None: they will be, if the probe agrees)."""
    check_mode(mode)
    if mode == "eager":
        return "layers 'eager'"
    layers = _layers(model)
    first = next(model.parameters(), None)
    device = first.device if first is not None else torch.device("cpu")
    reason = None
    if not layers:
        reason = "the model has no decoder layers to trace"
    elif any(type(layer).__name__ not in KNOWN for layer in layers):
        reason = f"{type(layers[0]).__name__} is not a layer whose shape the traces copy ({', '.join(KNOWN)})"
    elif any(hasattr(layer.self_attn, "q_norm") for layer in layers):
        reason = "the attention has q/k norms the traces do not copy"
    elif "cache" not in inspect.signature(type(layers[0]).forward).parameters:
        reason = "this transformers' layers take ``past_key_values`` (4.x), not the 5.x calls the traces copy"
    elif any(m._forward_hooks or m._forward_pre_hooks for layer in layers for m in layer.modules()):
        reason = "some layer's modules have hooks (e.g. tensor-parallel shards)"
    elif device.type != "cpu":  # on CUDA, freezing merges q/k/v into one matmul and the fuser fuses pointwise
        # ops: other kernels, other rounding, and shapes beyond the load-time probe never checked
        reason = f"the model is on {device}: traced layers are for CPU models only"
    elif model.training:
        reason = "the model is in training mode"
    if reason and mode == "traced":
        raise ValueError(f"layers 'traced': {reason}; use layers 'auto' or 'eager'")
    return reason


def trace_layers(model: torch.nn.Module, mode: str = "auto") -> int:
    """Give every decoder layer of ``model`` its ``TracedForward``, in place; returns how many (0: none, and
    ``model`` runs as before). ``traced`` raises where ``auto`` declines."""
    reason = why_not(model, mode)
    if reason is None:
        try:
            return _trace(model)
        except Exception as e:  # noqa: BLE001 - a trace that fails (or a torch without jit) leaves the stock path
            untrace_layers(model)
            reason = f"tracing failed: {type(e).__name__}: {e}"
            if mode == "traced":
                raise RuntimeError(f"layers 'traced': {reason}; use layers 'auto' or 'eager'") from e
    logger.info("decoder layers not traced: %s", reason)
    return 0


def untrace_layers(model: torch.nn.Module) -> None:
    """Every layer back to its stock forward."""
    for layer in _layers(model):
        layer.__dict__.pop("forward", None)


def traced_count(model: torch.nn.Module) -> int:
    return sum(isinstance(layer.__dict__.get("forward"), TracedForward) for layer in _layers(model))


def _layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model
    return list(getattr(decoder, "layers", []))


PROBE_RUNS = 3  # TorchScript runs a graph as recorded at first, then an optimised one: the probe checks both


def _probe(model: torch.nn.Module) -> torch.Tensor:
    """The decoder's hidden states of 5 prompt tokens, then of 3 more through the cache: ``[1, 8, H]``."""
    from transformers import DynamicCache

    decoder, device = model.get_decoder(), next(model.parameters()).device
    ids = torch.arange(1, 9, device=device)[None] % model.config.vocab_size  # [1, 8]
    cache = DynamicCache(config=model.config)
    first = decoder(input_ids=ids[:, :5], cache=cache, use_cache=True).last_hidden_state
    then = decoder(input_ids=ids[:, 5:], cache=cache, use_cache=True,
                   position_ids=torch.arange(5, 8, device=device)[None]).last_hidden_state
    return torch.cat([first, then], dim=1)


@torch.no_grad()
def _trace(model: torch.nn.Module) -> int:
    untrace_layers(model)  # the probe's reference is the stock layers, also when tracing again
    decoder, layers = model.get_decoder(), _layers(model)
    first = next(model.parameters())
    dtype = decoder.embed_tokens.weight.dtype if hasattr(decoder, "embed_tokens") else first.dtype
    hidden = torch.randn(1, 3, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    hidden = hidden.to(device=first.device, dtype=dtype) * 0.1  # [1, 3, H]: sizes are traced as ops, any q serves
    cos, sin = decoder.rotary_emb(hidden, torch.arange(3, device=first.device)[None])  # [1, 3, dim] each
    expected = _probe(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # torch.jit.trace's: see the module's docstring
        warnings.simplefilter("ignore", torch.jit.TracerWarning)
        for layer in layers:
            attended = _Before(layer)(hidden, cos, sin)[0].transpose(1, 2)  # [1, 3, heads, dim]: attention's shape
            before = torch.jit.freeze(torch.jit.trace(_Before(layer), (hidden, cos, sin), check_trace=False).eval())
            after = torch.jit.freeze(torch.jit.trace(_After(layer), (attended, hidden), check_trace=False).eval())
            layer.forward = TracedForward(layer, before, after, hidden)
    for _ in range(PROBE_RUNS):
        got = _probe(model)
        if not torch.equal(got, expected):
            raise RuntimeError(f"the traced layers' output differs from the stock layers' on a probe (max "
                               f"{(got.float() - expected.float()).abs().max().item():.3g})")
    logger.info("traced the dense parts of %d decoder layers", len(layers))
    return len(layers)
