"""The error a worker raises for a request it does not hold, and which errors no request survives. Torch-free,
so that code which only recognises them (a model actor's call tracker, imported by deployment replicas too)
loads no torch."""

from __future__ import annotations

import sys


class UnknownRequest(KeyError):
    """A call for a request this worker does not hold (finished, reaped, or never started)."""


class RequestCancelled(Exception):
    """The request's caller has gone and it was freed on the workers under its step
    (``SpeculativeDecoder.cancel``): the step ends here; nobody reads it."""


def poisons_device(exc: BaseException) -> bool:
    """Whether ``exc`` leaves the process's accelerator unusable: a CUDA error (an illegal address, a device-side
    assert, an ECC fault) poisons the CUDA context, so every later call fails too. Such an error must not be
    caught per request (the batch "going on" would fail every request after it) but end the actor, which its
    health check then reports broken. Out of memory is not one: the next, smaller batch may fit."""
    torch = sys.modules.get("torch")  # not loaded: no tensor ever ran here, so no device error either
    return torch is not None and isinstance(exc, getattr(torch, "AcceleratorError", ()))
