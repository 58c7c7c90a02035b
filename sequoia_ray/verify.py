"""Walk a verified tree from the root: keep the longest accepted path plus one residual/bonus token."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sequoia_ray.config import SamplingParams
from sequoia_ray.draft import DraftTree
from sequoia_ray.sampling import sample, target_probs, verify_node
from sequoia_ray.tree.plan import TreePlan


@dataclass(frozen=True)
class Verdict:
    path: list[int]  # node ids from the root (0) to the deepest accepted node
    tokens: list[int]  # the accepted draft tokens then one residual or bonus token: len(path) tokens


def verify_tree(
    plan: TreePlan,
    draft: DraftTree,
    logits: torch.Tensor,  # [n, V] target logits at every tree node
    params: SamplingParams,
    generator: torch.Generator,
) -> Verdict:
    node, path, out = 0, [0], []
    while True:
        kids = plan.children[node]
        child_tokens = [int(draft.tokens[c]) for c in kids]
        if params.greedy:
            chosen, token = _greedy_step(logits[node], child_tokens)
        else:
            chosen, token = _sampled_step(logits[node], draft, node, child_tokens, params, generator)
        if chosen is None:
            out.append(token)
            return Verdict(path, out)
        node = kids[chosen]
        path.append(node)
        out.append(child_tokens[chosen])


def _greedy_step(logits: torch.Tensor, children: list[int]) -> tuple[int | None, int]:
    best = int(torch.argmax(logits))
    return (children.index(best) if best in children else None), best


def _sampled_step(logits, draft: DraftTree, node: int, children: list[int], params, generator):
    p = target_probs(logits, params.temperature, params.top_p)
    if not children:
        return None, sample(p, generator)  # bonus token at an accepted leaf
    d = draft.dists[node].dense(p.shape[-1], p.dtype)
    verdict = verify_node(p, d, children, generator)
    return verdict.accepted, verdict.token
