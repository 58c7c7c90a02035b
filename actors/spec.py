"""What a model actor needs to know, as a small typed record the layers above build (a ServeConfig in
``deployments``, a ProfileJobConfig in ``tuning``): actors never see those configs."""

from __future__ import annotations

from dataclasses import dataclass

from sequoia_ray.devices import check_device

COLLECTIVE_TIMEOUT_S = 120.0  # torch.distributed timeout of a TP group: a collective on a hung rank fails after it
STEP_TIMEOUT_S = 60.0  # longest one draft or verify call may take before the caller gives up on it
IDLE_TIMEOUT_S = 300.0  # free a request's KV state after this long without a call
TP_BACKENDS = {"gloo": "cpu", "nccl": "cuda"}  # torch.distributed backend -> the device type it serves


@dataclass(frozen=True)
class ModelActorSpec:
    """One model actor: which model, how to load it, where to run it, how long to keep idle requests."""

    source: str  # HF dir, .gguf file, hub id, default-draft / default-target, tiny-draft / tiny-target
    dtype: str = "float32"
    quantize: str | None = None  # "int8": dynamic int8 (CPU only)
    linears: str = "auto"  # auto | packed | aten: Linear weights packed for oneDNN (sequoia_ray.models.packed_linear)
    layers: str = "auto"  # auto | traced | eager: layers run as TorchScript traces (sequoia_ray.models.traced_layers)
    draft_vocab: int | None = None  # a draft's LM head on the lowest ids (sequoia_ray.models.draft_vocab); None: all
    device: str = "auto"  # auto | cpu | cuda; auto = the accelerator Ray assigned, else the CPU
    threads: int = 1  # torch intra-op threads
    idle_timeout_s: float = IDLE_TIMEOUT_S
    collective_timeout_s: float = COLLECTIVE_TIMEOUT_S
    max_batch_requests: int = 16  # requests per forward (1: one request per forward)
    max_batch_tokens: int = 2048  # tokens per forward (a larger first call still runs, alone)
    batch_layout: str = "auto"  # auto | ragged | flat | padded (sequoia_ray.models.batch_forward)
    prefill_chunk: int | None = None  # longest prefill forwarded in one step (None: a whole prompt at once)
    batch_wait_s: float = 0.0  # how long a forward may wait for the previous forward's target-alone requests
    wait_trees: bool = False  # forwards wait for the previous forwards' tree requests too (draft: GATHER_S only)
    prefix_cache_tokens: int = 0  # prompt-prefix K/V kept across requests (sequoia_ray.prefix_cache; 0: none)
    prefix_block: int = 16  # tokens per cached block

    def __post_init__(self) -> None:
        from sequoia_ray.models.batch_forward import check_layout

        from sequoia_ray.models import draft_vocab, traced_layers
        from sequoia_ray.models.packed_linear import check_mode

        check_device(self.device)
        check_mode(self.linears)
        traced_layers.check_mode(self.layers)
        draft_vocab.check_size(self.draft_vocab)
        self.limits()  # checks the batch limits
        check_layout(self.batch_layout)
        if self.prefill_chunk is not None and self.prefill_chunk < 1:
            raise ValueError(f"prefill_chunk {self.prefill_chunk} must be >= 1 (or None: no chunking)")
        self.prefix_cache()  # checks the prefix cache's sizes
        if self.threads < 1:
            raise ValueError(f"threads {self.threads} must be >= 1")
        if self.quantize is not None and self.device == "cuda":
            raise ValueError(f"quantize {self.quantize!r} (dynamic int8) runs on the CPU only; use device cpu, "
                             "or no quantisation and dtype bfloat16/float16 for a GPU model")


    def prefix_cache(self):
        """A new ``PrefixCache`` of this spec's sizes, or None (``prefix_cache_tokens`` 0)."""
        from sequoia_ray.prefix_cache import PrefixCache

        if self.prefix_cache_tokens < 0:
            raise ValueError(f"prefix_cache_tokens {self.prefix_cache_tokens} must be >= 0 (0: no prefix cache)")
        return PrefixCache(self.prefix_block, self.prefix_cache_tokens) if self.prefix_cache_tokens else None

    def limits(self, *, waits: bool = True):
        """The batcher's limits. With ``wait_trees`` a forward gathers the calls its last forward sent back, and
        the actor that ``waits`` (the target) also waits ``batch_wait_s`` for the tree requests of its last
        forwards; the other (the draft) only gathers: see ``batching.comes_back_after_any_step``."""
        from sequoia_ray.batching import GATHER_S, BatchLimits

        wait_s = self.batch_wait_s if waits or not self.wait_trees else 0.0
        return BatchLimits(self.max_batch_requests, self.max_batch_tokens, wait_s,
                           GATHER_S if self.wait_trees else 0.0)

    def batcher_policy(self, *, waits: bool = True) -> dict:
        """``Batcher``'s keyword arguments for an actor of this spec: its limits, which requests it waits for
        (``comes_back``) and over how many forwards (``lookback``): the lockstep of tree steps when ``wait_trees``."""
        from sequoia_ray.batching import LOCKSTEP_LOOKBACK, comes_back_after_any_step

        lockstep = dict(comes_back=comes_back_after_any_step, lookback=LOCKSTEP_LOOKBACK) if self.wait_trees else {}
        return dict(limits=self.limits(waits=waits), **lockstep)

    @property
    def pipelines(self) -> bool:
        """Whether tree requests may pipeline, one group drafting while another verifies: not in lockstep
        (``wait_trees`` with batches of 2+), where every step drafts all of them, then verifies them all."""
        return not self.wait_trees or self.max_batch_requests == 1

    @property
    def callers(self) -> int:
        """The actor's max_concurrency: enough waiting calls to fill a batch twice over (beyond it Ray queues)."""
        return max(64, 2 * self.max_batch_requests + 8)


def check_backend(backend: str, device_type: str, world: int) -> None:
    """A TP backend must match the ranks' device type when they talk (world > 1): gloo for CPUs, nccl for
    GPUs. A single rank runs no collective, so any backend serves it."""
    if backend not in TP_BACKENDS:
        raise ValueError(f"tp_backend {backend!r} must be one of {', '.join(TP_BACKENDS)}")
    if world > 1 and TP_BACKENDS[backend] != device_type:
        fix = next(b for b, d in TP_BACKENDS.items() if d == device_type)
        raise ValueError(f"tp_backend {backend!r} serves {TP_BACKENDS[backend]} devices but the ranks run on "
                         f"{device_type}; set tp_backend: {fix} (or change device / num_gpus)")
