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


def test_assisted_default_is_the_drafts_own_at_every_temperature(monkeypatch):
    """The fixed-k runs set the draft's generation_config; the next temperature's ``assisted default`` still
    runs with the draft's own defaults (before, it read back the last k run as its "default")."""
    from types import SimpleNamespace

    import e2e

    cfg = SimpleNamespace(num_assistant_tokens=20, num_assistant_tokens_schedule="heuristic")
    pair = SimpleNamespace(draft=SimpleNamespace(model=SimpleNamespace(generation_config=cfg)))
    seen = []
    monkeypatch.setattr(e2e, "run_assisted", lambda *a: seen.append(
        (cfg.num_assistant_tokens, cfg.num_assistant_tokens_schedule)) or (1, 1.0, None))
    for temperature in (0.0, 0.6):
        for _, run in e2e.assisted_configs(pair, temperature, 8):
            run([[1, 2]])
        assert (cfg.num_assistant_tokens, cfg.num_assistant_tokens_schedule) == (20, "heuristic")  # restored
    assert seen == [(20, "heuristic"), (3, "constant"), (5, "constant"), (8, "constant")] * 2


def test_assisted_tokens_stop_before_the_eos_as_ours_do():
    """transformers returns the EOS it stopped on (and pads after it); our decoder's count stops before it."""
    from types import SimpleNamespace

    import torch

    import e2e

    new = [[5, 6, 9, 9], [5, 6, 7, 8]]  # stopped on EOS 9 (then a pad), and not stopped

    class Target:
        device = torch.device("cpu")

        def generate(self, ids, **kw):
            return torch.cat([ids, torch.tensor([new.pop(0)])], dim=1)

    pair = SimpleNamespace(target=SimpleNamespace(model=Target(), eos_ids=(9, 3)), draft=SimpleNamespace(model=None))
    assert e2e.run_assisted(pair, [[1, 2, 3]], 0.0, 4)[0] == 2
    assert e2e.run_assisted(pair, [[1, 2, 3]], 0.0, 4)[0] == 4
    assert e2e.until_eos([3, 5], (9, 3)) == 0 and e2e.until_eos([], (9,)) == 0


def test_the_hindsight_grid_takes_any_n_and_a_bad_one_fails_at_parsing():
    """A grid n above 64 gets its tree (the DP is sized for the largest n asked), and a bad --grid-n fails
    before anything loads."""
    from types import SimpleNamespace

    import e2e

    from sequoia_ray.tree.acceptance_vector import AcceptanceVector
    from sequoia_ray.tree.planning import plan_for
    from tests.unit.test_request_trees import P, profile

    planned, _ = plan_for(AcceptanceVector.from_p(P), 8, 4)
    result = SimpleNamespace(n=8, d=4, model_n=8, model_d=4)
    args = SimpleNamespace(grid_n=[4, 100], grid_d=[4], dynamic_extend=0, max_tokens=8)
    configs = dict(e2e.plan_configs(None, 0.0, result, planned, args, profile()))
    big = configs["grid n=100 d=4"].args[1]  # functools.partial(run_ours, pair, plan, ...)
    assert big.n == 1 + 3 + 9 + 27  # n = 100 asked of the DP (sized 64 before): all 4 levels of P's 3 ranks hold
    assert e2e.parse_args(["--grid-n", "4,100"]).grid_n == [4, 100]
    assert e2e.parse_args([]).grid_d == [4, 6, 8, 10, 12]
    for bad in ("4,0", "4,x", ""):
        with pytest.raises(SystemExit):
            e2e.parse_args(["--grid-n", bad])
