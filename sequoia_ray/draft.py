"""The draft side: grow a token tree level by level (one draft forward per level) for a tree plan.

Per request the draft keeps a KV cache of committed tokens. ``grow`` forwards the not-yet-cached committed
tokens (their last one is the root), then, level by level, only the nodes that have children (a leaf's
logits and K/V are never used, and most nodes of an optimal tree are leaves); at a node with k children
it draws k distinct tokens without replacement from D (greedy: the top-k) and keeps D, truncated to its
top ``support`` tokens, for the verifier. ``commit`` keeps only the accepted path's K/V.

Devices: the tree is grown on the draft model's device, with the request's generator on that device; ``grow``
returns it as host tensors (``DraftTree.to("cpu")``), which is what crosses to the target (a Ray actor sends
host tensors), and the target places it on its own device on arrival.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from sequoia_ray.config import SamplingParams
from sequoia_ray.request_state import RequestState, RequestTable
from sequoia_ray.sampling import SparseDist, draw_without_replacement, target_probs, truncate
from sequoia_ray.tree.plan import TreePlan

DEFAULT_SUPPORT = 64


@dataclass(frozen=True)
class DraftTree:
    """What the draft sends to the verifier: the tokens of every node and D at every inner node."""

    tokens: torch.Tensor  # [n] int64; tokens[0] is the root (the last committed token)
    dists: dict[int, SparseDist]  # node id -> D its children were drawn from (empty when greedy)

    def to(self, device: torch.device | str) -> DraftTree:
        """The same tree on ``device``: every node's D is packed into one tensor of tokens and one of
        probabilities, so crossing devices costs one transfer each, not two per inner node."""
        if not self.dists:
            return DraftTree(self.tokens.to(device), {})
        nodes = list(self.dists)
        sizes = [len(self.dists[node].tokens) for node in nodes]
        tokens = torch.cat([self.dists[node].tokens for node in nodes]).to(device)  # [sum K] int64
        probs = torch.cat([self.dists[node].probs for node in nodes]).to(device)  # [sum K] float
        dists = {node: SparseDist(t, p) for node, t, p in zip(nodes, tokens.split(sizes), probs.split(sizes))}
        return DraftTree(self.tokens.to(device), dists)


@dataclass
class _Request(RequestState):
    base: int = 0  # cache slot of the root during the last grow
    forwarded: dict[int, int] = field(default_factory=dict)  # tree node -> its cache slot after ``base``
    cached: int = 0  # committed tokens whose K/V are in the cache
    grown: bool = False  # a tree was grown since the last commit


class DraftWorker(RequestTable):
    """Holds a draft model and per-request draft state, keyed by request id."""

    state_type = _Request

    def __init__(self, model, *, support: int = DEFAULT_SUPPORT) -> None:
        super().__init__(model)
        self.support = support
        self.vocab = model.config.vocab_size

    def grow(self, request_id: str, plan: TreePlan) -> DraftTree:
        """Grow ``plan``'s tree on the draft's device; returns it as host tensors (what crosses processes)."""
        req, device = self.get(request_id), self.device
        req.session.truncate(req.cached)
        req.base = len(req.committed) - 1
        pending = torch.tensor(req.committed[req.cached :], device=device)
        hidden = req.session.hidden(pending, torch.arange(req.cached, req.base + 1, device=device))
        logits = req.session.head(hidden[-1:])  # [1, V] at the root; the rest of the prefix needs no logits
        tokens = torch.zeros(plan.n, dtype=torch.long, device=device)
        tokens[0] = req.committed[-1]
        dists: dict[int, SparseDist] = {}
        mask = torch.from_numpy(plan.ancestor_mask()).to(device)  # [n, n] bool
        depth = torch.tensor(plan.depth, device=device)  # [n]
        forwarded, inner = [0], [0]  # tree nodes in the cache (slot order); nodes whose logits we hold
        while True:
            self._draw_children(req, plan, inner, logits, tokens, dists)
            # Only nodes with children are forwarded: a leaf's logits and K/V are never needed.
            inner = [c for node in inner for c in plan.children[node] if plan.children[c]]
            if not inner:
                break
            idx = torch.tensor(inner, device=device)
            cols = torch.tensor(forwarded + inner, device=device)
            logits = req.session.forward(tokens[idx], req.base + depth[idx], mask[idx][:, cols], req.base)
            forwarded += inner
        req.forwarded = {node: slot for slot, node in enumerate(forwarded)}
        req.grown = True
        return DraftTree(tokens, dists).to("cpu")

    def _draw_children(self, req: _Request, plan: TreePlan, nodes, logits, tokens, dists) -> None:
        for row, node in enumerate(nodes):
            kids = plan.children[node]
            if not kids:
                continue
            if req.params.greedy:
                drawn = torch.topk(logits[row], len(kids)).indices
            else:
                probs = target_probs(logits[row], req.params.temperature, req.params.top_p)
                dists[node] = truncate(probs, self.support)
                drawn = draw_without_replacement(dists[node], len(kids), self.vocab, req.generator)
            tokens[torch.tensor(kids, device=tokens.device)] = drawn

    def commit(self, request_id: str, path: list[int], new_tokens: list[int]) -> None:
        """The verifier kept ``path`` (node ids from the root) and appended ``new_tokens``."""
        req = self.get(request_id)
        if req.grown:
            self._keep_path(req, path)
        req.committed.extend(new_tokens)

    @staticmethod
    def _keep_path(req: _Request, path: list[int]) -> None:
        req.grown = False
        kept = [req.forwarded[node] for node in path if node in req.forwarded]  # a prefix of the path
        device = req.session.device
        slots = torch.cat([torch.arange(req.base, device=device),
                           req.base + torch.tensor(kept, dtype=torch.long, device=device)])
        req.session.keep(slots)
        req.cached = req.base + len(kept)
