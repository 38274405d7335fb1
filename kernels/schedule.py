"""Tile scheduling shared by the attention back-ends (``triton_attention``, ``cutlass_attention``).

One implementation each of what both kernels take from the host: the work order (segments by
decreasing work, eq. 17's heavy-first order), the automatic split-KV count (eq. 18) from the
plan's host lists, the SM count of a device, and the selected-block bitmask prepass (a small
Triton kernel) that tells the mean-correction loop which fully visible blocks have a listed
tile. No host synchronisation anywhere here.
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from .config import KV_TILE, Q_TILE
from .index import SparseIndex
from .plan import PrefillPlan
from .triton_interpreter import apply_if_interpreting

apply_if_interpreting()  # TRITON_INTERPRET=1: the CPU interpreter's fixes (triton_interpreter.py)

NUM_SMS_DEFAULT = 132  # H200
MAX_SPLITS = 16
PARTIAL_BYTES_CAP = 1 << 30  # fp32 split partials: at most this many bytes


@triton.jit
def selected_blocks(seg_offsets, kv_tiles, bits, words_per_seg,
                     TPB: tl.constexpr, BLOCK_E: tl.constexpr):
    """One bit per (segment, logical block with a listed tile): ``bits`` (zeroed) |= ..."""
    seg = tl.program_id(0)
    lo = tl.load(seg_offsets + seg)
    n = tl.load(seg_offsets + seg + 1) - lo
    row = bits + seg.to(tl.int64) * words_per_seg
    for e0 in range(0, n, BLOCK_E):
        e = e0 + tl.arange(0, BLOCK_E)
        ok = e < n
        blk = tl.load(kv_tiles + lo + e, mask=ok, other=0) // TPB
        tl.atomic_or(row + blk // 32, (1 << (blk % 32)).to(tl.int32), mask=ok, sem="relaxed")


@functools.lru_cache(maxsize=None)
def num_sms(device_index: int | None) -> int:
    if device_index is None or not torch.cuda.is_available():
        return NUM_SMS_DEFAULT
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def auto_num_splits(plan: PrefillPlan, num_sms: int = NUM_SMS_DEFAULT) -> int:
    """Split-KV parts from the plan's host lists only (no device data, no sync).

    The causal work of a segment (tiles up to its horizon) bounds its sparse work. With work
    ordered longest first, the makespan is at least the longest segment; split when that exceeds
    the average work per SM (underfilled grids, or one long sequence among short ones).
    """
    cfg = plan.config
    if cfg.num_splits > 0:
        return cfg.num_splits
    total = 0.0
    longest = 0
    for lq, lkv, nt in zip(plan.seqlens_q, plan.seqlens_kv, plan.qtiles):
        if nt == 0:
            continue
        prefix = lkv - lq
        total += plan.num_kv_heads * nt * ((prefix + lq / 2) / KV_TILE + 1)
        longest = max(longest, -(-lkv // KV_TILE))
    if total == 0:
        return 1
    per_sm = total / num_sms
    if longest <= per_sm:
        return 1
    splits = math.ceil(longest / per_sm)
    # at least ~4 tiles per split, bounded partial buffers
    splits = min(splits, MAX_SPLITS, max(1, longest // 4))
    row_bytes = plan.total_q * plan.num_qo_heads * triton.next_power_of_2(plan.head_dim) * 4
    while splits > 1 and splits * row_bytes > PARTIAL_BYTES_CAP:
        splits -= 1
    return max(splits, 1)


def work_order(plan: PrefillPlan, index: SparseIndex | None, dense: bool) -> torch.Tensor:
    """Segments sorted by decreasing work (device-side argsort; no host sync)."""
    if not dense:
        counts = index.seg_offsets[1:] - index.seg_offsets[:-1]
        return torch.argsort(counts, descending=True).to(torch.int32)
    # dense: the causal horizon of each query tile, same for every KV head
    g = plan.group_size
    ts = plan.tile_seq.long()
    cu_q = plan.cu_seqlens_q.long()
    lq = (cu_q[1:] - cu_q[:-1])[ts]
    tile = torch.arange(plan.total_tiles, device=ts.device) - plan.cu_qtiles.long()[ts]
    last_row = torch.minimum(tile * Q_TILE + Q_TILE, g * lq) - 1
    horizon = last_row // g + plan.seqlens_kv_t.long()[ts] - lq
    key = horizon.repeat(plan.num_kv_heads)
    return torch.argsort(key, descending=True).to(torch.int32)


__all__ = ["selected_blocks", "num_sms", "auto_num_splits", "work_order", "NUM_SMS_DEFAULT"]
