"""OpenAI-compatible request/response models and the one place errors become HTTP responses.

Unknown OpenAI fields are tolerated (clients send many); fields we cannot honour (n > 1, logprobs, echo,
best_of, tools) are rejected with 400 rather than silently ignored. Every error body is OpenAI-style:
``{"error": {"message", "type", "param", "code"}}``; no stack trace ever reaches a client.
"""

from __future__ import annotations

import logging
import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import (BaseModel, BeforeValidator, ConfigDict, Field, StrictBool, ValidationError, field_validator,
                      model_validator)

from sequoia_ray.config import MAX_STOP_STRINGS, SamplingParams

logger = logging.getLogger(__name__)


class APIError(Exception):
    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, retry_after_s: int | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = {"Retry-After": str(retry_after_s)} if retry_after_s is not None else None

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def validation_error(exc: ValidationError | Any) -> APIError:
    """A pydantic/FastAPI validation failure as a 400 naming the first bad field and value."""
    errors = exc.errors() if hasattr(exc, "errors") else []
    if not errors:
        return APIError(400, str(exc))
    first = errors[0]
    loc = [str(x) for x in first.get("loc", ()) if x not in ("body",)]
    got = first.get("input")
    message = f"{'.'.join(loc) or 'body'}: {first.get('msg')}" + (f" (got {got!r:.80})" if got is not None else "")
    return APIError(400, message, param=".".join(loc) or None, code="invalid_value")


def _json_number(value):
    if isinstance(value, (str, bool)):  # pydantic's lax mode would read "5" as 5 and true as 1: no guessing
        raise ValueError(f"must be a JSON number, not {type(value).__name__}")
    return value


Int = Annotated[int, BeforeValidator(_json_number)]  # 5 and 5.0 (JSON Schema integers), not 5.5 or "5"
Float = Annotated[float, BeforeValidator(_json_number)]


class _Common(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str = Field(description="The served model id (see /v1/models).")
    max_tokens: Int | None = Field(None, ge=1, description="Tokens to generate at most.")
    temperature: Float = Field(1.0, ge=0.0, le=2.0)
    top_p: Float = Field(1.0, gt=0.0, le=1.0)
    seed: Int | None = Field(None, ge=0, lt=2**62)
    stop: str | list[str] | None = None
    stream: StrictBool = False
    n: Int = Field(1, ge=1, le=1, description="Only n = 1 is supported.")
    speculative: StrictBool = Field(True, description="sequoia-ray extension: false = the target alone (for A/B).")

    @field_validator("stop")
    @classmethod
    def _stop(cls, value):
        if isinstance(value, list) and len(value) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings, got {len(value)}")
        return value

    @model_validator(mode="after")
    def _unsupported(self):
        extra = self.model_extra or {}
        for name in ("logprobs", "top_logprobs", "best_of", "tools", "functions", "suffix"):
            if extra.get(name) not in (None, False, 0, []):
                raise ValueError(f"'{name}' is not supported by this server")
        if extra.get("echo"):
            raise ValueError("'echo' is not supported by this server")
        return self

    def sampling(self, default_max: int) -> SamplingParams:
        return SamplingParams(max_tokens=self.max_tokens or default_max, temperature=self.temperature,
                              top_p=self.top_p, seed=self.seed, stop=self.stop)


class CompletionRequest(_Common):
    prompt: str | list[str] | list[Int] = Field(description="Text, a one-element list of text, or token ids.")

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, value):
        if isinstance(value, list) and value and all(isinstance(x, str) for x in value):
            if len(value) != 1:
                raise ValueError(f"only one prompt per request is supported, got {len(value)}")
        if value in ("", []) or value == [""]:
            raise ValueError("the prompt is empty")
        return value


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "developer"]
    content: str | list[dict[str, Any]]

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ValueError(f"only text content parts are supported, got {part.get('type')!r}")
            parts.append(part["text"])
        return "".join(parts)


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Int | None = Field(None, ge=1)

    def sampling(self, default_max: int) -> SamplingParams:
        params = super().sampling(default_max)
        if self.max_completion_tokens is not None and self.max_tokens is None:
            params = params.model_copy(update={"max_tokens": self.max_completion_tokens})
        return params


def completion_id(kind: str) -> str:
    return f"{kind}-{uuid.uuid4().hex[:24]}"


def usage(prompt_tokens: int, completion_tokens: int, stats: dict | None) -> dict:
    out = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
           "total_tokens": prompt_tokens + completion_tokens}
    if stats is not None:
        out["speculative"] = stats
    return out


def completion_body(rid: str, model: str, text: str, finish: str, use: dict) -> dict:
    return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "text": text, "finish_reason": finish, "logprobs": None}], "usage": use}


def chat_body(rid: str, model: str, text: str, finish: str, use: dict) -> dict:
    return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish}],
            "usage": use}


def completion_chunk(rid: str, model: str, text: str, finish: str | None) -> dict:
    return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "text": text, "finish_reason": finish, "logprobs": None}]}


def chat_chunk(rid: str, model: str, delta: dict, finish: str | None) -> dict:
    return {"id": rid, "object": "chat.completion.chunk", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}


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
