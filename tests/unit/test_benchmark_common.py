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
