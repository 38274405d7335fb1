"""benchmarks/bench_kv_ipc.py: its pieces on CPU; the whole run on a GPU (CUDA IPC needs one)."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks import bench_kv_ipc as bench

SMALL = {"num_layers": 3, "num_kv_heads": 2, "head_dim": 16, "page_size": 4}


def test_parse_lengths():
    assert bench.parse_lengths("4096,32768") == (4096, 32768)
    for bad in ("", "4k", "0", "5,5", "-3"):
        with pytest.raises(ValueError, match="lengths: expected"):
            bench.parse_lengths(bad)


def test_fragmented_request_takes_holes_and_keeps_the_pool_whole():
    pool = bench.make_pool(40, "cpu", SMALL)
    assert pool.num_pages == 10 + 64
    pages = bench.fragmented_request(pool, "r", 40)
    assert len(pages) == 10 and pool.seq_len("r") == 40
    assert any(b != a + 1 for a, b in zip(pages, pages[1:]))  # not one run of pages
    assert pool.free_pages == pool.num_pages - 10  # the fillers are all released


def test_page_sums_are_per_layer_word_sums():
    torch.manual_seed(0)
    pool = bench.make_pool(12, "cpu", SMALL)
    pool.k.normal_()
    pool.v.normal_()
    pages = [5, 2, 9]
    got = bench.page_sums(pool, pages)
    want = []
    for t in (pool.k, pool.v):
        for layer in range(3):
            want.append(sum(int(t[layer, p].view(torch.int16).to(torch.int64).sum()) for p in pages))
    assert got == want and len(got) == 6
    pool.k[1, 9, 0, 0, 0] += 1.0  # one element of one page of layer 1
    assert bench.page_sums(pool, pages)[1] != want[1] and bench.page_sums(pool, pages)[0] == want[0]


def test_payload_bytes_of_the_8b_geometry():
    pool = bench.make_pool(1, "cpu", {**bench.GEOMETRY, "num_layers": 1})
    # one layer, K and V, 64 pages of 64 tokens x 8 heads x 128 x 2 bytes
    assert bench.payload_bytes(pool, 64) == 2 * 64 * 64 * 8 * 128 * 2


def test_format_row():
    row = {"tokens": 4096, "bytes": 536870912, "memcpy_ms": 0.25, "memcpy_gbps": 2147.5,
           "copy_pages_ms": 0.5, "copy_pages_gbps": 1073.7, "copy_pages_of_memcpy": 0.5,
           "ipc_ms": 0.6, "ipc_gbps": 894.8, "ipc_of_memcpy": 0.4167, "check": "ok"}
    line = bench.format_row(row)
    assert line.split() == ["4096", "0.54", "|", "0.25", "2148", "|", "0.50", "1074", "0.50", "|",
                            "0.60", "895", "0.42", "|", "ok"]
    assert len(bench.HEADER.split("|")) == len(line.split("|"))


def test_bad_arguments_and_no_gpu(capsys, monkeypatch):
    with pytest.raises(SystemExit) as info:
        bench.main(["--lengths", "0"])
    assert info.value.code == 2 and "lengths: expected" in capsys.readouterr().err
    with pytest.raises(SystemExit) as info:
        bench.main(["--repeats", "0"])
    assert info.value.code == 2 and "--repeats: expected" in capsys.readouterr().err
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert bench.main(["--quick"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


@pytest.mark.gpu
def test_gpu_run_is_bit_exact(tmp_path):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    out = tmp_path / "ipc.json"
    assert bench.main(["--lengths", "256,1024", "--repeats", "1", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert [r["tokens"] for r in res["rows"]] == [256, 1024]
    assert all(r["check"] == "ok" and r["ipc_ms"] > 0 and r["memcpy_gbps"] > 0 for r in res["rows"])
    assert res["receiver_counters"]["ipc_failures"] == 0


def test_cpu_smoke_copies_pages_exactly(tmp_path, capsys):
    """No IPC on the CPU: the in-process page copy (the routine the receive uses, in two-page
    chunks) and the memcpy baseline, checked by the page sums, written like the GPU run."""
    out = tmp_path / "ipc.json"
    assert bench.main(["--cpu-smoke", "--repeats", "1", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["env"]["gpu"] == "cpu" and res["geometry"]["num_layers"] == 2
    assert [r["tokens"] for r in res["rows"]] == [100, 300]
    for r in res["rows"]:
        assert r["check"] == "ok" and r["ipc"] == "skipped: needs CUDA" and r["ipc_ms"] is None
        assert r["pages"] == -(-r["tokens"] // 16)
        assert r["bytes"] == 2 * 2 * r["pages"] * 16 * 2 * 64 * 2  # K+V, layers, pages, slots, heads, d, bf16
        assert r["copy_pages_ms"] > 0 and r["memcpy_ms"] > 0
    assert " - " in capsys.readouterr().out  # the table marks the IPC columns as not measured
