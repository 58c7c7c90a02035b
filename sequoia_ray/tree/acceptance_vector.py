"""The acceptance vector p[1..W] (optionally one per tree depth), with its reject mass explicit.

p[k] is the probability that the k-th child drawn (without replacement) at a node is the one the
verifier accepts; ``reject = 1 - sum(p)`` is the chance that every child is rejected. A depth-indexed
vector has one row per depth of the *parent*: row j applies to the children of nodes at depth j (the root
is at depth 0); the last row applies to every deeper level.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SUM_TOLERANCE = 1e-6


class AcceptanceError(ValueError):
    """An acceptance vector that cannot be used; the message names the value and the fix."""


@dataclass(frozen=True)
class AcceptanceVector:
    rows: tuple[tuple[float, ...], ...]  # [depth][k-1] -> p[k]; all rows have the same width W
    reject: tuple[float, ...]  # [depth] -> 1 - sum(rows[depth])

    def __post_init__(self) -> None:
        if not self.rows:
            raise AcceptanceError("acceptance vector has no rows; give at least one p value")
        if len(self.reject) != len(self.rows):
            raise AcceptanceError(f"{len(self.rows)} rows but {len(self.reject)} reject values")
        widths = {len(r) for r in self.rows}
        if len(widths) != 1 or 0 in widths:
            raise AcceptanceError(f"rows must be non-empty and of one width, got widths {sorted(widths)}")
        for j, (row, rej) in enumerate(zip(self.rows, self.reject)):
            _check_row(row, rej, where=f"row {j}" if len(self.rows) > 1 else "p")

    @property
    def width(self) -> int:
        return len(self.rows[0])

    @property
    def depth_indexed(self) -> bool:
        return len(self.rows) > 1

    def row(self, depth: int) -> tuple[float, ...]:
        """The p vector for the children of a node at ``depth`` (root = 0)."""
        return self.rows[min(depth, len(self.rows) - 1)]

    # ---- constructors -------------------------------------------------------------------------
    @classmethod
    def from_p(cls, p: list[float] | tuple[float, ...], reject: float | None = None) -> AcceptanceVector:
        """One row; ``reject`` defaults to 1 - sum(p) (clipped at 0 for float round-off)."""
        return cls.from_rows([p], None if reject is None else [reject])

    @classmethod
    def from_rows(cls, rows: list[list[float]] | list[tuple[float, ...]], reject: list[float] | None = None) -> AcceptanceVector:
        width = max((len(r) for r in rows), default=0)
        padded = tuple(tuple(float(x) for x in r) + (0.0,) * (width - len(r)) for r in rows)
        if reject is None:
            reject = [_implied_reject(r) for r in padded]
        return cls(rows=padded, reject=tuple(float(x) for x in reject))

    @classmethod
    def from_dict(cls, obj: Any, *, source: str = "acceptance") -> AcceptanceVector:
        """Read ``{"p": [...], "reject": r}`` or the depth-indexed ``{"p": [[...], ...], "reject": [...]}``."""
        if not isinstance(obj, dict) or "p" not in obj:
            raise AcceptanceError(f"{source}: expected an object with a 'p' list, got {type(obj).__name__}")
        p, reject = obj["p"], obj.get("reject")
        if not isinstance(p, list) or not p:
            raise AcceptanceError(f"{source}: field 'p' must be a non-empty list, got {p!r:.80}")
        for name, value in (("p", p), ("reject", reject)):
            items = value if isinstance(value, list) else [value]
            flat = [x for v in items for x in (v if isinstance(v, list) else [v])]
            if any(isinstance(x, (bool, str)) for x in flat):  # float() reads true as 1.0 and "0.5" as 0.5
                raise AcceptanceError(f"{source}: field '{name}' must hold numbers, got {value!r:.80}")
        try:
            if isinstance(p[0], list):
                return cls.from_rows(p, reject if reject is None else list(reject))
            return cls.from_p(p, reject)
        except (TypeError, ValueError) as exc:
            raise AcceptanceError(f"{source}: {exc}") from None

    def to_dict(self) -> dict[str, Any]:
        if self.depth_indexed:
            return {"p": [list(r) for r in self.rows], "reject": list(self.reject)}
        return {"p": list(self.rows[0]), "reject": self.reject[0]}

    @classmethod
    def parse(cls, text: str) -> AcceptanceVector:
        """A comma-separated list ``0.6,0.2,0.1`` (any length: text that reads as numbers is a list), else a
        JSON file path (``{"p": [...], "reject": r}``)."""
        return cls.parse_recorded(text)[0]

    @classmethod
    def parse_recorded(cls, text: str) -> tuple[AcceptanceVector, float | None]:
        """``parse``, and the temperature the file records (``sequoia-ray measure`` writes it); None for a list
        or a file without one."""
        values = _numbers(text)
        if values is not None:
            return cls.from_p(values), None
        path = Path(text)
        if path.suffix == ".json" or _is_file(path):
            obj = _read(path)
            temperature = obj.get("temperature") if isinstance(obj, dict) else None
            number = isinstance(temperature, (int, float)) and not isinstance(temperature, bool)
            recorded = temperature if number else None
            return cls.from_dict(obj, source=str(path)), recorded
        raise AcceptanceError(
            f"acceptance {text!r:.200} is neither a JSON file nor a comma-separated list of numbers")

    @classmethod
    def load(cls, path: Path) -> AcceptanceVector:
        return cls.from_dict(_read(path), source=str(path))


def _read(path: Path) -> Any:
    """An acceptance file's JSON; AcceptanceError naming the file when it does not read."""
    try:
        return json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise AcceptanceError(f"acceptance file {path} does not exist") from None
    except OSError as exc:  # a folder, no permission, ...
        raise AcceptanceError(f"acceptance file {path} cannot be read ({exc.strerror or exc})") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise AcceptanceError(f"acceptance file {path} is not valid JSON ({exc})") from None
    except RecursionError:
        raise AcceptanceError(f"acceptance file {path} is JSON nested too deeply to be an acceptance vector; "
                              'give {"p": [...], "reject": r}') from None


def is_number_list(text: str) -> bool:
    """Whether ``parse`` reads ``text`` as a comma-separated list of numbers (not as a file path)."""
    return _numbers(text) is not None


def _numbers(text: str) -> list[float] | None:
    """The numbers of a comma-separated list, or None when ``text`` is not one."""
    fields = text.split(",")
    while fields and not fields[-1].strip():  # a trailing comma
        fields.pop()
    parts = [x for x in fields if x.strip()]
    try:
        values = [float(x) for x in parts] if parts else None
    except ValueError:
        return None
    if values is not None and len(parts) < len(fields):  # "0.6,,0.1": rank 3's value would be read as rank 2's
        rank = next(i for i, f in enumerate(fields, 1) if not f.strip())
        raise AcceptanceError(f"acceptance {text!r:.200} has an empty field at rank {rank}; give one number per "
                              "rank (0 for a rank never accepted)")
    return values


def _is_file(path: Path) -> bool:
    try:
        return path.is_file()
    except OSError:  # e.g. a name longer than the file system allows
        return False


def _implied_reject(row: tuple[float, ...]) -> float:
    _check_values(row, where="p")
    total = math.fsum(row)
    if total > 1 + SUM_TOLERANCE:
        raise AcceptanceError(f"sum of p is {total:.6g} > 1; p[k] are probabilities of disjoint events")
    return max(0.0, 1.0 - total)


def _check_values(row: tuple[float, ...], *, where: str) -> None:
    for k, x in enumerate(row, start=1):
        if not math.isfinite(x) or x < 0 or x > 1:
            raise AcceptanceError(f"{where}: p[{k}] = {x!r} must be a finite probability in [0, 1]")


def _check_row(row: tuple[float, ...], reject: float, *, where: str) -> None:
    _check_values(row, where=where)
    if not math.isfinite(reject) or reject < 0:
        raise AcceptanceError(f"{where}: reject = {reject!r} must be a finite probability >= 0")
    total = math.fsum(row) + reject
    if abs(total - 1) > SUM_TOLERANCE:
        raise AcceptanceError(
            f"{where}: sum(p) + reject = {total:.9g}, must be 1 (±{SUM_TOLERANCE}); "
            "omit 'reject' to let it be 1 - sum(p)"
        )
