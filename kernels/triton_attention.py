"""Triton attention stage of FlashPrefill V2: block-sparse attention over the CSR index.

Computes, for every packed row ``i`` of every (sequence, KV head, query tile) segment,

    O = (sum_{j in S, j <= p+P} e^{s_j} v_j + sum_{J in C} |B_J| e^{sbar_J} vbar_J)
        / (sum_{j in S, j <= p+P} e^{s_j}   + sum_{J in C} |B_J| e^{sbar_J})

and ``lse`` (natural log of the denominator), exactly what ``kernels.reference.sparse_attention``
computes (SPEC.md "Attention stage with mean correction", docs/SEMANTICS.md).

Supports
- PackGQA: one program per (sequence, KV head, 128-row query tile[, split]); rows ``r = p*g + t``
  so the ``g`` query heads of a group share every staged K/V tile.
- Varlen batches with cached prefixes (bottom-right causal: key ``j`` visible to position ``p``
  iff ``j <= p + P``), empty and single-token sequences.
- Paged K/V with any ``page_size >= 1``: one page lookup per 64-token tile when ``page_size`` is a
  multiple of 64, one lookup per key row otherwise.
- The CSR list is walked backwards (diagonal first, eq. 17) with the next index prefetched;
  the causal mask is applied only to the few tiles that cross the diagonal.
- Fully visible tiles two CSR entries at a time (``PAIR``): one [128, 128] score tile whose
  K/V rows come from two (non-adjacent) 64-token tiles, half the online-softmax steps.
- Mean correction in the same online softmax: chunks of 64 block means whose logits are
  shifted by ``log |B_J|``; the selected blocks come from a per-segment bitmask built by a
  small prepass (``schedule.selected_blocks``). The term uses the fp32 means: for 16-bit inputs each
  is split once per call into two operands of q's dtype (``index.split_means``: hi + lo, two
  dots each for the scores and the PV product), so the chunk loop is unmasked and
  cp.async-pipelined.
- Split-KV by selected-tile count (eq. 18) with an exact LSE combine; programs ordered by
  decreasing work (device-side argsort of the segment lengths). Both come from
  ``kernels/schedule.py``, shared with the CUTLASS kernel.
- ``dense=True``: the same kernel over every visible tile (no index), no correction.
- fp16 / bf16 (tensor cores, fp32 accumulation) and fp32 (exact fp32 dots, for tests);
  head_dim a multiple of 16 up to 256 (non powers of two are padded and masked).
- FP8 e4m3 (eq. 15, ``kernels/fp8.py``): per-(sequence, KV head) descales folded into the
  base-2 logit scale and the epilogue, ``P`` quantized as ``round_e4m3(256 p)`` for the fp8 PV
  wgmma, correction operands re-quantized once per call; V row-major (Triton transposes the
  fp8 B operand in shared memory) or token-major (already K-major), measured in
  ``benchmarks/bench_operator.py``.

Does not
- Warp specialization, TMA descriptors or a persistent scheduler: loads are plain pointer
  loads software-pipelined by ``tl.range``.
- Validate its inputs: ``kernels.ops`` does that once per batch (``plan_prefill``).

Numerics: block means enter the tensor-core dots as hi + lo pairs of the input dtype (fp32 for
fp32 inputs, e4m3 re-quantized for FP8); probabilities are rounded to the input dtype before the
PV product, as in FlashAttention.

FLOPs (for TFLOP/s): each visible (query row, selected key) pair costs ``4 d`` (``2 d`` for
``q.k``, ``2 d`` for ``p.v``); each (query row, corrected block) pair also ``4 d``. Work done by
the tensor cores is larger: whole 128x64 tiles, diagonal tiles included, are multiplied.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_interpreter import apply_if_interpreting

from . import fp8
from .config import KV_TILE, Q_TILE
from .fp8 import Fp8Descales
from .index import SparseIndex, split_means
from .plan import PrefillPlan
from .ranges import op_range
from .schedule import auto_num_splits, num_sms, selected_blocks, work_order

apply_if_interpreting()  # TRITON_INTERPRET=1: the CPU interpreter's fixes (triton_interpreter.py)

_LOG2E = 1.4426950408889634
_empty = torch.empty  # outputs and split partials (tests swap in a NaN-filled allocator)


# --------------------------------------------------------------------------------------------
# device helpers
# --------------------------------------------------------------------------------------------


@triton.jit
def _kv_rows(pt_row, n, Lkv, offs_n,
             PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, MASK_KEYS: tl.constexpr):
    """(page, slot) of the 64 keys of tile ``n``: token j lives at page_table[b, j // ps], j % ps."""
    if PAGE_SIZE % BLOCK_N == 0:
        # the whole tile lies in one page: one page-table lookup
        page = tl.load(pt_row + (n * BLOCK_N) // PAGE_SIZE).to(tl.int64)
        slot = ((n * BLOCK_N) % PAGE_SIZE + offs_n).to(tl.int64)
    else:
        j = n * BLOCK_N + offs_n
        if MASK_KEYS:
            page = tl.load(pt_row + j // PAGE_SIZE, mask=j < Lkv, other=0).to(tl.int64)
        else:
            page = tl.load(pt_row + j // PAGE_SIZE).to(tl.int64)
        slot = (j % PAGE_SIZE).to(tl.int64)
    return page, slot


@triton.jit
def _load_kv_tile(K, V, pt_row, n, Lkv, offs_n, offs_d,
                  sk_p, sk_s, sv_p, sv_s, sv_d,
                  HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, PAGE_SIZE: tl.constexpr,
                  BLOCK_N: tl.constexpr, MASK_KEYS: tl.constexpr):
    """K and V rows of tile ``n`` ([BLOCK_N, D_PAD]); keys past ``Lkv`` read as 0 when masked."""
    page, slot = _kv_rows(pt_row, n, Lkv, offs_n, PAGE_SIZE, BLOCK_N, MASK_KEYS)
    k_ptrs = K + (page * sk_p + slot * sk_s)[:, None] + offs_d[None, :]
    v_ptrs = V + (page * sv_p + slot * sv_s)[:, None] + offs_d[None, :] * sv_d
    if MASK_KEYS:
        m = ((n * BLOCK_N + offs_n) < Lkv)[:, None] & (offs_d < HEAD_DIM)[None, :]
        k = tl.load(k_ptrs, mask=m, other=0.0)
        v = tl.load(v_ptrs, mask=m, other=0.0)
    elif HEAD_DIM == D_PAD:
        k = tl.load(k_ptrs)
        v = tl.load(v_ptrs)
    else:
        m = (offs_d < HEAD_DIM)[None, :]
        k = tl.load(k_ptrs, mask=m, other=0.0)
        v = tl.load(v_ptrs, mask=m, other=0.0)
    return k, v


@triton.jit
def _load_kv_pair(K, V, pt_row, n_a, n_b, offs_p, offs_d,
                  sk_p, sk_s, sv_p, sv_s, sv_d,
                  HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, PAGE_SIZE: tl.constexpr,
                  BLOCK_N: tl.constexpr):
    """K and V rows of two fully visible tiles as one [2 BLOCK_N, D_PAD] operand: row ``i`` is
    row ``i % BLOCK_N`` of tile ``n_a`` (first half) or ``n_b`` (second half)."""
    first = offs_p < BLOCK_N
    sub = offs_p % BLOCK_N
    if PAGE_SIZE % BLOCK_N == 0:
        page_a = tl.load(pt_row + (n_a * BLOCK_N) // PAGE_SIZE)
        page_b = tl.load(pt_row + (n_b * BLOCK_N) // PAGE_SIZE)
        page = tl.where(first, page_a, page_b).to(tl.int64)
        slot = (tl.where(first, (n_a * BLOCK_N) % PAGE_SIZE, (n_b * BLOCK_N) % PAGE_SIZE)
                + sub).to(tl.int64)
    else:
        j = tl.where(first, n_a, n_b) * BLOCK_N + sub
        page = tl.load(pt_row + j // PAGE_SIZE).to(tl.int64)
        slot = (j % PAGE_SIZE).to(tl.int64)
    k_ptrs = K + (page * sk_p + slot * sk_s)[:, None] + offs_d[None, :]
    v_ptrs = V + (page * sv_p + slot * sv_s)[:, None] + offs_d[None, :] * sv_d
    if HEAD_DIM == D_PAD:
        k = tl.load(k_ptrs)
        v = tl.load(v_ptrs)
    else:
        m = (offs_d < HEAD_DIM)[None, :]
        k = tl.load(k_ptrs, mask=m, other=0.0)
        v = tl.load(v_ptrs, mask=m, other=0.0)
    return k, v


@triton.jit
def _online_update(acc, m_i, l_i, s, v, MASKED: tl.constexpr, PRECISION: tl.constexpr,
                   FP8: tl.constexpr, v_lo=None, V_LO: tl.constexpr = False):
    """One online-softmax step on base-2 logits ``s`` ([M, N], -inf where masked). FP8: the
    PV operand is ``round_e4m3(256 p)`` (eq. 15); ``l`` sums the unrounded ``p``, so ``acc``
    carries a factor 256 that the epilogue removes. ``V_LO``: the values are ``v + v_lo`` (an
    fp32 mean carried as two 16-bit parts), two PV products."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    if MASKED:
        # rows that have seen nothing yet keep m = -inf; shift by 0 instead of NaN
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_use = m_new
    alpha = tl.math.exp2(m_i - m_use)
    p = tl.math.exp2(s - m_use[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    if FP8:
        acc = tl.dot((p * 256.0).to(v.dtype), v, acc)
    else:
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=PRECISION)
        if V_LO:
            acc = tl.dot(p.to(v.dtype), v_lo, acc, input_precision=PRECISION)
    return acc, m_new, l_i


# --------------------------------------------------------------------------------------------
# attention kernel
# --------------------------------------------------------------------------------------------


# batch-dependent integers are not specialized (a new batch shape must not recompile)
@triton.jit(do_not_specialize=["total_tiles", "total_q", "words_per_seg", "s_lo"])
def _sparse_attn_fwd(
    Q, K, V, Kbar, Vbar, Out, Lse, OPart, LsePart, QD, KD, VD,
    seg_offsets, kv_tiles, order, corr_bits, words_per_seg,
    cu_seqlens_q, seqlens_kv, cu_qtiles, cu_blocks, tile_seq, page_table,
    sq_t, sq_h, sk_p, sk_s, sk_h, sv_p, sv_s, sv_h, sv_d,
    skb_t, skb_h, svb_t, svb_h, svb_d, s_lo, s_pt,
    sqd_b, sqd_h, skd_b, skd_h, svd_b, svd_h,
    total_tiles, total_q, num_splits, qk_scale,
    G: tl.constexpr, HQ: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, TPB: tl.constexpr, MAX_DIAG: tl.constexpr,
    CORR_BLOCKS: tl.constexpr, CORRECTION: tl.constexpr, DENSE: tl.constexpr,
    SPLIT: tl.constexpr, PRECISION: tl.constexpr, LOOP_STAGES: tl.constexpr,
    PAIR: tl.constexpr, FP8: tl.constexpr, MEANS_LO: tl.constexpr,
):
    pid = tl.program_id(0)
    rank = pid // num_splits
    u = pid % num_splits
    seg = tl.load(order + rank)
    h = seg // total_tiles
    t = seg % total_tiles
    b = tl.load(tile_seq + t)
    tile = t - tl.load(cu_qtiles + b)
    q0 = tl.load(cu_seqlens_q + b)
    lq = tl.load(cu_seqlens_q + b + 1) - q0
    lkv = tl.load(seqlens_kv + b)
    prefix = lkv - lq
    if FP8:  # descales of this (sequence, KV head): S = c_q c_k (q8 k8^T), O = c_v (P V8)
        qk = qk_scale * tl.load(QD + b * sqd_b + h * sqd_h) * tl.load(KD + b * skd_b + h * skd_h)
    else:
        qk = qk_scale

    # PackGQA rows of this tile: r = p*G + t
    r0 = tile * BLOCK_M
    rows = r0 + tl.arange(0, BLOCK_M)
    row_ok = rows < G * lq
    pos = rows // G
    head = h * G + rows % G
    lo = r0 // G + prefix  # pmin + P
    hi = (tl.minimum(r0 + BLOCK_M, G * lq) - 1) // G + prefix  # pmax + P
    key_limit = pos + prefix  # last visible key of each row

    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D_PAD)
    d_ok = offs_d < HEAD_DIM
    tok = (q0 + pos).to(tl.int64)
    q = tl.load(Q + tok[:, None] * sq_t + head[:, None] * sq_h + offs_d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)

    K_h = K + h.to(tl.int64) * sk_h
    V_h = V + h.to(tl.int64) * sv_h
    pt_row = page_table + b.to(tl.int64) * s_pt

    # the segment's tile list (ascending); dense: every tile up to the causal horizon
    first_masked = (lo + 1) // BLOCK_N  # tiles >= this cross the diagonal (or Lkv)
    if DENSE:
        seg_lo = 0
        n_list = hi // BLOCK_N + 1
        n_diag = n_list - first_masked
    else:
        seg_lo = tl.load(seg_offsets + seg)
        n_list = tl.load(seg_offsets + seg + 1) - seg_lo
        # the masked tiles are a short suffix of the ascending list: count them
        tail = n_list - MAX_DIAG + tl.arange(0, MAX_DIAG)
        last = tl.load(kv_tiles + seg_lo + tail, mask=tail >= 0, other=-1)
        n_diag = tl.sum((last >= first_masked).to(tl.int32), 0)
    tiles_ptr = kv_tiles + seg_lo

    # split u owns list positions [i_lo, i_hi) (eq. 18, counted from the top of the list)
    per_split = tl.cdiv(n_list, num_splits)
    i_hi = tl.maximum(n_list - u * per_split, 0)
    i_lo = tl.maximum(n_list - (u + 1) * per_split, 0)
    i_mid = n_list - n_diag

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], dtype=tl.float32)

    # 1) diagonal tiles (masked), from the top down
    top = i_hi - 1
    n_masked = tl.maximum(i_hi - tl.maximum(i_lo, i_mid), 0)
    for it in range(0, n_masked):
        i = top - it
        if DENSE:
            n = i
        else:
            n = tl.load(tiles_ptr + i)
        k, v = _load_kv_tile(K_h, V_h, pt_row, n, lkv, offs_n, offs_d, sk_p, sk_s, sv_p, sv_s, sv_d,
                             HEAD_DIM, D_PAD, PAGE_SIZE, BLOCK_N, True)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk
        keys = n * BLOCK_N + offs_n
        visible = (keys[None, :] <= key_limit[:, None]) & (keys < lkv)[None, :]
        s = tl.where(visible, s, float("-inf"))
        acc, m_i, l_i = _online_update(acc, m_i, l_i, s, v, True, PRECISION, FP8)

    # 2) tiles every row sees entirely: no mask, software pipelined, next index prefetched
    top = tl.minimum(i_hi, i_mid) - 1
    n_full = tl.maximum(top + 1 - i_lo, 0)
    if PAIR:
        # two list entries per step: one [128, 128] score tile (wider wgmma, half the
        # softmax steps); an odd count leaves the lowest entry to the 64-wide loop below
        offs_p = tl.arange(0, 2 * BLOCK_N)
        n_pairs = n_full // 2
        if DENSE:
            na_next = top
            nb_next = top - 1
        else:
            na_next = tl.load(tiles_ptr + top, mask=n_pairs > 0, other=0)
            nb_next = tl.load(tiles_ptr + top - 1, mask=n_pairs > 0, other=0)
        for it in tl.range(0, n_pairs, num_stages=LOOP_STAGES):
            n_a = na_next
            n_b = nb_next
            if DENSE:
                na_next = n_a - 2
                nb_next = n_b - 2
            else:
                nxt = tl.maximum(top - 2 * it - 2, i_lo + 1)
                na_next = tl.load(tiles_ptr + nxt)
                nb_next = tl.load(tiles_ptr + nxt - 1)
            k, v = _load_kv_pair(K_h, V_h, pt_row, n_a, n_b, offs_p, offs_d, sk_p, sk_s, sv_p,
                                 sv_s, sv_d, HEAD_DIM, D_PAD, PAGE_SIZE, BLOCK_N)
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk
            acc, m_i, l_i = _online_update(acc, m_i, l_i, s, v, False, PRECISION, FP8)
        top = top - 2 * n_pairs
        n_full = n_full - 2 * n_pairs
    if DENSE:
        n_next = top
    else:
        n_next = tl.load(tiles_ptr + top, mask=n_full > 0, other=0)
    for it in tl.range(0, n_full, num_stages=LOOP_STAGES):
        n = n_next
        if DENSE:
            n_next = n - 1
        else:
            n_next = tl.load(tiles_ptr + tl.maximum(top - it - 1, i_lo))
        k, v = _load_kv_tile(K_h, V_h, pt_row, n, lkv, offs_n, offs_d, sk_p, sk_s, sv_p, sv_s, sv_d,
                             HEAD_DIM, D_PAD, PAGE_SIZE, BLOCK_N, False)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk
        acc, m_i, l_i = _online_update(acc, m_i, l_i, s, v, False, PRECISION, FP8)

    # 3) mean correction: fully visible blocks with no selected tile, owned by the last split.
    # corr_bits holds one bit per (segment, selected logical block) (``schedule.selected_blocks``);
    # the means arrive as tensor-core operands prepared once per call, so each chunk is
    # unmasked, cp.async-pipelined [CORR_BLOCKS, d] loads and one tile of online softmax.
    # MEANS_LO (16-bit inputs): each fp32 mean is hi + lo, two operands of q's dtype at
    # Kbar/Vbar and s_lo elements further (SEMANTICS choice 4: the term uses the fp32 means;
    # hi alone, the mean rounded to bf16, put lse off by up to 3e-3).
    if CORRECTION:
        if u == num_splits - 1:
            if lo + 1 < lkv:
                n_blocks_full = (lo + 1) // BLOCK_SIZE
            else:
                n_blocks_full = tl.cdiv(lkv, BLOCK_SIZE)
            blk0 = tl.load(cu_blocks + b).to(tl.int64)
            offs_c = tl.arange(0, CORR_BLOCKS)
            bits_row = corr_bits + seg.to(tl.int64) * words_per_seg
            last_blk = tl.maximum(n_blocks_full - 1, 0)
            kb_h = Kbar + h.to(tl.int64) * skb_h
            vb_h = Vbar + h.to(tl.int64) * svb_h
            for c in tl.range(0, tl.cdiv(n_blocks_full, CORR_BLOCKS), num_stages=LOOP_STAGES):
                J = c * CORR_BLOCKS + offs_c
                word = tl.load(bits_row + J // 32)
                todo = (J < n_blocks_full) & (((word >> (J % 32)) & 1) == 0)
                rowsJ = blk0 + tl.minimum(J, last_blk)  # in bounds: no load mask
                kb_ptrs = kb_h + rowsJ[:, None] * skb_t + offs_d[None, :]
                vb_ptrs = vb_h + rowsJ[:, None] * svb_t + offs_d[None, :] * svb_d
                if HEAD_DIM == D_PAD:
                    kb = tl.load(kb_ptrs)
                    vb = tl.load(vb_ptrs)
                    if MEANS_LO:
                        kb_lo = tl.load(kb_ptrs + s_lo)
                        vb_lo = tl.load(vb_ptrs + s_lo)
                else:
                    kb = tl.load(kb_ptrs, mask=d_ok[None, :], other=0.0)
                    vb = tl.load(vb_ptrs, mask=d_ok[None, :], other=0.0)
                    if MEANS_LO:
                        kb_lo = tl.load(kb_ptrs + s_lo, mask=d_ok[None, :], other=0.0)
                        vb_lo = tl.load(vb_ptrs + s_lo, mask=d_ok[None, :], other=0.0)
                size = tl.minimum((J + 1) * BLOCK_SIZE, lkv) - J * BLOCK_SIZE
                # log |B_J| for the blocks to correct, -inf for the others: one column bias
                bias = tl.where(todo, tl.math.log2(tl.maximum(size, 1).to(tl.float32)),
                                float("-inf"))
                s = tl.dot(q, tl.trans(kb), input_precision=PRECISION)
                if MEANS_LO:
                    s = tl.dot(q, tl.trans(kb_lo), s, input_precision=PRECISION)
                    s = s * qk + bias[None, :]
                    acc, m_i, l_i = _online_update(acc, m_i, l_i, s, vb, True, PRECISION, FP8,
                                                   vb_lo, True)
                else:
                    s = s * qk + bias[None, :]
                    acc, m_i, l_i = _online_update(acc, m_i, l_i, s, vb, True, PRECISION, FP8)

    # epilogue
    if FP8:  # acc = 256 sum P~ V8: restore c_v / 256 (l sums the unrounded p)
        acc = acc * (tl.load(VD + b * svd_b + h * svd_h) * (1.0 / 256.0))
    out_rows = tok * HQ + head  # out / lse are contiguous [Tq, Hq, (d)]
    if SPLIT:
        has = l_i > 0.0
        o = acc / tl.where(has, l_i, 1.0)[:, None]
        lse2 = tl.where(has, m_i + tl.math.log2(tl.where(has, l_i, 1.0)), float("-inf"))
        prow = u.to(tl.int64) * total_q * HQ + out_rows
        tl.store(OPart + prow[:, None] * D_PAD + offs_d[None, :], o, mask=row_ok[:, None])
        tl.store(LsePart + prow, lse2, mask=row_ok)
    else:
        o = acc / l_i[:, None]
        tl.store(Out + out_rows[:, None] * HEAD_DIM + offs_d[None, :], o.to(Out.dtype.element_ty),
                 mask=row_ok[:, None] & d_ok[None, :])
        tl.store(Lse + out_rows, (m_i + tl.math.log2(l_i)) * 0.6931471805599453, mask=row_ok)


@triton.jit
def _combine_splits(OPart, LsePart, Out, Lse, n_rows, num_splits,
                    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK_R: tl.constexpr):
    """Exact merge of the split partials (base-2 LSE) into out (q dtype) and lse (natural log)."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    ok = rows < n_rows
    rows64 = rows.to(tl.int64)
    offs_d = tl.arange(0, D_PAD)
    m = tl.full([BLOCK_R], float("-inf"), dtype=tl.float32)
    for u in range(0, num_splits):
        m = tl.maximum(m, tl.load(LsePart + u * n_rows + rows64, mask=ok, other=float("-inf")))
    m_use = tl.where(m == float("-inf"), 0.0, m)
    den = tl.zeros([BLOCK_R], dtype=tl.float32)
    acc = tl.zeros([BLOCK_R, D_PAD], dtype=tl.float32)
    for u in range(0, num_splits):
        prow = u * n_rows + rows64
        w = tl.math.exp2(tl.load(LsePart + prow, mask=ok, other=float("-inf")) - m_use)
        o = tl.load(OPart + prow[:, None] * D_PAD + offs_d[None, :], mask=ok[:, None], other=0.0)
        den += w
        acc += w[:, None] * o
    den = tl.where(ok, den, 1.0)  # rows past the end
    out = acc / den[:, None]
    tl.store(Out + rows64[:, None] * HEAD_DIM + offs_d[None, :], out.to(Out.dtype.element_ty),
             mask=ok[:, None] & (offs_d < HEAD_DIM)[None, :])
    tl.store(Lse + rows64, (m_use + tl.math.log2(den)) * 0.6931471805599453, mask=ok)


# --------------------------------------------------------------------------------------------
# host side: launch configuration, scheduling, public entry point
# --------------------------------------------------------------------------------------------


def _launch_config(head_dim: int) -> tuple[int, int]:
    """(num_warps, pipeline stages, pair) for BLOCK_M=128 on sm_90: two warpgroups of 64 rows.
    Compiled for sm_90 on a CPU (cuobjdump --dump-resource-usage), d=128, bf16, 3 stages: pair
    off 254 registers, no spill, 129 KB smem; pair on 255 registers, 16-byte stack (3 STL),
    160 KB smem. H200 (benchmarks/tune_kernels.py, docs/PERF_NOTES.md): pair on, 3 stages is
    fastest at 32K-128K (2 stages -16%, 4 stages no gain); 128-wide correction chunks spill
    ~190 bytes and are slower than 64. d=256 (not re-measured) keeps 2 stages, no pair."""
    if head_dim <= 128:
        return 8, 3, True
    return 8, 2, False


def sparse_attention(
    q: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    plan: PrefillPlan,
    index: SparseIndex | None,
    *,
    num_splits: int | None = None,
    dense: bool = False,
    _num_warps: int | None = None,
    _num_stages: int | None = None,
    _pair: bool | None = None,
    _corr_blocks: int = 64,
    descales: Fp8Descales | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention stage over ``index`` (or every visible tile with ``dense=True``).

    Inputs as validated by ``kernels.ops.plan_prefill``: ``q [Tq, Hq, d]``,
    ``k_pages/v_pages [num_pages, page_size, Hkv, d]``. Returns ``out [Tq, Hq, d]`` in ``q.dtype``
    and ``lse [Tq, Hq]`` float32 (natural log). ``num_splits=None`` picks automatically
    (``config.num_splits`` when positive). No host synchronisation.

    FP8 (``q``, pages ``float8_e4m3fn`` and ``descales``): output bfloat16. V may be stored
    token-major (``v_pages`` a permuted ``[num_pages, Hkv, d, page_size]`` tensor): then the
    PV product's B operand is K-major in shared memory, as Hopper's fp8 wgmma wants.
    """
    cfg = plan.config
    tq, hq, d = q.shape
    is_fp8 = descales is not None
    if is_fp8 != (q.dtype == fp8.FP8_DTYPE):
        raise ValueError(f"descales: expected Fp8Descales exactly for float8_e4m3fn inputs, q is {q.dtype}")
    out = _empty((tq, hq, d), dtype=fp8.OUT_DTYPE if is_fp8 else q.dtype, device=q.device)
    lse = _empty((tq, hq), dtype=torch.float32, device=q.device)
    num_segments = plan.num_segments
    if tq == 0 or num_segments == 0:
        return out, lse
    if not dense and index is None:
        raise ValueError("index: expected a SparseIndex (or pass dense=True), got None")
    if num_splits is None:
        dev_index = q.device.index if q.device.type == "cuda" else None
        num_splits = auto_num_splits(plan, num_sms(dev_index))
    if isinstance(num_splits, bool) or not isinstance(num_splits, int) or num_splits < 1:
        raise ValueError(f"num_splits: expected an int >= 1 or None, got {num_splits!r}")

    g = plan.group_size
    d_pad = max(16, triton.next_power_of_2(d))
    tpb = cfg.tiles_per_block
    correction = bool(cfg.mean_correction) and not dense
    corr_blocks = _corr_blocks  # block means per correction step (a multiple of 32)
    max_diag = triton.next_power_of_2(Q_TILE // KV_TILE + 1 + tpb)
    scale = cfg.softmax_scale(d)
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    warps, stages, pair = _launch_config(d)
    if q.dtype == torch.float32 and d > 64:
        # fp32 tiles are twice the bytes: 3 stages of 128x128 K/V exceed the 227 KB of shared
        # memory (seen on the H200 at d=128: 262 KB asked). fp32 is the exact-math test path.
        stages, pair = 1, False
    warps = _num_warps or warps
    stages = _num_stages or stages
    pair = pair if _pair is None else bool(_pair)

    order = work_order(plan, index, dense)
    if dense:
        seg_offsets = kv_tiles = order  # unused
        kbar = vbar = q  # unused
    else:
        seg_offsets, kv_tiles = index.seg_offsets, index.kv_tiles
        kbar, vbar = index.means.kbar, index.means.vbar
        if kv_tiles.numel() == 0:
            kv_tiles = seg_offsets  # never dereferenced when every segment is empty
    words = 1
    corr_bits = seg_offsets  # unused without correction
    with op_range("correction"):  # the operands of the mean correction (its math runs in the attention kernel)
        means_lo = False
        if correction and is_fp8:
            # e4m3 operands re-quantized with each block's (sequence, KV head) descale; V means
            # stored block-major ([Hkv, d, blocks]) so the PV operand is K-major like V's tiles
            seq = plan.block_seq  # shared by every layer of the forward
            kbar = fp8.requantize_means(kbar, descales.k, plan.cu_blocks, block_seq=seq)
            vbar = fp8.requantize_means(vbar, descales.v, plan.cu_blocks,
                                        block_seq=seq).permute(1, 2, 0).contiguous().permute(2, 0, 1)
        elif correction and q.dtype != torch.float32:
            # the fp32 means as hi + lo operands of q's dtype, split once per call (not per tile)
            kbar = split_means(kbar, q.dtype)[0]
            vbar = split_means(vbar, q.dtype)[0]
            means_lo = True
        if correction:
            words = max(1, triton.cdiv(plan.max_blocks, corr_blocks)) * (corr_blocks // 32)
            corr_bits = torch.zeros((num_segments, words), dtype=torch.int32, device=q.device)
            if kv_tiles.numel():
                selected_blocks[(num_segments,)](seg_offsets, kv_tiles, corr_bits, words,
                                                  TPB=tpb, BLOCK_E=128, num_warps=4)
    split = num_splits > 1
    if split:
        o_part = _empty((num_splits, tq, hq, d_pad), dtype=torch.float32, device=q.device)
        lse_part = _empty((num_splits, tq, hq), dtype=torch.float32, device=q.device)
    else:
        o_part, lse_part = out, lse  # unused
    pt = plan.page_table
    if is_fp8:
        qd, kd, vd = descales.q, descales.k, descales.v
        dstr = descales.strides()
    else:
        qd = kd = vd = lse  # unused
        dstr = (0, 0, 0, 0, 0, 0)
    grid = (num_segments * num_splits,)
    _sparse_attn_fwd[grid](
        q, k_pages, v_pages, kbar, vbar, out, lse, o_part, lse_part, qd, kd, vd,
        seg_offsets, kv_tiles, order, corr_bits, words,
        plan.cu_seqlens_q, plan.seqlens_kv_t, plan.cu_qtiles, plan.cu_blocks, plan.tile_seq, pt,
        q.stride(0), q.stride(1),
        k_pages.stride(0), k_pages.stride(1), k_pages.stride(2),
        v_pages.stride(0), v_pages.stride(1), v_pages.stride(2), v_pages.stride(3),
        kbar.stride(0), kbar.stride(1) if kbar.dim() > 1 else 0,
        vbar.stride(0), vbar.stride(1) if vbar.dim() > 1 else 0, vbar.stride(2) if vbar.dim() > 2 else 1,
        kbar.numel() if means_lo else 0, pt.stride(0), *dstr,
        plan.total_tiles, tq, num_splits, scale * _LOG2E,
        G=g, HQ=hq, HEAD_DIM=d, D_PAD=d_pad,
        BLOCK_M=Q_TILE, BLOCK_N=KV_TILE, PAGE_SIZE=plan.page_size,
        BLOCK_SIZE=cfg.block_size, TPB=tpb, MAX_DIAG=max_diag,
        CORR_BLOCKS=corr_blocks, CORRECTION=correction, DENSE=dense,
        SPLIT=split, PRECISION=precision, LOOP_STAGES=stages, PAIR=pair, FP8=is_fp8,
        MEANS_LO=means_lo, num_warps=warps, num_stages=stages,
    )
    if split:
        n_rows = tq * hq
        block_r = 16
        _combine_splits[(triton.cdiv(n_rows, block_r),)](
            o_part, lse_part, out, lse, n_rows, num_splits,
            HEAD_DIM=d, D_PAD=d_pad, BLOCK_R=block_r, num_warps=4,
        )
    return out, lse


__all__ = ["sparse_attention", "auto_num_splits"]
