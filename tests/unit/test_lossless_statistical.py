"""Statistical proofs on tiny models: the joint law of the first two tokens, and tokens per step = F(T)."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from sequoia_ray.config import SamplingParams
from sequoia_ray.draft import DraftWorker, DynamicTrees
from sequoia_ray.engine import SpeculativeDecoder
from sequoia_ray.models.draft_vocab import restrict_head
from sequoia_ray.sampling import node_steps
from sequoia_ray.target import TargetWorker
from sequoia_ray.tree.acceptance_vector import AcceptanceVector
from sequoia_ray.tree.dp import solve
from sequoia_ray.tree.plan import expected_tokens, k_ary
from tests.tiny import noisy_copy, sharpen, tiny_model

pytestmark = pytest.mark.long  # 3000 requests a test: ~20 s alone, up to a minute beside the other worker

V = 8


def next_probs(model, tokens: list[int], temperature: float = 1.0) -> torch.Tensor:  # [V] float64
    with torch.inference_mode():
        return torch.softmax(model(input_ids=torch.tensor([tokens])).logits[0, -1].double() / temperature, -1)


# Prunes and extends often on this pair (draft 0.99 sure of a token the target gives 0.30): of 200 first trees
# from the 13-node plan, 1 kept 5 nodes / 3 levels, 107 kept 5 nodes and 92 kept 6 nodes, both 4 levels
# (one extended); from its first 2 levels (4 nodes), 93 trees kept 3 nodes / 3 levels, 107 kept 4 nodes / 4 levels.
DYNAMIC = DynamicTrees(0.15, extend=2, extend_threshold=0.2)
# The level rule on top: every first tree from the 13-node plan stops at 3 levels (107 with 4 nodes, 93 with 5).
LEVELS = DynamicTrees(0.15, extend=2, extend_threshold=0.2, level_threshold=0.6)


def two_tokens(target, draft, prompt, n: int, batch: int, dynamic: DynamicTrees | None = None):
    """(token 1, token 2, steps) of ``n`` requests (seeds 0..n-1) at T = 1 with a 13-node tree (or the trees
    ``dynamic`` grows from it): one request at a time through the engine (batch 1), or ``batch`` requests per
    draft and target forward (the batched path)."""
    plan, params = k_ary(3, 2), SamplingParams(max_tokens=2, temperature=1.0, ignore_eos=True)
    if batch == 1:
        spec = SpeculativeDecoder(TargetWorker(target), DraftWorker(draft, dynamic=dynamic), plan)
        for seed in range(n):
            out = spec.generate(prompt, params.model_copy(update={"seed": seed}))
            yield out.token_ids[0], out.token_ids[1], out.stats.steps
        return
    tw, dw = TargetWorker(target), DraftWorker(draft, dynamic=dynamic)
    for lo in range(0, n, batch):
        rids = [str(s) for s in range(lo, min(n, lo + batch))]
        for rid in rids:
            tw.start(rid, prompt, params, seed=2 * int(rid))
            dw.start(rid, prompt, params, seed=2 * int(rid) + 1)
        got, steps = {rid: [] for rid in rids}, dict.fromkeys(rids, 0)
        while any(len(t) < 2 for t in got.values()):
            todo = [rid for rid in rids if len(got[rid]) < 2]
            trees = dw.grow_batch([(rid, plan) for rid in todo])
            verdicts = tw.verify_batch([(rid, plan, tree) for rid, tree in zip(todo, trees)])
            for rid, v in zip(todo, verdicts):
                dw.commit(rid, v.path, v.tokens)
                got[rid] += v.tokens
                steps[rid] += 1
        for rid in rids:
            yield got[rid][0], got[rid][1], steps[rid]
            tw.finish(rid)
            dw.finish(rid)


# Dynamic trees run batched only: a batched dynamic tree is the tree grown alone, draw for draw
# (tests/unit/test_dynamic_trees.py), and the suite's time is bounded. 32 requests per forward take ~0.7x
# the time of 8 here (the per-forward cost of these tiny models dominates).
@pytest.mark.parametrize("batch,dynamic,vocab", [(1, None, None), (32, None, None), (32, DYNAMIC, None),
                                                 (32, LEVELS, None), (32, DYNAMIC, 5)],
                         ids=["1-static", "32-static", "32-dynamic", "32-levels", "32-dynamic-subset"])
def test_first_two_tokens_follow_the_target_exactly(batch, dynamic, vocab):
    """N = 3000 requests (seeds 0..2999) at T = 1 with a 13-node tree (static, or pruned and extended by
    ``DYNAMIC``, or also cut by the level rule), one at a time or 32 per forward, the draft's head on all 8
    ids or on ids 0-4 only (``vocab``: the target's tokens 5-7 then come from residuals alone); for each of
    the 64 cells of the joint law of (token 1, token 2), |frequency - exact target probability| <= 5 SE +
    0.004 (SE = sqrt(p (1 - p) / N)); a 5-sigma bound per cell keeps the false-failure chance below ~1e-4."""
    target = sharpen(tiny_model("qwen2", seed=11, vocab=V), 25.0)
    draft = noisy_copy(target, scale=0.6, seed=12)
    if vocab is not None:
        assert restrict_head(draft, None, vocab)
    prompt = [1, 5, 2]
    p1 = next_probs(target, prompt)
    exact = torch.stack([p1[a] * next_probs(target, prompt + [a]) for a in range(V)])  # [V, V]
    q1 = next_probs(draft, prompt)
    assert 0.5 * float((p1 - q1).abs().sum()) > 0.1, "the draft must differ from the target for power"
    if vocab is not None:  # power: 0.56 of the joint law has a token the draft cannot propose
        assert float(exact[:, vocab:].sum() + exact[vocab:, :vocab].sum()) > 0.2
    n = 3000
    counts = torch.zeros(V, V)
    two_in_one_step = 0
    for first, second, steps in two_tokens(target, draft, prompt, n, batch, dynamic):
        counts[first, second] += 1
        two_in_one_step += steps == 1
    freq = counts / n
    se = torch.sqrt(exact * (1 - exact) / n)
    assert torch.all((freq - exact).abs() <= 5 * se + 0.004), (freq - exact).abs().max()
    assert two_in_one_step > n // 10, "accepted paths must really produce both tokens in one step"


def nucleus_law(model, tokens: list[int], temperature: float, top_p: float) -> torch.Tensor:  # [V] float64
    """The target's sampling law, computed here apart from ``sampling.target_probs``: softmax(logits / T) in
    float64, then the smallest most-probable set whose mass reaches ``top_p``, renormalised."""
    with torch.inference_mode():
        probs = torch.softmax(model(input_ids=torch.tensor([tokens])).logits[0, -1].double() / temperature, -1)
    out, mass = torch.zeros_like(probs), 0.0
    for i in sorted(range(len(probs)), key=lambda i: -float(probs[i])):
        if mass >= top_p:
            break
        out[i], mass = probs[i], mass + float(probs[i])
    return out / out.sum()


def test_first_two_tokens_follow_the_target_at_a_temperature_and_nucleus_with_a_truncated_draft():
    """N = 3000 requests (seeds 0..2999) through the engine at T = 0.6, top_p = 0.8, the draft's D cut to its
    top 3 tokens (``support``: the verifier is sent only those), a 13-node tree whose nodes have 3 children: the
    64 cells of the joint law of (token 1, token 2) against the law computed apart (``nucleus_law``), each within
    5 SE + 0.004 (SE = sqrt(p (1 - p) / N); false-failure chance below ~1e-4). The T = 1 test above cannot see a
    verifier that drops the temperature or the nucleus (the target alone goes through the same verifier), nor
    draws and uniforms from one stream (its draft is 0.99 sure of one token, so the draw order barely varies):
    here the draft's top token has less than 0.6 of its law, and the nucleus holds 5 of the 8 ids."""
    target = sharpen(tiny_model("qwen2", seed=11, vocab=V), 3.0)
    draft = noisy_copy(target, scale=0.6, seed=12)
    prompt, temperature, top_p = [1, 5, 2], 0.6, 0.8
    p1 = nucleus_law(target, prompt, temperature, top_p)
    exact = torch.stack([p1[a] * nucleus_law(target, prompt + [a], temperature, top_p) for a in range(V)])
    q1 = nucleus_law(draft, prompt, temperature, top_p)
    assert int((p1 > 0).sum()) >= 4 and float(q1.max()) < 0.6, "power: a wide nucleus and an unsure draft"
    plan = k_ary(3, 2)
    params = SamplingParams(max_tokens=2, temperature=temperature, top_p=top_p, ignore_eos=True)
    spec = SpeculativeDecoder(TargetWorker(target), DraftWorker(draft, support=3), plan)
    n, counts, two_in_one_step = 3000, torch.zeros(V, V), 0
    for seed in range(n):
        out = spec.generate(prompt, params.model_copy(update={"seed": seed}))
        counts[out.token_ids[0], out.token_ids[1]] += 1
        two_in_one_step += out.stats.steps == 1
    freq, se = counts / n, torch.sqrt(exact * (1 - exact) / n)
    assert torch.all((freq - exact).abs() <= 5 * se + 0.004), (freq - exact).abs().max()
    assert two_in_one_step > n // 10, "accepted paths must really produce both tokens in one step"


def test_a_requests_draws_and_verifier_uniforms_are_independent_streams():
    """The engine seeds the draft and the verifier of a request apart (``_salt``): on one stream, the uniforms
    that accept a child would be the numbers that drew it (a node of 3 children, 40,000 trials: token 0 came out
    at 0.181 for 0.300, review helper's script)."""
    from sequoia_ray import engine

    target = sharpen(tiny_model("qwen2", seed=11, vocab=V), 3.0)
    tw, dw = TargetWorker(target), DraftWorker(noisy_copy(target, scale=0.6, seed=12))
    seeds = {}
    for worker, name in ((tw, "verify"), (dw, "draft")):
        start = worker.start
        worker.start = lambda rid, prompt, params, seed, _start=start, _name=name: (
            seeds.__setitem__(_name, seed) or _start(rid, prompt, params, seed))
    SpeculativeDecoder(tw, dw, k_ary(3, 2)).generate([1, 5, 2], SamplingParams(max_tokens=4, temperature=1.0, seed=9))
    assert seeds == {"verify": engine._salt(9, "verify"), "draft": engine._salt(9, "draft")}
    assert len({engine._salt(s, stream) for s in range(200) for stream in ("draft", "verify")}) == 400
    first = [torch.rand(4, generator=torch.Generator().manual_seed(seeds[k])) for k in ("verify", "draft")]
    assert not torch.equal(*first)


def context_free(model, seed: int):
    """Every token embeds to the same vector, so the next-token law is the same in every context."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        model.model.embed_tokens.weight[:] = torch.randn(model.config.hidden_size, generator=gen)
    return model


def exact_acceptance(p: torch.Tensor, q: torch.Tensor, width: int) -> list[float]:
    """p[k] = P(the k-th child drawn without replacement from q is the accepted one), by enumeration."""
    out = [0.0] * width
    for order in itertools.permutations(range(len(p)), width):
        w, drawn = 1.0, set()
        for s in order:
            w *= float(q[s]) / float(sum(q[t] for t in range(len(q)) if t not in drawn))
            drawn.add(s)
        reach = 1.0
        for k, step in enumerate(node_steps(p, q, list(order))):
            out[k] += w * reach * step.accept_prob
            reach *= 1 - step.accept_prob
    return out


def test_tokens_per_step_equals_plan_value_on_a_context_free_pair():
    """1200 steps (60 requests x 20 steps, all 60 in each draft and target forward: the batched path; the
    joint-law test above runs one request at a time too) with the DP's best 12-node tree; the mean of
    tokens per step is within 4 standard errors (estimated from the sample) of F(T) computed from the exact p."""
    target = sharpen(context_free(tiny_model("llama", seed=2, vocab=6), seed=3), 6.0)
    draft = sharpen(context_free(tiny_model("llama", seed=4, vocab=6), seed=5), 6.0)
    p, q = next_probs(target, [0]), next_probs(draft, [0])
    acceptance = AcceptanceVector.from_p(exact_acceptance(p, q, 3))
    plan = solve(acceptance, 12, 5).tree(12, 5)
    value = expected_tokens(plan, acceptance)
    target_w, draft_w = TargetWorker(target), DraftWorker(draft)
    params = SamplingParams(temperature=1.0, max_tokens=10_000)
    rids = [str(r) for r in range(60)]
    for r, rid in enumerate(rids):
        target_w.start(rid, [1, 2], params, seed=2 * r)
        draft_w.start(rid, [1, 2], params, seed=2 * r + 1)
    per_step = []
    for _ in range(20):
        trees = draft_w.grow_batch([(rid, plan) for rid in rids])
        verdicts = target_w.verify_batch([(rid, plan, tree) for rid, tree in zip(rids, trees)])
        for rid, verdict in zip(rids, verdicts):
            draft_w.commit(rid, verdict.path, verdict.tokens)
            per_step.append(len(verdict.tokens))
    x = torch.tensor(per_step, dtype=torch.float64)
    se = float(x.std()) / math.sqrt(len(x))
    assert abs(float(x.mean()) - value) <= 4 * se, (float(x.mean()), value, se)
    assert value > 1.3  # the pair accepts often enough for the test to mean something
