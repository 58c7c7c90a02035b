"""benchmarks/layout.py on the tiny target: every way of running a step is timed on the same trees, and the
lone-request row compares the plain session forward with what serves (ragged under SDPA), bit for bit."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from sequoia_ray.local import LocalPair

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import layout  # noqa: E402


@pytest.fixture(scope="module")
def model():
    return LocalPair.tiny().target.model


@pytest.mark.parametrize("batch", [1, 3])
def test_rows_time_every_way_and_check_the_plain_forward_bit_for_bit(model, batch, monkeypatch):
    ran = []
    step = layout.step
    monkeypatch.setattr(layout, "step", lambda *a: ran.append(a[-1]) or step(*a))
    row = layout.compare(model, batch, 4, 60, repeats=2)
    ways = ["separate", "plain", *layout.LAYOUTS] if batch > 1 else ["separate", "plain"]
    assert ran == ways * 3  # a warm-up round, then 2 timed ones, interleaved
    assert row["B"] == batch and row["tokens"] == 4 * batch
    assert all(row[f"{w} ms"] > 0 for w in ["separate", "plain", *layout.LAYOUTS])
    assert row["separate vs plain"] == pytest.approx(row["plain ms"] / row["separate ms"])
    assert row["plain bitwise separate"] is True  # fp32 tiny model: the ragged lone forward is the plain one's


def test_a_plain_forward_that_differs_is_reported(model, monkeypatch):
    """Were the served lone forward to drift from the session's own (here: one hidden state nudged), the row says so."""
    step = layout.step

    def nudged(*a):
        seconds, hidden = step(*a)
        return seconds, [h + 1e-3 for h in hidden] if a[-1] == "plain" else hidden

    monkeypatch.setattr(layout, "step", nudged)
    assert layout.compare(model, 1, 4, 60, repeats=1)["plain bitwise separate"] is False
