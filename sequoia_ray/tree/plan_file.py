"""Planned trees as versioned JSON: the tree, what it was built from, and where it applies.

A plan file is data, never code: it is parsed as JSON and every field is validated on load, so a
truncated, foreign or tampered file gives an error naming the file and the field, never a wrong tree.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sequoia_ray.tree.acceptance_vector import AcceptanceError, AcceptanceVector
from sequoia_ray.tree.dp import table_bytes
from sequoia_ray.tree.plan import MAX_PLAN_DEPTH, MAX_PLAN_NODES, PlanError, TreePlan, expected_tokens

SCHEMA_VERSION = 1
KIND = "sequoia-ray/tree-plan"
F_TOLERANCE = 1e-9
MAX_DP_BYTES = 4 * 10**9  # the DP tables a plan may need (dp.table_bytes); the project's own sizes need
# at most ~0.55 GB (1,024 nodes, 64 ranks, unbounded depth), a 128 x 1,024 vector at 1,024 nodes and 128
# levels would need 137 GB


class PlanFormatError(ValueError):
    """A plan file that cannot be trusted; the message names the file and the field."""


BUILTIN_ACCEPTANCE = "builtin-acceptance"  # Provenance.source of a plan whose p was not measured
ACCEPTANCE_FILE = "acceptance-file"  # Provenance.source of a plan whose p was given (--acceptance T=FILE), not measured


@dataclass(frozen=True)
class Provenance:
    """Where a plan applies and what it was measured with. Every field is optional (None = not recorded),
    so files written before a field existed still load; the serving configuration fields (dtype through
    threads) say what the acceptance vector and the profile were measured with, which is what the plan
    is only right for."""

    draft: str | None = None
    target: str | None = None
    temperature: float | None = None
    hardware: str | None = None
    dtype: str | None = None  # float32 | bfloat16 | float16
    draft_quantize: str | None = None  # e.g. int8; None = not quantised (or not recorded)
    device: str | None = None  # where the models ran (e.g. cpu, cuda:0)
    linears: str | None = None  # packed | aten: the target's Linear kernels (sequoia_ray.models.packed_linear)
    layers: str | None = None  # traced | eager: whether the layers ran traced (sequoia_ray.models.traced_layers)
    draft_vocab: int | None = None  # ids kept in the draft's LM head (sequoia_ray.models.draft_vocab); None = all
    threads: int | None = None  # the target's torch threads
    time_budget_s: float | None = None  # a bounded profile's time budget; None = unbounded
    prompts: int | None = None  # prompts the acceptance vector was measured on
    tokens_measured: int | None = None  # tokens asked for while measuring it (a prompt may end sooner at EOS)
    batch: int | None = None  # the batch-size bucket the plan was chosen for; None = 1 (never written for 1)
    predicted_speedup: float | None = None  # over the target alone at the batch size, by the cost model
    measured_speedup: float | None = None  # the same, run for real (the measured choice)
    candidates: list[dict] | None = None  # every tree measured: n, d, predicted and measured speedup, ...
    overhead: dict | None = None  # the cost model's per-step overhead (hardware.StepOverhead.to_dict())
    source: str | None = None  # how the plan was made: "live" = re-planned from live traffic; BUILTIN_ACCEPTANCE =
    # this machine's profile with the built-in acceptance vector (a bounded profile had no time to measure p);
    # ACCEPTANCE_FILE = with the acceptance vector the job was given (prompts and tokens_measured 0); None = profiled
    live_samples: int | None = None  # inner-node observations behind a live plan's acceptance vector


@dataclass(frozen=True)
class PlannedTree:
    plan: TreePlan
    acceptance: AcceptanceVector
    budget: int  # the node budget n the plan was chosen for (plan.n <= budget)
    max_depth: int | None  # the level limit d (root included); None = unbounded
    expected_tokens: float  # G(n, d) = F(plan) under ``acceptance``
    provenance: Provenance = field(default_factory=Provenance)

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema_version": SCHEMA_VERSION,
            "kind": KIND,
            "expected_tokens": self.expected_tokens,
            "budget": self.budget,
            "max_depth": self.max_depth,
            "depth": self.plan.num_levels,
            "nodes": self.plan.n,
            "parents": list(self.plan.parents),
            "acceptance": self.acceptance.to_dict(),
            "provenance": {k: v for k, v in vars(self.provenance).items() if v is not None},
        }

    def dumps(self) -> str:
        return json.dumps(self.to_dict(), indent=1)

    def save(self, path: Path) -> None:
        path = Path(path)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(self.dumps())
        tmp.replace(path)

    @classmethod
    def from_dict(cls, obj: Any, *, source: str = "plan") -> PlannedTree:
        return _parse(obj, source)

    @classmethod
    def loads(cls, text: str | bytes, *, source: str = "plan") -> PlannedTree:
        try:
            obj = json.loads(text)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise PlanFormatError(f"{source}: not valid JSON (truncated or corrupt?): {exc}") from None
        except RecursionError:
            raise PlanFormatError(f"{source}: JSON nested too deeply to be a plan") from None
        return _parse(obj, source)

    @classmethod
    def load(cls, path: Path) -> PlannedTree:
        try:
            data = Path(path).read_bytes()
        except OSError as exc:
            raise PlanFormatError(f"{path}: cannot read plan file ({exc.strerror})") from None
        return cls.loads(data, source=str(path))


def _parse(obj: Any, source: str) -> PlannedTree:
    def bad(name: str, why: str) -> PlanFormatError:
        return PlanFormatError(f"{source}: field '{name}': {why}")

    if not isinstance(obj, dict):
        raise PlanFormatError(f"{source}: expected a JSON object, got {type(obj).__name__}")
    if obj.get("schema_version") != SCHEMA_VERSION:
        raise bad("schema_version", f"{obj.get('schema_version')!r} is not {SCHEMA_VERSION}; re-create the plan")
    if obj.get("kind", KIND) != KIND:
        raise bad("kind", f"{obj.get('kind')!r} is not {KIND!r}")
    parents = obj.get("parents")
    if isinstance(parents, list) and len(parents) > MAX_PLAN_NODES:
        raise bad("parents", f"{len(parents)} nodes; a plan holds at most {MAX_PLAN_NODES}")
    try:
        plan = TreePlan(tuple(_int_list(parents)))
    except (PlanError, TypeError) as exc:
        raise bad("parents", str(exc)) from None
    for name, actual in (("nodes", plan.n), ("depth", plan.num_levels)):  # written for readers: said right
        if name in obj and not (type(obj[name]) is int and obj[name] == actual):
            raise bad(name, f"{obj[name]!r} but the tree's parents give {actual}; re-create the plan")
    _check_acceptance_size(obj.get("acceptance"), bad)
    try:
        acceptance = AcceptanceVector.from_dict(obj.get("acceptance"), source="acceptance")
    except AcceptanceError as exc:
        raise bad("acceptance", str(exc)) from None
    budget = _int_field(obj, "budget", bad, minimum=plan.n, maximum=MAX_PLAN_NODES)
    max_depth = obj.get("max_depth")
    if max_depth is not None:
        max_depth = _int_field(obj, "max_depth", bad, minimum=plan.num_levels, maximum=MAX_PLAN_DEPTH)
    _check_dp_memory(budget, max_depth, acceptance, bad)
    value = obj.get("expected_tokens")
    if not isinstance(value, (int, float)) or not math.isfinite(value):
        raise bad("expected_tokens", f"{value!r} must be a finite number")
    actual = expected_tokens(plan, acceptance)
    if abs(actual - value) > F_TOLERANCE * max(1.0, actual):
        raise bad("expected_tokens", f"{value!r} but the tree is worth {actual!r} under its acceptance vector")
    return PlannedTree(plan, acceptance, budget, max_depth, float(value), _provenance(obj.get("provenance"), bad))


def check_plan_size(budget: int, max_depth: int | None, acceptance: AcceptanceVector) -> None:
    """Refuse, before solving, a plan whose file ``load`` would refuse: a budget, a depth or an acceptance vector
    past what a plan file holds, or together past the DP's memory limit (the checks ``_parse`` makes).
    PlanFormatError naming the value and the limit."""
    def bad(name: str, why: str) -> PlanFormatError:
        return PlanFormatError(f"{name} {why} (the most a plan file holds)")

    _int_field({"budget": budget}, "budget", bad, minimum=1, maximum=MAX_PLAN_NODES)
    if max_depth is not None:
        _int_field({"max_depth": max_depth}, "max_depth", bad, minimum=1, maximum=MAX_PLAN_DEPTH)
    _check_acceptance_size(acceptance.to_dict(), bad)
    _check_dp_memory(budget, max_depth, acceptance, lambda name, why: PlanFormatError(f"{name} {why}"))


def _check_dp_memory(budget: int, max_depth: int | None, acceptance: AcceptanceVector, bad) -> None:
    """Each limit alone is not enough: the DP keeps a [ranks, budget] table per (row, level), so 128 rows of
    1,024 ranks at budget 1,024 and 128 levels passed every limit and then needed 137 GB (dp.table_bytes)."""
    need = table_bytes(acceptance, budget, max_depth)
    if need > MAX_DP_BYTES:
        depth = f"unbounded (up to {budget} levels)" if max_depth is None else max_depth
        raise bad("acceptance", f"{len(acceptance.rows)} rows x {acceptance.width} ranks at budget {budget} and "
                                f"max_depth {depth} need ~{need / 1e9:.1f} GB of DP tables, over the "
                                f"{MAX_DP_BYTES / 1e9:.0f} GB limit: give fewer rows, a smaller max_depth or budget, "
                                "or cut the ranks")


def _check_acceptance_size(acceptance: Any, bad) -> None:
    """At most MAX_PLAN_NODES ranks and MAX_PLAN_DEPTH rows: no plan can use more (a node has fewer children than
    a plan has nodes; row j is for the children of depth-j nodes), and serving runs the DP and the live estimate
    on a stored file's vector, whose cost grows with both (6,000 ranks at 256 nodes: 2 s, 141 MB)."""
    p = acceptance.get("p") if isinstance(acceptance, dict) else None
    if not isinstance(p, list):
        return  # AcceptanceVector.from_dict names what is wrong
    rows = p if p and isinstance(p[0], list) else [p]
    width = max(len(row) if isinstance(row, list) else 0 for row in rows) if rows else 0
    if len(rows) > MAX_PLAN_DEPTH or width > MAX_PLAN_NODES:
        raise bad("acceptance", f"{len(rows)} rows of up to {width} ranks; a plan uses at most {MAX_PLAN_DEPTH} rows "
                                f"of {MAX_PLAN_NODES} ranks: cut the vector (the ranks and rows past those are "
                                "never used)")


def _int_list(x: Any) -> list[int]:
    if not isinstance(x, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in x):
        raise TypeError(f"must be a list of integers, got {x!r:.80}")
    return x


def _int_field(obj: dict, name: str, bad, *, minimum: int, maximum: int) -> int:
    v = obj.get(name)
    if not isinstance(v, int) or isinstance(v, bool) or not minimum <= v <= maximum:
        raise bad(name, f"{v!r:.40} must be an integer from {minimum} to {maximum}")
    return v


def _provenance(obj: Any, bad) -> Provenance:
    if obj is None:
        return Provenance()
    if not isinstance(obj, dict) or set(obj) - set(Provenance.__dataclass_fields__):
        raise bad("provenance", f"{obj!r:.80} must be an object with keys {sorted(Provenance.__dataclass_fields__)}")
    temp = obj.get("temperature")
    if temp is not None and (not isinstance(temp, (int, float)) or not math.isfinite(temp) or temp < 0):
        raise bad("provenance.temperature", f"{temp!r} must be a finite number >= 0")
    for key in ("draft", "target", "hardware", "dtype", "draft_quantize", "device", "linears", "layers", "source"):
        if obj.get(key) is not None and not isinstance(obj[key], str):
            raise bad(f"provenance.{key}", f"{obj[key]!r} must be a string")
    for key, least in (("threads", 0), ("prompts", 0), ("tokens_measured", 0), ("batch", 1), ("live_samples", 0),
                       ("draft_vocab", 1)):
        v = obj.get(key)
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < least):
            raise bad(f"provenance.{key}", f"{v!r} must be an integer >= {least}")
    budget = obj.get("time_budget_s")
    if budget is not None and (not isinstance(budget, (int, float)) or not math.isfinite(budget) or budget <= 0):
        raise bad("provenance.time_budget_s", f"{budget!r} must be a finite number > 0")
    for key in ("predicted_speedup", "measured_speedup"):
        v = obj.get(key)
        if v is not None and (not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or v <= 0):
            raise bad(f"provenance.{key}", f"{v!r} must be a finite number > 0")
    _check_records(obj.get("candidates"), bad)
    _check_overhead(obj.get("overhead"), bad)
    return Provenance(**obj)


def _check_records(records: Any, bad) -> None:
    if records is None:
        return
    if not isinstance(records, list) or not all(isinstance(r, dict) for r in records):
        raise bad("provenance.candidates", f"{records!r:.80} must be a list of objects")
    for r in records:
        if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in r.values()):
            raise bad("provenance.candidates", f"{r!r:.80} must map names to numbers")


def _check_overhead(overhead: Any, bad) -> None:
    if overhead is None:
        return
    ok = isinstance(overhead, dict) and all(
        isinstance(v, list) and len(v) == 2
        and all(isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x >= 0 for x in v)
        for v in overhead.values())
    if not ok:
        raise bad("provenance.overhead", f"{overhead!r:.80} must map alone/tree/calls to [fixed, per_request] "
                                         "seconds, finite and >= 0")
