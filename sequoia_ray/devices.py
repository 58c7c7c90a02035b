"""Which device a model runs on: ``auto | cpu | cuda``, resolved from what the process was given.

``auto`` is the accelerator the process was given, else the CPU: Ray hides every GPU an actor was not
assigned (``CUDA_VISIBLE_DEVICES``), so an actor with ``num_gpus: 0`` resolves to the CPU and one with a GPU
to that GPU; a tensor-parallel rank launched outside Ray picks its GPU by ``LOCAL_RANK``. The device is
decided once, when a model loads; afterwards every tensor the core builds takes its device from the model
(``model.device``), never assumes the host. Tensors that cross between processes travel as host tensors
and are placed on arrival. (torch is imported inside the functions: the command line reads ``DEVICE_CHOICES``
without loading torch.)
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

DEVICE_CHOICES = ("auto", "cpu", "cuda")


def check_device(spec: str) -> str:
    """``spec`` if it is a device choice, else a ValueError naming it and the choices (every config's check)."""
    if spec not in DEVICE_CHOICES:
        raise ValueError(f"device {spec!r} is not one of {', '.join(DEVICE_CHOICES)}; "
                         "auto = the assigned accelerator, else the CPU")
    return spec


def resolve_device(spec: str = "auto", *, gpu_ids: Sequence[int | str] = (), local_rank: int | None = None,
                   cuda_available: bool | None = None) -> torch.device:
    """The torch device for ``spec``.

    ``gpu_ids`` are the GPUs assigned to this process (``ray.get_gpu_ids()``): the first is the device, at its
    place among ``CUDA_VISIBLE_DEVICES`` (Ray narrows that to the assigned GPUs, so ``cuda:0``; with
    ``RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES`` it is left as it was, and every actor of a node took GPU 0),
    or its own number when that variable is unset. Without assigned ids, ``local_rank`` (default: the
    ``LOCAL_RANK`` environment variable) picks the GPU.
    """
    import torch

    check_device(spec)
    available = torch.cuda.is_available() if cuda_available is None else cuda_available
    if spec == "auto" and gpu_ids and not available:  # else the actor would hold its GPU and compute on the CPU
        raise ValueError(f"Ray assigned GPU {list(gpu_ids)} but torch sees no CUDA device (a CPU build of torch: "
                         "install a CUDA build, see scripts/gpu_check.sh; or set num_gpus: 0 / device: cpu)")
    if spec == "cpu" or (spec == "auto" and not available):
        return torch.device("cpu")
    if not available:
        raise ValueError("device 'cuda' was asked for but torch sees no CUDA device (a CPU build of torch, or no "
                         "GPU assigned to this actor: set num_gpus > 0); use device auto or cpu")
    if gpu_ids:
        return torch.device("cuda", visible_index(gpu_ids[0]))
    rank = _env_rank(local_rank) or 0
    count = torch.cuda.device_count() if cuda_available is None else rank + 1
    if count == 1:  # a launcher that narrows each process to its own GPU (CUDA_VISIBLE_DEVICES per task)
        return torch.device("cuda", 0)
    if rank >= count:  # it wrapped around (rank % count): two ranks of a group on one GPU, without a word
        raise ValueError(f"LOCAL_RANK {rank} but this process sees {count} GPU(s) (CUDA_VISIBLE_DEVICES="
                         f"{os.environ.get('CUDA_VISIBLE_DEVICES')!r}); run at most one rank per visible GPU")
    return torch.device("cuda", rank)


def visible_index(gpu_id: int | str) -> int:
    """The CUDA index of the GPU Ray calls ``gpu_id`` in this process: its place in ``CUDA_VISIBLE_DEVICES``
    (ids or UUIDs), its own number when the variable is unset, else 0."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return int(gpu_id) if str(gpu_id).isdigit() else 0
    listed = [item.strip() for item in visible.split(",") if item.strip()]
    return listed.index(str(gpu_id)) if str(gpu_id) in listed else 0


def _env_rank(local_rank: int | None) -> int | None:
    if local_rank is not None:
        return local_rank
    value = os.environ.get("LOCAL_RANK")
    if value is None or value.strip() in ("", "-1"):  # -1: "not distributed" (transformers' Trainer's convention)
        return None
    if not value.strip().isdigit():
        raise ValueError(f"LOCAL_RANK {value!r} is not a rank (0, 1, ...); unset it or give this process's rank")
    return int(value)


def synchronize(device: torch.device) -> None:
    """Wait for the work queued on ``device`` (a no-op on the CPU): call it before reading a clock, since an
    accelerator runs kernels asynchronously and a timer read right after a launch measures only the launch."""
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type != "cpu" and hasattr(torch, device.type):
        getattr(torch, device.type).synchronize()  # mps, xpu, ... expose the same call
