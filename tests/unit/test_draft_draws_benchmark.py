"""benchmarks/draft_draws.py on the tiny draft: both ways really run (kept logits, then the whole head's), grow
the same greedy trees, and the kept way is put back afterwards."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from sequoia_ray import draft as draft_module

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import draft_draws  # noqa: E402


def test_both_ways_run_and_grow_the_same_greedy_trees(tmp_path, monkeypatch):
    seen = []
    kept, whole = draft_draws.KEPT, draft_draws.whole
    monkeypatch.setattr(draft_draws, "KEPT", lambda *a: seen.append("kept") or kept(*a))
    monkeypatch.setattr(draft_draws, "whole", lambda *a: seen.append("whole") or whole(*a))
    out = draft_draws.main(["--tiny", "--rounds", "2", "--temperatures", "0,0.6", "--out", str(tmp_path / "d.json")])
    rows = out["rows"]
    assert len(rows) == 2 * len(draft_draws.CASES) and {"kept", "whole"} <= set(seen)
    assert all(r["same_trees"] == "2/2" for r in rows if r["T"] == 0)
    assert all(r["kept_ms"] > 0 and r["whole_ms"] > 0 and r["q1"] <= r["kept/whole"] <= r["q3"] for r in rows)
    assert draft_module.kept_logits is draft_draws.KEPT  # put back
    assert json.loads((tmp_path / "d.json").read_text())["rows"] == rows
