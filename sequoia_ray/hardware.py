"""Hardware awareness: profile t(n) and the draft's cost, then choose the tree size and depth.

t(n) = time for the target to verify n tree tokens ÷ time for 1 (at a realistic context length);
c(w) = time of one draft forward over w tokens ÷ one target step. The draft forwards, level by level, only
the nodes that have children (the root with the uncached committed tokens first), so with i_l such inner
nodes at level l

    predicted speedup(n, d) = G(n, d) / (t(n) + sum_{l : i_l > 0} c(i_l))

which is the paper's G / (t(n) + d·c) with c measured per level width instead of assumed constant.

Batches. With continuous batching one target forward verifies the trees of B requests and one draft forward
per level grows all of them, so a step of B requests on the same tree costs

    step(B, n, d) = T_B(B·n) + sum_{l : i_l > 0} C_B(B·i_l)

with T_B(N) the target's forward of N tree tokens in total from B requests (each at the profiled context,
``hidden_many`` + one LM head call over all rows) and C_B(W) the draft's forward of a level W nodes wide across
the B requests, both ÷ the one-token target step. The batch's throughput is B·G(n, d) / step(B, n, d) and the
target alone batched is the root-only tree (n = 1, no draft call): B / T_B(B). ``choose(..., batch=B)``
maximises the ratio of the two over every (n, d), the root-only tree included, so speculation that does not
pay at some batch size is dropped by the planner itself. At B = 1 it is exactly the formula above. Beyond the
largest total a batch was timed at (a bounded profile times big batches at few sizes), T_B(N) = t(N) plus the
batch's excess over t measured at that largest total (the B contexts' K/V and the per-request work do not
grow with the tree), likewise C_B. A profile without batch tables (written before batches were profiled)
extrapolates a batch as one request of B·n tokens (T_B(N) = t(N), C_B(W) = c(W)): right when reading the
weights dominates a step, optimistic when reading the B contexts' K/V does (long contexts).

Overhead. The forwards are not the whole step: drawing children, the verifier's walk, the KV compaction, the
Python around them and, when served, the actor calls take time too. ``StepOverhead`` holds it, measured by
running real steps (``sequoia_ray.overhead``: lockstep steps in process, the time each spends outside its
forwards) as a fixed part plus a part per request of the batch, for a root-only step and for a step that grows
a tree:

    step(B, n, d) = T_B(B·n) + sum_l C_B(B·i_l) + O_tree(B)        O(B) = fixed + B·(per_request + calls)
    alone(B)      = T_B(B) + O_alone(B)

Noise. Every table is timed round-robin with repeats; ``noise`` is the median over everything timed of the
repeats' median absolute deviation over their median. ``drift`` is how far the machine's speed moved between
rounds (``round_drift``): a step change in speed during the profile keeps every MAD small (two of three repeats
agree) yet bends the tables where it happened, so a drifting timing is taken again (``retries``) and the
calmer attempt kept. ``check_noise`` refuses a profile noisier or drifting more than a bound (a busy
machine's profile would choose a plan for load that is gone).

Timings run on the model's device and synchronise it before every clock read (an accelerator runs kernels
asynchronously; without the sync a timer measures only the launches).
"""

from __future__ import annotations

import contextlib

import datetime as _dt
import functools
import json
import logging
import math
import platform
import re
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

from sequoia_ray.devices import synchronize
from sequoia_ray.models.batch_forward import Segment, hidden_many
from sequoia_ray.models.tree_lm import KVSession
from sequoia_ray.tree.dp import DPTable
from sequoia_ray.tree.plan import MAX_PLAN_NODES, TreePlan, carried_leaf, chain

logger = logging.getLogger(__name__)

SCHEMA_VERSION = 1
DEFAULT_BUDGETS = (1, 2, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256)
DRAFT_WIDTHS = (1, 2, 4, 8, 16, 32, 64)
MAX_DRIFT = 0.15  # rounds whose speeds differ more are timed again (round_drift)
ANCHOR_EVERY = 6  # t(1), which every table is divided by, is timed again after every this many forwards a round
BATCH_BUCKETS = (1, 2, 4, 8, 16)  # batch sizes with a plan of their own; a batch uses its bucket's
BATCH_LAYOUT = "auto"  # hidden_many's layout when timing batches: the serving default


class ProfileError(ValueError):
    """A profile that cannot be used; names the field and the fix."""


def batch_bucket(batch_size: int, buckets=BATCH_BUCKETS) -> int:
    """The bucket whose plan a batch of ``batch_size`` requests uses: the largest bucket <= batch_size
    (3 -> 2, 40 -> 16)."""
    if batch_size < 1:
        raise ValueError(f"batch size {batch_size} must be >= 1")
    return max(b for b in buckets if b <= batch_size)


@dataclass(frozen=True)
class StepOverhead:
    """Time a step spends outside the profiled forwards, in target steps (one target token's time):
    ``fixed + per_request·B`` for a root-only step (``alone``) and for a step that grows a tree (``tree``), plus
    ``B·calls`` with ``calls`` = (alone, tree) the actor calls of one request's served step (0 in process): every
    request of a batch makes its own calls, and on a host whose cores the forwards keep busy their time adds up.
    """

    alone: tuple[float, float] = (0.0, 0.0)  # (fixed, per request)
    tree: tuple[float, float] = (0.0, 0.0)
    calls: tuple[float, float] = (0.0, 0.0)  # (a root-only step, a step with a tree), when served

    def of(self, batch: int, speculating: bool) -> float:
        fixed, per_request = self.tree if speculating else self.alone
        return fixed + (per_request + self.calls[int(speculating)]) * batch

    def to_dict(self) -> dict:
        return {"alone": list(self.alone), "tree": list(self.tree), "calls": list(self.calls)}

    @classmethod
    def from_dict(cls, obj: dict, *, source: str = "overhead") -> StepOverhead:
        try:
            pairs = {k: tuple(float(x) for x in obj.get(k, (0.0, 0.0))) for k in ("alone", "tree", "calls")}
        except (AttributeError, TypeError, ValueError) as exc:
            raise ProfileError(f"{source}: malformed overhead ({type(exc).__name__}: {exc})") from None
        if any(len(v) != 2 or not all(math.isfinite(x) and x >= 0 for x in v) for v in pairs.values()):
            raise ProfileError(f"{source}: overhead fields alone/tree/calls must be [fixed, per_request] seconds, "
                               "finite and >= 0")
        return cls(**pairs)


NO_OVERHEAD = StepOverhead()


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
    batch_t: dict[int, dict[int, float]] = field(default_factory=dict)  # B >= 2 -> total tokens B·n -> T_B
    batch_c: dict[int, dict[int, float]] = field(default_factory=dict)  # B >= 2 -> total level width -> C_B
    noise: float = math.nan  # median relative MAD of the timed repeats (nan: not measured)
    drift: float = math.nan  # the machine's speed change between timing rounds (round_drift; nan: not measured)

    def t_of(self, n: int) -> float:
        return _interpolate(self.t, n, "t(n)")

    def c_of(self, width: int) -> float:
        return _interpolate(self.c, width, "c(w)")

    def target_cost(self, batch: int, tokens: int) -> float:
        """T_B: one target forward over ``tokens`` tree tokens in total from ``batch`` requests, in target steps."""
        if batch == 1 or not self.batch_t:
            return self.t_of(tokens)
        return _batched(self._bucket(self.batch_t, batch, "batch_t"), self.t, tokens, f"T_{batch}(tokens)")

    def level_cost(self, batch: int, width: float) -> float:
        """C_B: one draft forward over a level ``width`` nodes wide across ``batch`` requests, in target steps."""
        if batch == 1 or not self.batch_c:
            return self.c_of(width)
        return _batched(self._bucket(self.batch_c, batch, "batch_c"), self.c, width, f"C_{batch}(width)")

    def draft_cost(self, plan: TreePlan, batch: int = 1, carried: float = 0.0) -> float:
        """Draft forwards for ``plan`` (in each of ``batch`` requests) in target steps: one per level, over
        that level's inner nodes; the first level also over the ``carried`` tokens a request brings from its
        last tree (``tree.plan.carried_leaf``: an accepted leaf, whose K/V the draft never made)."""
        return sum(self.level_cost(batch, batch * w) for w in draft_widths(plan, carried))

    def can_cost(self, plan: TreePlan, batch: int = 1, carried: float = 0.0) -> bool:
        """Whether ``step_cost`` can price ``plan`` for ``batch`` requests: its target forward within the
        profiled tokens and every draft level within the profiled widths. ``max_tokens(1)`` bounds the tree by t
        alone, and a tree of 256 nodes may have a level 66 nodes wide where c was profiled up to 64."""
        widest = max(draft_widths(plan, carried), default=0.0)
        return batch * plan.n <= self.max_tokens(batch) and batch * widest <= self.max_width(batch)

    def step_cost(self, plan: TreePlan, batch: int = 1, overhead: StepOverhead = NO_OVERHEAD,
                  carried: float = 0.0) -> float:
        """step(B, n, d): verify ``batch`` trees of ``plan`` in one target forward, grow them level by level
        (the first level with the ``carried`` tokens, see ``draft_cost``), plus the step's ``overhead``."""
        forwards = self.target_cost(batch, batch * plan.n) + self.draft_cost(plan, batch, carried)
        return forwards + overhead.of(batch, plan.n > 1)

    def max_tokens(self, batch: int) -> int:
        """The most tree tokens in total a batch of ``batch`` requests' target forward can be costed at: t's
        largest size, or beyond it the batch's own ``batch_t`` row's largest (``_batched``). Its draft levels are
        checked apart (``can_cost``, ``max_width``): this was capped at the draft's widest level too, so a batch
        of B could not plan a tree of more than 64 / B nodes (c profiled to 64, t to 256) however narrow its
        levels (B = 16: 4 nodes, where the model itself preferred 8 and predicted 6.7% more throughput)."""
        if batch == 1:
            return max(self.t)
        return max(max(self.t), max(self.batch_t.get(batch, {}), default=0))

    def max_width(self, batch: int) -> int:
        """The widest draft level in total (over ``batch`` requests) ``level_cost`` can price: c's largest width,
        or beyond it the batch's own ``batch_c`` row's largest (``_batched`` extrapolates only within c)."""
        if batch == 1 or not self.batch_c:
            return max(self.c)
        return max(max(self.c), max(self.batch_c.get(batch, {}), default=0))

    def buckets(self) -> tuple[int, ...]:
        """The batch buckets this profile can plan for (all of them, extrapolated, without batch tables)."""
        if not self.batch_t:
            return tuple(b for b in BATCH_BUCKETS if b <= max(self.t) and b <= max(self.c))
        return tuple(sorted({1} | (set(self.batch_t) & set(self.batch_c))))

    def _bucket(self, tables: dict[int, dict[int, float]], batch: int, name: str) -> dict[int, float]:
        if batch not in tables:
            raise ProfileError(f"{name}: batch {batch} not profiled (have {sorted(tables)}); use a profiled "
                               f"bucket or re-profile with it")
        return tables[batch]

    def to_dict(self) -> dict:
        out = asdict(self)
        for name in ("t", "c"):
            out[name] = {str(k): v for k, v in getattr(self, name).items()}
        for name in ("batch_t", "batch_c"):
            out[name] = {str(b): {str(k): v for k, v in row.items()} for b, row in getattr(self, name).items()}
        for name in ("noise", "drift"):
            out[name] = None if math.isnan(getattr(self, name)) else getattr(self, name)  # JSON has no NaN
        return {"schema_version": SCHEMA_VERSION, **out}

    @classmethod
    def from_dict(cls, obj: dict, *, source: str = "profile") -> HardwareProfile:
        if not isinstance(obj, dict) or obj.get("schema_version") != SCHEMA_VERSION:
            raise ProfileError(f"{source}: field 'schema_version' must be {SCHEMA_VERSION}")
        try:
            t = {int(k): float(v) for k, v in obj["t"].items()}
            c = {int(k): float(v) for k, v in obj["c"].items()}
            batch_t, batch_c = (_batch_tables(obj.get(name, {})) for name in ("batch_t", "batch_c"))
            prof = cls(str(obj["hardware_id"]), t, c, float(obj["target_step_s"]), int(obj["context"]),
                       str(obj["dtype"]), dict(obj.get("versions", {})), str(obj.get("timestamp", "")),
                       batch_t, batch_c, _optional_float(obj.get("noise")), _optional_float(obj.get("drift")))
        except (KeyError, TypeError, ValueError, AttributeError, ArithmeticError) as exc:
            raise ProfileError(f"{source}: malformed profile ({type(exc).__name__}: {str(exc)[:200]})") from None
        top = max(BATCH_BUCKETS)
        tables = [("t", t, MAX_PLAN_NODES), ("c", c, MAX_PLAN_NODES)] + [
            (f"{name}[{b}]", row, MAX_PLAN_NODES * top)
            for name, batches in (("batch_t", batch_t), ("batch_c", batch_c)) for b, row in batches.items()]
        for name, table, largest in tables:
            if not table or any(not 1 <= k <= largest or not math.isfinite(v) or v <= 0 for k, v in table.items()):
                raise ProfileError(f"{source}: field '{name}' must map sizes from 1 to {largest} to finite positive "
                                   "times")
        if 1 not in t or 1 not in c:  # below its smallest size a table is read flat: t(1) = 1 defines every ratio
            raise ProfileError(f"{source}: fields 't' and 'c' must hold size 1 (they hold {sorted(t)[:3]}..., "
                               f"{sorted(c)[:3]}...); re-profile")
        if any(not 2 <= b <= top for b in (*batch_t, *batch_c)):
            raise ProfileError(f"{source}: fields 'batch_t'/'batch_c' hold batches from 2 to {top} (batch 1 is 't'/'c')")
        if not (math.isfinite(prof.target_step_s) and prof.target_step_s > 0) or prof.context < 1:
            raise ProfileError(f"{source}: fields 'target_step_s' (finite, > 0) and 'context' (>= 1) are "
                               f"{prof.target_step_s!r}, {prof.context!r}")
        return prof

    def save(self, path: Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1))

    @classmethod
    def load(cls, path: Path) -> HardwareProfile:
        try:
            return cls.from_dict(json.loads(Path(path).read_text()), source=str(path))
        except json.JSONDecodeError as exc:
            raise ProfileError(f"{path}: not valid JSON ({exc})") from None


def _optional_float(x) -> float:
    return math.nan if x is None else float(x)


def check_noise(prof: HardwareProfile, bound: float) -> None:
    """ProfileError when ``prof``'s timings are noisier, or drifted more, than ``bound`` (a fraction, e.g. 0.1 = 10%),
    or their noise or drift is nan (not measured: nothing says they are within the bound), or a forward of x tokens
    costs more than x one-token forwards beyond the bound (``t`` or a batch row's T_B above x·(1 + bound)): x
    forwards of one token do the same work, so only load that came and went between the timings makes it so. Load
    from other processes can keep every repeat's MAD under the bound and still bend the tables: on the 2-core EPYC
    (session 65) a profile beside three busy processes had noise 24% and t(4) = 7.6, and its plans served the
    target alone (0.98x) until the store was cleared."""
    for name, value in (("noise", prof.noise), ("drift between rounds", prof.drift)):
        if math.isnan(value):
            raise ProfileError(f"profile of {prof.hardware_id}: timing {name} is nan (not measured: no size was "
                               "timed twice with a non-zero median; a profile made elsewhere may lack it), so nothing "
                               "bounds it; profile again with this version (it times every size in several rounds)")
        if value > bound:
            raise ProfileError(f"profile of {prof.hardware_id}: timing {name} {value:.0%} exceeds the bound {bound:.0%}; "
                               "profile again on a quieter machine (nothing else running) or raise the bound "
                               f"(--max-noise, the job config's max_noise; now {bound:g})")
    _check_linear(prof, bound)


def _check_linear(prof: HardwareProfile, bound: float) -> None:
    """``check_noise``'s bound on the tables: T(x) <= x·(1 + bound) target steps, for t and every batch row."""
    rows = [("t", prof.t)] + [(f"batch {b}'s T_{b}", row) for b, row in sorted(prof.batch_t.items())]
    for name, row in rows:
        for x, cost in sorted(row.items()):
            if cost > x * (1 + bound):
                raise ProfileError(
                    f"profile of {prof.hardware_id}: {name}({x}) = {cost:.3g}: a forward of {x} tokens timed at more "
                    f"than {x} one-token forwards (beyond the bound {bound:.0%}), which only load that came and went "
                    "between the timings does; profile again on a quieter machine (nothing else running) or raise the "
                    f"bound (--max-noise, the job config's max_noise; now {bound:g})")


def _batched(row: dict[int, float], one: dict[int, float], x: int, name: str) -> float:
    """A batch's time at ``x`` total tokens: interpolated in its own ``row``; beyond the row's largest total,
    the one-request curve ``one`` plus the batch's excess over it measured there (carried forward, never
    less than the row's largest time)."""
    top = max(row)
    if x <= top:
        return _interpolate(row, x, name)
    return max(row[top], _interpolate(one, x, name) + row[top] - _interpolate(one, top, name))


def _batch_tables(obj: dict) -> dict[int, dict[int, float]]:
    return {int(b): {int(k): float(v) for k, v in row.items()} for b, row in obj.items()}


def _interpolate(table: dict[int, float], x: int, name: str) -> float:
    keys = sorted(table)
    if x > keys[-1]:
        raise ProfileError(f"{name} at {x} > profiled max {keys[-1]}; re-profile with larger sizes")
    return float(np.interp(x, keys, [table[k] for k in keys]))


def draft_widths(plan: TreePlan, carried: float = 0.0) -> list[float]:
    """Per draft forward of one request's step on ``plan``, its width: a level's inner nodes, the first level's
    plus the ``carried`` tokens (see ``HardwareProfile.draft_cost``); levels without inner nodes make no forward
    (a root-only tree: none)."""
    inner = [sum(1 for node in level if plan.children[node]) for level in plan.levels]
    return [i + carried * (k == 0) for k, i in enumerate(inner) if i]


@dataclass(frozen=True)
class Choice:
    n: int
    d: int
    expected_tokens: float
    predicted_speedup: float  # over the target alone at the same batch size
    plan: TreePlan
    batch: int = 1  # the batch bucket B it was chosen for
    step_cost: float = math.nan  # step(B, n, d) in target steps (one target token's time)
    carried: float = 0.0  # tokens a request's first draft level carries from its last tree (carried_leaf)

    @property
    def throughput(self) -> float:
        """B·G(n, d) / step(B, n, d): the batch's tokens per target step."""
        return self.batch * self.expected_tokens / self.step_cost


def choose(table: DPTable, profile: HardwareProfile, budgets=DEFAULT_BUDGETS, batch: int = 1,
           overhead: StepOverhead = NO_OVERHEAD) -> tuple[Choice, list[Choice]]:
    """The (n, d) maximising the batch's throughput B·G(n, d) / step(B, n, d) for ``batch`` requests per step,
    the root-only tree (the target alone) included, and every candidate evaluated; every step pays
    ``overhead``. The predicted speedup is over that root-only tree at the same batch size; at batch 1 without
    overhead it is G(n, d) / (t(n) + draft cost). A tree the profile cannot price (a draft level wider than c
    was profiled at, ``can_cost``) is no candidate, as a budget beyond the profiled t is none."""
    candidates = []
    max_n = min(table.max_nodes, profile.max_tokens(batch) // batch)
    if max_n < 1:
        raise ProfileError(f"batch {batch} needs >= {batch} tokens profiled, the profile has "
                           f"{profile.max_tokens(batch)}; re-profile with larger sizes")
    alone = profile.step_cost(chain(0), batch, overhead)  # T_B(B) + O_alone(B); t(1) = 1 at batch 1
    for n in sorted({b for b in budgets if b <= max_n} | {1}):
        for d in range(1, table.max_depth + 1):
            plan = table.tree(n, d)
            carried = carried_leaf(plan, table.acceptance)
            if not profile.can_cost(plan, batch, carried):
                continue  # a draft level wider than profiled: pricing it would extrapolate c
            cost = profile.step_cost(plan, batch, overhead, carried)
            value = table.value(n, d)
            candidates.append(Choice(n, d, value, value * alone / cost, plan, batch, cost, carried))
    best = max(candidates, key=lambda c: (round(c.predicted_speedup, 12), -c.n, -c.d))
    return best, candidates


def choose_buckets(table: DPTable, profile: HardwareProfile, budgets=DEFAULT_BUDGETS,
                   overhead: StepOverhead = NO_OVERHEAD) -> dict[int, tuple[Choice, list[Choice]]]:
    """``choose`` for every batch bucket the profile can plan for."""
    return {b: choose(table, profile, budgets, batch=b, overhead=overhead) for b in profile.buckets()}


# ---- measuring -----------------------------------------------------------------------------------
def time_forward(model, sizes, *, context: int, repeats: int = 3, warmup: int = 1, seed: int = 0,
                 head_rows: int | None = None) -> dict[int, float]:
    """Seconds (``quiet``) to forward s new tokens after ``context`` cached ones, for each s in ``sizes``, with
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
        hidden = hidden_many(model, [Segment(session, inputs[s], positions[s])])[0]  # as a lone request is served
        session.head(hidden if head_rows is None else hidden[:head_rows])
        elapsed = _clock(device) - start
        session.truncate(context)
        return elapsed

    for _ in range(warmup):
        for s in sizes:
            step(s)
    rounds = [[step(s) for s in sizes] for _ in range(repeats)]  # round-robin: drift hits every size alike
    return {s: quiet(r[i] for r in rounds) for i, s in enumerate(sizes)}


def time_batched(model, batch: int, sizes, *, context: int, repeats: int = 3, warmup: int = 1, seed: int = 0,
                 layout: str = BATCH_LAYOUT) -> dict[int, float]:
    """Seconds (``quiet``) of one batched forward: ``batch`` requests, each with ``context`` cached tokens and s
    new ones, in one ``hidden_many`` call plus one LM head call over all batch·s rows (as a batched worker runs
    it), for each s in ``sizes``; keyed by the batch's total tokens batch·s."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    steps = batch_steps(model, batch, sizes, context=context, gen=gen, layout=layout)
    return round_robin(steps, repeats=repeats, warmup=warmup)


def batch_steps(model, batch: int, sizes, *, context: int, gen: torch.Generator, layout: str = BATCH_LAYOUT
                ) -> dict[int, Callable[[], float]]:
    """Per total tokens batch·s, a function timing one forward of ``batch`` requests with s new tokens each
    (see ``time_batched``); the sessions are built once, each call leaves them as it found them."""
    device = model.device
    sessions = _same_context(model, batch, context, gen)

    def step(s: int, tokens: torch.Tensor) -> float:  # tokens: [batch, s]
        positions = context + torch.arange(s, device=device)
        segments = [Segment(session, tokens[i], positions) for i, session in enumerate(sessions)]
        start = _clock(device)
        hidden = hidden_many(model, segments, layout)  # batch x [s, H]
        sessions[0].head(torch.cat(hidden))
        elapsed = _clock(device) - start
        for session in sessions:
            session.truncate(context)
        return elapsed

    vocab = model.config.vocab_size
    return {batch * s: functools.partial(step, s, torch.randint(0, vocab, (batch, s), generator=gen).to(device))
            for s in sizes}


def round_robin(steps: dict, *, repeats: int, warmup: int = 1) -> dict:
    """The ``quiet`` time of ``repeats`` calls of each timing function, called in turn (drift hits every one
    alike)."""
    return {k: quiet(v) for k, v in timed_rounds(steps, repeats=repeats, warmup=warmup).items()}


def quiet(samples) -> float:
    """What a forward costs, from its timed repeats: the fastest. Interference on a shared host only ever adds
    time, and on the 2-core Xeon VM it comes in phases of seconds that slow a forward up to 2.5x (t(1) timed 411,
    382 and 171 ms in one bounded profile; 145-166 ms in 10 of the 12 repeats of a longer one): a median of three
    takes such a phase for the machine. Two long profiles (12 repeats) of the real pair minutes apart, every
    table over its t(1): read by medians they differed by a mean 19-25% a cell, by fastest repeats 2.7-3.1%
    (``benchmarks/profile_estimators.py``, two runs, session 28)."""
    return min(samples)


def timed_rounds(steps: dict, *, repeats: int, warmup: int = 1, anchor=None, every: int = 0
                 ) -> dict[object, list[float]]:
    """Every one of ``repeats`` results of each timing function, the functions called in turn. With an
    ``anchor`` (a key of ``steps``) it is also called after every ``every`` functions of a round, its extra
    results listed after its ``repeats`` own (``round_drift`` reads the first ``repeats`` of every list)."""
    for _ in range(warmup):
        for f in steps.values():
            f()
    rounds, extra = [], []
    for _ in range(repeats):
        rounds.append({})
        for i, (k, f) in enumerate(steps.items(), 1):
            rounds[-1][k] = f()
            if anchor is not None and every and i % every == 0 and i < len(steps):
                extra.append(steps[anchor]())
    out = {k: [r[k] for r in rounds] for k in steps}
    if anchor is not None:
        out[anchor] += extra
    return out


def relative_noise(samples: dict[object, list[float]]) -> float:
    """The median, over everything timed, of its repeats' median absolute deviation over their median (nan
    with fewer than 2 repeats)."""
    spreads = [_mad(v) / statistics.median(v) for v in samples.values() if len(v) > 1 and statistics.median(v) > 0]
    return statistics.median(spreads) if spreads else math.nan


def round_drift(samples: dict[object, list[float]]) -> float:
    """How far the machine's speed moved between the rounds of a round-robin timing (nan with fewer than 2
    rounds): each round's factor is the median, over everything timed, of its time in that round over its
    median; the drift is the largest factor over the smallest, minus 1. A machine that slows down halfway
    through (a co-tenant on a shared host; session 21 saw a 2-core VM's forwards take 163 then 370 ms) gives
    sizes timed before the change their fast median and sizes after it their slow one: t(n) then jumps at
    whatever size the change hit, while the MAD of three repeats stays small."""
    rows = [v for v in samples.values() if len(v) > 1 and statistics.median(v) > 0]
    if not rows:
        return math.nan
    rounds = min(len(v) for v in rows)  # an anchor's extra results (``timed_rounds``) are in no round
    rows = [v[:rounds] for v in rows]
    mids = [statistics.median(v) for v in rows]
    factors = [statistics.median(v[i] / mid for v, mid in zip(rows, mids)) for i in range(len(rows[0]))]
    return max(factors) / min(factors) - 1


def _mad(values: list[float]) -> float:
    mid = statistics.median(values)
    return statistics.median(abs(v - mid) for v in values)


def time_steps(target, draft, plans: list[TreePlan], batch: int, *, context: int, repeats: int = 3,
               warmup: int = 1, seed: int = 0, layout: str = BATCH_LAYOUT) -> list[float]:
    """Seconds (``quiet``) of the forwards of one batched step on each of ``plans``, timed for real and round-robin
    (drift hits every plan alike): per level with inner nodes one draft ``hidden_many`` over the ``batch``
    requests' inner nodes (+ head), then one target ``hidden_many`` over their ``plan.n`` tree tokens each
    (+ one head call). What ``step_cost`` predicts; sampling and the verify walk are not in it. A root-only
    tree makes no draft call (``draft`` may be None when every plan is root-only)."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    targets = _same_context(target, batch, context, gen)
    drafts = _same_context(draft, batch, context, gen) if any(plan.n > 1 for plan in plans) else []

    def forward(sessions: list[KVSession], width: int) -> None:
        model, device = sessions[0].model, sessions[0].device
        tokens = torch.randint(0, model.config.vocab_size, (width,), generator=gen, device="cpu").to(device)
        positions = sessions[0].length + torch.arange(width, device=device)
        sessions[0].head(torch.cat(hidden_many(model, [Segment(s, tokens, positions) for s in sessions], layout)))

    def step(plan: TreePlan) -> float:
        inner = [sum(1 for node in level if plan.children[node]) for level in plan.levels]
        start = _clock(target.device)
        for width in (i for i in inner if i):
            forward(drafts, width)
        forward(targets, plan.n)
        elapsed = _clock(target.device) - start
        for session in targets + drafts:
            session.truncate(context)
        return elapsed

    for _ in range(warmup):
        for plan in plans:
            step(plan)
    rounds = [[step(plan) for plan in plans] for _ in range(repeats)]
    return [quiet(r[i] for r in rounds) for i in range(len(plans))]


def _same_context(model, batch: int, context: int, gen: torch.Generator) -> list[KVSession]:
    """``batch`` sessions holding the K/V of one random ``context``-token prefix (prefilled once, copied)."""
    device = model.device
    first = KVSession(model)
    prefix = torch.randint(0, model.config.vocab_size, (context,), generator=gen, device="cpu").to(device)
    first.hidden(prefix, torch.arange(context, device=device))
    sessions = [first]
    for _ in range(batch - 1):
        copy = KVSession(model)
        for dst, src in zip(copy.cache.layers, first.cache.layers):
            dst.update(src.keys.clone(), src.values.clone())
        sessions.append(copy)
    return sessions


def per_request_sizes(batch: int, sizes, max_total: int | None = None) -> tuple[int, ...]:
    """The per-request sizes s of ``sizes`` a batch of ``batch`` is timed at: batch·s <= ``max_total``, and 1
    always (the target alone batched, the root-only tree, is a candidate at every batch size); ``max_total``
    defaults to the largest size."""
    max_total = max(sizes) if max_total is None else max_total
    return tuple(s for s in sorted(set(sizes) | {1}) if s == 1 or batch * s <= max_total)


def _clock(device: torch.device) -> float:
    """``perf_counter`` after the queued work on ``device`` has finished."""
    synchronize(device)
    return time.perf_counter()


def profile(target, draft, *, hardware: str, budgets=DEFAULT_BUDGETS, widths=DRAFT_WIDTHS, context: int = 256,
            repeats: int = 5, dtype: str = "float32", time_target=None, batches=(),
            batch_total: int | None = None, max_drift: float = MAX_DRIFT, retries: int = 1) -> HardwareProfile:
    """t(n) and c(w) for a target and a draft model, and for each batch B >= 2 of ``batches`` the batched
    T_B and C_B at B·s total tokens for the sizes s of ``budgets`` with B·s <= ``batch_total`` (default: the
    largest size; s = 1 always). With the target in process (``target`` not None) every forward is timed in
    one round-robin loop, so a burst of load on a shared machine hits all sizes and batches alike instead of
    one table; else ``time_target(sizes, context, 1)`` times the target once a round (e.g. a whole
    tensor-parallel group, every rank in lockstep: ``_time_group``) and the profile has no batch tables. Either
    way the noise and drift are measured, and a timing whose rounds drift apart by more than ``max_drift`` is
    taken again, up to ``retries`` times, and the least drifting kept."""
    sizes = sorted(set(budgets) | {1})
    if target is None:
        time_all = functools.partial(_time_group, time_target, draft, sizes, widths, context=context, repeats=repeats)
    else:
        grid = {b: per_request_sizes(b, sizes, batch_total) for b in batches if b > 1}
        time_all = functools.partial(_time_all, target, draft, sizes, widths, context=context, repeats=repeats,
                                     grid=grid)
    rounds, drift = _calm_rounds(time_all, hardware, max_drift, retries)
    timed, noise = {k: quiet(v) for k, v in rounds.items()}, relative_noise(rounds)
    target_s, draft_s = ({k: v for (m, b, k), v in timed.items() if (m, b) == (name, 1)} for name in "tc")
    one = target_s[1]
    batch_t, batch_c = ({b: {k: v / one for (m, bb, k), v in timed.items() if (m, bb) == (name, b)}
                         for b in {b for (m, b, _) in timed if b > 1}} for name in "tc")
    return HardwareProfile(
        hardware_id=hardware, t={n: s / one for n, s in target_s.items()}, c={w: s / one for w, s in draft_s.items()},
        target_step_s=one, context=context, dtype=dtype, versions=library_versions(),
        timestamp=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"), batch_t=batch_t, batch_c=batch_c,
        noise=noise, drift=drift)


def _calm_rounds(time_all: Callable[[], dict], hardware: str, max_drift: float, retries: int
                 ) -> tuple[dict[object, list[float]], float]:
    """``time_all()``'s rounds and their drift; timed again while they drift more than ``max_drift`` (at most
    ``retries`` more times), the least drifting attempt kept."""
    best = None
    for attempt in range(1 + retries):
        rounds = time_all()
        drift = round_drift(rounds)
        if best is None or drift < best[1]:
            best = (rounds, drift)
        if not drift > max_drift:
            break
        logger.warning("profile of %s: the machine's speed moved %.0f%% between timing rounds (attempt %d of %d)%s",
                       hardware, 100 * drift, attempt + 1, 1 + retries, "; timing again" if attempt < retries else "")
    return best


def _time_all(target, draft, sizes, widths, *, context: int, repeats: int, grid: dict[int, tuple[int, ...]]
              ) -> dict[tuple[str, int, int], list[float]]:
    """Seconds (every repeat) per ("t" | "c", batch, total tokens): the target at ``sizes`` and the draft at
    ``widths`` alone (batch 1), both at every batch of ``grid`` (its per-request sizes), in one round-robin loop.
    t(1) is timed again after every ``ANCHOR_EVERY`` forwards (its extra repeats follow its own): every table is
    divided by it, so a slow phase of a shared host over its few repeats would skew them all (in one bounded
    profile of the 2-core Xeon all three took 331-375 ms where a quiet t(1) takes ~150, and every ratio came out
    ~0.45x); ~6 more forwards of one token a round, ~10% of a round."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    plan = [("t", target, 1, sizes), ("c", draft, 1, widths)]
    plan += [(name, model, b, per) for b, per in grid.items() for name, model in (("t", target), ("c", draft))]
    steps = {(name, b, k): f for name, model, b, per in plan
             for k, f in batch_steps(model, b, per, context=context, gen=gen).items()}
    return timed_rounds(steps, repeats=repeats, anchor=("t", 1, 1), every=ANCHOR_EVERY)


def _time_group(time_target: Callable, draft, sizes, widths, *, context: int, repeats: int
                ) -> dict[tuple[str, int, int], list[float]]:
    """``_time_all``'s rounds for a target timed elsewhere: each round one ``time_target(sizes, context, 1)`` (every
    size once, after its own warm-up) and the draft's widths once. Until it timed round by round, a group's
    profile held only its quiet times, noise and drift nan, and ``check_noise`` let any noise through."""
    rounds: dict[tuple[str, int, int], list[float]] = {}
    for _ in range(repeats):
        timed = {"t": time_target(sizes, context, 1), "c": time_forward(draft, widths, context=context, repeats=1)}
        for name, times in timed.items():
            for k, seconds in times.items():
                rounds.setdefault((name, 1, k), []).append(seconds)
    return rounds


def library_versions() -> dict[str, str]:
    import transformers

    return {"torch": torch.__version__, "transformers": transformers.__version__, "python": platform.python_version()}


SERVED_THREADS = 2  # the target's torch threads in the shipped Serve config, deployments/config.yaml (a test holds
# them equal): a CPU hardware id counts threads, and the service looks plans up under its own
# (``deployments.launch.serving_hardware_id``), so the profiling jobs default to it. A constant, not read from the
# Serve app: the core and the Tune job import no Serve code.


@contextlib.contextmanager
def torch_threads(threads: int | None):
    """torch's thread count set to ``threads`` for a block (None: left as it is), then put back: timings taken
    at the threads the served target will run with (its hardware id counts them)."""
    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def hardware_id(accelerator: str | None = None, tp_size: int = 1, threads: int | None = None,
                cpu: str | None = None) -> str:
    """``<accelerator>-tp<N>`` on a GPU (e.g. ``H100-tp2``), ``cpu-<cpu>-<threads>c[-tp<N>]`` on CPU, with
    ``cpu`` this machine's ``cpu_name()`` unless given (e.g. ``cpu-AMD-EPYC-avx2-2c``). Pass the ``cpu_name()``
    of the machine the target runs on when computing the id elsewhere."""
    suffix = f"-tp{tp_size}" if tp_size > 1 else ""
    if accelerator:
        return f"{accelerator}{suffix}"
    return f"cpu-{cpu or cpu_name()}-{threads or torch.get_num_threads()}c{suffix}"


def cpu_name() -> str:
    """The CPU part of a CPU hardware id: the model name and the vector instructions torch's kernels use here,
    with ``bf16`` where oneDNN has bf16 kernels (``AMD-EPYC-avx512bf16``, ``AMD-EPYC-avx2``). The model name
    alone is not enough: two EPYCs of one name, one with AVX-512 bf16 and one with AVX2 only, run a bf16
    target's 16-token forward at 7x different costs relative to one token, so each needs its own plans."""
    isa = torch.backends.cpu.get_cpu_capability().lower().replace(" ", "")
    if torch.ops.mkldnn._is_mkldnn_bf16_supported():
        isa += "bf16"
    return f"{_cpu_model()}-{isa}"


def accelerator_name(device: torch.device) -> str | None:
    """The GPU's type as a hardware-id part (``A100``) for a CUDA device, else None; call it where the device is
    visible (in the actor that owns it). The type is Ray's name for it (``gpu_type``), so serving, ``sequoia-ray
    profile`` and the Ray Tune job (which names a GPU type by its node's ``accelerator_type:A100`` resource) file
    one GPU's plans under one hardware id."""
    if device.type != "cuda":
        return None
    return gpu_type(torch.cuda.get_device_name(device))


_UPPER_WORD = re.compile(r"[A-Z]+")
_MODEL_TOKEN = re.compile(r"[A-Z0-9]*[0-9][A-Z0-9]*")
ID_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")  # characters a hardware id (a plan store folder) may not hold


def gpu_type(device_name: str) -> str:
    """The GPU type Ray labels a node with (its ``accelerator_type:<type>`` resource) for an NVIDIA device name:
    after the vendor word, the all-capital words and the model number that follow, hyphen-joined, cut at the
    first other character (``NVIDIA A100-SXM4-80GB`` -> ``A100``, ``Tesla V100-SXM2-16GB`` -> ``V100``,
    ``NVIDIA RTX PRO 6000 Blackwell`` -> ``RTX-PRO-6000``); a name without such a model number (``NVIDIA GeForce
    RTX 4090``) is the name without ``NVIDIA``, hyphen-joined. A100 40 GB and 80 GB share ``A100``, as in Ray.
    Characters a hardware id may not hold (the plan store's folder names) become ``-``: ``AMD Instinct
    MI250X/MI250`` -> ``AMD-Instinct-MI250X-MI250``, where the ``/`` made ``PlanKey.folder`` refuse the id."""
    words = device_name.split()
    lead, rest = [], words[1:]
    while rest and _UPPER_WORD.fullmatch(rest[0]):
        lead.append(rest.pop(0))
    model = _MODEL_TOKEN.match(rest[0]) if rest else None
    if model and len(name := "-".join([*lead, model.group()])) > 1:
        return name
    name = ID_UNSAFE.sub("-", "-".join(words[1:] if words[:1] == ["NVIDIA"] else words))
    return name if name.strip(".") else "unknown-gpu"  # "", "." and ".." name no folder


# Arm cores by (CPU implementer, CPU part) of /proc/cpuinfo, which names no model on aarch64
ARM_CORES = {("0x41", "0xd08"): "Cortex-A72", ("0x41", "0xd0b"): "Cortex-A76", ("0x41", "0xd0c"): "Neoverse-N1",
             ("0x41", "0xd40"): "Neoverse-V1", ("0x41", "0xd49"): "Neoverse-N2", ("0x41", "0xd4f"): "Neoverse-V2",
             ("0x41", "0xd8e"): "Neoverse-N3", ("0x41", "0xd84"): "Neoverse-V3", ("0xc0", "0xac3"): "AmpereOne"}


def _cpu_model(cpuinfo: str | None = None) -> str:
    """The CPU's model name from ``cpuinfo`` (default: /proc/cpuinfo's text). An Arm Linux names none there: every
    Arm CPU was ``aarch64`` (with torch's capability the same ``default`` on a Graviton2, an Ampere Altra and a
    Graviton4), so one's plans were served on the others; its core is named by its implementer and part codes
    (``Neoverse-N1``; an unknown one ``arm-0x41-0xd99``)."""
    name = platform.processor() or platform.machine()
    try:
        text = Path("/proc/cpuinfo").read_text() if cpuinfo is None else cpuinfo
    except OSError:
        text = ""
    fields: dict[str, str] = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    if fields.get("model name"):
        name = fields["model name"]
    elif "CPU part" in fields:
        codes = (fields.get("CPU implementer", "").lower(), fields["CPU part"].lower())
        name = ARM_CORES.get(codes) or "arm-" + "-".join(codes)
    keep = "".join(ch if ch.isalnum() else "-" for ch in name.strip())
    return "-".join(part for part in keep.split("-") if part)[:48] or "unknown"
