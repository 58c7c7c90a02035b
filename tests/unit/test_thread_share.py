"""A model actor's forward gets all its threads unless a tree request it does not carry is in flight
(``actors/thread_share.py``), and the actor's batches really run with that count."""

from __future__ import annotations

import contextlib
import functools
from types import SimpleNamespace

import torch

from actors.base import ModelActor, _steps_a_tree
from actors.draft import DraftActor
from actors.reaper import Reaper
from actors.spec import ModelActorSpec
from actors.target import TargetRank, free_port
from actors.thread_share import ThreadShare


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_half_the_threads_while_another_tree_request_is_in_flight():
    clock = _Clock()
    share = ThreadShare(2, window_s=1.0, clock=clock)
    assert share.threads_for({"a"}) == 2  # one client's trees: alone on the machine
    assert share.threads_for({"a"}) == 2
    assert share.threads_for(set()) == 2 - 1  # the target alone here, "a" drafting elsewhere
    clock.now = 0.5
    assert share.threads_for({"b"}) == 1  # "a" was seen 0.5 s ago: the other group, on the other actor
    assert share.threads_for({"a", "b"}) == 2  # both in this forward (lockstep): nobody elsewhere
    clock.now = 2.0
    assert share.threads_for({"b"}) == 2  # "a" not seen for 2 s: finished, or taking the target alone
    assert share.threads_for(set()) == 1  # "b", seen just now, is elsewhere
    clock.now = 3.5
    assert share.threads_for(set()) == 2  # the target alone at any batch: all threads
    assert ThreadShare(1).threads_for({"x"}) == 1 and ThreadShare(3, clock=_Clock()).threads_for(set()) == 3


def test_a_request_seen_stepping_the_target_alone_is_not_elsewhere():
    """Trees end (the service switched to the target alone): the first root-only batch of those requests
    already gets all the threads, not a second later."""
    share = ThreadShare(2, window_s=1.0, clock=_Clock())
    assert share.threads_for({"a"}) == 2 and share.threads_for({"b"}) == 1  # two tree groups
    assert share.threads_for(set(), {"a"}) == 1  # "b" may still be drafting
    assert share.threads_for(set(), {"a", "b"}) == 2  # both step the target alone now


def test_a_finished_request_is_not_elsewhere():
    share = ThreadShare(2, window_s=1.0, clock=_Clock())
    assert share.threads_for({"a", "b"}) == 2
    share.forget("a")  # "a" finished: "b" alone is all the trees there are
    assert share.threads_for({"b"}) == 2
    share.forget("never seen")
    assert share.threads_for(set()) == 1  # "b" is elsewhere


@contextlib.contextmanager
def _actor_counting_threads():
    """(actor, run, counts): a ModelActor with no model (its batch wrapper, finish path and reaper are under
    test), ``run(method, calls)`` running a batch through the wrapper, and each batch's thread count so far.
    The count is restored after."""
    actor = ModelActor.__new__(ModelActor)
    actor.share = ThreadShare(2, clock=_Clock())
    counts = []

    def run_batch(method, calls, caps):
        counts.append(torch.get_num_threads())
        return [None] * len(calls)

    before = torch.get_num_threads()
    try:
        yield actor, functools.partial(actor._run_shared, run_batch), counts
    finally:
        torch.set_num_threads(before)


def test_an_actor_forgets_the_requests_it_finishes_or_frees():
    """After a tree request finishes (its ``finish`` call) or is freed as idle (the reaper), the next forwards
    without it still get all the threads (before session 41, half for a second after every end)."""
    with _actor_counting_threads() as (actor, run, counts):
        actor.reaper = Reaper(3600.0)
        finished = []
        actor.worker = SimpleNamespace(finish=finished.append)
        tree = SimpleNamespace(n=4)
        run("grow", [("a", tree), ("b", tree), ("c", tree)])
        actor._unsafe_run("finish", "a")
        run("grow", [("b", tree), ("c", tree)])
        actor._reap("grow", ["b"], stale=["c"])  # "c" freed as idle (a TP follower is told which)
        run("grow", [("b", tree)])
        assert counts == [2, 2, 2] and finished == ["a", "c"]


def test_only_actors_whose_tree_requests_pipeline_share_their_threads():
    """In lockstep (tree requests waited for, batches of 2+) the draft never grows while the target verifies:
    both actors keep all their threads for every forward. Pipelined (no lockstep, or one request per forward),
    both share them."""
    for spec, shares in [(dict(wait_trees=True, max_batch_requests=8), False),
                         (dict(wait_trees=False, max_batch_requests=8), True),
                         (dict(wait_trees=True, max_batch_requests=1), True)]:
        assert ModelActorSpec("x", **spec).pipelines is shares
        draft = DraftActor(ModelActorSpec("tiny-draft", threads=2, **spec))
        rank = TargetRank(0, 1, "127.0.0.1", free_port(), "gloo", ModelActorSpec("tiny-target", threads=2, **spec))
        rank.lead([])
        try:
            assert (draft.share is not None, rank.share is not None) == (shares, shares), spec
        finally:
            draft.batcher.close()
            rank.batcher.close()


def test_trees_are_grows_and_verifies_of_more_than_the_root():
    assert _steps_a_tree("grow", ("a", SimpleNamespace(n=1)))
    assert _steps_a_tree("verify", ("a", SimpleNamespace(n=8), None))
    assert not _steps_a_tree("verify", ("a", SimpleNamespace(n=1), None))
    assert not _steps_a_tree("start", ("a",))


def test_a_batch_runs_with_the_threads_it_was_given():
    """The actor's batch wrapper sets the count on the thread that runs the batch, before running it."""
    with _actor_counting_threads() as (_, run, counts):
        tree = SimpleNamespace(n=4)
        run("verify", [("a", tree, None)])
        run("verify", [("b", tree, None)])  # "a" is elsewhere now
        run("verify", [("a", tree, None), ("b", tree, None)])
        root = SimpleNamespace(n=1)  # both switch to the target alone: all threads at once
        run("verify", [("a", root, None), ("b", root, None)])
        assert counts == [2, 1, 2, 2]
