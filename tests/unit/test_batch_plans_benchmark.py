"""benchmarks/batch_plans.py measures the prompts as the profiler and the service encode them (chat prompts
through the chat template), with the tiny pair standing in for the real one and no plan store."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import batch_plans  # noqa: E402

import sequoia_ray.local  # noqa: E402
import sequoia_ray.measured_choice  # noqa: E402
import sequoia_ray.plan_store  # noqa: E402
from sequoia_ray.prompts import load_prompts  # noqa: E402
from sequoia_ray.tree.plan import TreePlan  # noqa: E402


class Measured(Exception):
    pass


def test_prompts_are_encoded_as_served(monkeypatch, tmp_path):
    pair = sequoia_ray.local.LocalPair.tiny(device="cpu")
    planned = SimpleNamespace(plan=TreePlan((-1, 0)), provenance=SimpleNamespace(overhead=None))
    monkeypatch.setattr(sequoia_ray.local.LocalPair, "load", lambda *a, **kw: pair)
    monkeypatch.setattr(sequoia_ray.plan_store, "PlanStore",
                        lambda root: SimpleNamespace(fetch_plan=lambda key: (planned, None)))
    seen = {}

    def measure(target, draft, choices, prompts, params, **kw):
        seen["prompts"] = prompts
        raise Measured

    monkeypatch.setattr(sequoia_ray.measured_choice, "measure_choices", measure)
    monkeypatch.setattr(sys, "argv", ["batch_plans.py", "--plan-store", str(tmp_path), "--batches", "1",
                                      "--threads", str(torch.get_num_threads())])
    with pytest.raises(Measured):
        batch_plans.main()
    texts = load_prompts(batch_plans.HERE / "prompts.jsonl")
    assert any(p.chat for p in texts)
    assert seen["prompts"] == [pair.encode(p.text, chat=p.chat) for p in texts]
