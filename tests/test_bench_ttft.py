"""benchmarks/bench_ttft.py: the CPU smoke mode end to end, and the density-from-entry-count formula."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_ttft", ROOT / "benchmarks" / "bench_ttft.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["bench_ttft"] = mod
    spec.loader.exec_module(mod)
    return mod


def test_density_from_nnz_matches_evals_density(bench):
    from evals.density import density
    from kernels import ops
    from kernels.config import SparseConfig
    from kernels.paged import contiguous_to_paged
    from kernels.synthetic import structured_qkv

    batch, length = 2, 512
    q, k, v = structured_qkv(length, batch=batch, num_qo_heads=8, num_kv_heads=2, head_dim=64,
                             target_density=0.3, dtype=torch.float32, device="cpu", seed=0)
    cfg = SparseConfig(block_size=64, sink_tokens=64, window_tokens=64)
    k_pages, table = contiguous_to_paged(k, 64)
    v_pages, _ = contiguous_to_paged(v, 64)
    cu = torch.arange(0, (batch + 1) * length, length, dtype=torch.int32)
    seqlens = torch.full((batch,), length, dtype=torch.int32)
    qf = q.reshape(batch * length, 8, 64)
    plan = ops.plan_prefill(qf, k_pages, v_pages, table, cu, seqlens, cfg)
    index = ops.build_index_planned(qf, k_pages, v_pages, plan, backend="reference")
    exact = density(index, plan)
    assert exact < 0.9  # a real test of the formula, not the all-kept case
    (derived,) = bench.density_from_nnz(plan, [index.nnz])
    assert derived == pytest.approx(exact, abs=1e-12)


def test_cpu_smoke_run(bench, tmp_path):
    out = tmp_path / "ttft.json"
    result = bench.main(["--device", "cpu", "--quick", "--out", str(out)])
    saved = json.loads(out.read_text())
    assert saved["rows"] == json.loads(json.dumps(result["rows"]))
    assert [w["ok"] for w in saved["warmup"]] == [True, True]
    rows = saved["rows"]
    assert [(r["model"], r["batch"], r["seqlen"]) for r in rows] == [("random", 1, 256), ("structured", 1, 256)]
    for r in rows:
        assert r["status"] == "ok", r["errors"]
        assert r["ttft_ms"] > 0 and r["sdpa_ttft_ms"] > 0 and 0 < r["density"] <= 1
        assert len(r["density_per_layer"]) == 2  # the tiny model's layers
        assert r["first_tokens_match"] == 1.0
    assert all(r["fused_ops"] == "auto" and r["fused_counts"] == {"rms_norm": 0, "silu_mul": 0, "rotary": 0} for r in rows)  # CPU
    assert rows[0]["decode_ms_per_step"] > 0 and rows[0]["sdpa_decode_ms_per_step"] > 0
    assert "note" in rows[0] and "random weights" in rows[0]["note"]


def test_cpu_smoke_run_with_fused_ops(bench, tmp_path, monkeypatch):
    """--fused-ops on: our runner's norms and MLPs run the Triton kernels (interpreter), the sdpa
    baseline the eager modules again, and the first tokens still match."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    out = tmp_path / "ttft.json"
    result = bench.main(["--device", "cpu", "--quick", "--models", "random", "--skip-decode", "--fused-ops", "on",
                         "--out", str(out)])
    (row,) = result["rows"]
    assert row["status"] == "ok", row["errors"]
    assert row["fused_ops"] == "on" and row["fused_counts"] == {"rms_norm": 5, "silu_mul": 2, "rotary": 2}  # 2 layers + final norm
    assert row["first_tokens_match"] == 1.0 and row["sdpa_ttft_ms"] > 0


def test_sdpa_baseline_runs_stock_transformers(bench):
    from model_executor import build_tiny_model, fused

    model = build_tiny_model(seed=0).model
    fused.install(model)
    assert fused.installed(model)["rms_norm"] > 0
    bench.Sdpa(model, torch.device("cpu"))
    assert fused.installed(model) == {"rms_norm": 0, "silu_mul": 0, "rotary": 0}


def test_cpu_smoke_run_weight_dtypes(bench, tmp_path):
    """--weight-dtype: a row per weight dtype (bf16 first, whatever the order asked), FP8 rows
    with their logits' error against the bf16 row and the runner's memory report."""
    out = tmp_path / "ttft.json"
    result = bench.main(["--device", "cpu", "--quick", "--models", "random", "--skip-decode",
                         "--weight-dtype", "fp8_block,bf16,fp8_channel", "--out", str(out)])
    rows = result["rows"]
    assert [r["weight_dtype"] for r in rows] == ["bf16", "fp8_block", "fp8_channel"]
    assert [w["weight_dtype"] for w in result["warmup"]] == ["bf16", "fp8_block", "fp8_channel"]
    assert all(r["status"] == "ok" for r in rows), [r["errors"] for r in rows]
    assert "logits_vs_bf16" not in rows[0] and rows[0]["memory"]["fp8_layers"] == 0
    for r in rows[1:]:
        err = r["logits_vs_bf16"]
        assert 0 < err["max_abs"] and 0 < r["logits_rel_vs_bf16"] < 1 and 0 <= r["first_tokens_match_bf16"] <= 1
        assert r["memory"]["fp8_layers"] == 2 * 7 and r["memory"]["pages_freed_by_fp8"] > 0
        assert r["fp8_counts"]["fp8_linear"] == 14
        assert r["sdpa_ttft_ms"] > 0 and r["first_tokens_match"] == 1.0  # sdpa on the same FP8 weights
    assert "weights" in bench.table(rows).splitlines()[0]
    assert json.loads(out.read_text())["config"]["weight_dtypes"] == ["bf16", "fp8_block", "fp8_channel"]


def test_weight_dtype_option_errors(bench):
    with pytest.raises(SystemExit):
        bench.parse_args(["--device", "cpu", "--weight-dtype", "int8"])
    with pytest.raises(SystemExit):
        bench.parse_args(["--device", "cpu", "--weight-dtype", ","])


def test_rebuilt_models_hold_the_same_weights(bench):
    """FP8 rows rebuild the model from its seed: the bf16 comparison needs the same weights."""
    cfg, _ = bench.parse_args(["--device", "cpu"])
    for kind in ("structured", "random"):
        a = bench.build_model(kind, cfg, torch.device("cpu")).state_dict()
        torch.manual_seed(123)  # whatever the global RNG holds in between
        b = bench.build_model(kind, cfg, torch.device("cpu")).state_dict()
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
