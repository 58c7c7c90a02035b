"""benchmarks/calls.py compares what it says: the same trees, once through torch's pickling and once as lists."""

from __future__ import annotations

import pickle
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from calls import TorchPickled, trees  # noqa: E402


def test_the_two_wire_forms_carry_the_same_tree_one_through_torch():
    for name, (plan, tree) in trees().items():
        old = TorchPickled(tree.tokens, tree.dists, tree.plan)
        a, b = pickle.dumps(old), pickle.dumps(tree)
        assert b"_rebuild_tensor" in a and b"_rebuild_tensor" not in b, name
        x, y = pickle.loads(a), pickle.loads(b)
        assert torch.equal(x.tokens, y.tokens) and list(x.dists) == list(y.dists), name
        assert all(torch.equal(x.dists[n].probs, y.dists[n].probs) for n in x.dists), name
        assert tree.tokens.numel() == plan.n or plan.n == 1, name
    sampled = [tree for name, (_, tree) in trees().items() if "sampled" in name]
    assert len(sampled) == 1 and len(sampled[0].dists) == 7
