"""benchmarks/step_split.py: a step's parts, measured over the steps that held the whole batch, and the split of
the predicted speedup's error into the factors of G, the root-only step and the tree step."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

from sequoia_ray.lockstep import LockstepRun

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from step_split import PARTS, _parts, _rows  # noqa: E402


def _run(steps: list[tuple[float, float, float, int, int]]) -> LockstepRun:
    """(seconds, inside the forwards, inside the draft's, requests, tokens kept) per timed step."""
    s, f, d, b, k = zip(*steps)
    return LockstepRun(sum(k), s, b, k, 1.0, forward_s=f, draft_forward_s=d)


def test_parts_are_medians_over_the_steps_holding_the_whole_batch():
    """Two runs at B = 2; each has a tail step holding one request, which no part may see: its 9 s step, 5 s of
    target forward and 2 tokens would move every median and the tokens a step."""
    runs = [_run([(1.0, 0.8, 0.3, 2, 6), (1.2, 1.0, 0.4, 2, 6), (9.0, 5.0, 0.0, 1, 2)]),
            _run([(1.1, 0.9, 0.35, 2, 4), (9.0, 5.0, 0.0, 1, 2)])]
    parts = _parts(runs)
    assert parts["step s"] == pytest.approx(1.1)
    assert parts["target forward"] == pytest.approx(0.55)  # forward minus the draft's: 0.5, 0.6, 0.55
    assert parts["draft forwards"] == pytest.approx(0.35)
    assert parts["outside the forwards"] == pytest.approx(0.2)
    assert parts["tokens"] == pytest.approx(16 / 6)  # 16 tokens over 3 full steps of 2 requests


def test_the_error_factors_multiply_to_predicted_over_measured():
    predicted = {"alone": {"tokens": 1.0, "target forward": 1.0, "draft forwards": 0.0, "outside the forwards": 0.0},
                 "tree": {"tokens": 2.5, "target forward": 1.2, "draft forwards": 0.6, "outside the forwards": 0.0}}
    measured = {"alone": {"tokens": 1.0, "target forward": 1.0, "draft forwards": 0.0, "outside the forwards": 0.03},
                "tree": {"tokens": 2.3, "target forward": 1.25, "draft forwards": 0.7, "outside the forwards": 0.12}}
    rows, summary = _rows(predicted, measured)
    assert summary["predicted speedup (in process)"] == pytest.approx(2.5 / 1.8)
    assert summary["measured speedup, from the parts' medians"] == pytest.approx(2.3 * 1.03 / 2.07)
    factors = summary["factor of G (tokens)"] * summary["factor of the root-only step"] * summary["factor of the tree step"]
    assert factors == pytest.approx(summary["predicted / measured"])
    step_rows = {r["step"]: r for r in rows if r["part"] == "the step"}
    assert step_rows["tree"]["measured"] == pytest.approx(sum(measured["tree"][k] for k in PARTS))
    assert all(not math.isnan(r["predicted"]) for r in rows)
