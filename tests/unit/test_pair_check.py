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
    # a draft's table padded less than the target's (Qwen2.5 0.5B for 7B: one tokenizer, 151,936 and 152,064 rows)
    assert pair_refusal({"vocab": 152064, "tokenizer": "abc"}, QWEN_SMALL) is None


@pytest.mark.parametrize("draft,words", [({"vocab": 152064, "tokenizer": "abc"}, "152064 ids, the target's 151936"),
                                         ({"vocab": 151936, "tokenizer": "xyz"}, "tokenizer")])
def test_another_vocabulary_or_tokenizer_is_refused_by_name(draft, words):
    assert words in pair_refusal(QWEN_SMALL, draft)


def test_a_pair_padded_differently_loads_and_a_draft_with_more_rows_is_refused(tmp_path):
    """The local pair's check is the ingress's: one tokenizer, the draft's table at most the target's (before, any
    difference of tables was refused as "do not share a tokenizer")."""
    from sequoia_ray.local import check_same_vocab
    from sequoia_ray.models.loading import load_model

    target = load_model(TINY_TARGET, progress=False)
    padded = load_model(TINY_TARGET, progress=False)
    padded.model.resize_token_embeddings(target.model.config.vocab_size + 31)  # what a hardware padding does
    check_same_vocab(padded, target)  # the draft (tiny target) 97 rows, the target 128: the draft's ids all fit
    with pytest.raises(ValueError, match=r"draft .* vocabulary has 128 ids, the target's 97.*at most the target's"):
        check_same_vocab(target, padded)


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


def test_each_draft_actor_is_asked_once_and_a_refusal_is_kept(caplog):
    class Held(OpenAIIngress.func_or_class):  # Serve awaits ``__del__``; garbage collection would not
        def __del__(self) -> None:
            pass

    ingress = object.__new__(Held)
    ingress.pairs = {}
    good, bad = _Actor(dict(QWEN_SMALL), "good"), _Actor({"vocab": 152064, "tokenizer": "abc"}, "bad")

    async def steps():
        return [await ingress._pair_refusal(actor, QWEN_SMALL, 1.0) for actor in (good, bad, good, bad)]

    verdicts = asyncio.run(steps())
    assert verdicts[0] is None and verdicts[2] is None
    assert verdicts[1] == verdicts[3] and "152064" in verdicts[1]
    assert (good.asked, bad.asked) == (1, 1)
    assert sum("target alone" in r.message for r in caplog.records) == 1  # logged once, not per request
