"""benchmarks/level_supports.py on the tiny pair: both ways run, draw the same trees (the same draws: only the
host reads differ), and the per-level way is put back afterwards."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from sequoia_ray.draft import DraftWorker

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import level_supports  # noqa: E402


def test_both_ways_run_and_draw_the_same_trees(tmp_path, monkeypatch):
    seen = []
    node = level_supports.per_node
    monkeypatch.setattr(level_supports, "per_node", lambda *a: seen.append("node") or node(*a))
    row = level_supports.main(["--tiny", "--rounds", "2", "--batch", "3", "--out", str(tmp_path / "l.json")])
    assert seen and row["same trees"] is True and row["node ms"] > 0 and row["level ms"] > 0
    assert DraftWorker._dists is level_supports.PER_LEVEL  # put back
    assert json.loads((tmp_path / "l.json").read_text())["row"] == row
