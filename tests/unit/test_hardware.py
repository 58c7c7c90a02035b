"""The optimizer picks the known best (n, d) on synthetic t(n) and c; profiles round-trip and validate."""

from __future__ import annotations

import json

import pytest

from sequoia_ray.hardware import HardwareProfile, ProfileError, choose, hardware_id, time_forward
from sequoia_ray.tree.acceptance_vector import AcceptanceVector
from sequoia_ray.tree.dp import solve
from tests.tiny import tiny_model


def synthetic(t: dict[int, float], c: float) -> HardwareProfile:
    return HardwareProfile("test-hw", t, {w: c for w in (1, 2, 4, 8, 16, 32, 64)}, 0.1, 128, "float32")


def brute_force_best(table, prof, budgets):
    best = None
    for n in budgets:
        for d in range(1, table.max_depth + 1):
            plan = table.tree(n, d)
            levels = plan.num_levels
            cost = prof.t_of(plan.n) + prof.c_of(1) * (levels - 1)  # constant c: (levels - 1) draft forwards
            s = table.value(n, d) / cost
            if best is None or s > best[0] + 1e-12:
                best = (s, n, d)
    return best


def test_flat_t_and_free_draft_picks_the_biggest_deepest_tree():
    table = solve(AcceptanceVector.from_p([0.8, 0.1]), 64, 8)
    prof = synthetic({n: 1.0 for n in (1, 2, 4, 8, 16, 32, 64)}, c=1e-9)
    best, _ = choose(table, prof, budgets=(1, 2, 4, 8, 16, 32, 64))
    assert (best.n, best.d) == (64, 8)


def test_expensive_verification_picks_small_trees():
    table = solve(AcceptanceVector.from_p([0.8, 0.1]), 64, 8)
    prof = synthetic({1: 1.0, 2: 2.0, 4: 4.0, 8: 8.0, 16: 16.0, 32: 32.0, 64: 64.0}, c=0.01)  # t(n) = n
    best, _ = choose(table, prof, budgets=(1, 2, 4, 8, 16, 32, 64))
    assert best.n == 1 and best.predicted_speedup == pytest.approx(1 / 1.0)


@pytest.mark.parametrize("c", [0.02, 0.1, 0.3])
def test_choice_matches_brute_force_on_a_realistic_curve(c):
    table = solve(AcceptanceVector.from_p([0.72, 0.09, 0.04, 0.02]), 64, 10)
    t = {1: 1.0, 2: 1.02, 4: 1.05, 8: 1.15, 16: 1.4, 32: 2.0, 64: 3.3}
    budgets = (1, 2, 4, 8, 16, 32, 64)
    prof = synthetic(t, c)
    best, candidates = choose(table, prof, budgets=budgets)
    s, n, d = brute_force_best(table, prof, budgets)
    assert best.predicted_speedup == pytest.approx(s, rel=1e-12)
    assert len(candidates) == len(budgets) * 10
    assert best.predicted_speedup == max(x.predicted_speedup for x in candidates)


def test_profile_round_trip_and_validation(tmp_path):
    prof = synthetic({1: 1.0, 8: 1.2}, c=0.2)
    path = tmp_path / "p.json"
    prof.save(path)
    assert HardwareProfile.load(path) == prof
    bad = json.loads(path.read_text())
    bad["t"]["4"] = float("nan")
    path.write_text(json.dumps(bad))
    with pytest.raises(ProfileError, match="field 't'"):
        HardwareProfile.load(path)
    with pytest.raises(ProfileError, match="profiled max 8"):
        prof.t_of(16)


def test_time_forward_on_a_tiny_model_and_hardware_id():
    times = time_forward(tiny_model("llama"), (1, 4), context=16, repeats=2, warmup=1)
    assert set(times) == {1, 4} and all(v > 0 for v in times.values())
    assert hardware_id().startswith("cpu-") and hardware_id().endswith("c")
    assert hardware_id("H100", 2) == "H100-tp2" and hardware_id("L4") == "L4"
