"""benchmarks/dynamic.py --real runs e2e.py's default real pair: the int8 draft on the CPU, as served (no
model is loaded: the load is stood in for)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import dynamic  # noqa: E402
import e2e  # noqa: E402

from sequoia_ray.config import DEFAULT_DRAFT_VOCAB  # noqa: E402


class Loaded(Exception):
    pass


def test_real_loads_e2es_default_pair(monkeypatch):
    monkeypatch.setattr(e2e, "resolve_device", lambda device: torch.device("cpu"))  # a CPU host, wherever run
    seen = {}

    def load(*args, **kw):
        seen.update(kw, args=args)
        raise Loaded

    monkeypatch.setattr(dynamic.LocalPair, "load", load)
    with pytest.raises(Loaded):
        dynamic.main(["--real"])
    served = e2e.parse_args([])
    assert (seen["draft_quantize"], seen["device"]) == (served.draft_quantize, served.device) == ("int8", "cpu")
    assert seen["dtype"] == served.dtype == "bfloat16" and seen["args"] == ()
    assert seen.get("draft_vocab", DEFAULT_DRAFT_VOCAB) == served.draft_vocab  # (LocalPair.load's default)


def test_an_extending_rule_is_capped_by_the_tokens_left():
    """The benchmark gave its rule to the draft worker (``DraftWorker(dynamic=...)``), which the engine knows
    nothing of: a tree extended past the tokens the request had left (a review: 7 levels grown for 3 tokens left,
    and past the draft's context). Given to the decoder, as served, the engine caps its extension."""
    from sequoia_ray.config import SamplingParams
    from sequoia_ray.draft import DynamicTrees
    from sequoia_ray.local import LocalPair
    from sequoia_ray.tree.plan import chain

    pair = LocalPair.tiny(device="cpu")
    rule = DynamicTrees(0.0, extend=4, extend_threshold=0.0)  # every node kept, every extension taken
    row = dynamic.run_prompt(pair, chain(2), rule, list(range(3, 11)), SamplingParams(max_tokens=3, seed=0))
    assert row["steps"] == 1 and row["levels/step"] == 2  # 3 tokens: the root's 2 levels below it, + the bonus
    row = dynamic.run_prompt(pair, chain(2), rule, list(range(3, 11)), SamplingParams(max_tokens=40, seed=0))
    assert row["levels/step"] > 2  # with tokens to spare the rule extends the 2-level chain
