"""Fixtures shared by the integration tests."""

from __future__ import annotations

import pytest

from sequoia_ray.local import LocalPair


@pytest.fixture(scope="session")
def local():
    """The tiny pair in-process: the reference outputs the served ones are compared with (read only, so
    loaded once for the session)."""
    return LocalPair.load("tiny-target", "tiny-draft", dtype="float32", progress=False)


@pytest.fixture(scope="module")
def store_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("plans")
