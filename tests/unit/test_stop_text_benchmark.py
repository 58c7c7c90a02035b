"""benchmarks/stop_text.py with the tiny tokenizer: both ways stream the same text (they must), the reference
really decodes the whole output at every token, and the JSON holds the printed rows."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import stop_text  # noqa: E402


def test_both_ways_stream_the_same_text_and_the_reference_decodes_everything(tmp_path, monkeypatch):
    lengths = []
    decode = stop_text.WholeDecode._decode

    def counting(self):
        lengths.append(len(self.ids))
        return decode(self)

    monkeypatch.setattr(stop_text.WholeDecode, "_decode", counting)
    out = tmp_path / "stop_text.json"
    assert stop_text.main(["--tiny", "--lengths", "100,200", "--rounds", "2", "--stop", "zzzz", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["tokens"] for r in rows] == [100, 200] and all(r["same_text"] for r in rows)
    assert all(r["whole_ms"] > 0 and r["incremental_ms"] > 0 for r in rows)
    assert lengths == [*range(1, 101)] * 2 + [*range(1, 201)] * 2  # every token, the whole output each time


def test_a_text_that_differs_fails_the_run(tmp_path, monkeypatch):
    monkeypatch.setattr(stop_text.StopChecker, "_decode", lambda self: "x" * len(self.ids))
    assert stop_text.main(["--tiny", "--lengths", "100", "--rounds", "1", "--out", str(tmp_path / "s.json")]) == 1
