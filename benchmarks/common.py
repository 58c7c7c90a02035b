"""Shared helpers for the benchmarks: a printed table and a JSON record (timing: sequoia_ray.hardware)."""

from __future__ import annotations

import json
import platform
from pathlib import Path

RESULTS = Path(__file__).parent / "results"


def print_table(rows: list[dict], columns: list[str]) -> None:
    widths = [max(len(c), *(len(_fmt(r.get(c))) for r in rows)) for c in columns]
    print("  ".join(c.rjust(w) for c, w in zip(columns, widths)))
    for r in rows:
        print("  ".join(_fmt(r.get(c)).rjust(w) for c, w in zip(columns, widths)))


def _fmt(x: object) -> str:
    return f"{x:.4g}" if isinstance(x, float) else str(x)


def write_json(name: str, payload: dict, out: Path | None = None) -> Path:
    out = out or RESULTS / f"{name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    payload = {"benchmark": name, "machine": platform.platform(), "processor": platform.processor(), **payload}
    out.write_text(json.dumps(payload, indent=1))
    print(f"wrote {out}")
    return out
