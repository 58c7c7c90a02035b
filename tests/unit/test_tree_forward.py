"""Oracle: tree-masked logits at every node == a plain causal forward along root -> node; compaction."""

from __future__ import annotations

import pytest
import torch

from sequoia_ray.models.tree_lm import KVSession
from sequoia_ray.tree.plan import TreePlan, chain, from_nested, k_ary
from tests.tiny import VOCAB, tiny_model

TREES = {
    "chain": chain(4),
    "star": k_ary(5, 1),
    "binary": k_ary(2, 3),
    "ragged": from_nested([[[[]], []], [], [[], [[], []]]]),
}


def plain_logits(model, tokens: list[int]) -> torch.Tensor:  # [len, V]
    with torch.inference_mode():
        return model(input_ids=torch.tensor([tokens])).logits[0].float()


@pytest.mark.parametrize("kind", ["qwen2", "llama"])
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("name", list(TREES))
def test_tree_logits_equal_causal_forward_along_each_path(kind, attn, name):
    model = tiny_model(kind, attn=attn)
    plan: TreePlan = TREES[name]
    gen = torch.Generator().manual_seed(1)
    prefix = torch.randint(0, VOCAB, (7,), generator=gen).tolist()
    tree_tokens = torch.randint(0, VOCAB, (plan.n,), generator=gen)
    session = KVSession(model)
    session.forward(torch.tensor(prefix), torch.arange(len(prefix)))
    depth = torch.tensor(plan.depth)
    logits = session.forward(tree_tokens, len(prefix) + depth, torch.from_numpy(plan.ancestor_mask()))
    for node in range(plan.n):
        path_tokens = prefix + [int(tree_tokens[i]) for i in plan.path(node)]
        expected = plain_logits(model, path_tokens)[-1]
        torch.testing.assert_close(logits[node], expected, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_compaction_equals_fresh_forward_of_committed_text(attn):
    model = tiny_model("qwen2", attn=attn, seed=3)
    plan = from_nested([[[[]], []], [[]]])
    gen = torch.Generator().manual_seed(5)
    prefix = torch.randint(0, VOCAB, (6,), generator=gen).tolist()
    tree_tokens = torch.randint(0, VOCAB, (plan.n,), generator=gen)
    session = KVSession(model)
    session.forward(torch.tensor(prefix), torch.arange(len(prefix)))
    session.forward(tree_tokens, len(prefix) + torch.tensor(plan.depth), torch.from_numpy(plan.ancestor_mask()))
    path = plan.path(3)  # root -> rank-1 child -> its first child (deepest, not the last node)
    session.keep(torch.cat([torch.arange(len(prefix)), len(prefix) + torch.tensor(path)]))
    committed = prefix + [int(tree_tokens[i]) for i in path]
    assert session.length == len(committed)
    nxt = [11, 12, 13]
    after = session.forward(torch.tensor(nxt), torch.arange(len(committed), len(committed) + 3))
    torch.testing.assert_close(after, plain_logits(model, committed + nxt)[-3:], atol=2e-5, rtol=1e-5)


def test_cached_tree_region_from_an_earlier_forward():
    """A level-by-level draft: level 2 attends to level-1 nodes already in the cache."""
    model = tiny_model("llama", attn="eager", seed=4)
    plan = k_ary(2, 2)  # 1 + 2 + 4 nodes
    gen = torch.Generator().manual_seed(9)
    prefix = torch.randint(0, VOCAB, (5,), generator=gen).tolist()
    tokens = torch.randint(0, VOCAB, (plan.n,), generator=gen)
    mask = torch.from_numpy(plan.ancestor_mask())
    session = KVSession(model)
    session.forward(torch.tensor(prefix), torch.arange(5))
    start = session.length
    session.forward(tokens[:3], 5 + torch.tensor(plan.depth[:3]), mask[:3, :3], tree_start=start)
    last = session.forward(tokens[3:], 5 + torch.tensor(plan.depth[3:]), mask[3:, :7], tree_start=start)
    for row, node in enumerate(range(3, 7)):
        expected = plain_logits(model, prefix + [int(tokens[i]) for i in plan.path(node)])[-1]
        torch.testing.assert_close(last[row], expected, atol=2e-5, rtol=1e-5)
