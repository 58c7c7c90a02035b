"""Shared helpers for the benchmarks: a printed table, a JSON record, the order and medians of rounds (timing:
sequoia_ray.hardware)."""

from __future__ import annotations

import json
import platform
import statistics
import sys
from pathlib import Path

RESULTS = Path(__file__).parent / "results"


def print_table(rows: list[dict], columns: list[str]) -> None:
    widths = [max(len(c), *(len(_fmt(r.get(c))) for r in rows)) for c in columns]
    print("  ".join(c.rjust(w) for c, w in zip(columns, widths)))
    for r in rows:
        print("  ".join(_fmt(r.get(c)).rjust(w) for c, w in zip(columns, widths)))


def _fmt(x: object) -> str:
    return f"{x:.4g}" if isinstance(x, float) else str(x)


def hardware() -> str:
    """The hardware id plans are keyed by (``sequoia_ray.hardware.hardware_id``: CPU model, the vector
    instructions torch uses, threads), so results from different machines tell which ran them; where torch is
    not loaded (a vLLM child in its own venv), ``platform.processor()``, which may be empty."""
    if "torch" in sys.modules:
        try:
            from sequoia_ray.hardware import hardware_id
        except ImportError:  # another venv's torch
            pass
        else:
            return hardware_id()
    return platform.processor()


def write_json(name: str, payload: dict, out: Path | None = None) -> Path:
    out = out or RESULTS / f"{name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    payload = {"benchmark": name, "machine": platform.platform(), "hardware": hardware(), **payload}
    out.write_text(json.dumps(payload, indent=1))
    print(f"wrote {out}")
    return out


def quartiles(values: list[float], method: str = "inclusive") -> tuple[float, float, float]:
    """(q1, median, q3) of ``values`` (``statistics.quantiles``' ``method``); one value is all three:
    ``statistics.quantiles`` needs two, and ``--rounds 1`` gives one. Inclusive: the quartiles of the rounds
    measured, within them (``exclusive`` estimates a population's, beyond the data for few rounds: [1, 2] gave
    0.75 and 2.25)."""
    if len(values) < 2:
        return (values[0],) * 3
    q1, median, q3 = statistics.quantiles(values, n=4, method=method)
    return q1, median, q3


def rotated(items: list, by: int) -> list:
    """``items`` rotated left by ``by``: the order of round ``by`` when cases run one after another, so that no
    case always runs first, or always right after the same one, and a drift of the host's speed within a
    round lands on every case in turn."""
    by %= len(items)
    return items[by:] + items[:by]


def round_medians(runs: dict[str, list[dict]], label: str, base: str, ratios: dict[str, str]) -> list[dict]:
    """A row per case of ``runs`` (case -> its figures, one dict a round): the case under ``label``, the median
    over the rounds of each numeric figure, and for each ``ratios`` item (column -> figure) the paired ratio:
    the median over the rounds of the case's figure over ``base``'s in the same round (None where ``base``'s
    is 0 in every round). Each round's ratio cancels the host's drift between rounds, which a ratio of the
    medians would keep."""
    rows = []
    for name, done in runs.items():
        row = {label: name} | {k: statistics.median(r[k] for r in done) for k, v in done[0].items()
                               if isinstance(v, (int, float)) and not isinstance(v, bool)}
        for column, key in ratios.items():
            paired = [r[key] / b[key] for r, b in zip(done, runs[base]) if b[key]]
            row[column] = statistics.median(paired) if paired else None
        rows.append(row)
    return rows
