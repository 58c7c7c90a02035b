"""The model actors, built in-process (no Ray), load what their spec asks for and serve it: packed Linear
layers included (the target rank once read ``q_proj.weight``, which a packed layer does not have), and traced
decoder layers or not."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from actors.draft import DraftActor
from actors.spec import ModelActorSpec
from actors.target import TargetRank, free_port
from sequoia_ray.config import SamplingParams
from sequoia_ray.engine import SpeculativeDecoder
from sequoia_ray.local import LocalPair
from sequoia_ray.models.draft_vocab import SubsetHead
from sequoia_ray.models.packed_linear import packed_count
from sequoia_ray.models.traced_layers import traced_count
from sequoia_ray.tree.plan import chain, k_ary

pytestmark = pytest.mark.usefixtures("keep_logging")  # tests/conftest.py


@pytest.mark.parametrize("linears,layers,vocab", [("packed", "traced", 40), ("aten", "eager", None),
                                                 ("aten", "auto", 40)])
def test_actors_load_their_linears_and_decode_the_targets_greedy_tokens(linears, layers, vocab):
    spec = ModelActorSpec("tiny-target", linears=linears, layers=layers)
    rank = TargetRank(0, 1, "127.0.0.1", free_port(), "gloo", spec)
    assert not dist.is_initialized()  # one rank has no collectives: no group (no gloo loop thread)
    draft = DraftActor(ModelActorSpec("tiny-draft", linears=linears, layers=layers, draft_vocab=vocab))
    models = (rank.worker.model, draft.worker.model)
    assert [packed_count(m) > 0 for m in models] == [linears == "packed"] * 2
    assert [traced_count(m) > 0 for m in models] == [layers != "eager"] * 2  # auto traces CPU models
    heads = [type(m.get_output_embeddings()) for m in models]
    assert heads == [torch.nn.Linear if linears == "aten" else heads[0], SubsetHead if vocab else heads[0]]
    reference = LocalPair.load("tiny-target", None, progress=False, linears="aten", layers="eager").decoder(chain(0))
    spec = SpeculativeDecoder(rank.worker, draft.worker, k_ary(2, 3))
    prompt = [5, 17, 33, 8]
    expected = reference.generate(prompt, SamplingParams(max_tokens=16)).token_ids
    assert spec.generate(prompt, SamplingParams(max_tokens=16)).token_ids == expected


def test_an_actor_whose_batcher_thread_died_reports_itself_broken():
    """Every call to such an actor fails ("this actor must be replaced"); its health check must say so, or Serve
    never replaces it."""
    import threading

    from actors.health import raise_if_unhealthy

    draft = DraftActor(ModelActorSpec("tiny-draft"))
    assert draft.health()["broken"] is None
    gone = threading.Thread(target=lambda: None)
    gone.start()
    gone.join()
    live, draft.batcher.thread = draft.batcher.thread, gone
    with pytest.raises(RuntimeError, match="batcher thread has died"):
        raise_if_unhealthy([draft.health()], 60.0, "draft actor")
    draft.batcher.thread = live
    draft.batcher.close()
