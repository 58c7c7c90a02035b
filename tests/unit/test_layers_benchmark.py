"""benchmarks/layers.py on the tiny pair: both ways run on the same weights, alternated, the switch really
switches, and a traced forward that drifted from the stock one is reported, not hidden."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from sequoia_ray.local import LocalPair
from sequoia_ray.models.traced_layers import TracedForward, trace_layers

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import layers  # noqa: E402


@pytest.fixture()
def pair():
    pair = LocalPair.tiny()
    for model in (pair.target.model, pair.draft.model):
        trace_layers(model, "traced")
    return pair


def _traced(model) -> list[bool]:
    return [isinstance(layer.__dict__.get("forward"), TracedForward) for layer in model.model.layers]


def test_the_switch_turns_every_traced_layer_off_and_on(pair):
    switch = layers.Switch(pair.target.model, pair.draft.model)
    assert len(switch.layers) == len(pair.target.model.model.layers) + len(pair.draft.model.model.layers)
    switch(False)
    assert not any(_traced(pair.target.model) + _traced(pair.draft.model))
    switch(True)
    assert all(_traced(pair.target.model) + _traced(pair.draft.model))


class Recording(layers.Switch):
    def __init__(self, *models) -> None:
        super().__init__(*models)
        self.seen: list[bool] = []

    def __call__(self, traced: bool) -> None:
        self.seen.append(traced)
        super().__call__(traced)


@pytest.mark.parametrize("batch,q", [(1, 1), (3, 4)])
def test_forward_rows_alternate_and_check_bit_for_bit(pair, batch, q):
    switch = Recording(pair.target.model)
    row = layers.forwards(pair.target.model, switch, batch, q, repeats=3, vocab=60)
    assert switch.seen == [False, True, True, False, False, True, True, False, True]  # alternated; ends traced
    assert row["bitwise"] is True and row["eager ms"] > 0 and row["traced ms"] > 0
    assert row["traced / eager"] > 0 and all(_traced(pair.target.model))


def test_a_traced_forward_that_drifts_is_reported(pair):
    for layer in pair.target.model.model.layers:
        after = layer.forward.after
        layer.forward.after = lambda attended, residual, after=after: after(attended, residual) + 1e-3
    row = layers.forwards(pair.target.model, layers.Switch(pair.target.model), 2, 2, repeats=1, vocab=60)
    assert row["bitwise"] is False


def test_decoding_counts_both_ways_and_compares_their_tokens(pair, monkeypatch):
    monkeypatch.setattr(layers, "PROMPTS", Path(__file__).resolve().parents[2] / "benchmarks" / "prompts.jsonl")
    row = layers.decoding(pair, layers.Switch(pair.target.model, pair.draft.model), limit=2, rounds=1,
                          max_tokens=6)
    assert row["runs"] == 2 and row["same tokens"] == "2/2"  # fp32 tiny pair: traced is bitwise the stock
    assert row["eager tok/s"] > 0 and row["traced tok/s"] > 0
    assert all(_traced(pair.target.model) + _traced(pair.draft.model))  # nothing left switched off
