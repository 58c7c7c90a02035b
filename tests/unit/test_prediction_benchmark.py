"""benchmarks/prediction.py: the prediction error of a store's measured trees, split into acceptance and cost."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import pytest

from sequoia_ray.hardware import HardwareProfile, StepOverhead, choose
from sequoia_ray.plan_store import PlanKey, PlanStore
from sequoia_ray.tree.acceptance_vector import AcceptanceVector
from sequoia_ray.tree.dp import solve
from sequoia_ray.tree.plan_file import PlannedTree, Provenance

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from prediction import main, rows_of  # noqa: E402

T = {1: 1.0, 2: 1.05, 4: 1.1, 8: 1.2, 16: 1.4}
PROFILE = HardwareProfile("hw", T, {w: 0.25 * v for w, v in T.items()}, 0.08, 64, "float32")
OVERHEAD = StepOverhead(alone=(0.01, 0.0), tree=(0.03, 0.0))


def _publish(store: PlanStore, measured: dict[tuple[int, int], tuple[float, float]]) -> dict:
    """A batch-1 plan whose provenance lists the model's predictions and ``measured`` (n, d) -> (speedup,
    tokens per step), as the profile job writes them; the predictions by tree."""
    acceptance = AcceptanceVector.from_p([0.7, 0.15, 0.05])
    table = solve(acceptance, 16, 6)
    best, candidates = choose(table, PROFILE, budgets=(1, 4, 8, 16), overhead=OVERHEAD)
    predicted = {(c.n, c.d): c for c in candidates}
    rows = [{"n": 1, "d": 1, "predicted_speedup": 1.0, "measured_speedup": 1.0, "tokens_per_s": 10.0,
             "tokens_per_step": 1.0}]
    rows += [{"n": n, "d": d, "predicted_speedup": predicted[n, d].predicted_speedup, "measured_speedup": speedup,
              "tokens_per_s": 10.0 * speedup, "tokens_per_step": tokens}
             for (n, d), (speedup, tokens) in measured.items()]
    prov = Provenance(overhead=OVERHEAD.to_dict(), candidates=rows, tokens_measured=250)
    store.publish_profile(PROFILE)
    store.publish_plan(PlannedTree(best.plan, acceptance, best.n, best.d, best.expected_tokens, prov),
                       PlanKey("hw", "draft", "target", 0.0))
    return predicted


def test_the_error_splits_into_acceptance_and_cost(tmp_path):
    store = PlanStore(str(tmp_path))
    predicted = _publish(store, {(8, 4): (1.5, 3.3), (4, 3): (1.2, 2.2)})
    rows = {r["tree"]: r for r in rows_of(str(tmp_path))}
    assert sorted(rows) == ["n=4 d=3", "n=8 d=4"]  # the target alone is the baseline, not a row
    for (n, d), speedup, tokens in (((8, 4), 1.5, 3.3), ((4, 3), 1.2, 2.2)):
        row, choice = rows[f"n={n} d={d}"], predicted[n, d]
        assert row["G"] == pytest.approx(choice.expected_tokens)
        assert row["pred check"] == pytest.approx(0.0, abs=1e-9)  # G / step reproduces the recorded prediction
        assert row["G err"] == pytest.approx(tokens / choice.expected_tokens - 1)
        assert row["measured step"] == pytest.approx(tokens / speedup)
        assert row["err"] == pytest.approx(choice.predicted_speedup / speedup - 1)
        # the two factors make the whole: predicted / measured = (step_m / step_p) / (tokens / G)
        assert (1 + row["err"]) == pytest.approx((1 + row["step err"]) / (1 + row["G err"]))


def test_only_the_latest_batch_one_plan_with_measured_trees_counts(tmp_path, capsys):
    store = PlanStore(str(tmp_path))
    _publish(store, {(8, 4): (1.5, 3.3)})
    _publish(store, {(4, 3): (1.2, 2.2)})  # later: replaces the first
    unmeasured = store.fetch_plan(PlanKey("hw", "draft", "target", 0.0))[0]
    store.publish_plan(unmeasured, PlanKey("hw", "draft", "target", 0.0, 4))  # a batch bucket: not read
    assert [r["tree"] for r in rows_of(str(tmp_path))] == ["n=4 d=3"]
    bare = replace(unmeasured, provenance=Provenance())
    store.publish_plan(bare, PlanKey("hw", "draft", "target", 0.6))  # nothing measured: no row
    main([str(tmp_path), "--out", str(tmp_path / "out.json")])
    assert "within 10%: " in capsys.readouterr().out
    empty = tmp_path / "empty"
    with pytest.raises(SystemExit, match="no batch-1 plan"):
        main([str(empty)])
