"""benchmarks/threads.py: every case once a round in a rotated order, the figures the medians over the rounds and
the ratio to one thread paired round by round (the child processes are stood in for: nothing loads)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import threads  # noqa: E402

TOKS = {"main": [10.0, 20.0], "other": [20.0, 20.0], "compute": [10.0, 30.0]}  # tok/s per round: the host drifts


def test_rounds_rotate_and_the_ratio_is_paired(monkeypatch, tmp_path):
    order, run = [], subprocess.run

    def child(cmd, **kw):
        if "--case" not in cmd:  # not a case's child (the hardware id's probes)
            return run(cmd, **kw)
        case = cmd[cmd.index("--case") + 1]
        figures = {"draft ms": 1.0, "verify ms": 2.0, "context switches": 5, "tokens": 48,
                   "tok/s": TOKS[case][sum(c == case for c in order)]}
        order.append(case)
        return subprocess.CompletedProcess(cmd, 0, stdout="log line\n" + json.dumps(figures))

    monkeypatch.setattr(threads.subprocess, "run", child)
    threads.main(["--rounds", "2", "--tiny", "--out", str(tmp_path / "threads.json")])
    assert order == ["main", "other", "compute", "other", "compute", "main"]
    record = json.loads((tmp_path / "threads.json").read_text())
    rows = {r["case"]: r for r in record["rows"]}
    one, other, compute = (rows[name] for name in threads.CASES)
    assert one["tok/s"] == 15.0 and other["tok/s"] == 20.0 and one["vs one thread"] == 1.0
    # each round's ratio, then their median (the ratio of the medians would be 20 / 15 for both)
    assert other["vs one thread"] == pytest.approx((2.0 + 1.0) / 2)
    assert compute["vs one thread"] == pytest.approx((1.0 + 1.5) / 2)
    assert [r["tok/s"] for r in record["rounds"]["the compute thread"]] == TOKS["compute"]
