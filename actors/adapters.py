"""The core's Draft / Target protocols over actor handles: a ``SpeculativeDecoder`` built on these drives
a ``DraftActor`` and a ``TargetGroup``'s ranks exactly as it drives in-process workers. What crosses is
host tensors (the draft actor returns them; the target places them on its device on arrival). A step is
two calls: ``grow`` (with the previous verdicts folded in) and ``verify``; the tree goes from the draft
actor to rank 0 by object reference, never through the caller."""

from __future__ import annotations

import math

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayError

from actors.spec import STEP_TIMEOUT_S

from sequoia_ray.config import SamplingParams
from sequoia_ray.draft import DraftTree, DynamicTrees
from sequoia_ray.request_errors import UnknownRequest
from sequoia_ray.tree.plan import TreePlan
from sequoia_ray.verify import Verdict


PREFILL_TOKENS_PER_TIMEOUT = 256  # without chunking: a prompt's deadline grows one timeout per this many tokens


def prefill_timeout(timeout_s: float, tokens: int, chunk: int | None) -> float:
    """The deadline of a call that prefills ``tokens`` prompt tokens. A batching actor prefills ``chunk`` of them
    per forward and answers only after the last, so ``timeout_s`` (what one forward may take) is given per chunk:
    a 6,000-token prompt at 256 a chunk, beside other requests, takes longer than one step's 60 s without any
    forward being slow. A hung forward is still caught, later by the same factor, and by the actor's health
    check (one forward longer than ``step_timeout_s``). ``chunk`` None: the whole prompt in one forward."""
    return timeout_s * max(1, math.ceil(tokens / (chunk or PREFILL_TOKENS_PER_TIMEOUT)))


def _answer(ref, timeout_s: float, step_s: float, who: str):
    """``ray.get(ref)`` within ``timeout_s``. A timeout says what was waited for, how long and what to change (Ray's
    own "Get timed out: some object(s) not ready." named neither the deadline nor the setting)."""
    try:
        return ray.get(ref, timeout=timeout_s)
    except GetTimeoutError:
        chunks = f", step_timeout_s {step_s:g} s per prefill chunk" if timeout_s > step_s else ""
        raise GetTimeoutError(f"no answer from the {who} within {timeout_s:g} s{chunks}: the actor is hung or "
                              "overloaded; if it is only slow, raise step_timeout_s (or lower prefill_chunk for long "
                              "prompts)") from None


class PrefillDeadlines:
    """Each started request's deadline for its first step — the call that prefills its prompt, the first grow or
    verify — then ``timeout_s`` for every later call. ``start`` itself forwards nothing (it makes the request's
    state), so it has ``timeout_s``: with the prompt's deadline a hung draft held every new request's first step
    up to ``step_timeout_s`` per chunk (a 6,000-token prompt at 60 s and chunks of 256: 24 minutes)."""

    def __init__(self, timeout_s: float, chunk: int | None) -> None:
        self.timeout_s, self.chunk = timeout_s, chunk
        self.pending: dict[str, float] = {}  # request -> the deadline of its first step

    def start(self, request_id: str, prompt: list[int]) -> float:
        """Keeps the prompt's deadline for the request's first step; the start's own (one step)."""
        self.pending[request_id] = prefill_timeout(self.timeout_s, len(prompt), self.chunk)
        return self.timeout_s

    def step(self, request_id: str) -> float:
        return self.pending.pop(request_id, self.timeout_s)

    def catch_up(self, tokens: int) -> float:
        """The deadline of a call that forwards ``tokens`` the actor has not seen, beyond the tree."""
        return prefill_timeout(self.timeout_s, tokens, self.chunk)

    def forget(self, request_id: str) -> None:
        self.pending.pop(request_id, None)


class TargetUnavailable(RuntimeError):
    """The target group failed or timed out on a call (a rank died or hung): the request cannot go on;
    the client may retry once the group has been replaced (HTTP 503)."""


class RequestForgotten(RuntimeError):
    """The target group no longer holds the request — freed after ``request_idle_timeout_s`` without a call (its
    client did not read its stream that long, or the draft's prefill of its prompt took that long) — though the
    group itself is fine: the request cannot go on (it was a 503 saying the group had failed)."""


class ActorDraft:
    """The Draft protocol over one DraftActor handle; a call slower than its deadline fails (and the engine
    goes on without the draft, after an ``abandon`` that frees the request once the actor gets to it).
    ``max_context``: the positions the actor's model reads (its ``info``), None for no limit."""

    calls_from_any_thread = True  # actor calls (``SpeculativeDecoder.cancel`` may abandon from another thread)

    def __init__(self, actor, timeout_s: float = STEP_TIMEOUT_S, prefill_chunk: int | None = None,
                 max_context: int | None = None) -> None:
        self.actor, self.timeout_s, self.max_context = actor, timeout_s, max_context
        self.deadlines = PrefillDeadlines(timeout_s, prefill_chunk)  # the draft prefills at the first grow

    def _call(self, method: str, request_id: str, *args, timeout_s: float | None = None):
        return _answer(self.actor.call.remote(method, request_id, *args), timeout_s or self.timeout_s, self.timeout_s,
                       f"draft actor to {method}")

    def start(self, request_id: str, prompt: list[int], params: SamplingParams, seed: int) -> None:
        self._call("start", request_id, prompt, params, seed, timeout_s=self.deadlines.start(request_id, prompt))

    def grow(self, request_id: str, plan: TreePlan, commits=(), rule: DynamicTrees | None = None) -> ray.ObjectRef:
        """The tree as a reference: the target's rank 0 fetches it from the draft actor directly."""
        done, tree = self.actor.grow.remote(request_id, plan, commits, rule)
        # the tokens the draft catches up on (steps the target ran alone) are prefilled like a prompt's
        deadline = max(self.deadlines.step(request_id), self.deadlines.catch_up(sum(len(t) for _, t, _ in commits)))
        _answer(done, deadline, self.timeout_s, "draft actor to grow")  # raises the draft's failure; the tree stays
        return tree

    def commit(self, request_id: str, path: list[int], new_tokens: list[int], at: int | None = None) -> None:
        self._call("commit", request_id, path, new_tokens, at)

    def finish(self, request_id: str) -> None:
        self.deadlines.forget(request_id)
        self._call("finish", request_id)

    def abandon(self, request_id: str) -> None:
        """A finish not awaited: after a failed call the engine frees the request here without waiting on an
        actor that may be stuck (the finish queues behind the stuck call and runs when the actor gets to it)."""
        self.deadlines.forget(request_id)
        self.actor.call.remote("finish", request_id)


class RanksTarget:
    """The Target protocol over a tensor-parallel group: every call goes to rank 0, which forwards it to
    the other ranks (one sender keeps the ranks' collectives in one order) and checks they agree. Any
    failure — a dead or broken rank, no answer within ``timeout_s``, ranks that disagree — raises
    ``TargetUnavailable``; the request is then over (its state goes with the group, which is replaced)."""

    calls_from_any_thread = True  # actor calls (``SpeculativeDecoder.cancel`` may finish from another thread)

    def __init__(self, ranks: list, timeout_s: float = STEP_TIMEOUT_S, prefill_chunk: int | None = None) -> None:
        self.ranks, self.timeout_s = ranks, timeout_s
        self.deadlines = PrefillDeadlines(timeout_s, prefill_chunk)  # the target prefills at the first verify
        self.failed = False

    def _call(self, method: str, *args, timeout_s: float | None = None):
        try:
            return _answer(self.ranks[0].call.remote(method, *args), timeout_s or self.timeout_s, self.timeout_s,
                           f"target group to {method}")
        except (RayError, GetTimeoutError) as exc:
            cause = getattr(exc, "cause", None) or exc  # a RayTaskError's first line is Ray's task header
            if isinstance(cause, UnknownRequest) and method != "start":
                raise RequestForgotten(f"the target no longer holds the request during {method}: {cause}") from exc
            self.failed = True
            # a dead rank's message says why on its later lines (its node, pid, the worker's exit type: out of
            # memory, a lost node); a task error's first line is the error itself
            said = " ".join(str(cause).split()) if isinstance(exc, RayActorError) else str(cause).split("\n")[0]
            raise TargetUnavailable(f"the target group failed during {method}: {type(cause).__name__}: "
                                    f"{said[:600]}") from exc

    def start(self, request_id: str, prompt: list[int], params: SamplingParams, seed: int) -> None:
        self._call("start", request_id, prompt, params, seed, timeout_s=self.deadlines.start(request_id, prompt))

    def verify(self, request_id: str, plan: TreePlan, draft: DraftTree | ray.ObjectRef) -> Verdict:
        deadline = self.deadlines.step(request_id)
        return self._call("verify", request_id, plan, draft, timeout_s=deadline)  # Ray resolves a reference at rank 0

    def finish(self, request_id: str) -> None:
        self.deadlines.forget(request_id)
        if self.failed:  # do not wait on a failed group: tell it without awaiting the answer
            self.ranks[0].call.remote("finish", request_id)
            return
        try:
            self._call("finish", request_id)
        except RequestForgotten:  # freed there already: nothing to finish
            pass
