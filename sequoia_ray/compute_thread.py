"""One thread per process for every torch computation, model loading included.

torch's CPU kernels run their parallel regions on libgomp (GNU OpenMP), which keeps a pool of worker threads
for each thread that starts regions. Once a process's pools hold more threads than the process has CPUs,
libgomp stops spinning between regions (its "throttled" spin count of ~100 iterations, whatever
``GOMP_SPINCOUNT`` says) and every worker sleeps and is woken around each of the hundreds of regions of a
forward. Measured on a 2-core EPYC with the default pair, 2 torch threads, the same 48 tokens: the models
loaded on one thread and run on another drafted a step in 194 ms and verified it in 153 ms, with 23,640
voluntary context switches, against 131 and 128 ms and none on one thread. A Ray actor loads its model in
one of Ray's threads and answers calls in others, so its forwards ran ~1.5x slower than in-process until
it ran everything here (``actors/base.py``).

``compute_thread().run(fn, *args)`` runs ``fn`` on the process's one compute thread and returns its result
(or raises its exception) in the caller; called on the compute thread itself, it runs ``fn`` inline. The
thread is ``concurrent.futures``': at interpreter exit Python waits for the call running on it, if any.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")


class ComputeThread:
    """A single thread that runs the functions given to ``run``, one at a time, in the order they arrive."""

    def __init__(self, name: str = "torch-compute") -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
        self._ident = self._pool.submit(threading.get_ident).result()

    def run(self, fn: Callable[..., T], *args, **kwargs) -> T:
        if self.on_it():
            return fn(*args, **kwargs)  # already here: a queued call would wait for itself
        return self._pool.submit(fn, *args, **kwargs).result()

    def on_it(self) -> bool:
        """Whether the caller is the compute thread."""
        return threading.get_ident() == self._ident


_lock = threading.Lock()
_shared: ComputeThread | None = None


def compute_thread() -> ComputeThread:
    """The process's compute thread (started on first use)."""
    global _shared
    with _lock:
        if _shared is None:
            _shared = ComputeThread()
        return _shared
