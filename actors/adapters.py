"""The core's Draft / Target protocols over actor handles: a ``SpeculativeDecoder`` built on these drives
a ``DraftActor`` and a ``TargetGroup``'s ranks exactly as it drives in-process workers. What crosses is
host tensors (the draft actor returns them; the target places them on its device on arrival). A step is
two calls: ``grow`` (with the previous verdicts folded in) and ``verify``; the tree goes from the draft
actor to rank 0 by object reference, never through the caller."""

from __future__ import annotations

import ray
from ray.exceptions import GetTimeoutError, RayError

from actors.spec import STEP_TIMEOUT_S

from sequoia_ray.config import SamplingParams
from sequoia_ray.draft import DraftTree, DynamicTrees
from sequoia_ray.tree.plan import TreePlan
from sequoia_ray.verify import Verdict


class TargetUnavailable(RuntimeError):
    """The target group failed or timed out on a call (a rank died or hung): the request cannot go on;
    the client may retry once the group has been replaced (HTTP 503)."""


class ActorDraft:
    """The Draft protocol over one DraftActor handle; a call slower than ``timeout_s`` fails (and the
    engine goes on without the draft)."""

    def __init__(self, actor, timeout_s: float = STEP_TIMEOUT_S) -> None:
        self.actor, self.timeout_s = actor, timeout_s

    def _call(self, method: str, request_id: str, *args):
        try:
            return ray.get(self.actor.call.remote(method, request_id, *args), timeout=self.timeout_s)
        except GetTimeoutError:
            self.actor.call.remote("finish", request_id)  # queued behind the stuck call; not awaited
            raise

    def start(self, request_id: str, prompt: list[int], params: SamplingParams, seed: int) -> None:
        self._call("start", request_id, prompt, params, seed)

    def grow(self, request_id: str, plan: TreePlan, commits=(), rule: DynamicTrees | None = None) -> ray.ObjectRef:
        """The tree as a reference: the target's rank 0 fetches it from the draft actor directly."""
        done, tree = self.actor.grow.remote(request_id, plan, commits, rule)
        try:
            ray.get(done, timeout=self.timeout_s)  # raises the draft's failure; the tree itself stays remote
        except GetTimeoutError:
            self.actor.call.remote("finish", request_id)  # queued behind the stuck call; not awaited
            raise
        return tree

    def commit(self, request_id: str, path: list[int], new_tokens: list[int], at: int | None = None) -> None:
        self._call("commit", request_id, path, new_tokens, at)

    def finish(self, request_id: str) -> None:
        self._call("finish", request_id)

    def abandon(self, request_id: str) -> None:
        """A finish not awaited: after a failed call the engine frees the request here without waiting on an
        actor that may be stuck (the finish runs when it gets to it)."""
        self.actor.call.remote("finish", request_id)


class RanksTarget:
    """The Target protocol over a tensor-parallel group: every call goes to rank 0, which forwards it to
    the other ranks (one sender keeps the ranks' collectives in one order) and checks they agree. Any
    failure — a dead or broken rank, no answer within ``timeout_s``, ranks that disagree — raises
    ``TargetUnavailable``; the request is then over (its state goes with the group, which is replaced)."""

    def __init__(self, ranks: list, timeout_s: float = STEP_TIMEOUT_S) -> None:
        self.ranks, self.timeout_s = ranks, timeout_s
        self.failed = False

    def _call(self, method: str, *args):
        try:
            return ray.get(self.ranks[0].call.remote(method, *args), timeout=self.timeout_s)
        except (RayError, GetTimeoutError) as exc:
            self.failed = True
            first_line = str(exc).splitlines()[0] if str(exc) else ""
            raise TargetUnavailable(f"the target group failed during {method}: {type(exc).__name__}: "
                                    f"{first_line}") from exc

    def start(self, request_id: str, prompt: list[int], params: SamplingParams, seed: int) -> None:
        self._call("start", request_id, prompt, params, seed)

    def verify(self, request_id: str, plan: TreePlan, draft: DraftTree | ray.ObjectRef) -> Verdict:
        return self._call("verify", request_id, plan, draft)  # Ray resolves a reference at rank 0

    def finish(self, request_id: str) -> None:
        if self.failed:  # do not wait on a failed group: tell it without awaiting the answer
            self.ranks[0].call.remote("finish", request_id)
            return
        self._call("finish", request_id)
