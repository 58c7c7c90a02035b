"""benchmarks/vllm_decode.py without vLLM: the child protocol with a stand-in engine, the alternation, and
the arithmetic of decode time and paired ratios."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import vllm_decode  # noqa: E402

# a stand-in engine: answers [prompts, n] with 0.1 s for one token and 0.1 + 0.01 s for every further step,
# and for each prompt n copies of its first id
FAKE = """
import json, sys
print("ready", flush=True)
for line in sys.stdin:
    batch, n = json.loads(line)
    print(json.dumps([0.1 + 0.01 * (n - 1), [[ids[0]] * n for ids in batch]]), flush=True)
"""


def test_child_alternation_and_summary(tmp_path):
    child = vllm_decode.Child([sys.executable, "-c", FAKE], dict(os.environ), tmp_path / "fake.log")
    calls = []

    def ours(batch, n):  # twice the stand-in's decode time a step, the same prefill and tokens
        calls.append(("ours", n))
        return 0.1 + 0.02 * (n - 1), [[ids[0]] * n for ids in batch]

    def vllm(batch, n):
        calls.append(("vllm", n))
        return child(batch, n)

    try:
        runs = vllm_decode.alternate({"vllm": vllm, "ours": ours}, [[[7, 8], [5]], [[9], [4]]], rounds=2, tokens=5,
                                     gap_s=0)
    finally:
        child.close()
    assert [c for c in calls if c[1] == 1] == [("vllm", 1), ("ours", 1), ("ours", 1), ("vllm", 1),
                                              ("ours", 1), ("vllm", 1), ("vllm", 1), ("ours", 1)]
    assert len(runs["vllm"]) == len(runs["ours"]) == 4 and runs["vllm"][1]["tokens"] == [[9] * 5, [4] * 5]
    rows = {r["engine"]: r for r in vllm_decode.summarize(runs, tokens=5, batch=2)}
    assert rows["vllm"]["decode ms/step (median)"] == pytest.approx(10.0)
    assert rows["ours"]["decode ms/step (median)"] == pytest.approx(20.0)
    assert rows["ours"]["tokens/s (median step)"] == pytest.approx(100.0)  # 2 tokens a 20 ms step
    assert rows["ours"]["decode / vllm (paired)"] == pytest.approx(2.0)
    assert rows["ours"]["prefill / vllm (paired)"] == pytest.approx(1.0)
    assert rows["ours"]["same tokens as vllm"] == "4/4"


def test_a_child_that_dies_is_an_error_naming_its_log(tmp_path):
    with pytest.raises(RuntimeError, match="exited before it was ready; its log is"):
        vllm_decode.Child([sys.executable, "-c", "import sys; sys.exit(3)"], dict(os.environ), tmp_path / "x.log")


def test_bad_arguments_say_what_to_do(tmp_path):
    with pytest.raises(SystemExit, match="give at least 2"):
        vllm_decode.main(["--tokens", "1"])
    with pytest.raises(SystemExit, match="give a batch >= 1 that divides the limit"):
        vllm_decode.main(["--batch", "3", "--limit", "8"])
    with pytest.raises(SystemExit, match="scripts/vllm_venv.sh"):
        vllm_decode.main(["--vllm-python", str(tmp_path / "nothing")])
