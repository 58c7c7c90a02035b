"""The ingress serves the target alone for a draft whose vocabulary or tokenizer is not the target's (the draft's
uniform fallback would cover other ids than the verifier's), asking each draft actor once."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from actors.base import tokenizer_digest
from deployments.ingress import OpenAIIngress, pair_refusal
from sequoia_ray.models.loading import TINY_DRAFT, TINY_TARGET, load_tokenizer

QWEN_SMALL = {"vocab": 151936, "tokenizer": "abc"}  # Qwen2.5 0.5B-3B's embedding rows; 7B and up have 152064


def test_a_same_vocabulary_pair_speculates():
    assert pair_refusal(QWEN_SMALL, dict(QWEN_SMALL)) is None
    assert pair_refusal(QWEN_SMALL, {"vocab": 151936, "tokenizer": None}) is None  # no tokenizer to compare


@pytest.mark.parametrize("draft,words", [({"vocab": 152064, "tokenizer": "abc"}, "152064 ids, the target's 151936"),
                                         ({"vocab": 151936, "tokenizer": "xyz"}, "tokenizer")])
def test_another_vocabulary_or_tokenizer_is_refused_by_name(draft, words):
    assert words in pair_refusal(QWEN_SMALL, draft)


def test_the_local_pair_refuses_by_the_ingress_rule_and_names_the_difference():
    """A draft padded to another table size with the target's tokenizer is refused for its size, not (as before)
    as a pair that "does not share a tokenizer"; another tokenizer is refused for its tokenizer."""
    from sequoia_ray.local import check_same_vocab
    from sequoia_ray.models.loading import load_model

    target = load_model(TINY_TARGET, progress=False)
    padded = load_model(TINY_TARGET, progress=False)
    padded.model.resize_token_embeddings(target.model.config.vocab_size + 31)  # what a hardware padding does
    check_same_vocab(target, load_model(TINY_DRAFT, progress=False))
    with pytest.raises(ValueError, match=r"vocabulary has 97 ids, the target's 128: .*target's vocabulary"):
        check_same_vocab(padded, target)
    other = load_model(TINY_DRAFT, progress=False)
    other.tokenizer.add_tokens(["<extra>"])
    with pytest.raises(ValueError, match=r"tokenizer is not the target's"):
        check_same_vocab(target, other)


def test_the_digest_tells_tokenizers_apart():
    draft, target = load_tokenizer(TINY_DRAFT, progress=False), load_tokenizer(TINY_TARGET, progress=False)
    assert tokenizer_digest(draft) == tokenizer_digest(target)  # the tiny pair shares one
    target.add_tokens(["<extra>"])
    assert tokenizer_digest(draft) != tokenizer_digest(target)
    assert tokenizer_digest(None) is None


class _Actor:
    def __init__(self, meta: dict, key: str) -> None:
        self._actor_id = SimpleNamespace(hex=lambda: key)
        self.asked = 0
        self.meta = meta
        self.info = SimpleNamespace(remote=self._info)

    async def _info(self):
        self.asked += 1
        return self.meta


class _Held(OpenAIIngress.func_or_class):  # Serve awaits ``__del__``; garbage collection would not
    def __del__(self) -> None:
        pass


def test_each_draft_actor_is_asked_once_and_a_refusal_is_kept(caplog):
    ingress = object.__new__(_Held)
    ingress.pairs, ingress.draft_contexts = {}, {}
    good, bad = _Actor(dict(QWEN_SMALL), "good"), _Actor({"vocab": 152064, "tokenizer": "abc"}, "bad")

    async def steps():
        return [await ingress._pair_refusal(actor, QWEN_SMALL, 1.0) for actor in (good, bad, good, bad)]

    verdicts = asyncio.run(steps())
    assert verdicts[0] is None and verdicts[2] is None
    assert verdicts[1] == verdicts[3] and "152064" in verdicts[1]
    assert (good.asked, bad.asked) == (1, 1)
    assert sum("target alone" in r.message for r in caplog.records) == 1  # logged once, not per request


def test_the_decoder_knows_the_draft_actors_context():
    """A request longer than the draft's context goes on with the target alone (``engine.draft_levels``): the
    ingress hands the draft actor's ``max_context`` to the decoder."""
    from actors.adapters import ActorDraft
    from deployments.config import ServeConfig

    ingress = object.__new__(_Held)
    ingress.pairs, ingress.draft_contexts, ingress.tokenizer, ingress.live = {}, {}, None, None
    ingress.cfg, ingress.draft_deployment, ingress.rates = ServeConfig(), object(), None
    actor = _Actor(dict(QWEN_SMALL, max_context=2048), "short")
    target = dict(QWEN_SMALL, ranks=[], eos_ids=[1], max_context=32768)

    async def target_actors():
        return target

    async def draft_actor(timeout):
        return ActorDraft(actor, timeout)

    ingress._target_actors, ingress._draft_actor = target_actors, draft_actor
    decoder = asyncio.run(ingress._decoder(lambda: None, True))
    assert (decoder.draft_context, decoder.max_context) == (2048, 32768)
