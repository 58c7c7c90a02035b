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
        lines = [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    except OSError as exc:
        raise FileNotFoundError(f"prompt file {path}: {exc.strerror}") from None
    except UnicodeDecodeError as exc:
        raise ValueError(f"prompt file {path} is not UTF-8 text (byte {exc.start}); save it as UTF-8") from None
    if not lines:  # said now, not as a failure of whatever the prompts were for (after loading the models)
        raise ValueError(f"prompt file {path} holds no prompts; give one prompt per line"
                         + (" (a JSON object with a 'prompt' string)" if path.suffix == ".jsonl" else ""))
    if path.suffix != ".jsonl":
        return [Prompt(line) for line in lines]
    out = []
    for i, line in enumerate(lines, start=1):
        try:
            out.append(_prompt(json.loads(line)))
        except (ValueError, KeyError, TypeError, RecursionError) as exc:  # RecursionError: nested too deeply
            raise ValueError(f"{path}:{i}: expected a JSON object with a non-empty 'prompt' string, and 'chat' a "
                             f"boolean and 'kind' a string if given ({exc})") from None
    return out


def _prompt(obj: dict) -> Prompt:
    text, chat, kind = obj["prompt"], obj.get("chat", False), obj.get("kind", "text")
    if not isinstance(text, str) or not text:  # null or a list would be read as its repr, "false" as True
        raise TypeError(f"prompt {text!r:.40}")
    if not isinstance(chat, bool) or not isinstance(kind, str):
        raise TypeError(f"chat {chat!r:.20}, kind {kind!r:.20}")
    return Prompt(text, chat, kind)


def interleave_kinds(prompts: list[Prompt]) -> list[Prompt]:
    """The prompts taken round-robin by kind (kinds in order of first appearance, each keeping its own order),
    so that any prefix mixes the kinds as evenly as it can. The profiler measures p on the prompts in order
    until its time runs out, keeps the first ``max_prompts``, and a measured choice at batch 1 runs one prompt
    a round: with the built-in set in its old order (code, code, prose, ...) the main job's two rounds measured
    its trees on code alone (the 600 s profile's three on code, code, prose) while p came from three prompts of
    each kind, and a file of code prompts followed by prose ones was profiled on code only."""
    by_kind: dict[str, list[Prompt]] = {}
    for p in prompts:
        by_kind.setdefault(p.kind, []).append(p)
    queues = list(by_kind.values())
    return [q[i] for i in range(max(map(len, queues), default=0)) for q in queues if i < len(q)]
