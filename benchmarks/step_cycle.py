"""Where a served step's time goes: the draft's and the target's batch traces (``Batcher.trace``, one clock for
every process of a host) over one load window, split into the time only the target computed, only the draft,
both at once (two forwards sharing the cores), and neither (the calls between them: the ingress's walk, Ray's
round trips, a batch gathering its calls). ``benchmarks/load_sweep.py`` prints it per served cell.
"""

from __future__ import annotations

from statistics import median

from sequoia_ray.batching import Forward


def _clipped(forwards: list[Forward], start: float, end: float) -> list[tuple[float, float]]:
    """The forwards' intervals within [start, end), merged where they overlap, in order."""
    spans = sorted((max(f.start, start), min(f.end, end)) for f in forwards if f.end > start and f.start < end)
    merged: list[list[float]] = []
    for a, b in spans:
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return [(a, b) for a, b in merged]


def _length(spans: list[tuple[float, float]]) -> float:
    return sum(b - a for a, b in spans)


def _overlap(x: list[tuple[float, float]], y: list[tuple[float, float]]) -> float:
    """Total length of the intersection of two sorted, disjoint interval lists."""
    i = j = 0
    total = 0.0
    while i < len(x) and j < len(y):
        total += max(0.0, min(x[i][1], y[j][1]) - max(x[i][0], y[j][0]))
        if x[i][1] < y[j][1]:
            i += 1
        else:
            j += 1
    return total


def _ms(values: list[float]) -> float | None:
    return round(1000 * median(values), 1) if values else None


def _kind(forwards: list[Forward]) -> dict:
    """Forwards, median ms, mean requests and tokens (a forward's first: catch-up, prefill chunks, the tree's
    root level or nodes) and median gathering ms (from its first call queued to its start)."""
    return {"forwards": len(forwards), "median ms": _ms([f.end - f.start for f in forwards]),
            "requests": round(sum(f.calls for f in forwards) / len(forwards), 2) if forwards else None,
            "tokens": round(sum(f.tokens for f in forwards) / len(forwards), 2) if forwards else None,
            "gather ms": _ms([f.start - f.queued for f in forwards])}


def cycle(target: list[Forward], draft: list[Forward], start: float, end: float) -> dict:
    """The window [start, end) split four ways (shares of it: ``target only``, ``draft only``, ``both``,
    ``neither``), the target's forwards with a tree in them and without, the draft's, and the target's median
    idle gap after a forward with trees (the draft's level and every call in between) and after one without."""
    if end <= start:
        raise ValueError(f"the window [{start}, {end}) is empty; end must be after start")
    wall = end - start
    t, d = _clipped(target, start, end), _clipped(draft, start, end)
    both = _overlap(t, d)
    shares = {"target only": (_length(t) - both) / wall, "draft only": (_length(d) - both) / wall,
              "both": both / wall, "neither": (wall - _length(t) - _length(d) + both) / wall}
    inside = sorted((f for f in target if start <= f.start and f.end <= end), key=lambda f: f.start)
    gaps: dict[bool, list[float]] = {True: [], False: []}
    for before, after in zip(inside, inside[1:]):
        gaps[before.trees > 0].append(after.start - before.end)
    return {"wall s": round(wall, 3), **{k: round(v, 4) for k, v in shares.items()},
            "target with trees": _kind([f for f in inside if f.trees]),
            "target alone": _kind([f for f in inside if not f.trees]),
            "draft": _kind([f for f in draft if start <= f.start and f.end <= end]),
            "gap after trees ms": _ms(gaps[True]), "gap after alone ms": _ms(gaps[False])}


def trace_rows(forwards: list[Forward], start: float) -> list[list]:
    """Each forward as ``[method, start s after start, ms, requests, trees, tokens, gather ms]`` (for the JSON)."""
    return [[f.method, round(f.start - start, 4), round(1000 * (f.end - f.start), 1), f.calls, f.trees, f.tokens,
             round(1000 * (f.start - f.queued), 1)] for f in forwards]
