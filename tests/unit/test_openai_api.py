"""The OpenAI surface without Ray: fields honoured, refused with a 400 naming them, or read as their default
(``null``), the chat roles a template sees, a template's refusal, the stream's usage chunk, the API key from the
environment and malformed launch arguments."""

from __future__ import annotations

import asyncio
import json
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
    ("best_of", 2), ("echo", True), ("suffix", "end"),
    ("top_k", 5), ("min_p", 0.1), ("repetition_penalty", 1.2), ("min_tokens", 3), ("use_beam_search", True),
    ("best_of", True),  # not read as 1
    ("guided_json", {"type": "object"}), ("guided_choice", ["a", "b"]), ("structured_outputs", {"regex": "a+"}),
    ("stop_token_ids", [5]), ("include_stop_str_in_output", True), ("skip_special_tokens", False),
    ("add_generation_prompt", False), ("chat_template", "{{ x }}"), ("reasoning_effort", "high"),
    ("modalities", ["text", "audio"]), ("bad_words", ["x"]), ("length_penalty", 0.5),
    ("verbosity", "low"), ("logits_processors", ["pkg.Processor"]),  # session 56: both were silently ignored
])
def test_a_field_that_would_change_the_output_is_refused_by_name(name, value):
    err = api_error({**COMPLETION, name: value})
    assert (err.status, err.param, err.code) == (400, name, "unsupported_parameter")
    assert name in err.message and json.dumps(value)[:20] in err.message  # as the client wrote it: true, not True
    assert err.body()["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("name,value,instead", [
    ("max_new_tokens", 64, "max_tokens"), ("num_predict", 64, "max_tokens"), ("stop_sequences", ["x"], "stop"),
    ("do_sample", False, "temperature"), ("repeat_penalty", 1.1, None), ("typical_p", 0.9, None),
    ("mirostat", 2, None),
])
def test_another_servers_output_option_is_refused_naming_ours(name, value, instead):
    """Clients ported from TGI, Ollama or llama.cpp send their own names: each was accepted and ignored (the
    default 16 tokens where 64 were asked)."""
    err = api_error({**COMPLETION, name: value})
    assert (err.status, err.param, err.code) == (400, name, "unknown_parameter")
    assert (f"send '{instead}" in err.message) if instead else ("leave it out" in err.message), err.message


def test_other_servers_options_at_values_that_change_nothing_or_beside_ours_are_accepted():
    """A client written for several servers (text-generation-webui's presets, SillyTavern) sends its whole preset:
    neutral samplers, and its own length beside ours. Refusing them refused every request of such a client."""
    preset = {"top_a": 0, "typical_p": 1, "tfs_z": 1, "mirostat": 0, "repeat_penalty": 1.0, "num_beams": 1,
              "do_sample": True, "max_new_tokens": 64, "stop_sequences": ["\n"], "temperature_last": True,
              "repetition_penalty_range": 0, "penalty_last_n": 64, "min_length": 0, "mirostat_tau": 5,
              "max_token": None}
    req = api.CompletionRequest.model_validate({**COMPLETION, "max_tokens": 64, "stop": ["\n"], **preset})
    assert req.sampling(16).max_tokens == 64
    assert api_error({**COMPLETION, "top_a": 0.2}).param == "top_a"  # not read as top_p
    err = api_error({**COMPLETION, "stopSequences": ["x"]})  # camelCase: named as the client sent it
    assert err.param == "stopSequences" and "send 'stop'" in err.message
    err = api_error({**COMPLETION, "maxTokens": 8})
    assert err.param == "maxTokens" and "did you mean 'max_tokens'?" in err.message


@pytest.mark.parametrize("typo,meant", [("max_token", "max_tokens"), ("temprature", "temperature"),
                                        ("Temperature", "temperature"), ("topp", "top_p"), ("stops", "stop"),
                                        ("max_completion_token", "max_completion_tokens"), ("seeds", "seed"),
                                        ("logprob", "logprobs")])
def test_a_misspelt_field_is_named_with_the_one_meant(typo, meant):
    err = api_error({**COMPLETION, typo: 5})
    assert (err.status, err.param, err.code) == (400, typo, "unknown_parameter")
    assert f"did you mean '{meant}'?" in err.message
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], typo: 5}
    assert api_error(chat, api.ChatCompletionRequest).param == typo


@pytest.mark.parametrize("message", [
    {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function",
                                                           "function": {"name": "f", "arguments": "{}"}}]},
    {"role": "assistant", "content": "ok", "tool_calls": [{"id": "c1", "type": "function"}]},
    {"role": "assistant", "content": "ok", "function_call": {"name": "f", "arguments": "{}"}},
    {"role": "user", "content": "42", "tool_call_id": "c1"},
])
def test_a_tool_call_in_the_history_is_refused_not_dropped(message):
    """The SDK echoes an assistant's tool calls back in the history: they were dropped silently (the model saw
    another conversation), or, with ``content`` null, refused as "not null"."""
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}, message]}
    err = api_error(body, api.ChatCompletionRequest)
    assert err.status == 400 and err.param == "messages.1" and "tool calls are not supported" in err.message
    echoed = {"role": "assistant", "content": "ok", "tool_calls": None, "function_call": None, "refusal": None}
    api.ChatCompletionRequest.model_validate({**body, "messages": [body["messages"][0], echoed]})  # no call: fine


@pytest.mark.parametrize("name", ["user", "metadata", "store", "service_tier", "parallel_tool_calls", "prediction",
                                  "prompt_cache_key", "safety_identifier", "request_id", "priority", "cache_salt",
                                  "return_token_ids", "vllm_xargs", "id"])
def test_other_clients_fields_that_change_nothing_stay_tolerated(name):
    for model, body in ((api.CompletionRequest, COMPLETION),
                        (api.ChatCompletionRequest, {"model": "m", "messages": [{"role": "user", "content": "hi"}]})):
        model.model_validate({**body, name: "x"})  # no typo of a known field: accepted


def test_a_long_refused_value_is_shown_cut_with_an_ellipsis():
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]
    err = api_error({**COMPLETION, "tools": tools})
    shown = err.message.split("= ", 1)[1].split(" is not supported", 1)[0]
    assert shown.endswith("...") and len(shown) == 60 and json.dumps(tools).startswith(shown[:-3]), err.message


@pytest.mark.parametrize("name,value", [
    ("presence_penalty", 0), ("frequency_penalty", 0.0), ("logit_bias", {}), ("response_format", {"type": "text"}),
    ("tool_choice", "none"), ("tool_choice", "auto"), ("logprobs", False), ("logprobs", None), ("best_of", 1), ("n", 1),
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
    (prompt,), _ = prepare(replica, [{"role": "developer", "content": "AnswerInFrench"},
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
    return SimpleNamespace(text=text, token_ids=[1] * len(text), finish_reason=finish, logprobs=None,
                           stats=SimpleNamespace(to_dict=lambda: {"tokens_per_step": 2.0}))


@pytest.mark.parametrize("chat", [True, False])
@pytest.mark.parametrize("include_usage", [True, False, None])
def test_a_stream_ends_with_a_usage_chunk_when_asked(chat, include_usage):
    replica = ingress()

    async def chunks():
        for chunk in (_chunk("ab"), _chunk("c", "length")):
            await asyncio.sleep(0)
            yield 0, chunk

    async def collect(req):
        return [event async for event in replica._events(chunks(), req, "rid", chat, prompt_tokens=5)]

    body = {"model": "m", "stream": True, "stream_options": {"include_usage": include_usage}}
    req = (api.ChatCompletionRequest.model_validate({**body, "messages": [{"role": "user", "content": "x"}]})
           if chat else api.CompletionRequest.model_validate({**body, "prompt": "x"}))
    events = asyncio.run(collect(req))
    usage = {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8, "speculative": {"tokens_per_step": 2.0}}
    finish = events[-2] if include_usage else events[-1]
    assert finish["choices"][0]["finish_reason"] == "length"
    if include_usage:  # OpenAI's: every other chunk has usage null, so a client adding the chunks' usages is right
        assert events[-1]["choices"] == [] and events[-1]["usage"] == usage and events[-1]["id"] == "rid"
        assert all("usage" in e and e["usage"] is None for e in events[:-1])
    else:
        assert finish["usage"] == usage and all("usage" not in e for e in events[:-1])
    assert len({e["created"] for e in events}) == 1  # one timestamp for the whole stream


def _stream(replica, chat: bool, stream_options: dict) -> list[dict]:
    async def chunks():
        for chunk in (_chunk("ab"), _chunk("c", "length")):
            yield 0, chunk

    body = {"model": "m", "stream": True, "stream_options": stream_options}
    req = (api.ChatCompletionRequest.model_validate({**body, "messages": [{"role": "user", "content": "x"}]})
           if chat else api.CompletionRequest.model_validate({**body, "prompt": "x"}))

    async def collect():
        return [event async for event in replica._events(chunks(), req, "rid", chat, prompt_tokens=5)]

    return asyncio.run(collect())


@pytest.mark.parametrize("chat", [True, False])
@pytest.mark.parametrize("include_usage", [True, False])
def test_continuous_usage_stats_puts_the_usage_so_far_in_every_chunk(chat, include_usage):
    events = _stream(ingress(), chat, {"include_usage": include_usage, "continuous_usage_stats": True})
    counted = [e["usage"]["completion_tokens"] for e in events]
    assert counted == ([0] if chat else []) + [2, 3] + ([3] if include_usage else [])  # vLLM's: so far, then all
    assert all(e["usage"]["prompt_tokens"] == 5 for e in events)


@pytest.mark.parametrize("chat", [True, False])
def test_a_choice_has_logprobs_null_in_every_body(chat):
    """OpenAI's schema lists a choice's ``logprobs`` (nullable) as required; strict clients failed on chat's."""
    use = api.usage(1, 1, None)
    body = (api.chat_body if chat else api.completion_body)("rid", "m", [("t", "stop", None)], use)
    events = _stream(ingress(), chat, {})
    assert body["choices"][0]["logprobs"] is None and all(e["choices"][0]["logprobs"] is None for e in events)


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


@pytest.mark.parametrize("port", ["99999", "0", "http"])
def test_a_port_outside_tcps_range_is_a_usage_error_before_ray_starts(port, capsys):
    from deployments.launch import main

    with pytest.raises(SystemExit) as info:  # it reached Serve's proxy and died there with a traceback
        main(["--port", port])
    assert info.value.code == 2 and "is not a TCP port" in capsys.readouterr().err


def test_a_plan_store_that_is_not_a_string_is_refused():
    with pytest.raises(ValueError, match="plan_store 5 must be a path or a URI"):
        app_args(DEFAULT_CONFIG, ["plan_store=5"])


def test_a_malformed_config_file_names_itself(tmp_path: Path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("applications: [\n")
    with pytest.raises(ValueError, match="not valid YAML"):
        app_args(bad, [])
    bad.write_text("proxy_location: EveryNode\n")
    with pytest.raises(ValueError, match="applications"):
        app_args(bad, [])
    assert app_args(DEFAULT_CONFIG, ["max_concurrent=4", "draft=null"])["draft"] is None


# ---- review findings (session 52): each a 500, a param of null or a silently different answer before ------------
@pytest.mark.parametrize("body,param,fragment", [
    ({"prompt": [[1, 2], [3.5]]}, "prompt.1.0", "fractional part"),  # a batch's bad id; was "prompt.str"
    ({"prompt": "x", "stop": ["a", None]}, "stop.1", "valid string"),  # was "stop.str"
    ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options", "stream: true"),
    ({"prompt": "x", "seed": 2**63}, "seed", "9223372036854775807"),
    ({"prompt": "x", "n": True}, "n", "not bool"), ({"prompt": "x", "n": 0}, "n", "greater than or equal to 1"),
    ({"prompt": ["a", [1]]}, "prompt", "texts or token arrays, not both"),  # was "prompt.1: ... a valid string"
])
def test_bad_fields_are_named_as_the_client_sent_them(body, param, fragment):
    err = api_error({"model": "m", **body})
    assert (err.status, err.param) == (400, param) and fragment in err.message


@pytest.mark.parametrize("content,fragment", [
    (None, "not null"), ([{"type": "image_url", "image_url": {"url": "x"}}], "type 'image_url'"),
    ([{"type": "text"}], "without a string 'text'"), (["hi"], "type 'str'"),
])
def test_chat_content_other_than_text_names_the_message(content, fragment):
    err = api_error({"model": "m", "messages": [{"role": "user", "content": content}]}, api.ChatCompletionRequest)
    assert err.param == "messages.0.content" and fragment in err.message


def test_one_token_array_in_an_array_is_that_prompt():
    """lm-eval's local-completions sends its token prompts as ``[[ids]]``: refused as a batch before."""
    replica = ingress()
    prompts, _ = replica._prepare(api.CompletionRequest.model_validate({**COMPLETION, "prompt": [[5, 6, 7]]}),
                                  chat=False)
    assert prompts == [[5, 6, 7]]


def test_text_parts_are_joined_by_newlines_and_a_name_reaches_the_template():
    """As vLLM renders them: the parts glued together read "Translate to French:Good morning." before."""
    message = api.ChatMessage.model_validate({"role": "user", "name": "alice", "content": [
        {"type": "text", "text": "Translate to French:"}, {"type": "text", "text": "Good morning."}]})
    assert message.for_template() == {"role": "user", "name": "alice",
                                      "content": "Translate to French:\nGood morning."}
    assert "name" not in api.ChatMessage(role="user", content="x").for_template()
    err = api_error({"model": "m", "messages": [{"role": "user", "content": "x", "name": 5}]},
                    api.ChatCompletionRequest)
    assert err.param == "messages.0.name"


def test_the_extensions_take_null_as_their_default():
    req = api.CompletionRequest.model_validate({**COMPLETION, "speculative": None, "ignore_eos": None})
    assert req.speculative is True and req.sampling(16).ignore_eos is False


def test_differing_lengths_are_an_invalid_value_not_an_unsupported_parameter():
    err = api_error({**COMPLETION, "max_tokens": 5, "max_completion_tokens": 6})
    assert (err.param, err.code) == ("max_completion_tokens", "invalid_value")


def test_a_chat_without_a_length_may_run_to_the_limit_and_a_completion_takes_16():
    """A chat's default was 256 tokens, cutting longer answers with finish_reason "length"; OpenAI's and vLLM's
    chat default is what the context holds (``_fit_context`` cuts the default to it)."""
    replica = ingress(max_tokens_limit=2048)
    assert prepare(replica, [{"role": "user", "content": "hi"}])[1].max_tokens == 2048
    assert replica._prepare(api.CompletionRequest.model_validate(COMPLETION), chat=False)[1].max_tokens == 16
    assert prepare(ingress(max_tokens_limit=8), [{"role": "user", "content": "hi"}])[1].max_tokens == 8


def test_any_64_bit_seed_is_accepted_and_the_same_seed_gives_the_same_params():
    for seed in (-1, 2**63 - 1, -(2**63)):
        params = api.CompletionRequest.model_validate({**COMPLETION, "seed": seed}).sampling(16)
        assert 0 <= params.seed < 2**62 and params.seed == seed % 2**62


def test_max_completion_tokens_also_sets_a_completions_length():
    req = api.CompletionRequest.model_validate({**COMPLETION, "max_completion_tokens": 5})
    assert req.sampling(16).max_tokens == 5 and req.length_param == "max_completion_tokens" and req.length_sent


@pytest.mark.parametrize("chat", [True, False])
def test_text_that_is_not_unicode_or_ids_outside_the_vocabulary_name_the_field(chat):
    replica = ingress()
    field = "messages" if chat else "prompt"
    body = {"messages": [{"role": "user", "content": "hi \udc00"}]} if chat else {"prompt": "\ud800"}
    model = api.ChatCompletionRequest if chat else api.CompletionRequest
    with pytest.raises(api.APIError) as info:  # a lone surrogate: valid JSON, the tokenizer raised a TypeError
        replica._prepare(model.model_validate({"model": "m", **body}), chat=chat)
    assert (info.value.status, info.value.param) == (400, field) and "Unicode" in info.value.message
    if not chat:
        with pytest.raises(api.APIError) as info:
            replica._prepare(api.CompletionRequest.model_validate({"model": "m", "prompt": [5, -1]}), chat=False)
        assert (info.value.status, info.value.param) == (400, "prompt") and "token ids" in info.value.message


def test_a_chat_prompt_over_the_limit_names_the_messages():
    with pytest.raises(api.APIError) as info:
        prepare(ingress(max_prompt_tokens=3), [{"role": "user", "content": "a b c d e f"}])
    assert (info.value.param, info.value.code) == ("messages", "context_length_exceeded")


@pytest.mark.parametrize("body,context,expect", [
    ({}, 100, 16),  # the default fits: kept
    ({}, 20, 10),  # the default is cut to what the context holds after the 10-token prompt
    ({}, 10, ("prompt", "leaves no room")),  # nothing left: the prompt is what to change
    ({"max_tokens": 50}, 40, ("max_tokens", "max_tokens 50 exceeds")),  # a length the client sent is never cut
    ({"max_completion_tokens": 50}, 40, ("max_completion_tokens", "max_completion_tokens 50 exceeds")),
    # a prompt that fills the context alone: no length helps, even one sent (said to lower max_tokens 1)
    ({"max_tokens": 1}, 10, ("prompt", "leaves no room in the model's context of 10 tokens; shorten the prompt")),
    ({"max_tokens": 4}, 8, ("prompt", "prompt of 10 tokens leaves no room")),
])
def test_a_default_length_fits_the_context_and_a_sent_one_is_refused_by_name(body, context, expect):
    from deployments.ingress import _fit_context

    req = api.CompletionRequest.model_validate({**COMPLETION, **body})
    params, prompt = req.sampling(16), list(range(10))
    if isinstance(expect, int):
        assert _fit_context(prompt, params, context, req).max_tokens == expect
        return
    with pytest.raises(api.APIError) as info:
        _fit_context(prompt, params, context, req)
    assert (info.value.status, info.value.param, info.value.code) == (400, expect[0], "context_length_exceeded")
    assert expect[1] in info.value.message


class _Request:
    """A request whose body arrives in ``parts`` (chunked: no Content-Length); ``read`` counts the parts taken."""

    def __init__(self, body: bytes, parts: int = 1) -> None:
        size = -(-len(body) // parts) or 1
        self.headers, self.parts, self.read = {}, [body[i : i + size] for i in range(0, len(body), size)], 0

    async def stream(self):
        for part in self.parts:
            self.read += 1
            yield part


def test_a_chunked_body_is_read_only_up_to_the_limit():
    from deployments.ingress import _parse

    request = _Request(b'{"model": "m", "prompt": "' + b"x" * 10_000 + b'"}', parts=100)
    with pytest.raises(api.APIError) as info:
        asyncio.run(_parse(request, api.CompletionRequest, 2_000))
    assert (info.value.status, info.value.code) == (413, "request_too_large") and request.read <= 21
    small = _Request(b'{"model": "m", "prompt": "hi"}', parts=3)
    assert asyncio.run(_parse(small, api.CompletionRequest, 2_000)).prompt == "hi"


def test_a_body_nested_too_deeply_is_a_400_not_a_500():
    from deployments.ingress import _parse

    body = b'{"model": "m", "prompt": "x", "metadata": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    with pytest.raises(api.APIError) as info:
        asyncio.run(_parse(_Request(body), api.CompletionRequest, 1_000_000))
    assert (info.value.status, info.value.code) == (400, "invalid_json")


def test_an_internal_error_is_counted_as_a_500():
    replica, counted = ingress(), []
    replica.expected_auth = None
    replica.metrics = SimpleNamespace(requests=SimpleNamespace(inc=lambda tags: counted.append(tags["status"])))

    async def broken(req, chat, ended, received):
        raise RuntimeError("a bug")

    replica._serve = broken
    with pytest.raises(RuntimeError):
        asyncio.run(replica._counted("completions", _Request(b'{"model": "m", "prompt": "x"}'),
                                     api.CompletionRequest, chat=False))
    assert counted == ["500"]


def test_retrieve_model_answers_for_the_served_model_only():
    """Its entry is an OpenAI Model, ``created`` included (it was missing: the SDK's strict model and clients
    typed as OpenAI's, e.g. async-openai's u32, refuse an entry without it)."""
    from openai.types import Model

    replica = ingress()
    replica.expected_auth, replica.created = None, 1_796_616_776
    entry = asyncio.run(replica.model("m", _Request(b"")))
    assert entry["id"] == "m" and Model.model_validate(entry, strict=True).created == 1_796_616_776
    with pytest.raises(api.APIError) as info:
        asyncio.run(replica.model("org/other", _Request(b"")))
    assert (info.value.status, info.value.code) == (404, "model_not_found")


def test_validation_messages_read_as_ours_and_point_at_the_other_route():
    """Found by a new user: a chat body sent to /v1/completions said only "prompt: Field required (got {'model':
    ..., 'm)" (the whole body, cut without a mark); validators' messages began with pydantic's "Value error,"."""
    chat_body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    err = api_error(chat_body)
    assert err.message == "prompt: Field required; a body with 'messages' goes to /v1/chat/completions"
    err = api_error({"model": "m", "prompt": "hi"}, api.ChatCompletionRequest)
    assert err.message.endswith("; a body with 'prompt' goes to /v1/completions") and "got" not in err.message
    err = api_error({**COMPLETION, "stop": ["a"] * 5})
    assert "Value error" not in err.message and err.message.startswith("stop: at most 4 stop strings")
    err = api_error({**COMPLETION, "temperature": "x" * 200})
    assert err.message.endswith("...)") and len(err.message) < 160 and err.param == "temperature"


def test_add_special_tokens_is_accepted_only_at_what_each_route_does():
    """vLLM's add_special_tokens changes the prompt's ids and was ignored whatever its value: a completion is
    encoded with the tokenizer's special tokens, a chat by its template without them."""
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    api.CompletionRequest.model_validate({**COMPLETION, "add_special_tokens": True})
    api.ChatCompletionRequest.model_validate({**chat, "add_special_tokens": False})
    err = api_error({**COMPLETION, "add_special_tokens": False})
    assert (err.status, err.param, err.code) == (400, "add_special_tokens", "unsupported_parameter")
    err = api_error({**chat, "add_special_tokens": True}, api.ChatCompletionRequest)
    assert (err.status, err.param, err.code) == (400, "add_special_tokens", "unsupported_parameter")


@pytest.mark.parametrize("header, allowed", [("Bearer k1", True), ("bearer k1", True), ("BEARER  k1 ", True),
                                             ("Bearer k2", False), ("k1", False), ("Basic k1", False), ("", False)])
def test_the_bearer_scheme_is_read_in_any_case_and_the_key_exactly(header, allowed):
    """RFC 9110: an authentication scheme is case-insensitive; 'bearer <key>' was refused."""
    replica = ingress(api_key="k1")
    replica.expected_auth = api_key_header(replica.cfg)
    request = _Request(b"")
    request.headers = {"authorization": header}
    if allowed:
        replica._authorize(request)
    else:
        with pytest.raises(api.APIError) as info:
            replica._authorize(request)
        assert (info.value.status, info.value.code) == (401, "invalid_api_key")


def test_a_method_not_allowed_says_which_are():
    """A 405 must carry Allow (RFC 9110); the error handler rebuilt the response without the exception's headers."""
    from starlette.exceptions import HTTPException

    from deployments.ingress import _http

    response = asyncio.run(_http(None, HTTPException(405, headers={"Allow": "POST"})))
    assert response.status_code == 405 and response.headers["allow"] == "POST"
    assert json.loads(response.body)["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("path,hinted", [("/chat/completions", True), ("/tp1/completions", True), ("/models", True),
                                         ("/v1/nothing", False), ("/v2/chat/completions/", True), ("/x", False),
                                         ("/v1/v1/chat/completions", True)])  # a base URL with /v1, a client adding it
def test_a_route_without_v1_says_where_the_routes_are(path, hinted):
    """A client whose base URL lacks /v1 got a bare 404 "Not Found"."""
    from starlette.exceptions import HTTPException
    from starlette.requests import Request

    from deployments.ingress import _http

    request = Request({"type": "http", "method": "POST", "path": path, "headers": [], "query_string": b""})
    response = asyncio.run(_http(request, HTTPException(404)))
    error = json.loads(response.body)["error"]
    assert response.status_code == 404 and error["type"] == "not_found_error"
    assert ("/v1/chat/completions" in error["message"]) == hinted, error["message"]


def test_a_stream_is_neither_cached_nor_buffered_on_the_way():
    from deployments.ingress import event_stream

    async def events():
        yield {"x": 1}

    response = event_stream(events(), lambda status: None)
    assert response.media_type == "text/event-stream"
    assert response.headers["cache-control"] == "no-cache" and response.headers["x-accel-buffering"] == "no"


@pytest.mark.parametrize("gone", ["send", "disconnect", None])
def test_a_stream_is_counted_once_even_when_its_body_never_starts(gone):
    """A client gone before the response's first byte: Starlette never iterated the body (its start's ``send``
    failed, or the disconnect came first), and the request was never counted. A stream that runs is counted by
    its own end, once."""
    from starlette.requests import ClientDisconnect

    from deployments.ingress import event_stream

    async def events():
        yield {"x": 1}

    async def scenario():
        counted = []
        response = event_stream(events(), counted.append)
        sent = []

        async def send(message):
            if gone == "send":
                raise OSError("connection reset")
            if gone == "disconnect":
                await asyncio.sleep(10)  # the start held up on the way: the disconnect comes first
            sent.append(message)

        async def receive():
            if gone == "disconnect":
                return {"type": "http.disconnect"}
            await asyncio.sleep(10)

        scope = {"type": "http", "asgi": {"spec_version": "2.4" if gone == "send" else "2.0"}}
        try:
            await response(scope, receive, send)
        except ClientDisconnect:
            pass
        return counted, bool(sent)

    counted, sent = asyncio.run(scenario())
    assert counted == (["200"] if gone is None else ["499"]) and sent == (gone is None)


@pytest.mark.parametrize("prompt,param,said", [([1, True], "prompt.1", "not bool"), ([1, "a"], "prompt.1", "not str"),
                                               (["a", 2], "prompt.1", "valid string")])
def test_a_bad_element_of_a_prompt_list_is_the_one_named(prompt, param, said):
    """``[1, true]`` said "prompt.0: Input should be a valid string (got 1)": element 0 is a fine token id."""
    err = api_error({**COMPLETION, "prompt": prompt})
    assert err.param == param and said in err.message, err.message


@pytest.mark.parametrize("body, param", [
    ({"prompt": "hi", "temperature": "\ud800"}, "temperature"),  # the error quotes it: rendering it raised
    ({"prompt": "hi", "logit_bias": "\ud800"}, "logit_bias"),  # pydantic's errors() itself raised
    ({"prompt": "hi", "stop": ["a", "\ud800"]}, "stop"),  # accepted: a stop string no output can hold, ignored
    ({"prompt": "hi", "max_tokn\ud800": 5}, None),  # an unknown field's name quoted
])
def test_an_unpaired_surrogate_anywhere_is_a_400_that_renders(body, param):
    """A value sent as ``"\\ud800"`` is valid JSON but not UTF-8: an error quoting it failed to render (a 500,
    counted as a 400), and a stop string holding one was ignored. Found by a README review (session 61)."""
    from starlette.responses import JSONResponse

    err = api_error({"model": "m", **body})
    rendered = json.loads(JSONResponse(err.body(), status_code=err.status).body)
    assert err.status == 400 and (param is None or rendered["error"]["param"] == param)
    assert "\\ud800" in rendered["error"]["message"] or "Unicode" in rendered["error"]["message"]
