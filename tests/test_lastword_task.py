"""The shipped lm-eval task's items (evals/tasks/lastword/lastword_utils.py)."""

from __future__ import annotations

import importlib.util
import random
import re
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parent.parent / "evals" / "tasks" / "lastword" / "lastword_utils.py"
_spec = importlib.util.spec_from_file_location("lastword_utils", _PATH)
lastword = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(lastword)


def _prose(rng: random.Random, sentences: int) -> str:
    words = ["".join(rng.choice("abcdefghij") for _ in range(rng.randint(2, 9))) for _ in range(200)]
    return " ".join(" ".join(rng.choice(words) for _ in range(rng.randint(3, 12))) + "." for _ in range(sentences))


def test_items_are_sentence_ends_of_the_text():
    text = _prose(random.Random(3), 400)
    items = lastword.build_items(25, 300, text)
    assert len(items) == 25 and sorted(i["id"] for i in items) == list(range(25))
    assert len({i["offset"] for i in items}) == 25
    for it in items:
        end = it["offset"] + len(it["target"])
        assert text[it["offset"]:end] == it["target"] and text[end] == "."  # " word" then the full stop
        assert text[:it["offset"]].endswith(it["context"]) and 250 < len(it["context"]) <= 300
        assert re.fullmatch(r" [A-Za-z]{4,}", it["target"]) and not it["context"][0].isspace()
    assert items == lastword.build_items(25, 300, text)  # deterministic


def test_the_shipped_text_gives_the_full_and_tiny_tasks():
    full, tiny = lastword.build_items(300, 6000), lastword.build_items(16, 1500)
    assert len(full) == 300 and len(tiny) == 16
    assert len({it["text_sha256"] for it in full + tiny}) == 1
    assert min(len(it["context"]) for it in full) > 5900


@pytest.mark.parametrize("kwargs, name", [
    ({"count": 0, "context_chars": 100}, "count"),
    ({"count": True, "context_chars": 100}, "count"),
    ({"count": 10**6, "context_chars": 100}, "count"),
    ({"count": 3, "context_chars": 4}, "context_chars"),
    ({"count": 3, "context_chars": "100"}, "context_chars"),
])
def test_bad_arguments_name_them(kwargs, name):
    with pytest.raises(ValueError, match=name):
        lastword.build_items(**kwargs)


def test_the_sparse_mode_prefills_every_context_sparse(tmp_path):
    """lmeval_scores' sparse mode forces sparse prefill at every length (``sparse.dense_below =
    0``): the model's profile may keep its trained context dense, the comparison may not."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from benchmarks import lmeval_scores

    seen = {}

    class Stop(Exception):
        pass

    def popen(cmd, **kw):
        seen["cmd"] = cmd
        raise Stop

    import argparse

    args = argparse.Namespace(model="builtin:smollm2-135m", kv_pages=64)
    orig = lmeval_scores.subprocess.Popen
    lmeval_scores.subprocess.Popen = popen
    try:
        for mode, want in (("sparse", "sparse.dense_below=0"), ("dense", "0.0")):
            with pytest.raises(Stop):
                lmeval_scores.run_mode(mode, args, Path("."), tmp_path)
            assert want in seen["cmd"], seen["cmd"]
    finally:
        lmeval_scores.subprocess.Popen = orig
