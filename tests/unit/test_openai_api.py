"""The OpenAI surface without Ray: fields honoured, refused with a 400 naming them, or read as their default
(``null``), the chat roles a template sees, a template's refusal, the stream's usage chunk, the API key from the
environment and malformed launch arguments."""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace

import pytest
from pydantic import ValidationError

from deployments import openai_api as api
from deployments.config import ServeConfig
from deployments.ingress import OpenAIIngress, api_key_header
from deployments.launch import DEFAULT_CONFIG, app_args
from sequoia_ray.config import ProfileJobConfig
from sequoia_ray.models.loading import TINY_TARGET, load_tokenizer

COMPLETION = {"model": "m", "prompt": "hi"}


def api_error(body: dict, model=api.CompletionRequest) -> api.APIError:
    with pytest.raises(ValidationError) as info:
        model.model_validate(body)
    return api.validation_error(info.value)


@pytest.mark.parametrize("name,value", [
    ("presence_penalty", 0.5), ("frequency_penalty", -1), ("logit_bias", {"50": -100}),
    ("response_format", {"type": "json_object"}), ("tool_choice", "required"), ("tools", [{"type": "function"}]),
    ("logprobs", True), ("top_logprobs", 2), ("best_of", 2), ("echo", True), ("suffix", "end"),
    ("top_k", 5), ("min_p", 0.1), ("repetition_penalty", 1.2), ("min_tokens", 3), ("use_beam_search", True),
    ("best_of", True),  # not read as 1
])
def test_a_field_that_would_change_the_output_is_refused_by_name(name, value):
    err = api_error({**COMPLETION, name: value})
    assert (err.status, err.param, err.code) == (400, name, "unsupported_parameter")
    assert name in err.message and repr(value)[:20] in err.message
    assert err.body()["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("name,value", [
    ("presence_penalty", 0), ("frequency_penalty", 0.0), ("logit_bias", {}), ("response_format", {"type": "text"}),
    ("tool_choice", "none"), ("tool_choice", "auto"), ("logprobs", False), ("logprobs", None), ("best_of", 1),
    ("top_k", -1), ("min_p", 0), ("repetition_penalty", 1.0), ("user", "someone"), ("metadata", {"k": "v"}),
    ("prediction", {"type": "content", "content": "x"}),  # a speed hint: the output does not depend on it
])
def test_a_field_at_its_no_op_value_or_one_that_changes_nothing_is_accepted(name, value):
    req = api.CompletionRequest.model_validate({**COMPLETION, name: value})
    assert req.sampling(16) == api.CompletionRequest.model_validate(COMPLETION).sampling(16)


def test_null_is_the_default():
    req = api.CompletionRequest.model_validate({**COMPLETION, "temperature": None, "top_p": None, "n": None,
                                                "stream": None, "max_tokens": None, "stop": None, "seed": None})
    params = req.sampling(16)
    assert (params.temperature, params.top_p, params.max_tokens, params.stop) == (1.0, 1.0, 16, ())
    assert not req.stream and not req.usage_chunk
    assert api_error({**COMPLETION, "temperature": 3}).param == "temperature"  # the bounds still hold


def test_ignore_eos_reaches_the_sampling_params():
    assert api.CompletionRequest.model_validate({**COMPLETION, "ignore_eos": True}).sampling(16).ignore_eos
    assert api_error({**COMPLETION, "ignore_eos": "yes"}).param == "ignore_eos"


def test_max_completion_tokens_is_max_tokens_and_the_two_may_not_differ():
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    req = api.ChatCompletionRequest.model_validate({**chat, "max_completion_tokens": 7})
    assert req.sampling(256).max_tokens == 7 and req.length_param == "max_completion_tokens"
    assert api.ChatCompletionRequest.model_validate({**chat, "max_completion_tokens": 7,
                                                     "max_tokens": 7}).sampling(256).max_tokens == 7
    err = api_error({**chat, "max_completion_tokens": 7, "max_tokens": 9}, api.ChatCompletionRequest)
    assert err.status == 400 and err.param == "max_completion_tokens" and "9" in err.message


# ---- the ingress's request preparation, without Ray ----------------------------------------------------------
ROLES_ONLY_TEMPLATE = ("{% for m in messages %}{% if m['role'] == 'system' %}<s>{{ m['content'] }}</s>"
                       "{% elif m['role'] == 'user' %}<u>{{ m['content'] }}</u>{% elif m['role'] == 'assistant' %}"
                       "<a>{{ m['content'] }}</a>{% endif %}{% endfor %}<a>")  # Qwen's shape: unknown roles vanish
ALTERNATING_TEMPLATE = ("{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
                        "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant') }}"
                        "{% endif %}{{ m['content'] }}{% endfor %}")


def ingress(template: str | None = None, **cfg):
    """The ingress as Serve holds it, made without its constructor: what ``_prepare`` reads."""
    class Held(OpenAIIngress.func_or_class):  # Serve awaits ``__del__``; garbage collection would not
        def __del__(self) -> None:
            pass

    replica = object.__new__(Held)
    replica.cfg = ServeConfig(model_name="m", draft=None, target=TINY_TARGET, **cfg)
    replica.tokenizer = load_tokenizer(TINY_TARGET, progress=False)
    if template is not None:
        replica.tokenizer.chat_template = template
    return replica


def prepare(replica, messages: list[dict], **body):
    return replica._prepare(api.ChatCompletionRequest.model_validate({"model": "m", "messages": messages, **body}),
                            chat=True)


def test_a_developer_message_reaches_the_template_as_system():
    replica = ingress(ROLES_ONLY_TEMPLATE)
    prompt, _ = prepare(replica, [{"role": "developer", "content": "AnswerInFrench"},
                                  {"role": "user", "content": "hi"}])
    assert replica.tokenizer.decode(prompt) == "<s>AnswerInFrench</s><u>hi</u><a>"


def test_a_template_refusal_is_a_400_naming_the_messages():
    replica = ingress(ALTERNATING_TEMPLATE)
    with pytest.raises(api.APIError) as info:
        prepare(replica, [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])
    assert (info.value.status, info.value.param) == (400, "messages") and "alternate" in info.value.message
    prepare(replica, [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}])  # accepted


def test_the_length_limit_error_names_the_field_the_client_sent():
    replica = ingress(max_tokens_limit=8)
    with pytest.raises(api.APIError) as info:
        prepare(replica, [{"role": "user", "content": "a"}], max_completion_tokens=9)
    assert info.value.param == "max_completion_tokens" and "max_completion_tokens 9" in info.value.message


def _chunk(text: str, finish: str | None = None):
    return SimpleNamespace(text=text, token_ids=[1] * len(text), finish_reason=finish,
                           stats=SimpleNamespace(to_dict=lambda: {"tokens_per_step": 2.0}))


@pytest.mark.parametrize("chat", [True, False])
@pytest.mark.parametrize("include_usage", [True, False, None])
def test_a_stream_ends_with_a_usage_chunk_when_asked(chat, include_usage):
    replica = ingress()

    async def chunks():
        for chunk in (_chunk("ab"), _chunk("c", "length")):
            await asyncio.sleep(0)
            yield chunk

    async def collect(req):
        return [event async for event in replica._events(chunks(), req, "rid", chat, prompt_tokens=5)]

    body = {"model": "m", "stream": True, "stream_options": {"include_usage": include_usage}}
    req = (api.ChatCompletionRequest.model_validate({**body, "messages": [{"role": "user", "content": "x"}]})
           if chat else api.CompletionRequest.model_validate({**body, "prompt": "x"}))
    events = asyncio.run(collect(req))
    usage = {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8, "speculative": {"tokens_per_step": 2.0}}
    finish = events[-2] if include_usage else events[-1]
    assert finish["choices"][0]["finish_reason"] == "length" and finish["usage"] == usage
    if include_usage:
        assert events[-1]["choices"] == [] and events[-1]["usage"] == usage and events[-1]["id"] == "rid"
    assert len({e["created"] for e in events}) == 1  # one timestamp for the whole stream


# ---- configuration --------------------------------------------------------------------------------------------
def test_an_api_key_variable_unset_in_the_replica_is_an_error_not_an_open_api(monkeypatch):
    monkeypatch.delenv("SEQUOIA_TEST_KEY", raising=False)
    cfg = ServeConfig(draft=None, target=TINY_TARGET, api_key_env="SEQUOIA_TEST_KEY")
    with pytest.raises(ValueError, match="SEQUOIA_TEST_KEY"):
        api_key_header(cfg)
    monkeypatch.setenv("SEQUOIA_TEST_KEY", "")
    with pytest.raises(ValueError, match="unset or empty"):
        api_key_header(cfg)
    monkeypatch.setenv("SEQUOIA_TEST_KEY", "k1")
    assert api_key_header(cfg) == b"Bearer k1"
    assert api_key_header(ServeConfig(draft=None, target=TINY_TARGET)) is None  # no key configured: open
    assert api_key_header(ServeConfig(draft=None, target=TINY_TARGET, api_key="k2")) == b"Bearer k2"
    with pytest.raises(ValidationError, match="api_key"):
        ServeConfig(draft=None, target=TINY_TARGET, api_key="")


def test_an_unknown_draft_quantisation_fails_at_the_config():
    for model, extra in ((ServeConfig, {}), (ProfileJobConfig, {"storage": "/tmp/x"})):
        with pytest.raises(ValidationError, match="draft_quantize"):
            model(draft_quantize="int4", **extra)
        assert model(draft_quantize="int8", **extra).draft_quantize == "int8"


@pytest.mark.parametrize("overrides,message", [
    (["draft"], "KEY=VALUE"), (["=3"], "KEY=VALUE"), (["max_concurrent=[1"], "not valid YAML"),
])
def test_a_malformed_override_names_itself(overrides, message):
    with pytest.raises(ValueError, match=message):
        app_args(DEFAULT_CONFIG, overrides)


def test_a_malformed_config_file_names_itself(tmp_path: Path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("applications: [\n")
    with pytest.raises(ValueError, match="not valid YAML"):
        app_args(bad, [])
    bad.write_text("proxy_location: EveryNode\n")
    with pytest.raises(ValueError, match="applications"):
        app_args(bad, [])
    assert app_args(DEFAULT_CONFIG, ["max_concurrent=4", "draft=null"])["draft"] is None
