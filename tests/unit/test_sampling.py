"""Lossless sampling: exact enumeration over every draw order, and the Gumbel-top-k draft sampler."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from sequoia_ray.config import SamplingParams
from sequoia_ray.sampling import (SparseDist, draw_without_replacement, node_steps, target_probs, truncate,
                                  verify_node)


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


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("v,k", [(4, 1), (5, 3), (4, 4)])
def test_a_draft_row_without_support_is_uniform_and_the_verifier_stays_exact(seed, v, k):
    """A draft row of NaN logits (an overflowing float16 draft) leaves D no support: the draft draws uniformly
    (the fallback), and the verifier reads the same uniform D, so the output is still exactly P."""
    nan_row = truncate(target_probs(torch.full((v,), float("nan")), 1.0), v)
    assert len(nan_row.tokens) == 0
    drawn = draw_without_replacement(nan_row, k, v, torch.Generator().manual_seed(seed))
    assert sorted(set(drawn.tolist())) == sorted(drawn.tolist()) and len(drawn) == k
    p = random_dist(torch.Generator().manual_seed(seed), v, zeros=seed % 2)
    no_support = nan_row.dense(v, torch.float64)
    torch.testing.assert_close(output_distribution(p, no_support, k), p, atol=1e-12, rtol=0)


def test_a_target_row_of_nan_is_an_error_not_an_acceptance():
    p = torch.full((4,), float("nan"), dtype=torch.float64)
    q = torch.tensor([0.1, 0.2, 0.3, 0.4], dtype=torch.float64)
    with pytest.raises(ValueError, match="not finite"):
        list(node_steps(p, q, [3, 2]))
    with pytest.raises(ValueError, match="draft probability 0"):  # a child D could not have drawn
        list(node_steps(q, torch.tensor([0.0, 0.5, 0.5, 0.0], dtype=torch.float64), [0]))


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


@pytest.mark.parametrize("seed", range(12))
def test_a_seeded_draw_does_not_depend_on_the_order_its_support_is_listed_in(seed):
    """A batched forward sums in another order than a 1-token one: two tokens' draft probabilities 1 ulp apart can
    come out of the top-k the other way round. The same seed must draw the same tokens from the same distribution
    whichever way its support is listed (12 tokens, 1 ulp near-ties among them; k past the support on odd seeds:
    the uniform fallback too)."""
    gen = torch.Generator().manual_seed(seed)
    probs = torch.rand(12, generator=gen, dtype=torch.float64)
    probs[1::2] = torch.nextafter(probs[::2], torch.tensor(1.0, dtype=torch.float64))  # pairs 1 ulp apart
    tokens, perm = torch.randperm(40, generator=gen)[:12], torch.randperm(12, generator=gen)
    k = 15 if seed % 2 else 5
    probs = probs / probs.sum()
    listed = draw_without_replacement(SparseDist(tokens, probs), k, 40, torch.Generator().manual_seed(seed))
    swapped = draw_without_replacement(SparseDist(tokens[perm], probs[perm]), k, 40, torch.Generator().manual_seed(seed))
    assert listed.tolist() == swapped.tolist()
    assert len(set(listed.tolist())) == k


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


def _nucleus_by_full_sort(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    sorted_p, order = torch.sort(probs, dim=-1, descending=True, stable=True)  # ties by id
    keep = torch.cumsum(sorted_p, dim=-1) - sorted_p < top_p
    keep[..., 0] = True
    kept = torch.zeros_like(probs).scatter_(-1, order, torch.where(keep, sorted_p, torch.zeros_like(sorted_p)))
    return kept / kept.sum(dim=-1, keepdim=True)


@pytest.mark.parametrize("top_p", [0.3, 0.9, 0.95, 0.999])
def test_the_nucleus_found_in_the_top_k_is_the_full_sorts(top_p):
    """``target_probs`` looks for the nucleus in the row's top NUCLEUS_K before sorting all of it: the same
    distribution as sorting the whole row (ties by id), for peaked rows (the top k settle it), flat ones (the
    whole row is sorted), rows of bf16 logits (many ties: topk and an unstable sort broke them differently, 370
    of 800 such rows kept other tokens in a review's run) and a level mixing them, each row as it is alone.
    56 rows of 4,096 ids per top_p."""
    from sequoia_ray.sampling import NUCLEUS_K

    generator = torch.Generator().manual_seed(int(top_p * 1000))
    rows = []
    for scale in (0.1, 1.0, 3.0, 6.0, 12.0):  # flat to peaked (at 0.1 the top 256 of 4,096 hold ~7% of the mass)
        rows.append(torch.randn(8, 4096, generator=generator) * scale)
    for scale in (3.0, 6.0):
        rows.append((torch.randn(8, 4096, generator=generator) * scale).bfloat16().float())  # ties
    for logits in rows + [torch.cat([rows[0][:2], rows[-1][:2]])]:
        expected = _nucleus_by_full_sort(logits, 0.7, top_p)
        assert torch.equal(target_probs(logits, 0.7, top_p), expected)
        for row in logits[:3]:
            assert torch.equal(target_probs(row, 0.7, top_p), _nucleus_by_full_sort(row, 0.7, top_p))
    flat = rows[0][0]
    assert int((target_probs(flat, 0.7, 0.95) > 0).sum()) > NUCLEUS_K  # the fallback really ran


def test_extreme_but_valid_parameters_stay_finite():
    """top_p below float32's smallest number keeps the top token (it used to zero every token -> NaN);
    a temperature below GREEDY_BELOW is greedy (logits / 1e-38 overflows)."""
    logits = torch.tensor([[2.0, 1.0, 3.0, -1.0]] * 2)
    for top_p in (1e-46, 1e-30):
        torch.testing.assert_close(target_probs(logits, 1.0, top_p), torch.tensor([[0.0, 0.0, 1.0, 0.0]] * 2))
    assert SamplingParams(temperature=1e-38).greedy and SamplingParams(temperature=2.2e-309).greedy
    assert not SamplingParams(temperature=1e-4).greedy
    assert torch.isfinite(target_probs(logits, 1e-4)).all()


# ---- dynamic trees: children kept while a stopping rule says so (sequoia_ray.draft) ----------------------
def stopped_output_distribution(p: torch.Tensor, q: torch.Tensor, k: int, kept) -> torch.Tensor:
    """Exact distribution of a node's output when only the first ``kept(order)`` of the k draws are sent
    (the verifier sees those children, then emits the residual), over every draw order of length k."""
    out = torch.zeros_like(p)
    for order in itertools.permutations(range(len(p)), k):
        w = draw_order_probability(q, order)
        if w == 0:
            continue
        m = kept(order)
        reach, last = 1.0, p
        for s, step in zip(order[:m], node_steps(p, q, list(order[:m]))):
            out[s] += w * reach * step.accept_prob
            reach *= 1 - step.accept_prob
            last = step.residual_after
        out += w * reach * last
    return out


def expected_rule(q: torch.Tensor, worth: float, threshold: float):
    """The draft's rule: keep child i while worth * E[D(s_i) | s_1..s_{i-1}] >= threshold (the code's E_i)."""
    from sequoia_ray.draft import _kept_prefix
    from sequoia_ray.sampling import expected_draw_probability

    dist = truncate(q, len(q))

    def kept(order):
        expected = expected_draw_probability(dist, torch.tensor(order)).tolist()
        return _kept_prefix([worth * e for e in expected], threshold)
    return kept


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("v,k,q_zeros", [(4, 3, 0), (5, 3, 0), (5, 4, 2), (6, 4, 0), (5, 4, 3)])
def test_pruned_children_keep_the_verifier_exact(seed, v, k, q_zeros):
    """Children kept while the expected path probability of the next draw stays >= threshold (a prefix decided
    before each draw is read): the node's output law is P to 1e-12, over every draw order. The threshold is at
    most the median of the rule's later values, so different draw orders stop at different lengths (checked)."""
    from sequoia_ray.sampling import expected_draw_probability

    gen = torch.Generator().manual_seed(100 + seed)
    p = random_dist(gen, v, zeros=seed % 2)
    q = random_dist(gen, v, zeros=q_zeros)
    worth = 0.5 + 0.5 * float(torch.rand((), generator=gen))
    orders = [o for o in itertools.permutations(range(v), k) if draw_order_probability(q, o) > 0]
    values = sorted({round(x, 12) for o in orders
                     for x in expected_draw_probability(truncate(q, v), torch.tensor(o))[1:].tolist() if x > 0})
    first = float(expected_draw_probability(truncate(q, v), torch.tensor(orders[0]))[0])  # the same for every order
    threshold = worth * min(first, values[len(values) // 2])  # the first child is kept, later ones vary
    kept = expected_rule(q, worth, threshold)
    assert len({kept(o) for o in orders}) > 1, "the rule must stop at different lengths for the test to bite"
    torch.testing.assert_close(stopped_output_distribution(p, q, k, kept), p, atol=1e-12, rtol=0)


def test_a_rule_that_reads_the_drawn_token_is_not_exact():
    """The control: keeping child i iff D(s_i) >= threshold (deciding on the draw itself, then dropping it)
    biases the output — the enumeration above has the power to see it."""
    p = torch.tensor([0.1, 0.2, 0.3, 0.4], dtype=torch.float64)
    q = torch.tensor([0.4, 0.3, 0.2, 0.1], dtype=torch.float64)

    def reads_the_draw(order):
        return _first_below([float(q[s]) for s in order], 0.25)
    out = stopped_output_distribution(p, q, 3, reads_the_draw)
    assert float((out - p).abs().max()) > 1e-3


def _first_below(values: list[float], bound: float) -> int:
    return next((i for i, x in enumerate(values) if x < bound), len(values))


def test_expected_draw_probability_is_the_mean_of_the_next_draw():
    """E_i against its definition, by enumeration: sum over the next token x of D_i(x) * D(x)."""
    from sequoia_ray.sampling import expected_draw_probability

    q = torch.tensor([0.5, 0.0, 0.3, 0.2], dtype=torch.float64)
    dist = truncate(q, 4)
    for order in itertools.permutations(range(4), 4):
        got = expected_draw_probability(dist, torch.tensor(order)).tolist()
        for i in range(4):
            rest = [t for t in range(4) if t not in order[:i]]
            mass = sum(float(q[t]) for t in rest)
            want = sum(float(q[t]) ** 2 for t in rest) / mass if i < 3 else 0.0  # the 4th draw is uniform fallback
            assert got[i] == pytest.approx(want, abs=1e-12), (order, i)


# ---- one token from P: the two-level inverse CDF ----------------------------------------------------------------
def _reference_id(p: torch.Tensor, u: float) -> int:
    """The spec, over one float64 CDF of the whole vocabulary: the first id whose CDF exceeds u · total."""
    cdf = torch.cumsum(p.double(), 0)
    return int(torch.searchsorted(cdf, torch.tensor([u * float(cdf[-1])], dtype=torch.float64), right=True))


@pytest.mark.parametrize("v", [7, 1024, 3000, 5121])
def test_inverse_cdf_is_the_full_cdfs_inverse_and_never_picks_a_zero(v):
    from sequoia_ray.sampling import inverse_cdf

    gen = torch.Generator().manual_seed(v)
    p = torch.rand(v, generator=gen) ** 4  # [V] skewed, with zeros in runs and at block edges
    p[torch.rand(v, generator=gen) < 0.4] = 0
    p[: min(v, 3)] = 0
    p[-1] = 0
    cdf = torch.cumsum(p.double(), 0)
    total = float(cdf[-1])
    us = [0.0, 1 - 1e-16, *torch.rand(400, generator=gen, dtype=torch.float64).tolist()]
    for u in us:
        got = inverse_cdf(p, u)
        assert p[got] > 0, (u, got)
        gaps = (cdf - u * total).abs()
        if float(gaps.min()) > 1e-9 * total:  # away from a boundary, where another summation order may round it over
            assert got == _reference_id(p, u), u


def test_a_draw_past_a_blocks_rounded_sum_takes_its_last_positive_id(monkeypatch):
    from sequoia_ray import sampling

    monkeypatch.setattr(sampling, "SAMPLE_BLOCK", 4)
    p = torch.tensor([0.0, 0.25, 0.0, 0.0, 0.5, 0.0, 0.25, 0.0])  # blocks [0, .25, 0, 0] and [.5, 0, .25, 0]
    assert sampling.inverse_cdf(p, 0.0) == 1 and sampling.inverse_cdf(p, 0.2499) == 1
    assert sampling.inverse_cdf(p, 0.25) == 4 and sampling.inverse_cdf(p, 0.7499) == 4
    assert sampling.inverse_cdf(p, 0.75) == 6 and sampling.inverse_cdf(p, 1 - 1e-16) == 6
    assert sampling.inverse_cdf(p * 3, 0.5) == 4  # any positive total


@pytest.mark.parametrize("bad", [torch.zeros(3000), torch.full((5,), float("nan")), torch.tensor([0.5, float("inf")])])
def test_probabilities_that_sum_to_nothing_usable_are_refused(bad):
    from sequoia_ray.sampling import inverse_cdf

    with pytest.raises(ValueError, match="cannot draw a token from probabilities summing to"):
        inverse_cdf(bad, 0.5)


def test_sample_has_the_law_of_p():
    """N = 40,000 draws from a P over 2,500 ids (three blocks; mass on 6 ids and a spread tail): each heavy id's
    frequency within 5 standard errors of its p (a wrong id or block is off by far more), the tail's too, and no
    draw of an id of probability 0; the same generator state gives the same token."""
    from sequoia_ray.sampling import sample

    p = torch.zeros(2500)
    heavy = {3: 0.3, 1023: 0.2, 1024: 0.15, 2047: 0.1, 2048: 0.1, 2499: 0.05}
    for i, x in heavy.items():
        p[i] = x
    p[1500:1600] = 0.1 / 100  # a tail of 0.1 in 100 ids
    gen, n = torch.Generator().manual_seed(0), 40_000
    draws = torch.tensor([sample(p, gen) for _ in range(n)])
    counts = torch.bincount(draws, minlength=2500).double() / n
    assert (counts[p == 0] == 0).all()
    for i, x in {**heavy, "tail": 0.1}.items():
        got = float(counts[1500:1600].sum()) if i == "tail" else float(counts[i])
        assert abs(got - x) < 5 * math.sqrt(x * (1 - x) / n), (i, got, x)
    a, b = torch.Generator().manual_seed(7), torch.Generator().manual_seed(7)
    assert [sample(p, a) for _ in range(20)] == [sample(p, b) for _ in range(20)]


def test_truncating_rows_at_once_equals_row_by_row():
    """``truncate_rows`` (one host read for a tree level) gives each row the D of truncating it alone — its
    top k with the zeros dropped, renormalised — and ``truncate`` the same: rows with fewer positive tokens than
    k (zeros in the tail), a one-hot row, and a full row."""
    from sequoia_ray.sampling import truncate, truncate_rows

    gen = torch.Generator().manual_seed(4)
    rows = torch.stack([random_dist(gen, 20, zeros=z) for z in (0, 5, 17)] + [torch.eye(20, dtype=torch.float64)[3]])
    for k in (1, 4, 8, 20):
        for row, got in zip(rows, truncate_rows(rows, k), strict=True):
            values, tokens = torch.topk(row, k)
            keep = values > 0
            assert torch.equal(got.tokens, tokens[keep]) and torch.equal(got.probs, values[keep] / values[keep].sum())
            alone = truncate(row, k)
            assert torch.equal(alone.tokens, got.tokens) and torch.equal(alone.probs, got.probs)


def test_verify_node_with_drawn_children_emits_p():
    """Children drawn without replacement from D, then ``verify_node`` whole (its uniforms, its residual): the
    emitted token (an accepted child or the residual's draw) has law P. Only ``node_steps`` was enumerated, and a
    single uniform for all children, or a residual never updated, passed every fast test (a mutation review).
    30,000 trials on V = 6, 3 children; each cell within 5 standard errors + 2e-3 (false alarm < 1e-5)."""
    p = torch.tensor([0.05, 0.30, 0.10, 0.25, 0.20, 0.10], dtype=torch.float64)
    q = torch.tensor([0.40, 0.05, 0.30, 0.05, 0.15, 0.05], dtype=torch.float64)
    dist, d = truncate(q, 6), q
    draws, checks = torch.Generator().manual_seed(1), torch.Generator().manual_seed(2)
    n, counts = 30_000, torch.zeros(6, dtype=torch.float64)
    for _ in range(n):
        kids = draw_without_replacement(dist, 3, 6, draws).tolist()
        v = verify_node(p, d, kids, checks)
        counts[kids[v.accepted] if v.accepted is not None else v.token] += 1
    se = torch.sqrt(p * (1 - p) / n)
    assert torch.all((counts / n - p).abs() <= 5 * se + 2e-3), (counts / n - p)
