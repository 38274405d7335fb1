"""Offline calibration text and the token windows cut from it.

The default text is the Python language reference that CPython ships in ``pydoc_data.topics``
(what ``help("if")`` prints; English technical prose with code): topics in sorted key order,
each stripped, joined by a blank line. It is always present offline, but its wording follows
the Python version, so a result records the version, the character count and the SHA-256.
"""

from __future__ import annotations

import hashlib
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

PYDOC_TOPICS = "pydoc-topics"
ROPE_SCALINGS = ("yarn", "linear", "none")


def pydoc_topics_text() -> str:
    """The language reference topics of this Python, joined (see the module docstring)."""
    from pydoc_data import topics

    return "\n\n".join(topics.topics[k].strip() for k in sorted(topics.topics))


@dataclass(frozen=True)
class Text:
    name: str  # what a table calls it
    text: str

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.text.encode("utf-8")).hexdigest()


def load_text(source: str = PYDOC_TOPICS) -> Text:
    """``"pydoc-topics"`` (see the module docstring) or the path of a UTF-8 text file."""
    if source == PYDOC_TOPICS:
        v = sys.version_info
        return Text(f"pydoc_data.topics (Python {v.major}.{v.minor}.{v.micro} language reference topics)",
                    pydoc_topics_text())
    path = Path(source)
    if not path.is_file():
        raise ValueError(f"text: expected {PYDOC_TOPICS!r} or a text file, got {source!r} (no such file)")
    try:
        body = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"text: expected UTF-8 text in {path}: {e}") from None
    return Text(f"file {path.name}", body)


def _check_length_and_count(length: object, count: object, count_name: str) -> None:
    if isinstance(length, bool) or not isinstance(length, int) or length < 2:
        raise ValueError(f"length: expected an int >= 2, got {length!r}")
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise ValueError(f"{count_name}: expected an int >= 1, got {count!r}")


def token_windows(ids: Sequence[int], length: int, samples: int) -> list[list[int]]:
    """Non-overlapping windows ``[s * length, (s + 1) * length)`` of ``ids``, ``s < samples``."""
    _check_length_and_count(length, samples, "samples")
    if samples * length > len(ids):
        raise ValueError(f"length: {samples} window(s) of {length} tokens need {samples * length} tokens, "
                         f"the text has {len(ids)}")
    return [list(ids[s * length:(s + 1) * length]) for s in range(samples)]


def ending_windows(ids: Sequence[int], length: int, count: int) -> list[tuple[list[int], int]]:
    """``count`` prompts of ``length`` tokens whose ends are spread evenly over ``ids`` (they may
    overlap; their last tokens, where an answer starts, differ), each with the token that follows
    it in the text: ``[(window, next_token), ...]``. The first starts the text."""
    _check_length_and_count(length, count, "prompts")
    room = len(ids) - 1 - length  # every window keeps one following token
    if room < 0:
        raise ValueError(f"length: {length} tokens and the one after them need {length + 1} tokens, "
                         f"the text has {len(ids)}")
    if count > room + 1:
        raise ValueError(f"prompts: {count} windows of {length} tokens ending at distinct offsets need "
                         f"{length + count} tokens, the text has {len(ids)}")
    starts = [0] if count == 1 else [round(i * room / (count - 1)) for i in range(count)]
    return [(list(ids[s:s + length]), int(ids[s + length])) for s in starts]


def rope_for(length: int, trained: int, kind: str) -> dict | None:
    """The RoPE scaling a length runs with: none within the trained context, else ``kind``
    with factor ``length / trained`` (``kind = "none"``: unscaled, extrapolating)."""
    if kind not in ROPE_SCALINGS:
        raise ValueError(f"rope_scaling: expected one of {ROPE_SCALINGS}, got {kind!r}")
    if length <= trained or kind == "none":
        return None
    return {"rope_type": kind, "factor": length / trained}
