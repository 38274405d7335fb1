"""The FP8 activation quantization's division (``kernels.triton_fp8_gemm._div_by_descale``: a shared
reciprocal and two remainder corrections instead of an IEEE division per element) against IEEE
division: bit for bit in float32 for quotients from 2^-66 up, and after the e4m3 rounding
everywhere (random quotients over float32's whole exponent range, subnormal values and descales,
exact quotients and e4m3 ties, -0, inf descales). Then the kernels that use it
(``quantize_activation``, ``silu_mul_quant``) on the edge values, against the PyTorch reference.
On CPU the interpreter's ``tl.fma`` is made a single rounding (``triton_interpreter.fma32``,
tested here against exact rationals); the ``gpu`` tests run the compiled kernel."""

from __future__ import annotations

import os
from fractions import Fraction

import numpy as np
import pytest
import torch
import triton
import triton.language as tl

from kernels import fp8_gemm
from kernels import triton_fp8_gemm as tfg
from kernels.triton_interpreter import fma32

needs_triton = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
                                  reason="Triton needs CUDA or TRITON_INTERPRET=1")
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
E4M3 = torch.float8_e4m3fn


@triton.jit
def _div_kernel(X, S, Y, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    x = tl.load(X + offs, mask=ok, other=0.0)
    s = tl.load(S + offs, mask=ok, other=1.0)
    tl.store(Y + offs, tfg._div_by_descale(x, s), mask=ok)


def _divide(x: torch.Tensor, s: torch.Tensor, device: str) -> torch.Tensor:
    x, s = x.to(device).contiguous(), s.to(device).contiguous()
    y = torch.empty_like(x)
    _div_kernel[(triton.cdiv(x.numel(), 1024),)](x, s, y, x.numel(), BLOCK=1024)
    return y.cpu()


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.int32), b.view(torch.int32))


def _descales(n: int, g: torch.Generator) -> torch.Tensor:
    """Descales as the quantization makes them: max(amax / 448, tiny), amax over many magnitudes."""
    amax = torch.rand(n, generator=g) * torch.exp2(torch.randint(-140, 125, (n,), generator=g).float())
    return torch.clamp(amax / 448.0, min=torch.finfo(torch.float32).tiny)


@needs_triton
@pytest.mark.parametrize("device", DEVICES)
def test_division_equals_ieee_bit_for_bit(device):
    g = torch.Generator().manual_seed(0)
    n = 200_000
    s = _descales(n, g)
    # quotients in [-448, 448] as the quantization sees them (|x| <= amax), plus tiny ones
    x = (torch.rand(n, generator=g) * 2 - 1) * s * 448.0 * torch.exp2(-torch.randint(0, 40, (n,), generator=g).float())
    x[::7] = x[::7] * 2.0**-100  # subnormal values (and quotients under 2^-66)
    got, want = _divide(x, s, device), x / s
    assert (want[::7] != 0).any() and (x[::7].abs() < torch.finfo(torch.float32).tiny).any()
    normal = want.abs() >= 2.0**-66
    assert normal.float().mean() > 0.5
    assert _same_bits(got[normal], want[normal])
    assert torch.equal(got.to(E4M3).view(torch.uint8), want.to(E4M3).view(torch.uint8))


@needs_triton
@pytest.mark.parametrize("device", DEVICES)
def test_division_edge_values(device):
    tiny = torch.finfo(torch.float32).tiny
    s = torch.tensor([3.0, 3.0, 3.0, 3.0, 1.5, 7.0, 2.0**100, 2.0**100, float("inf"), float("inf"), float("inf"),
                      tiny, tiny, 1.0, 0.3])
    x = torch.tensor([3.1875, -3.1875, 0.0, -0.0, 1.5 * 1.0625, 7.0 * 448.0, 2.0**-133, -(2.0**-133), 5.0, -5.0,
                      float("inf"), tiny * 448.0, -tiny, float("nan"), 0.3 * 0.1])
    got, want = _divide(x, s, device), x / s
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(got), nan) and nan.sum() == 2  # inf / inf, NaN / 1
    exact = ~nan
    exact[6:8] = False  # quotients under 2^-66: float32 may differ, not e4m3
    assert _same_bits(got[exact], want[exact]), (got, want)
    assert torch.equal(got[~nan].to(E4M3).view(torch.uint8), want[~nan].to(E4M3).view(torch.uint8))


def test_fma32_rounds_once():
    rng = np.random.default_rng(1)
    n = 4000
    x = (rng.standard_normal(n) * np.exp2(rng.integers(-30, 30, n))).astype(np.float32)
    y = (rng.standard_normal(n) * np.exp2(rng.integers(-30, 30, n))).astype(np.float32)
    z = (-(x.astype(np.float64) * y) * (1 + rng.standard_normal(n) * 2.0**-20)).astype(np.float32)  # cancellation
    got = fma32(x, y, z)
    for i in range(n):
        exact = Fraction(float(x[i])) * Fraction(float(y[i])) + Fraction(float(z[i]))
        # the float32 nearest the exact value (ties to even), by rounding through float64's exact neighbours
        near = np.float32(float(exact))
        cands = (np.nextafter(near, np.float32(-np.inf)), near, np.nextafter(near, np.float32(np.inf)))
        best = min(cands, key=lambda c: (abs(Fraction(float(c)) - exact), int(np.array(c).view(np.int32)) & 1))
        assert np.array(got[i]).view(np.int32) == np.array(best).view(np.int32), (x[i], y[i], z[i])


@needs_triton
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("group", [None, 128])
def test_quantization_kernels_on_edge_values(device, group):
    """-0, an inf in a group (its descale inf), values far under their group's amax, e4m3 ties:
    the Triton quantization and the fused SiLU-mul quantization equal the reference bit for bit."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(6, 256, generator=g) * torch.exp2(torch.randint(-20, 20, (6, 1), generator=g).float())
    x[0, :7] = torch.tensor([-0.0, 0.0, -0.0, 2.0**-133, -(2.0**-133), 1e-30, -1e-30])
    x[0, 8] = 3.0e37  # the rest of the row's first group is far under its amax
    x[1, 3] = float("inf")
    # descale exactly 3 (amax 1344) and quotients on e4m3 ties (1 + (2k + 1) / 16) * 2^e, both signs
    ties = torch.tensor([(1 + (2 * k + 1) / 16) * 2.0**e for k in range(8) for e in range(-6, 8)])
    x[2, 0], x[2, 1:113] = 1344.0, 3.0 * ties * (1 - 2 * (torch.arange(112) % 2))
    x = x.to(torch.float32)
    got = fp8_gemm.quantize_activation(x.to(device), group, backend="triton")
    want = fp8_gemm.quantize_activation_reference(x, group)
    assert torch.equal(got.x8.cpu().view(torch.uint8), want.x8.view(torch.uint8))
    assert torch.equal(got.scale.cpu(), want.scale)
    # silu(gate) * up with up carrying the edge values (silu(30) = 30 in float32)
    gate = torch.full_like(x, 30.0)
    act = fp8_gemm.silu_mul_quant(gate.to(device), x.to(device), group, backend="triton")
    ref = fp8_gemm.quantize_activation_reference(torch.nn.functional.silu(gate) * x, group)
    assert torch.equal(act.x8.cpu().view(torch.uint8), ref.x8.view(torch.uint8))
