"""Last-word prediction (LAMBADA-style) over Python's own documentation, for lm-eval.

The items are the calibration's (``model_executor/calibration/lastword.py`` says how they are
made; ``python -m router calibrate`` scores the same items on a ModelRunner): ``count`` sentence
ends of CPython's ``pydoc_data.topics`` with about ``context_chars`` characters of context each.
Loglikelihood task: is the target the greedy continuation (``acc``), its perplexity; generation
task: the first word generated (up to a space, full stop or newline) equals the target word.

lm-eval imports this file by path (``--include_path evals/tasks``); the product must be
importable there (installed, or the repository root on ``PYTHONPATH``).
"""

from __future__ import annotations

from model_executor.calibration.lastword import build_items

__all__ = ["build_items", "load"]


def load(count: int = 300, context_chars: int = 6000, **_: object) -> dict:
    """lm-eval's ``custom_dataset``: the items as a ``test`` split (the task's ``metadata``
    passes ``count`` and ``context_chars``)."""
    import datasets

    return datasets.DatasetDict({"test": datasets.Dataset.from_list(build_items(int(count), int(context_chars)))})
