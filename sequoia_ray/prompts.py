"""Prompt sets: a .jsonl file of {"prompt": str, "chat": bool, "kind": str} or plain text, one per line."""

from __future__ import annotations

import codecs
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
    lines = _lines(path)
    if not lines:  # said now, not as a failure of whatever the prompts were for (after loading the models)
        raise ValueError(f"prompt file {path} holds no prompts; give one prompt per line"
                         + (" (a JSON object with a 'prompt' string)" if path.suffix == ".jsonl" else ""))
    if path.suffix != ".jsonl":
        return [Prompt(line) for _, line in lines]
    out = []
    for i, line in lines:
        try:
            out.append(_prompt(json.loads(line)))
        except (ValueError, KeyError, TypeError, RecursionError) as exc:  # RecursionError: nested too deeply
            raise ValueError(f"{path}:{i}: expected a JSON object with a non-empty 'prompt' string, and 'chat' a "
                             f"boolean and 'kind' a string if given ({exc})") from None
    return out


def _lines(path: Path) -> list[tuple[int, str]]:
    """The file's non-blank lines with their physical line numbers (counted before blank ones are skipped: an error
    on line 4 after two blank lines was reported as line 2). Lines end at "\n" only ("\r\n" too): ``splitlines``
    also split at form feeds, U+0085 and U+2028, which a prompt may hold and JSON writes raw inside strings
    (``ensure_ascii=False``), so one .jsonl line failed as an unterminated string. A leading UTF-8 BOM (Windows
    editors write one) is dropped: it was read as the first prompt's first character and broke its JSON."""
    try:
        data = path.read_bytes()  # not read_text: its universal newlines would split at a lone "\r" too
    except OSError as exc:
        raise FileNotFoundError(f"prompt file {path}: {exc.strerror}") from None
    bom = len(codecs.BOM_UTF8) if data.startswith(codecs.BOM_UTF8) else 0
    try:
        text = data[bom:].decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"prompt file {path} is not UTF-8 text (byte {bom + exc.start}); save it as UTF-8") from None
    lines = (line.removesuffix("\r") for line in text.split("\n"))
    return [(i, line) for i, line in enumerate(lines, start=1) if line.strip()]


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
