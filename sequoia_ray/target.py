"""The target side: score a whole draft tree in one forward pass, verify it, compact the KV cache.

Per request the target caches every committed token but the newest (the next tree's root). ``verify``
forwards the uncached committed tokens (the first call: the prompt, i.e. prefill) and the tree in ONE pass,
walks the tree with the request's own generator, keeps the accepted path's K/V and returns the verdict —
only token ids cross back, never logits. A root-only plan is plain target decoding.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sequoia_ray.config import SamplingParams
from sequoia_ray.draft import DraftTree
from sequoia_ray.models.tree_lm import KVSession
from sequoia_ray.tree.plan import TreePlan
from sequoia_ray.verify import Verdict, verify_tree


@dataclass
class _Request:
    session: KVSession
    committed: list[int]
    params: SamplingParams
    generator: torch.Generator


class TargetWorker:
    """Holds the target model and per-request target state, keyed by request id."""

    def __init__(self, model) -> None:
        self.model = model
        self.requests: dict[str, _Request] = {}

    def start(self, request_id: str, prompt: list[int], params: SamplingParams, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.requests[request_id] = _Request(KVSession(self.model), list(prompt), params, gen)

    def finish(self, request_id: str) -> None:
        self.requests.pop(request_id, None)

    def verify(self, request_id: str, plan: TreePlan, draft: DraftTree) -> Verdict:
        req = self.requests[request_id]
        assert int(draft.tokens[0]) == req.committed[-1], "the tree's root must be the last committed token"
        assert draft.tokens.shape == (plan.n,), f"draft tree has {draft.tokens.shape[0]} tokens, plan {plan.n}"
        cached, base = req.session.length, len(req.committed) - 1
        pending = torch.tensor(req.committed[cached:base], dtype=torch.long)
        tokens = torch.cat([pending, draft.tokens])
        positions = torch.cat([torch.arange(cached, base), base + torch.tensor(plan.depth)])
        allowed = _prefill_then_tree(len(pending), torch.from_numpy(plan.ancestor_mask()))
        logits = req.session.forward(tokens, positions, allowed)[len(pending) :]
        verdict = verify_tree(plan, draft, logits, req.params, req.generator)
        req.session.keep(torch.cat([torch.arange(base), base + torch.tensor(verdict.path)]))
        req.committed.extend(verdict.tokens)
        return verdict


def _prefill_then_tree(n_pending: int, tree: torch.Tensor) -> torch.Tensor:  # -> [p + n, p + n] bool
    """Causal among the pending tokens; every tree node sees all of them and its own ancestors."""
    n = tree.shape[0]
    allowed = torch.zeros(n_pending + n, n_pending + n, dtype=torch.bool)
    allowed[:n_pending, :n_pending] = torch.ones(n_pending, n_pending, dtype=torch.bool).tril()
    allowed[n_pending:, :n_pending] = True
    allowed[n_pending:, n_pending:] = tree
    return allowed
