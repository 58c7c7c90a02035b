"""benchmarks/weight_layout.py on the tiny pair in bf16: one model holds every layout, the switch picks the
kernel of each forward, and the rows it reports come from forwards that really ran in each layout."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from sequoia_ray.local import LocalPair
from sequoia_ray.models.loading import TINY_DRAFT, TINY_TARGET
from sequoia_ray.models.packed_linear import ROWS_HINT, PackedLinear
from sequoia_ray.prompts import Prompt

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import weight_layout  # noqa: E402

needs_bf16 = pytest.mark.skipif(not torch.ops.mkldnn._is_mkldnn_bf16_supported(), reason="no oneDNN bf16 here")
HINTS = [1, None]


@pytest.fixture(scope="module")
def pair():
    return LocalPair.load(TINY_TARGET, TINY_DRAFT, dtype="bfloat16", progress=False, linears="aten")


@needs_bf16
def test_every_linear_holds_each_layout_and_the_switch_picks_it(pair):
    model = pair.target.model
    ids = torch.tensor([[5, 17, 42, 8, 60]])
    with torch.inference_mode():
        aten = model(ids).logits
    linears = sum(type(m) is torch.nn.Linear for m in model.modules())
    switch = weight_layout.install(model, HINTS)
    layers = [m for m in model.modules() if isinstance(m, weight_layout.Layouts)]
    assert len(layers) == linears > 0 and not any(type(m) is torch.nn.Linear for m in model.modules())
    assert all(set(m.packed) == set(HINTS) for m in layers)
    assert weight_layout.bitwise(model, switch, HINTS, aten, ids) == {"hint 1": True, "no hint": True}
    switch["hint"] = 7  # a layout nobody packed: the forward must use the switch, so it fails
    with pytest.raises(KeyError):
        model(ids)
    switch["hint"] = None
    rows = weight_layout.forwards(model, switch, HINTS, [(1, 1), (2, 3)], context=16, rounds=2)
    assert [r["B x s"] for r in rows] == ["1x1", "2x3"]
    assert all(r["no hint/hint 1 paired"] > 0 and r["hint 1 fastest ms"] <= r["hint 1 median ms"] for r in rows)
    prompts = [Prompt(text="def add(a, b):", kind="code", chat=False)]
    gen = weight_layout.generation(pair, switch, HINTS, prompts, max_tokens=6)
    assert [g["mode"] for g in gen] == ["alone", "tree"]
    assert all(g["same text as hint 1"] == "1/1" and g["no hint tok/s"] > 0 for g in gen)


@needs_bf16
def test_the_shipped_layout_is_the_unhinted_one_and_exact():
    """PackedLinear reorders with ROWS_HINT (None: oneDNN's own choice, 32 outputs wide here) and gives
    aten's result bit for bit in bf16."""
    assert ROWS_HINT is None
    torch.manual_seed(0)
    linear = torch.nn.Linear(96, 160).bfloat16()
    x = torch.randn(3, 96).bfloat16()
    with torch.inference_mode():
        assert torch.equal(PackedLinear(linear)(x), linear(x))


def test_one_round_gives_its_ratio_as_median_and_quartiles():
    """``--rounds 1``: one paired ratio, which is its median and both quartiles (``statistics.quantiles``,
    called directly before, needs two). The tiny target in float32: any CPU."""
    model = LocalPair.load(TINY_TARGET, None, dtype="float32", progress=False, linears="aten").target.model
    switch = weight_layout.install(model, HINTS)
    [row] = weight_layout.forwards(model, switch, HINTS, [(1, 1)], context=16, rounds=1)
    ratio = row["no hint/hint 1 paired"]
    assert ratio == row["no hint median ms"] / row["hint 1 median ms"]
    assert row["no hint/hint 1 quartiles"] == f"{ratio:.3f}-{ratio:.3f}"
