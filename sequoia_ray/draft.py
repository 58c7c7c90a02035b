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

import logging
from dataclasses import dataclass, field

import torch

from sequoia_ray.batching import NOT_YET
from sequoia_ray.config import SamplingParams
from sequoia_ray.models.batch_forward import Segment, hidden_many
from sequoia_ray.request_state import RequestState, RequestTable
from sequoia_ray.sampling import SparseDist, draw_without_replacement, target_probs, truncate
from sequoia_ray.tree.plan import TreePlan

DEFAULT_SUPPORT = 64
logger = logging.getLogger(__name__)


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


@dataclass
class _Growth:
    """One request's tree while the batch grows it, level by level."""

    req: _Request
    plan: TreePlan
    tokens: torch.Tensor  # [n] int64 on the draft's device; tokens[0] is the root
    mask: torch.Tensor | None  # [n, n] bool ancestor mask (None: a prefill chunk)
    depth: torch.Tensor | None  # [n] int64
    dists: dict[int, SparseDist] = field(default_factory=dict)
    forwarded: list[int] = field(default_factory=lambda: [0])  # tree nodes in the cache, in slot order
    inner: list[int] = field(default_factory=lambda: [0])  # nodes whose logits we hold (children to draw)
    prefill_only: bool = False  # this step forwards a chunk of the prompt only


class DraftWorker(RequestTable):
    """Holds a draft model and per-request draft state, keyed by request id.

    ``grow_batch`` grows several requests' trees together: one draft forward for every request's uncached
    committed tokens, then one forward per tree level over every request's frontier (``models.batch_forward``).
    Each request draws with its own generator in the order it would alone, so a seed gives the same tree at
    batch 1 and in a batch — given batch-invariant logits: true of float weights (to rounding), not of a
    dynamically int8-quantised draft, whose activation scale is per tensor, i.e. per batch (its trees still
    have the right law, the verifier is exact either way). A request that fails gets its exception in its
    slot; the others go on."""

    state_type = _Request

    def __init__(self, model, *, support: int = DEFAULT_SUPPORT, layout: str = "flat",
                 prefill_chunk: int | None = None) -> None:
        super().__init__(model)
        self.support, self.layout = support, layout
        self.prefill_chunk = prefill_chunk  # longest prefill forwarded in one step (None: the whole prompt)
        self.vocab = model.config.vocab_size
        self.embedded = model.get_input_embeddings().num_embeddings  # token ids it can read

    def grow(self, request_id: str, plan: TreePlan, commits=()) -> DraftTree:
        """Apply ``commits`` (see ``commit``), then grow ``plan``'s tree on the draft's device; returns it as
        host tensors (what crosses processes)."""
        while True:  # a long prompt takes one step per prefill chunk
            (result,) = self.grow_batch([(request_id, plan, commits)])
            if isinstance(result, Exception):
                raise result
            if not isinstance(result, str):
                return result

    def tokens_of(self, method: str, request_id: str, args: tuple) -> int:
        """Tokens the first forward of ``grow`` would take now for this call (the batcher's token budget)."""
        req, plan = self.get(request_id), args[0]
        unsent = sum(len(tokens) for _, tokens, at in (args[1] if len(args) > 1 else ()) if at >= len(req.committed))
        pending = len(req.committed) + unsent - req.cached
        return self.prefill_chunk if self._chunked(pending) else pending + plan.n

    def _chunked(self, pending: int) -> bool:
        return self.prefill_chunk is not None and pending > self.prefill_chunk

    def grow_batch(self, calls: list[tuple]) -> list[DraftTree | Exception | str]:
        """``calls``: ``(request_id, plan[, commits])``. Every call's tree (host tensors), the exception that ended
        it, or ``NOT_YET`` (a chunk of its prompt was prefilled; call again). A forward that fails as a whole is
        retried request by request (each regrows from its committed tokens; commits apply once)."""
        try:
            return self._grow_batch(calls)
        except Exception as exc:  # noqa: BLE001 - sorted out below: which requests fail
            if len(calls) == 1:
                return [exc]
            logger.exception("a batched grow of %d requests failed; retrying them one by one", len(calls))
            return [self.grow_batch([call])[0] for call in calls]

    def _grow_batch(self, calls: list[tuple]) -> list[DraftTree | Exception | str]:
        results: list[DraftTree | Exception | str | None] = [None] * len(calls)
        growing: dict[int, _Growth] = {}
        segments: dict[int, Segment] = {}
        for i, (request_id, plan, *commits) in enumerate(calls):
            try:
                for path, tokens, at in commits[0] if commits else ():
                    self.commit(request_id, path, tokens, at)
                growing[i], segments[i] = self._start_growth(request_id, plan)
            except Exception as exc:  # noqa: BLE001 - this request fails, the batch goes on
                results[i] = exc
        logits = self._forward(segments, last_only=True)  # [1, V] at each root
        for i in [i for i, g in growing.items() if g.prefill_only]:
            growing.pop(i).req.cached += segments[i].q
            results[i] = NOT_YET
        while growing:
            segments = {}
            for i, g in list(growing.items()):
                try:
                    segment = self._next_level(g, logits[i])
                except Exception as exc:  # noqa: BLE001
                    results[i] = exc
                    del growing[i]
                    continue
                if segment is None:
                    results[i] = self._finish_growth(g)
                    del growing[i]
                else:
                    segments[i] = segment
            logits = self._forward(segments, last_only=False)
        return results

    def _start_growth(self, request_id: str, plan: TreePlan) -> tuple[_Growth, Segment]:
        req, device = self.get(request_id), self.device
        req.session.truncate(req.cached)
        pending = req.committed[req.cached :]
        if not all(0 <= t < self.embedded for t in pending):
            raise ValueError(f"request {request_id!r} has token ids outside the draft's vocabulary [0, {self.embedded})")
        if self._chunked(len(pending)):
            chunk = torch.tensor(pending[: self.prefill_chunk], device=device)
            segment = Segment(req.session, chunk, torch.arange(req.cached, req.cached + len(chunk), device=device))
            return _Growth(req, plan, tokens=chunk, mask=None, depth=None, prefill_only=True), segment
        req.base = len(req.committed) - 1
        segment = Segment(req.session, torch.tensor(pending, device=device),
                          torch.arange(req.cached, req.base + 1, device=device))
        tokens = torch.zeros(plan.n, dtype=torch.long, device=device)
        tokens[0] = req.committed[-1]
        mask = torch.from_numpy(plan.ancestor_mask()).to(device)  # [n, n] bool
        return _Growth(req, plan, tokens, mask, torch.tensor(plan.depth, device=device)), segment

    def _forward(self, segments: dict[int, Segment], *, last_only: bool) -> dict[int, torch.Tensor]:
        """One draft forward over ``segments``; their logits ([q, V], or [1, V] at the last token)."""
        if not segments:
            return {}
        hidden = hidden_many(self.model, list(segments.values()), self.layout)
        rows = [h[-1:] for h in hidden] if last_only else hidden
        head = next(iter(segments.values())).session.head
        logits = head(torch.cat(rows)).split([r.shape[0] for r in rows])  # one LM-head call for the batch
        return dict(zip(segments, logits))

    def _next_level(self, g: _Growth, logits: torch.Tensor) -> Segment | None:
        """Draw the children of ``g.inner``; the segment forwarding the next inner level (None: the tree is done)."""
        self._draw_children(g.req, g.plan, g.inner, logits, g.tokens, g.dists)
        # Only nodes with children are forwarded: a leaf's logits and K/V are never needed.
        g.inner = [c for node in g.inner for c in g.plan.children[node] if g.plan.children[c]]
        if not g.inner:
            return None
        device = g.tokens.device
        idx = torch.tensor(g.inner, device=device)
        cols = torch.tensor(g.forwarded + g.inner, device=device)
        g.forwarded += g.inner
        return Segment(g.req.session, g.tokens[idx], g.req.base + g.depth[idx], g.mask[idx][:, cols], g.req.base)

    @staticmethod
    def _finish_growth(g: _Growth) -> DraftTree:
        g.req.forwarded = {node: slot for slot, node in enumerate(g.forwarded)}
        g.req.grown = True
        return DraftTree(g.tokens, g.dists).to("cpu")

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

    def commit(self, request_id: str, path: list[int], new_tokens: list[int], at: int | None = None) -> None:
        """The verifier kept ``path`` (node ids from the root) and appended ``new_tokens`` to the request's
        ``at`` tokens. With ``at`` the call is idempotent: a commit already applied (a grow sent again after a
        prefill chunk) is skipped, and one that does not follow the request's tokens is an error."""
        req = self.get(request_id)
        if at is not None and at != len(req.committed):
            if at + len(new_tokens) <= len(req.committed):
                return
            raise ValueError(f"commit at token {at} but request {request_id!r} has {len(req.committed)} tokens")
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
