"""Triton kernels of the FP8 path's elementwise steps: e4m3 quantization of q, and the FP8 KV
pool's write (quantize K and V and scatter them into their pages, V token-major).

Both compute exactly ``kernels.fp8.quantize``: ``x`` in fp32, divided (IEEE, round to nearest)
by its descale, clamped to +-448 (NaN stays NaN), rounded to nearest even in e4m3, in one read
of ``x`` and one byte written per element, where the eager version makes five passes over fp32
temporaries (widen, divide, clamp, narrow; plus, for q, ``abs`` and ``amax``).

Called through ``kernels.fp8.quantize_per_tensor(..., backend=)`` and
``kv_cache.pool.KVPool.write(..., backend=)`` (``kv_cache.tensors``); inputs are validated there.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_interpreter import apply_if_interpreting


apply_if_interpreting()  # TRITON_INTERPRET=1: the CPU interpreter's fixes (triton_interpreter.py)

BLOCK = 1024  # elements per program of the quantize kernel
BLOCK_T = 32  # tokens per program of the pool write


# the e4m3 format's largest finite value (kernels.fp8.FP8_MAX), from the dtype itself: this
# module is what kernels.fp8 dispatches to, so it imports nothing of it
FP8_MAX_C = tl.constexpr(torch.finfo(torch.float8_e4m3fn).max)


@triton.jit
def _e4m3(x, descale):
    y = tl.math.div_rn(x.to(tl.float32), descale)
    y = tl.clamp(y, -FP8_MAX_C, FP8_MAX_C, propagate_nan=tl.PropagateNan.ALL)
    return y.to(tl.float8e4nv)


@triton.jit
def _quantize_kernel(x_ptr, d_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    x = tl.load(x_ptr + offs, mask=ok, other=0.0)
    tl.store(out_ptr + offs, _e4m3(x, tl.load(d_ptr)), mask=ok)


def quantize_per_tensor(x: torch.Tensor, descale: torch.Tensor) -> torch.Tensor:
    """``x`` (contiguous, any shape) by the one descale ``descale [1]`` (on x's device) -> e4m3."""
    out = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device)
    n = x.numel()
    if n:
        _quantize_kernel[(triton.cdiv(n, BLOCK),)](x, descale, out, n, BLOCK=BLOCK, num_warps=4)
    return out


@triton.jit
def _write_kernel(
    k_ptr, v_ptr, slots_ptr, kd_ptr, vd_ptr, kp_ptr, vp_ptr, T,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kpp, stride_kps, stride_kph,
    stride_vpp, stride_vph, stride_vpd,
    PAGE_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
):
    h = tl.program_id(1)
    ts = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok = ts < T
    dims = tl.arange(0, BLOCK_D)
    mask = t_ok[:, None] & (dims < HEAD_DIM)[None, :]
    slot = tl.load(slots_ptr + ts, mask=t_ok, other=0).to(tl.int64)
    page = slot // PAGE_SIZE
    off = slot % PAGE_SIZE
    rows = ts.to(tl.int64)[:, None]
    k = tl.load(k_ptr + rows * stride_kt + h * stride_kh + dims[None, :], mask=mask, other=0.0)
    v = tl.load(v_ptr + rows * stride_vt + h * stride_vh + dims[None, :], mask=mask, other=0.0)
    k8 = _e4m3(k, tl.load(kd_ptr + h))
    v8 = _e4m3(v, tl.load(vd_ptr + h))
    # K: [page, slot, head, d] (a token's head is 128 contiguous bytes)
    tl.store(kp_ptr + page[:, None] * stride_kpp + off[:, None] * stride_kps + h * stride_kph + dims[None, :],
             k8, mask=mask)
    # V token-major: [page, head, d, slot] (consecutive tokens of a page are consecutive bytes)
    tl.store(vp_ptr + page[:, None] * stride_vpp + h * stride_vph + dims[None, :] * stride_vpd + off[:, None],
             v8, mask=mask)


def write_pages(k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor, k_descale: torch.Tensor,
                v_descale: torch.Tensor, k_pages: torch.Tensor, v_raw: torch.Tensor) -> None:
    """``k, v [T, H, d]`` (last dim contiguous) quantized by the per-head ``k_descale, v_descale
    [H]`` into ``k_pages [P, page_size, H, d]`` and token-major ``v_raw [P, H, d, page_size]``
    (e4m3, one layer of the pool) at flat ``slots [T]`` (``page * page_size + offset``)."""
    t, h, d = k.shape
    if t == 0:
        return
    _write_kernel[(triton.cdiv(t, BLOCK_T), h)](
        k, v, slots, k_descale, v_descale, k_pages, v_raw, t,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_pages.stride(0), k_pages.stride(1), k_pages.stride(2),
        v_raw.stride(0), v_raw.stride(1), v_raw.stride(2),
        PAGE_SIZE=k_pages.shape[1], HEAD_DIM=d, BLOCK_T=BLOCK_T, BLOCK_D=triton.next_power_of_2(d),
        num_warps=4,
    )
