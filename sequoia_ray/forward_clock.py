"""Seconds a worker spends inside its model's forwards (``hidden_many`` and the LM head), summed.

Off by default (no clock reads, no device syncs on the serving path). The profile's overhead runs
(``sequoia_ray.overhead``) turn it on: a step's time outside the forwards — drawing, the walk, the KV
compaction, the Python around them — is the step minus what this clock saw inside it, both read in the same
step, so a machine faster or slower than when t(n) and c were timed moves neither. On an accelerator the
device is synchronised at both ends of a forward (its kernels run asynchronously).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from sequoia_ray.devices import synchronize


class ForwardClock:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.on = False
        self.seconds = 0.0  # inside forwards since the clock was made, while on

    @contextmanager
    def timing(self) -> Iterator[None]:
        if not self.on:
            yield
            return
        synchronize(self.device)
        start = time.perf_counter()
        try:
            yield
        finally:
            synchronize(self.device)
            self.seconds += time.perf_counter() - start
