"""benchmarks/processes.py: the decoder with its draft and target each in a process of its own (pipes, no Ray)
decodes exactly as in one process, and a worker's exception reaches the caller."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import processes  # noqa: E402

from sequoia_ray.config import DEFAULT_DRAFT_VOCAB  # noqa: E402
from sequoia_ray.local import LocalPair  # noqa: E402
from sequoia_ray.prompts import Prompt  # noqa: E402

pytestmark = pytest.mark.long  # two processes that load models


@pytest.fixture(scope="module")
def pair():
    return LocalPair.load("tiny-target", "tiny-draft", dtype="float32", progress=False)


def test_two_processes_decode_what_one_does(pair):
    args = SimpleNamespace(target="tiny-target", draft="tiny-draft", dtype="float32", draft_quantize=None, threads=1,
                           rounds=2, max_tokens=12, draft_vocab=DEFAULT_DRAFT_VOCAB)
    prompts = [Prompt(text=t, kind="code", chat=False) for t in ("def add(a, b):", "The capital of France is")]
    rows, same = processes.compare(pair, args, prompts)
    assert same == 4  # 2 rounds x 2 prompts, greedy: the same text both ways
    assert [r["mode"] for r in rows] == ["one process", "two processes"] and rows[0]["vs one process"] == 1
    assert rows[0]["tokens"] == rows[1]["tokens"] > 0 and rows[0]["tok/step"] == rows[1]["tok/step"]


def test_a_workers_exception_reaches_the_caller(pair):
    """A call the worker fails (verify for a request it never started) raises in the caller what it raises in
    process, and the worker process goes on."""
    from sequoia_ray.target import TargetWorker

    with pytest.raises(Exception) as local:
        TargetWorker(pair.target.model).verify("no-such-request", None, None)
    target = processes.PipeWorker("target", "tiny-target", "float32", None, 1)
    try:
        with pytest.raises(type(local.value)) as remote:
            target.verify("no-such-request", None, None)
        assert str(remote.value) == str(local.value)
        assert target.process.is_alive()
        target.finish("no-such-request")  # and answers the next call
    finally:
        target.close()
    assert not target.process.is_alive()


def test_a_rows_forwards_are_the_actors_where_a_run_carries_them():
    """``forwards ms`` a step: a served run's ``forward_s`` (the actors' traced forwards), else the worker calls'
    time (in process, a call is its forward)."""
    here = [{"tokens": 10, "seconds": 1.0, "steps": 4, "draft_s": 0.2, "verify_s": 0.6},
            {"tokens": 6, "seconds": 0.6, "steps": 2, "draft_s": 0.1, "verify_s": 0.3}]
    served = [{**run, "forward_s": run["draft_s"] + run["verify_s"] - 0.05 * run["steps"]} for run in here]
    row_here, row_served = processes.summary("here", here), processes.summary("served", served)
    assert row_here["forwards ms"] == pytest.approx(1000 * 1.2 / 6)
    assert row_served["forwards ms"] == pytest.approx(1000 * 1.2 / 6 - 50)
    assert row_here["draft ms"] == row_served["draft ms"] == pytest.approx(1000 * 0.3 / 6)


def test_the_worker_draft_has_the_in_process_drafts_head(monkeypatch):
    """The draft in its own process loads with the head the in-process pair's draft has (``LocalPair.load``'s
    default ``draft_vocab``, as served); before, the worker loaded the full head. No process starts and nothing
    loads: the spawned processes' targets are called here, model loading stood in for."""
    import inspect

    import sequoia_ray.draft
    import sequoia_ray.models.loading

    spawned = []

    class Context:  # multiprocessing's spawn context, the process not started
        def Pipe(self):
            return SimpleNamespace(recv=lambda: "ready"), None

        def Process(self, target, args, daemon):
            spawned.append((target, args))
            return SimpleNamespace(start=lambda: None)

    monkeypatch.setattr(processes.mp, "get_context", lambda method: Context())
    import torch

    args = SimpleNamespace(tiny=False, threads=torch.get_num_threads())  # serve_worker sets it here
    processes.pair_args(args)
    processes.apart(SimpleNamespace(target=SimpleNamespace(tokenizer=None, eos_ids=(1,), max_context=64),
                                    draft=SimpleNamespace(max_context=64)), args)

    loaded = {}
    monkeypatch.setattr(sequoia_ray.models.loading, "load_model",
                        lambda name, **kw: loaded.update(kw, name=name) or SimpleNamespace(model=None))
    monkeypatch.setattr(sequoia_ray.draft, "DraftWorker", lambda model: None)
    target, (_, *rest) = next((t, a) for t, a in spawned if a[1] == "draft")
    sent = []
    target(SimpleNamespace(send=sent.append, recv=lambda: None), *rest)  # "ready", then no call: it ends
    default = inspect.signature(LocalPair.load).parameters["draft_vocab"].default
    assert loaded["name"] == "default-draft" and loaded["quantize"] == "int8" and sent == ["ready"]
    assert loaded.get("draft_vocab") == default is not None
