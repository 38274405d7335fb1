"""Incremental detokenization with stop strings.

Tokens arrive one at a time; text must go out as soon as it is final. Two things keep text
back: a multi-byte character whose bytes have not all arrived (the decoder yields U+FFFD for
the partial tail), and a possible beginning of a stop string (up to ``max(len(stop)) - 1``
characters). Decoding re-reads only a short window of recent tokens, not the whole output.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

_REPLACEMENT = "\ufffd"
_WINDOW = 8  # tokens re-decoded before the unread ones (a character spans at most a few)


class TextStream:
    """Feed tokens with :meth:`push`; each call returns the newly final text."""

    def __init__(self, tokenizer: Any, stop: Sequence[str] = ()) -> None:
        self._tok = tokenizer
        self._stop = tuple(stop)
        self._hold = max((len(s) for s in self._stop), default=1) - 1
        self._ids: list[int] = []
        self._prefix_offset = 0  # tokens before this are settled into self._text
        self._text = ""  # settled text (all characters complete)
        self._emitted = 0  # characters of self._text already returned
        self.stopped = False  # a stop string matched; the text ends before it

    @property
    def token_ids(self) -> list[int]:
        return self._ids

    @property
    def text(self) -> str:
        return self._text[: self._emitted] if self.stopped else self._text

    def _settle(self) -> None:
        start = max(self._prefix_offset - _WINDOW, 0)
        before = self._tok.decode(self._ids[start : self._prefix_offset])
        now = self._tok.decode(self._ids[start:])
        if now.endswith(_REPLACEMENT) or not now.startswith(before):
            return  # an incomplete character: wait for its remaining bytes
        self._text += now[len(before):]
        self._prefix_offset = len(self._ids)

    def push(self, token_ids: Sequence[int]) -> str:
        if self.stopped:
            return ""
        self._ids.extend(int(t) for t in token_ids)
        self._settle()
        if self._stop:
            search_from = max(self._emitted - self._hold, 0)
            hits = [i for i in (self._text.find(s, search_from) for s in self._stop) if i >= 0]
            if hits:
                cut = min(hits)
                self._text = self._text[:cut]
                out = self._text[self._emitted :]
                self._emitted = len(self._text)
                self.stopped = True
                return out
        ready = len(self._text) - self._hold if self._stop else len(self._text)
        if ready <= self._emitted:
            return ""
        out = self._text[self._emitted : ready]
        self._emitted = ready
        return out

    def finish(self) -> str:
        """End of generation: everything left (a dangling partial character decodes as U+FFFD)."""
        if self.stopped:
            return ""
        start = max(self._prefix_offset - _WINDOW, 0)
        before = self._tok.decode(self._ids[start : self._prefix_offset])
        now = self._tok.decode(self._ids[start:])
        if now.startswith(before):
            self._text += now[len(before):]
        self._prefix_offset = len(self._ids)
        out = self._text[self._emitted :]
        self._emitted = len(self._text)
        return out
