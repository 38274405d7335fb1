"""Last-word prediction (LAMBADA-style) over Python's own documentation: the items of the
shipped lm-eval task (``evals/tasks/lastword``) and its greedy score on a ModelRunner.

The text: the Python language reference topics that ship inside CPython's standard library
(``pydoc_data.topics``, :func:`~model_executor.calibration.text.pydoc_topics_text`; PSF license).
Nothing is downloaded and no copy of the text is kept in this repository; the text differs
between Python versions, so every item records the version and the text's SHA-256 (results are
comparable only for the same ``text_sha256``).

An item is a sentence end ``... <word>.`` in the text (``<word>``: 4 or more ASCII letters after
a space, the full stop followed by whitespace): its context is the ``context_chars`` characters
before the space (cut forward to the first whitespace, so no word is split), the target is
`` <word>``. ``count`` items are spread evenly over the sentence ends that have a full context,
then put in a seeded random order, so that lm-eval's ``--limit N`` (the first N) is a sample of
the whole text. An item is right (lm-eval's loglikelihood ``acc``) when every target token is the
greedy next token after the context and the target tokens before it.
"""

from __future__ import annotations

import hashlib
import random
import re
import sys
from collections.abc import Sequence

from .text import pydoc_topics_text

_SENTENCE_END = re.compile(r" ([A-Za-z]{4,})\.(?=\s)")


def build_items(count: int, context_chars: int, text: str | None = None) -> list[dict]:
    """``count`` items with contexts of about ``context_chars`` characters (see the module docstring)."""
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise ValueError(f"count: expected an int >= 1, got {count!r}")
    if isinstance(context_chars, bool) or not isinstance(context_chars, int) or context_chars < 16:
        raise ValueError(f"context_chars: expected an int >= 16, got {context_chars!r}")
    text = pydoc_topics_text() if text is None else text
    ends = [m for m in _SENTENCE_END.finditer(text) if m.start() >= context_chars]
    if len(ends) < count:
        raise ValueError(f"count: the text has {len(ends)} sentence ends with {context_chars} characters of "
                         f"context before them, fewer than {count}")
    digest = hashlib.sha256(text.encode("utf-8")).hexdigest()
    version = "%d.%d" % sys.version_info[:2]
    items = []
    for i in range(count):
        m = ends[(2 * i + 1) * len(ends) // (2 * count)]
        window = text[m.start() - context_chars:m.start()]
        cut = re.search(r"\s", window)
        context = window[cut.end():] if cut else window
        items.append({"id": i, "offset": m.start(), "context": context, "target": " " + m.group(1),
                      "python": version, "text_sha256": digest})
    random.Random(0).shuffle(items)
    return items


def encode_item(tokenizer, item: dict) -> tuple[list[int], int]:
    """The prompt ``context + target`` as token ids and how many of its last tokens are the
    target's: lm-eval's split (the whole string's tokens past as many as the context alone has;
    at least one)."""
    context = tokenizer.encode(item["context"], add_bos=False)
    whole = tokenizer.encode(item["context"] + item["target"], add_bos=False)
    return whole, max(1, len(whole) - len(context))


def greedy_hit(logits, ids: Sequence[int], n_target: int) -> bool:
    """Whether the last ``n_target`` tokens of ``ids`` are each the argmax of the logits of the
    position before them; ``logits``: ``[len(ids), V]`` of the whole prompt."""
    if logits.shape[0] != len(ids):
        raise ValueError(f"logits: expected {len(ids)} rows (one per token), got {logits.shape[0]}")
    if not 1 <= n_target < len(ids):
        raise ValueError(f"n_target: expected an int in [1, {len(ids) - 1}], got {n_target}")
    start = len(ids) - n_target
    pred = logits[start - 1:len(ids) - 1].argmax(-1).tolist()
    return pred == [int(t) for t in ids[start:]]
