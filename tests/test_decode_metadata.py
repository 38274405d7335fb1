"""The eager decode step's persistent device metadata (model_executor/decode_metadata.py) and
ModelRunner.decode over it (CPU, reference backend)."""

from __future__ import annotations

import random

import pytest
import torch

from model_executor import ModelRunner, PrefillItem
from model_executor.decode_metadata import DecodeMetadata
from model_executor.loading import make_pool

PS = 4


def _expect(pages, starts):
    """What a step's buffers must hold, from the page lists by hand."""
    slots = [p[s // PS] * PS + s % PS for p, s in zip(pages, starts)]
    return slots, [s + 1 for s in starts]


def test_rows_are_written_only_where_their_request_or_pages_changed():
    rng = random.Random(11)
    meta = DecodeMetadata(PS, torch.device("cpu"))
    pages = {"a": rng.sample(range(100), 3), "b": rng.sample(range(100), 2)}
    tokens = torch.tensor([rng.randrange(50) for _ in range(16)])

    def step(rids, starts):
        out = meta.prepare(rids, [pages[r] for r in rids], tokens[: len(rids)], starts)
        slots, seqlens = _expect([pages[r] for r in rids], starts)
        assert out["slots"].tolist() == slots and out["seqlens_kv"].tolist() == seqlens
        assert out["positions"].tolist() == list(starts) and out["cu_seqlens_q"].tolist() == list(range(len(rids) + 1))
        assert out["input_ids"].tolist() == tokens[: len(rids)].tolist()
        for row, rid in enumerate(rids):
            assert out["page_table"][row, : len(pages[rid])].tolist() == pages[rid]
        return dict(meta.stats)

    s = step(["a", "b"], [9, 5])
    assert (s["rows_written"], s["pages_written"], s["resized"]) == (2, 5, 1)
    s = step(["a", "b"], [10, 6])  # same rows, same pages: nothing written to the table
    assert (s["rows_written"], s["pages_written"]) == (2, 5)
    pages["b"].append(rng.randrange(100, 200))  # b crosses a page boundary: one page id written
    s = step(["a", "b"], [11, 8])
    assert (s["rows_written"], s["pages_written"]) == (2, 6)
    s = step(["b", "a"], [9, 11])  # rows swapped: both rewritten
    assert (s["rows_written"], s["pages_written"]) == (4, 12)
    pages["a"] = rng.sample(range(200, 300), 3)  # an id reused with other pages: rewritten
    s = step(["b", "a"], [10, 9])
    assert (s["rows_written"], s["pages_written"]) == (5, 15)
    assert meta.capacity == (8, 8)
    pages.update({f"x{i}": [rng.randrange(300)] for i in range(9)})  # a larger batch: the buffers grow
    s = step(["b", "a"] + [f"x{i}" for i in range(9)], [10, 9] + [0] * 9)
    assert s["resized"] == 2 and meta.capacity == (16, 8)


def test_page_size_must_be_a_positive_int():
    with pytest.raises(ValueError, match="page_size"):
        DecodeMetadata(0, torch.device("cpu"))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA"))])
def test_decode_over_the_persistent_metadata_matches_a_fresh_prefill(tiny, device):
    """Batches that change (reordered, a request gone, an id reused, pages crossed): every
    step's logits equal a prefill of the whole sequence in a pool of its own."""
    tiny.model.to(device)
    runner = ModelRunner(tiny.model, make_pool(tiny, num_pages=48, page_size=PS, device=device), dense_below=1 << 30)
    ref = ModelRunner(tiny.model, make_pool(tiny, num_pages=48, page_size=PS, device=device), dense_below=1 << 30)
    tol = 1e-4 if device == "cpu" else 2e-3  # Triton kernels on CUDA: another reduction order
    rng = random.Random(5)
    seqs: dict[str, list[int]] = {}

    def start(rid):
        seqs[rid] = [256] + [rng.randrange(256) for _ in range(rng.randint(2, 9))]
        runner.pool.reserve(rid, len(seqs[rid]))
        runner.prefill([PrefillItem(rid, seqs[rid][:-1])])  # the last token is decoded

    def step(rids):
        for rid in rids:
            runner.ensure_capacity(rid, len(seqs[rid]))
        got = runner.decode(rids, [seqs[r][-1] for r in rids])
        for row, rid in enumerate(rids):
            ref.pool.reserve("ref", len(seqs[rid]))
            want = ref.prefill([PrefillItem("ref", seqs[rid])])[0]
            ref.pool.release("ref")
            torch.testing.assert_close(got[row], want, atol=tol, rtol=tol)
            seqs[rid].append(rng.randrange(256))

    for rid in "abc":
        start(rid)
    for rids in (["a", "b"], ["a", "b"], ["b", "a", "c"], ["c", "a"], ["a", "b", "c"]):
        step(rids)
    runner.pool.release("b")
    start("b")  # the same id, other pages and tokens
    for rids in (["a", "b", "c"], ["b"], ["c", "b", "a"]):
        for _ in range(3):
            step(rids)
    stats = runner.decode_metadata.stats
    assert stats["steps"] == 14 and stats["rows_written"] < 14 * 2
