"""OpenAI-compatible request/response models and the one place errors become HTTP responses.

Unknown fields are tolerated (clients send many: ``user``, ``metadata``, ...), except a misspelt known one
(``max_token``: "did you mean 'max_tokens'?") and other servers' output options (``max_new_tokens``,
``num_predict``, ``stop_sequences``, ...: ``FOREIGN_FIELDS``); a field that would change the output and that we
cannot honour (best_of, echo, tools, penalties, logit_bias, a JSON response_format, vLLM's top_k / min_p / ...)
is accepted only at its no-op value and otherwise rejected with a 400 naming it, never silently ignored. Values
in messages are shown as JSON (``true``, ``null``). ``null`` stands for a field's default, as in OpenAI's API.
Every error body is OpenAI-style: ``{"error": {"message", "type", "param", "code"}}``; no stack trace ever
reaches a client.
"""

from __future__ import annotations

import difflib
import json
import logging
import re
import time
import uuid
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (BaseModel, BeforeValidator, ConfigDict, Field, StrictBool, ValidationError, field_validator,
                      model_validator)
from pydantic_core import PydanticCustomError

from sequoia_ray.config import MAX_LOGPROBS, MAX_STOP_STRINGS, SamplingParams

logger = logging.getLogger(__name__)


class APIError(Exception):
    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, retry_after_s: int | None = None) -> None:
        message, param = _utf8(message), _utf8(param)
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = {"Retry-After": str(retry_after_s)} if retry_after_s is not None else None

    def __reduce__(self):
        """Pickled whole: raised in ``generate`` / ``generate_stream``, it reaches a DeploymentHandle's caller
        through Ray, which pickles it; the default (``args`` = the message) failed to rebuild it and Ray gave
        the caller an ``UnserializableException`` without the status, so a 429 or 503 read like a 400."""
        return _rebuilt, (self.status, self.message, self.type, self.param, self.code, self.headers)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def _utf8(text: str | None) -> str | None:
    """``text`` with any unpaired surrogate written as its escape (``\\ud800``): an error quoting a value the client
    sent as ``"\\ud800"`` (valid JSON, not UTF-8) failed to render, and the client got a 500."""
    return text if text is None else text.encode("utf-8", "backslashreplace").decode("utf-8")


def _rebuilt(status, message, type, param, code, headers) -> APIError:  # noqa: A002 - APIError's own names
    error = APIError(status, message, type=type, param=param, code=code)
    error.headers = headers
    return error


def validation_error(exc: ValidationError | Any) -> APIError:
    """A pydantic/FastAPI validation failure as a 400 naming the first bad field and value."""
    errors = exc.errors() if hasattr(exc, "errors") else []
    if not errors:
        return APIError(400, str(exc))
    first = max(errors, key=lambda e: _furthest(e, errors))  # the member of a union that got furthest
    loc = _field_path(first)
    got = first.get("input")
    if not loc and "param" in first.get("ctx", {}):  # a whole-body check that names its field (``_unsupported``)
        return APIError(400, first["msg"], param=first["ctx"]["param"],
                        code=first["ctx"].get("code", "unsupported_parameter"))
    msg = str(first.get("msg", "")).removeprefix("Value error, ")  # pydantic's prefix for a validator's ValueError
    if first.get("type") == "missing":  # ``input`` is then the whole body: no value of the field to show
        message = f"{'.'.join(loc) or 'body'}: {msg}" + _other_route(tuple(loc), got)
    else:
        message = f"{'.'.join(loc) or 'body'}: {msg}" + (f" (got {_shown(got, 83)})" if got is not None else "")
    return APIError(400, message, param=".".join(loc) or None, code="invalid_value")


def _furthest(error: dict, errors: list[dict]) -> tuple:
    """How far into the request an error got: the depth of its field path, its indices, then the fewest errors
    in its union member (``prompt: [1, "a"]`` fails as a list of text at element 0 and as token ids at element
    1: the ids got further, and the error names element 1, not "prompt.0: should be a valid string (got 1)";
    ``[1, true]`` fails as text at both elements and as ids at element 1 only)."""
    def member(e: dict) -> tuple:
        return tuple(x for x in e.get("loc", ()) if isinstance(x, str) and "[" in x)

    path = _field_path(error)
    return (len(path), [int(x) if x.isdigit() else -1 for x in path],
            -sum(member(e) == member(error) for e in errors))


def _other_route(loc: tuple, body: Any) -> str:
    """The hint for a body sent to the other route: a chat body (``messages``) at /v1/completions, or a
    completion body (``prompt``) at /v1/chat/completions."""
    if not isinstance(body, dict):
        return ""
    if loc == ("prompt",) and "messages" in body:
        return "; a body with 'messages' goes to /v1/chat/completions"
    if loc == ("messages",) and "prompt" in body:
        return "; a body with 'prompt' goes to /v1/completions"
    return ""


def _field_path(error: dict) -> list[str]:
    """An error's location as the request's field names and indices: without FastAPI's "body" and pydantic's
    union member tags (``prompt.str``, ``prompt.list[int].0``, ``function-before[...]``)."""
    def tag(x) -> bool:
        return isinstance(x, str) and (x in ("body", "str", "int", "float", "bool", "list", "dict", "none")
                                       or any(c in x for c in "[]()-"))

    return [str(x) for x in error.get("loc", ()) if not tag(x)]


def _json_number(value):
    if isinstance(value, (str, bool)):  # pydantic's lax mode would read "5" as 5 and true as 1: no guessing
        raise ValueError(f"must be a JSON number, not {type(value).__name__}")
    return value


SEED_MODULUS = 2**62  # SamplingParams' seeds: each request derives its draft's and its target's seed from it
Int = Annotated[int, BeforeValidator(_json_number)]  # 5 and 5.0 (JSON Schema integers), not 5.5 or "5"
Float = Annotated[float, BeforeValidator(_json_number)]

# Fields (OpenAI's, and vLLM's extensions clients send to OpenAI-compatible servers) that change the output and
# that this server does not implement: each is accepted only at a value that changes nothing.
NO_OP_VALUES: dict[str, tuple] = {
    # OpenAI (``logprobs: 0`` is not a no-op: a completion then returns each token's logprob)
    "best_of": (None, 1), "echo": (None, False),
    "suffix": (None, ""), "tools": (None, []), "functions": (None, []), "tool_choice": (None, "auto", "none"),
    "function_call": (None, "none"), "presence_penalty": (None, 0), "frequency_penalty": (None, 0),
    "logit_bias": (None, {}), "response_format": (None, {"type": "text"}), "reasoning_effort": (None,),
    "modalities": (None, ["text"]), "audio": (None,), "web_search_options": (None,),
    "verbosity": (None, "medium"),  # "medium" is OpenAI's default
    # vLLM's sampling and structured-output extensions
    "top_k": (None, 0, -1), "min_p": (None, 0), "repetition_penalty": (None, 1), "min_tokens": (None, 0),
    "use_beam_search": (None, False), "length_penalty": (None, 1), "stop_token_ids": (None, []),
    "bad_words": (None, []), "allowed_token_ids": (None,), "include_stop_str_in_output": (None, False),
    "skip_special_tokens": (None, True), "spaces_between_special_tokens": (None, True),
    "truncate_prompt_tokens": (None,), "prompt_logprobs": (None,), "logits_processors": (None, []),
    "guided_json": (None,),
    "guided_regex": (None,), "guided_choice": (None,), "guided_grammar": (None,), "structured_outputs": (None,),
    # vLLM's chat-template extensions (chat requests)
    "add_generation_prompt": (None, True), "continue_final_message": (None, False), "chat_template": (None,),
    "chat_template_kwargs": (None, {}), "documents": (None,),
}


# Other servers' names for output-changing options (Hugging Face TGI and transformers, Ollama, llama.cpp,
# text-generation-webui, Anthropic), sent by clients ported to this API: none is OpenAI's, each would be ignored.
# name -> (our field that does it, or None; the values that change nothing). A length or stop option is
# accepted beside our own field (a client written for several servers sends both); else refused by name.
FOREIGN_FIELDS: dict[str, tuple[str | None, tuple]] = {
    "max_new_tokens": ("max_tokens", (None,)), "num_predict": ("max_tokens", (None,)),
    "max_length": ("max_tokens", (None,)), "n_predict": ("max_tokens", (None,)),
    "stop_sequences": ("stop", (None, [])), "do_sample": ("temperature", (None, True)),
    "repeat_penalty": (None, (None, 1)), "typical_p": (None, (None, 1)), "tfs_z": (None, (None, 1)),
    "mirostat": (None, (None, 0)), "top_a": (None, (None, 0)), "num_beams": (None, (None, 1)),
    "no_repeat_ngram_size": (None, (None, 0)), "return_full_text": (None, (None, False)),
    "grammar": (None, (None, "")), "watermark": (None, (None, False)),
}
TYPO_CUTOFF = 0.8  # difflib's ratio from which an unknown field may be a misspelt known one ("max_token") ...
TYPO_EDITS = 4, 2  # ... and one edit per 4 characters of it, at least one and at most 2 ("top_a" is not "top_p",
# "repetition_penalty_range" not "repetition_penalty")


def _no_op(value, no_op: tuple) -> bool:
    return any(value is ok or value == ok and isinstance(value, bool) == isinstance(ok, bool) for ok in no_op)


def _snake(name: str) -> str:
    """``stopSequences``, ``max-tokens`` -> ``stop_sequences``, ``max_tokens``."""
    return re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", name).replace("-", "_").lower()


def _edits(a: str, b: str) -> int:
    """Levenshtein distance."""
    row = list(range(len(b) + 1))
    for i, x in enumerate(a, 1):
        row, last = [i] + [0] * len(b), row
        for j, y in enumerate(b, 1):
            row[j] = min(last[j] + 1, row[j - 1] + 1, last[j - 1] + (x != y))
    return row[-1]


def _shown(value, width: int = 60) -> str:
    """``value`` as JSON (``true``, ``null``: what the client sends; Python's repr where JSON cannot say it), cut
    to ``width`` characters with an ellipsis (a long tools list reads as cut, not as the message going on where
    it stopped)."""
    try:
        text = json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        text = repr(value)
    text = _utf8(text)  # a pydantic error's message holding an unpaired surrogate failed to render at all
    return text if len(text) <= width else text[:width - 3] + "..."


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")

    include_usage: StrictBool | None = Field(
        None, description="Send a last chunk with the usage and no choices before [DONE]; every other chunk then "
                          "has usage null, as OpenAI's (without it the finish chunk carries the usage).")
    continuous_usage_stats: StrictBool | None = Field(
        None, description="vLLM's extension: every chunk carries the usage so far.")


class _Common(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str = Field(description="The served model id (see /v1/models).")
    max_tokens: Int | None = Field(None, ge=1, description="Tokens to generate at most.")
    temperature: Float | None = Field(None, ge=0.0, le=2.0, description="Default (null) 1.0; 0 = greedy.")
    top_p: Float | None = Field(None, gt=0.0, le=1.0, description="Default (null) 1.0.")
    seed: Int | None = Field(None, ge=-(2**63), le=2**63 - 1, description="Any 64-bit integer (OpenAI's); the "
                             "generators are seeded with it modulo 2**62.")
    stop: str | list[str] | None = None
    stream: StrictBool | None = False
    stream_options: StreamOptions | None = None
    speculative: StrictBool | None = Field(True, description="sequoia-ray extension: false = the target alone (for "
                                           "A/B); null = true.")
    ignore_eos: StrictBool | None = Field(False, description="vLLM's extension: keep generating past "
                                          "end-of-sequence; null = false.")
    max_completion_tokens: Int | None = Field(None, ge=1, description="OpenAI's newer name for max_tokens.")
    n: Int | None = Field(None, ge=1, description="Choices per prompt (null: 1), generated side by side; with a seed, "
                          "choice j is seeded with seed + j (vLLM's rule), so sampled choices differ.")

    @field_validator("stop")
    @classmethod
    def _stop(cls, value):
        if isinstance(value, list) and len(value) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings, got {len(value)}")
        for text in [value] if isinstance(value, str) else value or ():
            try:
                text.encode("utf-8")
            except UnicodeError:  # no output holds one: the stop string was ignored silently
                raise ValueError("holds text that is not valid Unicode (an unpaired surrogate); send UTF-8 text")
        return value

    ROUTE_NO_OPS: ClassVar[dict[str, tuple]] = {}  # a route's own no-op values (beside NO_OP_VALUES)

    @model_validator(mode="after")
    def _unsupported(self):
        extra = self.model_extra or {}
        for name, no_op in {**NO_OP_VALUES, **self.ROUTE_NO_OPS}.items():
            value = extra.get(name)
            if not _no_op(value, no_op):
                raise PydanticCustomError(
                    "unsupported", "'{param}' = {value} is not supported by this server; leave it out (or send "
                    "{no_op})", {"param": name, "value": _shown(value), "no_op": _shown(no_op[-1])})
        ours = {*type(self).model_fields, *NO_OP_VALUES, *self.ROUTE_NO_OPS}
        for name, value in extra.items():
            if value is None or name in ours:
                continue
            snake = _snake(name)
            if snake in FOREIGN_FIELDS:
                instead, no_op = FOREIGN_FIELDS[snake]
                if _no_op(value, no_op) or instead in type(self).model_fields and getattr(self, instead) is not None:
                    continue
                raise PydanticCustomError(
                    "unsupported", "'{param}' is not an OpenAI field and this server does not read it; " + (
                        f"send '{instead}' instead" if instead else "leave it out"),
                    {"param": name, "code": "unknown_parameter"})
            close = difflib.get_close_matches(snake, ours, n=1, cutoff=TYPO_CUTOFF)
            edits = min(TYPO_EDITS[1], max(1, len(snake) // TYPO_EDITS[0]))
            if close and _edits(snake, close[0]) <= edits:  # else tolerated: clients send many fields of their own
                raise PydanticCustomError(
                    "unknown", "unknown field '{param}'; did you mean '{known}'?",
                    {"param": name, "known": close[0], "code": "unknown_parameter"})
        return self

    @model_validator(mode="after")
    def _one_length(self):
        if None not in (self.max_tokens, self.max_completion_tokens) and self.max_tokens != self.max_completion_tokens:
            raise PydanticCustomError(
                "conflict", "max_tokens {max_tokens} and max_completion_tokens {max_completion_tokens} differ; send "
                "one of them", {"param": "max_completion_tokens", "code": "invalid_value",
                                "max_tokens": self.max_tokens, "max_completion_tokens": self.max_completion_tokens})
        if self.max_completion_tokens is not None:
            self.max_tokens = self.max_completion_tokens
        return self

    @model_validator(mode="after")
    def _null_is_the_default(self):
        if self.speculative is None:
            self.speculative = True
        if self.ignore_eos is None:
            self.ignore_eos = False
        return self

    @property
    def length_param(self) -> str:
        """The field that set the length limit, for errors."""
        return "max_tokens" if self.max_completion_tokens is None else "max_completion_tokens"

    @property
    def length_sent(self) -> bool:
        """Whether the client set a length limit (else the server's default, fitted to the context)."""
        return self.max_tokens is not None

    @model_validator(mode="after")
    def _stream_options_with_stream(self):
        if self.stream_options is not None and not self.stream:
            raise PydanticCustomError("stream_options", "stream_options is only allowed with stream: true",
                                      {"param": "stream_options", "code": "invalid_value"})
        return self

    @property
    def choices(self) -> int:
        """Choices per prompt (``n``)."""
        return self.n or 1

    def sampling(self, default_max: int) -> SamplingParams:
        return SamplingParams(max_tokens=self.max_tokens or default_max,
                              temperature=1.0 if self.temperature is None else self.temperature,
                              top_p=1.0 if self.top_p is None else self.top_p,
                              seed=None if self.seed is None else self.seed % SEED_MODULUS, stop=self.stop,
                              ignore_eos=self.ignore_eos, logprobs=self.logprob_count)  # each route's property

    @property
    def usage_chunk(self) -> bool:
        """Whether a stream ends with a usage-only chunk (``stream_options.include_usage``)."""
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def usage_every_chunk(self) -> bool:
        """Whether every chunk carries the usage so far (vLLM's ``stream_options.continuous_usage_stats``)."""
        return bool(self.stream_options and self.stream_options.continuous_usage_stats)


def _is_batch(value) -> bool:
    """Whether ``prompt`` holds several prompts: an array of texts or of token arrays (not one token array)."""
    return isinstance(value, list) and bool(value) and isinstance(value[0], (str, list))


class CompletionRequest(_Common):
    prompt_param: ClassVar[str] = "prompt"  # the field that holds the prompt, for errors
    # vLLM's add_special_tokens: a prompt is encoded with the tokenizer's special tokens (its BOS, if it has one), as
    # vLLM's completions are; top_logprobs is the chat's field (here ``logprobs`` is the count): it was ignored
    ROUTE_NO_OPS: ClassVar[dict[str, tuple]] = {"add_special_tokens": (None, True), "top_logprobs": (None, 0)}
    id_kind: ClassVar[str] = "cmpl"  # the prefix of the response's id
    prompt: str | list[str] | list[Int] | list[list[Int]] = Field(
        description="Text or token ids; or an array of either, a batch: one choice per prompt, in order (``index``), "
                    "the prompts generated side by side. lm-eval's local-completions and LangChain send batches.")

    logprobs: Annotated[Int | None, BeforeValidator(lambda v: None if v is False else v)] = Field(
        None, ge=0, le=MAX_LOGPROBS, description="Return each token's log-probability under the target (its raw "
        "logits) and this many likeliest alternatives (0: none); false: none.")

    @property
    def logprob_count(self) -> int | None:
        return self.logprobs

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_kind(cls, value):
        """A batch of texts and token arrays mixed: said so (it read "prompt.1: Input should be a valid string")."""
        if _is_batch(value):
            first = type(value[0])
            for i, one in enumerate(value):
                if isinstance(one, (str, list)) and not isinstance(one, first):
                    raise ValueError(f"a batch holds texts or token arrays, not both: prompt {i} is "
                                     f"{'text' if isinstance(one, str) else 'a token array'}, prompt 0 is not")
        return value

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, value):
        if value in ("", []):
            raise ValueError("the prompt is empty")
        if _is_batch(value):
            empty = [i for i, one in enumerate(value) if one in ("", [])]
            if empty:
                raise ValueError("the prompt is empty" if len(value) == 1
                                 else f"prompt {empty[0]} of the batch of {len(value)} is empty")
        return value

    @property
    def prompts(self) -> list[str | list[int]]:
        """The request's prompts, one or a batch's."""
        return list(self.prompt) if _is_batch(self.prompt) else [self.prompt]


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "developer"]
    content: str | list[dict[str, Any]]
    name: str | None = Field(None, description="The participant's name; passed to the chat template, as vLLM does.")

    @model_validator(mode="before")
    @classmethod
    def _no_tool_calls(cls, value):
        """A tool call or its result in the history (``tool_calls``, ``function_call``, ``tool_call_id``) was
        dropped silently, so the model saw another conversation; and an assistant message of tool calls alone
        (``content`` null) was refused as "not null", hiding why."""
        if isinstance(value, dict):
            for name in ("tool_calls", "function_call", "tool_call_id"):
                if value.get(name) not in (None, [], ""):
                    raise ValueError(f"has '{name}': tool calls are not supported by this server (no tools are "
                                     "offered); send the conversation's text only")
        return value

    @field_validator("content", mode="before")
    @classmethod
    def _text_only(cls, value):
        """A string, or text parts ``{"type": "text", "text": <string>}`` (no images, audio or files)."""
        if value is None:
            raise ValueError("must be a string or a list of text parts, not null")
        for i, part in enumerate(value if isinstance(value, list) else ()):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            if kind != "text":
                raise ValueError(f"part {i} has type {kind!r}; only text parts are supported")
            if not isinstance(part.get("text"), str):
                raise ValueError(f"part {i} is a text part without a string 'text'")
        return value

    def for_template(self) -> dict[str, str]:
        """The message as chat templates take it: OpenAI's "developer" role (its newer name for "system") is
        "system", which templates know; a template without a "developer" branch would drop the text. A ``name``
        goes with it (templates that know it render it)."""
        message = {"role": "system" if self.role == "developer" else self.role, "content": self.text()}
        return message if self.name is None else {**message, "name": self.name}

    def text(self) -> str:
        """The content as text: text parts (``_text_only``) joined by newlines, as vLLM joins them."""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part["text"] for part in self.content)


class ChatCompletionRequest(_Common):
    prompt_param: ClassVar[str] = "messages"
    id_kind: ClassVar[str] = "chatcmpl"
    ROUTE_NO_OPS: ClassVar[dict[str, tuple]] = {"add_special_tokens": (None, False)}  # the chat template writes
    # them, as vLLM's chats do
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: StrictBool | None = Field(None, description="Return each token's log-probability under the target "
                                        "(its raw logits), as OpenAI's chat does.")
    top_logprobs: Int | None = Field(None, ge=0, le=MAX_LOGPROBS, description="With logprobs: this many likeliest "
                                     "alternatives per token.")

    @model_validator(mode="after")
    def _top_with_logprobs(self):
        if self.top_logprobs and not self.logprobs:
            raise PydanticCustomError("top_logprobs", "top_logprobs needs logprobs: true",
                                      {"param": "top_logprobs", "code": "invalid_value"})
        return self

    @property
    def logprob_count(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


def completion_id(kind: str) -> str:
    return f"{kind}-{uuid.uuid4().hex[:24]}"


def usage(prompt_tokens: int, completion_tokens: int, stats: dict | None) -> dict:
    out = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
           "total_tokens": prompt_tokens + completion_tokens}
    if stats is not None:
        out["speculative"] = stats
    return out


def completion_body(rid: str, model: str, choices: list[tuple[str, str, dict | None]], use: dict) -> dict:
    """``choices``: each choice's (text, finish_reason, logprobs), in order (a prompt's ``n`` choices, then the
    next's)."""
    return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": [{"index": i, "text": text, "finish_reason": finish, "logprobs": logprobs}
                        for i, (text, finish, logprobs) in enumerate(choices)], "usage": use}


def chat_body(rid: str, model: str, choices: list[tuple[str, str, dict | None]], use: dict) -> dict:
    """``choices``: each choice's (text, finish_reason, logprobs), in order."""
    return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [{"index": i, "message": {"role": "assistant", "content": text}, "finish_reason": finish,
                         "logprobs": logprobs} for i, (text, finish, logprobs) in enumerate(choices)],
            "usage": use}


LOWEST_LOGPROB = -9999.0  # JSON has no -inf (a token the target rules out): vLLM's floor


def _lp(value: float) -> float:
    """A log-probability JSON can carry: -inf (and NaN, from logits that overflowed) at the floor."""
    return value if value >= LOWEST_LOGPROB else LOWEST_LOGPROB  # NaN compares false


def completion_logprobs(text_of, entries: list, offset: int = 0) -> dict:
    """A completion choice's ``logprobs`` (OpenAI's legacy form) for ``entries`` (``Chunk.logprobs``: per token,
    (id, log-probability, likeliest)): each token's text (``text_of(id)``), its log-probability, the likeliest
    texts with theirs (the token's own first among them, as vLLM's: of ids that read alike, e.g. byte-fallback
    pieces that all read U+FFFD, the first keeps the key) and its offset in the choice's text from ``offset``."""
    tokens, offsets, top = [], [], []
    for token_id, lp, likely in entries:
        tokens.append(text_of(token_id))
        offsets.append(offset)
        offset += len(tokens[-1])
        alternatives: dict[str, float] = {}
        for i, v in ((token_id, lp), *likely):
            alternatives.setdefault(text_of(i), _lp(v))
        top.append(alternatives)
    return {"tokens": tokens, "token_logprobs": [_lp(lp) for _, lp, _ in entries], "top_logprobs": top,
            "text_offset": offsets}


def chat_logprobs(text_of, entries: list, bytes_of=None) -> dict:
    """A chat choice's ``logprobs`` (OpenAI's form: ``content``, one entry a token with its UTF-8 bytes).
    ``bytes_of(id)``: a token's own bytes (None: unknown), which rebuild a character split across tokens whose text
    alone is U+FFFD (an emoji's 4 byte tokens gave three U+FFFD's bytes); else its text's."""
    def one(token_id: int, lp: float) -> dict:
        text = text_of(token_id)
        raw = bytes_of(token_id) if bytes_of is not None else None
        return {"token": text, "logprob": _lp(lp),
                "bytes": list(raw if raw is not None else text.encode("utf-8", "backslashreplace"))}

    return {"content": [{**one(token_id, lp), "top_logprobs": [one(i, v) for i, v in likely]}
                        for token_id, lp, likely in entries], "refusal": None}


def completion_chunk(rid: str, model: str, text: str, finish: str | None, created: int, index: int = 0,
                     logprobs: dict | None = None) -> dict:
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": index, "text": text, "finish_reason": finish, "logprobs": logprobs}]}


def chat_chunk(rid: str, model: str, delta: dict, finish: str | None, created: int, index: int = 0,
               logprobs: dict | None = None) -> dict:
    return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [{"index": index, "delta": delta, "finish_reason": finish, "logprobs": logprobs}]}


class _ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorBody(BaseModel):
    """Every 4xx/5xx body."""

    error: _ErrorDetail


def openapi_schema(base: dict) -> dict:
    """``base`` (FastAPI's document) plus the request bodies the POST routes parse themselves and the
    OpenAI-style error responses, so clients and fuzzers see the real contract."""
    components = base.setdefault("components", {}).setdefault("schemas", {})

    def ref(model: type[BaseModel]) -> dict:
        schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
        components.update(schema.pop("$defs", {}))
        components[model.__name__] = schema
        return {"$ref": f"#/components/schemas/{model.__name__}"}

    error = {"description": "OpenAI-style error", "content": {"application/json": {"schema": ref(ErrorBody)}}}
    events = {"schema": {"type": "object", "description": "each event's data: a chunk (or an error); then [DONE]"}}
    for path, model in (("/v1/completions", CompletionRequest), ("/v1/chat/completions", ChatCompletionRequest)):
        op = base["paths"][path]["post"]
        op["requestBody"] = {"required": True, "content": {"application/json": {"schema": ref(model)}}}
        op["responses"]["200"]["description"] = "The completion, or with stream: true a server-sent-event stream"
        op["responses"]["200"]["content"]["text/event-stream"] = events
        op["responses"].update({code: error for code in ("400", "401", "404", "413", "429", "503")})
    return base
