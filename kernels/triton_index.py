"""Triton index stage of FlashPrefill V2: block means, fused score/threshold/force, CSR.

Computes exactly ``kernels.reference.build_index`` (see docs/SEMANTICS.md):

1. ``_block_means_kernel``: fp32 means of K and V per (logical block, KV head), read straight
   from the paged pool through ``plan.page_table`` (any ``page_size >= 1``; tokens past
   ``seqlens_kv`` are never read, so poisoned slack slots cannot leak in). It also writes the
   K means rounded to q's dtype: the scoring operands (SEMANTICS "choices we fixed" 1).
2. ``_score_select_kernel`` (paper eq. 19-20): a persistent grid; each program takes a
   segment (KV head ``h``, query tile ``t``), loads its up-to-128 PackGQA rows once and sweeps
   the visible block means in chunks of ``BLOCK_N`` blocks, one ``tl.dot`` per chunk (fp32
   accumulation; IEEE for fp32 inputs), transposed (blocks x rows) so that a block's energy
   is a reduction inside one warp. Single pass, base 2: for each block it keeps the
   log2-energy ``LE_J = c_J + log2(sum_i 2^(s_iJ - c_J))`` (scores in log2 units, ``c_J``
   the block's own maximum: a per-block version of the paper's per-chunk maximum, so no
   energy underflows and the final rescale of eq. 20 is a subtraction), writes it to the
   program's scratch row and keeps a running ``max_J LE_J``. After a barrier it re-reads the
   row, thresholds ``LE_J - max LE >= log2(alpha)`` (i.e. ``E_J >= alpha * max E``), forces
   sink/window/diagonal blocks, and writes a bitmask of the selected logical blocks and the
   number of selected 64-token tiles of the segment. ``energy_rule="first_key"`` masks each
   row's scores of blocks whose first key it does not see and scores only the blocks the
   tile's last row sees whole; a dense tile (one of its prompt's last ``last_dense_tiles``,
   ``plan.dense_rows_from``) scores nothing and keeps every visible block.
3. ``seg_offsets = cumsum(counts)`` on the device, then ``_compact_kernel`` expands each
   segment's bitmask into ascending 64-token tile ids, dropping tiles with ``64 n >= Lkv`` or
   ``64 n > pmax + P`` (SEMANTICS "choices we fixed" 3).

Memory (beyond the inputs and the outputs ``BlockMeans`` + CSR):
- K means in q's dtype: ``total_blocks * Hkv * d`` elements (O(L); none for fp32 inputs).
- Scratch: one fp32 row of ``max_blocks`` per persistent program (``programs_per_sm * #SMs`` rows),
  O(L).
- Counts: one int32 per segment, O(L).
- Selection bitmask: ``num_segments * ceil(max_blocks / 32)`` int32, i.e. one *bit* per
  (segment, logical block). This is the only term quadratic in L, but with a constant of
  ``g / (8 * 128 * block_size)`` bytes per (query, key) pair: 4 MiB at L = 128K (g=4, Hkv=8,
  Bs=128), 256 MiB at 1M. It is what lets the compaction run without recomputing the
  scores; a decoupled look-back prefix sum in the scoring kernel would remove it.
- CSR ``kv_tiles``: exactly ``nnz`` entries (``capacity=None``) or ``capacity`` entries.

Host synchronisation: none, except that ``capacity=None`` reads the total ``nnz`` back once
(``seg_offsets[-1]``) to allocate ``kv_tiles`` exactly. With ``capacity`` given nothing is read
back: ``kv_tiles`` has ``capacity`` entries, entries past it are not written, ``seg_offsets``
is clamped to ``capacity`` (so every consumer stays in bounds; the segments that did not fit
lose their tail), and ``build_index_with_status`` returns the number of entries the CSR
needed as a device tensor (overflow iff ``required > capacity``).

Work at B=1, Hq=32, Hkv=8, d=128, Bs=128, L=128K (causal): 4096 query tiles per KV head,
32768 segments, on average 512 visible blocks each: index GEMM 2 * 32768 * 128 * 512 * 128
= 0.55 TFLOP (0.56 ms at the 989 TFLOP/s dense bf16 peak), 2.1 G exp2 (~0.5 ms of MUFU at 16/clk/SM,
the floor: exp2 and wgmma overlap only across the programs sharing an SM), 4.3 GB of bf16
block means re-read from L2 (hence the rounded bf16 copy: fp32 would double it), and 0.54 GB
of K/V read once from HBM by the means kernel (~0.12 ms at 4.8 TB/s).

Supports fp16/bf16/fp32 (q, K, V of one dtype) and FP8 e4m3 with descales (means of the
descaled values in fp32; scores ``c_q c_k (q8 . round_e4m3(kbar / c_k))`` on fp8 tensor cores),
head_dim a multiple of 16 up to 256, any ``g``, any ``page_size``, V row-major or token-major,
varlen batches with cached prefixes, empty sequences and batches. Inputs are assumed validated by the caller
(``kernels.ops.plan_prefill``).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .triton_interpreter import apply_if_interpreting

from .config import KV_TILE, Q_TILE
from .fp8 import Fp8Descales
from .index import BlockMeans, SparseIndex
from .plan import PrefillPlan

apply_if_interpreting()  # TRITON_INTERPRET=1: the CPU interpreter's fixes (triton_interpreter.py)

_LOG2E = 1.4426950408889634
_BITS = 32  # selection bits per bitmask word


@dataclass(frozen=True)
class IndexLaunch:
    """Launch parameters of the three kernels (defaults chosen for the H200, sm_90; re-tune
    with ``benchmarks/bench_index.py --sweep``)."""

    means_tokens: int = 32  # tokens per step of the means kernel
    means_warps: int = 4
    # Score kernel, read in an sm_90 build on a CPU box (bf16, d = 128; benchmarks/index_resources.py):
    # BLOCK_N = 64 blocks x 128 rows with one warpgroup is a single wgmma m64n128 chain per chunk,
    # 64 KiB smem with a 2-stage cp.async ring, and at most 168 registers: three programs fit an
    # SM (regs and smem), so one program's exp2/reductions overlap another's wgmma and loads.
    # Uncapped, the non-finite score filter takes it to 181 registers: two fit, and the third
    # program of each SM runs as a second wave (issue #38). Capped: 166, no stack (e4m3: 240
    # uncapped, 168 capped, no stack).
    # Alternative in the benchmark sweep: BLOCK_N = 128, 8 warps, maxnreg 128 (125 regs, no
    # spill, 97 KiB smem, two per SM).
    block_n: int = 64  # logical blocks per score tl.dot (its M; N is the 128 query rows)
    score_warps: int = 4
    score_stages: int = 2  # cp.async ring of block-mean chunks
    score_maxnreg: int | None = 168  # applied to 16- and 8-bit inputs with d <= 128 only
    programs_per_sm: int = 3  # persistent score programs (each owns one scratch row)
    select_words: int = 4  # bitmask words per thresholding step (128 blocks)
    compact_blocks: int = 128  # logical blocks per compaction step
    compact_warps: int = 4


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def _score_programs(device: torch.device, num_segments: int, launch: IndexLaunch) -> int:
    if device.type == "cuda" and not _interpreting():
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        return max(1, min(num_segments, sms * launch.programs_per_sm))
    # The interpreter runs programs one after another: a few programs still exercise the
    # persistent loop (several segments per program, scratch-row reuse).
    return max(1, min(num_segments, 3))


def _maxnreg(value: int | None) -> dict:
    return {} if value is None or _interpreting() else {"maxnreg": value}


# --------------------------------------------------------------------------------------
# Shared geometry of a segment (one place, used by the score and compaction kernels)
# --------------------------------------------------------------------------------------
@triton.jit
def _tile_geometry(
    t, tile_seq_ptr, cu_q_ptr, seqlens_kv_ptr, cu_qtiles_ptr,
    G: tl.constexpr, TILE_M: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr,
):
    """Query tile ``t``: sequence, first query token, Lkv, first packed row, row count,
    ``pmin + P``, ``pmax + P``, visible and fully visible logical blocks, and the number of
    leading 64-token tiles that may be listed (``64 n < Lkv`` and ``64 n <= pmax + P``).
    Both drop rules are upper bounds, so the kept tiles of a selected block J are a prefix
    of its tiles: ``clamp(tile_limit - J * tiles_per_block, 0, tiles_per_block)``."""
    b = tl.load(tile_seq_ptr + t)
    q0 = tl.load(cu_q_ptr + b)
    lq = tl.load(cu_q_ptr + b + 1) - q0
    lkv = tl.load(seqlens_kv_ptr + b)
    prefix = lkv - lq
    r0 = (t - tl.load(cu_qtiles_ptr + b)) * TILE_M
    nrows = tl.minimum(G * lq - r0, TILE_M)
    lo = r0 // G + prefix
    hi = (r0 + nrows - 1) // G + prefix
    nvis = hi // BLOCK_SIZE + 1
    # the last query of the sequence sees the whole (possibly short) last block
    nfull = tl.where(lkv <= lo + 1, tl.cdiv(lkv, BLOCK_SIZE), (lo + 1) // BLOCK_SIZE)
    tile_limit = tl.minimum(tl.cdiv(lkv, TILE), hi // TILE + 1)
    return b, q0, lkv, r0, nrows, lo, hi, nvis, nfull, tile_limit


@triton.jit
def _row_mask(row_ok, dims, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    """2-D load mask for rows of HEAD_DIM elements. When BLOCK_D == HEAD_DIM the mask is
    constant along the row, which lets Triton vectorise the loads (16-byte accesses and
    cp.async pipelining need that)."""
    if BLOCK_D == HEAD_DIM:
        return row_ok[:, None]
    else:
        return row_ok[:, None] & (dims < HEAD_DIM)[None, :]


@triton.jit
def _round_to(x, DTYPE: tl.constexpr):
    """fp32 -> DTYPE with round-to-nearest-even, like torch's ``.to``. bf16 is rounded with
    integer ops because the interpreter's fp32->bf16 cast truncates (the GPU's rounds), and
    the scores must use bit-identical operands on both (finite inputs assumed)."""
    if DTYPE == tl.bfloat16:
        u = x.to(tl.uint32, bitcast=True)
        u = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
        return u.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    elif DTYPE == tl.float8e4nv:
        return tl.clamp(x, -448.0, 448.0).to(DTYPE)  # saturate like kernels.fp8.quantize
    else:
        return x.to(DTYPE)


# --------------------------------------------------------------------------------------
# 1. Block means straight from the paged pool
# --------------------------------------------------------------------------------------
@triton.jit
def _block_means_kernel(
    k_ptr, v_ptr, page_table_ptr, seqlens_kv_ptr, cu_blocks_ptr,
    kbar_ptr, vbar_ptr, kbar_q_ptr, kd_ptr, vd_ptr,
    batch,
    stride_kp, stride_ks, stride_kh,
    stride_vp, stride_vs, stride_vh, stride_vd,
    stride_pt, stride_kd_b, stride_kd_h, stride_vd_b, stride_vd_h,
    num_kv_heads,
    PAGE_SIZE: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    TOKENS: tl.constexpr,
    BLOCK_B: tl.constexpr,
    WRITE_KBAR_Q: tl.constexpr,
    FP8: tl.constexpr,
):
    blk = tl.program_id(0)  # global logical block: row of the means
    h = tl.program_id(1)
    # sequence of this block: count of cu_blocks[1:] entries <= blk (B is small)
    bidx = tl.arange(0, BLOCK_B)
    cu = tl.load(cu_blocks_ptr + 1 + bidx, mask=bidx < batch, other=2147483647)
    b = tl.sum((cu <= blk).to(tl.int32), axis=0)
    J = blk - tl.load(cu_blocks_ptr + b)
    lkv = tl.load(seqlens_kv_ptr + b)
    start = J * BLOCK_SIZE
    end = tl.minimum(start + BLOCK_SIZE, lkv)

    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < HEAD_DIM
    # float64 sums are exact for 16-bit and FP8 tokens: the mean does not depend on the order
    # of the block's tokens (token-permuted copies tie exactly at the threshold)
    acc_k = tl.zeros([TOKENS, BLOCK_D], dtype=tl.float64)
    acc_v = tl.zeros([TOKENS, BLOCK_D], dtype=tl.float64)
    for c in tl.static_range(0, BLOCK_SIZE, TOKENS):
        j = start + c + tl.arange(0, TOKENS)
        ok = j < end
        page = tl.load(page_table_ptr + b * stride_pt + j // PAGE_SIZE, mask=ok, other=0).to(tl.int64)
        slot = (j % PAGE_SIZE).to(tl.int64)
        m = _row_mask(ok, dims, HEAD_DIM, BLOCK_D)
        k_off = page * stride_kp + slot * stride_ks + h * stride_kh
        v_off = page * stride_vp + slot * stride_vs + h * stride_vh
        acc_k += tl.load(k_ptr + k_off[:, None] + dims[None, :], mask=m, other=0.0).to(tl.float32).to(tl.float64)
        acc_v += tl.load(v_ptr + v_off[:, None] + dims[None, :] * stride_vd, mask=m, other=0.0).to(tl.float32).to(tl.float64)
    count = (end - start).to(tl.float64)
    kbar = (tl.sum(acc_k, axis=0) / count).to(tl.float32)
    vbar = (tl.sum(acc_v, axis=0) / count).to(tl.float32)
    if FP8:  # means of the descaled values; the scoring operand is re-quantized with c_k
        ck = tl.load(kd_ptr + b * stride_kd_b + h * stride_kd_h)
        cv = tl.load(vd_ptr + b * stride_vd_b + h * stride_vd_h)
        kbar_q = _round_to(kbar, kbar_q_ptr.dtype.element_ty)  # the mean of the stored values
        kbar = kbar * ck
        vbar = vbar * cv
    out = (blk.to(tl.int64) * num_kv_heads + h) * HEAD_DIM + dims
    tl.store(kbar_ptr + out, kbar, mask=dim_ok)
    tl.store(vbar_ptr + out, vbar, mask=dim_ok)
    if FP8:
        tl.store(kbar_q_ptr + out, kbar_q, mask=dim_ok)
    elif WRITE_KBAR_Q:
        tl.store(kbar_q_ptr + out, _round_to(kbar, kbar_q_ptr.dtype.element_ty), mask=dim_ok)


# --------------------------------------------------------------------------------------
# 2. Fused score -> threshold -> force, one segment at a time per persistent program
# --------------------------------------------------------------------------------------
@triton.jit
def _score_select_kernel(
    q_ptr, kbar_q_ptr, qd_ptr, kd_ptr,
    tile_seq_ptr, cu_q_ptr, seqlens_kv_ptr, cu_qtiles_ptr, cu_blocks_ptr, dense_rows_ptr,
    scratch_ptr, bits_ptr, counts_ptr,
    stride_qt, stride_qh, stride_qd_b, stride_qd_h, stride_kd_b, stride_kd_h,
    num_segments, total_tiles, num_kv_heads, num_programs,
    scratch_stride, words_per_seg,
    qk_scale_log2, log2_alpha, sink_tokens, window_tokens,
    G: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE_M: tl.constexpr,
    TILE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    WORDS: tl.constexpr,
    KEEP_ALL: tl.constexpr,
    FIRST_KEY: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    FP8: tl.constexpr,
):
    pid = tl.program_id(0)
    TPB: tl.constexpr = BLOCK_SIZE // TILE
    scratch = scratch_ptr + pid.to(tl.int64) * scratch_stride
    rows = tl.arange(0, TILE_M)
    dims = tl.arange(0, BLOCK_D)
    cols = tl.arange(0, BLOCK_N)
    wrow = tl.arange(0, WORDS)
    bit = tl.arange(0, 32)
    J2 = wrow[:, None] * 32 + bit[None, :]  # [WORDS, 32] block offsets of one step

    # Heavy tiles first: k walks query tiles from the last (most visible blocks) down, the
    # KV heads innermost, and programs take k round-robin, so every program gets a
    # descending mix of costs and the tail of the grid is short.
    for k in tl.range(pid, num_segments, num_programs):
        t = total_tiles - 1 - k // num_kv_heads
        h = k % num_kv_heads
        seg = h * total_tiles + t
        b, q0, lkv, r0, nrows, lo, hi, nvis, nfull, tile_limit = _tile_geometry(
            t, tile_seq_ptr, cu_q_ptr, seqlens_kv_ptr, cu_qtiles_ptr, G, TILE_M, BLOCK_SIZE, TILE
        )
        blk0 = tl.load(cu_blocks_ptr + b)
        # one of the prompt's last dense tiles: every fully visible block passes, nothing is
        # scored (same launch, no second kernel)
        dense = r0 + nrows - 1 >= tl.load(dense_rows_ptr + b)
        if FIRST_KEY:  # blocks the tile's last row sees whole; others are not scored
            nscore = tl.minimum((hi + 1) // BLOCK_SIZE, nvis)
        else:
            nscore = nvis
        nscore = tl.where(dense, 0, nscore)
        if FP8:  # s = c_q c_k (q8 . kbar8): one factor per (sequence, KV head)
            qk = qk_scale_log2 * tl.load(qd_ptr + b * stride_qd_b + h * stride_qd_h) \
                * tl.load(kd_ptr + b * stride_kd_b + h * stride_kd_h)
        else:
            qk = qk_scale_log2

        # PackGQA rows r = p*G + u -> q[q0 + p, h*G + u]
        r = r0 + rows
        row_ok = rows < nrows
        q_off = (q0 + r // G).to(tl.int64) * stride_qt + (h * G + r % G) * stride_qh
        qt = tl.load(
            q_ptr + q_off[:, None] + dims[None, :],
            mask=_row_mask(row_ok, dims, HEAD_DIM, BLOCK_D), other=0.0,
        )

        kb_base = kbar_q_ptr + (blk0.to(tl.int64) * num_kv_heads + h) * HEAD_DIM
        kb_stride = num_kv_heads * HEAD_DIM
        # Transposed product s^T = kbar_chunk @ q_tile^T ([BLOCK_N blocks, TILE_M rows]): each
        # block's energy is then a reduction along a row of the wgmma accumulator (in-thread
        # plus a quad shuffle), never across warps, and each block gets its own shift
        # c_J = max_i s_iJ, so E_J = 2^c_J * sum_i 2^(s_iJ - c_J) cannot underflow.
        if UPCAST_DOT:
            # interpreter only: its tl.dot multiplies bf16 bit patterns as integers; bf16
            # products are exact in fp32, so this is the same GEMM
            q_t = tl.trans(qt.to(tl.float32))
        else:
            q_t = tl.trans(qt)
        le_max_vec = tl.full([BLOCK_N], float("-inf"), tl.float32)
        if FIRST_KEY:
            pos = (r0 + rows) // G + (lo - r0 // G)  # each row's position, prefix included
        for j0 in range(0, nscore, BLOCK_N):
            J = j0 + cols
            col_ok = J < nscore
            kb = tl.load(
                kb_base + J[:, None].to(tl.int64) * kb_stride + dims[None, :],
                mask=_row_mask(col_ok, dims, HEAD_DIM, BLOCK_D), other=0.0,
            )
            if UPCAST_DOT:
                s = tl.dot(kb.to(tl.float32), q_t, input_precision="ieee")
            else:
                s = tl.dot(kb, q_t, input_precision=DOT_PRECISION)
            # padded query rows must not add energy, nor may a non-finite score (NaN/Inf in q
            # or k): such a row adds nothing, so it cannot change another row's selection.
            # Padded blocks (J >= nvis) read zero means, stay finite and are dropped below.
            s = tl.where(row_ok[None, :] & (tl.abs(s) < float("inf")), s, float("-inf"))
            if FIRST_KEY:  # a row scores block J only if it sees the block's first key
                s = tl.where(pos[None, :] >= J[:, None] * BLOCK_SIZE, s, float("-inf"))
            c = tl.max(s, axis=1)
            c = tl.where(c == float("-inf"), 0.0, c)  # no finite score: energy 0, le -inf
            # one FFMA per score: (s - c) * scale * log2(e)
            energy = tl.sum(tl.exp2(tl.fma(s, qk, -(c * qk)[:, None])), axis=1)
            le = c * qk + tl.log2(energy)  # log2 E_J: energy >= 1, or 0 (le = -inf)
            tl.store(scratch + J, le, mask=col_ok)
            le_max_vec = tl.maximum(le_max_vec, tl.where(col_ok, le, float("-inf")))
        le_max = tl.max(le_max_vec, axis=0)

        # The row was written with one thread layout and is re-read with another.
        tl.debug_barrier()

        threshold = le_max + log2_alpha
        count = 0
        for w0 in range(0, nvis, 32 * WORDS):
            J = w0 + J2
            vis = J < nvis
            if KEEP_ALL:
                passes = J < nfull
            else:
                le = tl.load(scratch + J, mask=J < nscore, other=float("-inf"))
                # E_J >= alpha max E (ties kept: equal operands give equal le), E_J > 0
                passes = ((le >= threshold) & (le > float("-inf")) | dense) & (J < nfull)
            sink = J * BLOCK_SIZE < sink_tokens
            block_last = tl.minimum((J + 1) * BLOCK_SIZE, lkv) - 1
            # includes the diagonal blocks and at least the block holding key pmin + P
            window = block_last >= lo + 1 - window_tokens
            sel = vis & (passes | sink | window)
            # bits are distinct, so the sum is the bitwise or (bit 31 wraps to the sign bit)
            words = tl.sum(sel.to(tl.int32) << bit[None, :], axis=1)
            widx = w0 // 32 + wrow
            tl.store(
                bits_ptr + seg.to(tl.int64) * words_per_seg + widx, words,
                mask=widx < tl.cdiv(nvis, 32),
            )
            ntiles = tl.minimum(tl.maximum(tile_limit - J * TPB, 0), TPB)
            count += tl.sum(tl.sum(tl.where(sel, ntiles, 0), axis=1), axis=0)
        tl.store(counts_ptr + seg, count)
        # The next segment overwrites the scratch row that threads may still be reading.
        tl.debug_barrier()


# --------------------------------------------------------------------------------------
# 3. Compaction: bitmask -> ascending 64-token tile ids at seg_offsets[seg]
# --------------------------------------------------------------------------------------
@triton.jit
def _compact_kernel(
    bits_ptr, offsets_ptr, kv_tiles_ptr,
    tile_seq_ptr, cu_q_ptr, seqlens_kv_ptr, cu_qtiles_ptr,
    total_tiles, words_per_seg, capacity,
    G: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE_M: tl.constexpr,
    TILE: tl.constexpr,
    TPB_P2: tl.constexpr,
    BLOCK_J: tl.constexpr,
):
    seg = tl.program_id(0)
    t = seg % total_tiles
    b, q0, lkv, r0, nrows, lo, hi, nvis, nfull, tile_limit = _tile_geometry(
        t, tile_seq_ptr, cu_q_ptr, seqlens_kv_ptr, cu_qtiles_ptr, G, TILE_M, BLOCK_SIZE, TILE
    )
    TPB: tl.constexpr = BLOCK_SIZE // TILE
    pos = tl.load(offsets_ptr + seg)
    bits = bits_ptr + seg.to(tl.int64) * words_per_seg
    sub = tl.arange(0, TPB_P2)
    for j0 in range(0, nvis, BLOCK_J):
        J = j0 + tl.arange(0, BLOCK_J)
        vis = J < nvis
        word = tl.load(bits + J // 32, mask=vis, other=0)
        sel = (((word >> (J % 32)) & 1) != 0) & vis
        n = tl.where(sel, tl.minimum(tl.maximum(tile_limit - J * TPB, 0), TPB), 0)
        first = pos + tl.cumsum(n, axis=0) - n  # exclusive scan: where block J's tiles go
        dst = first[:, None] + sub[None, :]
        ok = (sub[None, :] < n[:, None]) & (dst < capacity)
        tl.store(kv_tiles_ptr + dst, J[:, None] * TPB + sub[None, :], mask=ok)
        pos += tl.sum(n, axis=0)


# --------------------------------------------------------------------------------------
# Host wrappers
# --------------------------------------------------------------------------------------
def block_means(
    k_pages: torch.Tensor, v_pages: torch.Tensor, plan: PrefillPlan, score_dtype: torch.dtype,
    *, launch: IndexLaunch = IndexLaunch(), descales: Fp8Descales | None = None,
) -> tuple[BlockMeans, torch.Tensor]:
    """fp32 K/V block means and the K means in ``score_dtype`` (the same tensor if fp32).
    FP8: the means are of the descaled values; the scoring copy is ``round_e4m3(kbar / c_k)``."""
    hkv, d = k_pages.shape[2], k_pages.shape[3]
    nblk = plan.total_blocks
    device = k_pages.device
    kbar = torch.empty(nblk, hkv, d, dtype=torch.float32, device=device)
    vbar = torch.empty_like(kbar)
    write_q = score_dtype != torch.float32
    kbar_q = torch.empty(nblk, hkv, d, dtype=score_dtype, device=device) if write_q else kbar
    if nblk == 0:
        return BlockMeans(kbar=kbar, vbar=vbar), kbar_q
    bs = plan.config.block_size
    tokens = min(launch.means_tokens, bs)
    fp8 = descales is not None
    kd = descales.k if fp8 else kbar
    vd = descales.v if fp8 else kbar
    dstr = (*kd.stride(), *vd.stride()) if fp8 else (0, 0, 0, 0)
    _block_means_kernel[(nblk, hkv)](
        k_pages, v_pages, plan.page_table, plan.seqlens_kv_t, plan.cu_blocks,
        kbar, vbar, kbar_q, kd, vd,
        plan.batch_size,
        k_pages.stride(0), k_pages.stride(1), k_pages.stride(2),
        v_pages.stride(0), v_pages.stride(1), v_pages.stride(2), v_pages.stride(3),
        plan.page_table.stride(0), *dstr,
        hkv,
        PAGE_SIZE=k_pages.shape[1],
        BLOCK_SIZE=bs,
        HEAD_DIM=d,
        BLOCK_D=triton.next_power_of_2(d),
        TOKENS=tokens,
        BLOCK_B=triton.next_power_of_2(max(plan.batch_size, 1)),
        WRITE_KBAR_Q=write_q,
        FP8=fp8,
        num_warps=launch.means_warps,
    )
    return BlockMeans(kbar=kbar, vbar=vbar), kbar_q


def select_and_compact(
    q: torch.Tensor, plan: PrefillPlan, means: BlockMeans, kbar_q: torch.Tensor,
    *, capacity: int | None = None, launch: IndexLaunch = IndexLaunch(),
    descales: Fp8Descales | None = None,
) -> tuple[SparseIndex, torch.Tensor]:
    """Score, threshold, force and compact; returns the index and the required entry count
    (int32 ``[1]`` on the device)."""
    cfg = plan.config
    device = q.device
    nseg = plan.num_segments
    i32 = dict(dtype=torch.int32, device=device)
    offsets = torch.zeros(nseg + 1, **i32)
    if nseg == 0:
        kv_tiles = torch.empty(capacity or 0, **i32)
        return SparseIndex(seg_offsets=offsets, kv_tiles=kv_tiles, means=means), offsets[-1:].clone()

    d = q.shape[-1]
    g = plan.group_size
    bs = cfg.block_size
    words = triton.cdiv(plan.max_blocks, _BITS)
    nprog = _score_programs(device, nseg, launch)
    scratch = torch.empty(nprog, plan.max_blocks, dtype=torch.float32, device=device)
    bits = torch.empty(nseg, words, **i32)
    counts = torch.empty(nseg, **i32)
    keep_all = cfg.alpha == 0
    fp8 = descales is not None
    qd = descales.q if fp8 else scratch
    kd = descales.k if fp8 else scratch
    dstr = (*qd.stride(), *kd.stride()) if fp8 else (0, 0, 0, 0)
    _score_select_kernel[(nprog,)](
        q, kbar_q, qd, kd,
        plan.tile_seq, plan.cu_seqlens_q, plan.seqlens_kv_t, plan.cu_qtiles, plan.cu_blocks,
        plan.dense_rows_from, scratch, bits, counts,
        q.stride(0), q.stride(1), *dstr,
        nseg, plan.total_tiles, plan.num_kv_heads, nprog,
        plan.max_blocks, words,
        cfg.softmax_scale(d) * _LOG2E,
        0.0 if keep_all else math.log2(cfg.alpha),
        cfg.sink_tokens, max(cfg.window_tokens, 1),  # the block of key pmin + P: no empty row
        G=g,
        HEAD_DIM=d,
        BLOCK_D=triton.next_power_of_2(d),
        BLOCK_SIZE=bs,
        TILE_M=Q_TILE,
        TILE=KV_TILE,
        BLOCK_N=launch.block_n,
        WORDS=launch.select_words,
        KEEP_ALL=keep_all,
        FIRST_KEY=cfg.energy_rule == "first_key",
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        UPCAST_DOT=q.dtype == torch.bfloat16 and _interpreting(),
        FP8=fp8,
        num_warps=launch.score_warps,
        num_stages=launch.score_stages,
        # the cap is spill-free for 16- and 8-bit operands up to d = 128 (e4m3: 240 registers
        # uncapped, 168 with no stack under it); fp32 spills ~4 KiB
        **_maxnreg(launch.score_maxnreg if q.element_size() <= 2 and d <= 128 else None),
    )
    torch.cumsum(counts, 0, dtype=torch.int32, out=offsets[1:])
    required = offsets[-1:].clone()
    if capacity is None:
        capacity = int(required.item())  # the only host sync: size kv_tiles exactly
    else:
        offsets.clamp_(max=capacity)  # overflowing segments lose their tail, stay in bounds
    kv_tiles = torch.empty(capacity, **i32)
    if capacity == 0:  # nothing can be written (and a CUDA launch wants a real pointer)
        return SparseIndex(seg_offsets=offsets, kv_tiles=kv_tiles, means=means), required
    tpb = cfg.tiles_per_block
    _compact_kernel[(nseg,)](
        bits, offsets, kv_tiles,
        plan.tile_seq, plan.cu_seqlens_q, plan.seqlens_kv_t, plan.cu_qtiles,
        plan.total_tiles, words, capacity,
        G=g,
        BLOCK_SIZE=bs,
        TILE_M=Q_TILE,
        TILE=KV_TILE,
        TPB_P2=triton.next_power_of_2(tpb),
        BLOCK_J=launch.compact_blocks,
        num_warps=launch.compact_warps,
    )
    return SparseIndex(seg_offsets=offsets, kv_tiles=kv_tiles, means=means), required


def build_index_with_status(
    q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, plan: PrefillPlan,
    *, capacity: int | None = None, launch: IndexLaunch = IndexLaunch(),
    descales: Fp8Descales | None = None,
) -> tuple[SparseIndex, torch.Tensor]:
    """``build_index`` plus ``required``: int32 ``[1]`` device tensor, the number of CSR
    entries the full index needs (``> capacity`` means the index overflowed and was cut)."""
    if capacity is not None and (isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 0):
        raise ValueError(f"capacity: expected None or an int >= 0, got {capacity!r}")
    if (descales is not None) != (q.dtype == torch.float8_e4m3fn):
        raise ValueError(f"descales: expected Fp8Descales exactly for float8_e4m3fn inputs, q is {q.dtype}")
    means, kbar_q = block_means(k_pages, v_pages, plan, q.dtype, launch=launch, descales=descales)
    return select_and_compact(q, plan, means, kbar_q, capacity=capacity, launch=launch, descales=descales)


def build_index(
    q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, plan: PrefillPlan,
    *, capacity: int | None = None, descales: Fp8Descales | None = None,
) -> SparseIndex:
    """Index stage on the paged layout; equals ``kernels.reference.build_index``.

    ``capacity=None``: ``kv_tiles`` has exactly ``nnz`` entries (one host read of ``nnz``).
    ``capacity=n``: no host sync; ``kv_tiles`` has ``n`` entries and ``seg_offsets`` is
    clamped to ``n`` (use ``build_index_with_status`` to detect the overflow on the device).
    """
    return build_index_with_status(q, k_pages, v_pages, plan, capacity=capacity, descales=descales)[0]


__all__ = ["IndexLaunch", "block_means", "select_and_compact", "build_index", "build_index_with_status"]
