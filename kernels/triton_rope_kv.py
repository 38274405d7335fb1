"""Triton kernel of ``kernels/rope_kv.py``: RoPE of q and k and the paged K/V write in one launch.

One program per (block of ``BLOCK_T`` tokens, head) over ``Hq + 2 Hkv`` heads: query heads are
rotated into a new tokens-major q (``max |q|`` reduced by an integer atomic max on the float32
bit pattern when asked, as ``triton_fp8_gemm.rotary_amax``); key heads are rotated and stored
straight into their pages; value heads are copied into theirs. FP8 pools store ``x / descale``
(``triton_fp8._e4m3``: IEEE division, clamp to +-448 with NaN kept, nearest even) of the rotated
key as rounded to q's dtype, so the bytes are those of RoPE, then ``KVTensors.write``. The pages
are addressed by strides: K ``[P, page_size, Hkv, d]``, V the same logical view, row-major or
token-major (``[P, Hkv, d, page_size]`` underneath, FP8 pools). Inputs are validated by the
caller; the rotation is ``triton_elementwise``'s (no FP contraction: eager's rounding).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_fp8 import _e4m3
from .triton_interpreter import apply_if_interpreting

apply_if_interpreting()  # TRITON_INTERPRET=1: the CPU interpreter's fixes (triton_interpreter.py)

BLOCK_T = 32  # tokens per program
LAUNCH = {"num_warps": 4, "enable_fp_fusion": False}  # see triton_elementwise.ROTARY_LAUNCH


@triton.jit
def _rotate(x_ptr, cos_ptr, sin_ptr, cols, mask, HALF: tl.constexpr, dt: tl.constexpr):
    """``x * cos + rotate_half(x) * sin`` of ``[BLOCK_T, 2 HALF]`` rows, each product and the sum
    rounded to ``dt`` as eager; returns the two halves in ``dt``."""
    x1 = tl.load(x_ptr + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptr + HALF + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    c1 = tl.load(cos_ptr + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    c2 = tl.load(cos_ptr + HALF + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    s1 = tl.load(sin_ptr + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    s2 = tl.load(sin_ptr + HALF + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    y1 = ((x1 * c1).to(dt).to(tl.float32) + (-x2 * s1).to(dt).to(tl.float32)).to(dt)
    y2 = ((x2 * c2).to(dt).to(tl.float32) + (x1 * s2).to(dt).to(tl.float32)).to(dt)
    return y1, y2


@triton.jit
def _rope_kv_kernel(
    Q, K, V, COS, SIN, SLOTS, QO, KP, VP, KD, VD, AMAX,
    T, HQ, HKV,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
    stride_ct, stride_st,
    stride_kpp, stride_kps, stride_kph, stride_vpp, stride_vps, stride_vph, stride_vpd,
    PAGE_SIZE: tl.constexpr, HALF: tl.constexpr, BLOCK_T: tl.constexpr,
    FP8: tl.constexpr, Q_AMAX: tl.constexpr,
):
    h = tl.program_id(1)
    ts = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok = ts < T
    rows = ts.to(tl.int64)[:, None]
    cols = tl.arange(0, HALF)
    mask = t_ok[:, None]
    dt = Q.dtype.element_ty
    cos_ptr = COS + rows * stride_ct
    sin_ptr = SIN + rows * stride_st
    if h < HQ:  # a query head: rotated into the new tokens-major q
        y1, y2 = _rotate(Q + rows * stride_qt + h * stride_qh, cos_ptr, sin_ptr, cols, mask, HALF, dt)
        q_dst = QO + rows * stride_ot + h * stride_oh + cols[None, :]
        tl.store(q_dst, y1, mask=mask)
        tl.store(q_dst + HALF, y2, mask=mask)
        if Q_AMAX:  # masked rows are 0
            m = tl.maximum(tl.max(tl.abs(y1.to(tl.float32))), tl.max(tl.abs(y2.to(tl.float32))))
            tl.atomic_max(AMAX, m.to(tl.int32, bitcast=True))
    else:
        slot = tl.load(SLOTS + ts, mask=t_ok, other=0).to(tl.int64)[:, None]
        page = slot // PAGE_SIZE
        off = slot % PAGE_SIZE
        if h < HQ + HKV:  # a key head: rotated, then into its pages
            hk = h - HQ
            y1, y2 = _rotate(K + rows * stride_kt + hk * stride_kh, cos_ptr, sin_ptr, cols, mask, HALF, dt)
            k_dst = KP + page * stride_kpp + off * stride_kps + hk * stride_kph + cols[None, :]
            if FP8:
                kd = tl.load(KD + hk)
                tl.store(k_dst, _e4m3(y1, kd), mask=mask)
                tl.store(k_dst + HALF, _e4m3(y2, kd), mask=mask)
            else:
                tl.store(k_dst, y1.to(KP.dtype.element_ty), mask=mask)
                tl.store(k_dst + HALF, y2.to(KP.dtype.element_ty), mask=mask)
        else:  # a value head: copied (quantized) into its pages
            hv = h - HQ - HKV
            dims = tl.arange(0, 2 * HALF)[None, :]
            x = tl.load(V + rows * stride_vt + hv * stride_vh + dims, mask=mask, other=0.0)
            v_dst = VP + page * stride_vpp + off * stride_vps + hv * stride_vph + dims * stride_vpd
            if FP8:
                tl.store(v_dst, _e4m3(x, tl.load(VD + hv)), mask=mask)
            else:
                tl.store(v_dst, x.to(VP.dtype.element_ty), mask=mask)


def rope_kv_write(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  slots: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor,
                  k_descale: torch.Tensor | None, v_descale: torch.Tensor | None,
                  q_amax: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``q [T, Hq, d]``, ``k, v [T, Hkv, d]`` (unit last strides), ``cos, sin [T, d]`` (unit last
    strides), ``slots [T]`` contiguous, pages ``[P, page_size, Hkv, d]`` views (V's may be
    token-major underneath), descales ``[Hkv]`` float32 for e4m3 pages -> ``(q_rot, amax [1] or
    None)``."""
    t, hq, d = q.shape
    hkv = k.shape[1]
    out = torch.empty((t, hq, d), dtype=q.dtype, device=q.device)
    amax = torch.zeros(1, dtype=torch.int32, device=q.device) if q_amax else None
    if t:
        fp8 = k_descale is not None
        _rope_kv_kernel[(triton.cdiv(t, BLOCK_T), hq + 2 * hkv)](
            q, k, v, cos, sin, slots, out, k_pages, v_pages,
            k_descale if fp8 else cos, v_descale if fp8 else cos, amax if q_amax else out,
            t, hq, hkv,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            out.stride(0), out.stride(1), cos.stride(0), sin.stride(0),
            *k_pages.stride()[:3], *v_pages.stride(),
            PAGE_SIZE=k_pages.shape[1], HALF=d // 2, BLOCK_T=BLOCK_T, FP8=fp8, Q_AMAX=q_amax, **LAUNCH,
        )
    return out, None if amax is None else amax.view(torch.float32)
