"""A stand-in for Ray's metric objects (Counter, Gauge, Histogram) that records its calls, no Ray needed."""

from __future__ import annotations


class Recorder:
    def __init__(self) -> None:
        self.calls = []

    def set(self, value, tags=None):
        self.calls.append((value, tags))

    def inc(self, value=1, tags=None):
        self.calls.append((value, tags))

    def observe(self, value, tags=None):
        self.calls.append(value)
