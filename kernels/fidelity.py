"""Fidelity of the sparse operator against exact dense attention.

Metrics (all heads, all sequences):
- ``density``: selected key-query pairs over causal pairs (``reference.density``, vectorised).
- ``rel_l2`` / ``max_abs``: output error against ``reference.dense_attention`` (fp32) on the same
  paged inputs, with and without mean correction (same index), and the error of merely rounding
  the exact output to the input dtype (``rel_l2_dtype_floor``), for scale.
- ``retained_mass``: per (query, head), the exact softmax mass on the keys the index selected,
  ``sum_{selected j <= p} exp(s_j - lse_dense)``; mean and min. Computed chunk by chunk of
  queries (``[Hq, chunk, Lkv]`` at a time), never as an ``L x L`` matrix.
- ``needle_recall``: over planted needles (``synthetic.StructuredInputs.needle_blocks``), the
  fraction of (needle, query tile) pairs, for query tiles lying inside the needle's query range
  and seeing all of its keys, whose CSR segment holds every 64-token tile of the needle.

``fidelity_report`` runs everything on contiguous ``[B, L, H, d]`` inputs; the pieces
(``index_density``, ``retained_mass``, ``needle_recall``, ``output_error``, ``metrics``) work on
a plan and an index so that a caller that already ran the stages (the demo, the benchmarks)
does not run them twice.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from . import ops, reference
from ._checks import check_tensor
from .config import KV_TILE, Q_TILE, SparseConfig
from .index import SparseIndex
from .paged import gather_kv
from .plan import PrefillPlan

# Elements of one fp32 [Hq, chunk, Lkv] score block in the dense passes.
_CHUNK_ELEMENTS = {"cpu": 1 << 25, "cuda": 1 << 29}


def query_chunk(plan: PrefillPlan, device: torch.device) -> int:
    """Queries per chunk so that one ``[Hq, chunk, Lkv]`` fp32 score block stays bounded."""
    budget = _CHUNK_ELEMENTS.get(device.type, _CHUNK_ELEMENTS["cpu"])
    widest = max(plan.max_seqlen_kv, 1) * plan.num_qo_heads
    return max(1, min(max(plan.seqlens_q, default=1), budget // widest))


def prepare_paged(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, config: SparseConfig | None = None,
    *, page_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, PrefillPlan]:
    """Contiguous ``[B, L, H, d]`` inputs on the paged layout, as ``ops.sparse_attention`` runs them."""
    return ops.prepare_contiguous(q, k, v, config, page_size=page_size)


def without_correction(plan: PrefillPlan) -> PrefillPlan:
    """The same plan with ``mean_correction=False`` (the index does not depend on it)."""
    return dataclasses.replace(plan, config=dataclasses.replace(plan.config, mean_correction=False))


def _segment_of_entries(index: SparseIndex, plan: PrefillPlan) -> torch.Tensor:
    offsets = index.seg_offsets.long()
    counts = offsets[1:] - offsets[:-1]
    return torch.repeat_interleave(torch.arange(plan.num_segments, device=offsets.device), counts)


def index_density(index: SparseIndex, plan: PrefillPlan) -> float:
    """``reference.density`` without a Python loop over segments: selected visible key-query
    pairs over causal pairs, all query heads."""
    device = index.seg_offsets.device
    g = plan.group_size
    lq = torch.tensor(plan.seqlens_q, dtype=torch.int64, device=device)
    lkv = torch.tensor(plan.seqlens_kv, dtype=torch.int64, device=device)
    causal = int((g * plan.num_kv_heads * (lq * (lkv - lq) + lq * (lq + 1) // 2)).sum())
    if causal == 0 or plan.num_segments == 0:
        return 0.0
    nnz = int(index.seg_offsets[-1])
    seg = _segment_of_entries(index, plan)
    tile = index.kv_tiles[:nnz].long()
    t = seg % plan.total_tiles
    b = plan.tile_seq.long()[t]
    local = t - plan.cu_qtiles.long()[b]
    r0 = local * Q_TILE
    nrows = torch.clamp(g * lq[b] - r0, max=Q_TILE)
    prefix = lkv[b] - lq[b]
    start = tile * KV_TILE
    end = torch.minimum(start + KV_TILE, lkv[b])
    full = end <= r0 // g + prefix + 1  # every row of the tile sees the whole K/V tile
    selected = int((nrows * (end - start))[full].sum())
    # tiles on the diagonal: count row by row
    part = ~full
    i = torch.arange(Q_TILE, device=device)
    pos = (r0[part, None] + i) // g + prefix[part, None]
    seen = torch.clamp(torch.minimum(end[part, None], pos + 1) - start[part, None], min=0)
    seen = seen * (i < nrows[part, None])
    selected += int(seen.sum())
    return selected / causal


def _tile_mask(index: SparseIndex, plan: PrefillPlan, b: int, seg: torch.Tensor) -> torch.Tensor:
    """Bool ``[Hkv, qtiles_b, ktiles_b]``: K/V tile ``n`` selected for query tile ``I`` of
    sequence ``b``, KV head ``h``."""
    device = index.seg_offsets.device
    ntiles_kv = -(-plan.seqlens_kv[b] // KV_TILE)
    mask = torch.zeros(plan.num_kv_heads, plan.qtiles[b], ntiles_kv, dtype=torch.bool, device=device)
    nnz = int(index.seg_offsets[-1])
    t = seg % plan.total_tiles
    h = seg // plan.total_tiles
    lo = plan.cu_qtiles_host[b]
    mine = (t >= lo) & (t < lo + plan.qtiles[b])
    tiles = index.kv_tiles[:nnz].long()
    mask[h[mine], t[mine] - lo, tiles[mine]] = True
    return mask


def retained_mass(
    q: torch.Tensor, k_pages: torch.Tensor, plan: PrefillPlan, index: SparseIndex,
    lse: torch.Tensor, *, chunk: int | None = None,
) -> torch.Tensor:
    """``[Tq, Hq]`` float32: exact softmax mass (``lse`` from ``reference.dense_attention``) on
    the selected keys each query can see."""
    d, g = q.shape[-1], plan.group_size
    scale = plan.config.softmax_scale(d)
    chunk = query_chunk(plan, q.device) if chunk is None else chunk
    out = torch.zeros(q.shape[0], q.shape[1], dtype=torch.float32, device=q.device)
    seg = _segment_of_entries(index, plan)
    heads = torch.arange(g, device=q.device)
    for b in range(plan.batch_size):
        lq, lkv, prefix = plan.seqlens_q[b], plan.seqlens_kv[b], plan.prefix(b)
        if lq == 0:
            continue
        q0 = plan.cu_seqlens_q_host[b]
        mask = _tile_mask(index, plan, b, seg)
        keys = gather_kv(k_pages, plan.page_table, b, lkv).float().repeat_interleave(g, dim=1)
        for c0 in range(0, lq, chunk):
            c1 = min(c0 + chunk, lq)
            hi = c1 + prefix
            p = torch.arange(c0, c1, device=q.device)
            qc = q[q0 + c0 : q0 + c1].float().transpose(0, 1)  # [Hq, c, d]
            s = scale * qc @ keys[:hi].permute(1, 2, 0)  # [Hq, c, hi]
            tile = (p[None, :] * g + heads[:, None]) // Q_TILE  # [g, c]: query tile of each row
            sel = mask[:, tile].reshape(plan.num_qo_heads, c1 - c0, -1)  # [Hq, c, ktiles]
            j = torch.arange(hi, device=q.device)
            keep = sel[..., j // KV_TILE] & (j[None, None, :] <= (p + prefix)[None, :, None])
            s = s.masked_fill(~keep, float("-inf"))
            ref = lse[q0 + c0 : q0 + c1].transpose(0, 1)[..., None]  # [Hq, c, 1]
            out[q0 + c0 : q0 + c1] = torch.exp(s - ref).sum(-1).transpose(0, 1)
    return out


def needle_recall(
    index: SparseIndex, plan: PrefillPlan, needle_blocks: torch.Tensor
) -> tuple[float | None, int]:
    """``(recall, pairs)`` over (needle, query tile) pairs; ``(None, 0)`` without any pair.

    ``needle_blocks``: int ``[N, 6]`` rows ``(batch, kv_head, key_start, key_end, query_start,
    query_end)`` (query positions among the sequence's new tokens, key positions among its keys).
    """
    needles = check_tensor("needle_blocks", needle_blocks, ndim=2, dtypes=(torch.int32, torch.int64))
    if needles.shape[1] != 6:
        raise ValueError(f"needle_blocks: expected shape [N, 6], got {tuple(needles.shape)}")
    rows = needles.cpu().tolist()
    for row in rows:
        b, h = row[0], row[1]
        if not (0 <= b < plan.batch_size and 0 <= h < plan.num_kv_heads):
            raise ValueError(
                f"needle_blocks: batch/kv_head ({b}, {h}) out of range for "
                f"{plan.batch_size} sequences and {plan.num_kv_heads} KV heads"
            )
    g = plan.group_size
    seg = _segment_of_entries(index, plan)
    found = total = 0
    for b in sorted({row[0] for row in rows}):
        mask = _tile_mask(index, plan, b, seg)
        prefix = plan.prefix(b)
        tiles = torch.arange(plan.qtiles[b])
        r1 = torch.clamp(tiles * Q_TILE + Q_TILE, max=g * plan.seqlens_q[b])
        pmin, pmax = (tiles * Q_TILE) // g, (r1 - 1) // g
        for _, h, ks, ke, qs, qe in (row for row in rows if row[0] == b):
            inside = (pmin >= qs) & (pmax < qe) & (pmin + prefix >= ke - 1)
            chosen = tiles[inside].to(mask.device)
            if chosen.numel() == 0:
                continue
            need = mask[h][chosen][:, ks // KV_TILE : -(-ke // KV_TILE)]
            found += int(need.all(1).sum())
            total += chosen.numel()
    return (found / total if total else None), total


def output_error(out: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    """``(relative L2, max abs)`` of ``out`` against ``ref``, in fp32."""
    diff = out.float() - ref.float()
    norm = float(ref.float().norm())
    return float(diff.norm()) / max(norm, 1e-30), float(diff.abs().max()) if diff.numel() else 0.0


def metrics(
    q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, plan: PrefillPlan,
    index: SparseIndex, out_corrected: torch.Tensor, out_uncorrected: torch.Tensor,
    *, needle_blocks: torch.Tensor | None = None,
) -> dict:
    """Fidelity numbers for outputs the caller already computed (see ``fidelity_report``)."""
    chunk = query_chunk(plan, q.device)
    # fp32 copies of the same values: dense_attention returns q's dtype, we want the exact output
    ref, lse = reference.dense_attention(q.float(), k_pages.float(), v_pages.float(), plan, chunk=chunk)
    mass = retained_mass(q, k_pages, plan, index, lse, chunk=chunk).clamp(0.0, 1.0)
    rel_c, max_c = output_error(out_corrected, ref)
    rel_u, max_u = output_error(out_uncorrected, ref)
    rel_floor, _ = output_error(ref.to(q.dtype), ref)
    recall, pairs = (None, 0) if needle_blocks is None else needle_recall(index, plan, needle_blocks)
    corrected = plan.config.mean_correction
    return {
        "density": index_density(index, plan),
        "retained_mass": float(mass.mean()) if mass.numel() else math.nan,
        "retained_mass_min": float(mass.min()) if mass.numel() else math.nan,
        "rel_l2": rel_c if corrected else rel_u,
        "max_abs": max_c if corrected else max_u,
        "rel_l2_corrected": rel_c,
        "max_abs_corrected": max_c,
        "rel_l2_uncorrected": rel_u,
        "max_abs_uncorrected": max_u,
        "rel_l2_dtype_floor": rel_floor,
        "needle_recall": recall,
        "needle_pairs": pairs,
    }


def fidelity_report(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, config: SparseConfig | None = None,
    *, backend: ops.Backend = "auto", needle_blocks: torch.Tensor | None = None,
    page_size: int = 64,
) -> dict:
    """Index, sparse attention (with and without mean correction) and exact dense attention on
    contiguous ``[B, L, Hq, d]`` q and ``[B, L, Hkv, d]`` k, v; returns a dict of floats:

    ``density``, ``retained_mass`` (mean), ``retained_mass_min``, ``rel_l2`` and ``max_abs``
    (for ``config.mean_correction``), ``rel_l2_corrected``, ``max_abs_corrected``,
    ``rel_l2_uncorrected``, ``max_abs_uncorrected``, ``rel_l2_dtype_floor``, ``needle_recall``
    (None without needles), ``needle_pairs``, and the shapes, ``alpha`` and resolved ``backend``.
    """
    cfg = SparseConfig() if config is None else config
    qf, k_pages, v_pages, plan = prepare_paged(q, k, v, cfg, page_size=page_size)
    resolved = ops.resolve_backend(backend, qf.device)
    index = ops.build_index_planned(qf, k_pages, v_pages, plan, backend=resolved)
    on = dataclasses.replace(plan, config=dataclasses.replace(plan.config, mean_correction=True))
    out_c, _ = ops.attention_planned(qf, k_pages, v_pages, on, index, backend=resolved)
    out_u, _ = ops.attention_planned(qf, k_pages, v_pages, without_correction(plan), index, backend=resolved)
    report = {
        "batch": q.shape[0], "seqlen": q.shape[1], "num_qo_heads": q.shape[2],
        "num_kv_heads": k.shape[2], "head_dim": q.shape[3],
        "dtype": str(q.dtype).replace("torch.", ""), "device": str(q.device), "backend": resolved,
        "alpha": cfg.alpha, "block_size": cfg.block_size,
    }
    report.update(metrics(qf, k_pages, v_pages, plan, index, out_c, out_u, needle_blocks=needle_blocks))
    return report


__all__ = [
    "fidelity_report",
    "metrics",
    "index_density",
    "retained_mass",
    "needle_recall",
    "output_error",
    "prepare_paged",
    "without_correction",
    "query_chunk",
]
