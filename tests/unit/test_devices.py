"""Device resolution: auto | cpu | cuda from what the process was assigned (no GPU needed)."""

import pytest
import torch

from sequoia_ray.devices import resolve_device


def test_cpu_and_auto_without_an_accelerator_are_the_host():
    assert resolve_device("cpu", cuda_available=True) == torch.device("cpu")
    assert resolve_device("auto", cuda_available=False) == torch.device("cpu")



def test_an_assigned_gpu_that_torch_cannot_see_is_an_error():
    """Ray gave the actor a GPU, but torch is a CPU build: computing on the CPU would hold the GPU idle and file
    plans under the CPU's id."""
    with pytest.raises(ValueError, match=r"Ray assigned GPU \[3\] but torch sees no CUDA device"):
        resolve_device("auto", gpu_ids=[3], cuda_available=False)
    assert resolve_device("cpu", gpu_ids=[3], cuda_available=False) == torch.device("cpu")  # asked for: the CPU


def test_auto_takes_the_assigned_gpu(monkeypatch):
    # Ray restricts CUDA_VISIBLE_DEVICES to the actor's GPUs, so the first assigned GPU is cuda:0 inside it.
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5")
    assert resolve_device("auto", gpu_ids=[5], cuda_available=True) == torch.device("cuda", 0)
    assert resolve_device("cuda", local_rank=1, cuda_available=True) == torch.device("cuda", 1)


@pytest.mark.parametrize("visible,gpu_id,index", [("0,1,2,3", 3, 3), ("2,3", 3, 1), (None, 3, 3),
                                                  ("GPU-aa,GPU-bb", "GPU-bb", 1), ("", 2, 0)])
def test_the_assigned_gpu_is_found_among_the_visible_ones(monkeypatch, visible, gpu_id, index):
    """With RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES (vLLM-style stacks set it) Ray leaves the variable as it
    was: every actor of a node took cuda:0, its assigned GPU or not. The assigned id is looked up in it (ids or
    UUIDs), or taken as the index when it is unset."""
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    assert resolve_device("auto", gpu_ids=[gpu_id], cuda_available=True) == torch.device("cuda", index)


def test_local_rank_from_the_environment(monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "2")
    assert resolve_device("auto", cuda_available=True) == torch.device("cuda", 2)


def test_bad_values_name_the_value_and_the_fix():
    with pytest.raises(ValueError, match="'tpu'.*auto, cpu, cuda"):
        resolve_device("tpu")
    with pytest.raises(ValueError, match="no CUDA device.*auto or cpu"):
        resolve_device("cuda", cuda_available=False)


def test_int8_draft_is_cpu_only():
    from sequoia_ray.models.loading import load_model

    with pytest.raises(ValueError, match="CPU only.*bfloat16 or float16"):
        load_model("tiny-draft", quantize="int8", device=torch.device("cuda", 0))


def test_quiet_loading_draws_no_bar_and_logs_plain_lines(capfd, caplog):
    """Actors load with progress=False: a bar's carriage returns become blank lines in a Ray driver's log."""
    import logging

    from sequoia_ray.models.loading import load_model

    capfd.readouterr()
    with caplog.at_level(logging.INFO, logger="sequoia_ray.models.loading"):
        load_model("tiny-target", progress=False)
    quiet = capfd.readouterr()
    assert "\r" not in quiet.err + quiet.out and "it/s" not in quiet.err, quiet.err[-500:]
    assert any(r.getMessage().startswith("loading tiny-target on cpu ... done in ") for r in caplog.records)
    load_model("tiny-target", progress=True)  # the command line's bars are back (the switch was restored)
    assert "Loading weights" in capfd.readouterr().err


def test_progress_bars_switch_restores_the_previous_state():
    import transformers.modeling_gguf_pytorch_utils as gguf
    from transformers.utils import logging as hf_logging

    from sequoia_ray.models.loading import progress_bars

    before = gguf.tqdm
    with progress_bars(False):
        assert not hf_logging.is_progress_bar_enabled()
        assert gguf.tqdm is not before
    assert hf_logging.is_progress_bar_enabled() and gguf.tqdm is before


def test_profile_job_device_is_validated_and_reaches_the_cli():
    import argparse

    from pydantic import ValidationError

    from sequoia_ray.config import ProfileJobConfig
    from sequoia_ray.arguments import add_job_args, job_config

    assert ProfileJobConfig(storage="/tmp/x").device == "auto"
    with pytest.raises(ValidationError, match="'tpu' is not one of auto, cpu, cuda"):
        ProfileJobConfig(storage="/tmp/x", device="tpu")
    parser = argparse.ArgumentParser()
    add_job_args(parser)
    assert job_config(parser.parse_args(["--storage", "/tmp/x", "--device", "cpu"])).device == "cpu"


def test_a_tree_crosses_devices_in_one_transfer_per_field():
    """DraftTree.to packs every inner node's D: one tokens and one probs tensor move, not two per node."""
    from sequoia_ray.draft import DraftTree
    from sequoia_ray.sampling import SparseDist

    dists = {node: SparseDist(torch.tensor([node, node + 10]), torch.tensor([0.75, 0.25])) for node in (0, 2, 5)}
    moved = DraftTree(torch.arange(7), dists).to("cpu")
    assert list(moved.dists) == [0, 2, 5]
    for node, d in moved.dists.items():
        assert d.tokens.tolist() == [node, node + 10] and d.probs.tolist() == [0.75, 0.25]
    assert len({d.tokens.untyped_storage().data_ptr() for d in moved.dists.values()}) == 1
    assert len({d.probs.untyped_storage().data_ptr() for d in moved.dists.values()}) == 1
    assert DraftTree(torch.arange(3), {}).to("cpu").dists == {}


@pytest.mark.parametrize("quantize,device,expected", [("int8", "auto", "cpu"), (None, "auto", "auto")])
def test_a_pair_with_an_int8_draft_on_device_auto_loads_on_the_cpu(monkeypatch, quantize, device, expected):
    """int8 runs on the CPU only: on a machine with a GPU, ``auto`` put the int8 draft on it and failed (every
    CPU benchmark of benchmarks/ that loads the served pair)."""
    import sequoia_ray.local as local

    asked = []
    monkeypatch.setattr(local, "load_model", lambda source, **kw: asked.append(kw["device"]))
    monkeypatch.setattr(local, "check_same_vocab", lambda t, d: None)
    local.LocalPair.load("t", "d", draft_quantize=quantize, device=device, progress=False)
    assert asked == [expected, expected]


@pytest.mark.parametrize("draft,options,error", [
    ("d", {"draft_quantize": "int8", "device": "cuda"}, "cuda"),  # int8 on cuda (or no CUDA here): refused
    ("d", {"draft_quantize": "int4"}, "quantize 'int4' is not supported"),
    ("d", {"draft_vocab": 0}, "draft vocabulary size 0"),
    ("/no/such/draft", {}, "model path /no/such/draft does not exist"),
    ("  ", {}, "model source '  ' is empty")])
def test_a_pairs_bad_draft_is_refused_before_the_target_loads(monkeypatch, draft, options, error):
    """The draft's options and path were checked only when the draft loaded, after the target (minutes for a
    real one, spent for nothing): a mistyped draft path failed at the end of the wait."""
    import sequoia_ray.local as local

    loaded = []
    monkeypatch.setattr(local, "load_model", lambda source, **kw: loaded.append(source))
    with pytest.raises((ValueError, FileNotFoundError), match=error):
        local.LocalPair.load("t", draft, progress=False, **options)
    assert loaded == []


def test_a_local_rank_past_the_visible_gpus_is_refused_not_wrapped(monkeypatch):
    """LOCAL_RANK 2 on a 2-GPU host took cuda:0 (rank % count): two ranks of a group on one GPU, without a word."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert resolve_device("cuda") == torch.device("cuda", 1)
    monkeypatch.setenv("LOCAL_RANK", "2")
    with pytest.raises(ValueError, match="LOCAL_RANK 2 but this process sees 2 GPU"):
        resolve_device("cuda")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)  # each process narrowed to its own GPU: that one
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert resolve_device("cuda") == torch.device("cuda", 0)
    monkeypatch.setenv("LOCAL_RANK", "one")
    with pytest.raises(ValueError, match="LOCAL_RANK 'one' is not a rank"):
        resolve_device("cuda")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setenv("LOCAL_RANK", "-1")  # "not distributed" (transformers' convention): the first GPU
    assert resolve_device("cuda") == torch.device("cuda", 0)
