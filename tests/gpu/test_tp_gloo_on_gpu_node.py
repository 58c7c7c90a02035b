"""A CPU target split over gloo on a node that has GPUs: Ray leaves the node's GPUs visible to the ranks'
``num_gpus: 0`` actors, and transformers puts TP shards on the accelerator torch detects, so without
``actors.target.rank_environment`` both ranks loaded onto cuda:0. Needs a CUDA device; run with
``pytest -m gpu tests/gpu`` (``scripts/gpu_check.sh`` does)."""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device on the node"),
]


def test_gloo_ranks_on_a_gpu_node_run_on_the_cpu_and_decode_what_one_rank_does():
    import ray

    from actors.placement import ActorResources
    from actors.spec import ModelActorSpec
    from actors.target import TargetGroup
    from tests.gpu.test_tp_nccl import decode

    ray.init(num_cpus=4, num_gpus=torch.cuda.device_count(), include_dashboard=False)
    try:
        groups = [TargetGroup(ModelActorSpec("tiny-target", device="cpu"), tp, "gloo", ActorResources(num_cpus=1))
                  for tp in (1, 2)]
        try:
            assert [ray.get(r.info.remote())["device"] for r in groups[1].ranks] == ["cpu", "cpu"]
            assert decode(groups[1].ranks, groups[1].meta) == decode(groups[0].ranks, groups[0].meta)
        finally:
            for g in groups:
                g.kill()
    finally:
        ray.shutdown()
