"""Collection rules shared by every test tier."""

from __future__ import annotations

import ast
import functools
import os
from pathlib import Path

import pytest
import torch


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """Under pytest-xdist's default distribution (``scripts/test.sh`` runs two workers): a module's tests run
    on one worker, so its module-scoped fixtures (the real pair, a cluster of its own, a model) are built
    once; the modules that deploy on the session's Ray all run on one worker, in order, sharing that Ray
    (one work unit). Another ``--dist`` is left to xdist. (Not ``--dist loadgroup`` with ``xdist_group``
    marks: pytest-xdist 3.8 groups by rewriting node ids, which pytest 9.2 ignores,
    pytest-dev/pytest-xdist#1386.)"""
    if config.getvalue("dist") not in ("load", "loadscope"):
        return None
    from xdist.scheduler import LoadScopeScheduling

    class SessionRayScheduling(LoadScopeScheduling):
        ordered = False

        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0]
            return "session-ray" if _module_uses_the_sessions_ray(config.rootpath / module) else module

        def _assign_work_unit(self, node) -> None:
            if not self.ordered:  # the first call comes right after the work queue is built
                for scope in sorted(self.workqueue, key=lambda scope: _unit_rank(config.rootpath, scope)):
                    self.workqueue.move_to_end(scope)  # sorted() is stable: xdist's order within a rank
                self.ordered = True
            super()._assign_work_unit(node)

    return SessionRayScheduling(config, log)


LONG_MARKS = frozenset({"slow", "integration", "long"})


def _unit_rank(root: Path, scope: str) -> int:
    """Longest first, so the last units handed out are short ones and neither worker idles at the end (before,
    the modules of one or two long tests came last, by xdist's order by test count: 130 s of one worker alone).
    0: the session's Ray (its modules in turn, ~13 min under load); 1: a module marked slow, integration or
    long (a cluster of its own, the real pair, or minutes of sampling); 2: the rest."""
    if scope == "session-ray":
        return 0
    return 1 if _module_marks(root / scope) & LONG_MARKS else 2


def pytest_configure(config):
    """Under pytest-xdist, each worker's torch gets its share of the cores (2 workers on 2 cores: 1 thread
    each). Two processes of 2 OpenMP threads on 2 cores spin against each other at every parallel region:
    the tiny-model statistical tests ran 30-40x slower beside each other than alone (session 21: 320
    requests' trees took 25-51 s each with 2 threads, 0.6-1.7 s with 1). Ray's actors set their own."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if os.environ.get("PYTEST_XDIST_WORKER") and workers > 1:
        torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // workers))


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


@functools.cache
def _module_nodes(path: Path) -> tuple[ast.AST, ...]:
    """Every AST node of a test module, parsed once (read from its source, so the xdist controller, which imports
    no test module, can tell too); none for a path that is not a Python file."""
    if path.suffix != ".py" or not path.is_file():
        return ()
    return tuple(ast.walk(ast.parse(path.read_text())))


@functools.cache
def _module_uses_the_sessions_ray(path: Path) -> bool:
    """A test module that deploys on the session's Ray: it imports ``serving`` or ``session_ray`` from
    ``tests.serving`` (anywhere in it)."""
    return any(isinstance(node, ast.ImportFrom) and node.module == "tests.serving"
               and any(alias.name in ("serving", "session_ray") for alias in node.names)
               for node in _module_nodes(path))


def _module_marks(path: Path) -> set[str]:
    """The ``pytest.mark.X`` names written anywhere in a test module."""
    return {node.attr for node in _module_nodes(path)
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute)
            and node.value.attr == "mark" and isinstance(node.value.value, ast.Name) and node.value.value.id == "pytest"}


def _uses_the_sessions_ray(item) -> bool:
    return _module_uses_the_sessions_ray(Path(item.path))


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


@pytest.fixture
def keep_logging():
    """A model actor sets up the core's logger for its process; built in-process, that process is pytest's,
    so put the logger back after the test."""
    import logging

    log = logging.getLogger("sequoia_ray")
    handlers, level = list(log.handlers), log.level
    yield
    log.handlers[:] = handlers
    log.setLevel(level)
