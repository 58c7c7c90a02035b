"""Tensor parallelism on GPUs: the tiny target split over 2 GPUs with nccl decodes exactly what one GPU
does (greedy, fp32), both alone and verifying a draft actor's trees. Needs >= 2 CUDA devices; starts local
Ray with them. Run with ``pytest -m gpu tests/gpu`` (``scripts/gpu_check.sh`` does)."""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                       reason="needs at least 2 CUDA devices (tensor parallelism over nccl)"),
]

PROMPTS = ["hello world", "the cat sat on"]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def local_ray():
    import ray

    ray.init(num_cpus=4, num_gpus=torch.cuda.device_count(), include_dashboard=False)
    yield
    ray.shutdown()


def decode(ranks, meta, draft_actor=None) -> list[list[int]]:
    from actors.adapters import ActorDraft, RanksTarget
    from sequoia_ray.config import SamplingParams
    from sequoia_ray.engine import SpeculativeDecoder
    from sequoia_ray.local import encode
    from sequoia_ray.models.loading import load_tokenizer
    from sequoia_ray.tree.builtin import builtin_plan

    tok = load_tokenizer("tiny-target", progress=False)
    draft = ActorDraft(draft_actor, 120.0) if draft_actor is not None else None
    decoder = SpeculativeDecoder(RanksTarget(ranks, 120.0), draft, builtin_plan(0.0).plan, tokenizer=tok,
                                 eos_ids=tuple(meta["eos_ids"]), max_context=meta["max_context"])
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    return [decoder.generate(encode(tok, p, chat=False), params).token_ids for p in PROMPTS]


def group(tp_size: int):
    from actors.placement import ActorResources
    from actors.spec import ModelActorSpec
    from actors.target import TargetGroup

    return TargetGroup(ModelActorSpec("tiny-target", device="cuda"), tp_size, "nccl", ActorResources(num_gpus=1))


def test_tp2_over_nccl_equals_tp1(local_ray):
    import ray

    from actors.draft import DraftActor
    from actors.spec import ModelActorSpec

    one = group(1)
    try:
        assert one.meta["device"] == "cuda:0"
        expected = decode(one.ranks, one.meta)
    finally:
        one.kill()
    two = group(2)
    draft = ray.remote(concurrency_groups={"health": 1})(DraftActor).options(num_cpus=1).remote(
        ModelActorSpec("tiny-draft", device="cpu"))
    try:
        assert [ray.get(r.info.remote())["device"] for r in two.ranks] == ["cuda:0", "cuda:0"]  # one GPU each
        assert decode(two.ranks, two.meta) == expected
        assert decode(two.ranks, two.meta, draft) == expected  # trees from a CPU draft, verified on 2 GPUs
    finally:
        two.kill()
        ray.kill(draft)
