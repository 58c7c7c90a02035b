"""The target's tree forward, row by row, against the plain forward of the same tokens; and a tree that is not
rooted at the request's last token refused with the cache untouched."""

from __future__ import annotations

import pytest
import torch

import sequoia_ray.target as target_module
from sequoia_ray.config import SamplingParams
from sequoia_ray.draft import DraftTree, DraftWorker
from sequoia_ray.target import TargetWorker
from sequoia_ray.tree.plan import from_nested
from tests.tiny import agreeing_pair
from tests.unit.test_tree_forward import plain_logits


def test_a_tree_rooted_elsewhere_is_refused_and_the_cache_is_untouched():
    """A stale tree (grown before the last verdict) verified silently would put another root's K/V in the cache
    and corrupt everything after it; no test sent one (a mutation review)."""
    target, _ = agreeing_pair()
    tw = TargetWorker(target)
    tw.start("r", [5, 6, 7], SamplingParams(max_tokens=8), 0)
    tw.verify("r", from_nested([]), DraftTree(torch.tensor([7]), {}))  # one step: the prompt is cached
    committed, length = list(tw.requests["r"].committed), tw.requests["r"].session.length
    stale = DraftTree(torch.tensor([committed[-1] + 1, 3]), {})  # e.g. a tree grown before the last verdict
    with pytest.raises(ValueError, match="root"):
        tw.verify("r", from_nested([[]]), stale)
    assert tw.requests["r"].committed == committed and tw.requests["r"].session.length == length


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_target_tree_logits_and_cache_equal_a_fresh_forward(temperature, monkeypatch):
    """Every tree row's logits are the plain forward of the context and the node's path, and after each verdict
    the cache continues as a fresh forward does. Output-level tests cannot see a position bug: the tiny models'
    next-token law moves by < 0.005 total variation for a one-position gap and never changes the argmax (tree
    positions shifted by one passed the whole suite, the statistical tests too: a mutation review)."""
    target, draft = agreeing_pair()
    seen = {}
    real = target_module.verify_tree
    monkeypatch.setattr(target_module, "verify_tree",
                        lambda plan, tree, logits, params, gen: seen.update(plan=plan, tree=tree, logits=logits)
                        or real(plan, tree, logits, params, gen))
    tw, dw = TargetWorker(target), DraftWorker(draft)
    params = SamplingParams(max_tokens=100, temperature=temperature)
    plan = from_nested([[[[[]]], [[]]], [[]], []])
    tw.start("r", [5, 6, 7], params, 1)
    dw.start("r", [5, 6, 7], params, 2)
    for _ in range(5):
        before = list(tw.requests["r"].committed)
        verdict = tw.verify("r", plan, dw.grow("r", plan))
        dw.commit("r", verdict.path, verdict.tokens)
        tokens = seen["tree"].tokens.tolist()
        for node in range(plan.n):  # each tree row: the plain forward of the context then the node's path
            path = [tokens[i] for i in plan.path(node)][1:]
            want = plain_logits(target, before + path)[-1]
            torch.testing.assert_close(seen["logits"][node], want, atol=2e-5, rtol=1e-5)
        req = tw.requests["r"]
        got = req.session.forward(torch.tensor(req.committed[-1:]), torch.tensor([len(req.committed) - 1]))
        torch.testing.assert_close(got[0], plain_logits(target, req.committed)[-1], atol=2e-5, rtol=1e-5)
        req.session.truncate(len(req.committed) - 1)
