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
