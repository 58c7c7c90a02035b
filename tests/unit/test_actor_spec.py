"""The actors' own spec and the ServeConfig that builds it: device, backend and placement validation."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from actors.placement import ActorResources, bundles
from actors.spec import COLLECTIVE_TIMEOUT_S, ModelActorSpec, check_backend
from deployments.config import ServeConfig
from sequoia_ray.batching import GATHER_S, LOCKSTEP_LOOKBACK, BatchLimits, comes_back_after_any_step


@pytest.mark.parametrize("idle, step, ok", [(7.0, 3.5, True), (300.0, 60.0, True), (0.5, 60.0, False),
                                             (119.0, 60.0, False)])
def test_an_idle_time_shorter_than_two_steps_is_refused(idle, step, ok):
    """A request idle timer below two step timeouts would free live requests' KV between their calls."""
    if ok:
        ServeConfig(request_idle_timeout_s=idle, step_timeout_s=step)
        return
    with pytest.raises(ValidationError, match=rf"request_idle_timeout_s {idle} .* give >= {2 * step:g}"):
        ServeConfig(request_idle_timeout_s=idle, step_timeout_s=step)


def test_serve_config_builds_the_actor_specs():
    cfg = ServeConfig(draft="d", target="t", dtype="float32", draft_quantize="int8", num_cpus=3,
                      request_idle_timeout_s=7.0, step_timeout_s=3.5)
    draft, target = cfg.actor_spec("draft"), cfg.actor_spec("target")
    assert draft == ModelActorSpec("d", dtype="float32", quantize="int8", device="auto", threads=3,
                                   idle_timeout_s=7.0, collective_timeout_s=COLLECTIVE_TIMEOUT_S,
                                   prefill_chunk=cfg.prefill_chunk, prefix_cache_tokens=cfg.prefix_cache_tokens,
                                   prefix_block=cfg.prefix_block, batch_wait_s=1.0, wait_trees=True,
                                   draft_vocab=65536)
    assert target.source == "t" and target.quantize is None  # only the draft is quantised
    assert ServeConfig(layers="eager").actor_spec("draft").layers == "eager"
    assert ServeConfig(layers="eager").actor_spec("target").layers == "eager"
    assert ServeConfig().actor_spec("draft").draft_vocab == 65536  # the default: a draft's head on 65,536 ids
    assert ServeConfig(draft_vocab=None).actor_spec("draft").draft_vocab is None
    assert ServeConfig(draft_vocab=1000).actor_spec("target").draft_vocab is None  # a target's head stays whole
    # lockstep tree steps: the target waits for them, the draft only gathers
    policy, drafts = target.batcher_policy(), target.batcher_policy(waits=False)
    assert (policy["limits"].wait_s, policy["limits"].gather_s, policy["lookback"]) == (1.0, GATHER_S, LOCKSTEP_LOOKBACK)
    assert (drafts["limits"].wait_s, drafts["limits"].gather_s) == (0.0, GATHER_S)
    assert policy["comes_back"] is drafts["comes_back"] is comes_back_after_any_step
    alternating = ServeConfig(batch_wait_trees=False, batch_wait_ms=300).actor_spec("target")
    for waits in (True, False):  # both wait as configured; requests come straight back (Batcher's default)
        assert alternating.batcher_policy(waits=waits) == {"limits": BatchLimits(wait_s=0.3)}
    batched = ServeConfig(max_batch_requests=1, max_batch_tokens=64, batch_layout="flat", prefill_chunk=32)
    spec = batched.actor_spec("target")
    assert (spec.max_batch_requests, spec.max_batch_tokens, spec.batch_layout, spec.prefill_chunk) == (1, 64, "flat", 32)
    assert cfg.collective_timeout_s == ModelActorSpec("x").collective_timeout_s == COLLECTIVE_TIMEOUT_S


@pytest.mark.parametrize("args,needle", [
    ({"tp_size": 2, "tp_backend": "nccl"}, "set tp_backend: gloo"),  # nccl on CPU ranks
    ({"tp_size": 2, "tp_backend": "gloo", "num_gpus": 1}, "set tp_backend: nccl"),  # gloo on GPU ranks (auto)
    ({"tp_size": 2, "tp_backend": "gloo", "num_gpus": 1, "device": "cuda"}, "set tp_backend: nccl"),
    ({"tp_backend": "mpi"}, "must be one of gloo, nccl"),
    ({"device": "tpu"}, "is not one of auto, cpu, cuda"),
    ({"device": "cuda"}, "set num_gpus: 1"),
    ({"num_gpus": 1, "draft_quantize": "int8"}, "runs on the CPU only"),
    ({"batch_layout": "paged"}, "layout 'paged' must be one of auto, flat, padded"),
    ({"max_batch_requests": 0}, "greater than or equal to 1"),
    ({"prefill_chunk": 0}, "greater than or equal to 1"),
    ({"tp_size": 2, "layers": "traced"}, "layers 'traced' cannot apply to a target sharded over tp_size 2"),
    ({"draft_vocab": 0}, "greater than or equal to 1"),
])
def test_bad_placement_is_a_config_error_naming_the_fix(args, needle):
    with pytest.raises(ValidationError) as err:
        ServeConfig(**args)
    assert needle in str(err.value)


@pytest.mark.parametrize("args", [
    {"tp_size": 2, "tp_backend": "nccl", "num_gpus": 1},  # auto on an assigned GPU
    {"tp_size": 2, "tp_backend": "gloo", "num_gpus": 1, "device": "cpu"},  # GPUs reserved, ranks on the CPU
    {"tp_size": 1, "tp_backend": "gloo", "num_gpus": 1},  # a single rank runs no collective
    {"num_gpus": 1, "draft_quantize": "int8", "device": "cpu"},
])
def test_consistent_placements_validate(args):
    ServeConfig(**args)


def test_actor_spec_validates_itself():
    with pytest.raises(ValueError, match="not one of auto, cpu, cuda"):
        ModelActorSpec("m", device="gpu")
    with pytest.raises(ValueError, match="CPU only"):
        ModelActorSpec("m", quantize="int8", device="cuda")
    with pytest.raises(ValueError, match="threads 0"):
        ModelActorSpec("m", threads=0)
    with pytest.raises(ValueError, match="max_batch_requests 0 must be >= 1"):
        ModelActorSpec("m", max_batch_requests=0)
    with pytest.raises(ValueError, match="prefill_chunk 0 must be >= 1"):
        ModelActorSpec("m", prefill_chunk=0)
    with pytest.raises(ValueError, match="layout 'x'"):
        ModelActorSpec("m", batch_layout="x")
    with pytest.raises(ValueError, match="layers 'jit' must be one of auto, traced, eager"):
        ModelActorSpec("m", layers="jit")
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match=f"draft vocabulary size {bad!r} must be an integer >= 1"):
            ModelActorSpec("m", draft_vocab=bad)
    with pytest.raises(ValueError, match="set tp_backend: nccl"):
        check_backend("gloo", "cuda", world=2)
    check_backend("gloo", "cuda", world=1)


def test_bundles_one_per_actor_the_replica_shares_the_first():
    gpu = ActorResources(num_cpus=2, num_gpus=1, accelerator_type="L4")
    assert bundles(gpu, 2) == [{"CPU": 2, "GPU": 1, "accelerator_type:L4": 0.001}] * 2
    assert bundles(ActorResources(), 1) == [{"CPU": 1.0}]
    assert gpu.options() == {"num_cpus": 2, "num_gpus": 1, "accelerator_type": "L4"}


def test_actor_device_follows_what_ray_assigned(monkeypatch):
    """auto: the GPU Ray assigned (cuda:0 in the actor: Ray narrows CUDA_VISIBLE_DEVICES), else the CPU even
    when GPUs are visible to a num_gpus 0 actor."""
    import torch

    from actors import base

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    monkeypatch.setattr(base.ray, "is_initialized", lambda: True)
    monkeypatch.setattr(base.ray, "get_gpu_ids", lambda: [])
    assert base.assigned_device("auto") == torch.device("cpu")
    monkeypatch.setattr(base.ray, "get_gpu_ids", lambda: [3])
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")  # as Ray sets it for the actor
    assert base.assigned_device("auto") == torch.device("cuda", 0)
    assert base.assigned_device("cpu") == torch.device("cpu")
    monkeypatch.setattr(base.ray, "get_gpu_ids", lambda: [])
    with pytest.raises(ValueError, match="no GPU; set num_gpus >= 1"):
        base.assigned_device("cuda")  # never a GPU Ray left visible but did not assign


def test_actor_log_lines_reach_stderr(capfd):
    """Actors log plain lines (no progress bars); without a handler INFO would be dropped in an actor."""
    import logging

    from actors.base import log_lines_to_stderr

    log = logging.getLogger("sequoia_ray")
    before = list(log.handlers), log.level
    try:
        log_lines_to_stderr()
        log_lines_to_stderr()  # idempotent: one handler, not one per actor class
        logging.getLogger("sequoia_ray.models.loading").info("loading tiny-target on cpu ... done in 0.1 s")
        err = capfd.readouterr().err
        assert err.count("INFO sequoia_ray.models.loading: loading tiny-target on cpu ... done in 0.1 s") == 1
        assert "\r" not in err
    finally:
        log.handlers[:], _ = before
        log.setLevel(before[1])


def test_cpu_actors_pinned_to_a_gpu_type_file_plans_under_the_cpu():
    """``accelerator_type`` may place CPU actors on a GPU type's nodes; their plans are the CPU's (the GPU's would
    be timed on another device)."""
    from sequoia_ray.hardware import hardware_id

    assert ServeConfig(accelerator_type="A100").plan_hardware_id(2) == hardware_id(None, 1, 2)
    assert ServeConfig(accelerator_type="A100", num_gpus=1, draft_quantize=None).plan_hardware_id(2) == "A100"


@pytest.mark.parametrize("autoscaling,message", [
    ({"max_replica": 4}, "unknown keys \\['max_replica'\\]"),  # a typo: Serve would drop it and never scale
    ({"min_replicas": 5, "max_replicas": 2}, "must be greater than or equal to min_replicas"),
    ({"min_replicas": "x"}, "min_replicas"),
])
def test_an_autoscaling_config_serve_would_refuse_or_misread_is_refused(autoscaling, message):
    with pytest.raises(ValidationError, match=message):
        ServeConfig(autoscaling=autoscaling)
    assert ServeConfig(autoscaling={"min_replicas": 1, "max_replicas": 4, "target_ongoing_requests": 4}).autoscaling


def test_nccl_ranks_need_a_whole_gpu_each():
    with pytest.raises(ValidationError, match="one whole GPU each"):
        ServeConfig(tp_size=2, tp_backend="nccl", num_gpus=0.5, draft_quantize=None)
    assert ServeConfig(tp_size=2, tp_backend="nccl", num_gpus=1, draft_quantize=None).tp_size == 2


def test_a_prefill_chunk_larger_than_the_token_budget_is_refused():
    """A chunk over max_batch_tokens ran alone at every forward (a first call over the budget still runs), and the
    decoding steps behind it waited a whole forward each time: a configuration mistake, named now."""
    with pytest.raises(ValueError, match="prefill_chunk 256 is larger than max_batch_tokens 64"):
        ServeConfig(max_batch_tokens=64)
    assert ServeConfig(max_batch_tokens=64, prefill_chunk=64).prefill_chunk == 64
    assert ServeConfig(max_batch_tokens=64, prefill_chunk=None).prefill_chunk is None  # the user's choice: unchunked


def test_traced_layers_on_a_gpu_are_refused_by_the_config():
    """Traced layers are for CPU models (on CUDA TorchScript merges the q/k/v projections and fuses pointwise ops:
    other kernels, other rounding); the config names it before any actor loads."""
    with pytest.raises(ValueError, match="layers 'traced' is for CPU models only"):
        ServeConfig(layers="traced", num_gpus=1)
    assert ServeConfig(layers="auto", num_gpus=1).layers == "auto"
    assert ServeConfig(layers="traced").layers == "traced"  # on the CPU
