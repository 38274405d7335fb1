"""CUTLASS/CuTe attention stage of FlashPrefill V2 (``kernels/csrc/sparse_attn_fwd.cu``).

The same function, signature and outputs as ``kernels.triton_attention.sparse_attention``
(block-sparse attention over the CSR index with mean correction, ``lse`` in natural log), run by a
CUDA C++ kernel on wgmma tensor cores, loaded through a C ABI (``kernels.cutlass_build``).

Supports: CUDA tensors, bf16 / fp16, head_dim 64 and 128, any page size, PackGQA, varlen with
prefixes, split-KV with an exact combine, ``dense=True``. Rows of q, k_pages and v_pages must be
16-byte aligned (last dim contiguous, other strides multiples of 16 bytes): true for tensors
made by ``torch.empty``/``randn`` and views of whole heads.

FP8 (``float8_e4m3fn`` q and pages with ``descales``, ``kernels/fp8.py``): head_dim 128, V
stored token-major (``v_pages`` a permuted ``[num_pages, Hkv, d, page_size]`` tensor, the
K-major operand Hopper's fp8 wgmma takes) with ``page_size % 16 == 0``; bfloat16 output.

Does not: fp32 (the Triton kernel's exact-math test path), other head dims, FP8 with row-major V
or head_dim 64 (the Triton kernel takes those).

Shared with the Triton kernel (one implementation each, ``kernels/schedule.py``): the work order
(``work_order``), the automatic split count (``auto_num_splits``) and the selected-block bitmask
prepass (``selected_blocks``, a Triton kernel).
"""

from __future__ import annotations

import ctypes
import math

import torch

from . import cutlass_build, fp8
from .fp8 import Fp8Descales
from .index import SparseIndex, split_means
from .plan import PrefillPlan
from .ranges import op_range

_LOG2E = 1.4426950408889634
HEAD_DIMS = (64, 128)
DTYPES = (torch.bfloat16, torch.float16, torch.float8_e4m3fn)
FP8_HEAD_DIMS = (128,)
_CORR_CHUNK = 64  # bitmask words per segment cover max_blocks rounded up to this (the kernel reads J < n_blocks_full only)
_empty = torch.empty  # outputs and split partials (tests swap in a NaN-filled allocator)


def available() -> bool:
    """The library can be loaded or built here (a prebuilt path, or nvcc + CUTLASS headers)."""
    return cutlass_build.unavailable_reason() is None


def check_inputs(q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor) -> None:
    """ValueError naming the argument when the kernel cannot take these tensors."""
    if q.dtype not in DTYPES:
        raise ValueError(f"q: the CUTLASS kernel supports bfloat16, float16 and float8_e4m3fn, got "
                         f"{q.dtype} (use backend='triton' for float32)")
    is_fp8 = q.dtype == fp8.FP8_DTYPE
    head_dims = FP8_HEAD_DIMS if is_fp8 else HEAD_DIMS
    if q.dim() != 3 or q.shape[-1] not in head_dims:
        raise ValueError(f"q: the CUTLASS kernel supports head_dim in {head_dims} for {q.dtype}, "
                         f"got shape {tuple(q.shape)} (use backend='triton')")
    for name, t in (("q", q), ("k_pages", k_pages), ("v_pages", v_pages)):
        if t.device != q.device:
            raise ValueError(f"{name}: expected a tensor on {q.device}, got one on {t.device}")
        if t.dtype != q.dtype:
            raise ValueError(f"{name}: expected dtype {q.dtype} (q's), got {t.dtype}")
        if t.shape[-1] != q.shape[-1]:
            raise ValueError(f"{name}: expected head_dim {q.shape[-1]}, got shape {tuple(t.shape)}")
        if is_fp8 and name == "v_pages":
            # token-major V: slots contiguous, whole 16-byte chunks of keys inside a page
            if t.stride(1) != 1:
                raise ValueError(f"v_pages: the CUTLASS kernel takes float8_e4m3fn V token-major (a "
                                 f"permuted [num_pages, Hkv, d, page_size] tensor), got strides "
                                 f"{t.stride()} (use backend='triton' for row-major V)")
            if t.shape[1] % 16 or any(s % 16 for s in (t.stride(0), t.stride(2), t.stride(3))) or t.data_ptr() % 16:
                raise ValueError(f"v_pages: token-major float8_e4m3fn V needs page_size % 16 == 0 and "
                                 f"16-byte aligned d rows, got shape {tuple(t.shape)}, strides "
                                 f"{t.stride()} (use backend='triton')")
            continue
        if t.stride(-1) != 1:
            raise ValueError(f"{name}: expected a contiguous last dimension, got strides "
                             f"{t.stride()} (call .contiguous())")
        align = 16 // t.element_size()
        if any(s % align for s in t.stride()[:-1]) or t.data_ptr() % 16:
            raise ValueError(f"{name}: expected 16-byte aligned rows (strides multiples of {align} "
                             f"elements, aligned base), got strides {t.stride()} and address "
                             f"{t.data_ptr():#x} (call .contiguous())")
    if q.device.type != "cuda":
        raise ValueError(f"q: the CUTLASS kernel needs a CUDA tensor, got one on {q.device}")


def supports(q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor) -> bool:
    try:
        check_inputs(q, k_pages, v_pages)
    except ValueError:
        return False
    return True


def _aligned_block_columns(cu_blocks: torch.Tensor, num_blocks: int,
                           block_seq: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cu_blocks_v [B + 1], column [num_blocks])``: sequence ``b``'s blocks re-based to start at
    a multiple of 64 (``cu_blocks_v[b] = sum_{c<b} round_up(n_c, 64)``) and each block's column
    there. Device ops only (no host synchronisation). ``block_seq``: each block's sequence
    (``PrefillPlan.block_seq``) when the caller has it."""
    counts = cu_blocks[1:] - cu_blocks[:-1]
    padded = (counts + 63) // 64 * 64
    cu_v = torch.zeros_like(cu_blocks)
    cu_v[1:] = torch.cumsum(padded, 0)
    blocks = torch.arange(num_blocks, device=cu_blocks.device, dtype=cu_blocks.dtype)
    seq = torch.searchsorted(cu_blocks[1:].contiguous(), blocks, right=True) if block_seq is None else block_seq
    return cu_v, (cu_v[seq] + blocks - cu_blocks[seq]).long()


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def sparse_attention(
    q: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    plan: PrefillPlan,
    index: SparseIndex | None,
    *,
    num_splits: int | None = None,
    dense: bool = False,
    kernel: str = cutlass_build.DEFAULT_KERNEL,
    max_ctas: int | None = None,
    descales: Fp8Descales | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention stage over ``index`` (or every visible tile with ``dense=True``).

    Inputs as validated by ``kernels.ops.plan_prefill``: ``q [Tq, Hq, d]``,
    ``k_pages/v_pages [num_pages, page_size, Hkv, d]``. Returns ``out [Tq, Hq, d]`` in ``q.dtype``
    and ``lse [Tq, Hq]`` float32 (natural log). ``num_splits=None`` picks automatically
    (``config.num_splits`` when positive). ``kernel`` picks the compiled variant
    (``cutlass_build.KERNELS``: ``ws128`` the warp-specialized kernel with 128 keys per step,
    ``ws64`` with 64, ``ws128_pingpong`` with the consumer warpgroups in pingpong order,
    ``ws128_persistent`` pingpong and one CTA per SM, ``ws128_persistent_nopingpong`` one CTA
    per SM alone). ``max_ctas`` caps a persistent
    variant's grid (default one CTA per SM; tests use a few CTAs so that each walks many work
    units). ``descales``: exactly for float8_e4m3fn inputs (output bfloat16). No host
    synchronisation.
    """
    check_inputs(q, k_pages, v_pages)
    is_fp8 = q.dtype == fp8.FP8_DTYPE
    if is_fp8 != (descales is not None):
        raise ValueError(f"descales: expected Fp8Descales exactly for float8_e4m3fn inputs, q is {q.dtype}")
    if kernel not in cutlass_build.KERNELS:
        raise ValueError(f"kernel: expected one of {tuple(cutlass_build.KERNELS)}, got {kernel!r}")
    if max_ctas is not None and (isinstance(max_ctas, bool) or not isinstance(max_ctas, int)
                                 or max_ctas < 1):
        raise ValueError(f"max_ctas: expected an int >= 1 or None, got {max_ctas!r}")
    from . import schedule  # work order, split count and the bitmask prepass (Triton)

    cfg = plan.config
    tq, hq, d = q.shape
    out = _empty((tq, hq, d), dtype=fp8.OUT_DTYPE if is_fp8 else q.dtype, device=q.device)
    lse = _empty((tq, hq), dtype=torch.float32, device=q.device)
    num_segments = plan.num_segments
    if tq == 0 or num_segments == 0:
        return out, lse
    if not dense and index is None:
        raise ValueError("index: expected a SparseIndex (or pass dense=True), got None")
    if num_splits is None:
        num_splits = schedule.auto_num_splits(plan, schedule.num_sms(q.device.index))
    if isinstance(num_splits, bool) or not isinstance(num_splits, int) or num_splits < 1:
        raise ValueError(f"num_splits: expected an int >= 1 or None, got {num_splits!r}")
    lib = cutlass_build.load_library()

    correction = bool(cfg.mean_correction) and not dense
    order = schedule.work_order(plan, index, dense)
    seg_offsets = kv_tiles = kbar = vbar = corr_bits = None
    words = 0
    if not dense:
        seg_offsets, kv_tiles = index.seg_offsets, index.kv_tiles
        if kv_tiles.numel() == 0:
            kv_tiles = seg_offsets  # never dereferenced when every segment is empty
    with op_range("correction"):  # the operands of the mean correction (its math runs in the attention kernel)
        cu_blocks_v = None
        if correction and is_fp8:
            # e4m3 operands re-quantized with each block's (sequence, KV head) descale (as the Triton
            # kernel). V means block-major ([Hkv, d, columns], the V^T tiles' K-major layout), each
            # sequence's starting at a multiple of 64 columns (a TMA box must start 16-byte aligned),
            # zeros between: columns cu_blocks_v[b] + j, cu_blocks_v = cumsum(round_up(n_b, 64))
            seq = plan.block_seq  # these three depend on the plan alone: built once per forward
            kbar = fp8.requantize_means(index.means.kbar, descales.k, plan.cu_blocks, block_seq=seq).contiguous()
            vq = fp8.requantize_means(index.means.vbar, descales.v, plan.cu_blocks, block_seq=seq)
            cu_blocks_v, column = plan.derived(
                "cutlass_block_columns", lambda: _aligned_block_columns(plan.cu_blocks, vq.shape[0], seq))
            width = -(-vq.shape[0] // 64) * 64 + 64 * plan.batch_size  # >= cu_blocks_v[-1], no sync
            vt = torch.zeros((vq.shape[1], d, width), dtype=vq.dtype, device=q.device)
            vt[:, :, column] = vq.permute(1, 2, 0)
            vbar = vt.permute(2, 0, 1)  # [columns, Hkv, d] view, strides (1, d * width, width)
        elif correction:
            # the fp32 means as hi + lo operands of q's dtype (as the Triton kernel): rows J and
            # total_blocks + J of a [2 * total_blocks, Hkv, d] tensor (fp_attn_api.h)
            kbar = split_means(index.means.kbar, q.dtype)[0]
            vbar = split_means(index.means.vbar, q.dtype)[0]
        if correction:
            words = max(1, math.ceil(plan.max_blocks / _CORR_CHUNK)) * (_CORR_CHUNK // 32)
            corr_bits = torch.zeros((num_segments, words), dtype=torch.int32, device=q.device)
            if index.kv_tiles.numel():
                schedule.selected_blocks[(num_segments,)](seg_offsets, kv_tiles, corr_bits, words,
                                                     TPB=cfg.tiles_per_block, BLOCK_E=128,
                                                     num_warps=4)
    o_part = lse_part = None
    if num_splits > 1:
        o_part = _empty((num_splits, tq, hq, d), dtype=torch.float32, device=q.device)
        lse_part = _empty((num_splits, tq, hq), dtype=torch.float32, device=q.device)

    pt = plan.page_table
    dstr = descales.strides() if is_fp8 else (0,) * 6
    p = cutlass_build.FpAttnParams(
        q=_ptr(q), k=_ptr(k_pages), v=_ptr(v_pages), kbar=_ptr(kbar), vbar=_ptr(vbar),
        out=_ptr(out), lse=_ptr(lse), o_part=_ptr(o_part), lse_part=_ptr(lse_part),
        seg_offsets=_ptr(seg_offsets), kv_tiles=_ptr(kv_tiles), order=_ptr(order),
        corr_bits=_ptr(corr_bits), cu_seqlens_q=_ptr(plan.cu_seqlens_q),
        seqlens_kv=_ptr(plan.seqlens_kv_t), cu_qtiles=_ptr(plan.cu_qtiles),
        cu_blocks=_ptr(plan.cu_blocks), cu_blocks_v=_ptr(cu_blocks_v), tile_seq=_ptr(plan.tile_seq), page_table=_ptr(pt),
        q_descale=_ptr(descales.q) if is_fp8 else None,
        k_descale=_ptr(descales.k) if is_fp8 else None,
        v_descale=_ptr(descales.v) if is_fp8 else None,
        sq_t=q.stride(0), sq_h=q.stride(1),
        sk_p=k_pages.stride(0), sk_s=k_pages.stride(1), sk_h=k_pages.stride(2),
        sv_p=v_pages.stride(0), sv_s=v_pages.stride(1), sv_h=v_pages.stride(2), sv_d=v_pages.stride(3),
        skb_t=kbar.stride(0) if correction else 0, skb_h=kbar.stride(1) if correction else 0,
        svb_t=vbar.stride(0) if correction else 0, svb_h=vbar.stride(1) if correction else 0,
        svb_d=vbar.stride(2) if correction else 1,
        s_pt=pt.stride(0),
        sqd_b=dstr[0], sqd_h=dstr[1], skd_b=dstr[2], skd_h=dstr[3], svd_b=dstr[4], svd_h=dstr[5],
        total_q=tq, total_tiles=plan.total_tiles, num_segments=num_segments,
        num_splits=num_splits, words_per_seg=words, group_size=plan.group_size,
        num_qo_heads=hq, head_dim=d, page_size=plan.page_size, num_pages=k_pages.shape[0],
        total_blocks=kbar.shape[0] if correction else 0, block_size=cfg.block_size,
        dtype=cutlass_build.DTYPE_CODES[str(q.dtype).removeprefix("torch.")],
        correction=int(correction), dense=int(dense), device=q.device.index or 0,
        qk_scale_log2=cfg.softmax_scale(d) * _LOG2E, kernel_variant=cutlass_build.KERNELS[kernel],
        max_ctas=max_ctas or 0,
    )
    stream = torch.cuda.current_stream(q.device).cuda_stream
    status = lib.fp_sparse_attn_fwd(ctypes.byref(p), ctypes.c_void_p(stream))
    cutlass_build.check_status(lib, status, "fp_sparse_attn_fwd")
    return out, lse


__all__ = ["sparse_attention", "available", "supports", "check_inputs"]
