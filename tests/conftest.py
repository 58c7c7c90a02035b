"""Collection rules shared by every test tier."""

from __future__ import annotations

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    """``gpu`` tests need CUDA: skip them, saying why, where torch sees no CUDA device."""
    if torch.cuda.is_available():
        return
    reason = ("needs CUDA: torch sees no CUDA device here (a CPU build of torch, or no GPU); "
              "on a GPU machine run scripts/gpu_check.sh")
    skip = pytest.mark.skip(reason=reason)
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session", autouse=True)
def _end_the_sessions_ray():
    """The serving tests share one local Ray and Serve (tests/serving.py); end them with the session."""
    yield
    from tests.serving import stop_ray

    stop_ray()
