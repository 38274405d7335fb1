"""Last-word prediction (LAMBADA-style) over Python's own documentation, for lm-eval.

The text: the Python language reference topics that ship inside CPython's standard library
(``pydoc_data.topics``, the text ``help("if")`` prints; PSF license), joined in the order of
their names. Nothing is downloaded and no copy of the text is kept in this repository; the text
differs between Python versions, so every item records the version and the text's SHA-256
(results are comparable only for the same ``text_sha256``).

An item is a sentence end ``... <word>.`` in the text (``<word>``: 4 or more ASCII letters after
a space, the full stop followed by whitespace): its context is the ``context_chars`` characters
before the space (cut forward to the first whitespace, so no word is split), the target is
`` <word>``. ``count`` items are spread evenly over the sentence ends that have a full context, then put in
a seeded random order, so that lm-eval's ``--limit N`` (the first N) is a sample of the whole text.
Loglikelihood task: is the target the greedy continuation (``acc``), its perplexity; generation
task: the first word generated (up to a space, full stop or newline) equals the target word.

This file is self-contained (lm-eval imports it by path: ``--include_path evals/tasks``).
"""

from __future__ import annotations

import hashlib
import random
import re
import sys

_SENTENCE_END = re.compile(r" ([A-Za-z]{4,})\.(?=\s)")


def source_text() -> str:
    import pydoc_data.topics

    topics = pydoc_data.topics.topics
    return "\n\n".join(topics[name].strip() for name in sorted(topics))


def build_items(count: int, context_chars: int, text: str | None = None) -> list[dict]:
    """``count`` items with contexts of about ``context_chars`` characters (see the module docstring)."""
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise ValueError(f"count: expected an int >= 1, got {count!r}")
    if isinstance(context_chars, bool) or not isinstance(context_chars, int) or context_chars < 16:
        raise ValueError(f"context_chars: expected an int >= 16, got {context_chars!r}")
    text = source_text() if text is None else text
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


def load(count: int = 300, context_chars: int = 6000, **_: object) -> dict:
    """lm-eval's ``custom_dataset``: the items as a ``test`` split (the task's ``metadata``
    passes ``count`` and ``context_chars``)."""
    import datasets

    return datasets.DatasetDict({"test": datasets.Dataset.from_list(build_items(int(count), int(context_chars)))})
