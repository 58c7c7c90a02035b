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


def _uses_the_sessions_ray(item) -> bool:
    """A test whose module deploys on the session's Ray (``tests.serving.serving`` or ``session_ray``)."""
    from tests import serving

    names = vars(getattr(item, "module", None) or object)
    return any(names.get(name) is getattr(serving, name) for name in ("serving", "session_ray"))


_LAST_RAY_TEST = pytest.StashKey[str | None]()  # node id of the last test that uses the session's Ray


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    """After the last test that uses the session's Ray (and its module's fixtures are torn down), end that
    Ray: its idle processes take ~20% of a core, which the CPU-bound tests after it (on 2 cores) would pay."""
    yield
    stash = item.session.stash
    if _LAST_RAY_TEST not in stash:  # the items as run (after deselection), found at the first teardown
        users = [it.nodeid for it in item.session.items if _uses_the_sessions_ray(it)]
        stash[_LAST_RAY_TEST] = users[-1] if users else None
    if nextitem is not None and item.nodeid == stash[_LAST_RAY_TEST]:
        from tests.serving import stop_ray

        stop_ray()
