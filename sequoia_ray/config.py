"""Pydantic models for the core's edges (sampling, the profiling job), validated with the bad value echoed.
The serving configuration lives with the Serve app (``deployments/config.py``)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, field_validator

DEFAULT_DRAFT_VOCAB = 65536  # ids kept in a draft's LM head (sequoia_ray.models.draft_vocab); None: the full head
DRAFT_VOCAB_DOC = ("The draft's LM head keeps only this many lowest token ids plus the special tokens (lossless; "
                   "a draft level reads fewer weights); null or 'full' = the full head.")


def draft_vocab_value(value):
    """A config's ``draft_vocab`` as given: ``'full'`` (any case) is None; a boolean (YAML's yes/on/true) is
    refused, not read as 1 — pydantic's lax mode would keep only id 0 and the special tokens."""
    if isinstance(value, str) and value.strip().lower() == "full":
        return None
    if isinstance(value, bool) or (isinstance(value, str) and not value.strip().isdigit()):
        raise ValueError(f"draft_vocab {value!r}: give an integer >= 1 (the lowest ids kept in the draft's LM head), "
                         "or null / 'full' for the full head")
    return value


DraftVocab = Annotated[int | None, BeforeValidator(draft_vocab_value)]  # ServeConfig's and the profiling job's
DraftQuantize = Literal["int8"] | None  # the one quantisation loading knows (models/loading.py); checked at the config

PLAN_FALLBACK_FILES = 4  # older files a plan store fetch tries when the newest in a folder does not read
PLAN_KEEP_FILES = 100  # published files a plan store folder keeps after a publish (sequoia_ray.plan_store); here,
# not there, so the Serve config reads them without importing torch (the routing replicas import no torch)


def check_plan_keep(keep: int, name: str = "keep") -> int:
    """``keep`` (a plan store's, a Serve config's ``plan_keep``): 0 (every file) or more than the fallback files a
    fetch may read; ValueError naming ``name`` otherwise."""
    if keep < 0 or 0 < keep <= PLAN_FALLBACK_FILES:
        raise ValueError(f"{name} {keep} would delete files a fetch may fall back to (it reads the newest "
                         f"{PLAN_FALLBACK_FILES + 1}): give more than {PLAN_FALLBACK_FILES}, or 0 to keep every file")
    return keep
MAX_STOP_STRINGS = 4
MAX_STOP_LENGTH = 128
GREEDY_BELOW = 1e-5  # temperatures below this are greedy: the limit T -> 0, without logits / T overflowing
MAX_LOGPROBS = 20  # alternatives a token's log-probability may come with at most (OpenAI's top_logprobs limit)
MAX_TEMPERATURE = 100.0  # the highest a request (and so a profiled temperature bucket) may ask for


class SamplingParams(BaseModel):
    """How to decode one request. ``temperature = 0`` is greedy (exactly the target's argmax decoding)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    max_tokens: int = Field(128, ge=1, description="Tokens to generate at most (the prompt not included).")
    temperature: float = Field(0.0, ge=0.0, le=MAX_TEMPERATURE,
                               description="0 = greedy; > 0 samples from softmax(logits / T).")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus: sample only from the smallest set of mass top_p.")
    seed: int | None = Field(None, ge=0, lt=2**62,
                             description="Same seed, same request, same trees -> same tokens (the served tree follows "
                                         "the load; the tokens' law is always the target's). None = random.")
    stop: tuple[str, ...] = Field((), description=f"Up to {MAX_STOP_STRINGS} strings that end generation (not returned).")
    ignore_eos: bool = Field(False, description="Keep generating past end-of-sequence tokens (benchmarks).")
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS,
                                 description="Report each generated token's log-probability under the target (its "
                                             "raw logits: before temperature and top-p, as vLLM's) with this many "
                                             "likeliest alternatives; None: none.")

    @field_validator("temperature")
    @classmethod
    def _tiny_is_greedy(cls, value: float) -> float:
        return 0.0 if value < GREEDY_BELOW else value

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


class ProfileJobConfig(BaseModel):
    """The profiling job: per hardware type, measure p, profile t(n) and c, run the DP, choose, validate,
    publish the plan and the profile to the store serving reads."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    storage: str = Field(description="Plan store URI: a local directory or s3://bucket/prefix (pyarrow.fs).")
    draft: str = Field("default-draft", description="Draft model source (HF dir, .gguf, hub id, default-draft).")
    target: str = Field("default-target", description="Target model source.")
    temperatures: tuple[float, ...] = Field((0.0, 0.6), description="Temperature buckets to plan for.")
    budgets: tuple[int, ...] = Field((1, 2, 4, 8, 12, 16, 24, 32, 48, 64), description="Tree sizes n to profile.")
    max_depth: int = Field(10, ge=1, le=64, description="Deepest tree considered (levels, root included).")
    width: int = Field(8, ge=1, le=64, description="Star width W when measuring the acceptance vector.")
    prompts: str | None = Field(None, description="Prompt file (.jsonl or lines); default: a built-in set.")
    acceptance: dict[float, str] = Field(default_factory=dict, description="Temperature -> acceptance file to use instead of measuring.")
    measure_tokens: int = Field(48, ge=1, description="Tokens generated per prompt while measuring p.")
    validate_tokens: int = Field(48, ge=1, description="Tokens per prompt when validating the chosen plan.")
    max_prompts: int = Field(6, ge=1, description="Prompts used for measuring and validating.")
    context: int = Field(256, ge=1, description="Cached context length at which t(n) and c are profiled.")
    candidates: int = Field(3, ge=0, le=16, description="Trees the cost model predicts fastest that are then run "
                            "for real per batch bucket (besides the target alone); the fastest measured is published.")
    measure_rounds: int = Field(3, ge=1, le=20, description="Round-robin rounds of the measured choice and overhead runs.")
    max_noise: float = Field(0.25, gt=0.0, description="Refuse a profile whose timing noise (median relative MAD of "
                             "the repeats) or drift between rounds (sequoia_ray.hardware.round_drift) exceeds this "
                             "fraction (e.g. 0.25, not 25); raise it on a shared machine.")
    dtype: str = Field("bfloat16", description="Model dtype on this hardware: float32 | bfloat16 | float16.")
    draft_quantize: DraftQuantize = Field(None, description="'int8' for a dynamically quantised CPU draft.")
    linears: Literal["auto", "packed", "aten"] = Field("auto", description="Linear layers on weights packed once for "
                                                       "oneDNN (CPU): auto = bf16 models, packed = also fp32, aten = never.")
    layers: Literal["auto", "traced", "eager"] = Field("auto", description="Decoder layers' dense parts as TorchScript "
                                                      "traces, bitwise the same output: auto = CPU models, traced = "
                                                      "also elsewhere, eager = never.")
    draft_vocab: DraftVocab = Field(DEFAULT_DRAFT_VOCAB, ge=1, description=DRAFT_VOCAB_DOC)
    tp_size: int = Field(1, ge=1, description="Tensor-parallel size of the target (part of the hardware id).")
    hardware: tuple[str, ...] = Field((), description="Accelerator types to profile; default: every type in the cluster.")
    smoke_test: bool = Field(False, description="Tiny random models and small sizes: seconds, for CI.")
    device: str = Field("auto", description="Where the models run: auto (the trial's assigned accelerator, else "
                        "the CPU) | cpu | cuda.")

    @field_validator("budgets")
    @classmethod
    def _budgets(cls, value):
        from sequoia_ray.tree.plan import MAX_PLAN_NODES

        if not value or min(value) < 1 or max(value) > MAX_PLAN_NODES:
            raise ValueError(f"budgets {value} must be tree sizes from 1 to {MAX_PLAN_NODES}")
        if max(value) < 2:  # the overhead is measured on a tree (profiling._probe): there would be none
            raise ValueError(f"budgets {value} hold no tree with a draft token (n >= 2), so every plan would be the "
                             "target alone; add sizes >= 2 (e.g. 2,4,8,16), or serve without a draft")
        return tuple(sorted(set(value) | {1}))

    @field_validator("max_depth")
    @classmethod
    def _max_depth(cls, value):
        if value < 2:  # as for budgets: a tree of 1 level is the root alone
            raise ValueError(f"max_depth {value} leaves no level for a draft token (levels count the root), so every "
                             "plan would be the target alone; give max_depth >= 2, or serve without a draft")
        return value

    @field_validator("storage")
    @classmethod
    def _storage(cls, value):
        if not value.strip():
            raise ValueError(f"storage {value!r} is empty: give a local folder or a URI, e.g. .sequoia/plans")
        return value

    @field_validator("temperatures")
    @classmethod
    def _temps(cls, value):
        from sequoia_ray.plan_store import temperature_bucket

        if not value or not all(0 <= t <= MAX_TEMPERATURE for t in value):  # nan fails both comparisons
            raise ValueError(f"temperatures {value} must be from 0 to {MAX_TEMPERATURE:g} (SamplingParams' range)")
        value = tuple(dict.fromkeys(value))  # each bucket once, in the order given
        first: dict[str, float] = {}  # bucket -> the temperature given for it
        for t in value:  # two in one bucket would publish to one plan folder, the later overwriting the earlier
            earlier = first.setdefault(temperature_bucket(t), t)
            if earlier != t:
                raise ValueError(f"temperatures {earlier} and {t} both fall in the plan bucket {temperature_bucket(t)} "
                                 "(plans are stored per temperature rounded to 0.1), so one's plans would overwrite "
                                 "the other's; keep one of them")
        return value

    @field_validator("device")
    @classmethod
    def _device(cls, value):
        from sequoia_ray.devices import check_device

        return check_device(value)

