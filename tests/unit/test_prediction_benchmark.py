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


def _tiny_plan(hardware: str, temperature: float, n: int, **prov) -> tuple[PlannedTree, PlanKey]:
    acceptance = AcceptanceVector.from_p([0.6, 0.2])
    table = solve(acceptance, 4, 3)
    provenance = Provenance(hardware=hardware, temperature=temperature, draft="tiny-draft", target="tiny-target",
                            predicted_speedup=1.4 if n > 1 else 1.0, measured_speedup=1.3, **prov)
    planned = PlannedTree(table.tree(n, 3), acceptance, n, 3, table.value(n, 3), provenance)
    return planned, PlanKey(hardware, "tiny-draft", "tiny-target", temperature)


def test_measure_runs_this_machines_tree_plans_with_the_recorded_configuration(tmp_path):
    from prediction import measure_rows

    from sequoia_ray.local import LocalPair
    from sequoia_ray.prompts import Prompt

    store = PlanStore(str(tmp_path))
    for planned, key in (_tiny_plan("here", 0.0, 4, dtype="float32", draft_quantize="int8", linears="aten"),
                         _tiny_plan("here", 0.6, 1, dtype="float32"),  # the target alone: nothing to measure
                         _tiny_plan("elsewhere", 0.0, 4, dtype="float32")):  # another machine's plan
        store.publish_plan(planned, key)
    loaded = []

    def load(prov):
        loaded.append(prov)
        return LocalPair.tiny(device="cpu")

    prompts = [Prompt("def add(a, b):", kind="code"), Prompt("The weather today", kind="prose")]
    rows = measure_rows(str(tmp_path), prompts, repeats=2, max_tokens=6, hardware="here", load=load)
    assert [(r["T"], r["tree"]) for r in rows] == [(0.0, "n=4 d=3")]
    assert [(p.hardware, p.dtype, p.draft_quantize, p.linears) for p in loaded] == [("here", "float32", "int8", "aten")]
    row = rows[0]
    assert row["config"] == "float32/int8/aten" and row["prompts"] == 2 and len(row["repeats"]) == 2
    assert row["lo"] <= row["measured"] <= row["hi"] and row["lo"] > 0
    assert row["err"] == pytest.approx(1.4 / row["measured"] - 1)
    assert row["tok/step"] >= 1.0


def test_load_as_recorded_passes_the_provenance_configuration(monkeypatch):
    from prediction import load_as_recorded

    from sequoia_ray.local import LocalPair

    seen = {}
    monkeypatch.setattr(LocalPair, "load", classmethod(lambda cls, *a, **k: seen.update(args=a, kwargs=k)))
    load_as_recorded(Provenance(draft="d", target="t", dtype="bfloat16", draft_quantize="int8", linears="packed",
                                device="cpu", layers="eager", draft_vocab=65536))
    assert seen["args"] == ("t", "d")
    assert seen["kwargs"] == {"dtype": "bfloat16", "draft_quantize": "int8", "device": "cpu", "linears": "packed",
                              "layers": "eager", "draft_vocab": 65536, "progress": False}
    # nothing recorded: the loader's defaults, but the full draft head (a plan from before draft_vocab had it)
    load_as_recorded(Provenance(draft="d", target="t", device="cuda:1"))
    assert seen["kwargs"] == {"dtype": "float32", "draft_quantize": None, "device": "cuda", "linears": "auto",
                              "layers": "auto", "draft_vocab": None, "progress": False}


@pytest.mark.parametrize("served", [True, False])
def test_measure_charges_the_served_calls_the_prediction_counted(tmp_path, monkeypatch, served):
    """A plan whose overhead counts 0.01 / 0.04 target steps of calls on a profile of 50 ms steps: its runs are
    charged 0.5 / 2 ms a request and step (none with ``served_calls=False``), and the row says so."""
    from types import SimpleNamespace

    import prediction

    from sequoia_ray.measured_choice import Measured
    from sequoia_ray.prompts import Prompt

    store = PlanStore(str(tmp_path))
    store.publish_profile(HardwareProfile("here", {1: 1.0, 4: 1.1}, {1: 0.2, 4: 0.3}, 0.05, 64, "float32"))
    planned, key = _tiny_plan("here", 0.0, 4, dtype="float32", overhead=StepOverhead(calls=(0.01, 0.04)).to_dict())
    store.publish_plan(planned, key)
    seen = []
    pair = SimpleNamespace(encode=lambda text, chat: [1, 2, 3], target=SimpleNamespace(model=None),
                           draft=SimpleNamespace(model=None))

    def fake(target, draft, choices, prompts, params, *, batch, rounds, calls):
        seen.append(calls)
        return [None, Measured(choices[1], 1.2, 10.0, 2.0)]

    monkeypatch.setattr(prediction, "measure_choices", fake)
    rows = prediction.measure_rows(str(tmp_path), [Prompt("def add(a, b):", kind="code")], repeats=1, max_tokens=6,
                                   hardware="here", load=lambda prov: pair, served_calls=served)
    expected = (0.0005, 0.002) if served else (0.0, 0.0)
    assert seen == [pytest.approx(expected)] and rows[0]["calls ms"] == pytest.approx([1e3 * c for c in expected])
