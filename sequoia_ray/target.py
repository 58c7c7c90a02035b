"""The target side: score draft trees in one forward pass, verify them, compact the KV cache.

Per request the target caches every committed token but the newest (the next tree's root). A verify
forwards the uncached committed tokens (the first call: the prompt, i.e. prefill) and the tree in ONE pass,
walks the tree with the request's own generator, keeps the accepted path's K/V and returns the verdict —
only token ids cross back, never logits. A root-only plan is plain target decoding. The tree verified is the
one the draft grew: a dynamic tree (``DraftTree.plan``) replaces the plan sent, and the verdict's path is in
its node ids; the verifier is exact for any tree shape.

Batching: ``verify_batch`` verifies several requests' trees in ONE forward (``models.batch_forward``): each
request keeps its own context, positions, tree mask, generator, verdict and compaction, so a batched
verdict is the verdict the request would get alone. A request that fails (unknown, a malformed tree, an
error in its walk) gets its exception in its slot of the result and the others go on; a forward that
fails as a whole is retried request by request, so one request cannot take the batch down (on a
tensor-parallel rank it fails the batch instead: the peers' collectives would not match a retry). A failed
request's cache is rolled back to its committed tokens.

Devices: the tree arrives as host tensors (from an actor, or from an in-process draft) and its tokens are
placed on the target model's device on arrival; the forward runs there. The walk runs on the host after ONE
transfer (``sequoia_ray.verify``), so the request's generator is a host generator.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

import torch

from sequoia_ray.batching import NOT_YET
from sequoia_ray.config import SamplingParams
from sequoia_ray.draft import DraftTree
from sequoia_ray.models.batch_forward import Segment, hidden_many
from sequoia_ray.prefix_cache import PrefixCache
from sequoia_ray.request_errors import poisons_device
from sequoia_ray.request_state import RequestState, RequestTable, check_prefill_chunk
from sequoia_ray.tree.plan import TreePlan
from sequoia_ray.verify import Verdict, batch_inputs, token_logprobs, verify_tree

logger = logging.getLogger(__name__)


@dataclass
class _Prepared:
    req: RequestState
    plan: TreePlan
    draft: DraftTree | None  # None: a prefill chunk only, the tree waits for the next step
    segment: Segment
    pending: int  # committed tokens forwarded before the tree (prefill rows: no logits)
    base: int  # cache slot of the tree's root
    cached: int  # the session's length before this step (where a failed step rolls it back to)


@dataclass
class _TargetRequest(RequestState):
    prefill_mark: int = 0  # the worker's ``prefilled`` at this request's start or last verdict


class TargetWorker(RequestTable):
    """Holds the target model and per-request target state, keyed by request id."""

    state_type = _TargetRequest

    def __init__(self, model, *, layout: str = "auto", prefill_chunk: int | None = None,
                 retry_alone: bool = True, prefix_cache: PrefixCache | None = None) -> None:
        super().__init__(model, prefix_cache)
        self.layout = layout
        self.prefill_chunk = check_prefill_chunk(prefill_chunk)  # None: the whole prompt at once
        # A failed batched forward is retried request by request, unless this is one rank of a tensor-parallel
        # group: its peers are still inside the batched forward's collectives, so it must fail the batch.
        self.retry_alone = retry_alone
        self.vocab = model.get_input_embeddings().num_embeddings
        self.prefilled = 0  # prompt tokens forwarded so far, all requests (a verdict's ``prefill_beside``)

    def start(self, request_id: str, prompt: list[int], params: SamplingParams, seed: int) -> None:
        super().start(request_id, prompt, params, seed)
        self.requests[request_id].prefill_mark = self.prefilled

    @property
    def generator_device(self) -> torch.device:
        return torch.device("cpu")  # the verify walk runs on the host (see sequoia_ray.verify)

    def verify(self, request_id: str, plan: TreePlan, draft: DraftTree) -> Verdict:
        while True:  # a long prompt takes one step per prefill chunk
            (result,) = self.verify_batch([(request_id, plan, draft)])
            if isinstance(result, Exception):
                raise result
            if result != NOT_YET:
                return result

    def tokens_of(self, method: str, request_id: str, args: tuple) -> int:
        """Tokens ``verify`` would forward now for this call (the batcher's token budget)."""
        req, plan = self.get(request_id), _grown(args[0], args[1] if len(args) > 1 else None)
        pending = len(req.committed) - 1 - req.session.length
        if self._chunked(pending):
            return self.prefill_chunk
        return pending + plan.n

    def fewest_tokens_of(self, method: str, request_id: str, args: tuple) -> int:
        """The fewest tokens this call can forward now (``verify_batch``'s ``caps`` cut a prefill chunk)."""
        req = self.get(request_id)
        return self._fewest(self.tokens_of(method, request_id, args), len(req.committed) - 1 - req.session.length)

    def verify_batch(self, calls: list[tuple[str, TreePlan, DraftTree]],
                     caps: dict[str, int] | None = None) -> list[Verdict | Exception | str]:
        """One forward for every call's tree; per call its verdict, the exception that ended it, or ``NOT_YET``
        (a chunk of its prompt was prefilled; call again). ``caps``: a request's prefill chunk cut to so many
        tokens in this forward (the batcher's token budget left)."""
        results: list[Verdict | Exception | None] = [None] * len(calls)
        prepared: dict[int, _Prepared] = {}
        for i, call in enumerate(calls):
            try:
                prepared[i] = self._prepare(*call, cap=(caps or {}).get(call[0]))
            except Exception as exc:  # noqa: BLE001 - this request fails, the batch goes on
                if poisons_device(exc):  # a CUDA error: no request here survives it; the actor must go
                    raise
                results[i] = exc
        for i, outcome in self._verify_prepared(prepared).items():
            results[i] = outcome
        return results

    def _verify_prepared(self, prepared: dict[int, _Prepared]) -> dict[int, Verdict | Exception | str]:
        if not prepared:
            return {}
        try:
            with self.forward_clock.timing():
                hidden = hidden_many(self.model, [p.segment for p in prepared.values()], self.layout)
                trees = {i: h[p.pending :] for (i, p), h in zip(prepared.items(), hidden) if p.draft is not None}
                # One LM-head call for every tree row of the batch: the head is memory-bound, so rows cost about
                # what one row does, and a call per request would re-read the vocab x hidden weights each time.
                # Inside the try: a head that fails (out of memory on a large batch's [sum n, V] logits) fails
                # the forward, which is rolled back and retried request by request like the decoder's.
                rows = list(trees.values())
                sizes = [r.shape[0] for r in rows]  # each tree's rows of the batch's logits
                logits = prepared[next(iter(trees))].req.session.head(torch.cat(rows)) if trees else None
                # The walks' inputs too (on an accelerator an argmax and the sampled rows' copy to the host): what
                # fails there must roll back the sessions as well, or their tree K/V stayed for the next verify.
                inputs = batch_inputs(logits, sizes, [prepared[i].req.params.greedy for i in trees]) if trees else []
        except Exception as exc:  # noqa: BLE001 - sorted out below: which requests fail
            if poisons_device(exc):  # a CUDA error: no request here survives it; the actor must go
                raise
            for p in prepared.values():
                p.req.session.truncate(p.cached)  # a solo forward may have written some layers' K/V
            if not self.retry_alone:
                raise
            if len(prepared) == 1:
                return {i: exc for i in prepared}
            logger.exception("a batched verify of %d requests failed; retrying them one by one", len(prepared))
            return {i: out for i, p in prepared.items() for out in self._verify_prepared({i: p}).values()}
        out: dict[int, Verdict | Exception | str] = {i: NOT_YET for i, p in prepared.items() if p.draft is None}
        self.prefilled += sum(p.pending for p in prepared.values())
        raw = logits.split(sizes) if trees else []  # [n, V] each: for logprobs
        for i, node_logits, tree_logits in zip(trees, inputs, raw):  # each request's rows (or argmax ids)
            out[i] = self._walk(prepared[i], node_logits, tree_logits)
        return out

    def _prepare(self, request_id: str, plan: TreePlan, draft: DraftTree, *, cap: int | None = None) -> _Prepared:
        req, device, plan = self.get(request_id), self.device, _grown(plan, draft)
        if draft.tokens.shape != (plan.n,):
            raise ValueError(f"draft tree has {draft.tokens.shape[0]} tokens, plan {plan.n}")
        if int(draft.tokens[0]) != req.committed[-1]:
            raise ValueError("the tree's root must be the last committed token")
        if not 0 <= int(draft.tokens.min()) <= int(draft.tokens.max()) < self.vocab:  # host tensor: no sync
            raise ValueError(f"draft tree has token ids outside the target's vocabulary [0, {self.vocab})")
        cached, base = req.session.length, len(req.committed) - 1
        if self._chunked(base - cached):
            chunk = torch.tensor(req.committed[cached : cached + self._chunk_size(cap)], dtype=torch.long,
                                 device=device)
            segment = Segment(req.session, chunk, torch.arange(cached, cached + len(chunk), device=device))
            return _Prepared(req, plan, None, segment, len(chunk), base, cached)
        # Built on the host and placed with two copies (ids and positions together, then the mask): one copy per
        # piece cost four waits a request on an accelerator, every step.
        pending, host = base - cached, torch.device("cpu")
        ids = torch.empty(2, pending + plan.n, dtype=torch.long, device=host)  # [2, p + n]: token ids, positions
        ids[0, :pending] = torch.tensor(req.committed[cached:base], dtype=torch.long, device=host)
        ids[0, pending:] = draft.tokens
        ids[1, :pending] = torch.arange(cached, base, device=host)
        ids[1, pending:] = base + torch.tensor(plan.depth, dtype=torch.long, device=host)
        ids = ids.to(device)
        allowed = _prefill_then_tree(pending, torch.from_numpy(plan.ancestor_mask())).to(device)  # [p + n, p + n]
        segment = Segment(req.session, ids[0], ids[1], allowed)
        return _Prepared(req, plan, draft, segment, pending, base, cached)

    def _walk(self, p: _Prepared, logits, tree_logits: torch.Tensor) -> Verdict | Exception:
        """``logits``: ``verify_tree``'s input ([n, V], or greedy [n] argmax ids); ``tree_logits``: the [n, V] rows."""
        try:
            verdict = verify_tree(p.plan, p.draft.to("cpu"), logits, p.req.params, p.req.generator)
            if p.req.params.logprobs is not None:
                verdict = replace(verdict, logprobs=token_logprobs(tree_logits, verdict, p.req.params.logprobs))
            # other requests' prompt tokens forwarded since this request's last verdict: in this forward, or
            # in one its call waited behind (a pipelined tree step queues behind the other group's forward)
            # and the draft's catch-up forwards since this request's previous tree (the tree says how many)
            beside = self.prefilled - p.req.prefill_mark - p.pending + p.draft.prefill_beside
            verdict = replace(verdict, prefill_beside=beside)
            p.req.prefill_mark = self.prefilled
            p.req.session.keep([*range(p.base), *(p.base + node for node in verdict.path)])
        except Exception as exc:  # noqa: BLE001 - this request fails, the batch goes on
            if poisons_device(exc):  # a CUDA error: no request here survives it; the actor must go
                raise
            p.req.session.truncate(p.base)  # drop the tree's K/V: the cache holds committed tokens only
            return exc
        p.req.committed.extend(verdict.tokens)
        return verdict


def _grown(plan: TreePlan, draft) -> TreePlan:
    """The tree to verify: the one the draft grew (a dynamic tree carries its own plan), else the plan sent."""
    return getattr(draft, "plan", None) or plan


def _prefill_then_tree(n_pending: int, tree: torch.Tensor) -> torch.Tensor:  # -> [p + n, p + n] bool
    """Causal among the pending tokens; every tree node sees all of them and its own ancestors."""
    n, device = tree.shape[0], tree.device
    allowed = torch.zeros(n_pending + n, n_pending + n, dtype=torch.bool, device=device)
    allowed[:n_pending, :n_pending] = torch.ones(n_pending, n_pending, dtype=torch.bool, device=device).tril()
    allowed[n_pending:, :n_pending] = True
    allowed[n_pending:, n_pending:] = tree
    return allowed
