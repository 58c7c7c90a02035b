"""Prompt sets: a .jsonl file of {"prompt": str, "chat": bool, "kind": str} or plain text, one per line."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Prompt:
    text: str
    chat: bool = False
    kind: str = "text"


def load_prompts(path: str | Path) -> list[Prompt]:
    path = Path(path)
    try:
        lines = [line for line in path.read_text().splitlines() if line.strip()]
    except OSError as exc:
        raise FileNotFoundError(f"prompt file {path}: {exc.strerror}") from None
    if path.suffix != ".jsonl":
        return [Prompt(line) for line in lines]
    out = []
    for i, line in enumerate(lines, start=1):
        try:
            obj = json.loads(line)
            out.append(Prompt(str(obj["prompt"]), bool(obj.get("chat", False)), str(obj.get("kind", "text"))))
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{path}:{i}: expected a JSON object with a 'prompt' string ({exc})") from None
    if not out:
        raise ValueError(f"{path} holds no prompts")
    return out
