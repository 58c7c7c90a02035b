"""benchmarks/e2e.py's interleaving: every config meets every prompt, in an order that rotates, and the
figures are each config's own sums (no model is loaded)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from e2e import run_configs  # noqa: E402


def _configs(calls: list, speeds: dict[str, float]):
    """Fake configs: each prompt of length L gives L tokens in L / speed seconds and L / 2 steps (None for
    'assisted', which has no steps); every call is logged as (name, prompt, first_seed)."""
    def make(name):
        def run(prompts, first_seed=0):
            calls.append((name, tuple(prompts[0]), first_seed))
            tokens = sum(len(p) for p in prompts)
            return tokens, tokens / speeds[name], (None if name == "assisted" else tokens // 2)
        return name, run
    return [make(name) for name in speeds]


def test_configs_are_interleaved_prompt_by_prompt_with_a_rotating_order():
    calls: list = []
    speeds = {"target alone": 2.0, "assisted": 3.0, "tree": 5.0}
    by_kind = {"code": [[1] * 10, [2] * 20], "prose": [[3] * 4]}
    rows = run_configs(_configs(calls, speeds), by_kind, 0.0)
    timed = calls[3:]  # after one warm-up call per config (the first code prompt's first 8 tokens)
    assert [c[1] for c in calls[:3]] == [(1,) * 8] * 3
    assert [c[0] for c in timed] == ["target alone", "assisted", "tree",  # prompt 1: as given
                                     "assisted", "tree", "target alone",  # prompt 2: rotated by one
                                     "tree", "target alone", "assisted"]  # prompt 3: by two
    assert [(c[1][0], c[2]) for c in timed[::3]] == [(1, 0), (2, 1), (3, 0)]  # each kind's prompts seeded 0, 1, ...
    got = {(r["kind"], r["config"]): r for r in rows}
    assert got[("code", "tree")]["tok/s"] == pytest.approx(5.0)
    assert got[("code", "tree")]["tokens"] == 30
    assert got[("code", "tree")]["x target"] == pytest.approx(2.5)
    assert got[("prose", "assisted")]["x target"] == pytest.approx(1.5)
    assert got[("code", "assisted")]["tok/step"] == "-"
    assert got[("code", "tree")]["tok/step"] == pytest.approx(30 / 15)


def test_a_config_slowed_only_while_the_host_is_slow_is_not_singled_out():
    """The host halves its speed after the first prompt: interleaved, two equal configs still measure equal
    (run one config after the other, as before, the second would measure half the first)."""
    calls: list = []
    clock = {"n": 0}

    def make(name):
        def run(prompts, first_seed=0):
            clock["n"] += 1
            slow = 2.0 if clock["n"] > 4 else 1.0  # the 2 warm-ups and the first prompt's 2 calls run fast
            return 10, slow, 5
        return name, run
    rows = run_configs([make("a"), make("b")], {"code": [[1] * 10] * 2, "prose": [[2] * 10]}, 0.0)
    code = {r["config"]: r["tok/s"] for r in rows if r["kind"] == "code"}
    assert code["a"] == pytest.approx(code["b"]) == pytest.approx(20 / 3)


def test_summary_takes_each_variant_by_its_own_name_and_marks_a_missing_one():
    from types import SimpleNamespace

    from e2e import summarize

    def row(config, x):
        return {"T": 0.0, "kind": "code", "config": config, "tok/s": x, "x target": x, "x assisted": x / 2,
                "x best fixed": x / 3}
    rows = [row("grid n=4 d=4", 3.0), row("grid n=8 d=6", 3.5), row("SERVED n=8 d=4", 2.0),
            row("ADAPTIVE from n=8 d=4", 2.1), row("DYNAMIC from n=8 d=4", 2.2),
            row("ADAPTIVE+DYNAMIC from n=8 d=4", 2.3), row("DYNAMIC+EXTEND 4 from n=8 d=4", 2.4)]
    [summary] = summarize(rows, {0.0: (SimpleNamespace(predicted_speedup=1.9), None)})
    assert summary["best fixed"] == "n=8 d=6" and summary["predicted"] == 1.9
    assert [summary[f"{v} x target"] for v in ("adaptive", "dynamic", "both", "extend")] == [2.1, 2.2, 2.3, 2.4]
    assert summary["all x target"] == "-"  # no ADAPTIVE+DYNAMIC+EXTEND row (run without --dynamic-extend)
    rows.append(row("ADAPTIVE+DYNAMIC+EXTEND 4 from n=8 d=4", 2.5))
    [summary] = summarize(rows, {0.0: (SimpleNamespace(predicted_speedup=1.9), None)})
    assert summary["all x target"] == 2.5 and summary["both x target"] == 2.3 and summary["extend x target"] == 2.4


def test_every_variant_name_maps_back_to_its_column():
    from e2e import VARIANTS, variant

    for column, (name, _, dynamic) in VARIANTS.items():
        label = f"{name} 12" if dynamic == "extend" else name
        assert variant(f"{label} from n=16 d=5") == column
    assert variant("SERVED n=16 d=5") is None and variant("grid n=4 d=4") is None and variant("ADAPTIVE") is None
