"""Tree plans: structure, F(T), baselines, and the versioned JSON file with its validation."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from sequoia_ray.tree.acceptance_vector import AcceptanceError, AcceptanceVector
from sequoia_ray.tree.plan import (PlanError, TreePlan, carried_leaf, chain, expected_tokens, from_nested, k_ary, reach,
                                   specinfer)
from sequoia_ray.tree.plan_file import PlanFormatError, PlannedTree, Provenance
from sequoia_ray.tree.planning import plan_for


def test_structure_of_a_small_tree():
    plan = TreePlan((-1, 0, 0, 1, 1, 2, 3))
    assert plan.depth == (0, 1, 1, 2, 2, 2, 3)
    assert plan.rank == (0, 1, 2, 1, 2, 1, 1)
    assert plan.levels == ((0,), (1, 2), (3, 4, 5), (6,))
    assert plan.children[1] == (3, 4)
    assert plan.path(6) == (0, 1, 3, 6)
    mask = plan.ancestor_mask()
    for i in range(plan.n):
        assert set(np.flatnonzero(mask[i])) == set(plan.path(i))


@pytest.mark.parametrize(
    "parents,message",
    [((0, 0), "parents\\[0\\] must be -1"), ((-1, 1), "before its child"), ((-1, 0, 2), "before its child"),
     ((-1, 0, 0, 1, 2, 1), "breadth-first"), ((), "must be -1")],
)
def test_invalid_trees_are_rejected(parents, message):
    with pytest.raises(PlanError, match=message):
        TreePlan(parents)


def test_expected_tokens_by_hand():
    a = AcceptanceVector.from_p([0.5, 0.3])
    plan = from_nested([[[]], []])  # root -> (c1 -> g1), c2
    assert expected_tokens(plan, a) == pytest.approx(1 + 0.5 + 0.3 + 0.25)
    deep = AcceptanceVector.from_rows([[0.5, 0.3], [0.9, 0.0]])
    assert expected_tokens(plan, deep) == pytest.approx(1 + 0.5 + 0.3 + 0.5 * 0.9)
    assert expected_tokens(from_nested([[], [], []]), a) == pytest.approx(1.8)  # rank 3 beyond W: worth 0


@pytest.mark.parametrize("a,L", [(0.7, 4), (0.9, 7), (0.2, 1)])
def test_baselines(a: float, L: int):
    p = AcceptanceVector.from_p([a, (1 - a) * a])
    assert chain(L).n == L + 1 and chain(L).num_levels == L + 1
    assert expected_tokens(chain(L), p) == pytest.approx((1 - a ** (L + 1)) / (1 - a))
    two = specinfer(2, L)
    assert two.n == 2 * L + 1 and two.num_levels == L + 1
    assert expected_tokens(two, p) == pytest.approx(1 + a * (1 - a**L) / (1 - a) + p.rows[0][1] * (1 - a**L) / (1 - a))
    full = k_ary(2, L)
    assert full.n == 2 ** (L + 1) - 1
    s = a + p.rows[0][1]
    assert expected_tokens(full, p) == pytest.approx((1 - s ** (L + 1)) / (1 - s))


def planned(budget=12, depth=4) -> PlannedTree:
    acceptance = AcceptanceVector.from_p([0.62, 0.17, 0.06])
    prov = Provenance(draft="d", target="t", temperature=0.6, hardware="cpu-test-2c")
    return plan_for(acceptance, budget, depth, prov)[0]


def test_json_round_trip_is_exact(tmp_path):
    original = planned()
    path = tmp_path / "plan.json"
    original.save(path)
    loaded = PlannedTree.load(path)
    assert loaded == original
    assert loaded.expected_tokens == original.expected_tokens  # bit-exact float
    assert json.loads(path.read_text())["schema_version"] == 1


def corrupt(obj: dict, path: tuple, value) -> dict:
    obj = json.loads(json.dumps(obj))
    target = obj
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    return obj


@pytest.mark.parametrize(
    "path,value,field",
    [
        (("schema_version",), 2, "schema_version"),
        (("parents",), [-1, 2, 0], "parents"),
        (("parents",), [-1, 0, 1, 0], "parents"),
        (("parents",), "abc", "parents"),
        (("expected_tokens",), float("nan"), "expected_tokens"),
        (("expected_tokens",), 9.0, "expected_tokens"),
        (("acceptance", "p"), [0.5, float("nan")], "acceptance"),
        (("acceptance", "reject"), 0.9, "acceptance"),
        (("budget",), 2, "budget"),
        (("max_depth",), 1, "max_depth"),
        (("provenance", "temperature"), -1, "provenance.temperature"),
        (("provenance",), {"gpu": "x"}, "provenance"),
        (("nodes",), 999, "nodes"),  # said wrong: loaded as the parents' tree without a word
        (("depth",), 2, "depth"),
        (("nodes",), True, "nodes"),
    ],
)
def test_corrupted_fields_name_the_field_and_file(tmp_path, path, value, field):
    bad = corrupt(planned().to_dict(), path, value)
    file = tmp_path / "bad.json"
    file.write_text(json.dumps(bad))
    with pytest.raises(PlanFormatError) as info:
        PlannedTree.load(file)
    assert str(file) in str(info.value) and f"'{field}'" in str(info.value)


def test_truncated_and_missing_files(tmp_path):
    file = tmp_path / "plan.json"
    file.write_text(planned().dumps()[:50])
    with pytest.raises(PlanFormatError, match="not valid JSON"):
        PlannedTree.load(file)
    with pytest.raises(PlanFormatError, match="cannot read"):
        PlannedTree.load(tmp_path / "nope.json")
    file.write_text("[1, 2]")
    with pytest.raises(PlanFormatError, match="expected a JSON object"):
        PlannedTree.load(file)


@pytest.mark.parametrize(
    "p,reject,message",
    [([0.5, -0.1], None, "p\\[2\\] = -0.1"), ([0.7, 0.6], None, "sum of p is 1.3"), ([float("inf")], None, "p\\[1\\]"),
     ([0.5], 0.2, "sum\\(p\\) \\+ reject = 0.7"), ([], None, "no rows|non-empty")],
)
def test_invalid_acceptance_vectors(p, reject, message):
    with pytest.raises(AcceptanceError, match=message):
        AcceptanceVector.from_p(p, reject)


def test_acceptance_parse_forms(tmp_path):
    assert AcceptanceVector.parse("0.5, 0.25").reject == (0.25,)
    file = tmp_path / "acc.json"
    file.write_text(json.dumps({"p": [[0.5, 0.2], [0.7]], "reject": [0.3, 0.3]}))
    depth_indexed = AcceptanceVector.parse(str(file))
    assert depth_indexed.rows == ((0.5, 0.2), (0.7, 0.0)) and depth_indexed.depth_indexed
    with pytest.raises(AcceptanceError, match="neither a JSON file"):
        AcceptanceVector.parse("0.5,abc")
    with pytest.raises(AcceptanceError, match="does not exist"):
        AcceptanceVector.parse(str(tmp_path / "missing.json"))
    (tmp_path / "folder.json").mkdir()
    with pytest.raises(AcceptanceError, match="folder.json cannot be read"):  # was a bare IsADirectoryError
        AcceptanceVector.parse(str(tmp_path / "folder.json"))
    with pytest.raises(AcceptanceError, match="empty field at rank 2"):  # was read as (0.6, 0.1): rank 3 as rank 2
        AcceptanceVector.parse("0.6,,0.1")
    assert AcceptanceVector.parse("0.6,0.2,").rows == ((0.6, 0.2),)  # a trailing comma is no rank
    assert math.isclose(sum(AcceptanceVector.parse("0.3,0.3,0.4").rows[0]), 1.0)


def test_the_carried_leaf_is_the_chance_the_accepted_path_ends_at_a_leaf():
    """The draft forwards inner nodes only, so the next step's first draft forward also carries the accepted leaf:
    a chain of 2 with p[1] = 0.8 ends at its leaf with 0.8 x 0.8; a root with two leaf children with p[1] + p[2];
    k_ary(2, 2) with (p[1] + p[2])^2 (its four leaves); the root-only tree runs no draft."""
    p = AcceptanceVector.from_p([0.8, 0.1])
    assert carried_leaf(chain(2), p) == pytest.approx(0.64)
    assert carried_leaf(k_ary(2, 1), p) == pytest.approx(0.9)
    assert carried_leaf(k_ary(2, 2), p) == pytest.approx(0.81)
    assert carried_leaf(chain(0), p) == 0.0
    # reach is what expected_tokens sums: G = 1 + 0.8 + 0.64 for the chain of 2
    assert reach(chain(2), p).tolist() == pytest.approx([1.0, 0.8, 0.64])
    assert expected_tokens(chain(2), p) == pytest.approx(2.44)


@pytest.mark.parametrize("p, what", [([0.5] + [0.0] * 1_024, "1 rows of up to 1025 ranks"),
                                     ([[0.5]] * 129, "129 rows of up to 1 ranks")])
def test_a_plan_file_with_a_vector_wider_or_deeper_than_any_plan_is_refused(tmp_path, p, what):
    """Serving runs the DP on a stored file's vector, whose cost grows with its width and rows; no plan uses more
    than MAX_PLAN_NODES ranks or MAX_PLAN_DEPTH rows, so a file with more is refused, naming the field."""
    obj = planned().to_dict()
    obj["acceptance"] = {"p": p}
    obj["expected_tokens"] = expected_tokens(planned().plan, AcceptanceVector.from_dict(obj["acceptance"]))
    file = tmp_path / "wide.json"
    file.write_text(json.dumps(obj))
    with pytest.raises(PlanFormatError, match=f"{file}: field 'acceptance': {what}; a plan uses at most 128 rows"):
        PlannedTree.load(file)
    obj["acceptance"] = {"p": p[:1024] if not isinstance(p[0], list) else p[:128]}
    obj["expected_tokens"] = expected_tokens(planned().plan, AcceptanceVector.from_dict(obj["acceptance"]))
    assert PlannedTree.loads(json.dumps(obj)).acceptance.width <= 1024  # the most a plan can use: loads


@pytest.mark.parametrize("build, message", [(lambda: chain(-1), "length = -1 must be >= 0"),
                                            (lambda: k_ary(2, -1), "levels_below_root = -1 must be >= 0"),
                                            (lambda: k_ary(0, 2), "k = 0 must be >= 1"),
                                            (lambda: specinfer(2, 0), "length = 0 must be >= 1")])
def test_a_bad_builder_argument_is_named_as_passed(build, message):
    """chain(-1) said "length = 0 must be >= 1" (the level count it derives): the value named was not the one
    passed, and 0 is allowed (the root alone)."""
    with pytest.raises(PlanError, match=f"^{message}$"):
        build()
    assert chain(0).n == 1 and k_ary(3, 0).n == 1
