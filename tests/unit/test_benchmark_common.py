"""benchmarks/common.py: every result file says which hardware ran it."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import common  # noqa: E402

from sequoia_ray.hardware import hardware_id  # noqa: E402


def test_result_records_the_hardware_id(tmp_path):
    out = common.write_json("probe", {"rows": [1]}, tmp_path / "probe.json")
    record = json.loads(out.read_text())
    assert record["hardware"] == hardware_id()  # e.g. cpu-AMD-EPYC-avx512bf16-2c: plans are keyed by it
    assert record["benchmark"] == "probe" and record["rows"] == [1]


def test_without_torch_the_processor_stands_in(monkeypatch):
    """A vLLM child in its own venv imports common without torch: no import of ours is tried there."""
    monkeypatch.delitem(sys.modules, "torch")
    monkeypatch.setattr(common.platform, "processor", lambda: "x86_64-probe")
    assert common.hardware() == "x86_64-probe"


def test_quartiles_of_one_value_and_of_several():
    """One value (``--rounds 1``) is its own median and quartiles; several are ``statistics.quantiles``'."""
    assert common.quartiles([1.5]) == (1.5, 1.5, 1.5)
    assert common.quartiles([1.0, 2.0, 3.0, 4.0, 5.0]) == (2.0, 3.0, 4.0)
    assert common.quartiles([1.0, 2.0, 3.0, 4.0, 5.0], method="exclusive") == (1.5, 3.0, 4.5)
    assert common.quartiles([1.0, 2.0]) == (1.25, 1.5, 1.75)  # within the rounds (exclusive: 0.75, 2.25)


def test_rotated_starts_each_round_one_case_later():
    assert [common.rotated(["a", "b", "c"], r) for r in range(4)] == [
        ["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"], ["a", "b", "c"]]


def test_round_medians_pair_each_round_with_the_base():
    runs = {"base": [{"tok/s": 10.0, "name": "x"}, {"tok/s": 20.0, "name": "x"}],
            "other": [{"tok/s": 20.0, "name": "y"}, {"tok/s": 20.0, "name": "y"}]}
    rows = common.round_medians(runs, "case", "base", {"vs base": "tok/s"})
    assert rows == [{"case": "base", "tok/s": 15.0, "vs base": 1.0}, {"case": "other", "tok/s": 20.0, "vs base": 1.5}]
    runs["base"] = [{"tok/s": 0.0}, {"tok/s": 0.0}]  # nothing to divide by in any round
    assert common.round_medians(runs, "case", "base", {"vs base": "tok/s"})[1]["vs base"] is None
