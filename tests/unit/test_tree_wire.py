"""A DraftTree crosses between actors pickled with its host tensors as plain lists (torch's pickling of each
tensor cost more than the rest of a Ray call): the round trip is exact for every dtype, keeps the tree's plan,
catch-up count and node order, repacks the dists as ``DraftTree.to`` does, and leaves accelerator tensors
to torch (their device kept)."""

from __future__ import annotations

import pickle

import pytest
import torch

from sequoia_ray.draft import DraftTree
from sequoia_ray.sampling import SparseDist
from sequoia_ray.tree.plan import k_ary


def round_trip(tree: DraftTree) -> tuple[DraftTree, bytes]:
    data = pickle.dumps(tree, protocol=5)
    return pickle.loads(data), data


def test_a_greedy_tree_round_trips_as_a_list():
    plan = k_ary(2, 2)
    tree = DraftTree(torch.tensor([151_643, 0, 2**40, 7, 8, 9, 10]), {}, plan, prefill_beside=12)
    back, data = round_trip(tree)
    assert torch.equal(back.tokens, tree.tokens) and back.tokens.dtype == torch.int64
    assert back.dists == {} and back.plan == plan and back.prefill_beside == 12
    assert b"_rebuild_tensor" not in data and len(data) < 300  # no torch storage in it


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_a_sampled_trees_dists_come_back_exactly_packed_and_in_order(dtype):
    g = torch.Generator().manual_seed(0)
    nodes = (5, 0, 2)  # not sorted: the order is the draw's
    dists = {n: SparseDist(torch.randperm(150_000, generator=g)[:32], torch.rand(32, generator=g).to(dtype))
             for n in nodes}
    tree = DraftTree(torch.randint(0, 150_000, (7,), generator=g), dists).to("cpu")
    back, data = round_trip(tree)
    assert list(back.dists) == list(nodes) and back.plan is None and back.prefill_beside == 0
    for n in nodes:
        assert torch.equal(back.dists[n].tokens, dists[n].tokens) and back.dists[n].tokens.dtype == torch.int64
        assert torch.equal(back.dists[n].probs, dists[n].probs) and back.dists[n].probs.dtype == dtype
    assert len({d.tokens.untyped_storage().data_ptr() for d in back.dists.values()}) == 1
    assert len({d.probs.untyped_storage().data_ptr() for d in back.dists.values()}) == 1
    assert b"_rebuild_tensor" not in data


def test_a_tree_off_the_host_keeps_its_device():
    tree = DraftTree(torch.arange(3, device="meta"), {1: SparseDist(torch.arange(2, device="meta"),
                                                                    torch.ones(2, device="meta") / 2)})
    back, _ = round_trip(tree)
    assert back.tokens.device.type == "meta" and back.dists[1].probs.device.type == "meta"
    assert back.tokens.shape == (3,) and back.dists[1].tokens.shape == (2,)


def test_a_wire_form_naming_no_torch_dtype_is_refused():
    from sequoia_ray.draft import _tree_from_wire

    with pytest.raises(ValueError, match="'manual_seed'.*not a torch dtype"):
        _tree_from_wire((([1, 2], "manual_seed"),), [], [], None, 0)
