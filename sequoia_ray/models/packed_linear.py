"""Linear layers with their weights packed once for oneDNN: the CPU decoding kernel transformers lacks.

``torch.nn.functional.linear`` on a CPU hands oneDNN a plain row-major weight at every call, and a decode
step (a few to a few dozen rows against every weight of the model) is bound by how fast the weights stream
from memory. Reordered once into oneDNN's blocked layout (``mkldnn._reorder_linear_weight``, what
torch.compile's freezing pass and the CPU engines of vLLM and IPEX do), the same product streams them about
twice as fast: on this project's 2-core EPYC, bf16, the 1.5B target's forward of 1 / 8 / 16 tree tokens went
from 218 / 306 / 300 to 117 / 140 / 188 ms, with bitwise the same logits (``benchmarks/linears.py``).

``mode``: ``aten`` (never pack), ``packed`` (every plain CPU Linear in fp32 or bf16; an error elsewhere), or
``auto`` (the default: pack bf16 CPU models, where the result is bitwise the same as unpacked on the CPUs
measured — fp32 packing is as fast but rounds differently (~4e-5 in the logits), so it is asked for, not
assumed). Never packed: non-CPU devices, int8-quantised layers (they are no ``nn.Linear``), and weights that
are not plain tensors (tensor-parallel shards keep their hooks and run unpacked).
"""

from __future__ import annotations

import functools
import logging

import torch

logger = logging.getLogger(__name__)

MODES = ("auto", "packed", "aten")
PACKABLE = (torch.float32, torch.bfloat16)


# The rows oneDNN is told to expect when it picks the blocked layout; None: no hint. With a hint of 1 (sessions 7-28)
# it blocks a bf16 weight 64 outputs wide (AB16b64a2b), without one 32 wide (AB16b32a2b, as vLLM's CPU GEMM):
# the 1.5B target's forward took 0.73-0.76x the time at 1 x 1, 8 x 1 and 1 x 16 tokens and 0.91-0.93x at 8 x 4
# (paired medians, both layouts of every weight in one model, alternated, in either packing order), alike at the
# fastest repeats; without the hint the logits were aten's bit for bit, with it not on every prompt
# (benchmarks/weight_layout.py).
ROWS_HINT: int | None = None


class PackedLinear(torch.nn.Module):
    """``y = x @ W.T + b`` with ``W`` held only in oneDNN's blocked layout (the plain weight is dropped)."""

    def __init__(self, linear: torch.nn.Linear, rows_hint: int | None = ROWS_HINT) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach()
        self.register_buffer("packed", torch.ops.mkldnn._reorder_linear_weight(weight, rows_hint), persistent=False)
        self.bias = linear.bias  # a Parameter or None, shared

    @property
    def dtype(self) -> torch.dtype:
        return self.packed.dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        if x.dtype != self.packed.dtype:
            raise TypeError(f"PackedLinear holds {self.packed.dtype} weights but got a {x.dtype} input; "
                            "cast the input (or load the model with linears='aten')")
        if torch.jit.is_tracing():  # the tracer cannot record the empty ``Scalar?[]`` argument: a script can
            return _scripted().packed_linear(x, self.packed, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


_SCRIPT = """
def packed_linear(x: Tensor, packed: Tensor, bias: Optional[Tensor]):
    none: List[Optional[number]] = []
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", none, "")
"""


@functools.cache
def _scripted():
    """TorchScript's ``packed_linear``, what a trace of a packed layer (``models.traced_layers``) calls."""
    return torch.jit.CompilationUnit(_SCRIPT)


def check_mode(mode: str) -> str:
    if mode not in MODES:
        raise ValueError(f"linears {mode!r} must be one of {', '.join(MODES)} (auto: packed for bf16 on a CPU)")
    return mode


def why_not(model: torch.nn.Module, mode: str) -> str | None:
    """Why ``model`` is not packed under ``mode`` (None: it will be). ``packed`` raises where ``auto`` declines."""
    first = next(model.parameters(), None)
    device = first.device if first is not None else torch.device("cpu")
    return _why_not(mode, first.dtype if first is not None else torch.float32, device)


def kernels_for(mode: str, dtype: torch.dtype, device_type: str) -> str:
    """``packed`` or ``aten``: what a model of ``dtype`` on ``device_type`` will run under ``mode`` (what a
    plan's provenance records as ``linears``); ``packed`` where it cannot apply raises, as loading would."""
    return "aten" if _why_not(mode, dtype, torch.device(device_type)) else "packed"


def _why_not(mode: str, dtype: torch.dtype, device: torch.device) -> str | None:
    check_mode(mode)
    if mode == "aten":
        return "linears 'aten'"
    reason = None
    if device.type != "cpu":
        reason = f"the model is on {device}; oneDNN packing is a CPU kernel"
    elif not torch.backends.mkldnn.is_available():
        reason = "this torch build has no oneDNN (mkldnn)"
    elif dtype not in PACKABLE:
        reason = f"dtype {dtype} has no packed kernel here (float32 and bfloat16 do)"
    elif dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        reason = "this CPU has no oneDNN bf16 support"
    if reason and mode == "packed":
        raise ValueError(f"linears 'packed': {reason}; use linears 'auto' or 'aten'")
    if reason is None and mode == "auto" and dtype != torch.bfloat16:
        reason = f"linears 'auto' packs bfloat16 models only (this one is {dtype}); ask for 'packed'"
    return reason


@torch.no_grad()
def pack_linears(model: torch.nn.Module, mode: str = "auto") -> int:
    """Replace every packable ``nn.Linear`` of ``model`` by a ``PackedLinear``, in place; returns how many.
    A weight shared with another module (a tied LM head) stays where it is, and the head gets its own
    packed copy; any other plain weight is freed."""
    reason = why_not(model, mode)
    if reason is not None:
        logger.info("linear layers not packed: %s", reason)
        return 0
    targets = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
               if type(child) is torch.nn.Linear and type(child.weight.data) is torch.Tensor
               and child.weight.dtype in PACKABLE and not child._forward_hooks and not child._forward_pre_hooks]
    for parent, name, child in targets:
        setattr(parent, name, PackedLinear(child))
    logger.info("packed %d linear layers for oneDNN", len(targets))
    return len(targets)


def packed_count(model: torch.nn.Module) -> int:
    return sum(isinstance(m, PackedLinear) for m in model.modules())
