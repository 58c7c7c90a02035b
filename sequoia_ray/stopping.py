"""Exact stop conditions applied token by token: EOS, stop strings (not returned) and max_tokens.

Text is streamed as it becomes final: a tail that could still begin a stop string, or that ends in an
incomplete UTF-8 character, is held back until it is resolved.

The text is decoded incrementally: a token decodes with at most ``SETTLE_AFTER`` before it, after the last
``PREFIX_TOKENS`` of the settled ones (their text cut off), as vLLM's incremental detokenizer does. Decoding the whole
output again at every token cost O(length) a token: 2.4 s over a 4,096-token answer on the default tokenizer.
"""

from __future__ import annotations

import codecs
import os
import re


PREFIX_TOKENS = 4  # tokens decoded before the unsettled ones (vLLM's incremental detokenizer reads 5)
SETTLE_AFTER, KEEP_UNSETTLED = 48, 16  # with 48 unsettled tokens, settle all but the last 16
# Every decode leaves the spaces as the tokens spell them. A tokenizer whose config asks to "clean up" spaces
# (Llama 3.x's, under the transformers versions that apply it to byte-level BPE: before 5.x) drops the space of
# " '" before "s" once the "s" arrives, after that space was sent: text[sent:] then skipped a character
# ("{'key': 'server'}" streamed as "{'key': 'erver'}").
DECODE = {"skip_special_tokens": True, "clean_up_tokenization_spaces": False}
OPEN_BYTES = 3  # the most bytes an unfinished UTF-8 character has
SPELL_LOOKUP = 16  # tokens read for bytes on each side of a cut; past them, bytes count as unknown
BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece byte fallback's (Llama's, Mistral's)


class StopChecker:
    """``prefix``: the prompt's last tokens. The output is decoded after them and their text cut off: a
    SentencePiece tokenizer (Llama, Mistral) drops the leading space of the first token it decodes, so the
    output decoded alone would begin "Paris" where the model wrote " Paris"."""

    def __init__(self, tokenizer, stop: tuple[str, ...], eos_ids: frozenset[int], prefix: tuple[int, ...] = ()
                 ) -> None:
        if stop and tokenizer is None:
            raise ValueError("stop strings need a tokenizer to decode text; load the model with its tokenizer")
        self.tokenizer, self.stop, self.eos_ids = tokenizer, stop, eos_ids
        self.prefix = _window(tokenizer, prefix) if tokenizer is not None else []
        self.prefix_text = tokenizer.decode(self.prefix, **DECODE) if self.prefix else ""
        self.settled, self.settled_text = 0, ""  # ids[:settled] read as settled_text, whatever follows them
        self.spelled: dict[int, bytes | None] = {}  # token -> its bytes (None: unknown)
        self.ids: list[int] = []
        self.text = ""
        self.sent = 0  # characters of text already emitted
        self.holdback = max((len(s) for s in stop), default=1) - 1

    @property
    def count(self) -> int:
        return len(self.ids)

    def feed(self, tokens: list[int], max_tokens: int) -> tuple[list[int], str, str | None]:
        """Take one step's tokens; return the ids and text to emit and the finish reason, if any."""
        new: list[int] = []
        reason = None
        for token in tokens:
            if token in self.eos_ids:
                reason = "stop"
                break
            new.append(token)
            self.ids.append(token)
            if self._decode_and_find_stop():
                reason = "stop"
                break
            if self.count >= max_tokens:
                reason = "length"
                break
        return new, self._delta(final=reason is not None), reason

    def _decode_and_find_stop(self) -> bool:
        if self.tokenizer is None:
            return False
        old, self.text = self.text, self._decode()
        # Text up to ``same`` held no stop string before; a new one ends after it. Decoding usually only appends,
        # but a token may also complete a character or change spacing before the old end.
        same = len(old) if self.text.startswith(old) else len(os.path.commonprefix([old, self.text]))
        found = [at for s in self.stop if (at := self.text.find(s, max(0, same - len(s) + 1))) >= 0]
        if found:  # the earliest stop string in the text, whichever of them it is
            self.text = self.text[:min(found)]
            return True
        return False

    def _decode(self) -> str:
        """The output's text, as it reads after the prompt: the settled text, then the unsettled tokens' text."""
        unsettled, window, window_text = self.ids[self.settled:], self.prefix, self.prefix_text
        tail = self._after(window, window_text, unsettled)
        if tail is None:  # the tokens changed the window's last character (a prompt ending inside a character):
            window, window_text = [], ""  # they are read alone, and settle so too (else every token read them all)
            tail = self.tokenizer.decode(unsettled, **DECODE)
        text = self.settled_text + tail
        if len(unsettled) >= SETTLE_AFTER:
            self._settle(tail, window, window_text)
        return text

    def _after(self, window: list[int], window_text: str, ids: list[int]) -> str | None:
        """The text of ``ids`` read after ``window`` (None when they change the window's own text)."""
        text = self.tokenizer.decode(window + ids, **DECODE)
        return text[len(window_text):] if text.startswith(window_text) else None

    def _settle(self, tail: str, window: list[int], window_text: str) -> None:
        """Settle all but the last KEEP_UNSETTLED tokens when the text then reads the same: their text (read after
        ``window``, as ``tail`` was) ends in a whole character, and the rest read after the new window gives the
        rest of ``tail``. Else try later."""
        cut = len(self.ids) - KEEP_UNSETTLED
        head = self._after(window, window_text, self.ids[self.settled:cut])
        if head is None or (head.endswith("\ufffd") and self._unfinished_at(cut)) or not tail.startswith(head):
            return
        window = _window(self.tokenizer, self.ids[:cut])
        window_text = self.tokenizer.decode(window, **DECODE)
        if self._after(window, window_text, self.ids[cut:]) != tail[len(head):]:
            return
        self.settled, self.settled_text = cut, self.settled_text + head
        self.prefix, self.prefix_text = window, window_text

    def _unfinished_at(self, cut: int) -> bool:
        """Whether ``ids[:cut]`` may end inside a character that later tokens complete: their bytes end in the first
        bytes of one, and the bytes after the cut so far continue it or complete it (a byte-fallback decoder still
        reads the whole byte run as U+FFFD while it ends unfinished), not break it off. Unknown bytes count as
        unfinished, a byte-fallback ``<0xNN>`` token's too: such a decoder reads a broken run as U+FFFD throughout,
        so a cut inside one could not be settled without changing text already read (32 stray bytes then 数 x10 came
        out 15 characters short); runs of them settle where they did before. A head ending in U+FFFD was never
        settled: a real U+FFFD too (Qwen2.5's token 5691, a stray continuation byte), so an output of them read
        every token of it at every token (4,001 ids at 4,000)."""
        before = self._spelling(range(cut - 1, max(cut - SPELL_LOOKUP, 0) - 1, -1))
        if before is None:
            return True
        decoder = codecs.getincrementaldecoder("utf-8")("replace")
        decoder.decode(before)
        start = decoder.getstate()[0]  # an unfinished character's first bytes, held until more come
        if not start:
            return False
        after = self._spelling(range(cut, min(cut + SPELL_LOOKUP, len(self.ids))), whole=False)
        return after is None or not _broken_off(start, after)

    def _spelling(self, positions: range, whole: bool = True) -> bytes | None:
        """The bytes of the tokens at ``positions`` (in their order: backwards before a cut), up to OPEN_BYTES of
        them. None if a token's are unknown, or ``whole`` and the positions end before OPEN_BYTES bytes."""
        out = b""
        for at in positions:
            token = self.ids[at]
            if token not in self.spelled:
                self.spelled[token] = token_bytes(self.tokenizer, token, byte_fallback=False)
            data = self.spelled[token]
            if data is None:
                return None
            out = data + out if positions.step < 0 else out + data
            if len(out) >= OPEN_BYTES:
                return out[-OPEN_BYTES:] if positions.step < 0 else out[:OPEN_BYTES]
        return None if whole else out

    def _delta(self, final: bool) -> str:
        """The text not sent yet, but for what may still change. Trailing U+FFFD is held only if the output may end
        inside a character: a real U+FFFD was held too, so an output of them was sent at its end only (and each
        token walked back over all of them)."""
        end = len(self.text)
        if not final:  # an unfinished character first (with the U+FFFD before it: a byte-fallback decoder reads a
            # byte run ending inside a character as U+FFFD a byte), then what could begin a stop string before it
            if self.text.endswith("\ufffd") and self._unfinished_at(self.count):
                end = max(self.sent, len(self.text.rstrip("\ufffd")))
            end -= self._open_tail(end)
        if end <= self.sent:
            return ""
        out, self.sent = self.text[self.sent : end], end
        return out

    def _open_tail(self, end: int) -> int:
        """The length of the longest tail of ``text[:end]`` that begins a stop string (held back: the next tokens
        may complete it). Any shorter such tail is inside it. It was ``holdback`` characters whatever the text: a
        40-character stop string held 39 characters of every stream back until its end."""
        for k in range(min(self.holdback, end), 0, -1):
            tail = self.text[end - k : end]
            if any(s.startswith(tail) for s in self.stop):
                return k
        return 0


def _broken_off(start: bytes, after: bytes) -> bool:
    """Whether ``after`` breaks off the character ``start`` begins (a byte that cannot continue it comes first): it
    then reads as U+FFFD whatever follows. Completed, it may still change the text before the cut: a byte-fallback
    decoder reads a byte run as U+FFFD a byte until the run ends whole."""
    try:
        codecs.getincrementaldecoder("utf-8")().decode(start + after)
    except UnicodeDecodeError as exc:
        return exc.start == 0
    return False


def token_bytes(tokenizer, token: int, *, byte_fallback: bool = True) -> bytes | None:
    """A token's bytes, or None if unknown: its text when it decodes to whole characters, else its spelling: a
    byte-fallback ``<0xNN>`` (None with ``byte_fallback`` False), or byte-level BPE's (GPT-2's, Qwen's, Llama 3's)
    characters, one a byte — spelled bytes only if they read as the token's text (an unknown spelling that happens
    to be Latin-1 is not byte-level BPE's)."""
    text = tokenizer.decode([token], **DECODE)
    if "\ufffd" not in text:
        return text.encode()
    spelling = tokenizer.convert_ids_to_tokens(token) if hasattr(tokenizer, "convert_ids_to_tokens") else None
    if not isinstance(spelling, str):
        return None
    if match := BYTE_TOKEN.fullmatch(spelling):
        data = bytes([int(match[1], 16)]) if byte_fallback else None
    else:
        data = bytes(BYTE_LEVEL[c] for c in spelling) if all(c in BYTE_LEVEL for c in spelling) else None
    return data if data is not None and data.decode("utf-8", "replace") == text else None


def _byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE's alphabet, character -> byte (GPT-2's ``bytes_to_unicode``): printable Latin-1 characters
    stand for themselves, the other bytes for characters from U+0100 on, in order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {**{chr(b): b for b in printable}, **{chr(256 + i): b for i, b in enumerate(others)}}


BYTE_LEVEL = _byte_level_alphabet()


def _window(tokenizer, ids) -> list[int]:
    """The last PREFIX_TOKENS of ``ids``, started on a whole character: a window starting inside a byte-fallback
    character (Llama's, Mistral's ``<0xNN>`` tokens) decoded as U+FFFD, and output bytes joining that run read as
    U+FFFD for the rest of the request (a stop string made of them never found). Its first tokens are dropped until
    the text no longer starts with U+FFFD."""
    window = list(ids[-PREFIX_TOKENS:])
    while window and tokenizer.decode(window, **DECODE).startswith("\ufffd"):
        window.pop(0)
    return window
