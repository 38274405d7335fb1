"""The PyTorch reference of the FlashPrefill V2 operator: the oracle and the CPU path.

Computes exactly what SPEC.md (and docs/SEMANTICS.md) define, in float32, tile by
tile: nothing here materialises an L x L matrix, so it runs at 32K on a CPU.

Numerics fixed here and shared with the kernels:
- Index scores use the block means rounded to the input dtype
  (``s_iJ = scale * q_i . kbar_J.to(q.dtype)`` accumulated in fp32), so that a kernel
  feeding ``tl.dot`` with 16-bit operands computes the same products exactly.
- Block means are exact: sums in float64 (exact for 16-bit and FP8 tokens), one rounding to
  fp32, so a block's mean does not depend on the order of its tokens.
- Energies are computed in float64 from exact products of the rounded operands, so blocks with
  equal scoring operands get equal energies and the threshold ``E_J >= alpha * max E`` keeps
  ties. Non-finite scores (NaN/Inf in q or k) count as ``-inf``: such a row adds no energy, so
  it cannot change another row's selection.
- The block holding key ``pmin + P`` is always forced (``window_tokens = 0`` acts as 1), so no
  row of a tile is left without a key.
- Mean correction uses the fp32 means.
- FP8 inputs (``descales`` given, see ``kernels/fp8.py``): everything runs on the dequantized
  values in fp32; the index scores with the means re-quantized by the sequence's K descale
  (the operands of the FP8 kernels), and outputs are bfloat16.
"""

from __future__ import annotations

import torch

from . import fp8
from .config import KV_TILE
from .fp8 import Fp8Descales
from .index import BlockMeans, SparseIndex
from .paged import gather_kv
from .plan import PrefillPlan


def _packed_queries(q: torch.Tensor, plan: PrefillPlan, b: int, h: int) -> torch.Tensor:
    """Rows ``r = p * g + t`` of sequence ``b`` for KV head ``h``: ``[g * Lq, d]``."""
    g = plan.group_size
    lo = plan.cu_seqlens_q_host[b]
    lq = plan.seqlens_q[b]
    return q[lo : lo + lq, h * g : (h + 1) * g].reshape(lq * g, q.shape[-1])


def _sequence_kv(
    pages: torch.Tensor, plan: PrefillPlan, b: int, length: int, descale: torch.Tensor | None
) -> torch.Tensor:
    """Sequence ``b``'s first ``length`` keys or values in fp32 (dequantized for FP8)."""
    x = gather_kv(pages, plan.page_table, b, length)
    return x.float() if descale is None else fp8.dequantize_sequence(x, descale[b])


def _float_queries(q: torch.Tensor, plan: PrefillPlan, descales: Fp8Descales | None) -> torch.Tensor:
    if descales is None:
        return q
    return fp8.dequantize_queries(q, descales.q, plan.cu_seqlens_q_host, plan.num_kv_heads)


def _out_dtype(q: torch.Tensor) -> torch.dtype:
    return fp8.OUT_DTYPE if fp8.is_fp8(q) else q.dtype


def block_means(
    k_pages: torch.Tensor, v_pages: torch.Tensor, plan: PrefillPlan,
    descales: Fp8Descales | None = None,
) -> BlockMeans:
    """fp32 means of each logical block's real tokens (descaled first for FP8), per KV head."""
    bs = plan.config.block_size
    hkv, d = k_pages.shape[2], k_pages.shape[3]
    out = []
    for pages, name in ((k_pages, "k"), (v_pages, "v")):
        descale = None if descales is None else getattr(descales, name)
        means = torch.zeros(plan.total_blocks, hkv, d, dtype=torch.float32, device=pages.device)
        row = 0
        for b, lkv in enumerate(plan.seqlens_kv):
            if lkv == 0:
                continue
            x = _sequence_kv(pages, plan, b, lkv, descale)
            nb = plan.blocks[b]
            x = x.double()  # exact sums: the mean does not depend on the order of the tokens
            pad = x.new_zeros(nb * bs - lkv, hkv, d)
            sums = torch.cat([x, pad]).reshape(nb, bs, hkv, d).sum(1)
            counts = torch.full((nb,), float(bs), dtype=torch.float64, device=x.device)
            counts[-1] = lkv - (nb - 1) * bs
            means[row : row + nb] = (sums / counts[:, None, None]).float()
            row += nb
        out.append(means)
    return BlockMeans(kbar=out[0], vbar=out[1])


def _tile_geometry(plan: PrefillPlan, b: int, tile: int) -> tuple[int, int, int, int, int, int]:
    """(r0, rows, pmin+P, pmax+P, visible blocks, fully visible blocks) of one query tile."""
    bs = plan.config.block_size
    r0, rows, pmin, pmax = plan.tile_rows(b, tile)
    prefix = plan.prefix(b)
    lo, hi = pmin + prefix, pmax + prefix
    nvis = hi // bs + 1
    nfull = plan.blocks[b] if plan.seqlens_kv[b] <= lo + 1 else (lo + 1) // bs
    return r0, rows, lo, hi, nvis, nfull


def block_energies(
    q: torch.Tensor, means: BlockMeans, plan: PrefillPlan, descales: Fp8Descales | None = None
) -> list[torch.Tensor]:
    """Per segment, the energies ``E_J`` of the tile's visible blocks (float64, ``[nvis]``,
    shifted by the tile's largest finite score). Scores are float64 products of the scoring
    operands (exact for 16-bit ones), so equal operands give equal energies; a non-finite
    score counts as ``-inf`` (adds nothing). With ``energy_rule="first_key"`` a row adds to
    block ``J`` only if it sees key ``J * Bs``, and blocks that the tile's last row does not
    see whole get 0."""
    cfg = plan.config
    scale = cfg.softmax_scale(q.shape[-1])
    first_key = cfg.energy_rule == "first_key"
    bs = cfg.block_size
    if descales is None:
        kbar_scored = means.kbar.to(q.dtype).double()
    else:
        c = fp8.block_descales(descales.k, plan.cu_blocks, plan.total_blocks, block_seq=plan.block_seq)[:, :, None]
        kbar_scored = fp8.requantize_means(means.kbar, descales.k, plan.cu_blocks, block_seq=plan.block_seq).double() * c
        q = _float_queries(q, plan, descales)
    energies: list[torch.Tensor] = [torch.empty(0, dtype=torch.float64)] * plan.num_segments
    for h in range(plan.num_kv_heads):
        for b in range(plan.batch_size):
            if plan.qtiles[b] == 0:
                continue
            qp = _packed_queries(q, plan, b, h).double()
            blk0 = plan.cu_blocks_host[b]
            kb = kbar_scored[blk0 : blk0 + plan.blocks[b], h]
            for tile in range(plan.qtiles[b]):
                r0, rows, _, hi, nvis, _ = _tile_geometry(plan, b, tile)
                s = scale * (qp[r0 : r0 + rows] @ kb[:nvis].T)  # [rows, nvis]
                s = s.masked_fill(~torch.isfinite(s), float("-inf"))
                if first_key:
                    # row i scores block J only if it sees the block's first key; a block the
                    # tile's last row does not see whole is not scored (energy 0)
                    pos = torch.arange(r0, r0 + rows, device=s.device) // plan.group_size + plan.prefix(b)
                    j = torch.arange(nvis, device=s.device)
                    scored = (pos[:, None] >= j[None, :] * bs) & ((j[None, :] + 1) * bs - 1 <= hi)
                    s = s.masked_fill(~scored, float("-inf"))
                top = s.max() if s.numel() else s.new_tensor(0.0)
                shift = top if bool(torch.isfinite(top)) else s.new_tensor(0.0)
                # each block's energy is reduced by the same code over a contiguous row
                energy = torch.exp(s - shift).T.contiguous().sum(1)
                seg = h * plan.total_tiles + plan.cu_qtiles_host[b] + tile
                energies[seg] = energy
    return energies


def block_energy_ratios(
    q: torch.Tensor, means: BlockMeans, plan: PrefillPlan, descales: Fp8Descales | None = None
) -> list[torch.Tensor]:
    """Per segment, ``E_J / max E`` over the tile's visible blocks (fp32, ``[nvis]``; NaN
    where no row has a finite score). For reporting: the selection compares the energies."""
    return [(e / e.max()).float() if e.numel() else e.float()
            for e in block_energies(q, means, plan, descales)]


def select_blocks(energy: torch.Tensor, plan: PrefillPlan, b: int, tile: int) -> torch.Tensor:
    """Bool ``[nvis]``: the selected logical blocks of one tile (threshold + forced).

    ``energy``: the tile's block energies (``block_energies``; ratios work too). A block passes
    if ``E_J >= alpha * max E`` (ties kept) and ``E_J > 0`` (a tile none of whose rows has a
    finite score keeps only its forced blocks); ``alpha = 0`` passes every fully visible block."""
    cfg = plan.config
    bs = cfg.block_size
    _, _, lo, _, nvis, nfull = _tile_geometry(plan, b, tile)
    j = torch.arange(nvis, device=energy.device)
    if cfg.alpha == 0 or plan.dense_tile(b, tile):  # dense: every visible block
        passes = j < nfull
    else:
        passes = (energy >= cfg.alpha * energy.max()) & (energy > 0) & (j < nfull)
    sink = j * bs < cfg.sink_tokens
    block_last = torch.clamp((j + 1) * bs, max=plan.seqlens_kv[b]) - 1
    # at least the block holding key pmin + P: every row of the tile sees it
    window = block_last >= lo + 1 - max(cfg.window_tokens, 1)
    return passes | sink | window


def build_index(
    q: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    plan: PrefillPlan,
    means: BlockMeans | None = None,
    descales: Fp8Descales | None = None,
) -> SparseIndex:
    """Reference index stage: block means, energies, threshold, forced blocks, CSR."""
    if means is None:
        means = block_means(k_pages, v_pages, plan, descales)
    tpb = plan.config.tiles_per_block
    energies = block_energies(q, means, plan, descales)
    device = q.device
    lists: list[torch.Tensor] = [torch.empty(0, dtype=torch.int32, device=device)] * plan.num_segments
    for h in range(plan.num_kv_heads):
        for b in range(plan.batch_size):
            for tile in range(plan.qtiles[b]):
                seg = h * plan.total_tiles + plan.cu_qtiles_host[b] + tile
                sel = select_blocks(energies[seg], plan, b, tile)
                _, _, _, hi, _, _ = _tile_geometry(plan, b, tile)
                blocks = sel.nonzero().flatten()
                tiles = (blocks[:, None] * tpb + torch.arange(tpb, device=device)).flatten()
                # drop tiles past the sequence or past every row's causal horizon
                tiles = tiles[(tiles * KV_TILE < plan.seqlens_kv[b]) & (tiles * KV_TILE <= hi)]
                lists[seg] = tiles.to(torch.int32)
    counts = torch.tensor([len(x) for x in lists], dtype=torch.int64, device=device)
    offsets = torch.zeros(plan.num_segments + 1, dtype=torch.int32, device=device)
    offsets[1:] = counts.cumsum(0).to(torch.int32)
    kv_tiles = torch.cat(lists) if lists else torch.empty(0, dtype=torch.int32, device=device)
    return SparseIndex(seg_offsets=offsets, kv_tiles=kv_tiles, means=means)


def sparse_attention(
    q: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    plan: PrefillPlan,
    index: SparseIndex,
    descales: Fp8Descales | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference attention stage over the index, with mean correction.

    Returns ``out [Tq, Hq, d]`` in ``q.dtype`` (bfloat16 for FP8) and ``lse [Tq, Hq]``
    float32 (natural log).
    """
    out_dtype = _out_dtype(q)
    q = _float_queries(q, plan, descales)
    cfg = plan.config
    bs, g, d = cfg.block_size, plan.group_size, q.shape[-1]
    scale = cfg.softmax_scale(d)
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    lse = torch.zeros(q.shape[0], q.shape[1], dtype=torch.float32, device=q.device)
    offsets = index.seg_offsets.tolist()
    for b in range(plan.batch_size):
        lkv, prefix = plan.seqlens_kv[b], plan.prefix(b)
        if plan.qtiles[b] == 0:
            continue
        q0 = plan.cu_seqlens_q_host[b]
        blk0 = plan.cu_blocks_host[b]
        keys = _sequence_kv(k_pages, plan, b, lkv, None if descales is None else descales.k)
        vals = _sequence_kv(v_pages, plan, b, lkv, None if descales is None else descales.v)
        for h in range(plan.num_kv_heads):
            qp = _packed_queries(q, plan, b, h).float()
            kbar = index.means.kbar[blk0 : blk0 + plan.blocks[b], h]
            vbar = index.means.vbar[blk0 : blk0 + plan.blocks[b], h]
            for tile in range(plan.qtiles[b]):
                seg = h * plan.total_tiles + plan.cu_qtiles_host[b] + tile
                r0, rows, _, _, _, nfull = _tile_geometry(plan, b, tile)
                tiles = index.kv_tiles[offsets[seg] : offsets[seg + 1]].long()
                j = (tiles[:, None] * KV_TILE + torch.arange(KV_TILE, device=q.device)).flatten()
                j = j[j < lkv]
                qt = qp[r0 : r0 + rows]
                pos = (r0 + torch.arange(rows, device=q.device)) // g + prefix
                s = scale * (qt @ keys[j, h].T)
                s = s.masked_fill(j[None, :] > pos[:, None], float("-inf"))
                v = vals[j, h]
                if cfg.mean_correction and nfull:
                    keep = torch.ones(nfull, dtype=torch.bool, device=q.device)
                    sel_blocks = torch.unique(tiles // cfg.tiles_per_block)
                    keep[sel_blocks[sel_blocks < nfull]] = False
                    corr = keep.nonzero().flatten()
                    if corr.numel():
                        size = torch.clamp((corr + 1) * bs, max=lkv) - corr * bs
                        sbar = scale * (qt @ kbar[corr].T) + torch.log(size.float())[None, :]
                        s = torch.cat([s, sbar], 1)
                        v = torch.cat([v, vbar[corr]], 0)
                m = s.max(1, keepdim=True).values
                p = torch.exp(s - m)
                denom = p.sum(1, keepdim=True)
                o = (p @ v) / denom
                row_pos = pos - prefix + q0
                row_head = h * g + (r0 + torch.arange(rows, device=q.device)) % g
                out[row_pos, row_head] = o
                lse[row_pos, row_head] = (m + torch.log(denom)).squeeze(1)
    return out.to(out_dtype), lse


def sparse_prefill(
    q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, plan: PrefillPlan,
    descales: Fp8Descales | None = None,
) -> tuple[torch.Tensor, torch.Tensor, SparseIndex]:
    """Index stage then attention stage, all in the reference."""
    index = build_index(q, k_pages, v_pages, plan, descales=descales)
    out, lse = sparse_attention(q, k_pages, v_pages, plan, index, descales)
    return out, lse, index


def density(index: SparseIndex, plan: PrefillPlan) -> float:
    """Selected key-query pairs over causal key-query pairs (all query heads)."""
    g = plan.group_size
    offsets = index.seg_offsets.tolist()
    selected = 0
    causal = 0
    for b in range(plan.batch_size):
        prefix, lkv = plan.prefix(b), plan.seqlens_kv[b]
        lq = plan.seqlens_q[b]
        causal += g * plan.num_kv_heads * (lq * prefix + lq * (lq + 1) // 2)
        for h in range(plan.num_kv_heads):
            for tile in range(plan.qtiles[b]):
                seg = h * plan.total_tiles + plan.cu_qtiles_host[b] + tile
                r0, rows, _, _, _, _ = _tile_geometry(plan, b, tile)
                tiles = index.kv_tiles[offsets[seg] : offsets[seg + 1]].long()
                if tiles.numel() == 0:
                    continue
                pos = (r0 + torch.arange(rows, device=tiles.device)) // g + prefix
                start = tiles * KV_TILE
                end = torch.clamp(start + KV_TILE, max=lkv)
                visible = torch.clamp(
                    torch.minimum(end[None, :], pos[:, None] + 1) - start[None, :], min=0
                )
                selected += int(visible.sum())
    return selected / causal if causal else 0.0


def dense_attention(
    q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, plan: PrefillPlan,
    *, chunk: int = 1024, descales: Fp8Descales | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact bottom-right causal attention in fp32, ``chunk`` queries at a time."""
    out_dtype = _out_dtype(q)
    q = _float_queries(q, plan, descales)
    d = q.shape[-1]
    scale = plan.config.softmax_scale(d)
    g = plan.group_size
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    lse = torch.zeros(q.shape[0], q.shape[1], dtype=torch.float32, device=q.device)
    for b in range(plan.batch_size):
        lq, lkv, prefix = plan.seqlens_q[b], plan.seqlens_kv[b], plan.prefix(b)
        if lq == 0:
            continue
        q0 = plan.cu_seqlens_q_host[b]
        keys = _sequence_kv(k_pages, plan, b, lkv, None if descales is None else descales.k)
        vals = _sequence_kv(v_pages, plan, b, lkv, None if descales is None else descales.v)
        keys, vals = keys.repeat_interleave(g, dim=1), vals.repeat_interleave(g, dim=1)
        for c0 in range(0, lq, chunk):
            c1 = min(c0 + chunk, lq)
            hi = c1 + prefix
            qc = q[q0 + c0 : q0 + c1].float().transpose(0, 1)  # [Hq, c, d]
            s = scale * qc @ keys[:hi].permute(1, 2, 0)  # [Hq, c, hi]
            pos = torch.arange(c0, c1, device=q.device) + prefix
            s = s.masked_fill(torch.arange(hi, device=q.device)[None, :] > pos[:, None], float("-inf"))
            m = s.max(-1, keepdim=True).values
            p = torch.exp(s - m)
            denom = p.sum(-1, keepdim=True)
            out[q0 + c0 : q0 + c1] = ((p @ vals[:hi].transpose(0, 1)) / denom).transpose(0, 1)
            lse[q0 + c0 : q0 + c1] = (m + torch.log(denom)).squeeze(-1).transpose(0, 1)
    return out.to(out_dtype), lse


__all__ = [
    "block_means",
    "block_energies",
    "block_energy_ratios",
    "select_blocks",
    "build_index",
    "sparse_attention",
    "sparse_prefill",
    "density",
    "dense_attention",
]

