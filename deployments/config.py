"""The Ray Serve application's configuration: models, tensor parallelism, resources and device per actor,
plans, limits. It builds the actors' own small specs (``actors.spec``); actors never see this model."""

from __future__ import annotations

import math
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from actors.placement import ActorResources
from actors.spec import COLLECTIVE_TIMEOUT_S, IDLE_TIMEOUT_S, STEP_TIMEOUT_S, ModelActorSpec, check_backend
from sequoia_ray.config import (DEFAULT_DRAFT_VOCAB, DRAFT_VOCAB_DOC, PLAN_FALLBACK_FILES, PLAN_KEEP_FILES,
                                 DraftQuantize, DraftVocab, check_plan_keep)
from sequoia_ray.devices import check_device


class ServeConfig(BaseModel):
    """The Ray Serve application: models, tensor parallelism, resources and device per actor, plans, limits."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    model_name: str = Field("sequoia-default", description="The model id clients send and /v1/models lists.")
    draft: str | None = Field("default-draft", description="Draft source; None serves the target alone.")
    target: str = Field("default-target", description="Target source (HF dir, .gguf, hub id, default-target, tiny).")
    dtype: str = Field("bfloat16", description="float32 (exact greedy identity) | bfloat16 | float16.")
    draft_quantize: DraftQuantize = Field(None, description="'int8' for a dynamically quantised CPU draft.")
    linears: Literal["auto", "packed", "aten"] = Field("auto", description="Linear layers on weights packed once "
                                                       "for oneDNN (CPU; ~2x a decode forward): auto = bf16 models, "
                                                       "packed = also fp32, aten = never.")
    layers: Literal["auto", "traced", "eager"] = Field("auto", description="Decoder layers' dense parts as "
                                                      "TorchScript traces, bitwise the same output (CPU; a draft "
                                                      "level ~0.8x): auto = CPU models, traced = also elsewhere, "
                                                      "eager = never.")
    draft_vocab: DraftVocab = Field(DEFAULT_DRAFT_VOCAB, ge=1, description=DRAFT_VOCAB_DOC)
    tp_size: int = Field(1, ge=1, le=64, description="Tensor-parallel ranks of the target (one actor each).")
    tp_backend: str = Field("gloo", description="torch.distributed backend: gloo (CPU) or nccl (GPU).")
    num_gpus: float = Field(0.0, ge=0, description="GPUs per actor (each TP rank and the draft).")
    device: str = Field("auto", description="Where the model actors run: auto (the GPU Ray assigned an actor, "
                        "else the CPU) | cpu | cuda (fails without an assigned GPU).")
    num_cpus: float = Field(1.0, gt=0, description="Logical CPUs each model actor reserves (Ray scheduling).")
    threads: int | None = Field(None, ge=1, description="Cores torch uses in each model actor (None = num_cpus). "
                                "The draft and the target take turns within a step, so on a small machine each "
                                "may use every core while reserving fewer.")
    check_placement: bool = Field(True, description="Fail at deploy time when the cluster as it is now can never "
                                  "place the model actors; turn off on clusters whose nodes come later "
                                  "(autoscaling from zero).")
    accelerator_type: str | None = Field(None, description="Pin actors to this GPU type (e.g. A100, L4).")
    plan_store: str | None = Field(None, description="Plan store URI; None = built-in plans only.")
    hardware_id: str | None = Field(None, description="Override the hardware id used to look plans up.")
    plan_refresh_s: float = Field(30.0, gt=0, description="How often to look for a newly published plan.")
    plan_keep: int = Field(PLAN_KEEP_FILES, ge=0, description="Published files a plan store folder keeps when "
                           "this service publishes a live plan there (the newest; older ones are deleted): 0 keeps "
                           f"every file, else more than {PLAN_FALLBACK_FILES}. Per publisher: the profiling "
                           f"jobs keep {PLAN_KEEP_FILES} in the folders they publish to.")
    live_acceptance: bool = Field(False, description="Learn the acceptance vector from the verdicts of live traffic "
                                  "(per temperature bucket) and re-plan when the served plan's vector leaves its "
                                  "confidence bound; the new plan is served at once and published as a live plan. "
                                  "Off unless asked for (the shipped config.yaml turns it on), so a server's plans "
                                  "change only where the operator wants them to.")
    live_min_samples: int = Field(400, ge=10, description="Trials (inner nodes with >= k children) rank k needs "
                                  "before its live estimate replaces the plan's p[k].")
    live_z: float = Field(3.0, gt=0, le=10, description="Width of the confidence bound (Wilson interval), in "
                          "standard deviations; larger = fewer, later re-plans.")
    live_half_life: float = Field(20_000.0, gt=0, description="Observations (visited inner nodes) after which one "
                                  "weighs half: the estimate follows recent traffic.")
    live_replan_s: float = Field(60.0, gt=0, description="How often to check the live estimate and re-plan (the "
                                 "rate limit of live re-plans; runs off the request path).")
    live_max_depth: int = Field(12, ge=1, le=64, description="Deepest tree (levels, root included) a live re-plan "
                                "may choose when a hardware profile lets it choose (n, d).")
    live_cost: bool = Field(False, description="Measure each request's step cycle with the tree and with the target "
                            "alone per temperature and batch bucket (probing the slower one rarely) and serve the "
                            "faster: speculation is dropped at batch sizes where it measures slower through Serve. "
                            "Off unless asked for (the shipped config.yaml turns it on).")
    live_cost_probe_every: int = Field(100, ge=1, description="Rounds (one step per request in flight) of the faster "
                                       "arm between two probes of the other.")
    live_cost_probe_rounds: int = Field(3, ge=1, description="Measured rounds of a probe (after the settling ones).")
    live_cost_settle_rounds: int = Field(2, ge=1, description="A phase's first rounds, not measured: a switch to the "
                                         "tree catches every draft up, over more than one round at a batch.")
    live_cost_backoff: int = Field(8, ge=1, description="A probe that confirms the served arm doubles the next served "
                                   "phase, up to this many times live_cost_probe_every rounds (1: no backoff).")
    live_cost_wide: float = Field(0.7, ge=0.0, le=1.0, description="A probed arm slower than this fraction of the "
                                  "served arm's rate backs off fully at once (live_cost_backoff times "
                                  "live_cost_probe_every rounds); 0: always double.")
    live_cost_max_age_s: float = Field(180.0, ge=0.0, description="A served phase ends for a probe of the other arm "
                                       "once that arm last ran this many seconds ago (measured or not), so both are "
                                       "compared at about the same host speed and traffic; 0: never (the phase "
                                       "lengths and the backoff alone space the probes).")
    first_step_alone: bool = Field(False, description="A request's first step (its prompt's prefill) runs the "
                                   "target alone: the first token waits for neither the draft's prefill nor a "
                                   "tree, and the request takes one step more (the draft catches up at the next).")
    request_trees: bool = Field(False, description="A tree per request: after a few steps each request's own "
                                "acceptance picks the cost model's tree for it (deeper for predictable text, "
                                "shallower for unsure), from the served plan's vector tilted to its p[1] and the "
                                "store's hardware profile (without one, the served plan).")
    request_trees_max_batch: int = Field(16, ge=1, description="With request_trees: the largest batch-size bucket "
                                         "(1, 2, 4, 8, 16) whose requests get trees of their own; in larger "
                                         "batches every request gets the bucket's plan (one request's deeper "
                                         "tree makes the whole batch wait for its extra draft levels).")
    dynamic_trees: bool = Field(False, description="Trees that adapt inside a request: the draft drops branches whose "
                                "path probability is worth less than their cost, and stops at a level worth less than "
                                "a draft forward (thresholds from the store's hardware profile and the served plan; "
                                "without a profile, the plan's tree).")
    dynamic_unpruned_every: int = Field(4, ge=0, description="With dynamic_trees: one tree step in this many of a "
                                        "request grows its plan's tree unpruned, and only those steps teach the live "
                                        "acceptance estimate (a pruned tree tries only the nodes the draft was sure "
                                        "of: its verdicts overstate the acceptance); 1: every step unpruned; 0: none "
                                        "(the estimate then learns nothing while dynamic trees serve).")
    dynamic_extend: int = Field(0, ge=0, le=16, description="With dynamic_trees: levels a confident path may grow beyond "
                                "the plan's depth (0: prune only).")
    max_concurrent: int = Field(8, ge=1, description="Requests in flight per ingress replica; beyond -> 429.")
    max_batch_requests: int = Field(16, ge=1, description="Requests whose trees one forward verifies (and one draft "
                                    "forward grows): continuous batching. 1 = one request per forward.")
    max_batch_tokens: int = Field(2048, ge=1, description="Tokens one forward may take (trees + prefill); a larger "
                                  "first request still runs, alone.")
    batch_layout: str = Field("auto", description="How a batch's requests share a forward: ragged (one "
                              "sequence, each request's attention over its own K/V in place; SDPA models) | flat "
                              "(one sequence, block mask; no padding) | padded (batch dimension, padded to the "
                              "longest) | auto (ragged under SDPA; else padded when every request forwards one "
                              "token, flat otherwise).")
    batch_hold_s: float = Field(1.0, ge=0, le=60, description="After a request ends, steps go on planning for the "
                                "batch it left (its plan, its live_cost arm) this long: a client's next request "
                                "usually arrives within it (0: plan for the requests in flight right now).")
    batch_wait_ms: float = Field(1000.0, ge=0, le=10_000, description="How long a forward may wait for the requests "
                                 "of the previous forwards that come back (target-alone steps; with batch_wait_trees "
                                 "also tree requests, while the draft grows their trees), so they share forwards "
                                 "instead of alternating (0 = start each forward at once). A wait ends as soon as "
                                 "they are all back; a request that does not come back is waited for twice at most.")
    batch_wait_trees: bool = Field(True, description="Step tree requests in lockstep: the target's forward waits "
                                   "(up to batch_wait_ms) for the previous forwards' tree requests too, and the draft "
                                   "gathers each batch's returning calls (50 ms), so every step drafts all requests "
                                   "in one forward per level and verifies them in one target forward. False: tree "
                                   "requests are not waited for and fall into groups that alternate, one drafting "
                                   "while the other verifies (on a 2-core Xeon through Serve, 8 clients: 14.4-18.8 "
                                   "tok/s alternating, 21.0-25.5 in lockstep).")
    prefill_chunk: int | None = Field(256, ge=1, description="Prefill a long prompt this many tokens per step beside "
                                      "the others' decoding (None: the whole prompt in one step).")
    prefix_cache_tokens: int = Field(4096, ge=0, description="Prompt-prefix K/V each model actor keeps across "
                                     "requests (a system prompt or chat template is prefilled once; least recently "
                                     "used blocks go first). 0 = off.")
    prefix_block: int = Field(16, ge=1, description="Tokens per cached prompt-prefix block (a prompt reuses whole "
                              "blocks only).")
    max_prompt_tokens: int = Field(8192, ge=1, description="Longest prompt accepted (tokens).")
    max_tokens_limit: int = Field(2048, ge=1, description="Largest max_tokens a request may ask for.")
    request_idle_timeout_s: float = Field(IDLE_TIMEOUT_S, gt=0, description="Free a request's KV state after this idle time.")
    max_body_bytes: int = Field(1_000_000, ge=1024, description="Largest request body accepted (bytes); beyond -> 413.")
    api_key: str | None = Field(None, min_length=1, description="Bearer token required on every route but /health "
                                "(None = open).")
    api_key_env: str | None = Field(None, min_length=1, description="Read the API key from this environment variable "
                                    "instead (in the ingress replica's environment: unset or empty there, the "
                                    "replica refuses to start rather than serve an open API).")
    step_timeout_s: float = Field(STEP_TIMEOUT_S, gt=0, description="Longest one draft or verify call may take; a target "
                                  "beyond it -> 503 (retryable), a draft beyond it -> the target alone. The call "
                                  "that prefills a prompt gets it once per prefill_chunk tokens (256 unchunked).")
    collective_timeout_s: float = Field(COLLECTIVE_TIMEOUT_S, gt=0, description="torch.distributed timeout of the TP group: a "
                                        "collective waiting on a hung rank fails after this.")
    health_check_period_s: float = Field(10.0, gt=0, description="How often Serve checks the model deployments.")
    health_check_timeout_s: float = Field(30.0, gt=0, description="A health check slower than this fails.")
    num_replicas: int = Field(1, ge=1, description="Ingress/draft/target replicas when autoscaling is off.")
    autoscaling: dict | None = Field(None, description="Ray Serve autoscaling_config for the draft and target "
                                     "deployments; target_ongoing_requests counts requests held per replica. The "
                                     "ingress scales with them (deployments.autoscaling.ingress_autoscaling_config).")
    drain_timeout_s: float = Field(300.0, gt=0, description="How long a model replica being removed (scaling "
                                   "down, a redeploy) waits for the requests its actors hold to finish before "
                                   "Serve stops it (its graceful_shutdown_timeout_s).")

    @field_validator("plan_keep")
    @classmethod
    def _plan_keep(cls, value):
        return check_plan_keep(value, "plan_keep")

    @field_validator("hardware_id")
    @classmethod
    def _hardware_id(cls, v):  # checked here, not at the first plan lookup (every refresh failed, built-in served)
        from sequoia_ray.plan_store import safe_name

        return v if v is None else safe_name(v, "hardware_id")

    @field_validator("dtype")
    @classmethod
    def _dtype(cls, v):
        if v not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"dtype {v!r} must be float32, bfloat16 or float16")
        return v

    @field_validator("batch_layout")
    @classmethod
    def _layout(cls, v):
        from sequoia_ray.models.batch_forward import check_layout

        return check_layout(v)

    @field_validator("device")
    @classmethod
    def _device(cls, v):
        return check_device(v)

    @model_validator(mode="after")
    def _placement(self):
        if self.device == "cuda" and not self.num_gpus:
            raise ValueError("device cuda needs a GPU per actor; set num_gpus: 1 (or device: auto / cpu)")
        if self.draft_quantize and self.device_type == "cuda":
            raise ValueError(f"draft_quantize {self.draft_quantize!r} runs on the CPU only; drop it and use "
                             "dtype bfloat16 or float16 for a GPU draft (or set device: cpu)")
        check_backend(self.tp_backend, self.device_type, self.tp_size)
        if self.tp_backend == "nccl" and self.tp_size > 1 and (self.num_gpus < 1 or self.num_gpus != int(self.num_gpus)):
            raise ValueError(f"num_gpus {self.num_gpus}: nccl ranks need one whole GPU each (two ranks on one GPU "
                             "fail to form the group); set num_gpus: 1")
        if self.layers == "traced" and self.device_type == "cuda":
            raise ValueError("layers 'traced' is for CPU models only (on CUDA TorchScript's freeze merges the q/k/v "
                             "projections and its fuser fuses pointwise ops: other kernels, other rounding); use "
                             "layers auto or eager")
        if self.layers == "traced" and self.tp_size > 1:
            raise ValueError(f"layers 'traced' cannot apply to a target sharded over tp_size {self.tp_size} "
                             "(its shards keep transformers' hooks); use layers auto or eager")
        return self

    @field_validator("autoscaling")
    @classmethod
    def _autoscaling(cls, v):
        """Serve's own check of the dict (a typo such as ``max_replica`` would be dropped: no scaling at all)."""
        if v is None:
            return v
        from ray.serve.config import AutoscalingConfig

        from deployments.autoscaling import model_bounds

        known = set(AutoscalingConfig.model_fields)
        unknown = sorted(set(v) - known)
        if unknown:
            raise ValueError(f"autoscaling has unknown keys {unknown}; Serve's are {sorted(known)}")
        try:
            model_bounds(v)
        except Exception as exc:  # noqa: BLE001 - Serve's pydantic error, shown as ours
            raise ValueError(f"autoscaling {v}: {' '.join(str(exc).split())[:300]}") from None
        return v

    @model_validator(mode="after")
    def _idle(self):
        # A request's calls are apart by up to a step of the others' (step_timeout_s) and its own: a shorter idle
        # time would free a live request's KV between two calls, and every request would fail mid-stream.
        if self.request_idle_timeout_s < 2 * self.step_timeout_s:
            raise ValueError(f"request_idle_timeout_s {self.request_idle_timeout_s} would free a live request "
                             f"between its calls, which may be step_timeout_s {self.step_timeout_s} apart twice; "
                             f"give >= {2 * self.step_timeout_s:g} (or lower step_timeout_s)")
        return self

    @model_validator(mode="after")
    def _chunks(self):
        if self.prefill_chunk is not None and self.prefill_chunk > self.max_batch_tokens:
            raise ValueError(f"prefill_chunk {self.prefill_chunk} is larger than max_batch_tokens "
                             f"{self.max_batch_tokens}: every chunk would run alone, over the budget, and the "
                             "decoding steps queued behind it would wait a whole forward; give prefill_chunk <= "
                             "max_batch_tokens (a chunk should leave room for the batch's trees)")
        return self

    @model_validator(mode="after")
    def _prefix(self):
        if 0 < self.prefix_cache_tokens < self.prefix_block:
            raise ValueError(f"prefix_cache_tokens {self.prefix_cache_tokens} holds no block of prefix_block "
                             f"{self.prefix_block} tokens; give >= {self.prefix_block} (or 0: no prefix cache)")
        return self

    @model_validator(mode="after")
    def _live(self):
        most = self.live_half_life / math.log(2)  # the effective sample size decay lets a rank reach
        if self.live_acceptance and most < self.live_min_samples:
            raise ValueError(f"live_half_life {self.live_half_life} keeps at most {most:.0f} effective samples, fewer "
                             f"than live_min_samples {self.live_min_samples}: no rank could ever be estimated; raise "
                             f"live_half_life to >= {math.ceil(self.live_min_samples * math.log(2))} or lower "
                             "live_min_samples")
        return self

    @property
    def device_type(self) -> str:
        """Where the actors will run: ``auto`` means a GPU when each actor gets one."""
        return ("cuda" if self.num_gpus else "cpu") if self.device == "auto" else self.device

    def actor_spec(self, role: str) -> ModelActorSpec:
        """The draft's or the target's actor spec."""
        draft = role == "draft"
        return ModelActorSpec(self.draft if draft else self.target, dtype=self.dtype,
                              quantize=self.draft_quantize if draft else None, device=self.device,
                              draft_vocab=self.draft_vocab if draft else None,
                              linears=self.linears, layers=self.layers,
                              threads=self.threads or max(1, int(self.num_cpus)), idle_timeout_s=self.request_idle_timeout_s,
                              collective_timeout_s=self.collective_timeout_s,
                              max_batch_requests=self.max_batch_requests, max_batch_tokens=self.max_batch_tokens,
                              batch_layout=self.batch_layout, prefill_chunk=self.prefill_chunk,
                              batch_wait_s=self.batch_wait_ms / 1000, wait_trees=self.batch_wait_trees,
                              prefix_cache_tokens=self.prefix_cache_tokens, prefix_block=self.prefix_block)

    def plan_hardware_id(self, threads: int, accelerator: str | None = None, cpu: str | None = None) -> str:
        """The hardware id plans are published and looked up by: the override, else the configured
        accelerator type or the type of the GPU the target runs on (``hardware.gpu_type``: Ray's name, as the Tune
        job's), else the CPU the target runs on (``cpu``,
        its ``sequoia_ray.hardware.cpu_name()``; this machine's when None) with the target's threads."""
        from sequoia_ray.hardware import hardware_id

        gpu = self.accelerator_type if self.device_type == "cuda" else None  # CPU actors on a GPU node: the CPU's
        return self.hardware_id or hardware_id(gpu or accelerator, self.tp_size, threads, cpu)

    def resources(self) -> ActorResources:
        return ActorResources(self.num_cpus, self.num_gpus, self.accelerator_type)

    def measured_otherwise(self, prov) -> str | None:
        """How the serving configuration a plan's provenance ``prov`` records differs from this one (None: it
        does not, or the plan records none): its dtype, draft quantisation, Linear kernels or draft vocabulary —
        a plan whose t, c and p were measured under another configuration chose its tree for other costs. A plan
        that records its dtype but not its Linear kernels predates packing: aten; nor its draft vocabulary:
        the full head."""
        import torch

        from sequoia_ray.models.loading import DTYPES
        from sequoia_ray.models.packed_linear import kernels_for

        if prov.dtype is None:
            return None
        if prov.dtype != self.dtype:
            return f"dtype {prov.dtype}, not {self.dtype}"
        if (prov.draft_quantize or None) != (self.draft_quantize or None):
            return f"draft_quantize {prov.draft_quantize}, not {self.draft_quantize}"
        kernels = kernels_for(self.linears, DTYPES.get(self.dtype, torch.float32), self.device_type)
        if (prov.linears or "aten") != kernels:
            return f"{prov.linears or 'aten'} Linear kernels, not {kernels} (linears {self.linears})"
        if self.draft and prov.draft_vocab != self.draft_vocab:
            return f"draft_vocab {prov.draft_vocab or 'full'}, not {self.draft_vocab or 'full'}"
        return None
