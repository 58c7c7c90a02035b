"""The draft side: grow a token tree level by level (one draft forward per level) for a tree plan.

Per request the draft keeps a KV cache of committed tokens. ``grow`` forwards the not-yet-cached committed
tokens (their last one is the root), then each level whose nodes have children; at a node with k children
it draws k distinct tokens without replacement from D (greedy: the top-k) and keeps D, truncated to its
top ``support`` tokens, for the verifier. ``commit`` keeps only the accepted path's K/V.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from sequoia_ray.config import SamplingParams
from sequoia_ray.models.tree_lm import KVSession
from sequoia_ray.sampling import SparseDist, draw_without_replacement, target_probs, truncate
from sequoia_ray.tree.plan import TreePlan

DEFAULT_SUPPORT = 64


@dataclass(frozen=True)
class DraftTree:
    """What the draft sends to the verifier: the tokens of every node and D at every inner node."""

    tokens: torch.Tensor  # [n] int64; tokens[0] is the root (the last committed token)
    dists: dict[int, SparseDist]  # node id -> D its children were drawn from (empty when greedy)

    def nbytes(self) -> int:
        sizes = [d.tokens.numel() * d.tokens.element_size() + d.probs.numel() * d.probs.element_size()
                 for d in self.dists.values()]
        return self.tokens.numel() * self.tokens.element_size() + sum(sizes)


@dataclass
class _Request:
    session: KVSession
    committed: list[int]
    params: SamplingParams
    generator: torch.Generator
    base: int = 0  # cache slot of the root during the last grow
    forwarded: int = 0  # tree nodes whose K/V the last grow left in the cache (a prefix of node ids)
    cached: int = field(default=0)  # committed tokens whose K/V are in the cache
    grown: bool = False  # a tree was grown since the last commit


class DraftWorker:
    """Holds a draft model and per-request draft state, keyed by request id."""

    def __init__(self, model, *, support: int = DEFAULT_SUPPORT) -> None:
        self.model = model
        self.support = support
        self.vocab = model.config.vocab_size
        self.requests: dict[str, _Request] = {}

    def start(self, request_id: str, prompt: list[int], params: SamplingParams, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.requests[request_id] = _Request(KVSession(self.model), list(prompt), params, gen)

    def finish(self, request_id: str) -> None:
        self.requests.pop(request_id, None)

    def grow(self, request_id: str, plan: TreePlan) -> DraftTree:
        req = self.requests[request_id]
        req.session.truncate(req.cached)
        req.base = len(req.committed) - 1
        pending = torch.tensor(req.committed[req.cached :])
        logits = req.session.forward(pending, torch.arange(req.cached, req.base + 1))[-1:]  # [1, V] at the root
        tokens = torch.zeros(plan.n, dtype=torch.long)
        tokens[0] = req.committed[-1]
        dists: dict[int, SparseDist] = {}
        mask = torch.from_numpy(plan.ancestor_mask())
        for level, nodes in enumerate(plan.levels):
            self._draw_children(req, plan, nodes, logits, tokens, dists)
            if level + 2 >= plan.num_levels:
                break
            nxt = torch.tensor(plan.levels[level + 1])
            positions = torch.full((len(nxt),), req.base + level + 1)
            logits = req.session.forward(tokens[nxt], positions, mask[nxt][:, : int(nxt[-1]) + 1], req.base)
        req.forwarded = req.session.length - req.base
        req.grown = True
        return DraftTree(tokens, dists)

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
            tokens[list(kids)] = drawn

    def commit(self, request_id: str, path: list[int], new_tokens: list[int]) -> None:
        """The verifier kept ``path`` (node ids from the root) and appended ``new_tokens``."""
        req = self.requests[request_id]
        if req.grown:
            self._keep_path(req, path)
        req.committed.extend(new_tokens)

    @staticmethod
    def _keep_path(req: _Request, path: list[int]) -> None:
        req.grown = False
        kept = [node for node in path if node < req.forwarded]
        slots = torch.cat([torch.arange(req.base), req.base + torch.tensor(kept, dtype=torch.long)])
        req.session.keep(slots)
        req.cached = req.base + len(kept)
