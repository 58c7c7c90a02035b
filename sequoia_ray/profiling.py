"""One hardware type's profiling trial, without Ray: measure p, profile t(n) and c, DP, choose,
validate for real, publish. ``tuning/profile.py`` runs one of these per hardware type under Ray Tune;
``sequoia-ray profile`` runs one in-process for this machine.
"""

from __future__ import annotations

import io
import logging
import time
from dataclasses import asdict, dataclass

from sequoia_ray.acceptance import measure
from sequoia_ray.config import ProfileJobConfig, SamplingParams
from sequoia_ray.hardware import Choice, choose, profile
from sequoia_ray.local import LocalPair
from sequoia_ray.plan_store import PlanKey, PlanStore
from sequoia_ray.prompts import Prompt, load_prompts
from sequoia_ray.tree.acceptance_vector import AcceptanceVector
from sequoia_ray.tree.dp import solve
from sequoia_ray.tree.plan import chain
from sequoia_ray.tree.plan_file import PlannedTree

logger = logging.getLogger(__name__)

BUILTIN_PROMPTS = [
    Prompt("def quicksort(arr):\n    \"\"\"Sort a list with quicksort.\"\"\"\n", False, "code"),
    Prompt("Write a Python function that reverses a linked list.", True, "code"),
    Prompt("Explain in a short paragraph why the sky is blue.", True, "prose"),
    Prompt("Once upon a time, in a small village by the sea,", False, "prose"),
    Prompt("import numpy as np\n\n\ndef normalize(x: np.ndarray) -> np.ndarray:\n", False, "code"),
    Prompt("Give three tips for learning to play the guitar.", True, "prose"),
]
SMOKE_BUDGETS = (1, 2, 4, 8, 16)


@dataclass(frozen=True)
class TrialResult:
    hardware: str
    temperature: float
    n: int
    d: int
    expected_tokens: float
    predicted_speedup: float
    measured_speedup: float
    measured_tokens_per_step: float
    plan_key: str
    profile_key: str


def load_pair(cfg: ProfileJobConfig, *, progress: bool = True) -> LocalPair:
    if cfg.smoke_test:
        return LocalPair.tiny(device=cfg.device)
    return LocalPair.load(cfg.target, cfg.draft, dtype=cfg.dtype, draft_quantize=cfg.draft_quantize,
                          device=cfg.device, progress=progress)


def run_trial(cfg: ProfileJobConfig, hardware: str, *, progress: bool = True, pair=None) -> tuple[list[TrialResult], dict]:
    """Everything for one hardware type; returns the results and the predicted-speedup grids for plots.

    ``pair`` defaults to an in-process ``LocalPair``; a tensor-parallel job passes one whose target is a
    group of rank actors (``decoder``, ``encode``, ``draft`` and ``time_target`` are all it needs)."""
    store = PlanStore(cfg.storage)
    pair = pair or load_pair(cfg, progress=progress)
    prompts = [pair.encode(p.text, chat=p.chat) for p in _prompts(cfg)]
    budgets = SMOKE_BUDGETS if cfg.smoke_test else cfg.budgets
    depth = min(cfg.max_depth, 5) if cfg.smoke_test else cfg.max_depth
    prof = profile(None, pair.draft.model, hardware=hardware, budgets=budgets, time_target=pair.time_target,
                   context=min(cfg.context, 32) if cfg.smoke_test else cfg.context, dtype=cfg.dtype)
    profile_key = store.publish_profile(prof)
    results, grids = [], {}
    for temperature in cfg.temperatures:
        acceptance = _acceptance(cfg, pair, prompts, temperature, progress)
        table = solve(acceptance, max(budgets), depth)
        best, candidates = choose(table, prof, budgets)
        grids[temperature] = [(c.n, c.d, c.predicted_speedup) for c in candidates]
        speedup, per_step = validate(pair, best, prompts, temperature, cfg.validate_tokens if not cfg.smoke_test else 12)
        planned = PlannedTree(best.plan, acceptance, best.n, best.d, table.value(best.n, best.d))
        key = PlanKey(hardware, _name(cfg, "draft"), _name(cfg, "target"), temperature)
        plan_key = store.publish_plan(planned, key)
        results.append(TrialResult(hardware, temperature, best.n, best.d, best.expected_tokens,
                                   best.predicted_speedup, speedup, per_step, plan_key, profile_key))
        logger.info("%s T=%s: %s", hardware, temperature, asdict(results[-1]))
    return results, grids


def _name(cfg: ProfileJobConfig, role: str) -> str:
    if cfg.smoke_test:
        return f"tiny-{role}"
    return cfg.draft if role == "draft" else cfg.target


def _prompts(cfg: ProfileJobConfig) -> list[Prompt]:
    prompts = load_prompts(cfg.prompts) if cfg.prompts else BUILTIN_PROMPTS
    return prompts[: 2 if cfg.smoke_test else cfg.max_prompts]


def _acceptance(cfg, pair: LocalPair, prompts, temperature: float, progress: bool) -> AcceptanceVector:
    if temperature in cfg.acceptance:
        return AcceptanceVector.parse(cfg.acceptance[temperature])
    tokens = 16 if cfg.smoke_test else cfg.measure_tokens
    acceptance, _ = measure(pair.decoder, prompts, width=cfg.width, temperature=temperature, max_tokens=tokens,
                            progress=progress)
    return acceptance


def validate(pair: LocalPair, best: Choice, prompts, temperature: float, max_tokens: int) -> tuple[float, float]:
    """Run the chosen plan for real: (measured speedup over the target alone, tokens per step)."""
    timings = {}
    per_step = 0.0
    for name, decoder in (("alone", pair.decoder(chain(0), speculate=False)), ("tree", pair.decoder(best.plan))):
        decoder.generate(prompts[0], SamplingParams(max_tokens=4, temperature=temperature, seed=0))  # warm-up
        tokens, steps, start = 0, 0, time.perf_counter()
        for i, prompt in enumerate(prompts):
            out = decoder.generate(prompt, SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=i,
                                                          ignore_eos=True))
            tokens, steps = tokens + out.stats.tokens, steps + out.stats.steps
        timings[name] = tokens / (time.perf_counter() - start)
        per_step = tokens / steps
    return timings["tree"] / timings["alone"], per_step


def heatmap_png(grid: list[tuple[int, int, float]], title: str) -> bytes:
    """Predicted speedup over (n, d) as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    ns, ds = sorted({g[0] for g in grid}), sorted({g[1] for g in grid})
    z = np.full((len(ds), len(ns)), np.nan)
    for n, d, s in grid:
        z[ds.index(d), ns.index(n)] = s
    fig, ax = plt.subplots(figsize=(1 + 0.6 * len(ns), 1 + 0.4 * len(ds)))
    im = ax.imshow(z, origin="lower", aspect="auto", cmap="viridis")
    ax.set_xticks(range(len(ns)), [str(n) for n in ns])
    ax.set_yticks(range(len(ds)), [str(d) for d in ds])
    ax.set_xlabel("tree budget n")
    ax.set_ylabel("max depth d")
    ax.set_title(title)
    fig.colorbar(im, ax=ax, label="predicted speedup")
    buf = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buf, format="png", dpi=100)
    plt.close(fig)
    return buf.getvalue()


def format_results(results: list[TrialResult]) -> str:
    head = f"{'hardware':28s} {'T':>4s} {'n':>4s} {'d':>3s} {'G':>6s} {'pred':>6s} {'meas':>6s} {'tok/step':>8s}"
    lines = [head, "-" * len(head)]
    for r in results:
        lines.append(f"{r.hardware:28s} {r.temperature:4.1f} {r.n:4d} {r.d:3d} {r.expected_tokens:6.2f} "
                     f"{r.predicted_speedup:6.2f} {r.measured_speedup:6.2f} {r.measured_tokens_per_step:8.2f}")
    return "\n".join(lines)


def publish_heatmaps(cfg: ProfileJobConfig, hardware: str, grids: dict) -> list[str]:
    store = PlanStore(cfg.storage)
    return [store.put_report(f"heatmap-{hardware}-t{t:.1f}.png", heatmap_png(grid, f"{hardware}  T={t}"))
            for t, grid in grids.items()]
