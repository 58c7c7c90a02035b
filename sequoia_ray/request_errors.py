"""The error a worker raises for a request it does not hold. Torch-free, so that code which only
recognises the error (a model actor's call tracker, imported by deployment replicas too) loads no torch."""

from __future__ import annotations


class UnknownRequest(KeyError):
    """A call for a request this worker does not hold (finished, reaped, or never started)."""
