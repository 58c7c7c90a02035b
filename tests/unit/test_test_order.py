"""The order in which pytest-xdist hands out the suite's work units (tests/conftest.py): longest first."""

from __future__ import annotations

from pathlib import Path

from tests.conftest import _module_marks, _unit_rank

ROOT = Path(__file__).resolve().parents[2]


def test_long_units_are_handed_out_first():
    assert _unit_rank(ROOT, "session-ray") == 0
    assert _unit_rank(ROOT, "tests/slow/test_real_pair.py") == 1  # slow: the real pair
    assert _unit_rank(ROOT, "tests/integration/test_serve_run.py") == 1  # integration: a cluster of its own
    assert _unit_rank(ROOT, "tests/unit/test_lossless_statistical.py") == 1  # long: minutes of sampling
    assert _unit_rank(ROOT, "tests/unit/test_dp.py") == 2
    assert _unit_rank(ROOT, "tests/unit/no_such_module.py") == 2


def test_marks_are_read_from_the_source(tmp_path):
    module = tmp_path / "test_x.py"
    module.write_text("import pytest\npytestmark = [pytest.mark.slow]\n\n@pytest.mark.long\ndef test_a():\n    pass\n"
                      "\n@other.mark.integration\ndef test_b():\n    pass\n")
    assert _module_marks(module) == {"slow", "long"}
