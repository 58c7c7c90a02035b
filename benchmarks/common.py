"""Shared helpers for the benchmarks: a printed table and a JSON record (timing: sequoia_ray.hardware)."""

from __future__ import annotations

import json
import platform
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
