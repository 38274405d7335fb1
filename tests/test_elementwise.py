"""kernels/elementwise.py: fused RMSNorm and SiLU-and-multiply against transformers' own eager
modules (the contract) and against the references, the Triton kernels under the interpreter on
CPU (CI) and on CUDA (``gpu`` marker)."""

from __future__ import annotations

import os
import subprocess
import sys
import zlib

import pytest
import torch

from kernels import elementwise as ew

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
needs_triton = pytest.mark.skipif(not INTERPRET, reason="Triton on CPU needs TRITON_INTERPRET=1")
# the CUDA cases carry the gpu marker, so `pytest -m gpu` on the device runs them
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA")])]


def test_max_ulps():
    one_ulp_up = torch.tensor([1.0, 2.0]).to(torch.bfloat16), torch.tensor([1.0078125, 2.0]).to(torch.bfloat16)
    # 2**-7 apart at 1.0078125: bf16's eps (2**-7) at that magnitude
    assert ew.max_ulps(*one_ulp_up) == pytest.approx(1 / 1.0078125)
    assert ew.max_ulps(torch.zeros(3), torch.zeros(3)) == 0.0 and ew.max_ulps(torch.empty(0), torch.empty(0)) == 0.0


def _llama_norm(n: int, eps: float, dtype: torch.dtype, device: str, weight: torch.Tensor):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    m = LlamaRMSNorm(n, eps=eps).to(device=device, dtype=weight.dtype)
    with torch.no_grad():
        m.weight.copy_(weight)
    return m


# (shape, dtype, weight dtype): rows of a prefill batch, a narrow head-dim norm (Qwen3's q/k
# norms), a non-power-of-two width, a row wider than one block (two-pass path), a 3-D input
@pytest.mark.parametrize("shape,dtype,wdtype", [
    ((37, 256), torch.bfloat16, torch.bfloat16),
    ((5, 3, 128), torch.float16, torch.float16),
    ((9, 96), torch.float32, torch.float32),
    ((3, 10000), torch.bfloat16, torch.bfloat16),
    ((4, 200), torch.bfloat16, torch.float32),  # promotion: fp32 weight, bf16 rows -> fp32 out
])
@pytest.mark.parametrize("device", DEVICES)
def test_rms_norm_matches_transformers(shape, dtype, wdtype, device):
    if device == "cpu" and not INTERPRET:
        pytest.skip("Triton on CPU needs TRITON_INTERPRET=1")
    gen = torch.Generator().manual_seed(zlib.crc32(repr((shape, dtype, wdtype)).encode()))  # not hash(): salted per process
    x = (torch.randn(shape, generator=gen) * 3 + 0.5).to(dtype).to(device)
    w = (1 + 0.1 * torch.randn(shape[-1], generator=gen)).to(wdtype).to(device)
    eps = 1e-5
    with torch.no_grad():
        expect = _llama_norm(shape[-1], eps, dtype, device, w)(x)
    got = ew.rms_norm(x, w, eps, backend="triton")
    assert got.dtype == expect.dtype == torch.promote_types(wdtype, dtype) and got.shape == x.shape
    # the normalized row rounds to x's dtype before the weight multiply: at most one ulp of that
    # rounding (the sum of squares is reduced in another order), then the same exact multiply; in
    # fp32 nothing hides the reduction order (a few fp32 ulps of the sum, seen up to 2.2 ulps out)
    assert ew.max_ulps(got, expect) <= (2.0 if dtype != torch.float32 else 8.0)
    assert torch.equal(ew.rms_norm(x, w, eps, backend="reference"), expect)  # the reference is eager's math


@pytest.mark.parametrize("shape,dtype", [((33, 300), torch.bfloat16), ((2, 5, 64), torch.float16),
                                         ((7, 50), torch.float32), ((0, 16), torch.bfloat16)])
@pytest.mark.parametrize("device", DEVICES)
def test_silu_mul_matches_eager(shape, dtype, device):
    if device == "cpu" and not INTERPRET:
        pytest.skip("Triton on CPU needs TRITON_INTERPRET=1")
    gen = torch.Generator().manual_seed(7 + len(shape))
    gate = (torch.randn(shape, generator=gen) * 4).to(dtype).to(device)
    up = torch.randn(shape, generator=gen).to(dtype).to(device)
    expect = torch.nn.SiLU()(gate) * up  # what LlamaMLP computes around its linear layers
    got = ew.silu_mul(gate, up, backend="triton")
    assert got.dtype == dtype and got.shape == gate.shape
    if gate.numel():
        assert ew.max_ulps(got, expect) <= 4.0  # exp and the division differ by an ulp or two in fp32


@needs_triton
def test_non_contiguous_inputs_and_auto_on_cpu():
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(64, 40, generator=gen).to(torch.bfloat16)[:, ::2]  # last stride 2
    w = torch.rand(20, generator=gen).to(torch.bfloat16) + 0.5
    assert ew.max_ulps(ew.rms_norm(x, w, 1e-6, backend="triton"), ew.rms_norm_reference(x, w, 1e-6)) <= 2.0
    g = torch.randn(30, 8, generator=gen).t()  # transposed
    u = torch.randn(8, 30, generator=gen)
    assert ew.max_ulps(ew.silu_mul(g, u, backend="triton"), ew.silu_mul_reference(g, u)) <= 2.0
    # auto on CPU is the reference, bit for bit
    assert torch.equal(ew.silu_mul(g, u), ew.silu_mul_reference(g, u))


@pytest.mark.parametrize("call,match", [
    (lambda: ew.rms_norm([1.0], torch.ones(1), 1e-6), "x"),
    (lambda: ew.rms_norm(torch.ones(2, 3, dtype=torch.int32), torch.ones(3), 1e-6), "x"),
    (lambda: ew.rms_norm(torch.ones(2, 3), torch.ones(4), 1e-6), "weight"),
    (lambda: ew.rms_norm(torch.ones(2, 3), torch.ones(1, 3), 1e-6), "weight"),
    (lambda: ew.rms_norm(torch.ones(()), torch.ones(1), 1e-6), "weight"),
    (lambda: ew.rms_norm(torch.ones(2, 3), torch.ones(3), -1.0), "eps"),
    (lambda: ew.rms_norm(torch.ones(2, 3), torch.ones(3), float("nan")), "eps"),
    (lambda: ew.rms_norm(torch.ones(2, 3), torch.ones(3), True), "eps"),
    (lambda: ew.rms_norm(torch.ones(2, 3), torch.ones(3), 1e-6, backend="cuda"), "backend"),
    (lambda: ew.silu_mul(torch.ones(2, 3), torch.ones(3, 2)), "up"),
    (lambda: ew.silu_mul(torch.ones(2, 3), torch.ones(2, 3, dtype=torch.float16)), "up"),
    (lambda: ew.silu_mul("gate", torch.ones(2)), "gate"),
])
def test_bad_arguments_raise(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_triton_backend_refused_on_cpu_without_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        ew.silu_mul(torch.ones(2), torch.ones(2), backend="triton")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_prefill_sized_rows():
    """A 8K-token slice of a Llama-3.1-8B prefill: hidden 4096 (single pass), intermediate 14336."""
    gen = torch.Generator(device="cuda").manual_seed(11)
    x = torch.randn(8192, 4096, device="cuda", generator=gen).to(torch.bfloat16)
    w = (1 + 0.1 * torch.randn(4096, device="cuda", generator=gen)).to(torch.bfloat16)
    assert ew.max_ulps(ew.rms_norm(x, w, 1e-5), ew.rms_norm_reference(x, w, 1e-5)) <= 2.0
    g = torch.randn(8192, 14336, device="cuda", generator=gen).to(torch.bfloat16)
    u = torch.randn(8192, 14336, device="cuda", generator=gen).to(torch.bfloat16)
    assert ew.max_ulps(ew.silu_mul(g, u), ew.silu_mul_reference(g, u)) <= 2.0


# ----------------------------------------------------------------------------- rotary
def _cos_sin(positions: torch.Tensor, d: int, dtype: torch.dtype, base: float = 500000.0):
    """As transformers' LlamaRotaryEmbedding builds them: cat(freqs, freqs), cos/sin in fp32, cast."""
    inv_freq = 1.0 / (base ** (torch.arange(0, d, 2, dtype=torch.float) / d))
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


@pytest.mark.parametrize("t,hq,hkv,d,dtype", [
    (40, 4, 2, 64, torch.bfloat16), (7, 3, 1, 128, torch.float16), (19, 2, 2, 32, torch.float32), (0, 2, 1, 64, torch.bfloat16)])
@pytest.mark.parametrize("device", DEVICES)
def test_rotary_matches_transformers(t, hq, hkv, d, dtype, device):
    if device == "cpu" and not INTERPRET:
        pytest.skip("Triton on CPU needs TRITON_INTERPRET=1")
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    gen = torch.Generator().manual_seed(t * 131 + d)
    q = (torch.randn(t, hq, d, generator=gen) * 2).to(dtype).to(device)
    k = torch.randn(t, hkv, d, generator=gen).to(dtype).to(device)
    positions = torch.randint(0, 131072, (t,), generator=gen)  # packed sequences: any positions
    cos, sin = (c.to(device) for c in _cos_sin(positions, d, dtype))
    # transformers' layout: [1, H, T, d] and cos/sin [1, T, d]
    eq, ek = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos[None], sin[None])
    got_q = ew.rotary(q, cos, sin, backend="triton")
    got_k = ew.rotary(k, cos, sin, backend="triton")
    assert got_q.is_contiguous() and got_q.shape == q.shape and got_q.dtype == dtype
    if t:
        # the same products and sum, each rounded to the dtype: bit for bit
        assert torch.equal(got_q, eq[0].transpose(0, 1)) and torch.equal(got_k, ek[0].transpose(0, 1))
        assert torch.equal(ew.rotary(q, cos, sin, backend="reference"), eq[0].transpose(0, 1))


@needs_triton
def test_rotary_strided_input():
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(9, 16, 3, generator=gen).to(torch.bfloat16).permute(0, 2, 1)  # [9, 3, 16], last stride 3
    cos, sin = _cos_sin(torch.arange(9), 16, torch.bfloat16)
    assert torch.equal(ew.rotary(x, cos, sin, backend="triton"), ew.rotary_reference(x, cos, sin))


@pytest.mark.parametrize("call,match", [
    (lambda: ew.rotary(torch.ones(2, 3, 4, 8), torch.ones(2, 8), torch.ones(2, 8)), "x"),
    (lambda: ew.rotary(torch.ones(2, 3, 8), torch.ones(3, 8), torch.ones(2, 8)), "cos"),
    (lambda: ew.rotary(torch.ones(2, 3, 8), torch.ones(2, 8), torch.ones(2, 4)), "sin"),
    (lambda: ew.rotary(torch.ones(2, 3, 8), torch.ones(2, 8, dtype=torch.float16), torch.ones(2, 8)), "cos"),
    (lambda: ew.rotary(torch.ones(2, 3, 96), torch.ones(2, 96), torch.ones(2, 96)), "head_dim"),
    (lambda: ew.rotary(torch.ones(2, 3, 7), torch.ones(2, 7), torch.ones(2, 7)), "head_dim"),
])
def test_rotary_bad_arguments_raise(call, match):
    with pytest.raises(ValueError, match=match):
        call()


_PTX_CHECK = r"""
import re, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kernels import triton_elementwise as te
for dtype in ("bf16", "fp16"):
    sig = {"X": f"*{dtype}", "Y": f"*{dtype}", "COS": f"*{dtype}", "SIN": f"*{dtype}",
           **{n: "i32" for n in ("n_heads", "stride_xt", "stride_xh", "stride_yt", "stride_yh", "stride_ct", "stride_st")},
           "HALF": "constexpr", "BLOCK_H": "constexpr"}
    compiled = triton.compile(ASTSource(fn=te._rotary_kernel, signature=sig, constexprs={"HALF": 64, "BLOCK_H": 32}),
                              target=GPUTarget("cuda", 90, 64), options=dict(te.ROTARY_LAUNCH))
    ops = [line.split()[0] for line in compiled.asm["ptx"].splitlines()
           if re.match(r"\s*(add|sub|mul|fma)\.\S*(f16|f32)\b", line)]
    print(dtype, " ".join(ops))
"""


def test_rotary_ptx_rounds_every_step():
    """The rotary kernel as built for the H200 (sm_90 PTX, compiled here on CPU, in a process of
    its own: the interpreter's patches of triton.language break real compiles): no fused
    multiply-add and every float add/mul carries ``.rn``, which ptxas may not contract, so each
    product is rounded before the sum as in eager (with FP contraction on, the compiler emitted
    ``fma.rn.bf16`` and the H200 results differed from transformers by an ulp)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", _PTX_CHECK], cwd=os.path.dirname(os.path.dirname(__file__)),
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = dict(line.split(" ", 1) for line in proc.stdout.splitlines())
    assert set(lines) == {"bf16", "fp16"}
    for dtype, ops in lines.items():
        ops = ops.split()
        assert ops and not any(op.startswith("fma") for op in ops), (dtype, ops)
        assert all(".rn." in op for op in ops), (dtype, sorted(set(ops)))
