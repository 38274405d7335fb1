"""Triton kernels for the model's memory-bound elementwise steps (see ``kernels/elementwise.py``).

Both compute what transformers' eager modules compute, step for step and in the same dtypes,
but read each input once and write the output once: eager RMSNorm makes ~9 passes over the
hidden states (an fp32 copy, its square, the mean, the scaling, the cast back, the weight
multiply), eager SiLU-and-multiply three over the ``[T, intermediate]`` activations.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_interpreter import apply_if_interpreting

apply_if_interpreting()  # TRITON_INTERPRET=1: the CPU interpreter's fixes (triton_interpreter.py)

# rows of RMSNorm per program: one row of the usual hidden sizes (4K-16K) fills a program;
# narrow rows (the tiny test models) are packed so a program still moves a few KB
_RMS_ROW_ELEMS = 4096
_SILU_BLOCK = 2048


@triton.jit
def _rms_norm_kernel(
    X, W, Y, n_rows, n_cols, stride_x, stride_y, eps,
    BLOCK_N: tl.constexpr, ROWS: tl.constexpr, SINGLE: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    row_ok = rows < n_rows
    x_rows = X + rows[:, None] * stride_x
    y_rows = Y + rows[:, None] * stride_y
    cols = tl.arange(0, BLOCK_N)
    if SINGLE:  # the whole row in registers: one read, one write
        mask = row_ok[:, None] & (cols[None, :] < n_cols)
        x = tl.load(x_rows + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        inv = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / n_cols + eps)
        normed = (x * inv[:, None]).to(X.dtype.element_ty)  # transformers: .to(input_dtype) first
        w = tl.load(W + cols, mask=cols < n_cols, other=0.0)
        y = w[None, :].to(tl.float32) * normed.to(tl.float32)  # then weight * that, rounded once
        tl.store(y_rows + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)
    else:  # rows wider than a block: sum of squares first, then scale (two reads)
        acc = tl.zeros([ROWS, BLOCK_N], dtype=tl.float32)
        for start in range(0, n_cols, BLOCK_N):
            c = start + cols
            mask = row_ok[:, None] & (c[None, :] < n_cols)
            x = tl.load(x_rows + c[None, :], mask=mask, other=0.0).to(tl.float32)
            acc += x * x
        inv = 1.0 / tl.sqrt(tl.sum(acc, axis=1) / n_cols + eps)
        for start in range(0, n_cols, BLOCK_N):
            c = start + cols
            mask = row_ok[:, None] & (c[None, :] < n_cols)
            x = tl.load(x_rows + c[None, :], mask=mask, other=0.0).to(tl.float32)
            normed = (x * inv[:, None]).to(X.dtype.element_ty)
            w = tl.load(W + c, mask=c < n_cols, other=0.0)
            y = w[None, :].to(tl.float32) * normed.to(tl.float32)
            tl.store(y_rows + c[None, :], y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _silu_mul_kernel(G, U, Y, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(G + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + offs, mask=mask, other=0.0)
    act = (g / (1.0 + tl.exp(-g))).to(U.dtype.element_ty)  # silu(gate) in the input dtype, as eager
    tl.store(Y + offs, (act.to(tl.float32) * u.to(tl.float32)).to(Y.dtype.element_ty), mask=mask)


def rms_norm(x2d: torch.Tensor, weight: torch.Tensor, eps: float, out_dtype: torch.dtype) -> torch.Tensor:
    """``x2d [rows, n]`` with a unit last stride (checked by the caller)."""
    rows, n = x2d.shape
    y = torch.empty((rows, n), dtype=out_dtype, device=x2d.device)
    if rows == 0 or n == 0:
        return y
    block_n = min(triton.next_power_of_2(n), 8192)
    single = block_n >= n
    per_row = max(1, _RMS_ROW_ELEMS // block_n)
    rows_per_program = min(triton.next_power_of_2(per_row), triton.next_power_of_2(rows))
    grid = (triton.cdiv(rows, rows_per_program),)
    _rms_norm_kernel[grid](
        x2d, weight, y, rows, n, x2d.stride(0), y.stride(0), float(eps),
        BLOCK_N=block_n, ROWS=rows_per_program, SINGLE=single, num_warps=8 if block_n >= 2048 else 4,
    )
    return y


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """Contiguous ``gate`` and ``up`` of one shape and dtype (checked by the caller)."""
    y = torch.empty_like(gate)
    n = gate.numel()
    if n:
        _silu_mul_kernel[(triton.cdiv(n, _SILU_BLOCK),)](gate, up, y, n, BLOCK=_SILU_BLOCK, num_warps=4)
    return y


# No FP contraction: with it the compiler narrows the fp32 products to bf16 and fuses one into the
# add (``fma.rn.bf16``), rounding once where eager rounds each product, so ~15% of the elements
# differed from transformers by an ulp on the H200 (bench_elementwise, 2026-12-01). Without it every
# step is a ``.rn`` op (tests/test_elementwise.py checks the sm_90 PTX on CPU).
ROTARY_LAUNCH = {"num_warps": 4, "enable_fp_fusion": False}


@triton.jit
def _rotary_kernel(
    X, Y, COS, SIN, n_heads, stride_xt, stride_xh, stride_yt, stride_yh, stride_ct, stride_st,
    HALF: tl.constexpr, BLOCK_H: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    cols = tl.arange(0, HALF)
    mask = (heads < n_heads)[:, None]
    x_ptr = X + t * stride_xt + heads[:, None] * stride_xh + cols[None, :]
    y_ptr = Y + t * stride_yt + heads[:, None] * stride_yh + cols[None, :]
    x1 = tl.load(x_ptr, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptr + HALF, mask=mask, other=0.0).to(tl.float32)
    c1 = tl.load(COS + t * stride_ct + cols).to(tl.float32)[None, :]
    c2 = tl.load(COS + t * stride_ct + HALF + cols).to(tl.float32)[None, :]
    s1 = tl.load(SIN + t * stride_st + cols).to(tl.float32)[None, :]
    s2 = tl.load(SIN + t * stride_st + HALF + cols).to(tl.float32)[None, :]
    dt = Y.dtype.element_ty
    # transformers: q * cos + rotate_half(q) * sin, each product and the sum rounded to q's dtype
    # (rotate_half(q) = cat(-q2, q1): exact)
    y1 = (x1 * c1).to(dt).to(tl.float32) + (-x2 * s1).to(dt).to(tl.float32)
    y2 = (x2 * c2).to(dt).to(tl.float32) + (x1 * s2).to(dt).to(tl.float32)
    tl.store(y_ptr, y1.to(dt), mask=mask)
    tl.store(y_ptr + HALF, y2.to(dt), mask=mask)


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x [T, H, d]`` (unit last stride), ``cos``/``sin`` ``[T, d]`` (unit last stride), d even and
    d/2 a power of two (checked by the caller) -> a new contiguous ``[T, H, d]``."""
    t, h, d = x.shape
    y = torch.empty((t, h, d), dtype=x.dtype, device=x.device)
    if t == 0 or h == 0:
        return y
    block_h = min(triton.next_power_of_2(h), max(1, 4096 // d))
    _rotary_kernel[(t, triton.cdiv(h, block_h))](
        x, y, cos, sin, h, x.stride(0), x.stride(1), y.stride(0), y.stride(1), cos.stride(0), sin.stride(0),
        HALF=d // 2, BLOCK_H=block_h, **ROTARY_LAUNCH,
    )
    return y
