"""One hardware type's profiling trial, without Ray: measure p, profile t(n) and c (and the batched T_B, C_B),
DP, choose per batch bucket, validate the batch-1 plan for real, publish one plan per bucket.
``tuning/profile.py`` runs one of these per hardware type under Ray Tune;
``sequoia-ray profile`` runs one in-process for this machine.
"""

from __future__ import annotations

import io
import logging
import math
import sys
import time
from dataclasses import asdict, dataclass, replace

from tqdm.auto import tqdm

from sequoia_ray.acceptance import measure
from sequoia_ray.config import ProfileJobConfig, SamplingParams
from sequoia_ray.hardware import (BATCH_BUCKETS, DRAFT_WIDTHS, NO_OVERHEAD, Choice, HardwareProfile, StepOverhead,
                                  check_noise, choose, choose_buckets, per_request_sizes, profile)
from sequoia_ray.measured_choice import Measured, measure_choices, pick, top_candidates
from sequoia_ray.overhead import OVERHEAD_BATCHES, measure_overhead
from sequoia_ray.local import LocalPair
from sequoia_ray.plan_store import PlanKey, PlanStore
from sequoia_ray.prompts import Prompt, interleave_kinds, load_prompts
from sequoia_ray.tree.acceptance_vector import AcceptanceVector
from sequoia_ray.tree.builtin import builtin_acceptance
from sequoia_ray.tree.dp import solve
from sequoia_ray.tree.plan import TreePlan, carried_leaf, chain
from sequoia_ray.tree.plan_file import ACCEPTANCE_FILE, BUILTIN_ACCEPTANCE, PlannedTree, Provenance

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
MIN_CHOICE_TOKENS = 16  # per request, in a measured choice's run at a large batch size


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
    batch: int = 1  # the batch bucket B the plan is for (measured_* are measured at that batch size)
    step_s: float = math.nan  # predicted seconds of one step of B requests on this plan
    throughput: float = math.nan  # predicted tokens per second of the batch: B·G / step_s
    model_n: int = 0  # the cost model's own pick (the published n, d may be a measured runner-up)
    model_d: int = 0


def load_pair(cfg: ProfileJobConfig, *, progress: bool = True) -> LocalPair:
    if cfg.smoke_test:
        return LocalPair.tiny(device=cfg.device)
    return LocalPair.load(cfg.target, cfg.draft, dtype=cfg.dtype, draft_quantize=cfg.draft_quantize,
                          device=cfg.device, progress=progress, linears=cfg.linears, layers=cfg.layers,
                          draft_vocab=cfg.draft_vocab)


def run_trial(cfg: ProfileJobConfig, hardware: str, *, progress: bool = True, pair=None, calls=None
              ) -> tuple[list[TrialResult], dict]:
    """Everything for one hardware type; returns the results and the predicted-speedup grids for plots.

    ``pair`` defaults to an in-process ``LocalPair``; a tensor-parallel job passes one whose target is a
    group of rank actors (``decoder``, ``encode``, ``draft`` and ``time_target`` are all it needs: without the
    target in process there are no lockstep runs, so no overhead term and no measured choice — the model's
    pick is published, its batch-1 plan validated). ``calls(plan, sampled=...)`` -> (root-only, tree) seconds
    of a served step's actor calls (``actors.call_probe.measure_calls``), when the plans will be served."""
    store = PlanStore(cfg.storage)
    store.check_writable()  # what can be checked is, before the models load: the store and the prompt file
    texts = profile_prompts(cfg)
    pair = pair or load_pair(cfg, progress=progress)
    prompts = [pair.encode(p.text, chat=p.chat) for p in texts]
    budgets = SMOKE_BUDGETS if cfg.smoke_test else cfg.budgets
    depth = min(cfg.max_depth, 5) if cfg.smoke_test else cfg.max_depth
    prof = profile(target_model(pair), pair.draft.model, hardware=hardware, budgets=budgets,
                   time_target=pair.time_target, context=min(cfg.context, 32) if cfg.smoke_test else cfg.context,
                   dtype=cfg.dtype, batches=BATCH_BUCKETS)
    check_noise(prof, math.inf if cfg.smoke_test else cfg.max_noise)  # tiny models: sub-ms timings, all noise
    prof = monotone(prof)  # as the bounded profile's: more tokens never cost less (a noisy size would say so)
    if cfg.smoke_test:  # one tree against the target alone, one round: seconds
        cfg = cfg.model_copy(update={"candidates": min(cfg.candidates, 1), "measure_rounds": 1})
    profile_key = store.publish_profile(prof)
    tokens = 12 if cfg.smoke_test else cfg.validate_tokens
    results, grids = [], {}
    for temperature in cfg.temperatures:
        acceptance, measured_on = _acceptance(cfg, pair, prompts, temperature, progress)
        table = solve(acceptance, max(budgets), depth)
        params = SamplingParams(max_tokens=tokens, temperature=temperature)
        if target_model(pair) is None:
            picks = _model_picks(pair, table, prof, budgets, prompts, params)
        else:
            picks = plan_buckets(cfg, pair, prof, table, budgets, prompts, params, calls=calls)
        grids[temperature] = [(c.n, c.d, c.predicted_speedup) for c in picks[1].predicted]
        for batch, picked in sorted(picks.items(), key=lambda item: -item[0]):  # batch 1 last: see _publish_all
            key = PlanKey(hardware, _name(cfg, "draft"), _name(cfg, "target"), temperature, batch)
            prov = _provenance(cfg, pair, picked, batch, **measured_on)
            planned = PlannedTree(picked.choice.plan, acceptance, picked.choice.n, picked.choice.d,
                                  table.value(picked.choice.n, picked.choice.d), prov)
            result = _result(prof, temperature, picked)
            results.append(replace(result, plan_key=store.publish_plan(planned, key), profile_key=profile_key))
            logger.info("%s T=%s B=%d: %s", hardware, temperature, batch, asdict(results[-1]))
    return sorted(results, key=lambda r: (cfg.temperatures.index(r.temperature), r.batch)), grids


@dataclass(frozen=True)
class Picked:
    """A batch bucket's published tree: the choice, what it measured, every tree measured, the overhead."""

    choice: Choice
    model_choice: Choice  # the cost model's own argmax
    predicted: list[Choice]  # every (n, d) the model evaluated
    measured: Measured | None = None  # the pick, run for real (None: not measured)
    candidates: tuple[Measured, ...] = ()
    overhead: StepOverhead | None = None


def plan_buckets(cfg: ProfileJobConfig, pair, prof: HardwareProfile, table, budgets, prompts, params: SamplingParams,
                 *, measured_buckets=None, calls=None) -> dict[int, Picked]:
    """Per batch bucket the profile has: the overhead measured on real steps, the model's choice with it, then
    (for ``measured_buckets``, default all) the measured choice among its ``cfg.candidates`` best and the target
    alone, each run at the bucket's batch size with ``params.max_tokens`` tokens in all (at least
    MIN_CHOICE_TOKENS per request). ``calls``: see ``run_trial``; its times join the overhead and the measured
    runs' seconds (the lockstep runs make no actor calls)."""
    models = (target_model(pair), pair.draft.model)
    probe, batches = _probe(table, prof, choose(table, prof, budgets)[0])
    overhead = measure_overhead(*models, prof, probe, prompts, params, batches=batches,
                                repeats=cfg.measure_rounds).overhead
    if calls is not None:
        overhead = replace(overhead, calls=_calls(calls, probe, prof, sampled=not params.greedy))
    chosen = choose_buckets(table, prof, budgets, overhead)
    picks = {}
    for batch, (best, predicted) in chosen.items():
        if not cfg.candidates or batch not in (measured_buckets or chosen):
            picks[batch] = Picked(best, best, predicted, overhead=overhead)
            continue
        per_request = params.model_copy(update={"max_tokens": max(MIN_CHOICE_TOKENS, params.max_tokens // batch)})
        measured = measure_choices(*models, top_candidates(predicted, cfg.candidates), prompts, per_request,
                                   batch=batch, rounds=cfg.measure_rounds, calls=served_calls(prof, overhead))
        winner = pick(measured)
        picks[batch] = Picked(winner.choice, best, predicted, winner, tuple(measured), overhead)
    return picks


def _calls(calls, probe: TreePlan, prof: HardwareProfile, *, sampled: bool) -> tuple[float, float]:
    """``calls`` (see ``run_trial``) timed on ``probe``'s tree, in target steps."""
    alone_s, tree_s = calls(probe, sampled=sampled)
    return alone_s / prof.target_step_s, tree_s / prof.target_step_s


def unmeasured_picks(table, prof: HardwareProfile, budgets, *, calls=None, sampled: bool) -> dict[int, Picked]:
    """Per batch bucket the model's choice with no step run in process (no time left for it): charged the
    served step's actor calls when ``calls`` can time them (the in-process overhead stays unmeasured), so that
    the buckets pay for the calls as the measured temperatures' do. The main job's T = 0 on the 2-core EPYC:
    without them bucket 8 predicted a tree at 1.003x the target alone (measured 0.996x in process, before
    Serve's calls; session 37)."""
    overhead = None
    if calls is not None:
        probe, _ = _probe(table, prof, choose(table, prof, budgets)[0])
        overhead = StepOverhead(calls=_calls(calls, probe, prof, sampled=sampled))
    return {b: Picked(best, best, predicted, overhead=overhead)
            for b, (best, predicted) in choose_buckets(table, prof, budgets, overhead or NO_OVERHEAD).items()}


def served_calls(prof: HardwareProfile, overhead: StepOverhead | None) -> tuple[float, float]:
    """(root-only, tree) seconds of a request's actor calls a served step makes: ``overhead.calls`` in seconds."""
    return (0.0, 0.0) if overhead is None else tuple(c * prof.target_step_s for c in overhead.calls)


def _probe(table, prof: HardwareProfile, first: Choice) -> tuple[TreePlan, tuple[int, ...]]:
    """The tree the overhead is measured on — the model's batch-1 choice, else (root-only, or too big to cost
    at the largest overhead batch) the DP's tree of at most 8 nodes and 4 levels that can be costed — and the
    overhead batches it can be costed at."""
    top = max(OVERHEAD_BATCHES)

    def costed(plan: TreePlan, batch: int) -> bool:  # its target forward and every draft level within the profile
        return prof.can_cost(plan, batch, carried_leaf(plan, table.acceptance))

    fits = max(1, min(table.max_nodes, prof.max_tokens(top) // top))
    small = table.tree(max(2, min(8, fits)), max(2, min(4, table.max_depth)))
    plan = first.plan if first.n > 1 and costed(first.plan, top) else small
    return plan, tuple(b for b in OVERHEAD_BATCHES if costed(plan, b))


def _model_picks(pair, table, prof: HardwareProfile, budgets, prompts, params: SamplingParams) -> dict[int, Picked]:
    """The model's choice per bucket without lockstep runs (a target that is a group of rank actors); the
    batch-1 plan validated with the pair's decoders."""
    chosen = choose_buckets(table, prof, budgets)
    speedup, per_step = validate(pair, chosen[1][0], prompts, params.temperature, params.max_tokens)
    picks = {b: Picked(best, best, predicted) for b, (best, predicted) in chosen.items()}
    one = chosen[1][0]
    picks[1] = replace(picks[1], measured=Measured(one, speedup, math.nan, per_step))
    return picks


def _provenance(cfg: ProfileJobConfig, pair, picked: Picked, batch: int, *, prompts: int, tokens: int,
                **extra) -> Provenance:
    measured = picked.measured
    return Provenance(
        dtype=cfg.dtype, draft_quantize=cfg.draft_quantize, device=str(pair.draft.model.device),
        linears=_linears(pair, cfg), layers=_layers(pair), draft_vocab=cfg.draft_vocab, prompts=prompts,
        tokens_measured=tokens, batch=batch if batch > 1 else None,
        predicted_speedup=_positive(picked.choice.predicted_speedup),
        measured_speedup=_positive(measured.measured_speedup) if measured else None,
        candidates=[m.to_dict() for m in picked.candidates] or None,
        overhead=picked.overhead.to_dict() if picked.overhead else None, **extra)


def _linears(pair, cfg: ProfileJobConfig) -> str:
    """The target's Linear kernels as run: counted in process; a rank group reports its configured mode."""
    from sequoia_ray.models.packed_linear import packed_count

    model = target_model(pair)
    if model is None:
        return cfg.linears
    return "packed" if packed_count(model) else "aten"


def _layers(pair) -> str | None:
    """``traced`` when an in-process model's layers ran as traces, ``eager`` when none did; None for a target
    that is a group of rank actors (tensor-parallel shards are never traced, the draft may be)."""
    from sequoia_ray.models.traced_layers import traced_count

    models = [getattr(getattr(pair, "draft", None), "model", None), target_model(pair)]
    if models[1] is None:
        return None
    return "traced" if any(traced_count(m) for m in models if m is not None) else "eager"


def _positive(x: float) -> float | None:
    return x if math.isfinite(x) and x > 0 else None


def target_model(pair):
    """The in-process target model (batches are timed with it), None for a target that is a group of rank
    actors (its profile then has no batch tables: see ``sequoia_ray.hardware`` on how they are extrapolated)."""
    target = getattr(pair, "target", None)
    return getattr(target, "model", None)


def _result(prof: HardwareProfile, temperature: float, picked: Picked) -> TrialResult:
    best, measured = picked.choice, picked.measured
    step_s = best.step_cost * prof.target_step_s
    return TrialResult(prof.hardware_id, temperature, best.n, best.d, best.expected_tokens, best.predicted_speedup,
                       measured.measured_speedup if measured else math.nan,
                       measured.tokens_per_step if measured else math.nan, "", "", best.batch, step_s,
                       best.batch * best.expected_tokens / step_s, picked.model_choice.n, picked.model_choice.d)


def _name(cfg: ProfileJobConfig, role: str) -> str:
    if cfg.smoke_test:
        return f"tiny-{role}"
    return cfg.draft if role == "draft" else cfg.target


def profile_prompts(cfg: ProfileJobConfig) -> list[Prompt]:
    """The prompts a profile measures on: ``cfg.prompts`` or the built-in set, round-robin by kind, the first
    ``max_prompts``."""
    prompts = interleave_kinds(load_prompts(cfg.prompts) if cfg.prompts else BUILTIN_PROMPTS)
    return prompts[: 2 if cfg.smoke_test else cfg.max_prompts]


def _acceptance(cfg, pair: LocalPair, prompts, temperature: float, progress: bool
                ) -> tuple[AcceptanceVector, dict]:
    """p at ``temperature`` and what it was measured on, as ``_provenance``'s ``prompts``, ``tokens`` and
    ``source``: the prompts and tokens per prompt measured, or none for a vector the job was given
    (``--acceptance T=FILE``; ``source`` ACCEPTANCE_FILE), which its plans claimed measured on every prompt."""
    if temperature in cfg.acceptance:
        return AcceptanceVector.parse(cfg.acceptance[temperature]), {"prompts": 0, "tokens": 0,
                                                                     "source": ACCEPTANCE_FILE}
    tokens = 16 if cfg.smoke_test else cfg.measure_tokens
    acceptance, _ = measure(pair.decoder, prompts, width=cfg.width, temperature=temperature, max_tokens=tokens,
                            progress=progress)
    return acceptance, {"prompts": len(prompts), "tokens": tokens}


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
    """One row per temperature and batch bucket B: the published plan (n, d), G, the predicted step time and
    batch throughput, the predicted and measured speedup over the target alone at that batch size, and the
    cost model's own pick when the measured choice published another. A figure not measured shows "-"."""
    width = max([28, *(len(r.hardware) for r in results)])  # a hardware id may be longer than the header's 28

    def cell(value: float, size: int, digits: int = 2) -> str:
        return f"{'-':>{size}s}" if math.isnan(value) else f"{value:{size}.{digits}f}"

    head = (f"{'hardware':{width}s} {'T':>4s} {'B':>3s} {'n':>4s} {'d':>3s} {'G':>6s} {'step ms':>8s} {'tok/s':>7s} "
            f"{'pred':>6s} {'meas':>6s} {'tok/step':>8s} {'model':>7s}")
    lines = [head, "-" * len(head)]
    for r in results:
        model = "same" if (r.model_n, r.model_d) in ((r.n, r.d), (0, 0)) else f"{r.model_n}/{r.model_d}"
        lines.append(f"{r.hardware:{width}s} {r.temperature:4.1f} {r.batch:3d} {r.n:4d} {r.d:3d} "
                     f"{cell(r.expected_tokens, 6)} {cell(1e3 * r.step_s, 8, 1)} {cell(r.throughput, 7, 1)} "
                     f"{cell(r.predicted_speedup, 6)} {cell(r.measured_speedup, 6)} "
                     f"{cell(r.measured_tokens_per_step, 8)} {model:>7s}")
    return "\n".join(lines)


def publish_heatmaps(cfg: ProfileJobConfig, hardware: str, grids: dict) -> list[str]:
    store = PlanStore(cfg.storage)
    return [store.put_report(f"heatmap-{hardware}-t{t:.1f}.png", heatmap_png(grid, f"{hardware}  T={t}"))
            for t, grid in grids.items()]


# ---- a bounded trial: the main job profiles this machine within a time budget ----------------------
BOUNDED_BUDGETS = (1, 2, 4, 8, 16, 32)  # tree sizes n profiled under a time budget (the DP's largest n)
SIZES_FIRST = 16  # sizes up to this are timed before the batch buckets when the budget cannot fit both
BOUNDED_CONTEXT = 64  # cached context when timing t(n) and c under a budget
BOUNDED_REPEATS = 3
PROFILE_SHARE = 0.25  # of the budget: profiling t(n) and c (the sizes are chosen to fit)
MEASURE_SHARE = 0.45  # of a temperature's time: measuring p; the rest measures the overhead and the best trees
MIN_TOKENS = 8  # fewer tokens than this per prompt measure nothing useful
BOUNDED_CANDIDATES = 2  # trees measured for real at batch 1 under a time budget (besides the target alone)
BOUNDED_ROUNDS = 2
CHECK_SHARE = 0.3  # of a temperature's time after p: checking the larger buckets' trees against the target alone
CHECK_TREE_STEPS = 1.5  # a tree run's steps, in root-only runs' time (measured here: 1.1x at batch 8, n = 2 d = 2)


class BudgetExhausted(RuntimeError):
    """The time budget cannot produce a usable plan; the message names the stage, the time and the fix."""


class Deadline:
    """A time budget on an injected clock (``time.monotonic`` by default; tests pass a fake one)."""

    def __init__(self, seconds: float, clock=time.monotonic) -> None:
        if seconds <= 0:
            raise ValueError(f"time budget {seconds} s must be > 0")
        self.seconds, self.clock, self.start = seconds, clock, clock()

    def elapsed(self) -> float:
        return self.clock() - self.start

    def left(self) -> float:
        return self.seconds - self.elapsed()


class Stages:
    """Progress over a trial's stages: a tqdm bar on a terminal, plain lines on stdout otherwise."""

    def __init__(self, names: list[str], deadline: Deadline, progress: bool) -> None:
        self.deadline, self.total, self.done = deadline, len(names), 0
        self.bar = tqdm(total=len(names), desc="profiling", unit="stage", disable=not (progress and sys.stderr.isatty()))
        self.lines = progress and self.bar.disable

    def next(self, name: str) -> None:
        note = f"{name} ({self.deadline.elapsed():.0f}s of {self.deadline.seconds:.0f}s)"
        if self.lines:
            print(f"profiling [{self.done + 1}/{self.total}] {note}", flush=True)
        self.bar.update(self.done - self.bar.n)
        self.bar.set_postfix_str(note)
        self.done += 1

    def close(self) -> None:
        self.bar.update(self.done - self.bar.n)
        self.bar.close()


@dataclass(frozen=True)
class Serving:
    """What the plan is measured and served with beyond the job config (recorded in its provenance)."""

    threads: int  # the target actor's torch threads (part of the hardware id)
    time_budget_s: float
    calls: object = None  # see run_trial: the served step's actor calls, measured (None: not counted)


def run_bounded(cfg: ProfileJobConfig, hardware: str, serving: Serving, *, clock=time.monotonic,
                progress: bool = True, pair=None) -> list[TrialResult]:
    """``run_trial`` within ``serving.time_budget_s`` by construction: a few sizes profiled at a short
    context, then per temperature as many prompts and tokens as the measured step time fits into that
    temperature's share of the time left. BudgetExhausted when that is too little for a usable plan.
    Publishes (profile and every temperature's plan for every batch bucket) only when all temperatures have
    their plans. Loading the
    models is outside the budget: its time does not depend on what is measured (and the served actors
    load the same models anyway)."""
    names = ["loading models", "profiling t(n) and c"] + [
        f"{s} T={t}" for t in cfg.temperatures for s in ("measuring p", "validating")]
    PlanStore(cfg.storage).check_writable()  # as in run_trial: before the models load
    texts = profile_prompts(cfg)
    stages = Stages(names, Deadline(serving.time_budget_s, clock), progress)
    try:
        stages.next("loading models")
        pair = pair or load_pair(cfg, progress=False)
        prompts = [pair.encode(p.text, chat=p.chat) for p in texts]
        stages.deadline = deadline = Deadline(serving.time_budget_s, clock)  # from here: loading is not ours
        stages.next("profiling t(n) and c")
        prof = _bounded_profile(cfg, pair, hardware, deadline)
        check_noise(prof, cfg.max_noise)
        planned = [_bounded_plan(cfg, pair, prof, prompts, i, deadline, stages, serving)
                   for i in range(len(cfg.temperatures))]
    finally:
        stages.close()
    return _publish_all(cfg, hardware, prof, planned)


def _bounded_profile(cfg: ProfileJobConfig, pair, hardware: str, deadline: Deadline) -> HardwareProfile:
    sizes, batch_total = bounded_sizes(pair.time_target((1, 8), BOUNDED_CONTEXT, 1), PROFILE_SHARE * deadline.left())
    if not batch_total:
        logger.warning("profiling t(n) and c at sizes %s without batch tables (no time for them): batches are "
                       "extrapolated as one request of B·n tokens; a larger time budget times them", sizes)
    widths = tuple(w for w in DRAFT_WIDTHS if w <= max(sizes))
    return monotone(profile(target_model(pair), pair.draft.model, hardware=hardware, budgets=sizes, widths=widths,
                            context=BOUNDED_CONTEXT, repeats=BOUNDED_REPEATS, dtype=cfg.dtype,
                            time_target=pair.time_target, batches=BATCH_BUCKETS if batch_total else (),
                            batch_total=batch_total or None))


def monotone(prof: HardwareProfile) -> HardwareProfile:
    """t(n), c(w) and every batch's T_B, C_B made non-decreasing: more tokens never cost less, and a few repeats
    on a busy machine can say otherwise, which would make the DP favour big trees for free. Each table is fitted
    by ``isotonic`` regression, then all are divided by the fitted t(1) (so t(1) = 1 again, ``target_step_s``
    scaled to match). Until session 28 a running maximum: one slow timing at a small size then set every
    larger size (t(8) = 1.42 copied to t(16) and t(32) in a profile of this 2-core Xeon). Bounded profiles
    against long ones (``benchmarks/profile_estimators.py``, session 28, 8 comparisons): read as until then
    (median repeats, running maximum) a median 21% off a cell; with the fastest repeats (``hardware.quiet``),
    t(1)'s extra repeats (``hardware._time_all``) and this fit 3.0%. The fit's own share is small (with the
    fastest repeats: running maximum 6.6%, the fit 6.8%; the worst cell 23% against 19%)."""
    fitted_t = isotonic(prof.t)
    one = fitted_t.get(1, 1.0)

    def scaled(table: dict[int, float]) -> dict[int, float]:
        return {k: v / one for k, v in table.items()}

    def fit(table: dict[int, float]) -> dict[int, float]:
        return scaled(isotonic(table))

    return replace(prof, t=scaled(fitted_t), c=fit(prof.c), target_step_s=prof.target_step_s * one,
                   batch_t={b: fit(row) for b, row in prof.batch_t.items()},
                   batch_c={b: fit(row) for b, row in prof.batch_c.items()})


def isotonic(table: dict[int, float]) -> dict[int, float]:
    """The non-decreasing fit of ``table`` (by key) nearest it in least squares: pool adjacent violators, each
    run of keys that decreases replaced by its mean."""
    blocks: list[tuple[float, int]] = []  # (sum, count) of consecutive keys, means increasing
    for k in sorted(table):
        total, count = table[k], 1
        while blocks and blocks[-1][0] / blocks[-1][1] > total / count:
            total, count = total + blocks[-1][0], count + blocks[-1][1]
            blocks.pop()
        blocks.append((total, count))
    means = [total / count for total, count in blocks for _ in range(count)]
    return dict(zip(sorted(table), means))


def bounded_sizes(probe: dict[int, float], seconds: float) -> tuple[tuple[int, ...], int]:
    """(sizes, batch_total) whose profiling fits ``seconds``, from a probe's target seconds at 1 and 8 tokens
    (linear beyond; the draft, at most as slow, doubles it; warm-up + repeats). Priorities, in order: the
    sizes of BOUNDED_BUDGETS up to SIZES_FIRST (the batch-1 plan's tree can be no larger than the largest
    size timed), then every batch bucket B timed at B·1 tokens, then the larger sizes, then the batch grid
    (T_B, C_B at B·s <= batch_total, the largest size fitting). So: the longest prefix of BOUNDED_BUDGETS
    timed alone that fits; with the batch buckets too when a prefix reaching min(that prefix's largest size,
    SIZES_FIRST) fits with them (the longest such), else no batch tables (batch_total 0: every batch
    extrapolated as one request of B·n tokens, and costed up to the largest size in all). Until session 25 the
    batch buckets came first: a probe on a slow moment of the 2-core Xeon (0.44 s a token, 30 s for profiling)
    timed sizes up to 4 only, with the batch tables, where sizes up to 16 alone fitted, and the main job served
    n = 4, d = 4 (the best fixed trees there have 16-32 nodes); and 33 s gave sizes to 4 where 29 s gave 16.
    BudgetExhausted when not even the sizes up to 4 fit alone."""
    def cost(sizes, total: int | None) -> float:
        tokens = batch_tokens(sizes, total) if total else sizes
        return 2 * (1 + BOUNDED_REPEATS) * sum(max(probe[1], probe[8] * s / 8) for s in tokens)

    prefixes = [BOUNDED_BUDGETS[:k] for k in range(len(BOUNDED_BUDGETS), 2, -1)]  # longest first
    alone = next((p for p in prefixes if cost(p, 0) <= seconds), None)
    if alone is None:
        raise BudgetExhausted(f"profiling t(n) and c: sizes {BOUNDED_BUDGETS[:3]} need ~{cost(BOUNDED_BUDGETS[:3], 0):.0f}s "
                              f"of the {seconds:.0f}s given to it; raise the time budget (profile_seconds)")
    floor = min(max(alone), SIZES_FIRST)
    batched = next((p for p in prefixes if max(p) >= floor and cost(p, 1) <= seconds), None)
    if batched is None:
        return alone, 0
    return batched, max(s for s in batched if cost(batched, s) <= seconds)


def batch_tokens(sizes, total: int | None = None) -> list[int]:
    """The forwards a profile of ``sizes`` times, by total tokens: each size alone, then each batch bucket's
    grid up to ``total`` (default: the largest size)."""
    return list(sizes) + [b * s for b in BATCH_BUCKETS[1:] for s in per_request_sizes(b, sizes, total)]


def _bounded_plan(cfg, pair, prof: HardwareProfile, prompts, i: int, deadline: Deadline, stages: Stages,
                  serving: Serving) -> list[tuple[PlannedTree, TrialResult]]:
    """Temperature ``cfg.temperatures[i]`` within its share of the time left: measure p, DP, then the overhead
    and the measured choice at batch 1 (``plan_buckets``) with as many tokens as fit, the other buckets the
    model's choice with that overhead; a (plan, result) per bucket. When not even p fits, the built-in
    acceptance vector stands in for it (``source`` BUILTIN_ACCEPTANCE in the provenance): the tree is still
    chosen for this machine's measured t(n) and c, where the built-in plan is chosen for none."""
    temperature = cfg.temperatures[i]
    end = deadline.elapsed() + deadline.left() / (len(cfg.temperatures) - i)
    stages.next(f"measuring p T={temperature}")
    measure_end = end - (end - deadline.elapsed()) * (1 - MEASURE_SHARE)
    source = None
    try:
        acceptance, used, tokens, pace = measure_within(cfg, pair, prompts, temperature, deadline, measure_end, prof)
    except BudgetExhausted as exc:  # t(n) and c are this machine's: plan with them and the built-in p
        logger.warning("%s. Planning T=%s with this machine's t(n) and c and the built-in acceptance vector "
                       "(a larger budget re-profiles)", exc, temperature)
        acceptance, used, tokens, pace, source = builtin_acceptance(temperature), 0, 0, 1.0, BUILTIN_ACCEPTANCE
    table = solve(acceptance, max(prof.t), cfg.max_depth)
    stages.next(f"measuring trees T={temperature}")
    bounded = cfg.model_copy(update={"candidates": min(cfg.candidates, BOUNDED_CANDIDATES),
                                     "measure_rounds": BOUNDED_ROUNDS})
    longest = len(max(prompts, key=len))
    ask, bounded = trees_within((end - deadline.elapsed()) * (1 - CHECK_SHARE), prof, pace, bounded, longest)
    if ask < MIN_TOKENS:
        logger.warning("no time left to measure trees at T=%s; publishing the cost model's choice unmeasured", temperature)
        picks = unmeasured_picks(table, prof, tuple(prof.t), calls=serving.calls, sampled=temperature > 0)
    else:
        if not bounded.candidates:
            logger.warning("no time left to measure trees at T=%s: the overhead measured, the cost model's choice "
                           "with it published unmeasured", temperature)
        params = SamplingParams(max_tokens=min(ask, cfg.validate_tokens), temperature=temperature)
        picks = plan_buckets(bounded, pair, prof, table, tuple(prof.t), prompts, params, measured_buckets=(1,),
                             calls=serving.calls)
        picks = check_buckets(picks, bucket_check(pair, prof, picks, prompts, params),
                              fits=lambda batch: check_seconds(prof, pace, batch, longest) <= end - deadline.elapsed())
    return [(PlannedTree(p.choice.plan, acceptance, p.choice.n, p.choice.d, table.value(p.choice.n, p.choice.d),
                         _provenance(cfg, pair, p, batch, prompts=used, tokens=tokens, threads=serving.threads,
                                     time_budget_s=serving.time_budget_s, source=source)),
             _result(prof, temperature, p)) for batch, p in picks.items()]


def check_buckets(picks: dict[int, Picked], measure, fits) -> dict[int, Picked]:
    """The larger buckets' trees checked against the target alone for real, largest bucket first: a bucket
    whose tree measures slower than the target alone publishes the root-only tree (the planner finds the
    crossover itself), and the check goes on to the next smaller bucket; the first bucket whose tree measures
    faster ends it — speculation pays less as the batch grows (the target's forward gets cheaper per token,
    the draft's levels and per-request costs do not), so the smaller buckets' trees pay too.
    ``measure(choices, batch)`` -> [Measured] (the root-only choice first); ``fits(batch)``: whether a check
    at that batch size fits the time left (one that does not is skipped: its pick stays unmeasured)."""
    out = dict(picks)
    for batch in sorted((b for b, p in picks.items() if b > 1 and p.choice.n > 1), reverse=True):
        if not fits(batch):
            logger.info("no time left to check bucket %d's tree against the target alone; publishing it unmeasured",
                        batch)
            continue
        p = picks[batch]
        root = next(c for c in p.predicted if c.n == 1)
        measured = measure([root, p.choice], batch)
        winner = pick(measured)
        out[batch] = Picked(winner.choice, p.model_choice, p.predicted, winner, tuple(measured), p.overhead)
        logger.info("bucket %d: n=%d d=%d measured %.2fx the target alone: %s", batch, p.choice.n, p.choice.d,
                    measured[1].measured_speedup, "the tree" if winner.choice.n > 1 else "the target alone serves")
        if winner.choice.n > 1:
            break
    return out


def bucket_check(pair, prof: HardwareProfile, picks: dict[int, Picked], prompts, params: SamplingParams):
    """``check_buckets``'s ``measure``: one round of MIN_CHOICE_TOKENS a request at the bucket's batch size, each
    step charged the served actor calls of the bucket's overhead (``served_calls``)."""
    models = (target_model(pair), pair.draft.model)
    short = params.model_copy(update={"max_tokens": MIN_CHOICE_TOKENS})

    def measure(choices: list[Choice], batch: int) -> list[Measured]:
        return measure_choices(*models, choices, prompts, short, batch=batch, rounds=1,
                               calls=served_calls(prof, picks[batch].overhead))
    return measure


def check_seconds(prof: HardwareProfile, pace: float, batch: int, prompt_len: int) -> float:
    """A bound on one ``check_buckets`` measure at ``batch``: two runs (the target alone, the tree), each
    prefilling ``batch`` prompts (the tree's run in the draft too) and stepping MIN_CHOICE_TOKENS times; a tree
    step counted as CHECK_TREE_STEPS root-only steps (it yields more tokens, so fewer steps, but costs more),
    times ``pace``."""
    alone = prof.target_step_s * prof.target_cost(batch, batch)
    prefills = batch * (_prefill_s(prof, prompt_len, draft=False) + _prefill_s(prof, prompt_len))
    return pace * (prefills + (1 + CHECK_TREE_STEPS) * MIN_CHOICE_TOKENS * alone)


def trees_within(seconds: float, prof: HardwareProfile, pace: float, cfg: ProfileJobConfig,
                 prompt_len: int) -> tuple[int, ProfileJobConfig]:
    """(tokens per run, config) for ``plan_buckets`` at batch 1 in ``seconds``: the measured choice among
    ``cfg.candidates`` trees when at least MIN_TOKENS fit it; else the overhead runs alone (``candidates`` 0:
    the cost model's choice, costed with the overhead measured); else fewer than MIN_TOKENS (nothing measured).
    The overhead comes first because it prices every bucket's tree, where the measured choice only confirms
    batch 1's: on the 2-core Xeon (session 40) the main job's T = 0 had ~23 s for trees, the choice needed
    ~26 s, and T = 0 published trees costed with no overhead at all (~6% of a tree step at batch 8)."""
    if cfg.candidates:
        ask = choice_tokens(seconds, prof, pace, cfg.candidates, prompt_len)
        if ask >= MIN_TOKENS:
            return ask, cfg
    return choice_tokens(seconds, prof, pace, 0, prompt_len), cfg.model_copy(update={"candidates": 0})


def choice_tokens(seconds: float, prof: HardwareProfile, pace: float, candidates: int, prompt_len: int) -> int:
    """Tokens per run that fit ``plan_buckets`` at batch 1 in ``seconds``: BOUNDED_ROUNDS rounds of the
    overhead runs (root-only and a tree at OVERHEAD_BATCHES) and of the 1 + ``candidates`` measured trees (none
    with ``candidates`` 0: ``plan_buckets`` then runs the overhead runs alone), each run a prefill of each of its
    prompts (in the draft too where it grows trees) and one root-only step's time per token (the profiled times
    scaled by ``pace``). Two approximations that offset: a tree's token costs less than a root-only step (~half
    at batch 1 here: a step costs ~2, yields ~4), and the measured trees run at least MIN_CHOICE_TOKENS however
    few are asked (``plan_buckets``)."""
    alone = {b: pace * prof.target_step_s * prof.target_cost(b, b) for b in OVERHEAD_BATCHES}
    measured = 1 + candidates if candidates else 0
    per_token = BOUNDED_ROUNDS * (2 * sum(alone.values()) + measured * alone[1])
    prompts = sum(OVERHEAD_BATCHES)  # prompts a round's runs of each kind prefill: root-only and tree
    target = _prefill_s(prof, prompt_len, draft=False)
    both = _prefill_s(prof, prompt_len)
    fixed = BOUNDED_ROUNDS * (prompts * (target + both) + (target + candidates * both if candidates else 0.0))
    return tokens_within(seconds, per_token, pace * fixed)


def tokens_within(seconds: float, step_s: float, fixed_s: float) -> int:
    """Tokens a generation can be asked for in ``seconds``: every step yields at least one token, so
    ``fixed_s`` (prefill, warm-up) plus one ``step_s`` per token bounds its time."""
    return max(0, int((seconds - fixed_s) / step_s))


def _prefill_s(prof: HardwareProfile, prompt_len: int, *, draft: bool = True) -> float:
    """Seconds to prefill a prompt of ``prompt_len`` tokens: the target's forward, t(n), and with ``draft`` the
    draft's, c(n); beyond the largest profiled n each grows in proportion to it (an upper bound: a forward's
    time per token only falls as it grows). The real pair here, prompts of 13-41 tokens: estimated 0.25-0.56 s,
    measured 0.25-0.55 s (target 0.20-0.42, draft 0.05-0.13); the earlier estimate — the target's t at the
    largest n for every chunk of that many tokens, twice — said 0.69-1.37 s."""
    def forward(table: dict[int, float], of) -> float:
        top = max(table)
        return of(prompt_len) if prompt_len <= top else table[top] * prompt_len / top

    return prof.target_step_s * (forward(prof.t, prof.t_of) + (forward(prof.c, prof.c_of) if draft else 0.0))


def measure_within(cfg: ProfileJobConfig, pair, prompts, temperature: float, deadline: Deadline, until: float,
                   prof: HardwareProfile) -> tuple[AcceptanceVector, int, int, float]:
    """(p, prompts used, tokens asked for, pace) measuring prompt after prompt until ``until`` (seconds into
    the deadline): each prompt asks for as many tokens as fit in its equal share of the time left (``_share``)
    at the profiled step and prefill times, scaled, once a prompt has run, by the pace observed (seconds seen /
    seconds predicted; a profile taken on a busy machine can be off either way). Sharing spreads p over the
    prompts — one predictable prompt taking all the time measured p[1] = 1.0 at T = 0.6 here."""
    predicted = prof.target_step_s * (prof.t_of(min(cfg.width + 1, max(prof.t))) + prof.c_of(1))
    pace, began, predicted_total = 1.0, deadline.elapsed(), 0.0
    weighted, steps_total, used, tokens = [0.0] * (cfg.width + 1), 0, 0, 0
    for i, prompt in enumerate(prompts):
        ask = _share(cfg.measure_tokens, until - deadline.elapsed(), len(prompts) - i, pace * predicted,
                     pace * _prefill_s(prof, len(prompt)))
        if not ask:
            break
        acc, steps = measure(pair.decoder, [prompt], width=cfg.width, temperature=temperature, max_tokens=ask,
                             seed=i, progress=False)
        for k, v in enumerate((acc.reject[0], *acc.rows[0])):
            weighted[k] += v * steps
        steps_total, used, tokens = steps_total + steps, used + 1, tokens + ask
        predicted_total += _prefill_s(prof, len(prompt)) + steps * predicted
        pace = (deadline.elapsed() - began) / predicted_total
    if not used:
        raise BudgetExhausted(f"measuring p at T={temperature}: {until - deadline.elapsed():.1f}s left fit fewer than "
                              f"{MIN_TOKENS} tokens at {predicted:.2f}s a step; raise the time budget (profile_seconds)")
    acceptance = AcceptanceVector.from_p([w / steps_total for w in weighted[1:]], weighted[0] / steps_total)
    return acceptance, used, tokens, pace


def _share(most: int, seconds: float, prompts: int, step_s: float, fixed_s: float) -> int:
    """Tokens for the next of ``prompts`` prompts: what fits its equal share of ``seconds`` (at most ``most``);
    MIN_TOKENS when the share is smaller but the whole time still fits them; 0 when not even that fits."""
    share = min(most, tokens_within(seconds / prompts, step_s, fixed_s))
    if share >= MIN_TOKENS:
        return share
    return MIN_TOKENS if min(most, tokens_within(seconds, step_s, fixed_s)) >= MIN_TOKENS else 0


def _publish_all(cfg: ProfileJobConfig, hardware: str, prof: HardwareProfile,
                 planned: list[list[tuple[PlannedTree, TrialResult]]]) -> list[TrialResult]:
    """Every bucket's plan, the batch-1 plan LAST: the launcher takes a temperature's batch-1 plan as the mark
    that its plans are there, so a publish cut short leaves the temperature missing (profiled again)."""
    store = PlanStore(cfg.storage)
    profile_key = store.publish_profile(prof)
    results = []
    for per_bucket, temperature in zip(planned, cfg.temperatures):
        for tree, r in sorted(per_bucket, key=lambda x: -x[1].batch):
            key = PlanKey(hardware, _name(cfg, "draft"), _name(cfg, "target"), temperature, r.batch)
            results.append(replace(r, plan_key=store.publish_plan(tree, key), profile_key=profile_key))
    return sorted(results, key=lambda r: (cfg.temperatures.index(r.temperature), r.batch))
