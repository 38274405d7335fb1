"""Triton dense paged decode attention (flash-decoding with PackGQA).

Computes, for one new query token per sequence, ``softmax(scale * q K^T) V`` over the
sequence's ``seqlens_kv[b]`` paged keys, and the natural-log ``lse``; the function that
``kernels/decode.py``'s reference defines.

How:
- PackGQA: one program per (sequence, KV head, split). The ``g = Hq / Hkv`` query heads of
  the KV head are the rows of one ``tl.dot`` tile (padded to ``BLOCK_M = max(16, g)``), so
  each K/V tile is read from memory once for all of them.
- Split-KV: the key range of each sequence is cut into ``num_splits`` parts of whole 64-key
  tiles; each part writes a normalised partial output and its lse, and a combine kernel
  merges them exactly (lse-weighted). ``num_splits == 1`` writes the result directly.
- Paged addressing: any ``page_size >= 1``. When ``page_size`` is a multiple of 64, a 64-key
  tile lies in one page (one page-table load per tile); otherwise each key's page is
  gathered.
- Online softmax in base 2 with fp32 accumulators; fp32 inputs use IEEE dots (no TF32).

Supports fp16/bf16/fp32 (q, K, V one dtype), head_dim multiple of 16 up to 256, any g.
FP8 pages (e4m3 with ``[B, Hkv]`` descale views, kernels/fp8.py): tiles are widened to q's
dtype in registers, ``c_k`` folds into the logit scale and ``c_v`` into the output. V may be
token-major (its own d stride). Does not support: more than one query token per sequence,
masks or sparsity, ALiBi/soft-capping. Inputs are assumed validated (``kernels/decode.py``). Nothing here syncs
with the host (the automatic split count uses ``max_seqlen_kv`` when given, else the page
table's width), so a call can be captured in a CUDA graph.
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from .triton_interpreter import apply_if_interpreting

apply_if_interpreting()  # TRITON_INTERPRET=1: the CPU interpreter's fixes (triton_interpreter.py)

BLOCK_N = 64  # keys per tile; also the split granularity
_LOG2E = 1.4426950408889634


@triton.jit
def _decode_split_kernel(
    q_ptr, k_ptr, v_ptr, page_table_ptr, seqlens_ptr,
    out_ptr, lse_ptr,  # final out/lse when num_splits == 1, else the fp32 partials
    kd_ptr, vd_ptr,
    stride_qb, stride_qh,
    stride_kp, stride_ks, stride_kh,
    stride_vp, stride_vs, stride_vh, stride_vd,
    stride_kdb, stride_kdh, stride_vdb, stride_vdh,
    stride_ptb,
    stride_ob, stride_oh, stride_os,
    stride_lb, stride_lh,
    scale_log2,
    num_splits,  # runtime: the auto choice varies with the batch, without recompiling
    G: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    TILE_IN_PAGE: tl.constexpr,
    IEEE: tl.constexpr,
    FP8: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    split = tl.program_id(2)

    seqlen = tl.load(seqlens_ptr + b).to(tl.int32)
    num_tiles = tl.cdiv(seqlen, BLOCK_N)
    tiles_per_split = tl.cdiv(num_tiles, num_splits)
    start = split * tiles_per_split * BLOCK_N
    end = tl.minimum(start + tiles_per_split * BLOCK_N, seqlen)

    rows = tl.arange(0, BLOCK_M)  # PackGQA: row t is query head h * G + t
    dims = tl.arange(0, BLOCK_D)
    row_ok = rows < G
    dim_ok = dims < HEAD_DIM
    qhead = h * G + rows
    q = tl.load(
        q_ptr + b * stride_qb + qhead[:, None] * stride_qh + dims[None, :],
        mask=row_ok[:, None] & dim_ok[None, :],
        other=0.0,
    )

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    offs_n = tl.arange(0, BLOCK_N)
    pt_row = page_table_ptr + b * stride_ptb
    k_head = k_ptr + h * stride_kh
    v_head = v_ptr + h * stride_vh
    if FP8:
        scale_log2 = scale_log2 * tl.load(kd_ptr + b * stride_kdb + h * stride_kdh)

    for n0 in range(start, end, BLOCK_N):
        keys = n0 + offs_n
        key_ok = keys < end
        if TILE_IN_PAGE:
            page = tl.load(pt_row + n0 // PAGE_SIZE).to(tl.int64)
            slot = (n0 % PAGE_SIZE + offs_n).to(tl.int64)
            k_off = page * stride_kp + slot * stride_ks
            v_off = page * stride_vp + slot * stride_vs
        else:
            page = tl.load(pt_row + keys // PAGE_SIZE, mask=key_ok, other=0).to(tl.int64)
            slot = (keys % PAGE_SIZE).to(tl.int64)
            k_off = page * stride_kp + slot * stride_ks
            v_off = page * stride_vp + slot * stride_vs
        kv_mask = key_ok[:, None] & dim_ok[None, :]
        k = tl.load(k_head + k_off[:, None] + dims[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_head + v_off[:, None] + dims[None, :] * stride_vd, mask=kv_mask, other=0.0)
        if FP8:  # widen e4m3 to q's dtype (exact); the descales act on s and o
            k = k.to(q.dtype)
            v = v.to(q.dtype)

        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = tl.where(key_ok[None, :], s * scale_log2, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new

    # an empty split (start >= end) leaves l_i = 0, m_i = -inf: lse -inf, zero output
    nonempty = l_i > 0
    if FP8:
        acc = acc * tl.load(vd_ptr + b * stride_vdb + h * stride_vdh)
    o = acc / tl.where(nonempty, l_i, 1.0)[:, None]
    lse2 = m_i + tl.log2(tl.where(nonempty, l_i, 1.0))
    lse = tl.where(nonempty, lse2 * 0.6931471805599453, float("-inf"))  # x ln 2: natural log
    o_ptrs = out_ptr + b * stride_ob + qhead[:, None] * stride_oh + split * stride_os + dims[None, :]
    tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :])
    tl.store(lse_ptr + b * stride_lb + qhead * stride_lh + split, lse, mask=row_ok)


@triton.jit
def _decode_combine_kernel(
    part_out_ptr, part_lse_ptr, out_ptr, lse_ptr,
    stride_pb, stride_ph, stride_ps,
    stride_plb, stride_plh,
    stride_ob, stride_oh,
    stride_lb, stride_lh,
    num_splits,
    HEAD_DIM: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    b = tl.program_id(0)
    hq = tl.program_id(1)
    splits = tl.arange(0, BLOCK_S)
    dims = tl.arange(0, BLOCK_D)
    lse_row = part_lse_ptr + b * stride_plb + hq * stride_plh
    lse_s = tl.load(lse_row + splits, mask=splits < num_splits, other=float("-inf"))
    m = tl.max(lse_s, 0)  # finite: split 0 always holds at least one key
    denom = tl.sum(tl.exp(lse_s - m), 0)  # empty splits (-inf) weigh 0
    # one split at a time: a [splits, d] tile would spill registers at 64+ splits
    o = tl.zeros([BLOCK_D], dtype=tl.float32)
    part_row = part_out_ptr + b * stride_pb + hq * stride_ph
    for s in range(0, num_splits):
        w = tl.exp(tl.load(lse_row + s) - m) / denom
        o += w * tl.load(part_row + s * stride_ps + dims, mask=dims < HEAD_DIM, other=0.0)
    tl.store(out_ptr + b * stride_ob + hq * stride_oh + dims, o.to(out_ptr.dtype.element_ty), mask=dims < HEAD_DIM)
    tl.store(lse_ptr + b * stride_lb + hq * stride_lh, m + tl.log(denom))


@functools.lru_cache(maxsize=None)
def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # interpreter: keep the grid small


def choose_num_splits(batch: int, num_kv_heads: int, max_seqlen_kv: int, num_sms: int) -> int:
    """About four programs per SM (a few waves even at two resident programs per SM, so the
    last wave's tail is short), each with at least 4 key tiles."""
    programs = batch * num_kv_heads
    want = max(1, math.ceil(4 * num_sms / programs))
    most = max(1, math.ceil(max_seqlen_kv / (4 * BLOCK_N)))
    return max(1, min(want, most, 128))


def paged_decode(
    q: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    page_table: torch.Tensor,
    seqlens_kv: torch.Tensor,
    *,
    scale: float,
    num_splits: int = 0,
    max_seqlen_kv: int | None = None,
    k_descale: torch.Tensor | None = None,
    v_descale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the split kernel (and the combine kernel when ``num_splits > 1``).

    Inputs validated by ``kernels.decode.paged_decode``; ``B >= 1``. No host sync.
    """
    batch, hq, d = q.shape
    page_size, hkv = k_pages.shape[1], k_pages.shape[2]
    g = hq // hkv
    if num_splits == 0:
        bound = max_seqlen_kv if max_seqlen_kv is not None else page_table.shape[1] * page_size
        num_splits = choose_num_splits(batch, hkv, bound, _num_sms(q.device))
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty(batch, hq, dtype=torch.float32, device=q.device)
    block_m = max(16, triton.next_power_of_2(g))
    block_d = max(16, triton.next_power_of_2(d))
    ieee = q.dtype == torch.float32
    if num_splits == 1:
        part_out, part_lse = out, lse
        o_strides = (out.stride(0), out.stride(1), 0)
        l_strides = (lse.stride(0), lse.stride(1))
    else:
        part_out = torch.empty(batch, hq, num_splits, d, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(batch, hq, num_splits, dtype=torch.float32, device=q.device)
        o_strides = (part_out.stride(0), part_out.stride(1), part_out.stride(2))
        l_strides = (part_lse.stride(0), part_lse.stride(1))
    fp8 = k_descale is not None
    kd = k_descale if fp8 else part_lse
    vd = v_descale if fp8 else part_lse
    d_strides = (*k_descale.stride(), *v_descale.stride()) if fp8 else (0, 0, 0, 0)
    _decode_split_kernel[(batch, hkv, num_splits)](
        q, k_pages, v_pages, page_table, seqlens_kv,
        part_out, part_lse, kd, vd,
        q.stride(0), q.stride(1),
        k_pages.stride(0), k_pages.stride(1), k_pages.stride(2),
        v_pages.stride(0), v_pages.stride(1), v_pages.stride(2), v_pages.stride(3),
        *d_strides,
        page_table.stride(0),
        *o_strides,
        *l_strides,
        scale * _LOG2E,
        num_splits,
        G=g,
        HEAD_DIM=d,
        PAGE_SIZE=page_size,
        BLOCK_M=block_m,
        BLOCK_D=block_d,
        BLOCK_N=BLOCK_N,
        TILE_IN_PAGE=page_size % BLOCK_N == 0,
        IEEE=ieee,
        FP8=fp8,
        num_warps=4,
        num_stages=3,
    )
    if num_splits > 1:
        _decode_combine_kernel[(batch, hq)](
            part_out, part_lse, out, lse,
            part_out.stride(0), part_out.stride(1), part_out.stride(2),
            part_lse.stride(0), part_lse.stride(1),
            out.stride(0), out.stride(1),
            lse.stride(0), lse.stride(1),
            num_splits,
            HEAD_DIM=d,
            BLOCK_S=max(2, triton.next_power_of_2(num_splits)),
            BLOCK_D=block_d,
            num_warps=4,
        )
    return out, lse
