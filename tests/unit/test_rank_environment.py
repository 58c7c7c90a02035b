"""A rank's environment for transformers' TP loading: a CPU rank of a group hides the node's GPUs (Ray leaves
them visible to a ``num_gpus: 0`` actor, and transformers would put every gloo rank's shards on cuda:0); a GPU
rank loads onto the GPU Ray assigned. ``tests/gpu/test_tp_nccl.py`` runs a gloo group on a GPU node."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from actors.target import rank_environment


def test_a_cpu_rank_of_a_group_hides_the_gpus():
    assert rank_environment(torch.device("cpu"), world=2) == {"LOCAL_RANK": "0", "CUDA_VISIBLE_DEVICES": ""}


def test_a_single_rank_keeps_the_gpus_of_its_process():
    assert rank_environment(torch.device("cpu"), world=1) == {"LOCAL_RANK": "0"}  # it loads without TP


@pytest.mark.parametrize("index", [0, 1])
def test_a_gpu_rank_loads_onto_its_own_gpu(index):
    assert rank_environment(torch.device("cuda", index), world=2) == {"LOCAL_RANK": str(index)}


def test_hidden_gpus_leave_torch_detecting_the_cpu():
    """What transformers reads to place the shards, in a fresh process with the environment applied (here a
    CPU build says cpu anyway; on a GPU node this is what makes the gloo ranks load on the CPU)."""
    env = dict(os.environ, **rank_environment(torch.device("cpu"), world=2))
    code = "import torch; print(torch._C._get_accelerator().type, torch.cuda.is_available())"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["cpu", "False"]
