"""CPU smoke runs of the operator benchmarks that share bench_operator's inputs:
benchmarks/bench_operator.py, bench_cutlass.py, profile_cutlass.py and tune_kernels.py.

Each runs its ``--cpu-smoke`` mode in-process (the Triton interpreter, a 4/1-head d=64 case at
L=256) and checks the JSON it writes: rows, checks against the reference, what was skipped and
why. A helper renamed under a script fails here, not on the next GPU run."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

import bench_cutlass  # noqa: E402
import bench_operator  # noqa: E402
import profile_cutlass  # noqa: E402
import tune_kernels  # noqa: E402
from kernels import cutlass_build  # noqa: E402


@pytest.fixture(autouse=True)
def _interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def test_operator_cpu_smoke_bf16_and_fp8_rows(tmp_path, capsys):
    out = tmp_path / "operator.json"
    bench_operator.main(["--cpu-smoke", "--fp8", "--out", str(out)])
    data = json.loads(out.read_text())
    assert data["config"]["device"] == "cpu"
    assert (data["config"]["num_qo_heads"], data["config"]["num_kv_heads"], data["config"]["head_dim"]) == (4, 1, 64)
    rows = data["rows"]
    assert [(r.get("dtype"), r.get("v_layout")) for r in rows] == [
        ("bfloat16", None), ("fp8_e4m3", "row_major"), ("fp8_e4m3", "token_major")]
    bf16 = rows[0]
    # every step ran: a failed step leaves its name in "errors" (the CPU run skips FlexAttention's launch only)
    assert bf16["errors"] == {"flex": "skipped: needs CUDA"}
    assert bf16["check"] == "reference" and bf16["check_ok"] is True and bf16["finite"] is True
    assert bf16["index_backend"] == "triton" and bf16["num_splits"] >= 1
    assert 0.0 < bf16["density"] <= 1.0 and bf16["nnz_tiles"] > 0
    assert 0.0 <= bf16["flex_mask_sparsity"] < 100.0
    for key in ("index_ms", "attention_ms", "attention_nocorr_ms", "total_ms", "dense_triton_ms"):
        assert bf16[key] > 0, key
    for r in rows[1:]:
        assert r["errors"] == {} and r["check_ok"] is True and r["check"] == "bf16"
        assert r["attn_rel_l2_vs_bf16_same_index"] < 5e-2 and r["index_ms"] > 0
    table = capsys.readouterr().out.split("wrote ")[-1]
    assert "token_major" in table and "row_major" in table and "reference" in table


def test_operator_rejects_cutlass_kernel_without_cutlass(capsys):
    with pytest.raises(SystemExit):
        bench_operator.parse_args(["--cutlass-kernel", next(iter(cutlass_build.KERNELS))])
    assert "--cutlass-kernel" in capsys.readouterr().err


def test_cutlass_cpu_smoke_stops_at_the_device_and_merges(tmp_path):
    out = tmp_path / "operator.json"
    old_cutlass = {"kernel": "cutlass", "dtype": "bfloat16", "batch": 1, "seqlen": 256, "target_density": None,
                   "attention_ms": -1.0}
    triton_row = {"kernel": "triton", "dtype": "bfloat16", "batch": 1, "seqlen": 256, "target_density": None}
    out.write_text(json.dumps({"env": {"gpu": "earlier"}, "rows": [triton_row, old_cutlass]}))
    bench_cutlass.main(["--cpu-smoke", "--kernels", "ws128,ws64", "--out", str(out)])
    data = json.loads(out.read_text())
    assert data["env"] == {"gpu": "earlier"}  # bench_operator's env stays; this run's goes to env_cutlass
    assert data["env_cutlass"]["cutlass_library"] is None and data["env_cutlass"]["gpu"] == "cpu"
    assert [r["kernel"] for r in data["rows"]] == ["triton", "cutlass"]  # the old cutlass row replaced
    row = data["rows"][1]
    assert row["errors"]["cutlass"].startswith("skipped:") and "CUDA" in row["errors"]["cutlass"]
    assert set(row["errors"]) == {"cutlass"}
    assert row["check"] == "reference" and row["check_ok"] is True
    assert row["triton_check_err"] <= bench_operator.BenchConfig().check_tol
    assert "attention_ms" not in row  # nothing of CUTLASS's is invented on the CPU
    assert row["triton_attention_ms"] > 0 and row["triton_dense_ms"] > 0 and row["num_splits"] >= 1


def test_cutlass_rejects_unknown_kernel(capsys):
    with pytest.raises(SystemExit):
        bench_cutlass.main(["--cpu-smoke", "--kernels", "ws999"])
    assert "--kernels" in capsys.readouterr().err


def test_profile_cutlass_cpu_smoke(tmp_path):
    out = tmp_path / "case.json"
    profile_cutlass.main(["--cpu-smoke", "--length", "256", "--kernels", "ws128,ws64", "--out", str(out)])
    case = json.loads(out.read_text())
    assert case["device"] == "cpu" and case["shape"] == [4, 1, 64] and case["length"] == 256
    assert case["launched"] == {"ws128": False, "ws64": False}
    assert 0.0 < case["density"] <= 1.0


def test_profile_cutlass_rejects_unknown_kernel(capsys):
    with pytest.raises(SystemExit):
        profile_cutlass.main(["--cpu-smoke", "--kernels", ""])
    assert "--kernels" in capsys.readouterr().err


def test_tune_kernels_cpu_smoke(tmp_path):
    out = tmp_path / "tune.json"
    tune_kernels.main(["--cpu-smoke", "--lengths", "256", "--variants", "nopair", "--index-variants", "pps2",
                       "--flex", "256", "--json", str(out)])
    rows = json.loads(out.read_text())
    assert not [r for r in rows if "error" in r and r["kind"] != "flex"], rows
    attn = {(r["variant"], r["corr"]): r for r in rows if r["kind"] == "attn"}
    assert set(attn) == {("default", True), ("default", False), ("nopair", True), ("nopair", False)}
    assert all(r["finite"] for r in attn.values())
    assert attn[("default", True)]["d_out"] == 0.0  # the reference column of the diff
    assert attn[("nopair", True)]["d_out"] <= bench_operator.BenchConfig().check_tol
    assert [r["variant"] for r in rows if r["kind"] == "prepass"] == ["cast+bits"]
    assert [r.get("error") for r in rows if r["kind"] == "flex"] == ["skipped: needs CUDA"]
    index = {r["variant"]: r for r in rows if r["kind"] == "index"}
    assert set(index) == {"means", "default", "pps2"}
    assert index["default"]["same_csr"] is True and index["pps2"]["same_csr"] is True


def test_tune_kernels_rejects_unknown_variant(capsys):
    with pytest.raises(SystemExit):
        tune_kernels.main(["--cpu-smoke", "--variants", "nopair,bogus"])
    assert "bogus" in capsys.readouterr().err
