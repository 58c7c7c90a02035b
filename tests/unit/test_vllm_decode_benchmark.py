"""benchmarks/vllm_decode.py without vLLM: the child protocol with a stand-in engine, the alternation, and
the arithmetic of decode time and paired ratios."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import vllm_decode  # noqa: E402

# a stand-in engine: answers [ids, n] with 0.1 s for one token and 0.1 + 0.01 s for every further one, and
# the tokens n copies of the prompt's first id
FAKE = """
import json, sys
print("ready", flush=True)
for line in sys.stdin:
    ids, n = json.loads(line)
    print(json.dumps([0.1 + 0.01 * (n - 1), [ids[0]] * n]), flush=True)
"""


def test_child_alternation_and_summary(tmp_path):
    child = vllm_decode.Child([sys.executable, "-c", FAKE], dict(os.environ), tmp_path / "fake.log")
    calls = []

    def ours(ids, n):  # twice the stand-in's decode time a token, the same prefill and tokens
        calls.append(("ours", n))
        return 0.1 + 0.02 * (n - 1), [ids[0]] * n

    def vllm(ids, n):
        calls.append(("vllm", n))
        return child(ids, n)

    try:
        runs = vllm_decode.alternate({"vllm": vllm, "ours": ours}, [[7, 8], [9]], rounds=2, tokens=5, gap_s=0)
    finally:
        child.close()
    assert [c for c in calls if c[1] == 1] == [("vllm", 1), ("ours", 1), ("ours", 1), ("vllm", 1),
                                              ("ours", 1), ("vllm", 1), ("vllm", 1), ("ours", 1)]
    assert len(runs["vllm"]) == len(runs["ours"]) == 4 and runs["vllm"][1]["tokens"] == [9] * 5
    rows = {r["engine"]: r for r in vllm_decode.summarize(runs, tokens=5)}
    assert rows["vllm"]["decode ms/token (median)"] == pytest.approx(10.0)
    assert rows["ours"]["decode ms/token (median)"] == pytest.approx(20.0)
    assert rows["ours"]["decode / vllm (paired)"] == pytest.approx(2.0)
    assert rows["ours"]["prefill / vllm (paired)"] == pytest.approx(1.0)
    assert rows["ours"]["same tokens as vllm"] == "4/4"


def test_a_child_that_dies_is_an_error_naming_its_log(tmp_path):
    with pytest.raises(RuntimeError, match="exited before it was ready; its log is"):
        vllm_decode.Child([sys.executable, "-c", "import sys; sys.exit(3)"], dict(os.environ), tmp_path / "x.log")


def test_bad_arguments_say_what_to_do(tmp_path):
    with pytest.raises(SystemExit, match="give at least 2"):
        vllm_decode.main(["--tokens", "1"])
    with pytest.raises(SystemExit, match="scripts/vllm_venv.sh"):
        vllm_decode.main(["--vllm-python", str(tmp_path / "nothing")])
