"""Lossless sampling: exact enumeration over every draw order, and the Gumbel-top-k draft sampler."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from sequoia_ray.config import SamplingParams
from sequoia_ray.sampling import SparseDist, draw_without_replacement, node_steps, target_probs, truncate


def draw_order_probability(q: torch.Tensor, order: tuple[int, ...]) -> float:
    """P(children drawn in this order) under sequential sampling without replacement from q, uniform
    over the undrawn tokens once q's support is exhausted (the spec, written independently of the code)."""
    prob, drawn = 1.0, set()
    for s in order:
        rest = [t for t in range(len(q)) if t not in drawn]
        mass = sum(float(q[t]) for t in rest)
        prob *= float(q[s]) / mass if mass > 0 else 1.0 / len(rest)
        drawn.add(s)
    return prob


def output_distribution(p: torch.Tensor, q: torch.Tensor, k: int) -> torch.Tensor:
    """Exact distribution of the token a node emits (accepted child or residual), over all draw orders."""
    out = torch.zeros_like(p)
    for order in itertools.permutations(range(len(p)), k):
        w = draw_order_probability(q, order)
        if w == 0:
            continue
        reach = 1.0
        for s, step in zip(order, node_steps(p, q, list(order))):
            out[s] += w * reach * step.accept_prob
            reach *= 1 - step.accept_prob
            last = step.residual_after
        out += w * reach * last
    return out


def random_dist(gen: torch.Generator, v: int, zeros: int = 0) -> torch.Tensor:
    x = torch.rand(v, generator=gen, dtype=torch.float64) ** 3
    x[torch.randperm(v, generator=gen)[:zeros]] = 0
    return x / x.sum()


@pytest.mark.parametrize("seed", range(10))
@pytest.mark.parametrize("v,k,q_zeros", [(4, 1, 0), (4, 2, 0), (5, 3, 0), (6, 3, 2), (5, 4, 3), (4, 4, 3), (6, 5, 0)])
def test_verifier_output_equals_p_exactly(seed, v, k, q_zeros):
    gen = torch.Generator().manual_seed(seed)
    p = random_dist(gen, v, zeros=seed % 2)
    q = random_dist(gen, v, zeros=q_zeros)  # q_zeros >= v - k: the uniform fallback is exercised
    torch.testing.assert_close(output_distribution(p, q, k), p, atol=1e-12, rtol=0)


def test_fallback_case_really_draws_outside_q():
    q = torch.tensor([0.0, 1.0, 0.0, 0.0], dtype=torch.float64)
    orders = [o for o in itertools.permutations(range(4), 3) if draw_order_probability(q, o) > 0]
    assert all(o[0] == 1 for o in orders) and len(orders) == 6  # then uniform over the three others


def test_identical_draft_is_always_accepted():
    p = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64)
    steps = list(node_steps(p, p.clone(), [1, 0]))
    assert steps[0].accept_prob == 1.0


@pytest.mark.parametrize("k", [1, 3, 6])
def test_gumbel_top_k_matches_sequential_sampling(k):
    """N = 60,000 draws of ordered k-tuples from a 6-token D with 2 zeros; every tuple's frequency is
    within 5 standard errors (+1e-3) of draw_order_probability. False-failure chance per cell < 1e-6."""
    probs = torch.tensor([0.4, 0.3, 0.0, 0.2, 0.1, 0.0])
    dist = truncate(probs, 6)
    gen = torch.Generator().manual_seed(k)
    n = 60_000
    counts: dict[tuple, int] = {}
    for _ in range(n):
        t = tuple(draw_without_replacement(dist, k, 6, gen).tolist())
        counts[t] = counts.get(t, 0) + 1
    assert all(len(set(t)) == k for t in counts)
    for order in itertools.permutations(range(6), k):
        expected = draw_order_probability(probs.double(), order)
        freq = counts.get(order, 0) / n
        se = math.sqrt(max(expected * (1 - expected), 1e-12) / n)
        assert abs(freq - expected) <= 5 * se + 1e-3, (order, freq, expected)


def test_truncate_keeps_top_k_and_renormalises():
    d = truncate(torch.tensor([0.1, 0.5, 0.0, 0.4]), 2)
    assert set(d.tokens.tolist()) == {1, 3}
    torch.testing.assert_close(d.dense(4), torch.tensor([0.0, 5 / 9, 0.0, 4 / 9]))
    assert isinstance(d, SparseDist)


def test_top_p_and_temperature():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    torch.testing.assert_close(target_probs(logits, 1.0, 1.0), torch.tensor([0.5, 0.3, 0.15, 0.05]))
    torch.testing.assert_close(target_probs(logits, 1.0, 0.8), torch.tensor([0.625, 0.375, 0.0, 0.0]))
    torch.testing.assert_close(target_probs(logits, 1.0, 0.81), torch.tensor([0.5, 0.3, 0.15, 0.0]) / 0.95)
    assert target_probs(logits, 1.0, 0.1)[0] == 1.0  # the top token always survives
    hot = target_probs(logits, 2.0, 1.0)
    assert hot[3] > 0.05 and hot[0] < 0.5


def test_extreme_but_valid_parameters_stay_finite():
    """top_p below float32's smallest number keeps the top token (it used to zero every token -> NaN);
    a temperature below GREEDY_BELOW is greedy (logits / 1e-38 overflows)."""
    logits = torch.tensor([[2.0, 1.0, 3.0, -1.0]] * 2)
    for top_p in (1e-46, 1e-30):
        torch.testing.assert_close(target_probs(logits, 1.0, top_p), torch.tensor([[0.0, 0.0, 1.0, 0.0]] * 2))
    assert SamplingParams(temperature=1e-38).greedy and SamplingParams(temperature=2.2e-309).greedy
    assert not SamplingParams(temperature=1e-4).greedy
    assert torch.isfinite(target_probs(logits, 1e-4)).all()
