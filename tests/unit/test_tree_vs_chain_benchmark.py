"""benchmarks/tree_vs_chain.py: the best tree against the best chain by the cost model. A chain is one of the
trees the DP weighs, so the tree never loses; with a certain top-1 draft token nothing beats the chain; with
acceptance spread over ranks and a flat target forward the tree wins; the chain is found by brute force."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from sequoia_ray.tree.acceptance_vector import AcceptanceVector
from sequoia_ray.tree.plan import chain, expected_tokens

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import tree_vs_chain  # noqa: E402

SPREAD = AcceptanceVector.from_p([0.45, 0.2, 0.1, 0.05], 0.2)


def test_a_certain_top_token_makes_the_chain_the_best_tree():
    sure = AcceptanceVector.from_p([1.0], 0.0)
    row = tree_vs_chain.compare(sure, tree_vs_chain.tiny_profile(), max_nodes=12, max_depth=12)
    assert row["tree / chain"] == pytest.approx(1.0)
    assert row["chain G"] == pytest.approx(12.0) and row["chain k"] == 11  # every draft token accepted


@pytest.mark.parametrize("hardware", ["this machine", "c / 4", "t flat to 64", "t flat, c / 4"])
def test_the_tree_never_loses_to_the_chain_and_the_chain_is_the_best_by_brute_force(hardware):
    profile = tree_vs_chain.what_ifs(tree_vs_chain.tiny_profile())[hardware]
    row = tree_vs_chain.compare(SPREAD, profile, max_nodes=16, max_depth=8)
    assert row["tree / chain"] >= 1 - 1e-9
    alone = profile.step_cost(chain(0))
    # a chain's leaf is its last token: accepted with p[1]^k, then the next step's draft forwards it too
    first = SPREAD.row(0)[0]
    speedups = [expected_tokens(chain(k), SPREAD) * alone / profile.step_cost(chain(k), carried=first ** k * (k > 0))
                for k in range(8)]
    assert row["chain x target"] == pytest.approx(max(speedups))
    assert row["chain k"] == max(range(8), key=speedups.__getitem__)


def test_a_flat_target_forward_lets_wide_trees_win():
    profiles = tree_vs_chain.what_ifs(tree_vs_chain.tiny_profile())
    cpu = tree_vs_chain.compare(SPREAD, profiles["this machine"], max_nodes=32, max_depth=8)
    flat = tree_vs_chain.compare(SPREAD, profiles["t flat to 64"], max_nodes=32, max_depth=8)
    assert flat["tree / chain"] > cpu["tree / chain"] > 1
    assert flat["tree n"] > cpu["tree n"]  # free tree tokens: a wider tree


def test_the_tiny_run_writes_a_row_per_temperature_kind_and_hardware(tmp_path, monkeypatch):
    out = tmp_path / "tvc.json"
    monkeypatch.setattr(sys, "argv", ["tree_vs_chain.py", "--tiny", "--temperatures", "0", "--tokens", "12",
                                      "--max-nodes", "8", "--max-depth", "6", "--out", str(out)])
    assert tree_vs_chain.main() == 0
    rows = json.loads(out.read_text())["rows"]
    assert {(r["kind"], r["hardware"]) for r in rows} == {(k, h) for k in ("code", "prose")
                                                         for h in tree_vs_chain.what_ifs(tree_vs_chain.tiny_profile())}
    assert all(r["tree / chain"] >= 1 - 1e-9 and r["steps"] > 0 for r in rows)
