"""Hardware awareness: profile t(n) and the draft's cost, then choose the tree size and depth.

t(n) = time for the target to verify n tree tokens ÷ time for 1 (at a realistic context length);
c(w) = time of one draft forward over w tokens ÷ one target step. The draft forwards, level by level, only
the nodes that have children (the root with the uncached committed tokens first), so with i_l such inner
nodes at level l

    predicted speedup(n, d) = G(n, d) / (t(n) + sum_{l : i_l > 0} c(i_l))

which is the paper's G / (t(n) + d·c) with c measured per level width instead of assumed constant.

Timings run on the model's device and synchronise it before every clock read (an accelerator runs kernels
asynchronously; without the sync a timer measures only the launches).
"""

from __future__ import annotations

import datetime as _dt
import json
import math
import platform
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

from sequoia_ray.devices import synchronize
from sequoia_ray.models.tree_lm import KVSession
from sequoia_ray.tree.dp import DPTable
from sequoia_ray.tree.plan import TreePlan

SCHEMA_VERSION = 1
DEFAULT_BUDGETS = (1, 2, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256)
DRAFT_WIDTHS = (1, 2, 4, 8, 16, 32, 64)


class ProfileError(ValueError):
    """A profile that cannot be used; names the field and the fix."""


@dataclass(frozen=True)
class HardwareProfile:
    hardware_id: str
    t: dict[int, float]  # n -> t(n), t(1) = 1
    c: dict[int, float]  # level width w -> c(w)
    target_step_s: float  # seconds for one target token at the profiled context
    context: int
    dtype: str
    versions: dict[str, str] = field(default_factory=dict)
    timestamp: str = ""

    def t_of(self, n: int) -> float:
        return _interpolate(self.t, n, "t(n)")

    def c_of(self, width: int) -> float:
        return _interpolate(self.c, width, "c(w)")

    def draft_cost(self, plan: TreePlan) -> float:
        """Draft forwards for ``plan`` in target steps: one per level, over that level's inner nodes."""
        inner = [sum(1 for node in level if plan.children[node]) for level in plan.levels]
        return sum(self.c_of(i) for i in inner if i)

    def to_dict(self) -> dict:
        out = asdict(self)
        out["t"] = {str(k): v for k, v in self.t.items()}
        out["c"] = {str(k): v for k, v in self.c.items()}
        return {"schema_version": SCHEMA_VERSION, **out}

    @classmethod
    def from_dict(cls, obj: dict, *, source: str = "profile") -> HardwareProfile:
        if not isinstance(obj, dict) or obj.get("schema_version") != SCHEMA_VERSION:
            raise ProfileError(f"{source}: field 'schema_version' must be {SCHEMA_VERSION}")
        try:
            t = {int(k): float(v) for k, v in obj["t"].items()}
            c = {int(k): float(v) for k, v in obj["c"].items()}
            prof = cls(str(obj["hardware_id"]), t, c, float(obj["target_step_s"]), int(obj["context"]),
                       str(obj["dtype"]), dict(obj.get("versions", {})), str(obj.get("timestamp", "")))
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ProfileError(f"{source}: malformed profile ({type(exc).__name__}: {exc})") from None
        for name, table in (("t", t), ("c", c)):
            if not table or any(k < 1 or not math.isfinite(v) or v <= 0 for k, v in table.items()):
                raise ProfileError(f"{source}: field '{name}' must map positive sizes to finite positive times")
        return prof

    def save(self, path: Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1))

    @classmethod
    def load(cls, path: Path) -> HardwareProfile:
        try:
            return cls.from_dict(json.loads(Path(path).read_text()), source=str(path))
        except json.JSONDecodeError as exc:
            raise ProfileError(f"{path}: not valid JSON ({exc})") from None


def _interpolate(table: dict[int, float], x: int, name: str) -> float:
    keys = sorted(table)
    if x > keys[-1]:
        raise ProfileError(f"{name} at {x} > profiled max {keys[-1]}; re-profile with larger sizes")
    return float(np.interp(x, keys, [table[k] for k in keys]))


@dataclass(frozen=True)
class Choice:
    n: int
    d: int
    expected_tokens: float
    predicted_speedup: float
    plan: TreePlan


def choose(table: DPTable, profile: HardwareProfile, budgets=DEFAULT_BUDGETS) -> tuple[Choice, list[Choice]]:
    """The (n, d) maximising G(n, d) / (t(n) + draft cost), and every candidate evaluated."""
    candidates = []
    max_n = min(table.max_nodes, max(profile.t))
    for n in sorted({b for b in budgets if b <= max_n} | {1}):
        for d in range(1, table.max_depth + 1):
            plan = table.tree(n, d)
            cost = profile.t_of(plan.n) + profile.draft_cost(plan)
            candidates.append(Choice(n, d, table.value(n, d), table.value(n, d) / cost, plan))
    best = max(candidates, key=lambda c: (round(c.predicted_speedup, 12), -c.n, -c.d))
    return best, candidates


# ---- measuring -----------------------------------------------------------------------------------
def time_forward(model, sizes, *, context: int, repeats: int = 3, warmup: int = 1, seed: int = 0,
                 head_rows: int | None = None) -> dict[int, float]:
    """Median seconds to forward s new tokens after ``context`` cached ones, for each s in ``sizes``, with
    the LM head on the first ``head_rows`` of them (None = all, as the draft and the verifier do)."""
    device = model.device
    gen = torch.Generator(device="cpu").manual_seed(seed)  # the same random inputs on every device
    vocab = model.config.vocab_size
    session = KVSession(model)
    prefix = torch.randint(0, vocab, (context,), generator=gen, device="cpu").to(device)
    session.forward(prefix, torch.arange(context, device=device))
    inputs = {s: torch.randint(0, vocab, (s,), generator=gen, device="cpu").to(device) for s in sizes}
    positions = {s: context + torch.arange(s, device=device) for s in sizes}

    def step(s: int) -> float:
        start = _clock(device)
        hidden = session.hidden(inputs[s], positions[s])
        session.head(hidden if head_rows is None else hidden[:head_rows])
        elapsed = _clock(device) - start
        session.truncate(context)
        return elapsed

    for _ in range(warmup):
        for s in sizes:
            step(s)
    rounds = [[step(s) for s in sizes] for _ in range(repeats)]  # round-robin: drift hits every size alike
    return {s: statistics.median(r[i] for r in rounds) for i, s in enumerate(sizes)}


def _clock(device: torch.device) -> float:
    """``perf_counter`` after the queued work on ``device`` has finished."""
    synchronize(device)
    return time.perf_counter()


def profile(target, draft, *, hardware: str, budgets=DEFAULT_BUDGETS, widths=DRAFT_WIDTHS, context: int = 256,
            repeats: int = 5, dtype: str = "float32", time_target=None) -> HardwareProfile:
    """t(n) and c(w) for a target and a draft model. ``time_target(sizes, context, repeats)`` replaces the
    in-process target timing, e.g. to time a whole tensor-parallel group (every rank in lockstep)."""
    sizes = sorted(set(budgets) | {1})
    if time_target is None:
        target_s = time_forward(target, sizes, context=context, repeats=repeats)
    else:
        target_s = time_target(sizes, context, repeats)
    draft_s = time_forward(draft, widths, context=context, repeats=repeats)
    one = target_s[1]
    return HardwareProfile(
        hardware_id=hardware, t={n: s / one for n, s in target_s.items()}, c={w: s / one for w, s in draft_s.items()},
        target_step_s=one, context=context, dtype=dtype, versions=library_versions(),
        timestamp=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"))


def library_versions() -> dict[str, str]:
    import transformers

    return {"torch": torch.__version__, "transformers": transformers.__version__, "python": platform.python_version()}


def hardware_id(accelerator: str | None = None, tp_size: int = 1, threads: int | None = None) -> str:
    """``<accelerator>-tp<N>`` on a GPU (e.g. ``H100-tp2``), ``cpu-<model>-<threads>c[-tp<N>]`` on CPU."""
    suffix = f"-tp{tp_size}" if tp_size > 1 else ""
    if accelerator:
        return f"{accelerator}{suffix}"
    return f"cpu-{_cpu_model()}-{threads or torch.get_num_threads()}c{suffix}"


def accelerator_name(device: torch.device) -> str | None:
    """The GPU's name as a hardware-id part (``NVIDIA_A100-SXM4-80GB``) for a CUDA device, else None; call it
    where the device is visible (in the actor that owns it)."""
    if device.type != "cuda":
        return None
    return torch.cuda.get_device_name(device).replace(" ", "_")


def _cpu_model() -> str:
    name = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1]
                break
    except OSError:
        pass
    keep = "".join(ch if ch.isalnum() else "-" for ch in name.strip())
    return "-".join(part for part in keep.split("-") if part)[:48] or "unknown"
