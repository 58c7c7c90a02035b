"""The target side: score a whole draft tree in one forward pass, verify it, compact the KV cache.

Per request the target caches every committed token but the newest (the next tree's root). ``verify``
forwards the uncached committed tokens (the first call: the prompt, i.e. prefill) and the tree in ONE pass,
walks the tree with the request's own generator, keeps the accepted path's K/V and returns the verdict —
only token ids cross back, never logits. A root-only plan is plain target decoding.

Devices: the tree arrives as host tensors (from an actor, or from an in-process draft) and its tokens are
placed on the target model's device on arrival; the forward runs there. The walk runs on the host after ONE
transfer (``sequoia_ray.verify``), so the request's generator is a host generator.
"""

from __future__ import annotations

import torch

from sequoia_ray.draft import DraftTree
from sequoia_ray.request_state import RequestTable
from sequoia_ray.tree.plan import TreePlan
from sequoia_ray.verify import Verdict, verify_tree


class TargetWorker(RequestTable):
    """Holds the target model and per-request target state, keyed by request id."""

    @property
    def generator_device(self) -> torch.device:
        return torch.device("cpu")  # the verify walk runs on the host (see sequoia_ray.verify)

    def verify(self, request_id: str, plan: TreePlan, draft: DraftTree) -> Verdict:
        req, device = self.get(request_id), self.device
        assert int(draft.tokens[0]) == req.committed[-1], "the tree's root must be the last committed token"
        assert draft.tokens.shape == (plan.n,), f"draft tree has {draft.tokens.shape[0]} tokens, plan {plan.n}"
        cached, base = req.session.length, len(req.committed) - 1
        pending = torch.tensor(req.committed[cached:base], dtype=torch.long, device=device)
        tokens = torch.cat([pending, draft.tokens.to(device)])  # the tree's tokens, placed on arrival
        depth = torch.tensor(plan.depth, dtype=torch.long, device=device)
        positions = torch.cat([torch.arange(cached, base, device=device), base + depth])
        tree = torch.from_numpy(plan.ancestor_mask()).to(device)  # [n, n] bool
        allowed = _prefill_then_tree(len(pending), tree)
        hidden = req.session.hidden(tokens, positions, allowed)[len(pending) :]
        # One LM-head call for the whole tree: on CPU the head is memory-bound, so n rows cost about what
        # one row does, and rows one at a time would re-read the vocab x hidden weights each time.
        logits = req.session.head(hidden)  # [n, V]; the prefill rows before the tree get no logits
        verdict = verify_tree(plan, draft.to("cpu"), logits, req.params, req.generator)
        path = torch.tensor(verdict.path, dtype=torch.long, device=device)
        req.session.keep(torch.cat([torch.arange(base, device=device), base + path]))
        req.committed.extend(verdict.tokens)
        return verdict


def _prefill_then_tree(n_pending: int, tree: torch.Tensor) -> torch.Tensor:  # -> [p + n, p + n] bool
    """Causal among the pending tokens; every tree node sees all of them and its own ancestors."""
    n, device = tree.shape[0], tree.device
    allowed = torch.zeros(n_pending + n, n_pending + n, dtype=torch.bool, device=device)
    allowed[:n_pending, :n_pending] = torch.ones(n_pending, n_pending, dtype=torch.bool, device=device).tril()
    allowed[n_pending:, :n_pending] = True
    allowed[n_pending:, n_pending:] = tree
    return allowed
