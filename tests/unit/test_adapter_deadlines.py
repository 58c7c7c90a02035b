"""The actor adapters' deadlines: a call that prefills a prompt is given ``step_timeout_s`` per prefill chunk (a
batching actor answers it only after the last chunk's forward); every other call one ``step_timeout_s``. No Ray:
the handles are stand-ins and ``ray.get`` is recorded."""

from __future__ import annotations

import pytest

import actors.adapters as adapters
from actors.adapters import ActorDraft, RanksTarget, prefill_timeout
from sequoia_ray.config import SamplingParams
from sequoia_ray.tree.plan import chain


class Method:
    def __init__(self, name: str, sent: list, returns=None) -> None:
        self.name, self.sent, self.returns = name, sent, returns

    def remote(self, *args):
        self.sent.append((self.name, args[0] if self.name == "call" else "grow"))
        return self.returns(args) if self.returns else ("ref", self.name, args[0])


class Handle:
    def __init__(self) -> None:
        self.sent: list = []
        self.call = Method("call", self.sent)
        self.grow = Method("grow", self.sent, returns=lambda args: (("ref", "grow"), ("ref", "tree")))


@pytest.fixture
def waited(monkeypatch):
    """The timeout of every ``ray.get`` the adapters make, in order."""
    timeouts: list[float] = []
    monkeypatch.setattr(adapters.ray, "get", lambda ref, timeout=None: timeouts.append(timeout))
    return timeouts


def test_prefill_timeout_is_one_step_per_chunk():
    assert prefill_timeout(60.0, 10, 256) == 60.0  # a short prompt: one step's deadline
    assert prefill_timeout(60.0, 6000, 256) == 60.0 * 24  # ceil(6000 / 256) chunks
    assert prefill_timeout(60.0, 0, 256) == 60.0
    assert prefill_timeout(2.0, 600, None) == 2.0 * 3  # unchunked: one deadline per 256 tokens


def test_the_targets_first_verify_has_the_prompts_deadline_and_the_next_one_steps(waited):
    target = RanksTarget([Handle()], timeout_s=60.0, prefill_chunk=256)
    params = SamplingParams(max_tokens=8)
    target.start("r", list(range(6000)), params, 0)
    target.verify("r", chain(0), None)  # the prompt's prefill, 24 chunks
    target.verify("r", chain(0), None)
    target.finish("r")
    assert waited == [60.0 * 24, 60.0 * 24, 60.0, 60.0]
    target.start("s", [1, 2, 3], params, 0)
    target.finish("s")  # a request that ends before its first verify leaves nothing behind
    assert target.deadlines.pending == {}


def test_the_drafts_first_grow_has_the_prompts_deadline(waited):
    handle = Handle()
    draft = ActorDraft(handle, timeout_s=10.0, prefill_chunk=100)
    draft.start("r", list(range(1000)), SamplingParams(max_tokens=8), 0)
    assert draft.grow("r", chain(2)) == ("ref", "tree")
    draft.grow("r", chain(2))
    draft.finish("r")
    assert waited == [100.0, 100.0, 10.0, 10.0]
    draft.start("s", list(range(1000)), SamplingParams(max_tokens=8), 0)
    draft.abandon("s")  # after a failure: not awaited, and the deadline is dropped
    assert draft.deadlines.pending == {} and handle.sent[-1] == ("call", "finish")


def test_a_grow_that_catches_up_on_many_tokens_has_their_prefills_deadline(waited):
    """Steps the target ran alone leave the draft tokens to forward before its tree (in chunks, like a prompt)."""
    draft = ActorDraft(Handle(), timeout_s=10.0, prefill_chunk=100)
    draft.start("r", [1, 2], SamplingParams(max_tokens=8), 0)
    draft.grow("r", chain(2), [([0], list(range(250)), 2), ([0], list(range(100)), 252)])  # 350 tokens: 4 chunks
    draft.grow("r", chain(2), [([0, 1], [5, 6], 352)])
    assert waited == [10.0, 40.0, 10.0]


def test_a_grow_that_times_out_frees_the_request_with_one_finish(monkeypatch):
    """The engine goes on without the draft and sends it one finish, not awaited (the adapter used to send its
    own on a timeout, and the engine a second)."""
    from ray.exceptions import GetTimeoutError

    from sequoia_ray.engine import _DraftLink

    def get(ref, timeout=None):
        if ref == ("ref", "grow"):
            raise GetTimeoutError("no answer")

    monkeypatch.setattr(adapters.ray, "get", get)
    handle = Handle()
    link = _DraftLink(ActorDraft(handle, timeout_s=10.0), "r", ([1, 2, 3], SamplingParams(max_tokens=8), 0))
    assert link.call("grow", chain(2)) is None and not link.alive
    assert handle.sent == [("call", "start"), ("grow", "grow"), ("call", "finish")]


def test_a_target_failure_names_its_cause_not_rays_task_header(monkeypatch):
    """A RayTaskError's first line is Ray's header ('ray::...call() (pid=..., ip=...)'): the error logged for the
    failed request said nothing of what failed."""
    import traceback

    from ray.exceptions import RayTaskError

    from actors.adapters import TargetUnavailable
    from sequoia_ray.request_errors import UnknownRequest

    try:
        raise UnknownRequest("request 'r' is not active here")
    except UnknownRequest as exc:
        wrapped = RayTaskError("call", traceback.format_exc(), exc, proctitle="ray::TargetRank.call()", pid=7,
                               ip="10.0.0.2").as_instanceof_cause()

    def fail(ref, timeout=None):
        raise wrapped

    monkeypatch.setattr(adapters.ray, "get", fail)
    target = RanksTarget([Handle()])
    with pytest.raises(TargetUnavailable, match="during verify: UnknownRequest: .?request 'r' is not active here"):
        target.verify("r", chain(0), None)


def test_a_rank_without_followers_gathers_nothing_and_starts_no_ray(monkeypatch):
    """TP 1 in process: _gather([]) called ray.get([]), which starts a local Ray outside a Ray worker."""
    from actors.target import TargetRank

    monkeypatch.setattr("actors.target.ray.get", lambda *a, **k: pytest.fail("ray.get with no followers"))
    assert TargetRank._gather(object.__new__(TargetRank), []) == []
