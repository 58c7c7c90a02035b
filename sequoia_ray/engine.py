"""``SpeculativeDecoder``: the loop grow -> verify, with exact stop conditions and statistics.

The decoder talks to its draft and target through two small protocols, so in-process workers and Ray
actor handles are interchangeable. Each step: the draft grows the plan's tree, the target verifies it in
one forward pass and returns the kept path and tokens (accepted + one residual/bonus), the draft keeps the
same path (told with its next grow: one draft call per step). Tokens are then emitted one by one so EOS,
stop strings and ``max_tokens`` end generation exactly, even inside an accepted path. Without a draft every step is a root-only tree (target alone).
"""

from __future__ import annotations

import hashlib
import logging
import numbers
import os
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from typing import Protocol

import torch

from sequoia_ray.config import SamplingParams
from sequoia_ray.draft import DraftTree, DynamicTrees
from sequoia_ray.request_errors import RequestCancelled, UnknownRequest
from sequoia_ray.stopping import StopChecker
from sequoia_ray.tree.plan import TreePlan, first_levels
from sequoia_ray.verify import Verdict

ROOT_ONLY = TreePlan((-1,))
logger = logging.getLogger(__name__)


class Draft(Protocol):
    """``grow`` first applies ``commits`` — the verdicts since the last grow, as ``(path, tokens, at)`` with ``at``
    the request's token count before them — so a step costs one draft call, not two. Its tree is opaque to
    the engine: whatever ``Target.verify`` accepts (a ``DraftTree``, or a reference to one in an object store).
    ``rule``, passed only when the decoder has one for the step: prune and extend the plan's tree by it."""

    def start(self, request_id: str, prompt: list[int], params: SamplingParams, seed: int) -> None: ...
    def grow(self, request_id: str, plan: TreePlan, commits: list[tuple[list[int], list[int], int]] = (),
             rule: DynamicTrees | None = None) -> DraftTree: ...
    def finish(self, request_id: str) -> None: ...
    # optional: ``abandon(request_id)``, a finish that neither waits nor raises (a draft behind a remote call),
    # sent after a failed call so the draft frees the request's state; without it the engine calls ``finish``
    # optional: ``max_context``, the positions the draft model reads (None or absent: no limit, see
    # ``draft_levels``)


class StepPolicy(Protocol):
    """One request's say in its trees (``SpeculativeDecoder(policy=...)`` makes one per request): ``plan`` turns
    the step's plan (the batch bucket's) into the tree this step grows — itself, another tree, or ``ROOT_ONLY``
    (the target alone for this step); ``observe`` sees each step's tree, verdict and ``seconds``, the wall time
    since the previous step's verdict (the request's whole step cycle: draft, verify, and its time away).
    Deciding the tree from earlier verdicts never touches exactness: the verifier is exact for any tree.
    A policy may also have ``finish()``: called once when the request ends, however it ends."""

    def plan(self, base: TreePlan) -> TreePlan: ...
    def observe(self, plan: TreePlan, verdict: Verdict, seconds: float) -> None: ...


class Target(Protocol):
    def start(self, request_id: str, prompt: list[int], params: SamplingParams, seed: int) -> None: ...
    def verify(self, request_id: str, plan: TreePlan, draft: DraftTree) -> Verdict: ...
    def finish(self, request_id: str) -> None: ...


@dataclass
class Stats:
    steps: int = 0
    tokens: int = 0
    accepted_hist: Counter = field(default_factory=Counter)  # accepted draft tokens per step -> steps
    root_rank_hist: Counter = field(default_factory=Counter)  # rank of the accepted root child (0 = none)
    draft_s: float = 0.0
    verify_s: float = 0.0
    total_s: float = 0.0
    plan_nodes: int = 0
    plan_levels: int = 0
    tree_nodes: int = 0  # nodes of every tree verified, roots included (dynamic trees: as grown)
    draft_failures: int = 0  # 1 if the draft failed and the request finished with the target alone

    @property
    def tokens_per_step(self) -> float:
        return self.tokens / self.steps if self.steps else 0.0

    @property
    def tree_steps(self) -> int:
        """Steps that verified a draft tree (the others ran the target alone: a first step, a live-cost probe, a
        root-only plan, the last token, a draft gone)."""
        return sum(self.root_rank_hist.values())

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.total_s if self.total_s > 0 else 0.0

    @classmethod
    def combined(cls, parts: list[Stats]) -> Stats:
        """The stats of prompts generated side by side (a batched completion): counts and the time in the models
        added; ``total_s`` the longest prompt's (they ran together: ``tokens_per_second`` is the batch's); the
        largest plan."""
        if len(parts) == 1:
            return parts[0]
        out = cls(total_s=max(s.total_s for s in parts), plan_nodes=max(s.plan_nodes for s in parts),
                  plan_levels=max(s.plan_levels for s in parts))
        for s in parts:
            for name in ("steps", "tokens", "tree_nodes", "draft_s", "verify_s", "draft_failures"):
                setattr(out, name, getattr(out, name) + getattr(s, name))
            out.accepted_hist.update(s.accepted_hist)
            out.root_rank_hist.update(s.root_rank_hist)
        return out

    def to_dict(self) -> dict:
        return {
            "steps": self.steps, "tokens": self.tokens, "tokens_per_step": self.tokens_per_step,
            "tokens_per_second": self.tokens_per_second, "draft_s": self.draft_s, "verify_s": self.verify_s,
            # string keys, as JSON has them: a handle's caller and an HTTP client read the same dict
            "total_s": self.total_s, "accepted_histogram": {str(k): v for k, v in sorted(self.accepted_hist.items())},
            "root_rank_histogram": {str(k): v for k, v in sorted(self.root_rank_hist.items())},
            "plan_nodes": self.plan_nodes, "plan_levels": self.plan_levels, "tree_nodes": self.tree_nodes,
            "draft_failures": self.draft_failures,
        }


@dataclass
class Chunk:
    """A streamed piece: new token ids and the text they complete; the last chunk has finish_reason."""

    token_ids: list[int]
    text: str
    finish_reason: str | None = None  # "stop" (EOS or stop string) | "length"
    stats: Stats | None = None
    # per token id (``SamplingParams.logprobs``): (its log-probability, ((likely id, its log-probability), ...))
    logprobs: list[tuple[float, tuple[tuple[int, float], ...]]] | None = None


@dataclass
class Generation:
    token_ids: list[int]
    text: str
    finish_reason: str
    stats: Stats
    seed: int
    logprobs: list[tuple[float, tuple[tuple[int, float], ...]]] | None = None  # per token id, as ``Chunk``'s


class _DraftLink:
    """One request's draft. Speculation is an optimisation, so a failing draft (a dead actor, a lost node)
    never fails the request: the failure is logged and the request goes on with the target alone, whose
    output is the same (greedy) or has the same law (sampling).

    The request never waits for the draft's ``start`` before its first token. Without ``early`` the draft is
    started lazily, by the request's first ``grow`` (its commits then catch it up on every token since the
    prompt). With ``early`` (a first step that runs the target alone) the start is sent at once, from a
    background thread, while the target prefills the prompt, and the first ``grow`` waits for it: a batching
    draft then knows the request before its first ``grow`` and gathers it into the forward of the requests it
    arrives with (see ``batching.Batcher._expect``). Lazily, its ``start`` reached the draft in the same burst as
    their ``grow`` calls, often after their forward had begun, and its first tree took a draft forward of its
    own: through Serve at 8 clients, 22 of 149 draft forwards, ~140 ms each, the target waiting for them.
    A request whose steps all run the target alone then costs the draft a ``start`` and a ``finish``.

    A draft may forget a request it has not seen for ``idle_timeout_s``: the steps the target runs alone (a
    long probe of the target alone, a slow prefill) do not call it. A ``grow`` that finds the request unknown
    starts it again, from every token the request has committed, and grows once more; the request goes on
    speculating (its later trees are drawn from a fresh generator: any trees are exact, the verifier decides)."""

    def __init__(self, draft: Draft | None, request_id: str, opening: tuple, *, early: bool = False,
                 cancelled: threading.Event | None = None) -> None:
        self.draft, self.request_id, self.failures = draft, request_id, 0
        self.cancelled = cancelled or threading.Event()  # set by ``SpeculativeDecoder.cancel``: a failure is then
        # the request freed under its call, not the draft's (no retirement counted, no restart of a forgotten one)
        self.opening, self.started = opening, False  # the draft's start arguments: (prompt, params, seed)
        self.ended = False  # told to finish without waiting (``finish``)
        self.tokens = list(opening[0])  # the request's tokens the draft has been sent (prompt, then commits)
        self.starting: Future | None = None  # the early start, running
        if early and draft is not None:
            self.started = True
            self.starting = _in_thread(self._call, "start", *opening)

    @property
    def alive(self) -> bool:
        return self.draft is not None

    def finish(self) -> None:
        """The draft frees the request (its end, or its retirement). A draft with ``abandon`` (an actor: a finish
        sent, not awaited) is told at once, waiting neither on it nor on an early start still running: a hung
        draft held every ending request's response up to its deadline (a review: the output complete at 0.28 s,
        the response at 2.0 s with step_timeout_s 1). The actor refuses a start that comes after its finish
        (``DraftActor``). An in-process draft finishes in turn, after its start (else the start would make its
        state after the finish)."""
        if not self.started:
            return
        abandon = getattr(self.draft, "abandon", None)
        if abandon is not None:
            self.ended = True  # a late start's failure is no longer this request's
            try:
                abandon(self.request_id)
            except Exception as exc:  # noqa: BLE001 - the output is complete: freeing is best effort
                logger.debug("draft finish failed for request %s: %s", self.request_id, exc)
            return
        try:
            self.call("finish")
        except RequestCancelled:  # its early start ended so: nothing left to free
            pass

    def retire(self) -> None:
        """Stop speculating for this request (not a failure): the draft frees it now, the target goes on alone."""
        if self.draft is not None:
            self.finish()
            self.draft = None

    def call(self, method: str, *args):
        if self.starting is not None:  # a call never overtakes the start (its failure is the draft's, handled)
            self.starting.result()
            self.starting = None
        if self.draft is None:
            return None
        if not self.started:
            self.started = True
            self._call("start", *self.opening)
            if self.draft is None:  # the start failed
                return None
        return self._call(method, *args)

    def _call(self, method: str, *args):
        try:
            return self._attempt(method, *args)
        except Exception as exc:  # noqa: BLE001 - any draft failure degrades to target-only decoding
            if self.ended:  # an early start that failed after the request's end (``finish``)
                logger.debug("draft %s of ended request %s failed: %s", method, self.request_id, exc)
                return None
            if self.cancelled.is_set():  # freed under this call: the caller has gone
                logger.debug("draft %s of cancelled request %s ended: %s", method, self.request_id, exc)
                self.draft = None
                if method == "finish":
                    return None
                raise RequestCancelled(self.request_id) from None
            logger.warning("draft %s failed for request %s (%s: %s); continuing with the target alone",
                           method, self.request_id, type(exc).__name__, exc)
            draft, self.draft, self.failures = self.draft, None, self.failures + 1
            if method != "finish":  # the draft may still hold the request (a grow that failed after its start)
                self._release(draft)
            return None

    def _attempt(self, method: str, *args):
        try:
            out = getattr(self.draft, method)(self.request_id, *args)
        except UnknownRequest:
            if method != "grow" or self.cancelled.is_set():  # (cancelled: freed on purpose, not forgotten)
                raise
            commits = args[1] if len(args) > 1 else ()  # the grow's verdicts: all the tokens since the last grow
            logger.info("the draft forgot request %s (idle); starting it again from its %d tokens",
                        self.request_id, len(self.tokens) + sum(len(tokens) for _, tokens, _ in commits))
            self.draft.start(self.request_id, self._with(commits), *self.opening[1:])
            out = getattr(self.draft, method)(self.request_id, *args)  # its commits are already in the start
        if method == "grow":
            self.tokens = self._with(args[1] if len(args) > 1 else ())
        return out

    def _with(self, commits) -> list[int]:
        """The request's tokens once ``commits`` ((path, tokens, at) verdicts) are applied."""
        tokens = list(self.tokens)
        for _, new, at in commits:
            if at == len(tokens):  # else applied already (a grow sent again)
                tokens += new
        return tokens

    def _release(self, draft: Draft) -> None:
        try:
            getattr(draft, "abandon", draft.finish)(self.request_id)
        except Exception as exc:  # noqa: BLE001 - best effort: the draft has already failed this request
            logger.debug("draft finish after a failure failed for request %s: %s", self.request_id, exc)


def _in_thread(fn, *args) -> Future:
    """``fn(*args)`` in a thread of its own (an early start, ``_DraftLink``): a pool of a few threads queued the
    starts of new requests behind those of a draft that had stopped answering, each up to its deadline."""
    future: Future = Future()

    def run() -> None:
        future.set_running_or_notify_cancel()
        try:
            future.set_result(fn(*args))
        except BaseException as exc:  # noqa: BLE001 - handed to whoever waits on the future
            future.set_exception(exc)

    threading.Thread(target=run, name="draft-start", daemon=True).start()
    return future


class PromptError(ValueError):
    """A prompt the engine cannot decode; ``param`` / ``code`` name the request field for an API error."""

    param, code = "prompt", "invalid_prompt"


class ContextLengthError(PromptError):
    """A prompt (plus max_tokens) that does not fit the model's context window."""

    param, code = "max_tokens", "context_length_exceeded"


class SpeculativeDecoder:
    """``plan``: the tree every step grows, or a function giving each step's tree (a server picks the plan of
    the current batch size at every step; trees are regrown every step, so they may change size).
    ``on_verdict(plan, verdict, params)``: called after every step with the tree verified and its verdict
    (e.g. to learn the acceptance vector from live traffic); its failures are logged, never the request's.
    ``policy(params)``: a ``StepPolicy`` per request, which may change each step's tree (a failing policy is
    logged and the step keeps the plan). ``dynamic(plan)``: the ``DynamicTrees`` rule the draft grows each step's
    tree by (e.g. ``DynamicRules.for_planned``), None for the plan's tree as it is; an extension never takes a
    tree deeper than the tokens the request has left (a failing ``dynamic`` is logged, the step grows the plan).
    ``first_step_alone``: a request's first step (its prompt's prefill) runs the target alone, so its first token
    waits for neither the draft's prefill nor a tree; the draft is started beside it (in the background, see
    ``_DraftLink``) and catches up at the second step.
    The first token comes sooner and the request takes one step more.

    With ``dynamic``, one tree step in ``unpruned_every`` of a request (its first, then every that many) grows
    its plan's tree as it is, and only those steps' verdicts carry their ``ranks`` to ``on_verdict`` and the
    policy: a pruned or extended tree tries only the nodes the draft was sure of, so its verdicts would bias an
    acceptance estimate upward (the same prompts and n = 8, d = 4 plan at B = 1: p[1], p[2] 0.805, 0.194 from
    dynamic trees against 0.775, 0.103 from static ones, session 38; live plans re-planned on such estimates
    chose chains of 4 at batch 8, which measured 0.90x the target alone where the profiled n = 2 tree gave 1.0x).
    ``unpruned_every`` 0: every tree step gets its rule (and no dynamic step's ranks are told). Without ``dynamic``
    every step is its plan's tree and every verdict carries its ranks."""

    def __init__(self, target: Target, draft: Draft | None, plan: TreePlan | Callable[[], TreePlan], *,
                 tokenizer=None, eos_ids: tuple[int, ...] = (), max_context: int | None = None,
                 on_verdict: Callable[[TreePlan, Verdict, SamplingParams], None] | None = None,
                 policy: Callable[[SamplingParams], StepPolicy] | None = None,
                 dynamic: Callable[[TreePlan], DynamicTrees | None] | None = None,
                 first_step_alone: bool = False, unpruned_every: int = 4, vocab_size: int | None = None) -> None:
        if unpruned_every < 0:
            raise ValueError(f"unpruned_every {unpruned_every} must be >= 0 (1: every step grows its plan's tree; "
                             "0: none does, and no dynamic step tells its ranks)")
        self.target, self.draft, self.first_step_alone = target, draft, first_step_alone
        self.unpruned_every = unpruned_every
        self.plan_for_step = plan if callable(plan) else (lambda: plan)
        self.tokenizer, self.eos_ids, self.max_context = tokenizer, frozenset(eos_ids), max_context
        self.on_verdict, self.policy, self.dynamic = on_verdict, policy, dynamic
        self.cancels: dict[str, threading.Event] = {}  # request id -> set by ``cancel``, for its streams running
        self.vocab_size = vocab_size  # the target's ids (a prompt's are checked against it), None: not checked

    def cancel(self, request_id: str) -> bool:
        """Stop a running request whose caller has gone, from another thread, while a step of it may be in
        flight: it is freed on both workers now, so a long prefill in progress ends at its next chunk (else
        every chunk ran for nobody before the stream could close) and its step raises ``RequestCancelled``.
        Best effort: the stream's own finish still runs when it closes. Only a worker that takes calls from any
        thread (``calls_from_any_thread``: a batcher's queue, an actor) is told now; another (a bare worker, not
        thread-safe) stops the request at its next step. False: no such request running."""
        event = self.cancels.get(request_id)
        if event is None:
            return False
        event.set()
        # the draft first: its abandon does not wait, while the target's finish may wait for the forward in
        # flight (up to a step's deadline on a hung rank) — a draft prefill ran 40 chunks behind a 2 s finish
        for worker, verb in ((self.draft, "abandon"), (self.target, "finish")):
            if not getattr(worker, "calls_from_any_thread", False):
                continue
            try:
                (getattr(worker, verb, None) or worker.finish)(request_id)  # abandon: a finish not awaited
            except Exception as exc:  # noqa: BLE001 - best effort: the stream's finish frees it too
                logger.debug("%s of cancelled request %s failed: %s", verb, request_id, exc)
        return True

    @property
    def draft_context(self) -> int | None:
        """The positions the draft model reads (its ``max_context``), None for no limit or no draft."""
        value = getattr(self.draft, "max_context", None)
        if value is not None and not isinstance(value, int):  # e.g. a proxy answering every attribute with a call
            raise TypeError(f"the draft's max_context is {value!r}: give it an int (positions) or None (no limit)")
        return value

    @property
    def plan(self) -> TreePlan:
        """The tree the next step would grow."""
        return self.plan_for_step()

    def generate(self, prompt: list[int], params: SamplingParams, request_id: str | None = None) -> Generation:
        params = with_seed(params)
        ids, text, logprobs = [], [], None if params.logprobs is None else []
        for chunk in self.stream(prompt, params, request_id):
            ids += chunk.token_ids
            text.append(chunk.text)
            if logprobs is not None:
                logprobs += chunk.logprobs
        return Generation(ids, "".join(text), chunk.finish_reason, chunk.stats, params.seed, logprobs)

    def stream(self, prompt: list[int], params: SamplingParams, request_id: str | None = None) -> Iterator[Chunk]:
        params = with_seed(params)
        self._check_prompt(prompt, params)
        rid = request_id or uuid.uuid4().hex
        seed = params.seed
        policy, draft = _Policy(self.policy, params), None
        cancelled = self.cancels[rid] = threading.Event()
        try:
            # inside the try: a start that failed after it ran (a timeout) leaves state the finish below frees
            self.target.start(rid, prompt, params, _salt(seed, "verify"))
            fits = draft_levels(self.draft_context, len(prompt)) > 1  # else the draft could read none of its trees
            draft = _DraftLink(self.draft if fits else None, rid, (prompt, params, _salt(seed, "draft")),
                               early=self.first_step_alone, cancelled=cancelled)
            yield from self._loop(rid, params, prompt, draft, policy)
        finally:
            policy.finish()
            try:
                self.target.finish(rid)
            except Exception as exc:  # noqa: BLE001 - the request is over: its output sent, or its error raising
                (logger.debug if cancelled.is_set() else logger.warning)(  # (cancelled: freed already)
                    "target finish failed for request %s (%s: %s); its state is freed when the target reaps it or "
                    "is replaced", rid, type(exc).__name__, exc)
            finally:
                self.cancels.pop(rid, None)
                if draft is not None:
                    draft.finish()  # even when the target has failed (if it was started)

    def _loop(self, rid: str, params: SamplingParams, prompt: list[int], draft: _DraftLink,
              policy: _Policy) -> Iterator[Chunk]:
        last_token, length = prompt[-1], len(prompt)
        commits: list[tuple[list[int], list[int], int]] = []  # verdicts the draft has not been sent yet
        stats = Stats()
        stop = StopChecker(self.tokenizer, params.stop, self.eos_ids if not params.ignore_eos else frozenset(),
                           prefix=tuple(prompt))
        rules = _Rules(self.dynamic, self.unpruned_every)
        start = last = time.perf_counter()
        while True:
            if draft.cancelled.is_set():
                raise RequestCancelled(rid)
            served = self.plan_for_step()
            planned = policy.plan(served)
            stats.plan_nodes, stats.plan_levels = planned.n, planned.num_levels  # the latest step's plan
            left = params.max_tokens - stats.tokens
            room = draft_levels(self.draft_context, length)
            if room <= 1 and draft.alive:
                draft.retire()  # the request has outgrown the draft's context: it goes on with the target alone
            levels = min(left, room)
            speculate = draft.alive and (stats.steps > 0 or not self.first_step_alone)
            plan = first_levels(planned, levels) if speculate else ROOT_ONLY
            rule = rules.of(plan, levels)
            verdict, plan = self._step(rid, plan, stats, last_token, draft, commits, rule)
            commits.append((verdict.path, verdict.tokens, length))
            length += len(verdict.tokens)
            stats.draft_failures = draft.failures
            last_token = verdict.tokens[-1]
            stats.steps += 1
            stats.tree_nodes += verdict.nodes or plan.n
            stats.accepted_hist[len(verdict.path) - 1] += 1
            if (verdict.nodes or plan.n) > 1:  # a tree verified: not one a dynamic rule pruned to its root
                stats.root_rank_hist[_root_rank(plan, verdict)] += 1
            seen = verdict if rule is None else replace(verdict, ranks=())  # a dynamic tree's ranks are biased
            self._observe(plan, seen if planned is served else _rank_one(seen), params)
            now = time.perf_counter()
            policy.observe(plan, seen, now - last)
            last = now
            ids, text, reason = stop.feed(verdict.tokens, params.max_tokens)
            logprobs = None if params.logprobs is None else list(verdict.logprobs[: len(ids)])  # ids: a prefix
            stats.tokens = stop.count
            stats.total_s = time.perf_counter() - start
            if reason is not None:
                yield Chunk(ids, text, reason, stats, logprobs)
                return
            if ids or text:
                yield Chunk(ids, text, logprobs=logprobs)

    def _step(self, rid: str, plan: TreePlan, stats: Stats, last_token: int, draft: _DraftLink,
              commits: list, rule: DynamicTrees | None = None) -> tuple[Verdict, TreePlan]:
        t0 = time.perf_counter()
        grow = (plan, list(commits)) + ((rule,) if rule is not None else ())
        tree = draft.call("grow", *grow) if plan.n > 1 else None
        if tree is not None:
            commits.clear()  # the draft has applied them
        if tree is None:  # no draft, a root-only plan, or the draft just failed: the target alone
            # A host tensor, like every tree that crosses to the target: the target places it on arrival.
            plan, tree = ROOT_ONLY, DraftTree(torch.tensor([last_token], device="cpu"), {})
        t1 = time.perf_counter()
        try:
            verdict = self.target.verify(rid, plan, tree)
        except Exception:
            if draft.cancelled.is_set():  # freed under the verify: the caller has gone
                raise RequestCancelled(rid) from None
            raise
        t2 = time.perf_counter()
        stats.draft_s += t1 - t0
        stats.verify_s += t2 - t1
        return verdict, plan

    def _observe(self, plan: TreePlan, verdict: Verdict, params: SamplingParams) -> None:
        if self.on_verdict is None:
            return
        try:
            self.on_verdict(plan, verdict, params)
        except Exception as exc:  # noqa: BLE001 - an observer (statistics) must never fail a request
            logger.warning("on_verdict observer failed (%s: %s); the request goes on", type(exc).__name__, exc)

    def _check_prompt(self, prompt: list[int], params: SamplingParams) -> None:
        """A prompt the models can read, refused here with what to change: in process (``LocalPair``) a text prompt
        failed in the tokenizer, an id outside the vocabulary in torch's embedding (``IndexError``) or as a draft
        failure."""
        if isinstance(prompt, (str, bytes)) or not all(
                isinstance(t, numbers.Integral) and not isinstance(t, bool) for t in prompt):
            raise PromptError("the prompt must be a list of token ids (ints): encode text with the model's tokenizer "
                              "first (LocalPair.target.tokenizer)")
        if not prompt:
            raise PromptError("the prompt is empty (or encodes to no tokens); give at least one token")
        if self.vocab_size is not None and (bad := [t for t in prompt if not 0 <= t < self.vocab_size]):
            raise PromptError(f"prompt token ids must be in [0, {self.vocab_size}), the target's vocabulary; got "
                              f"{bad[:5]}")
        if self.max_context is not None and len(prompt) + params.max_tokens > self.max_context:
            raise ContextLengthError(
                f"prompt of {len(prompt)} tokens + max_tokens {params.max_tokens} exceeds the model's context of "
                f"{self.max_context} tokens; shorten the prompt or lower max_tokens"
            )



def _rank_one(verdict: Verdict) -> Verdict:
    """``verdict`` as the live estimate may read it when a request's own policy chose its tree
    (``request_trees``): each visited inner node a trial of rank 1 alone, as if it had one child. The policy
    widens a prose request's nodes and narrows a code request's by the request's own acceptance, so ranks 2 and
    up were tried mostly on prose: a review's 50/50 code/prose simulation read p̂[2] 0.139 against 0.072 on the
    served tree, p̂ summing above 1, and the plans made from it lost ~5-7% (model figures). Rank 1 is tried at
    every visited inner node whatever its width: a fair trial from any tree."""
    return replace(verdict, ranks=tuple((1, int(rank == 1)) for _, rank in verdict.ranks))


class _Policy:
    """A request's ``StepPolicy`` (or none), guarded: a policy failure is logged once and the policy dropped
    (the request goes on with the plan), never the request's failure."""

    def __init__(self, factory: Callable[[SamplingParams], StepPolicy] | None, params: SamplingParams) -> None:
        self.policy = self._guard(lambda: factory(params)) if factory is not None else None

    def plan(self, base: TreePlan) -> TreePlan:
        if self.policy is None:
            return base
        chosen = self._guard(lambda: self.policy.plan(base))
        return base if chosen is None else chosen

    def observe(self, plan: TreePlan, verdict: Verdict, seconds: float) -> None:
        if self.policy is not None:
            self._guard(lambda: self.policy.observe(plan, verdict, seconds))

    def finish(self) -> None:
        finish = getattr(self.policy, "finish", None)
        if finish is not None:
            self._guard(finish)

    def _guard(self, call):
        try:
            return call()
        except Exception as exc:  # noqa: BLE001 - choosing trees is an optimisation, never a request failure
            logger.warning("step policy failed (%s: %s); the request goes on with the plan", type(exc).__name__, exc)
            self.policy = None
            return None


class _Rules:
    """A request's dynamic-tree rules (``SpeculativeDecoder(dynamic=...)``), guarded like ``_Policy``: a failing
    rule is logged once and dropped for the request (its steps grow their plans), never its failure."""

    def __init__(self, dynamic: Callable[[TreePlan], DynamicTrees | None] | None, unpruned_every: int) -> None:
        self.dynamic, self.unpruned_every = dynamic, unpruned_every
        self.trees = 0  # tree steps so far

    def of(self, plan: TreePlan, left: int) -> DynamicTrees | None:
        """The step's rule, its extension capped so the tree's deepest path (plus the bonus token) fits the
        ``left`` tokens; None: the plan's tree (every ``unpruned_every``-th tree step, the first included)."""
        if self.dynamic is None or plan.n <= 1:
            return None
        self.trees += 1
        if self.unpruned_every and (self.trees - 1) % self.unpruned_every == 0:
            return None
        try:
            rule = self.dynamic(plan)
        except Exception as exc:  # noqa: BLE001 - pruning is an optimisation, never a request failure
            logger.warning("dynamic rule failed (%s: %s); the request's steps grow their plans",
                           type(exc).__name__, exc)
            self.dynamic = None
            return None
        if rule is not None and rule.extend > left - plan.num_levels:
            rule = replace(rule, extend=max(0, left - plan.num_levels))
        return rule


def _root_rank(plan: TreePlan, verdict: Verdict) -> int:
    """The accepted root child's rank (0 = none) as the verifier saw the tree (it may not be ``plan``); a
    verdict without ranks (an older target) falls back to ``plan``'s ranks."""
    if verdict.ranks:
        return verdict.ranks[0][1]
    return plan.rank[verdict.path[1]] if len(verdict.path) > 1 else 0


def draft_levels(draft_context: int | None, length: int) -> int:
    """The tree levels (root included) a draft reading ``draft_context`` positions can grow for a request of
    ``length`` tokens: every node's position (the root's is ``length - 1``) stays below ``draft_context``. A
    draft past its context would read positions it was never trained on (rotary embeddings: trees it guesses
    badly) or none at all (a learnt position table: an index error); the request goes on with the target alone,
    as vLLM skips speculation for sequences longer than its draft's ``max_model_len``. A huge number: no limit."""
    return 1 << 30 if draft_context is None else draft_context - length + 1


def with_seed(params: SamplingParams) -> SamplingParams:
    """``params`` with a concrete seed (a fresh random one when none was given), so runs can be replayed. The
    first thing ``generate`` and ``stream`` do with their params: refused here unless ``SamplingParams`` (a dict
    failed as AttributeError 'seed')."""
    if not isinstance(params, SamplingParams):
        raise TypeError(f"params must be a SamplingParams, not {type(params).__name__}: e.g. "
                        "SamplingParams(max_tokens=32, temperature=0)")
    if params.seed is not None:
        return params
    return params.model_copy(update={"seed": int.from_bytes(os.urandom(7), "little")})


def _salt(seed: int, stream: str) -> int:
    """Independent generator seeds for the draft and verify streams of one request."""
    digest = hashlib.blake2b(f"{seed}:{stream}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)
