"""Sampling without replacement and the Sequoia verifier (paper Algorithm 2), lossless by construction.

Vocabulary. At a tree node, P is the target's distribution (temperature and top-p applied) and D the
draft's distribution the children were drawn from. The children s_1..s_k are drawn *without replacement*
from D; when D's support is exhausted the next draws are uniform over the tokens not drawn yet.

Verification at one node (temperature > 0): R <- P. For each child s_i in draw order accept it with
probability min(1, R[s_i] / D_i[s_i]); on rejection R <- norm(max(R - D_i, 0)) and D_{i+1} is D_i with s_i
removed, renormalised (uniform over the undrawn tokens once it is empty). If no child is accepted the node
emits a *residual* token drawn from R. An accepted node with no children emits a *bonus* token from its P.
Greedy (T = 0): the children are the draft's top-k; the child equal to argmax P is accepted; else argmax P.

Randomness is always a ``torch.Generator`` passed in; nothing here seeds or reads global RNG state.
Devices: every function works on the device of its inputs, and a generator must live on that same device
(a CUDA sampling op needs a CUDA generator): the draft samples on its model's device, the verifier walks on
the host (``sequoia_ray.verify``).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch

_NEG = -1e30  # key offset that puts tokens outside D's support after every token inside it
NUCLEUS_K = 256  # the top-k a nucleus is looked for in before sorting the whole row
NUCLEUS_MARGIN = 1e-6  # how far the top-k's mass must pass top_p to settle it (float32 cumsums' rounding)


def target_probs(logits: torch.Tensor, temperature: float, top_p: float = 1.0) -> torch.Tensor:
    """softmax(logits / T) restricted to the top-p nucleus and renormalised.  logits: [..., V] -> [..., V].

    The nucleus (every token whose mass strictly before it, in descending order, is below top_p) is looked for
    in the row's top NUCLEUS_K first: when their mass reaches top_p every later token is out, and the whole row
    need not be sorted (a sort of a 152k vocabulary took ~13 ms a row on a 2-core EPYC, the top 256 ~0.5 ms; it
    ran at every node the verifier visits and every draft level, for any request with top_p < 1). Else, a flat
    distribution, the whole row is sorted, as before."""
    assert temperature > 0, "greedy decoding uses argmax, not probabilities"
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p >= 1.0:
        return probs
    sorted_p, order, keep = _nucleus(probs, top_p, min(NUCLEUS_K, probs.shape[-1]))
    if order.shape[-1] < probs.shape[-1]:
        last_kept = sorted_p.gather(-1, keep.sum(dim=-1, keepdim=True) - 1)[..., 0]
        settled = (sorted_p.sum(dim=-1) >= top_p + NUCLEUS_MARGIN) & (last_kept > sorted_p[..., -1])
        if not bool(settled.all()):  # (one host read: the verifier's rows are on the host; a draft level's, one)
            sorted_p, order, keep = _nucleus(probs, top_p, probs.shape[-1])
    sorted_p = torch.where(keep, sorted_p, torch.zeros_like(sorted_p))
    kept = torch.zeros_like(probs).scatter_(-1, order, sorted_p)
    return kept / kept.sum(dim=-1, keepdim=True)


def _nucleus(probs: torch.Tensor, top_p: float, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The top ``k`` of each row in descending order, ties by id (so the top k and the whole row sorted agree on
    every token they share: ``torch.topk`` and an unstable sort break ties each their own way), and which of them
    the nucleus keeps. -> (probabilities, ids, keep), each [..., k]. The top k settle the nucleus when their mass
    passes top_p and its last kept token is above the k-th (no tie across the cut decides which tokens stay)."""
    if k < probs.shape[-1]:
        order = torch.topk(probs, k, dim=-1).indices.sort(dim=-1).values  # by id, then stably by probability
        sorted_p, by_p = probs.gather(-1, order).sort(dim=-1, descending=True, stable=True)
        order = order.gather(-1, by_p)
    else:
        sorted_p, order = torch.sort(probs, dim=-1, descending=True, stable=True)
    keep = torch.cumsum(sorted_p, dim=-1) - sorted_p < top_p  # the mass strictly before each token
    keep[..., 0] = True  # the top token always stays (even when top_p underflows float32)
    return sorted_p, order, keep


@dataclass(frozen=True)
class SparseDist:
    """A distribution over the vocabulary stored by its support (what crosses between actors)."""

    tokens: torch.Tensor  # [K] int64, distinct
    probs: torch.Tensor  # [K] float, sums to 1

    def to(self, device: torch.device | str) -> SparseDist:
        return SparseDist(self.tokens.to(device), self.probs.to(device))

    def dense(self, vocab: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:  # [V]
        out = torch.zeros(vocab, dtype=dtype, device=self.probs.device)
        out[self.tokens] = self.probs.to(dtype)
        return out


def truncate(probs: torch.Tensor, k: int) -> SparseDist:
    """The top-k of ``probs`` [V], renormalised: the exact D a draft samples from and the verifier uses."""
    (dist,) = truncate_rows(probs[None], k)
    return dist


def truncate_rows(probs: torch.Tensor, k: int) -> list[SparseDist]:
    """``truncate`` of every row of ``probs`` [L, V], with one host read for all of them (the size of each
    row's support; on an accelerator each read is a sync): a level of a tree at once."""
    values, tokens = torch.topk(probs, min(k, probs.shape[-1]), dim=-1)  # [L, k], each row descending
    support = (values > 0).sum(dim=-1).tolist()  # the positive values are a prefix of each row
    return [SparseDist(tokens=t[:m], probs=v[:m] / v[:m].sum()) for t, v, m in zip(tokens, values, support)]


def draw_without_replacement(dist: SparseDist, k: int, vocab: int, generator: torch.Generator) -> torch.Tensor:
    """k distinct tokens [k]: sequential draws from ``dist`` (Gumbel-top-k), then uniform over the rest.
    ``generator`` lives on ``dist``'s device.

    The uniforms go to the support's tokens in id order, not in the order ``dist`` lists them (by probability):
    the same seed draws the same tokens from the same distribution however its near-ties came out. A batched
    forward sums in another order than a 1-token one, and two tokens' probabilities 1 ulp apart could swap
    places in the support and so swap noise (a seeded request drew another tree in a batch than alone, about
    1 in 8,000 sampled requests); now only Gumbel keys within an ulp of each other can flip. Any fixed
    assignment of i.i.d. noise keeps the draw's law exact."""
    device = dist.tokens.device
    noise = torch.empty(len(dist.tokens), dtype=torch.float64, device=device)  # [K], noise[j] for dist.tokens[j]
    noise[torch.argsort(dist.tokens)] = torch.rand(len(dist.tokens), generator=generator, dtype=torch.float64,
                                                   device=device)
    gumbel = -torch.log(-torch.log(noise))
    keys = torch.log(dist.probs.double()) + gumbel
    order = torch.argsort(keys, descending=True)[:k]
    drawn = dist.tokens[order]
    if len(drawn) == k:
        return drawn
    rest = torch.randperm(vocab, generator=generator, device=device)
    rest = rest[~torch.isin(rest, drawn)]
    return torch.cat([drawn, rest[: k - len(drawn)]])


def probabilities_of(dist: SparseDist, tokens: torch.Tensor) -> torch.Tensor:  # tokens [k] -> [k] float64
    """D's probability of each token (0 outside D's support: a token drawn by the uniform fallback)."""
    match = dist.tokens[None, :] == tokens[:, None]  # [k, K]
    return (match.double() * dist.probs.double()[None, :]).sum(-1)


def expected_draw_probability(dist: SparseDist, drawn: torch.Tensor) -> torch.Tensor:  # drawn [k] -> [k] float64
    """E_i = E[D(s_i) | s_1..s_{i-1}]: the D-probability the i-th draw without replacement has on average,
    given the draws before it (``drawn`` in draw order) — sum of D(x)^2 / sum of D(x) over the undrawn x.
    Entry i reads only ``drawn[:i]``; it is 0 once D's support is exhausted (the uniform fallback)."""
    d = probabilities_of(dist, drawn)  # [k]
    probs = dist.probs.double()
    left = probs.sum() - (torch.cumsum(d, 0) - d)  # [k] D mass not drawn before draw i
    left_sq = (probs * probs).sum() - (torch.cumsum(d * d, 0) - d * d)
    inside = torch.arange(len(drawn), device=d.device) < len(dist.tokens)  # draw i still comes from D
    return torch.where(inside, left_sq.clamp(min=0) / left.clamp(min=1e-300), torch.zeros_like(d))


@dataclass(frozen=True)
class NodeStep:
    accept_prob: float  # min(1, R[s] / D[s]) for this child
    residual_after: torch.Tensor  # [V] R if this child is rejected


def node_steps(
    p: torch.Tensor,  # [V] target distribution at the node
    d: torch.Tensor,  # [V] draft distribution the first child was drawn from
    children: list[int],  # tokens in draw order
) -> Iterator[NodeStep]:
    """The deterministic part of the verifier at one node: acceptance chances and residuals, lazily.

    A D with no support (``truncate`` of a draft row of NaN, e.g. from an overflowing float16 draft) is the
    uniform distribution: the draft drew those children uniformly (``draw_without_replacement``'s fallback).
    A target P that is not a distribution (NaN) is an error, as drawing from it alone is (``inverse_cdf``),
    never an acceptance."""
    r = p
    drawn = torch.zeros_like(p, dtype=torch.bool)
    if not d.sum() > 0:
        d = torch.full_like(p, 1.0 / p.shape[-1])
    for s in children:
        if not d[s] > 0:
            raise ValueError(f"child token {s} has draft probability 0: it was not drawn from this D")
        accept = float(r[s] / d[s])
        if math.isnan(accept):
            raise ValueError(f"the target's probability of token {s} is {float(r[s])!r}: its logits at this node "
                             "are not finite")
        accept = min(1.0, accept)
        r = _normalise(torch.clamp(r - d, min=0), fallback=p)
        drawn[s] = True
        d = d.clone()
        d[s] = 0
        if d.sum() <= 0:
            d = (~drawn).to(p.dtype)
        d = d / d.sum()
        yield NodeStep(accept, r)


def _normalise(x: torch.Tensor, fallback: torch.Tensor) -> torch.Tensor:
    total = x.sum()
    if not torch.isfinite(total) or total <= 0:
        return fallback  # R = D exactly (float round-off) or NaN: the target's own P is the safe answer
    return x / total


@dataclass(frozen=True)
class NodeVerdict:
    accepted: int | None  # index into the node's children, or None
    token: int | None  # the residual token when no child was accepted


def verify_node(
    p: torch.Tensor,  # [V] target distribution at the node
    d: torch.Tensor,  # [V] draft distribution of the first draw
    children: list[int],  # tokens in draw order
    generator: torch.Generator,
) -> NodeVerdict:
    """Accept one child (fresh uniforms per child) or emit a residual token drawn from R."""
    residual = p
    for i, step in enumerate(node_steps(p, d, children)):
        u = torch.rand((), generator=generator, dtype=torch.float64, device=p.device)
        if u < step.accept_prob:
            return NodeVerdict(accepted=i, token=None)
        residual = step.residual_after
    return NodeVerdict(accepted=None, token=sample(residual, generator))


SAMPLE_BLOCK = 1024  # ids per block of ``inverse_cdf``'s first level


def sample(probs: torch.Tensor, generator: torch.Generator) -> int:
    """One token from ``probs`` [V] (non-negative, any positive total): ``inverse_cdf`` at a uniform draw.
    ``torch.multinomial`` walks one float64 CDF over the whole vocabulary, serially: 3.7 ms a token at 151,936
    ids on the 2-core EPYC, ~15% of a batch-of-8 target-alone step at T = 0.6; this takes ~0.1 ms."""
    u = torch.rand((), dtype=torch.float64, generator=generator, device=probs.device)
    return inverse_cdf(probs, u)


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor | float) -> int:
    """The id i with CDF(i - 1) <= u · total < CDF(i), ``u`` in [0, 1), in two levels: the block of ``SAMPLE_BLOCK``
    ids whose masses' running sum (float64) passes u · total, then the id inside it
    (a float64 running sum over the block). An id of probability 0 is never returned (the running sums do not rise
    there); where rounding leaves the draw past a block's own running sum, its last id of positive probability is."""
    flat = probs.reshape(-1)  # [V]
    whole = flat.numel() // SAMPLE_BLOCK * SAMPLE_BLOCK
    masses = flat[:whole].view(-1, SAMPLE_BLOCK).sum(dim=1, dtype=torch.float64)  # [V // B]
    if whole < flat.numel():
        masses = torch.cat([masses, flat[whole:].sum(dtype=torch.float64).reshape(1)])
    cdf = masses.cumsum(0)  # [blocks]
    total = float(cdf[-1])
    if not math.isfinite(total) or total <= 0:
        raise ValueError(f"cannot draw a token from probabilities summing to {total!r}: they must be "
                         "finite, non-negative and not all 0")
    target = float(u) * total
    b = min(int(torch.searchsorted(cdf, torch.tensor([target], dtype=torch.float64, device=flat.device),
                                   right=True)), cdf.numel() - 1)
    block = flat[b * SAMPLE_BLOCK:(b + 1) * SAMPLE_BLOCK]  # [<= B]
    within = block.double().cumsum(0)
    rest = target - (float(cdf[b - 1]) if b else 0.0)
    i = int(torch.searchsorted(within, torch.tensor([rest], dtype=torch.float64, device=flat.device), right=True))
    if i >= block.numel() or block[i] <= 0:  # the draw past this block's own sum (rounding): its last positive id
        i = int(torch.nonzero(block > 0)[-1])
    return b * SAMPLE_BLOCK + i
