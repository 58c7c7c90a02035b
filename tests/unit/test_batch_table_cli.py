"""tuning/batch_table.py's inputs: each bad one refused in one line (exit 2) before the models load."""

from __future__ import annotations

import json

import pytest

import tuning.batch_table as batch_table
from sequoia_ray.arguments import EXIT_BAD_INPUT
from sequoia_ray.hardware import HardwareProfile


@pytest.fixture
def no_models(monkeypatch):
    monkeypatch.setattr(batch_table, "load", lambda args: pytest.fail("the models loaded before the bad input"))


@pytest.mark.parametrize("argv, needle", [
    (["--sizes", "1,x"], "'1,x': 'x' is not an integer; give tree sizes like 1,2,4,8"),
    (["--sizes", "0,4"], "0 must be >= 1"),
    (["--repeats", "0"], "0 must be >= 1"),
    (["--temperature", "-1"], "-1.0 must be a finite number >= 0"),
    (["--profile", "missing.json"], "--profile missing.json: "),
    (["--profile", "list.json"], "expected a JSON object"),
    (["--acceptance", "0.8,0.7"], "sum of p is 1.5"),
    (["--json", "nowhere/out.json"], "the folder nowhere does not exist"),
    (["--profile", "prof8.json", "--sizes", "16,32"], "--sizes 16,32: --profile prof8.json (cpu-other-2c) has step "
                                                       "costs up to 8 tokens"),
])
def test_a_bad_input_is_one_line_before_the_models_load(tmp_path, monkeypatch, capsys, no_models, argv, needle):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "list.json").write_text("[1, 2]")
    (tmp_path / "prof8.json").write_text(json.dumps(
        HardwareProfile("cpu-other-2c", {1: 1.0, 8: 1.2}, {1: 0.1, 8: 0.1}, 0.1, 128, "float32").to_dict()))
    try:
        code = batch_table.main(argv)
    except SystemExit as exc:  # argparse's usage errors
        code = exc.code
    assert code == EXIT_BAD_INPUT
    err = capsys.readouterr().err
    assert err.startswith("tuning/batch_table.py: error: ") and needle in err and "Traceback" not in err
