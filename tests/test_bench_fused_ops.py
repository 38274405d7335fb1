"""benchmarks/bench_fused_ops.py: the CPU smoke run (the real kernels under the interpreter, each
fused op checked byte for byte against its unfused sequence), the table, argument errors."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_fused_ops as bench  # noqa: E402


def test_cpu_smoke_run(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    out = tmp_path / "fused.json"
    bench.main(["--cpu-smoke", "--tokens", "37", "--out", str(out)])
    result = json.loads(out.read_text())
    assert [(r["op"], r["variant"]) for r in result["rows"]] == [
        ("silu_mul_quant", "group128"), ("silu_mul_quant", "per_token"), ("rms_norm_quant", "group128"),
        ("rms_norm", "bf16"), ("rope_kv", "bf16_pool"), ("rope_kv", "e4m3_pool")]
    assert all(r["equal"] for r in result["rows"])
    assert result["config"]["tokens"] == 37 and result["copy_gbps"] > 0
    s = bench.SMOKE_SHAPE
    silu = result["rows"][0]
    assert silu["gbytes"] == pytest.approx(37 * s.intermediate * 5 / 1e9 + 37 * (s.intermediate // 128) * 4 / 1e9)
    for r in result["rows"]:
        assert r["fused_ms"] > 0 and r["x_copy"] == pytest.approx(r["fused_ms"] / r["roofline_ms_copy"])
        assert r["x_h200"] == pytest.approx(r["fused_ms"] / r["roofline_ms_h200"])
        assert (r["unfused_ms"] is None) == (r["op"] == "rms_norm")
    printed = capsys.readouterr().out
    assert "| rope_kv | e4m3_pool |" in printed and "| rms_norm | bf16 |" in printed


@pytest.mark.parametrize("argv,match", [(["--tokens", "0"], "--tokens"), (["--tokens", "x"], "--tokens")])
def test_bad_arguments(argv, match, capsys):
    with pytest.raises(SystemExit):
        bench.main(argv)
    assert match in capsys.readouterr().err


def test_cpu_smoke_needs_the_interpreter(monkeypatch, capsys):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(SystemExit):
        bench.main(["--cpu-smoke"])
    assert "TRITON_INTERPRET=1" in capsys.readouterr().err


def test_differences_name_the_part_the_count_and_the_distance():
    import torch

    gen = torch.Generator().manual_seed(7)
    y = torch.randn(4, 256, generator=gen).to(torch.bfloat16)
    x8 = torch.randn(4, 256, generator=gen).to(torch.float8_e4m3fn)
    scale = torch.rand(4, 2, generator=gen) + 0.5
    act = bench.fp8_gemm.Fp8Activation(x8, scale, 128)
    assert bench.differences((y, act), (y.clone(), bench.fp8_gemm.Fp8Activation(x8.clone(), scale.clone(), 128))) == ""
    y2 = y.clone()
    y2[1, 3] = y2[1, 3] + 1.0  # one element of y off by 1 (in bf16: exactly 1 at these magnitudes or a rounding of it)
    scale2 = scale.clone()
    scale2[2, 1] = scale2[2, 1] * 2
    got = bench.differences((y, act), (y2, bench.fp8_gemm.Fp8Activation(x8, scale2, 128)))
    diff_y = float((y[1, 3].float() - y2[1, 3].float()).abs())
    assert got == f"part 0: 1 of 1024 differ, max |diff| {diff_y:.3g}; part 2: 1 of 8 differ, max |diff| {float(scale[2, 1]):.3g}"
    assert bench.differences(y, y[:2]) == "part 0: shape (4, 256) vs (2, 256)"


def test_rms_norm_quant_agrees_within_two_ulps_and_on_its_own_quantization(monkeypatch):
    import torch

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    fp8 = bench.fp8_gemm
    gen = torch.Generator().manual_seed(11)
    y = (torch.randn(3, 256, generator=gen) * 3).to(torch.bfloat16)
    act = fp8.quantize_activation(y, 128, backend="reference")
    # one ulp of each element by hand: bf16 keeps 8 significant bits, |y| in [2^(e-1), 2^e) -> 2^(e-8)
    e = torch.floor(torch.log2(y.float().abs())) + 1
    away = torch.sign(y.float()) * torch.pow(2.0, e - 8)  # away from zero: the reference's binade, so its ulp

    def moved(k):
        return (y.float() + k * away).to(torch.bfloat16)

    assert bench.ulps_apart(moved(1), y) == 1.0 and bench.ulps_apart(y[:2], y) == float("inf")
    assert bench.Y_ULPS == 2  # one rounding apart upstream, one more in the product with the weight
    assert bench.rms_norm_quant_agrees((y, act), (moved(2), None))  # y_ref 2 ulps away
    assert not bench.rms_norm_quant_agrees((moved(3), fp8.quantize_activation(moved(3), 128, backend="reference")),
                                           (y, None))
    wrong = fp8.Fp8Activation(act.x8, act.scale * 2, 128)  # a quantization that is not y's
    assert not bench.rms_norm_quant_agrees((y, wrong), (y, None))


def test_rms_norm_quant_explain_names_the_failing_half(monkeypatch):
    import torch

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    fp8 = bench.fp8_gemm
    y = torch.tensor([[1.0, -1.5, 3.0, 0.75] * 32], dtype=torch.bfloat16)
    act = fp8.quantize_activation(y, 128, backend="reference")
    two_up = (y.float() + 2 * torch.sign(y.float()) * torch.tensor([2.0 ** -7, 2.0 ** -7, 2.0 ** -6, 2.0 ** -8] * 32)
              ).to(torch.bfloat16)
    assert bench.ulps_apart(two_up, y) == 2.0 and bench.ulps_apart(y, y) == 0.0
    assert bench.rms_norm_quant_explain((y, act), (two_up, None)).startswith("y: at most 2 ulp")
    assert bench.rms_norm_quant_explain((y, act), (y, None)).endswith("its quantization: equal")
    wrong = fp8.Fp8Activation(act.x8, act.scale * 2, 128)
    assert "its quantization: part 1: 1 of 1 differ" in bench.rms_norm_quant_explain((y, wrong), (y, None))
