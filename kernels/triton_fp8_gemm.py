"""Triton kernels of the FP8 linear layers (``kernels/fp8_gemm.py`` validates and dispatches):

- ``quantize_rows``: dynamic e4m3 quantization of ``x [M, K]`` per token or per (token, 128-wide
  group), one read of ``x``: amax, descale ``max(amax / 448, tiny)`` and the quantized values
  in one program per (row block, group);
- ``rms_norm_quant``: transformers' RMSNorm (``triton_elementwise``'s rounding: the normalized row
  rounded to ``x``'s dtype, times the weight, rounded once) whose result is also quantized as
  ``quantize_rows`` would, from the registers: the whole row in one program (``n <= MAX_ROW``);
- ``silu_mul_quant``: ``triton_elementwise``'s SiLU-and-multiply (the same rounding: silu in the
  input dtype, the product rounded once to it) quantized as ``quantize_rows`` would, without
  writing the product: the down projection reads only the e4m3 values and their descales
  (one read of gate and up, one byte written per element, where SiLU-mul then quantize reads
  and writes the ``[T, intermediate]`` product once more); the whole row in one program;
- ``scaled_mm``: ``(x8 * sa) @ (w8 * sb).T`` with float32 accumulation of e4m3 ``tl.dot``
  products; ``k_scaled``: the scales change every 128-wide K step (block scheme: ``sa [M, K/128]``,
  ``sb [ceil(N/128), K/128]``), applied to each step's partial product; otherwise per token
  ``sa [M, 1]`` and per channel ``sb [N, 1]``, applied once to the sum. bf16 (or the asked dtype)
  output, optional bias;
- ``rotary_amax``: ``triton_elementwise``'s rotary kernel (the same bits) with ``max |y|`` reduced
  by an integer atomic max on the float32 bit pattern (non-negative floats order as integers).

Quantization matches ``kernels.fp8.quantize`` bit for bit: IEEE division (``div_rn``), clamp to
+-448 with NaN kept, round to nearest even. Not supported: FP8 outputs of the GEMM, K not a
multiple of 128 in the block scheme (the caller checks), autotuning (fixed tiles).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_interpreter import apply_if_interpreting

apply_if_interpreting()  # TRITON_INTERPRET=1: the CPU interpreter's fixes (triton_interpreter.py)

FP8_MAX_C = tl.constexpr(torch.finfo(torch.float8_e4m3fn).max)
TINY_C = tl.constexpr(torch.finfo(torch.float32).tiny)
MAX_ROW = 16384  # widest row rms_norm_quant holds in one program (hidden sizes up to 16K)
_ROW_ELEMS = 4096  # rows per program are packed up to this many elements
GROUP = 128  # kernels.fp8_gemm.BLOCK (this module imports nothing of its caller)
# No FP contraction in the rotary kernel: the rounding of each product must be eager's (see
# kernels/triton_elementwise.py ROTARY_LAUNCH)
_ROTARY_LAUNCH = {"num_warps": 4, "enable_fp_fusion": False}


@triton.jit
def _quantize_tile(x, G: tl.constexpr, NG: tl.constexpr, ROWS: tl.constexpr):
    """fp32 ``x [ROWS, NG * G]`` -> (e4m3 ``[ROWS, NG * G]``, descales ``[ROWS, NG]``)."""
    xg = tl.reshape(x, (ROWS, NG, G))
    amax = tl.max(tl.abs(xg), axis=2)
    scale = tl.maximum(tl.math.div_rn(amax, FP8_MAX_C), TINY_C)
    y = tl.math.div_rn(xg, scale[:, :, None])
    y = tl.clamp(y, -FP8_MAX_C, FP8_MAX_C, propagate_nan=tl.PropagateNan.ALL)
    return tl.reshape(y, (ROWS, NG * G)).to(tl.float8e4nv), scale


@triton.jit
def _quantize_rows_kernel(X, Q, S, n_rows, n_cols, stride_x, stride_q, stride_s,
                          G: tl.constexpr, ROWS: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    grp = tl.program_id(1)
    cols = grp * G + tl.arange(0, G)
    mask = (rows < n_rows)[:, None] & (cols < n_cols)[None, :]
    x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    q, scale = _quantize_tile(x, G, 1, ROWS)
    tl.store(Q + rows[:, None] * stride_q + cols[None, :], q, mask=mask)
    tl.store(S + rows * stride_s + grp, tl.reshape(scale, (ROWS,)), mask=rows < n_rows)


def _rows_per_program(width: int, rows: int) -> int:
    return min(triton.next_power_of_2(max(1, _ROW_ELEMS // width)), triton.next_power_of_2(max(rows, 1)))


def quantize_rows(x: torch.Tensor, group: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [M, K]`` (unit last stride) -> ``(x8 [M, K], scale [M, 1 or K/128])``."""
    m, k = x.shape
    ng = 1 if group is None else k // group
    q = torch.empty((m, k), dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty((m, ng), dtype=torch.float32, device=x.device)
    if m == 0:
        return q, s
    if k == 0:
        return q, s.fill_(TINY_C.value)
    g = triton.next_power_of_2(k) if group is None else group
    rows = _rows_per_program(g, m)
    _quantize_rows_kernel[(triton.cdiv(m, rows), ng)](
        x, q, s, m, k, x.stride(0), q.stride(0), s.stride(0), G=g, ROWS=rows,
        num_warps=8 if g * rows >= 4096 else 4,
    )
    return q, s


@triton.jit
def _rms_norm_quant_kernel(X, W, Y, Q, S, n_rows, n_cols, stride_x, stride_y, stride_q, stride_s, eps,
                           BLOCK_N: tl.constexpr, G: tl.constexpr, NG: tl.constexpr, ROWS: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    row_ok = rows < n_rows
    cols = tl.arange(0, BLOCK_N)
    mask = row_ok[:, None] & (cols[None, :] < n_cols)
    x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / n_cols + eps)
    normed = (x * inv[:, None]).to(X.dtype.element_ty)  # transformers: .to(input_dtype) first
    w = tl.load(W + cols, mask=cols < n_cols, other=0.0)
    y = (w[None, :].to(tl.float32) * normed.to(tl.float32)).to(Y.dtype.element_ty)
    tl.store(Y + rows[:, None] * stride_y + cols[None, :], y, mask=mask)
    # quantize what was stored (y in its dtype), padding columns are zeros
    q, scale = _quantize_tile(tl.where(mask, y.to(tl.float32), 0.0), G, NG, ROWS)
    tl.store(Q + rows[:, None] * stride_q + cols[None, :], q, mask=mask)
    gs = tl.arange(0, NG)
    tl.store(S + rows[:, None] * stride_s + gs[None, :], scale, mask=row_ok[:, None] & (gs[None, :] < NG))


def rms_norm_quant(x2d: torch.Tensor, weight: torch.Tensor, eps: float, out_dtype: torch.dtype,
                   group: int | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``x2d [rows, n]`` (unit last stride, ``n <= MAX_ROW``) -> ``(y, x8, scale)``."""
    rows, n = x2d.shape
    ng = 1 if group is None else n // group
    y = torch.empty((rows, n), dtype=out_dtype, device=x2d.device)
    q = torch.empty((rows, n), dtype=torch.float8_e4m3fn, device=x2d.device)
    s = torch.empty((rows, ng), dtype=torch.float32, device=x2d.device)
    if rows == 0 or n == 0:
        return y, q, s.fill_(TINY_C.value)
    block_n = triton.next_power_of_2(n)
    # per token: one group as wide as the padded row; per group (n a multiple of 128): the
    # kernel also scales the all-zero padding groups, into a scratch of block_n / 128 columns
    g, ngs = (block_n, 1) if group is None else (group, block_n // group)
    scales = s if ngs == ng else torch.empty((rows, ngs), dtype=torch.float32, device=x2d.device)
    per = _rows_per_program(block_n, rows)
    _rms_norm_quant_kernel[(triton.cdiv(rows, per),)](
        x2d, weight, y, q, scales, rows, n, x2d.stride(0), y.stride(0), q.stride(0), scales.stride(0), float(eps),
        BLOCK_N=block_n, G=g, NG=ngs, ROWS=per, num_warps=8 if block_n >= 2048 else 4,
    )
    if scales is not s:
        s.copy_(scales[:, :ng])
    return y, q, s


@triton.jit
def _silu_mul_quant_kernel(G_, U, Q, S, n_rows, n_cols, stride_g, stride_u, stride_q, stride_s,
                           BLOCK_N: tl.constexpr, G: tl.constexpr, NG: tl.constexpr, ROWS: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    row_ok = rows < n_rows
    cols = tl.arange(0, BLOCK_N)
    mask = row_ok[:, None] & (cols[None, :] < n_cols)
    g = tl.load(G_ + rows[:, None] * stride_g + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + rows[:, None] * stride_u + cols[None, :], mask=mask, other=0.0)
    dt = U.dtype.element_ty
    act = (g / (1.0 + tl.exp(-g))).to(dt)  # silu(gate) in the input dtype, as eager
    y = (act.to(tl.float32) * u.to(tl.float32)).to(dt)  # the product eager would store
    q, scale = _quantize_tile(tl.where(mask, y.to(tl.float32), 0.0), G, NG, ROWS)
    tl.store(Q + rows[:, None] * stride_q + cols[None, :], q, mask=mask)
    gs = tl.arange(0, NG)
    tl.store(S + rows[:, None] * stride_s + gs[None, :], scale, mask=row_ok[:, None] & (gs[None, :] < NG))


def silu_mul_quant(gate: torch.Tensor, up: torch.Tensor, group: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``gate, up [rows, n]`` of one dtype (unit last strides, ``n <= MAX_ROW``, ``n`` a multiple
    of 128 for ``group=128``) -> ``(x8 [rows, n], scale [rows, 1 or n/128])``."""
    rows, n = gate.shape
    ng = 1 if group is None else n // group
    q = torch.empty((rows, n), dtype=torch.float8_e4m3fn, device=gate.device)
    s = torch.empty((rows, ng), dtype=torch.float32, device=gate.device)
    if rows == 0 or n == 0:
        return q, s.fill_(TINY_C.value)
    block_n = triton.next_power_of_2(n)
    # as rms_norm_quant: the all-zero padding groups are scaled into a scratch and dropped
    g, ngs = (block_n, 1) if group is None else (group, block_n // group)
    scales = s if ngs == ng else torch.empty((rows, ngs), dtype=torch.float32, device=gate.device)
    per = _rows_per_program(block_n, rows)
    _silu_mul_quant_kernel[(triton.cdiv(rows, per),)](
        gate, up, q, scales, rows, n, gate.stride(0), up.stride(0), q.stride(0), scales.stride(0),
        BLOCK_N=block_n, G=g, NG=ngs, ROWS=per, num_warps=16 if block_n >= 8192 else 8 if block_n >= 2048 else 4,
    )
    if scales is not s:
        s.copy_(scales[:, :ng])
    return q, s


@triton.jit
def _scaled_mm_kernel(A, SA, B, SB, C, BIAS, M, N, K,
                      stride_am, stride_bn, stride_sam, stride_sak, stride_sbn, stride_sbk, stride_cm,
                      SCALE_N: tl.constexpr, K_SCALED: tl.constexpr, HAS_BIAS: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      GROUP_M: tl.constexpr):
    # grouped tile order: GROUP_M row tiles share each column tile while it is in L2
    pid = tl.program_id(0)
    n_m = tl.cdiv(M, BLOCK_M)
    n_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * n_n
    first_m = (pid // per_group) * GROUP_M
    size_m = tl.minimum(n_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % size_m
    pid_n = (pid % per_group) // size_m
    offs_m = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < M
    n_ok = offs_n < N
    a_ptr = A + offs_m[:, None] * stride_am + offs_k[None, :]
    b_ptr = B + offs_n[None, :] * stride_bn + offs_k[:, None]
    sa_ptr = SA + offs_m * stride_sam
    sb_ptr = SB + (offs_n // SCALE_N) * stride_sbn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kt in range(0, tl.cdiv(K, BLOCK_K)):
        k_ok = offs_k < K - kt * BLOCK_K
        a = tl.load(a_ptr, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_ptr, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        if K_SCALED:  # block scheme: this 128-wide step's scales (BLOCK_K == 128)
            sa = tl.load(sa_ptr + kt * stride_sak, mask=m_ok, other=0.0)
            sb = tl.load(sb_ptr + kt * stride_sbk, mask=n_ok, other=0.0)
            acc += tl.dot(a, b) * sa[:, None] * sb[None, :]
        else:
            acc = tl.dot(a, b, acc)
        a_ptr += BLOCK_K
        b_ptr += BLOCK_K
    if not K_SCALED:
        sa = tl.load(sa_ptr, mask=m_ok, other=0.0)
        sb = tl.load(sb_ptr, mask=n_ok, other=0.0)
        acc = acc * sa[:, None] * sb[None, :]
    if HAS_BIAS:
        acc += tl.load(BIAS + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(C + offs_m[:, None] * stride_cm + offs_n[None, :], acc.to(C.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


def scaled_mm(a8: torch.Tensor, a_scale: torch.Tensor, w8: torch.Tensor, b_scale: torch.Tensor, *,
              scale_n: int, k_scaled: bool, out_dtype: torch.dtype, bias: torch.Tensor | None) -> torch.Tensor:
    """``a8 [M, K]``, ``w8 [N, K]`` (e4m3, unit last strides) with ``a_scale [M, 1 | K/128]`` and
    ``b_scale [ceil(N/scale_n), 1 | K/128]`` (float32) -> ``[M, N]`` in ``out_dtype``."""
    m, k = a8.shape
    n = w8.shape[0]
    c = torch.empty((m, n), dtype=out_dtype, device=a8.device)
    if m == 0 or n == 0:
        return c
    if k == 0:
        return c.zero_() if bias is None else c.copy_(bias.to(out_dtype).expand(m, n))
    a8 = a8 if a8.stride(-1) == 1 else a8.contiguous()
    w8 = w8 if w8.stride(-1) == 1 else w8.contiguous()
    block_m = 128 if m >= 128 else max(16, triton.next_power_of_2(m))
    block_n = 128
    grid = (triton.cdiv(m, block_m) * triton.cdiv(n, block_n),)
    _scaled_mm_kernel[grid](
        a8, a_scale, w8, b_scale, c, bias if bias is not None else c, m, n, k,
        a8.stride(0), w8.stride(0), a_scale.stride(0), a_scale.stride(1) if k_scaled else 0,
        b_scale.stride(0), b_scale.stride(1) if k_scaled else 0, c.stride(0),
        SCALE_N=scale_n, K_SCALED=k_scaled, HAS_BIAS=bias is not None,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=GROUP, GROUP_M=8,
        num_warps=8 if block_m >= 128 else 4, num_stages=3,
    )
    return c


@triton.jit
def _rotary_amax_kernel(
    X, Y, COS, SIN, AMAX, n_heads, stride_xt, stride_xh, stride_yt, stride_yh, stride_ct, stride_st,
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
    # transformers' q * cos + rotate_half(q) * sin, each product and the sum rounded to q's dtype
    y1 = ((x1 * c1).to(dt).to(tl.float32) + (-x2 * s1).to(dt).to(tl.float32)).to(dt)
    y2 = ((x2 * c2).to(dt).to(tl.float32) + (x1 * s2).to(dt).to(tl.float32)).to(dt)
    tl.store(y_ptr, y1, mask=mask)
    tl.store(y_ptr + HALF, y2, mask=mask)
    m = tl.maximum(tl.max(tl.abs(y1.to(tl.float32))), tl.max(tl.abs(y2.to(tl.float32))))  # masked rows are 0
    tl.atomic_max(AMAX, m.to(tl.int32, bitcast=True))


def rotary_amax(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [T, H, d]`` (unit last stride), ``cos``/``sin [T, d]`` contiguous -> ``(y, amax [1])``."""
    t, h, d = x.shape
    y = torch.empty((t, h, d), dtype=x.dtype, device=x.device)
    amax = torch.zeros(1, dtype=torch.int32, device=x.device)
    if t and h:
        block_h = min(triton.next_power_of_2(h), max(1, 4096 // d))
        _rotary_amax_kernel[(t, triton.cdiv(h, block_h))](
            x, y, cos, sin, amax, h, x.stride(0), x.stride(1), y.stride(0), y.stride(1), cos.stride(0),
            sin.stride(0), HALF=d // 2, BLOCK_H=block_h, **_ROTARY_LAUNCH,
        )
    return y, amax.view(torch.float32)
