"""Pydantic models for every edge: what a request may ask for, validated with the bad value echoed."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator

MAX_STOP_STRINGS = 4
MAX_STOP_LENGTH = 128


class SamplingParams(BaseModel):
    """How to decode one request. ``temperature = 0`` is greedy (exactly the target's argmax decoding)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    max_tokens: int = Field(128, ge=1, description="Tokens to generate at most (the prompt not included).")
    temperature: float = Field(0.0, ge=0.0, le=100.0, description="0 = greedy; > 0 samples from softmax(logits / T).")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus: sample only from the smallest set of mass top_p.")
    seed: int | None = Field(None, ge=0, lt=2**62, description="Same seed, same request -> same tokens. None = random.")
    stop: tuple[str, ...] = Field((), description=f"Up to {MAX_STOP_STRINGS} strings that end generation (not returned).")
    ignore_eos: bool = Field(False, description="Keep generating past end-of-sequence tokens (benchmarks).")

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_list(cls, value):
        if value is None:
            return ()
        if isinstance(value, str):
            value = [value]
        value = tuple(value)
        if len(value) > MAX_STOP_STRINGS:
            raise ValueError(f"{len(value)} stop strings; at most {MAX_STOP_STRINGS} are allowed")
        for s in value:
            if not isinstance(s, str) or not s or len(s) > MAX_STOP_LENGTH:
                raise ValueError(f"stop string {s!r:.40} must be a non-empty string of at most {MAX_STOP_LENGTH} chars")
        return value

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
