"""The draft's LM head on part of the vocabulary (sequoia_ray.models.draft_vocab): the kept ids' logits are the
full head's, the rest -inf; the draft never proposes a left-out id, and decoding stays the target's."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch

from sequoia_ray.config import SamplingParams
from sequoia_ray.draft import DraftWorker
from sequoia_ray.engine import SpeculativeDecoder
from sequoia_ray.local import LocalPair
from sequoia_ray.models.draft_vocab import SubsetHead, kept_ids, restrict_head
from sequoia_ray.models.loading import TINY_DRAFT, load_model, quantize_int8
from sequoia_ray.models.tiny import tiny_model
from sequoia_ray.models.tree_lm import KVSession
from sequoia_ray.target import TargetWorker
from sequoia_ray.tree.plan import k_ary

NO_SPECIALS = SimpleNamespace()  # a tokenizer without special or added tokens


def test_kept_ids_are_the_lowest_and_every_special_and_added_token():
    tok = SimpleNamespace(all_special_ids=[90, 2], added_tokens_decoder={95: "<x>", 500: "<beyond>"}, eos_token_id=93)
    assert kept_ids(tok, 5, 97) == [0, 1, 2, 3, 4, 90, 93, 95]  # 500 is beyond the model's 97 rows
    assert kept_ids(NO_SPECIALS, 200, 97) == list(range(97))


def test_the_subset_heads_logits_are_the_full_heads_on_kept_ids_and_minus_inf_elsewhere():
    model = tiny_model(vocab=97)
    full = model.lm_head
    tok = SimpleNamespace(all_special_ids=[1], added_tokens_decoder={96: "<end>"})
    assert restrict_head(model, tok, 30)
    head = model.get_output_embeddings()
    assert isinstance(head, SubsetHead) and head.ids.tolist() == [*range(30), 96]
    hidden = torch.randn(3, 5, 64)
    got, want = head(hidden), full(hidden)  # [3, 5, 97]
    kept = torch.zeros(97, dtype=torch.bool)
    kept[head.ids] = True
    torch.testing.assert_close(got[..., kept], want[..., kept])
    assert torch.isneginf(got[..., ~kept]).all()
    # the model's own forward (what transformers' generate calls) goes through it too
    logits = model(input_ids=torch.tensor([[5, 6, 7]])).logits[0, -1]
    assert torch.isneginf(logits[~kept]).all() and torch.isfinite(logits[kept]).all()


def test_nothing_to_restrict_keeps_the_full_head_and_bad_sizes_are_named():
    model = tiny_model(vocab=97)
    full = model.lm_head
    assert not restrict_head(model, NO_SPECIALS, None)
    assert not restrict_head(model, NO_SPECIALS, 97)  # every id kept anyway
    assert model.lm_head is full
    for bad in (0, -1, 2.5, True, "64k"):
        with pytest.raises(ValueError, match=f"draft vocabulary size {bad!r} must be an integer >= 1"):
            restrict_head(model, NO_SPECIALS, bad)
    with pytest.raises(ValueError, match="draft vocabulary size 0"):
        load_model(TINY_DRAFT, draft_vocab=0, progress=False)


def test_quantising_after_restricting_quantises_the_subset():
    model = tiny_model(vocab=97)
    reference = quantize_int8(copy.deepcopy(model))
    restrict_head(model, NO_SPECIALS, 40)
    model = quantize_int8(model)
    head = model.get_output_embeddings()
    assert isinstance(head, SubsetHead) and hasattr(head.linear, "_packed_params")  # torch.ao's dynamic int8 Linear
    hidden = torch.randn(4, 64)
    # per-channel int8: each kept row is quantised as in the full head
    torch.testing.assert_close(head(hidden)[:, :40], reference.lm_head(hidden)[:, :40])


def test_load_model_restricts_a_drafts_head_and_refuses_a_tensor_parallel_one():
    loaded = load_model(TINY_DRAFT, draft_vocab=50, progress=False, layers="eager")
    head = loaded.model.get_output_embeddings()
    assert isinstance(head, SubsetHead) and set(range(50)) <= set(head.ids.tolist())
    with pytest.raises(ValueError, match="draft_vocab 50: a tensor-parallel model is a target"):
        load_model(TINY_DRAFT, draft_vocab=50, progress=False, tp_plan="auto")


def test_soft_capping_keeps_left_out_ids_at_minus_inf():
    model = tiny_model(vocab=97)
    model.config.final_logit_softcapping = 5.0
    restrict_head(model, NO_SPECIALS, 20)
    logits = KVSession(model).head(torch.randn(2, 64))  # [2, 97]
    assert torch.isneginf(logits[:, 20:]).all() and (logits[:, :20].abs() <= 5.0).all()


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_the_draft_proposes_only_kept_ids_and_greedy_output_is_the_targets(temperature):
    pair = LocalPair.tiny(device="cpu")
    restricted = copy.deepcopy(pair.draft.model)
    assert restrict_head(restricted, pair.draft.tokenizer, 40)
    kept = set(restricted.get_output_embeddings().ids.tolist())
    plan, prompt = k_ary(3, 3), pair.encode("def fib(n): return", chat=False)
    params = SamplingParams(max_tokens=32, temperature=temperature, seed=7, ignore_eos=True)
    worker = DraftWorker(restricted)
    worker.start("r", prompt, params, seed=1)
    tree = worker.grow("r", plan)
    assert set(tree.tokens[1:].tolist()) <= kept  # the root is the prompt's last token
    for dist in tree.dists.values():
        assert set(dist.tokens.tolist()) <= kept
    worker.finish("r")
    decoders = {name: SpeculativeDecoder(TargetWorker(pair.target.model), DraftWorker(draft), plan)
                for name, draft in (("full", pair.draft.model), ("subset", restricted))}
    alone = SpeculativeDecoder(TargetWorker(pair.target.model), None, plan)
    got = {name: d.generate(prompt, params) for name, d in decoders.items()}
    if temperature == 0.0:
        want = alone.generate(prompt, params).token_ids
        assert got["full"].token_ids == want and got["subset"].token_ids == want
    assert got["subset"].stats.steps >= 1  # (sampled: the law is the statistical tests' business)
