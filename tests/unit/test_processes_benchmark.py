"""benchmarks/processes.py: the decoder with its draft and target each in a process of its own (pipes, no Ray)
decodes exactly as in one process, and a worker's exception reaches the caller."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import processes  # noqa: E402

from sequoia_ray.local import LocalPair  # noqa: E402
from sequoia_ray.prompts import Prompt  # noqa: E402


@pytest.fixture(scope="module")
def pair():
    return LocalPair.load("tiny-target", "tiny-draft", dtype="float32", progress=False)


def test_two_processes_decode_what_one_does(pair):
    args = SimpleNamespace(target="tiny-target", draft="tiny-draft", dtype="float32", draft_quantize=None, threads=1,
                           rounds=2, max_tokens=12)
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
