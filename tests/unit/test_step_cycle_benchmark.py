"""benchmarks/step_cycle.py splits a load window between the two actors' forwards exactly."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from sequoia_ray.batching import Forward

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from step_cycle import cycle, trace_rows  # noqa: E402


def fwd(start, end, calls=8, trees=8, method="verify"):
    return Forward(method, start, end, calls, trees, 2 * calls, start)


def test_the_window_splits_into_target_draft_both_and_neither():
    """Window [0, 10): the target runs [1, 4) and [6, 8), the draft [3, 5) and [7.5, 9) and [9, 12) (clipped
    at 10): target only 2 + 1.5, draft only 1 + 2, both 1 + 0.5, neither [0, 1) + [5, 6) = 2."""
    target = [fwd(1, 4), fwd(6, 8, trees=0)]
    draft = [fwd(3, 5, method="grow"), fwd(7.5, 9, method="grow"), fwd(9, 12, method="grow")]
    c = cycle(target, draft, 0.0, 10.0)
    assert c["target only"] == pytest.approx(0.35)
    assert c["draft only"] == pytest.approx(0.30)
    assert c["both"] == pytest.approx(0.15)
    assert c["neither"] == pytest.approx(0.20)
    assert c["target with trees"]["forwards"] == 1 and c["target alone"]["forwards"] == 1
    assert c["target with trees"]["median ms"] == 3000.0 and c["target alone"]["median ms"] == 2000.0
    assert c["draft"]["forwards"] == 2  # the one running past the window's end is not a whole forward in it
    assert c["gap after trees ms"] == 2000.0 and c["gap after alone ms"] is None


def test_overlapping_forwards_of_one_actor_count_once():
    """A TP or retried trace may hold overlapping spans: [0, 2) and [1, 3) are 3 s of the target, not 4."""
    c = cycle([fwd(0, 2), fwd(1, 3)], [], 0.0, 4.0)
    assert c["target only"] == pytest.approx(0.75) and c["neither"] == pytest.approx(0.25)


def test_gathering_and_requests_per_forward():
    draft = [Forward("grow", 1.0, 1.5, 8, 8, 40, 0.95), Forward("grow", 3.0, 3.5, 6, 6, 12, 2.9)]
    c = cycle([], draft, 0.0, 5.0)
    assert c["draft"]["requests"] == 7.0 and c["draft"]["tokens"] == 26.0
    assert c["draft"]["gather ms"] == pytest.approx(75.0)


def test_an_empty_window_is_refused():
    with pytest.raises(ValueError, match="empty"):
        cycle([], [], 5.0, 5.0)


def test_rows_are_relative_to_the_window_in_milliseconds():
    f = Forward("grow", 10.5, 10.625, 3, 2, 9, 10.45)
    assert trace_rows([f], 10.0) == [["grow", 0.5, 125.0, 3, 2, 9, 50.0]]
