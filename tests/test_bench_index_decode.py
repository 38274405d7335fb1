"""CPU smoke runs of benchmarks/bench_index.py, bench_decode.py and bench_density_count.py:
each script's CPU mode at a tiny shape, in-process, and the JSON it writes (checks, not times)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

import bench_decode  # noqa: E402
import bench_density_count  # noqa: E402
import bench_index  # noqa: E402


@pytest.fixture(autouse=True)
def _interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def test_index_cpu_smoke(tmp_path, capsys):
    out = tmp_path / "index.json"
    bench_index.main(["--cpu-smoke", "--out", str(out)])
    data = json.loads(out.read_text())
    cfg = data["config"]
    assert (cfg["device"], cfg["lengths"], cfg["num_qo_heads"], cfg["num_kv_heads"], cfg["head_dim"]) == (
        "cpu", [256], 4, 1, 64)
    assert cfg["check_length"] == 256  # the CSR was compared with the reference at this length
    (row,) = data["rows"]
    assert row["seqlen"] == 256 and row["nnz"] > 0 and 0.0 < row["density"] <= 1.0
    assert row["peak_extra_mib"] is None  # a CUDA allocator figure: not made up on the CPU
    assert data["kernels_loaded"] == []  # the interpreter loads nothing through a driver
    assert "identical CSR" in capsys.readouterr().out


def test_decode_cpu_smoke(tmp_path):
    out = tmp_path / "decode.json"
    bench_decode.main(["--cpu-smoke", "--out", str(out)])
    data = json.loads(out.read_text())
    assert data["config"]["device"] == "cpu" and data["env"]["gpu"] == "cpu"
    assert "--cpu-smoke" in data["env"]["command"]
    res = data["results"]
    assert [(r["batch"], r["context"]) for r in res] == [(1, 256), (2, 256)]
    for r in res:
        # the script's own gate (fp32 reference, 2x SDPA's error) passed, or it would have exited
        assert r["max_err"] <= 2 * r["sdpa_err"] + 1e-3 and r["lse_err"] <= 1e-3
        assert set(r["sweep_us"]) == {"1", "2"} and r["best_splits"] in (1, 2)
        assert r["kv_bytes"] == 2 * r["batch"] * 256 * 1 * 64 * 2  # K+V, 1 head, d=64, bf16


def test_decode_without_cuda_needs_cpu_smoke():
    if bench_decode.torch.cuda.is_available():
        pytest.skip("a GPU is present")
    with pytest.raises(SystemExit, match="--cpu-smoke"):
        bench_decode.main([])


def test_density_count_cpu_smoke(tmp_path, capsys):
    out = tmp_path / "density.json"
    assert bench_density_count.main(["--cpu-smoke", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["backend"] == "reference" and data["env"]["gpu"] == "cpu"
    (row,) = data["rows"]
    assert row["length"] == 256 and 0.0 < row["block_density"] <= 1.0
    assert row["count_ms"] > 0 and row["layer_ms"] > 0
    assert "density" in capsys.readouterr().out


def test_index_parts_times_each_part_once():
    """The calls bench_index and ``bench_peer.py --index-parts`` share: four timed parts, nnz of
    the index the reference builds (interpreter, tiny shape)."""
    import torch
    from kernels import reference

    cfg = bench_index.IndexBenchConfig(device="cpu", lengths=(256,), num_qo_heads=4, num_kv_heads=1, head_dim=64)
    q, kp, vp, plan, _ = bench_index._inputs(cfg, 256)
    calls = []

    def time_ms(fn):
        calls.append(fn())
        return float(len(calls))

    parts = bench_index.index_parts(q, kp, vp, plan, time_ms)
    assert parts["nnz"] == reference.build_index(q, kp, vp, plan).nnz > 0
    assert [parts[k] for k in ("means_ms", "select_ms", "total_ms", "total_sync_ms")] == [1.0, 2.0, 3.0, 4.0]
    means, kbar_q = calls[0]
    assert means.kbar.dtype == torch.float32 and kbar_q.dtype == q.dtype
    # select and total ran with capacity = nnz (no read-back), total_sync sized the CSR itself
    assert calls[1][0].kv_tiles.numel() == calls[2][0].kv_tiles.numel() == calls[3].kv_tiles.numel() == parts["nnz"]
    assert torch.equal(calls[2][0].seg_offsets, calls[3].seg_offsets)


def test_index_sweep_cpu_smoke(tmp_path):
    """``--sweep`` times every launch variant (the maxnreg cap is a no-op under the interpreter)."""
    out = tmp_path / "index.json"
    bench_index.main(["--cpu-smoke", "--sweep", "--out", str(out)])
    (row,) = json.loads(out.read_text())["rows"]
    assert len(row["sweep"]) == len(bench_index.SWEEP)
    assert {s["launch"]["score_maxnreg"] for s in row["sweep"]} >= {None, 168}
    assert all(s["select_ms"] > 0 for s in row["sweep"])
