"""Index-stage results: block means and the CSR of selected 64-token K/V tiles."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class BlockMeans:
    """Per-block fp32 means of K and V, per KV head.

    Row ``plan.cu_blocks[b] + J`` holds logical block ``J`` of sequence ``b``:
    ``kbar``/``vbar`` are ``[total_blocks, num_kv_heads, head_dim]`` float32.
    """

    kbar: torch.Tensor
    vbar: torch.Tensor


@dataclass(frozen=True)
class SparseIndex:
    """CSR of selected physical K/V tiles, one segment per (KV head, query tile).

    ``seg_offsets``: int32 ``[num_segments + 1]``, segment ``seg = h * total_tiles + t``.
    ``kv_tiles``: int32, at least ``seg_offsets[-1]`` entries; segment ``seg`` lists, in
    ascending order, the 64-token tiles ``n`` (keys ``[64 n, 64 n + 64)`` of its sequence)
    that its query tile attends to exactly.
    ``means``: the block means the index was built from (used by mean correction).
    """

    seg_offsets: torch.Tensor
    kv_tiles: torch.Tensor
    means: BlockMeans

    def segment(self, seg: int) -> torch.Tensor:
        lo, hi = (int(x) for x in self.seg_offsets[seg : seg + 2].tolist())
        return self.kv_tiles[lo:hi]

    @property
    def nnz(self) -> int:
        """Selected tiles in all segments (host sync; for reporting, not hot paths)."""
        return int(self.seg_offsets[-1])


def split_means(means: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """fp32 means as two tensor-core operands of a 16-bit ``dtype``: ``[2, *means.shape]``,
    ``hi = means.to(dtype)`` and ``lo = (means - hi).to(dtype)``, contiguous (``lo`` sits
    ``means.numel()`` elements after ``hi``). ``hi + lo`` is within ``2^-17`` (bf16) or
    ``2^-22`` (fp16, normal range) of the fp32 value, where ``hi`` alone is within ``2^-9``:
    the attention kernels feed both to their dots so that the correction term uses the fp32
    means (docs/SEMANTICS.md, choice 4)."""
    out = torch.empty((2, *means.shape), dtype=dtype, device=means.device)
    out[0] = means
    out[1] = means - out[0].float()
    return out
