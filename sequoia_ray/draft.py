"""The draft side: grow a token tree level by level (one draft forward per level) for a tree plan.

Per request the draft keeps a KV cache of committed tokens. ``grow`` forwards the not-yet-cached committed
tokens (their last one is the root), then, level by level, only the nodes that have children (a leaf's
logits and K/V are never used, and most nodes of an optimal tree are leaves); at a node with k children
it draws k distinct tokens without replacement from D (greedy: the top-k) and keeps D, truncated to its
top ``support`` tokens, for the verifier. ``commit`` keeps only the accepted path's K/V.

Devices: the tree is grown on the draft model's device, with the request's generator on that device; ``grow``
returns it as host tensors (``DraftTree.to("cpu")``), which is what crosses to the target (a Ray actor sends
host tensors), and the target places it on its own device on arrival.

Dynamic trees (``DraftWorker(..., dynamic=DynamicTrees(threshold, extend))`` for every tree, or a ``rule`` per
``grow`` call, e.g. the cost model's for the plan served: ``DynamicRules``), EAGLE-2's idea with the DP's plan
as prior and budget. A node's *path probability* v is the product of the draft's probabilities of the tokens
on its path (D at the request's temperature; greedy: the draft's softmax at T = 1) — the draft's estimate that
the target accepts the whole path, i.e. the node's expected gain in tokens. At a node with k planned children
the draft draws the k tokens in draw order and keeps children while ``v · E_i >= threshold`` (it stops at the
first i below), with E_i = E[D(s_i) | s_1..s_{i-1}] the expected D-probability of the i-th draw given the
earlier ones, so v · E_i is the child's expected path probability before it is drawn (greedy: E_i is the
i-th top probability itself — nothing is random). A node whose v is below the threshold is not forwarded
(E_i <= 1, so it could keep no child), so its whole planned subtree goes. A draft level costs a forward
whatever its width: with ``level_threshold`` the tree stops at a level whose nodes to forward are worth less
together (their children's path probabilities sum to at most theirs). Beyond the plan's depth, at each
level the one node of the deepest level with the largest v (a leaf of the plan's last level, then the
extension chain) gets one more child, drawn the same way, when ``v · E_1 >= extend_threshold``, for at most
``extend`` extra levels. Cap: every grown node but
the extension chain is a distinct plan node, so the tree has at most ``plan.n + extend`` nodes and
``plan.num_levels + extend`` levels. The grown tree is sent with its own ``TreePlan`` (``DraftTree.plan``,
breadth-first, children in draw order) and the target verifies that plan. With ``dynamic=None`` (or
thresholds of 0 and no extension) the tree is the plan's, draw for draw.

Why pruning keeps the verifier exact (sampled, T > 0). At a node, the verifier's output after i - 1
rejected children is distributed as the residual R_i whatever happens next, provided that, whenever the
i-th child is verified, it is distributed as D_i (D without s_1..s_{i-1}) given everything before it: then
stopping emits a draw from R_i, and going on accepts s_i with probability min(1, R_i/D_i)(s_i) or falls to
R_{i+1} = norm(max(R_i - D_i, 0)), which mixes back to R_i (the rejection-sampling lemma; by induction from
the last child). Keeping child i is decided from v (the path's tokens, drawn at the ancestors), E_i (a
function of s_1..s_{i-1} and D) and, for the extension and the level rule, the path probabilities of the
other nodes of the level (drawn with other noise, before this node's children) — never from s_i or a later
draw. So the decision is a stopping
time of the draw sequence and conditioning on it leaves s_i ~ D_i: the kept children are a prefix of the
without-replacement sequence whose length is decided before each draw is looked at. The k tokens are drawn
at once (Gumbel-top-k gives them in draw order, and the same noise as a static tree); the discarded tail
s_{m+1..k} is never read by any decision. Deciding on the drawn token itself (keep s_i iff v · D(s_i) >=
threshold) would NOT be exact: the kept s_i would follow D_i restricted to the likely tokens, not D_i. The
greedy verifier accepts argmax P wherever it is in any tree, so greedy output is the target's for any shape.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np
import torch

from sequoia_ray.batching import NOT_YET
from sequoia_ray.config import SamplingParams
from sequoia_ray.models.batch_forward import Segment, hidden_many
from sequoia_ray.models.draft_vocab import kept_logits
from sequoia_ray.prefix_cache import PrefixCache
from sequoia_ray.request_errors import poisons_device
from sequoia_ray.request_state import RequestState, RequestTable, check_prefill_chunk
from sequoia_ray.sampling import (
    SparseDist,
    draw_without_replacement,
    expected_draw_probability,
    probabilities_of,
    target_probs,
    truncate_rows,
)
from sequoia_ray.tree.plan import TreePlan

DEFAULT_SUPPORT = 64
logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DynamicTrees:
    """Trees that adapt inside a request (see the module docstring): a child is drawn while its expected path
    probability is >= ``threshold``; a confident path grows up to ``extend`` levels beyond the plan when its
    next node's expected path probability is >= ``extend_threshold`` (None: ``threshold``)."""

    threshold: float  # expected tokens a tree node must be worth: G(n, d) * delta / S (``from_cost_model``)
    extend: int = 0  # extra levels beyond the plan's depth (one node each)
    extend_threshold: float | None = None  # worth a node one extra draft level needs (None: ``threshold``)
    level_threshold: float = 0.0  # worth a level's inner nodes need together for the next draft forward

    def __post_init__(self) -> None:
        if not self.threshold >= 0:
            raise ValueError(f"threshold {self.threshold} must be >= 0 (0 keeps every planned node)")
        if self.extend < 0:
            raise ValueError(f"extend {self.extend} must be >= 0 (0: never grow beyond the plan's depth)")
        if self.extend_threshold is not None and not self.extend_threshold >= 0:
            raise ValueError(f"extend_threshold {self.extend_threshold} must be >= 0, or None for threshold")
        if not self.level_threshold >= 0:
            raise ValueError(f"level_threshold {self.level_threshold} must be >= 0 (0: no level is skipped)")

    @property
    def extend_bound(self) -> float:
        return self.threshold if self.extend_threshold is None else self.extend_threshold

    @classmethod
    def from_cost_model(cls, expected_tokens: float, step_cost: float, token_cost: float,
                        level_cost: float = 0.0, extend: int = 0, extend_cost: float | None = None) -> DynamicTrees:
        """Thresholds from the cost model, every cost in target-step units: a node worth g expected tokens
        raises throughput G / S iff g > G * delta / S, with G = ``expected_tokens`` (the plan's G(n, d)),
        S = ``step_cost`` (t(n) + d * c), delta = ``token_cost`` (t(n + 1) - t(n)); a draft level costs
        ``level_cost`` (c, one draft forward): the next level is grown only when the nodes it would draw
        from are worth G * c / S together, and a node on a new level beyond the plan pays delta + the level's
        ``extend_cost`` (None: c; in a batch a level beyond the plan is a forward of its own that the whole
        batch waits for, not a share of one)."""
        if step_cost <= 0:
            raise ValueError(f"step_cost {step_cost} must be > 0 (t(n) + d * c in target steps)")
        per_cost = expected_tokens / step_cost
        extend_cost = level_cost if extend_cost is None else extend_cost
        return cls(per_cost * token_cost, extend, per_cost * (token_cost + extend_cost), per_cost * level_cost)


@dataclass(frozen=True)
class DraftTree:
    """What the draft sends to the verifier: the tokens of every node and D at every inner node."""

    tokens: torch.Tensor  # [n] int64; tokens[0] is the root (the last committed token)
    dists: dict[int, SparseDist]  # node id -> D its children were drawn from (empty when greedy)
    plan: TreePlan | None = None  # the tree actually grown (a dynamic tree); None: the plan it was asked for
    # Catch-up tokens the draft forwarded, for any request, since this request's previous tree (its own
    # included): a prompt, or the tokens of steps the target took alone. Such a step's time says little about
    # its tree (``live_cost`` does not measure it); the target adds it to the verdict's ``prefill_beside``.
    prefill_beside: int = field(default=0, compare=False)

    def to(self, device: torch.device | str) -> DraftTree:
        """The same tree on ``device``: every node's D is packed into one tensor of tokens and one of
        probabilities, so crossing devices costs one transfer each, not two per inner node."""
        nodes, sizes, packed = self._packed()
        dists = _unpacked(nodes, sizes, [t.to(device) for t in packed])
        return DraftTree(self.tokens.to(device), dists, self.plan, self.prefill_beside)

    def __reduce__(self):
        """Pickled (as it crosses between actors) with host tensors as Python lists: torch's own pickling
        costs ~0.15 ms a tensor and a sampled tree has two per inner node (a 15-node tree with 7 inner nodes:
        1.7 ms and 23.5 KB a round trip; a Ray call carrying a root-only tree cost caller and callee 0.3 ms
        of CPU each more than one carrying a list). Exact for every dtype (a Python int or float holds any
        int64, float32 or bf16 value); the dists come back packed as ``to`` packs them. A tensor on an
        accelerator is pickled as itself (its device kept)."""
        nodes, sizes, packed = self._packed()
        return _tree_from_wire, (tuple(_to_wire(t) for t in (self.tokens, *packed)), nodes, sizes, self.plan,
                                 self.prefill_beside)

    def _packed(self) -> tuple[list[int], list[int], tuple[torch.Tensor, ...]]:
        """(the inner nodes in draw order, their supports' sizes, (tokens [sum K] int64, probs [sum K] float))
        of every node's D concatenated; no tensors for a greedy tree."""
        nodes = list(self.dists)
        sizes = [len(self.dists[node].tokens) for node in nodes]
        if not nodes:
            return nodes, sizes, ()
        return nodes, sizes, (torch.cat([self.dists[node].tokens for node in nodes]),
                              torch.cat([self.dists[node].probs for node in nodes]))


def _unpacked(nodes: list[int], sizes: list[int], packed) -> dict[int, SparseDist]:
    """``DraftTree._packed``'s inverse: each node's D as views into the packed tokens and probs."""
    if not nodes:
        return {}
    tokens, probs = packed
    return {node: SparseDist(t, p) for node, t, p in zip(nodes, tokens.split(sizes), probs.split(sizes))}


def _to_wire(t: torch.Tensor):
    return (t.tolist(), str(t.dtype).removeprefix("torch.")) if t.device.type == "cpu" else t


def _from_wire(x) -> torch.Tensor:
    if isinstance(x, torch.Tensor):
        return x
    values, name = x
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"a draft tree's tensor arrived with dtype {name!r}, which is not a torch dtype")
    return torch.tensor(values, dtype=dtype)


def _tree_from_wire(parts: tuple, nodes: list[int], sizes: list[int], plan: TreePlan | None,
                    prefill_beside: int) -> DraftTree:
    tokens, *packed = (_from_wire(x) for x in parts)
    return DraftTree(tokens, _unpacked(nodes, sizes, packed), plan, prefill_beside)


@dataclass
class _Request(RequestState):
    base: int = 0  # cache slot of the root during the last grow
    forwarded: dict[int, int] = field(default_factory=dict)  # tree node -> its cache slot after ``base``
    cached: int = 0  # committed tokens whose K/V are in the cache
    grown: bool = False  # a tree was grown since the last commit
    depth: int = 0  # depth of the last tree grown (a step accepts at most depth + 1 tokens)
    prefill_mark: int = 0  # the worker's ``prefilled`` at this request's start or last tree
    free: int | None = None  # of a catch-up going in chunks, the depth + 1 tokens not counted yet (None: none)


@dataclass
class _Growth:
    """One request's tree while the batch grows it, level by level. Static: the plan's nodes, ids and mask
    from the start. Dynamic: the grown tree so far (``parents``, ``depth``, ``mask`` grow with it)."""

    req: _Request
    plan: TreePlan  # the plan: a static tree's shape; a dynamic tree's prior and budget
    tokens: torch.Tensor  # [cap] int64 on the draft's device; tokens[i] is node i's token, tokens[0] the root
    mask: np.ndarray | None  # [cap, cap] bool ancestor mask on the host (None: a prefill chunk)
    depth: list[int] = field(default_factory=lambda: [0])  # node -> depth
    dists: dict[int, SparseDist] = field(default_factory=dict)
    forwarded: list[int] = field(default_factory=lambda: [0])  # tree nodes in the cache, in slot order
    inner: list[int] = field(default_factory=lambda: [0])  # nodes whose logits we hold (children to draw)
    prefill_only: bool = False  # this step forwards a chunk of the prompt only
    rule: DynamicTrees | None = None  # None: the plan's tree as it is
    parents: list[int] = field(default_factory=lambda: [-1])  # dynamic: the grown tree (breadth-first)
    source: list[int] = field(default_factory=lambda: [0])  # dynamic: grown node -> plan node (-1: extension)
    worth: list[float] = field(default_factory=lambda: [1.0])  # dynamic: path probability of every node


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

    def __init__(self, model, *, support: int = DEFAULT_SUPPORT, layout: str = "auto",
                 prefill_chunk: int | None = None, dynamic: DynamicTrees | None = None,
                 prefix_cache: PrefixCache | None = None) -> None:
        super().__init__(model, prefix_cache)
        self.support, self.layout = support, layout
        # None: every tree is its plan (see the module docstring). The worker's own rule knows no request's tokens
        # left nor the draft's context: under a SpeculativeDecoder give the rule to it (``dynamic=``), which caps
        # the extension to both, and withholds the pruned trees' biased ranks from the live estimate
        self.dynamic = dynamic
        self.prefill_chunk = check_prefill_chunk(prefill_chunk)  # None: the whole prompt at once
        self.vocab = model.config.vocab_size
        self.embedded = model.get_input_embeddings().num_embeddings  # token ids it can read
        self.kept: torch.Tensor | None = None  # [K] the ids the head's logits stand for (None: every id)
        self.prefilled = 0  # catch-up tokens forwarded so far, all requests (a tree's ``prefill_beside``)

    def start(self, request_id: str, prompt: list[int], params: SamplingParams, seed: int) -> None:
        super().start(request_id, prompt, params, seed)
        req = self.requests[request_id]
        req.prefill_mark, req.cached = self.prefilled, req.session.length  # past a cached prefix, if any

    def grow(self, request_id: str, plan: TreePlan, commits=(), rule: DynamicTrees | None = None) -> DraftTree:
        """Apply ``commits`` (see ``commit``), then grow ``plan``'s tree on the draft's device — pruned and
        extended by ``rule`` (None: the worker's ``dynamic``); returns it as host tensors (what crosses
        processes)."""
        while True:  # a long prompt takes one step per prefill chunk
            (result,) = self.grow_batch([(request_id, plan, commits, rule)])
            if isinstance(result, Exception):
                raise result
            if not isinstance(result, str):
                return result

    def tokens_of(self, method: str, request_id: str, args: tuple) -> int:
        """Tokens the first forward of ``grow`` would take now for this call (the batcher's token budget)."""
        pending = self._pending_of(request_id, args)
        if self._chunked(pending):
            return self.prefill_chunk
        rule = self._rule(args[2] if len(args) > 2 else None)
        return pending + args[0].n + (rule.extend if rule is not None else 0)

    def fewest_tokens_of(self, method: str, request_id: str, args: tuple) -> int:
        """The fewest tokens this call's first forward can take now (``grow_batch``'s ``caps`` cut a chunk)."""
        return self._fewest(self.tokens_of(method, request_id, args), self._pending_of(request_id, args))

    def _pending_of(self, request_id: str, args: tuple) -> int:
        """Tokens a ``grow`` call (``args``: plan[, commits[, rule]]) finds uncached once its commits apply."""
        req = self.get(request_id)
        commits = [(path, tokens) for path, tokens, at in (args[1] if len(args) > 1 else ())
                   if at >= len(req.committed)]
        # the cache once they are applied: the first keeps the grown tree's forwarded path (``_keep_path``); till
        # then ``cached`` is the last commit's (0 after a whole prompt: the prompt was counted again every step)
        cached = req.base + sum(n in req.forwarded for n in commits[0][0]) if req.grown and commits else req.cached
        return len(req.committed) + sum(len(tokens) for _, tokens in commits) - cached

    def grow_batch(self, calls: list[tuple], caps: dict[str, int] | None = None) -> list[DraftTree | Exception | str]:
        """``calls``: ``(request_id, plan[, commits[, rule]])``. Every call's tree (host tensors), the exception
        that ended it, or ``NOT_YET`` (a chunk of its prompt was prefilled; call again). ``caps``: a request's
        prefill chunk cut to so many tokens in this forward (the batcher's token budget left). A forward that fails
        as a whole is retried request by request (each regrows from its committed tokens; commits apply once)."""
        # The sampled requests' generators as they were: a retry alone draws what the batch would have (the same
        # seed gives the same tree at batch 1 and in a batch, even after a failed batch had drawn some levels).
        states = {rid: (req.generator, req.generator.get_state()) for rid in dict.fromkeys(c[0] for c in calls)
                  if (req := self.requests.get(rid)) is not None and not req.params.greedy} if len(calls) > 1 else {}
        results: list[DraftTree | Exception | str | None] = [None] * len(calls)
        try:
            return self._grow_batch(calls, caps or {}, results)
        except Exception as exc:  # noqa: BLE001 - sorted out below: which requests fail
            if poisons_device(exc):  # a CUDA error: no request here survives it; the actor must go
                raise
            if len(calls) == 1:
                return [exc]
            logger.exception("a batched grow of %d requests failed; retrying them one by one", len(calls))
            # only the calls the batch left unanswered: a chunk forwarded before the failure stays forwarded (its
            # retry forwarded a second one), a tree grown stays grown
            again = [i for i, result in enumerate(results) if result is None]
            for rid in {calls[i][0] for i in again} & states.keys():
                generator, state = states[rid]
                generator.set_state(state)
            for i in again:
                results[i] = self.grow_batch([calls[i]], caps)[0]
            return results

    def _grow_batch(self, calls: list[tuple], caps: dict[str, int],
                    results: list) -> list[DraftTree | Exception | str]:
        """``grow_batch``'s batch, each call's outcome written into ``results`` as it is known."""
        growing: dict[int, _Growth] = {}
        segments: dict[int, Segment] = {}
        for i, (request_id, plan, *rest) in enumerate(calls):
            try:
                for path, tokens, at in rest[0] if rest else ():
                    self.commit(request_id, path, tokens, at)
                rule = rest[1] if len(rest) > 1 else None
                growing[i], segments[i] = self._start_growth(request_id, plan, rule, caps.get(request_id))
            except Exception as exc:  # noqa: BLE001 - this request fails, the batch goes on
                if poisons_device(exc):  # a CUDA error: no request here survives it; the actor must go
                    raise
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
                    if poisons_device(exc):  # a CUDA error: no request here survives it; the actor must go
                        raise
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

    def _start_growth(self, request_id: str, plan: TreePlan, rule: DynamicTrees | None,
                      cap: int | None = None) -> tuple[_Growth, Segment]:
        req, device = self.get(request_id), self.device
        req.session.truncate(req.cached)
        pending = req.committed[req.cached :]
        if not all(0 <= t < self.embedded for t in pending):
            raise ValueError(f"request {request_id!r} has token ids outside the draft's vocabulary [0, {self.embedded})")
        chunked = self._chunked(len(pending))
        size = self._chunk_size(cap) if chunked else len(pending)
        # beyond the depth + 1 tokens a tree step can accept: a prompt, or steps the target took alone (once a
        # catch-up, however its chunks were cut: per chunk, the same tokens counted less the more cuts there were)
        free = 1 + req.depth if req.free is None else req.free
        self.prefilled += max(0, size - free)
        req.free = max(0, free - size) if chunked else None
        if chunked:
            chunk = torch.tensor(pending[:size], device=device)
            segment = Segment(req.session, chunk, torch.arange(req.cached, req.cached + len(chunk), device=device))
            return _Growth(req, plan, tokens=chunk, mask=None, prefill_only=True), segment
        req.base = len(req.committed) - 1
        segment = Segment(req.session, torch.tensor(pending, device=device),
                          torch.arange(req.cached, req.base + 1, device=device))
        return self._new_growth(req, plan, self._rule(rule)), segment

    def _rule(self, rule: DynamicTrees | None) -> DynamicTrees | None:
        """The rule a tree grows by: the call's, else the worker's; None for a static tree."""
        rule = rule if rule is not None else self.dynamic
        return None if rule is None or self._is_static(rule) else rule

    def _new_growth(self, req: _Request, plan: TreePlan, rule: DynamicTrees | None) -> _Growth:
        """Static (``rule`` None): the plan's tree. Dynamic: the root alone, room for ``plan.n + extend`` nodes."""
        if rule is not None and plan.n == 1 and not rule.extend:  # a root alone that may not grow: nothing to adapt
            rule = None
        cap = plan.n + (rule.extend if rule is not None else 0)
        tokens = torch.zeros(cap, dtype=torch.long, device=self.device)
        tokens[0] = req.committed[-1]
        if rule is None:
            return _Growth(req, plan, tokens, plan.ancestor_mask(), depth=list(plan.depth))
        mask = np.zeros((cap, cap), dtype=bool)  # [cap, cap]; rows filled as nodes are grown
        mask[0, 0] = True
        return _Growth(req, plan, tokens, mask, rule=rule)

    @staticmethod
    def _is_static(rule: DynamicTrees) -> bool:
        return rule.threshold == 0 and rule.extend == 0 and rule.level_threshold == 0

    def _forward(self, segments: dict[int, Segment], *, last_only: bool) -> dict[int, torch.Tensor]:
        """One draft forward over ``segments``; their logits ([q, K], or [1, K] at the last token) over the ids
        the draft's head keeps (``self.kept``; K = V for a full head)."""
        if not segments:
            return {}
        with self.forward_clock.timing():
            hidden = hidden_many(self.model, list(segments.values()), self.layout)
            rows = [h[-1:] for h in hidden] if last_only else hidden
            logits, self.kept = kept_logits(self.model, torch.cat(rows), next(iter(segments.values())).session.head)
            logits = logits.split([r.shape[0] for r in rows])  # one LM-head call for the batch
        return dict(zip(segments, logits))

    @staticmethod
    def _fits(width: int, logits: torch.Tensor) -> int:
        """``width`` greedy children, which the ids in ``logits`` [..., K] must hold (a restricted head keeps K)."""
        if width > logits.shape[-1]:
            raise ValueError(f"a node of the tree has {width} children but the draft's head has {logits.shape[-1]} "
                             "ids to choose them from; raise draft_vocab (or serve narrower trees)")
        return width

    def _ids(self, drawn: torch.Tensor) -> torch.Tensor:
        """Token ids of positions ``drawn`` in the logits ``_forward`` gave."""
        return drawn if self.kept is None else self.kept[drawn]

    def _dists(self, logits: torch.Tensor, params: SamplingParams) -> list[SparseDist]:  # logits: [L, K]
        """D at each of L nodes: the sampling distribution of its logits, truncated to its top ``support``
        tokens (one host read for all L)."""
        dists = truncate_rows(target_probs(logits, params.temperature, params.top_p), self.support)
        return [SparseDist(self._ids(d.tokens), d.probs) for d in dists]

    def _next_level(self, g: _Growth, logits: torch.Tensor) -> Segment | None:
        """Draw the children of ``g.inner``; the segment forwarding the next inner level (None: the tree is done)."""
        if g.rule is None:
            self._draw_children(g.req, g.plan, g.inner, logits, g.tokens, g.dists)
            # Only nodes with children are forwarded: a leaf's logits and K/V are never needed.
            g.inner = [c for node in g.inner for c in g.plan.children[node] if g.plan.children[c]]
        else:
            g.inner = self._grow_level(g, logits)
        if not g.inner:
            return None
        device, q = g.tokens.device, len(g.inner)
        # the level's node ids and positions in one copy to the device (each copy of host data waits for it)
        idx, positions = torch.tensor([*g.inner, *(g.req.base + g.depth[i] for i in g.inner)], dtype=torch.long,
                                      device=device).split(q)
        mask = torch.from_numpy(g.mask[np.ix_(g.inner, g.forwarded + g.inner)]).to(device)  # [q, kv] bool
        g.forwarded += g.inner
        return Segment(g.req.session, g.tokens[idx], positions, mask, g.req.base)

    def _finish_growth(self, g: _Growth) -> DraftTree:
        req = g.req
        req.forwarded = {node: slot for slot, node in enumerate(g.forwarded)}
        req.grown, req.depth = True, max(g.depth)
        beside, req.prefill_mark = self.prefilled - req.prefill_mark, self.prefilled
        if g.rule is None:
            return DraftTree(g.tokens, g.dists, prefill_beside=beside).to("cpu")
        n = len(g.parents)
        return DraftTree(g.tokens[:n], g.dists, TreePlan(tuple(g.parents)), beside).to("cpu")

    def _draw_children(self, req: _Request, plan: TreePlan, nodes, logits, tokens, dists) -> None:
        """Draw the children of ``nodes`` (``logits``: one row each) into ``tokens``: the draft's top-k (greedy,
        one top-k for the level) or draws without replacement from each node's D. One index and one write for
        the level: on an accelerator each host-to-device copy of an index waits for the device."""
        rows = [row for row, node in enumerate(nodes) if plan.children[node]]
        if not rows:
            return
        kids = [plan.children[nodes[row]] for row in rows]
        # [R, K]: the rows of nodes with children (all of them, but for a leaf in ``nodes``: the root alone)
        picked = logits[: len(rows)] if rows[-1] == len(rows) - 1 else logits[torch.tensor(rows, device=logits.device)]
        if req.params.greedy:
            top = self._ids(torch.topk(picked, self._fits(max(map(len, kids)), picked)).indices)  # [R, widest]
            drawn = [top[i, : len(k)] for i, k in enumerate(kids)]
        else:
            dists.update(zip([nodes[row] for row in rows], self._dists(picked, req.params)))
            drawn = [draw_without_replacement(dists[nodes[row]], len(k), self.vocab, req.generator)
                     for row, k in zip(rows, kids)]
        tokens[torch.tensor([c for k in kids for c in k], device=tokens.device)] = torch.cat(drawn)

    # ---- dynamic trees (see the module docstring) ----------------------------------------------------
    def _grow_level(self, g: _Growth, logits: torch.Tensor) -> list[int]:  # logits: [len(g.inner), K]
        """Draw each inner node's planned children, keep the prefix worth its cost; the next level's inner nodes."""
        wanted = [self._wanted(g, node) for node in g.inner]
        if not g.req.params.greedy:  # every node's D at once (one host read)
            g.dists.update(zip(g.inner, self._dists(logits[: len(g.inner)], g.req.params)))
        drawn = [self._draw_dynamic(g, node, logits[row], k) for (row, node), (k, _) in zip(enumerate(g.inner), wanted)]
        host = torch.cat([torch.stack(d[1:]) for d in drawn], dim=1).tolist() if drawn else [[], []]  # one sync
        new, at = [], 0
        for node, (k, bound), (tokens, _, _) in zip(g.inner, wanted, drawn):
            value, expected = host[0][at : at + k], host[1][at : at + k]
            at += k
            kept = _kept_prefix([g.worth[node] * e for e in expected], bound)
            new += self._add_children(g, node, tokens[:kept], value[:kept])
            if kept == 0:
                g.dists.pop(node, None)
        return self._inner_after(g, new)

    def _wanted(self, g: _Growth, node: int) -> tuple[int, float]:
        """(children to draw, expected path probability each must reach) at ``node``: its planned children,
        or one child beyond the plan (an extension)."""
        src = g.source[node]
        if src >= 0 and g.plan.children[src]:
            return len(g.plan.children[src]), g.rule.threshold
        return 1, g.rule.extend_bound

    def _draw_dynamic(self, g: _Growth, node: int, logits: torch.Tensor, k: int):  # logits: [K]
        """(tokens [k], the draft's probability of each [k], E_i [k]) at ``node``, in draw order."""
        req = g.req
        if req.params.greedy:  # the top-k, as a static tree; their probabilities are known before keeping any
            top = torch.topk(logits, self._fits(k, logits)).indices
            value = torch.softmax(logits.float(), dim=-1)[top].double()  # the draft's confidence at T = 1
            return self._ids(top), value, value
        dist = g.dists[node]  # drawn for the whole level by ``_grow_level``
        tokens = draw_without_replacement(dist, k, self.vocab, req.generator)
        return tokens, probabilities_of(dist, tokens), expected_draw_probability(dist, tokens)

    @staticmethod
    def _add_children(g: _Growth, node: int, tokens: torch.Tensor, value: list[float]) -> list[int]:
        """Append ``node``'s kept children (breadth-first ids); their ids."""
        src = g.source[node]
        planned = g.plan.children[src] if src >= 0 else ()
        ids = list(range(len(g.parents), len(g.parents) + len(value)))
        for i, (child, v) in enumerate(zip(ids, value)):
            g.parents.append(node)
            g.depth.append(g.depth[node] + 1)
            g.source.append(planned[i] if i < len(planned) else -1)
            g.worth.append(g.worth[node] * v)
            g.mask[child] = g.mask[node]
            g.mask[child, child] = True
        if ids:
            g.tokens[ids[0] : ids[-1] + 1] = tokens
        return ids

    @staticmethod
    def _inner_after(g: _Growth, new: list[int]) -> list[int]:
        """The new nodes to forward: planned inner nodes worth the threshold, and the most probable node of the
        deepest level when it may grow one level beyond the plan (at most ``extend`` levels)."""
        rule, last = g.rule, g.plan.num_levels - 1
        inner = [c for c in new if g.source[c] >= 0 and g.plan.children[g.source[c]] and g.worth[c] >= rule.threshold]
        deepest = [c for c in new if last <= g.depth[c] < last + rule.extend]
        if deepest:
            best = max(deepest, key=g.worth.__getitem__)
            if g.worth[best] >= rule.extend_bound:
                inner.append(best)
        if sum(g.worth[c] for c in inner) < rule.level_threshold:  # the next level's children are worth less
            return []
        return sorted(inner)

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
        req.session.keep([*range(req.base), *(req.base + slot for slot in kept)])
        req.cached = req.base + len(kept)


def _kept_prefix(values: list[float], bound: float) -> int:
    """How many leading ``values`` are >= ``bound`` (drawing stops at the first one below)."""
    for i, v in enumerate(values):
        if v < bound:
            return i
    return len(values)
