"""Token log-probabilities (``SamplingParams.logprobs``; OpenAI's ``logprobs`` / ``top_logprobs``): each generated
token's log-probability under the target's raw logits, whatever tree produced it, equals a plain forward's over
the prompt and the output (teacher forcing); in a batched verify too; and through the ingress in OpenAI's forms.
Refused (400) before. fp32 tiny pair: the bound 1e-4 is float32 noise over a 97-token vocabulary."""

from __future__ import annotations

import asyncio

import pytest
import torch

from deployments import openai_api as api
from sequoia_ray.config import SamplingParams
from sequoia_ray.draft import DraftWorker
from sequoia_ray.target import TargetWorker
from sequoia_ray.tree.builtin import builtin_plan
from tests.unit.test_handle_api import pair, replica  # noqa: F401 - the module-scoped fixture

BOUND = 1e-4


def plain(pair, prompt: list[int], output: list[int]) -> torch.Tensor:  # noqa: F811
    """[len(output), V]: the target's log-softmax where each output token was drawn, in one plain forward."""
    with torch.no_grad():
        logits = pair.target.model(torch.tensor([prompt + output])).logits[0].float()
    return logits.log_softmax(-1)[len(prompt) - 1 : len(prompt) - 1 + len(output)]


def check(rows: torch.Tensor, tokens: list[int], logprobs: list, top: int) -> None:
    assert len(logprobs) == len(tokens)
    for row, token, (lp, likely) in zip(rows, tokens, logprobs):
        assert abs(lp - row[token].item()) < BOUND
        values, ids = row.topk(top)
        assert [i for i, _ in likely] == ids.tolist() or top == 0
        assert all(abs(v - w) < BOUND for (_, v), w in zip(likely, values.tolist()))


@pytest.mark.parametrize("speculate", [True, False])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_each_tokens_logprob_is_the_targets_whatever_tree_made_it(pair, speculate, temperature):  # noqa: F811
    prompt = pair.encode("hello world", chat=False)
    params = SamplingParams(max_tokens=16, temperature=temperature, seed=5, logprobs=3)
    out = pair.decoder(builtin_plan(temperature).plan, speculate=speculate).generate(prompt, params)
    check(plain(pair, prompt, out.token_ids), out.token_ids, out.logprobs, 3)
    if speculate:
        assert out.stats.tokens_per_step > 1  # trees really accepted tokens (else this tests the target alone)


def test_a_batched_verify_gives_each_request_its_own_rows(pair):  # noqa: F811
    """Two requests' trees in one forward: each verdict's log-probabilities come from its own rows of the
    batch's logits (an offset slip would read the other request's)."""
    target, draft = TargetWorker(pair.target.model), DraftWorker(pair.draft.model)
    plan, params = builtin_plan(0.0).plan, SamplingParams(max_tokens=8, temperature=0.0, logprobs=2)
    prompts = {"a": pair.encode("hello world", chat=False), "b": pair.encode("The quick brown fox", chat=False)}
    for rid, prompt in prompts.items():
        target.start(rid, prompt, params, 1)
        draft.start(rid, prompt, params, 2)
    verdicts = target.verify_batch([(rid, plan, draft.grow(rid, plan)) for rid in prompts])
    for (rid, prompt), verdict in zip(prompts.items(), verdicts):
        check(plain(pair, prompt, verdict.tokens), verdict.tokens, list(verdict.logprobs), 2)
    assert all(len(v.path) > 1 for v in verdicts)  # trees accepted more than the root


def test_a_stop_string_cuts_the_logprobs_with_the_tokens(pair):  # noqa: F811
    prompt = pair.encode("hello world", chat=False)
    free = pair.decoder(builtin_plan(0.0).plan).generate(prompt, SamplingParams(max_tokens=24, logprobs=0))
    stop = free.text[5:7]
    out = pair.decoder(builtin_plan(0.0).plan).generate(prompt, SamplingParams(max_tokens=24, logprobs=0, stop=[stop]))
    assert out.finish_reason == "stop" and len(out.logprobs) == len(out.token_ids) < len(free.token_ids)
    assert all(likely == () for _, likely in out.logprobs)


# ---- the OpenAI forms --------------------------------------------------------------------------------------------
def test_a_completions_logprobs_are_openais_legacy_form_streamed_or_not(pair):  # noqa: F811
    r = replica(pair)
    body = {"model": "m", "prompt": "hello world", "max_tokens": 10, "temperature": 0, "logprobs": 2}
    whole = asyncio.run(r.generate(body))
    choice = whole["choices"][0]
    lp = choice["logprobs"]
    n = whole["usage"]["completion_tokens"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"]) == n
    assert "".join(lp["tokens"]) == choice["text"]  # the character tokenizer: a token's text is its character
    assert lp["text_offset"] == [sum(map(len, lp["tokens"][:k])) for k in range(n)]
    assert all(len(top) <= 3 and top[t] == v for top, t, v in zip(lp["top_logprobs"], lp["tokens"],
                                                                    lp["token_logprobs"]))

    async def events():
        return [e async for e in r.generate_stream(body)]

    parts = [e["choices"][0]["logprobs"] for e in asyncio.run(events()) if e["choices"]]
    assert sum((p["tokens"] for p in parts), []) == lp["tokens"]
    assert sum((p["text_offset"] for p in parts), []) == lp["text_offset"]  # offsets run on across chunks
    assert sum((p["token_logprobs"] for p in parts), []) == pytest.approx(lp["token_logprobs"], abs=BOUND)


def test_a_chats_logprobs_are_openais_content_form(pair):  # noqa: F811
    out = asyncio.run(replica(pair).generate({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                              "max_tokens": 6, "temperature": 0, "logprobs": True,
                                              "top_logprobs": 2}))
    content = out["choices"][0]["logprobs"]["content"]
    assert len(content) == out["usage"]["completion_tokens"]
    assert "".join(c["token"] for c in content) == out["choices"][0]["message"]["content"]
    for c in content:
        assert c["bytes"] == list(c["token"].encode()) and len(c["top_logprobs"]) == 2
        assert c["logprob"] <= c["top_logprobs"][0]["logprob"] + BOUND  # the likeliest first
    plain_chat = asyncio.run(replica(pair).generate({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                                     "max_tokens": 6, "temperature": 0}))
    assert plain_chat["choices"][0]["logprobs"] is None


@pytest.mark.parametrize("body, model, param", [
    ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, api.ChatCompletionRequest, "top_logprobs"),
    ({"prompt": "x", "logprobs": 21}, api.CompletionRequest, "logprobs"),
    ({"prompt": "x", "logprobs": True}, api.CompletionRequest, "logprobs"),  # a count, not a switch, on completions
    ({"messages": [{"role": "user", "content": "x"}], "logprobs": 2}, api.ChatCompletionRequest, "logprobs"),
])
def test_logprobs_asked_wrongly_are_400s_naming_the_field(body, model, param):
    from pydantic import ValidationError

    with pytest.raises(ValidationError) as info:
        model.model_validate({"model": "m", **body})
    assert api.validation_error(info.value).param == param


def test_logprobs_false_on_a_completion_asks_for_none():
    req = api.CompletionRequest.model_validate({"model": "m", "prompt": "x", "logprobs": False})
    assert req.sampling(16).logprobs is None


def test_top_logprobs_on_a_completion_is_refused_not_ignored():
    """The chat's field on /v1/completions (whose ``logprobs`` is the count) was tolerated as an unknown field:
    ``logprobs: 2, top_logprobs: 3`` quietly gave 2 alternatives. From a review of the change."""
    from pydantic import ValidationError

    with pytest.raises(ValidationError) as info:
        api.CompletionRequest.model_validate({"model": "m", "prompt": "x", "logprobs": 2, "top_logprobs": 3})
    assert api.validation_error(info.value).param == "top_logprobs"
    assert api.CompletionRequest.model_validate({"model": "m", "prompt": "x", "top_logprobs": 0}).logprobs is None


def test_ids_that_read_alike_keep_the_chosen_tokens_value_and_json_gets_no_nan():
    """Byte-fallback pieces all read U+FFFD: the likeliest dict kept the last colliding id's value, so the chosen
    token's entry showed another's. NaN (logits that overflowed) passed the -inf floor."""
    text = {1: "\ufffd", 2: "\ufffd", 3: "a"}.__getitem__
    out = api.completion_logprobs(text, [(1, -0.9, ((3, -0.5), (2, -2.5))), (3, float("nan"), ())])
    assert out["top_logprobs"][0] == {"\ufffd": -0.9, "a": -0.5}
    assert out["token_logprobs"] == [-0.9, api.LOWEST_LOGPROB]
    assert api.chat_logprobs(text, [(3, float("-inf"), ())])["content"][0]["logprob"] == api.LOWEST_LOGPROB


def test_each_tokens_text_is_decoded_once_a_replica(pair):  # noqa: F811
    r = replica(pair)
    calls = []
    decode = r.tokenizer.decode

    class Counting:
        def __getattr__(self, name):
            return getattr(r.tokenizer_inner, name)

        def decode(self, ids, **kw):
            calls.append(tuple(ids))
            return decode(ids, **kw)

    r.tokenizer_inner, r.tokenizer = r.tokenizer, Counting()
    assert r._token_text(5) == r._token_text(5) == decode([5])
    assert calls == [(5,)]


def test_a_chats_logprobs_carry_each_tokens_own_bytes():
    """OpenAI's ``bytes`` rebuild a character split across tokens, each of whose text alone is U+FFFD: the bytes of
    that text (three U+FFFD's for an emoji's 4 byte tokens) rebuilt nothing. A special token keeps its text's bytes
    (``token_bytes`` reads text as streamed, without special tokens: ``<|im_end|>`` got ``[]``). A byte-level BPE
    of single bytes, with a special token; the ingress's own lookups."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from tests.unit.test_handle_api import Held

    backend = Tokenizer(models.BPE({c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}, []))
    backend.pre_tokenizer, backend.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    ingress = object.__new__(Held)
    ingress.tokenizer = tok = PreTrainedTokenizerFast(tokenizer_object=backend, additional_special_tokens=["<|end|>"])
    ids = tok.encode("a🚀") + [tok.convert_tokens_to_ids("<|end|>")]
    assert len(ids) == 6 and tok.decode(ids[1:2]) == "\ufffd"
    content = ingress._logprobs([(i, -0.1, ((i, -0.1),)) for i in ids], chat=True)["content"]
    assert bytes(sum((c["bytes"] for c in content), [])).decode() == "a🚀<|end|>"
    assert [c["top_logprobs"][0]["bytes"] for c in content] == [c["bytes"] for c in content]
    alone = api.chat_logprobs(ingress._token_text, [(ids[1], -0.1, ())])  # no bytes_of: the text's
    assert alone["content"][0]["bytes"] == list("\ufffd".encode())


def test_a_spelling_that_does_not_read_as_the_token_gives_no_bytes():
    """A spelling of ASCII and Latin-1 characters that is not byte-level BPE's (``<0xæ>`` for the byte E6) was read
    as that alphabet's bytes: the stop checker then took the token for a whole character and streamed U+FFFD, later
    contradicted. Spelled bytes count only if they read as the token's text."""
    from types import SimpleNamespace

    from sequoia_ray.stopping import token_bytes

    odd = SimpleNamespace(decode=lambda ids, **kw: "\ufffd", convert_ids_to_tokens=lambda i: "<0xæ>")
    assert token_bytes(odd, 7) is None
    byte_level = SimpleNamespace(decode=lambda ids, **kw: "\ufffd", convert_ids_to_tokens=lambda i: "æ")  # E6
    assert token_bytes(byte_level, 7) == b"\xe6"
