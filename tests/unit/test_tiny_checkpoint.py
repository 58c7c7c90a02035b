"""The tiny pair's checkpoint: one directory per machine and content, shared by every process, nothing left per
process (the per-process directories of earlier versions piled up 1.6 MB for every test worker and Ray actor)."""

import tempfile
import threading
from pathlib import Path

from sequoia_ray.models import loading


def ours(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.name.startswith("sequoia-ray-tiny"))  # torch adds its own


def test_concurrent_writers_share_one_complete_directory(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    paths, errors = [], []

    def write():
        try:
            paths.append(loading.resolve(loading.TINY_TARGET, progress=False)[0])
        except Exception as exc:  # noqa: BLE001 - surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=write) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert len(set(paths)) == 1
    entries = ours(tmp_path)
    assert len(entries) == 1 and entries[0].startswith("sequoia-ray-tiny-") and "scratch" not in entries[0]
    assert (tmp_path / entries[0] / loading.TINY_TARGET / "config.json").is_file()
    assert (tmp_path / entries[0] / loading.TINY_DRAFT / "config.json").is_file()
    # a second resolve (another process's first) writes nothing new
    assert loading.resolve(loading.TINY_DRAFT, progress=False)[0].startswith(str(tmp_path / entries[0]))
    assert ours(tmp_path) == entries


def test_a_damaged_directory_is_rewritten(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    where = loading.resolve(loading.TINY_TARGET, progress=False)[0]
    (tmp_path / where / "config.json").unlink()
    assert loading.resolve(loading.TINY_TARGET, progress=False)[0] == where
    assert (tmp_path / where / "config.json").is_file()
    assert len(ours(tmp_path)) == 1


def test_the_tiny_pair_loads_from_the_shared_directory(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    loaded = loading.load_tokenizer(loading.TINY_DRAFT, progress=False)
    assert loaded.encode("ab")  # a working tokenizer from the published files
