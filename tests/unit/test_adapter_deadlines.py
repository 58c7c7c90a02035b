"""The actor adapters' deadlines: a call that prefills a prompt (the first grow or verify) is given ``step_timeout_s``
per prefill chunk (a batching actor answers it only after the last chunk's forward); every other call, the start
that makes the request's state included, one ``step_timeout_s``. No Ray:
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
    assert waited == [60.0, 60.0 * 24, 60.0, 60.0]  # the start forwards nothing: one step (was the prompt's)
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
    assert waited == [10.0, 100.0, 10.0, 10.0]
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


def _raised_on_a_rank(exc: Exception):
    """``exc`` as ``ray.get`` raises a rank's failure: a RayTaskError that is also an instance of its cause."""
    import traceback

    from ray.exceptions import RayTaskError

    try:
        raise exc
    except Exception as raised:  # noqa: BLE001 - wrapped as Ray wraps it
        return RayTaskError("call", traceback.format_exc(), raised, proctitle="ray::TargetRank.call()", pid=7,
                            ip="10.0.0.2").as_instanceof_cause()


def _failing(monkeypatch, exc: Exception) -> None:
    def fail(ref, timeout=None):
        raise exc

    monkeypatch.setattr(adapters.ray, "get", fail)


def test_a_target_failure_names_its_cause_not_rays_task_header(monkeypatch):
    """A RayTaskError's first line is Ray's header ('ray::...call() (pid=..., ip=...)'): the error logged for the
    failed request said nothing of what failed."""
    from actors.adapters import TargetUnavailable

    _failing(monkeypatch, _raised_on_a_rank(RuntimeError("tensor-parallel ranks disagree on a batched verify")))
    target = RanksTarget([Handle()])
    with pytest.raises(TargetUnavailable, match="during verify: RuntimeError: tensor-parallel ranks disagree"):
        target.verify("r", chain(0), None)
    assert target.failed


def test_a_dead_ranks_error_keeps_why_it_died(monkeypatch):
    """An ActorDiedError's first line is Ray's generic sentence; the rank, its node and why its worker exited
    (out of memory, a lost node) come after it, and were dropped from the error logged."""
    from ray.core.generated.common_pb2 import ActorDiedErrorContext
    from ray.exceptions import ActorDiedError

    from actors.adapters import TargetUnavailable

    died = ActorDiedError(ActorDiedErrorContext(
        class_name="TargetRank", actor_id=b"\x01" * 16, pid=4242, node_ip_address="10.0.0.7",
        error_message="The actor is dead because its worker process has died. Worker exit type: NODE_OUT_OF_MEMORY"))
    _failing(monkeypatch, died)
    with pytest.raises(TargetUnavailable) as info:
        RanksTarget([Handle()]).verify("r", chain(0), None)
    assert all(part in str(info.value) for part in ("ActorDiedError", "10.0.0.7", "NODE_OUT_OF_MEMORY", "4242"))
    assert "\n" not in str(info.value)


def test_a_request_the_target_freed_as_idle_is_not_a_failed_group(monkeypatch):
    """The target frees a request after request_idle_timeout_s without a call (its client did not read its stream
    that long, or the draft prefilled its prompt that long): its next verify said "the target group failed"
    (a 503 "being restarted", the group marked failed) though every rank was fine. Its finish then has nothing to
    free."""
    from actors.adapters import RequestForgotten
    from sequoia_ray.request_errors import UnknownRequest

    _failing(monkeypatch, _raised_on_a_rank(UnknownRequest("request 'r' is not active here (reaped after idling)")))
    target = RanksTarget([Handle()])
    with pytest.raises(RequestForgotten, match="during verify: .*request 'r' is not active here"):
        target.verify("r", chain(0), None)
    assert not target.failed
    target.finish("r")  # freed there already: no error


def test_a_rank_without_followers_gathers_nothing_and_starts_no_ray(monkeypatch):
    """TP 1 in process: _gather([]) called ray.get([]), which starts a local Ray outside a Ray worker."""
    from actors.target import TargetRank

    monkeypatch.setattr("actors.target.ray.get", lambda *a, **k: pytest.fail("ray.get with no followers"))
    assert TargetRank._gather(object.__new__(TargetRank), []) == []


def test_a_requests_end_waits_on_neither_a_hung_drafts_start_nor_its_finish(monkeypatch):
    """A review: with the draft actor hung, a request whose steps all ran the target alone (``first_step_alone``,
    a root-only plan) had its output complete at 0.28 s and its response at 2.0 s (step_timeout_s 1): its end
    waited on the early start, then on a finish, each up to its deadline. The finish is now sent, not awaited
    (the actor refuses a start that comes after it). Here the deadline is 30 s and the request must end within 10."""
    import threading

    from ray.exceptions import GetTimeoutError

    from sequoia_ray.engine import SpeculativeDecoder
    from sequoia_ray.target import TargetWorker
    from tests.tiny import agreeing_pair

    release = threading.Event()

    def hung(ref, timeout=None):  # a stuck actor: nothing comes back before the deadline
        release.wait(timeout)
        raise GetTimeoutError("Get timed out: some object(s) not ready.")

    monkeypatch.setattr(adapters.ray, "get", hung)
    handle = Handle()
    target_model, _ = agreeing_pair()
    decoder = SpeculativeDecoder(TargetWorker(target_model), ActorDraft(handle, timeout_s=30.0, prefill_chunk=256),
                                 chain(0), first_step_alone=True)
    out, done = {}, threading.Event()

    def run():
        out["result"] = decoder.generate(list(range(3, 40)), SamplingParams(max_tokens=4))
        done.set()

    threading.Thread(target=run, daemon=True).start()
    try:
        assert done.wait(10), "the request's end waited on the hung draft"
    finally:
        release.set()
    assert len(out["result"].token_ids) == 4 and ("call", "finish") in handle.sent


def test_a_timeout_says_how_long_was_waited_and_what_to_change(monkeypatch):
    """Ray's "Get timed out: some object(s) not ready." was all the log and the 503 said (a review: the deadline was
    720 s, and nothing named step_timeout_s or prefill_chunk)."""
    from ray.exceptions import GetTimeoutError

    def timed_out(ref, timeout=None):
        raise GetTimeoutError("Get timed out: some object(s) not ready.")

    monkeypatch.setattr(adapters.ray, "get", timed_out)
    target = RanksTarget([Handle()], timeout_s=60.0, prefill_chunk=256)
    target.deadlines.start("r", list(range(3000)))  # 12 chunks: the first verify's deadline is 720 s
    with pytest.raises(adapters.TargetUnavailable, match=r"during verify: GetTimeoutError: no answer from the target "
                       r"group to verify within 720 s, step_timeout_s 60 s per prefill chunk: .*raise step_timeout_s "
                       r"\(or lower prefill_chunk"):
        target.verify("r", chain(0), None)
    draft = ActorDraft(Handle(), timeout_s=10.0, prefill_chunk=100)
    with pytest.raises(GetTimeoutError, match=r"^no answer from the draft actor to start within 10 s: the actor is "):
        draft.start("s", [1, 2], SamplingParams(max_tokens=8), 0)
    with pytest.raises(GetTimeoutError, match=r"draft actor to grow within 10 s"):
        draft.grow("s", chain(2))
