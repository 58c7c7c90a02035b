"""The core on a real CUDA device (skipped without one; see tests/conftest.py and scripts/gpu_check.sh).

The CPU-only twin of these tests is tests/unit/test_device_placement.py, which checks placement with a
claimed device; here the kernels really run on the GPU.
"""

from __future__ import annotations

import pytest
import torch

from sequoia_ray.config import SamplingParams
from sequoia_ray.draft import DraftWorker
from sequoia_ray.engine import SpeculativeDecoder
from sequoia_ray.models.kv_store import store_of
from sequoia_ray.target import TargetWorker
from sequoia_ray.tree.plan import chain, k_ary, specinfer
from tests.tiny import VOCAB, noisy_copy, sharpen, tiny_model

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda", 0)
PROMPTS = [[3, 1, 4, 1, 5], [9, 2, 6], [7] * 12]


def host_pair():
    """The tiny pair on the CPU (noisy_copy draws its noise with a host generator)."""
    target = sharpen(tiny_model("qwen2", seed=0), 12.0)
    return target, noisy_copy(target, scale=0.03, seed=1)


@pytest.fixture(scope="module")
def pair():
    target, draft = host_pair()
    return target.to(CUDA), draft.to(CUDA)


def generate(target, draft, plan, params):
    spec = SpeculativeDecoder(TargetWorker(target), DraftWorker(draft) if draft is not None else None, plan)
    return spec.generate(PROMPTS[0], params)


@pytest.mark.parametrize("plan", [chain(4), k_ary(2, 3), specinfer(3, 3)], ids=["chain", "binary", "specinfer"])
def test_greedy_is_the_target_alone_in_fp32(pair, plan):
    target, draft = pair
    for prompt in PROMPTS:
        alone = SpeculativeDecoder(TargetWorker(target), None, chain(0)).generate(prompt, SamplingParams(max_tokens=24))
        spec = SpeculativeDecoder(TargetWorker(target), DraftWorker(draft), plan).generate(
            prompt, SamplingParams(max_tokens=24))
        assert spec.token_ids == alone.token_ids
    assert spec.stats.tokens_per_step > 1.2  # the noisy copy is accepted: speculation really ran


def test_sampled_same_seed_same_tokens(pair):
    target, draft = pair
    params = SamplingParams(max_tokens=32, temperature=0.8, seed=123)
    first = generate(target, draft, specinfer(3, 3), params)
    assert generate(target, draft, specinfer(3, 3), params).token_ids == first.token_ids
    other = generate(target, draft, specinfer(3, 3), params.model_copy(update={"seed": 124}))
    assert other.token_ids != first.token_ids


def test_model_cache_and_generator_are_on_cuda(pair):
    target, draft = pair
    params = SamplingParams(max_tokens=8, temperature=0.8)
    dw, tw = DraftWorker(draft), TargetWorker(target)
    for worker in (dw, tw):
        worker.start("r", PROMPTS[0], params, seed=1)
    tree = dw.grow("r", specinfer(2, 2))
    assert tree.tokens.device.type == "cpu", "trees cross processes as host tensors"
    tw.verify("r", specinfer(2, 2), tree)
    for worker in (dw, tw):  # the K/V store the ragged forwards write (its layers' is_initialized stays False:
        store = store_of(worker.requests["r"].session.cache)  # they are written through RaggedCache, not update)
        assert store.keys.device.type == "cuda" and worker.requests["r"].session.length > len(PROMPTS[0])
        assert worker.device.type == "cuda"
    assert dw.requests["r"].generator.device.type == "cuda"  # the draft samples on the GPU
    assert tw.requests["r"].generator.device.type == "cpu"  # the verify walk runs on the host


def test_bf16_draft_with_an_fp32_target_is_still_the_target(pair):
    target, draft = pair
    draft16 = host_pair()[1].to(CUDA, torch.bfloat16)
    params = SamplingParams(max_tokens=24)
    alone = generate(target, None, chain(0), params)
    spec = generate(target, draft16, specinfer(3, 3), params)
    assert draft16.device.type == "cuda" and draft16.dtype == torch.bfloat16
    assert spec.token_ids == alone.token_ids  # the fp32 target decides every token


def test_a_cpu_draft_with_a_cuda_target(pair):
    """The actor layout: trees grown on the host cross to a GPU target."""
    target, _ = pair
    cpu_draft = host_pair()[1]
    params = SamplingParams(max_tokens=24)
    assert generate(target, cpu_draft, specinfer(3, 3), params).token_ids == generate(
        target, None, chain(0), params).token_ids


def test_loading_and_timing_on_cuda():
    from sequoia_ray.hardware import time_forward
    from sequoia_ray.models.loading import load_model

    loaded = load_model("tiny-target", device="cuda", progress=False)
    assert loaded.model.device == CUDA
    times = time_forward(loaded.model, (1, 4, 16), context=32, repeats=2)
    assert all(t > 0 for t in times.values())


def test_a_cuda_model_keeps_its_linear_layers():
    """oneDNN packing is a CPU kernel: ``auto`` leaves a bf16 model on the GPU as it is, ``packed`` refuses it."""
    from sequoia_ray.models.packed_linear import pack_linears

    model = tiny_model("qwen2", seed=0).to(CUDA, torch.bfloat16)
    assert pack_linears(model, "auto") == 0
    assert all(m.weight.is_cuda for m in model.modules() if isinstance(m, torch.nn.Linear))
    with pytest.raises(ValueError, match="the model is on cuda"):
        pack_linears(model, "packed")


@pytest.mark.parametrize("layout", ["ragged", "padded", "flat"])
def test_batched_layouts_equal_each_request_alone_on_cuda(layout):
    """The ragged layout's per-request SDPA on the GPU's own kernels (which may return a transposed output):
    ragged requests (trees, a prefill, a decode token) in one forward == each alone, K/V included."""
    from sequoia_ray.models.batch_forward import Segment, hidden_many
    from sequoia_ray.models.tree_lm import KVSession

    model = tiny_model("qwen2", seed=4).to(CUDA)
    gen = torch.Generator().manual_seed(0)

    def requests():
        out = []
        for past, plan in ((7, k_ary(2, 2)), (0, None), (12, chain(3)), (20, "decode")):
            s = KVSession(model)
            if past:
                s.forward(torch.randint(0, VOCAB, (past,), generator=gen).to(CUDA), torch.arange(past, device=CUDA))
            if plan is None:  # a prefill into an empty cache
                tokens, positions = torch.randint(0, VOCAB, (9,), generator=gen), torch.arange(9)
                out.append(Segment(s, tokens.to(CUDA), positions.to(CUDA)))
            elif plan == "decode":
                tokens = torch.randint(0, VOCAB, (1,), generator=gen)
                out.append(Segment(s, tokens.to(CUDA), torch.tensor([past], device=CUDA)))
            else:
                tokens = torch.randint(0, VOCAB, (plan.n,), generator=gen).to(CUDA)
                positions = past + torch.tensor(plan.depth, device=CUDA)
                out.append(Segment(s, tokens, positions, torch.from_numpy(plan.ancestor_mask()).to(CUDA)))
        return out

    gen.manual_seed(0)
    alone = [s.session.hidden(s.tokens, s.positions, s.allowed, s.tree_start) for s in requests()]
    gen.manual_seed(0)
    batched = requests()
    for e, g in zip(alone, hidden_many(model, batched, layout)):
        torch.testing.assert_close(g, e, atol=2e-4, rtol=1e-4)
    assert all(s.session.length == s.positions.numel() + p for s, p in zip(batched, (7, 0, 12, 20)))


def test_traced_layers_are_refused_on_cuda():
    """Traced layers are for CPU models: on CUDA, ``torch.jit.freeze`` merges the q/k/v projections into one
    matmul and TorchScript's fuser fuses pointwise ops (other kernels, other rounding; a review, session 57), and
    the load-time probe checks two shapes only. ``auto`` keeps the stock layers, ``traced`` is refused."""
    from sequoia_ray.models.traced_layers import trace_layers

    target, draft = (m.to(CUDA) for m in host_pair())
    params = SamplingParams(max_tokens=20, temperature=0.0)
    expected = generate(target, draft, k_ary(2, 2), params).token_ids
    assert trace_layers(target, "auto") == 0
    with pytest.raises(ValueError, match="traced layers are for CPU models only"):
        trace_layers(target, "traced")
    assert generate(target, draft, k_ary(2, 2), params).token_ids == expected


def test_a_subset_draft_head_on_cuda_keeps_the_targets_greedy_tokens():
    """``draft_vocab`` on a CUDA draft: the kept rows and ids on the model's device, -inf logits elsewhere, and
    the greedy tokens still the target alone's."""
    from types import SimpleNamespace

    from sequoia_ray.models.draft_vocab import restrict_head

    target, draft = (m.to(CUDA) for m in host_pair())
    assert restrict_head(draft, SimpleNamespace(), VOCAB // 2)
    head = draft.get_output_embeddings()
    assert head.ids.is_cuda and head.linear.weight.is_cuda
    assert torch.isneginf(head(torch.randn(2, draft.config.hidden_size, device=CUDA))[:, VOCAB // 2:]).all()
    params = SamplingParams(max_tokens=20, temperature=0.0)
    assert generate(target, draft, k_ary(2, 2), params).token_ids == generate(target, None, chain(0), params).token_ids


def test_a_token_drawn_on_cuda_is_the_one_drawn_on_the_cpu():
    """``sampling.inverse_cdf`` on a CUDA vector (its sums, search and fallback on the device) picks the id the
    host picks for the same uniform, never one of probability 0."""
    from sequoia_ray.sampling import inverse_cdf

    gen = torch.Generator().manual_seed(0)
    p = torch.rand(151_936, generator=gen) ** 8  # [V]
    p[torch.rand(p.numel(), generator=gen) < 0.5] = 0
    for u in torch.rand(50, generator=gen, dtype=torch.float64).tolist():
        got = inverse_cdf(p.to(CUDA), u)
        assert got == inverse_cdf(p, u) and p[got] > 0
