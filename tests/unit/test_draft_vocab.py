"""The draft's LM head on part of the vocabulary (sequoia_ray.models.draft_vocab): the kept ids' logits are the
full head's, the rest -inf; the draft never proposes a left-out id, and decoding stays the target's."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from deployments.config import ServeConfig
from sequoia_ray.config import ProfileJobConfig, SamplingParams
from sequoia_ray import draft as draft_module
from sequoia_ray.draft import DraftWorker, DynamicTrees
from sequoia_ray.engine import SpeculativeDecoder
from sequoia_ray.local import LocalPair
from sequoia_ray.models.draft_vocab import SubsetHead, kept_ids, restrict_head
from sequoia_ray.models import loading
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
    assert kept_ids(NO_SPECIALS, 3, 97, keep=(80, 200)) == [0, 1, 2, 80]  # e.g. a generation config's EOS ids


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
    # the model's own forward (what transformers' generate calls) goes through it too (no soft-capping here)
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


def test_load_model_keeps_every_eos_id_and_restricts_before_quantising(monkeypatch):
    # The serving default: an int8 draft on a subset head. A generation config may name EOS ids the tokenizer
    # does not mark special; the head keeps them (else the draft could never propose the end of a sequence).
    monkeypatch.setattr(loading, "eos_ids", lambda tokenizer, *configs, extra=(): (90,))
    loaded = load_model(TINY_DRAFT, quantize="int8", draft_vocab=50, progress=False, layers="eager")
    head = loaded.model.get_output_embeddings()
    assert isinstance(head, SubsetHead) and hasattr(head.linear, "_packed_params")  # restricted, then quantised
    assert loaded.eos_ids == (90,) and 90 in head.ids.tolist()
    logits = KVSession(loaded.model).head(torch.randn(3, loaded.model.config.hidden_size))  # [3, V]
    kept = torch.zeros(logits.shape[-1], dtype=torch.bool)
    kept[head.ids] = True
    assert torch.isneginf(logits[:, ~kept]).all() and torch.isfinite(logits[:, kept]).all()


def test_a_tied_head_is_copied_and_the_input_embedding_stays_whole():
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    model = Qwen2ForCausalLM(config).eval()
    embedding = model.get_input_embeddings().weight.detach().clone()  # [97, 64]
    hidden = torch.randn(2, 64)
    want = model.lm_head(hidden)  # [2, 97]
    assert restrict_head(model, NO_SPECIALS, 30)
    model.tie_weights()  # what transformers may call again (e.g. after resizing); the subset head must survive it
    assert torch.equal(model.get_input_embeddings().weight, embedding)
    got = model.get_output_embeddings()(hidden)
    torch.testing.assert_close(got[:, :30], want[:, :30])
    assert torch.isneginf(got[:, 30:]).all()


@pytest.mark.parametrize("config", [ServeConfig, lambda **kw: ProfileJobConfig(storage="s", **kw)])
def test_configs_read_full_as_the_full_head_and_refuse_booleans(config):
    assert config(draft_vocab="full").draft_vocab is None and config(draft_vocab="FULL").draft_vocab is None
    assert config(draft_vocab="4096").draft_vocab == 4096 and config().draft_vocab == 65536
    for bad in (True, False, "yes", "64k"):  # YAML's yes/on/true is a boolean: pydantic would read it as 1
        with pytest.raises(ValueError, match=f"draft_vocab {bad!r}: give an integer >= 1 .* or null / 'full'"):
            config(draft_vocab=bad)
    with pytest.raises(ValueError, match="greater than or equal to 1"):
        config(draft_vocab=0)


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


@pytest.mark.parametrize("temperature", [0.0, 0.8])
@pytest.mark.parametrize("dynamic", [None, DynamicTrees(0.01, extend=2)], ids=["static", "dynamic"])
def test_draws_over_the_kept_ids_are_the_draws_over_the_whole_head(monkeypatch, temperature, dynamic):
    """The draft draws on its head's kept logits ([K], ``kept_logits``) and maps positions to ids: the same
    tree, draw for draw, and the same D at every node as drawing on the whole head's logits with -inf elsewhere."""
    pair = LocalPair.tiny(device="cpu")
    restricted = copy.deepcopy(pair.draft.model)
    full = restricted.get_output_embeddings()
    ids = torch.arange(1, full.out_features, 2)  # odd ids only: a position is not its id
    linear = torch.nn.Linear(full.in_features, len(ids), bias=False)
    with torch.no_grad():
        linear.weight.copy_(full.weight[ids])
    restricted.set_output_embeddings(SubsetHead(linear, ids, full.out_features))
    plan, prompt = k_ary(3, 3), pair.encode("def fib(n): return", chat=False)
    params = SamplingParams(max_tokens=32, temperature=temperature, ignore_eos=True)
    trees = {}
    for name in ("kept", "whole"):
        if name == "whole":  # the whole head's logits, as before kept_logits
            monkeypatch.setattr(draft_module, "kept_logits", lambda model, hidden, head: (head(hidden), None))
        worker = DraftWorker(restricted, dynamic=dynamic)
        worker.start("r", prompt, params, seed=3)
        trees[name] = worker.grow("r", plan)
        assert (worker.kept is None) == (name == "whole")
    kept, whole = trees["kept"], trees["whole"]
    assert kept.tokens.tolist() == whole.tokens.tolist() and kept.plan == whole.plan
    assert kept.tokens.numel() > 4 and set(kept.dists) == set(whole.dists)
    assert bool(kept.dists) == (temperature > 0) and all(t % 2 for t in kept.tokens[1:].tolist())
    for node, dist in kept.dists.items():
        assert dist.tokens.tolist() == whole.dists[node].tokens.tolist()
        torch.testing.assert_close(dist.probs, whole.dists[node].probs)


@pytest.mark.parametrize("dynamic", [None, DynamicTrees(0.01, extend=2)], ids=["static", "dynamic"])
def test_a_node_wider_than_the_kept_ids_names_draft_vocab(dynamic):
    """A greedy node with more children than a restricted head keeps ids: before, torch's "selected index k out of
    range" (the request went on with the target alone, the reason unsaid)."""
    pair = LocalPair.tiny(device="cpu")
    restricted = copy.deepcopy(pair.draft.model)
    restrict_head(restricted, NO_SPECIALS, 3)  # ids 0, 1, 2
    worker = DraftWorker(restricted, dynamic=dynamic)
    worker.start("r", [5, 17, 33], SamplingParams(max_tokens=8, temperature=0.0), seed=1)
    with pytest.raises(ValueError, match="has 4 children but the draft's head has 3 ids.*raise draft_vocab"):
        worker.grow("r", k_ary(4, 2))
