"""benchmarks/prefill.py: every setting once a round in a rotated order, the figures the medians over the
rounds and the ratios to the first setting paired round by round (the runs are stood in for: nothing loads)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import prefill  # noqa: E402

STALL = {"whole/padded": [1.0, 2.0], "whole/flat": [0.5, 2.0], "whole/ragged": [1.0, 1.0],
         "chunk 64/flat": [0.2, 0.2], "chunk 64/ragged": [0.1, 0.4]}  # stall max s per round: the host drifts


def test_rounds_rotate_and_the_ratios_are_paired(monkeypatch, tmp_path):
    order = []

    def run(pair, layout, chunk, decoders, prompt_tokens, max_tokens, **settings):
        name = prefill.setting_name(layout, chunk)
        stall = STALL[name][sum(n == name for n in order)]
        order.append(name)
        return {"setting": name, "stall max s": stall, "median gap s": 0.1, "long TTFT s": 1.0, "last TTFT s": 1.0,
                "tokens/s": 1 / stall}

    monkeypatch.setattr(prefill, "run", run)
    monkeypatch.setattr(prefill.LocalPair, "tiny", staticmethod(lambda device="auto": None))
    prefill.main(["--tiny", "--chunks", "64", "--rounds", "2", "--out", str(tmp_path / "prefill.json")])
    names = list(STALL)
    assert order == names + names[1:] + names[:1]
    record = json.loads((tmp_path / "prefill.json").read_text())
    rows = {r["setting"]: r for r in record["rows"]}
    assert rows["whole/flat"]["stall max s"] == 1.25 and rows["whole/padded"]["stall vs whole/padded"] == 1.0
    # each round's ratio, then their median (the ratio of the medians would be 1.25 / 1.5 and 1 / 1.5)
    assert rows["whole/flat"]["stall vs whole/padded"] == pytest.approx((0.5 + 1.0) / 2)
    assert rows["whole/ragged"]["stall vs whole/padded"] == pytest.approx((1.0 + 0.5) / 2)
    assert rows["whole/flat"]["tokens/s vs whole/padded"] == pytest.approx((2.0 + 1.0) / 2)
    assert [r["stall max s"] for r in record["runs"]["chunk 64/ragged"]] == STALL["chunk 64/ragged"]
