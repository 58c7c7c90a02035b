"""benchmarks/profile_estimators.py reads repeats the way it says, and judges the readings against the long runs."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from profile_estimators import compare, main, mean_error, quiet_as_of, summary, tables  # noqa: E402

TRUE = {("t", 1, 1): 0.17, ("t", 1, 8): 0.185, ("t", 1, 32): 0.245, ("c", 1, 1): 0.046, ("c", 1, 8): 0.08,
        ("t", 2, 2): 0.175, ("c", 2, 2): 0.05}


def _run(kind: str, slow: dict | None = None, repeats: int = 3) -> dict:
    """Every forward at its true time, except the repeats ``slow`` names (key -> {repeat: factor})."""
    slow = slow or {}
    return {"kind": kind, "rounds": {k: [v * slow.get(k, {}).get(i, 1.0) for i in range(repeats)]
                                     for k, v in TRUE.items()}}


def test_a_slow_phase_in_two_repeats_of_t1_misleads_the_median_not_the_fastest():
    short = _run("short", {("t", 1, 1): {0: 2.4, 1: 2.2}, ("t", 1, 32): {2: 1.5}})
    reference = tables(_run("long", repeats=5)["rounds"], "fastest+raw")
    assert reference[("t", 1)] == pytest.approx({1: 1.0, 8: 0.185 / 0.17, 32: 0.245 / 0.17})
    assert mean_error(tables(short["rounds"], "fastest+isotonic"), reference) == pytest.approx(0.0)
    median = tables(short["rounds"], "median+raw")
    assert median[("t", 1)][8] == pytest.approx(0.185 / (0.17 * 2.2))  # every table over the slow t(1)
    assert mean_error(median, reference) == pytest.approx(1 - 1 / 2.2)
    assert tables(short["rounds"], "median+max")[("t", 1)] == {1: 1.0, 8: 1.0, 32: 1.0}  # then lifted to t(1)


def test_anchored_reads_t1_over_its_extra_repeats_the_others_over_its_own():
    short = _run("short", {("t", 1, 1): {0: 2.2, 1: 2.1, 2: 2.3}})  # every own repeat of t(1) in a slow phase
    short["rounds"][("t", 1, 1)] += [0.17 * 1.9, 0.17, 0.17 * 2.0]  # the anchors: one quiet moment
    reference = tables(_run("long", repeats=5)["rounds"], "anchored+raw")
    assert mean_error(tables(short["rounds"], "anchored+isotonic"), reference) == pytest.approx(0.0)
    assert mean_error(tables(short["rounds"], "fastest+raw"), reference) == pytest.approx(1 - 1 / 2.1)
    assert mean_error(tables(short["rounds"], "median+raw"), reference) == pytest.approx(1 - 1 / 2.2)


def test_quiet_as_of_is_the_expected_fastest_of_that_many_repeats():
    import itertools
    import statistics

    samples = [0.31, 0.12, 0.5, 0.12, 0.2, 0.44, 0.27]
    for repeats in (1, 2, 3, 7):
        draws = [min(draw) for draw in itertools.combinations(samples, repeats)]  # every draw, equally likely
        assert quiet_as_of(samples, repeats) == pytest.approx(statistics.mean(draws))
    assert quiet_as_of(samples, 9) == 0.12  # as many or fewer samples: their fastest


def test_matched_reads_t1s_extra_repeats_as_many_as_the_others_have():
    short = _run("short")
    short["rounds"][("t", 1, 1)] += [0.17] * 8 + [0.085]  # one lucky repeat among t(1)'s 12
    matched, anchored = (tables(short["rounds"], f"{p}+raw")[("t", 1)][8] for p in ("matched", "anchored"))
    assert anchored == pytest.approx(0.185 / 0.085)  # every table over the one lucky repeat
    assert matched == pytest.approx(0.185 / (0.17 - 0.085 * 3 / 12))  # in a draw of 3 with chance 3/12


def test_running_max_against_isotonic_on_one_slow_small_size():
    short = _run("short", {("t", 1, 8): {0: 1.6, 1: 1.6, 2: 1.6}})  # slow in every repeat: no pick can help
    fitted = {r: tables(short["rounds"], r)[("t", 1)] for r in ("fastest+max", "fastest+isotonic")}
    assert fitted["fastest+max"][32] == pytest.approx(0.185 * 1.6 / 0.17)  # the spike carried to 32 tokens
    assert fitted["fastest+isotonic"][32] == pytest.approx((0.185 * 1.6 + 0.245) / 2 / 0.17)  # pooled with it


def test_compare_judges_every_short_run_against_every_long_one_and_the_longs_against_each_other():
    runs = [_run("short", {("t", 1, 1): {0: 2.0, 1: 2.0}}), _run("long", repeats=4), _run("short"),
            _run("long", {("c", 1, 8): {i: 3.0 for i in range(4)}}, repeats=4)]  # c(8) slow throughout
    rows, agreement = compare(runs)
    assert [(r["short"], r["reference"]) for r in rows] == [(0, 1), (2, 1), (0, 3), (2, 3)]
    assert rows[1]["fastest+isotonic err %"] == pytest.approx(0.0)  # a clean short run against a clean long one
    assert rows[0]["median+max err %"] > rows[0]["fastest+isotonic err %"] == pytest.approx(0.0)
    assert [(a["long"], a["other long"]) for a in agreement] == [(1, 3)]
    assert agreement[0]["anchored apart %"] == pytest.approx(100 * (1 - 1 / 3.0) / (len(TRUE) - 1))  # one cell
    best = {s["reading"]: s["best in"] for s in summary(rows)}
    assert best["fastest+isotonic"] == best["anchored+isotonic"] == best["matched+isotonic"] == "4/4"
    assert best["median+max"] != "4/4"


def test_a_smoke_run_on_the_tiny_pair_writes_its_json(tmp_path):
    out = tmp_path / "p.json"
    payload = main(["--tiny", "--order", "short,long", "--short-repeats", "1", "--long-repeats", "2",
                    "--out", str(out)])
    saved = json.loads(out.read_text())
    assert len(saved["rows"]) == 1 and saved["agreement"] == [] and len(saved["runs"]) == 2
    assert all(0 <= v < 1e4 for k, v in payload["rows"][0].items() if k.endswith("err %"))
    with pytest.raises(SystemExit, match="at least one of each"):
        main(["--tiny", "--order", "short,short"])
