"""Every torch computation of a process on one thread (``sequoia_ray.compute_thread``): the thread itself, and
the model actors (built in-process, no Ray) loading and running their models there, whichever thread calls."""

from __future__ import annotations

import threading
from types import SimpleNamespace
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import torch.distributed as dist

import sequoia_ray.models.loading as loading
from actors.draft import DraftActor
from actors.spec import ModelActorSpec
from actors.target import TargetRank, free_port
from sequoia_ray.batching import NOT_YET, WORKER_CALLS
from sequoia_ray.compute_thread import ComputeThread, compute_thread
from sequoia_ray.config import SamplingParams
from sequoia_ray.draft import DraftTree
from sequoia_ray.engine import ROOT_ONLY, SpeculativeDecoder
from sequoia_ray.local import LocalPair
from sequoia_ray.tree.plan import chain, k_ary

pytestmark = pytest.mark.usefixtures("keep_logging")  # tests/conftest.py


def test_calls_from_many_threads_run_on_one_thread_in_turn():
    compute = ComputeThread(name="test-compute")
    running, overlaps = [0], []
    lock = threading.Lock()

    def work(i):
        with lock:
            running[0] += 1
            overlaps.append(running[0])
        threading.Event().wait(0.002)
        with lock:
            running[0] -= 1
        return threading.get_ident(), i

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda i: compute.run(work, i), range(32)))
    assert [i for _, i in results] == list(range(32))
    assert len({ident for ident, _ in results}) == 1 and results[0][0] != threading.get_ident()
    assert max(overlaps) == 1  # one at a time
    assert compute.run(compute.on_it) and not compute.on_it()


def test_a_call_from_the_compute_thread_runs_inline_and_exceptions_reach_the_caller():
    compute = ComputeThread(name="test-compute")
    outer = compute.run(lambda: (threading.get_ident(), compute.run(threading.get_ident)))
    assert outer[0] == outer[1]  # nested: no deadlock waiting for itself

    def fail():
        raise ValueError("boom")

    with pytest.raises(ValueError, match="boom"):
        compute.run(fail)
    assert compute.run(lambda: 7) == 7  # the thread survives a failure
    assert compute_thread() is compute_thread()


class _Calls:
    """A model actor's ``call`` as the Draft / Target protocol (what the adapters do over Ray)."""

    def __init__(self, actor) -> None:
        self.actor = actor

    def __getattr__(self, method):
        if method not in WORKER_CALLS:
            raise AttributeError(method)  # e.g. the optional max_context: absent
        return lambda request_id, *args: self.actor.call(method, request_id, *args)


def test_model_actors_load_and_run_their_models_on_the_compute_thread(monkeypatch):
    """Loading (the draft's and the target's), every forward of a decode driven from this thread through the
    actors' batchers, and a tensor-parallel follower's steps: all on the process's compute thread."""
    where: dict[str, set[int]] = {"load": set(), "forward": set()}
    loads = []

    def recorded(load):
        def load_here(*args, **kwargs):
            where["load"].add(threading.get_ident())
            loads.append(args[0])
            loaded = load(*args, **kwargs)
            embed = loaded.model.get_input_embeddings()  # every forward of a tree or a prompt embeds it
            embed.register_forward_pre_hook(lambda *_: where["forward"].add(threading.get_ident()))
            return loaded
        return load_here

    prompt = [5, 17, 33, 8]
    expected = LocalPair.load("tiny-target", None, progress=False).decoder(chain(0)).generate(
        prompt, SamplingParams(max_tokens=12)).token_ids  # here, before anything is recorded
    monkeypatch.setattr(loading, "load_model", recorded(loading.load_model))  # the actors import it when loading
    rank = TargetRank(0, 1, "127.0.0.1", free_port(), "gloo", ModelActorSpec("tiny-target"))
    assert not dist.is_initialized()  # one rank has no collectives: no group (no gloo loop thread)
    rank.lead([])
    draft = DraftActor(ModelActorSpec("tiny-draft"))
    decoder = SpeculativeDecoder(_Calls(rank), _Calls(draft), k_ary(2, 3))
    assert decoder.generate(prompt, SamplingParams(max_tokens=12)).token_ids == expected
    # a follower's share of rank 0's calls, arriving on whatever thread Ray picks
    rank.step("start", "f", prompt, SamplingParams(max_tokens=4), 0)
    verdicts = rank.step_batch("verify", [("f", ROOT_ONLY, DraftTree(torch.tensor([prompt[-1]]), {}))])
    assert verdicts[0].tokens == expected[:1]
    rank.step("finish", "f")
    ident = compute_thread().run(threading.get_ident)
    assert loads == ["tiny-target", "tiny-draft"]  # both went through the recorder
    assert where == {"load": {ident}, "forward": {ident}}, (where, ident, threading.get_ident())


def test_rank_0_sends_its_chunk_cuts_with_the_batch_to_every_follower(monkeypatch):
    """The batcher cuts a prefill chunk to the token budget left (``caps``); every rank of a tensor-parallel group
    must forward the same tokens (the same collectives), so rank 0 sends the cuts with the batch."""
    spec = ModelActorSpec("tiny-target", prefill_chunk=32)
    rank, follower = (TargetRank(0, 1, "127.0.0.1", free_port(), "gloo", spec) for _ in range(2))
    sent = []

    def remote(*args):
        sent.append(args)
        return follower.step_batch(*args)

    monkeypatch.setattr("actors.target.ray.get", lambda refs, timeout=None: list(refs))
    rank.lead([SimpleNamespace(step_batch=SimpleNamespace(remote=remote))])
    prompt = list(range(1, 81))
    for r in (rank, follower):
        r.worker.start("f", prompt, SamplingParams(max_tokens=4), 0)
    root = DraftTree(torch.tensor([prompt[-1]]), {})
    assert rank._lead_batch("verify", [("f", ROOT_ONLY, root)], {"f": 20}) == [NOT_YET]
    assert [r.worker.requests["f"].session.length for r in (rank, follower)] == [20, 20]
    assert sent[0][3] == {"f": 20}
