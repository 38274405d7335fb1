"""Index formats of our operator and of the paper's (qhfan/FlashPrefillv2), and a CPU model of
the peer's selection rule. Used by ``benchmarks/bench_peer.py`` (cross-index runs) and
``tests/test_bench_peer.py``; see ``FLASHPREFILLV2.md`` beside this file for the differences.

Both indexes are a CSR over segments ``seg = kv_head * total_q_tiles + cu_q_tiles[b] + tile``
(PackGQA query tiles of 128 packed rows) listing ascending 64-token K/V tiles of the sequence.
They differ in two details that matter to a kernel:

- *Expansion of a selected block.* The peer lists every 64-token tile of a selected 128-token
  block (all but the sequence tail's invalid ones) and its attention kernel relies on it: the mean
  correction walks the CSR ``n_sub`` entries at a time. We drop tiles that no row of the query
  tile can see (past ``pmax + P``; docs/SEMANTICS.md choice 3). ``ours_to_peer`` re-expands,
  ``peer_to_ours`` drops; neither changes the visible selected pairs.
- *Block means.* Ours: ``BlockMeans`` fp32 ``[total_blocks, Hkv, d]`` of the (descaled) values.
  The peer's: ``[B, max_k_blocks, Hkv, d]`` in the input dtype; for e4m3, means of the quantized
  values rounded to e4m3 (per-tensor descales here, so ``mean(x8) * c == mean(x)``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kernels.config import KV_TILE, Q_TILE
from kernels.index import BlockMeans, SparseIndex

FP8 = torch.float8_e4m3fn


@dataclass(frozen=True)
class PeerIndex:
    """The peer's index (the fields of its ``flashprefill.SparseIndex``), framework-free."""

    block_sparse_cu: torch.Tensor  # int32 [Hkv * total_q_tiles + 1]
    block_sparse_idx: torch.Tensor  # int32, >= block_sparse_cu[-1] entries
    total_q_tiles: int
    cu_q_tiles: torch.Tensor  # int32 [B + 1]
    k_mean: torch.Tensor | None  # [B, max_k_blocks, Hkv, d], input dtype
    v_mean: torch.Tensor | None

    @classmethod
    def from_peer(cls, index) -> "PeerIndex":
        return cls(index.block_sparse_cu, index.block_sparse_idx, int(index.total_q_tiles),
                   index.cu_q_tiles, index.k_mean, index.v_mean)

    def to_peer(self):
        """The peer's own dataclass (needs ``flashprefill`` importable)."""
        from flashprefill.prefill import SparseIndex as PeerSparseIndex

        return PeerSparseIndex(self.block_sparse_cu, self.block_sparse_idx, self.total_q_tiles,
                               self.cu_q_tiles, k_mean=self.k_mean, v_mean=self.v_mean)


# ---------------------------------------------------------------------------------------------
# CSR geometry
# ---------------------------------------------------------------------------------------------


def _entries(offsets: torch.Tensor, tiles: torch.Tensor, plan):
    """Per CSR entry: (segment, tile, sequence, visible limit hi = pmax + P, Lkv), int64."""
    off = offsets.long()
    nnz = int(off[-1])
    dev = off.device
    seg = torch.repeat_interleave(torch.arange(plan.num_segments, device=dev), off[1:] - off[:-1])
    n = tiles[:nnz].long()
    t = seg % plan.total_tiles
    b = plan.tile_seq.long()[t]
    cu_q = plan.cu_seqlens_q.long()
    lq = cu_q[b + 1] - cu_q[b]
    lkv = plan.seqlens_kv_t.long()[b]
    r0 = (t - plan.cu_qtiles.long()[b]) * Q_TILE
    rows = torch.minimum(r0 + Q_TILE, plan.group_size * lq) - r0
    hi = (r0 + rows - 1) // plan.group_size + lkv - lq
    return seg, n, b, hi, lkv


def _csr(seg: torch.Tensor, tiles: torch.Tensor, num_segments: int):
    counts = torch.bincount(seg, minlength=num_segments)
    offsets = torch.zeros(num_segments + 1, dtype=torch.int32, device=seg.device)
    offsets[1:] = torch.cumsum(counts, 0).to(torch.int32)
    return offsets, tiles.to(torch.int32).contiguous()


def _check_same_tiling(plan, total_q_tiles: int, cu_q_tiles: torch.Tensor) -> None:
    if total_q_tiles != plan.total_tiles:
        raise ValueError(f"peer index: {total_q_tiles} query tiles, plan has {plan.total_tiles}")
    if cu_q_tiles.cpu().tolist() != list(plan.cu_qtiles_host):
        raise ValueError("peer index: cu_q_tiles differ from the plan's")


# ---------------------------------------------------------------------------------------------
# means
# ---------------------------------------------------------------------------------------------


def means_to_peer(means: BlockMeans, plan, dtype: torch.dtype, k_descale: float = 1.0,
                  v_descale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Ours -> ``(k_mean, v_mean)`` ``[B, max_blocks, Hkv, d]`` in ``dtype`` (e4m3: re-quantized
    with the per-tensor descales)."""
    out = []
    for x, c in ((means.kbar, k_descale), (means.vbar, v_descale)):
        dense = x.new_zeros(plan.batch_size, plan.max_blocks, *x.shape[1:])
        for b in range(plan.batch_size):
            j0 = plan.cu_blocks_host[b]
            dense[b, : plan.blocks[b]] = x[j0 : j0 + plan.blocks[b]]
        if dtype == FP8:
            dense = (dense / c).clamp(-448.0, 448.0)
        out.append(dense.to(dtype).contiguous())
    return out[0], out[1]


def means_from_peer(k_mean: torch.Tensor, v_mean: torch.Tensor, plan, k_descale: float = 1.0,
                    v_descale: float = 1.0) -> BlockMeans:
    """The peer's ``[B, max_k_blocks, Hkv, d]`` means -> our fp32 ``BlockMeans``."""
    parts = []
    for x, c in ((k_mean, k_descale), (v_mean, v_descale)):
        rows = [x[b, : plan.blocks[b]].float() for b in range(plan.batch_size)]
        y = torch.cat(rows, 0) if rows else x.new_zeros(0, *x.shape[2:]).float()
        parts.append((y * c if x.dtype == FP8 else y).contiguous())
    return BlockMeans(kbar=parts[0], vbar=parts[1])


# ---------------------------------------------------------------------------------------------
# index conversion
# ---------------------------------------------------------------------------------------------


def peer_to_ours(peer: PeerIndex, plan, means: BlockMeans | None = None, *, k_descale: float = 1.0,
                 v_descale: float = 1.0) -> SparseIndex:
    """The peer's CSR as our ``SparseIndex``: tiles no row of the query tile sees (past
    ``pmax + P`` or ``Lkv``) dropped. ``means``: ours to use for the correction; default the
    peer's own (converted; it must have computed them: ``use_mean_correction=True``)."""
    _check_same_tiling(plan, peer.total_q_tiles, peer.cu_q_tiles)
    if plan.config.block_size != 128 and means is None:
        raise ValueError("peer means are per 128-token block here; pass our means")
    seg, n, _, hi, lkv = _entries(peer.block_sparse_cu, peer.block_sparse_idx, plan)
    keep = (n * KV_TILE < lkv) & (n * KV_TILE <= hi)
    offsets, tiles = _csr(seg[keep], n[keep], plan.num_segments)
    if means is None:
        if peer.k_mean is None or peer.v_mean is None:
            raise ValueError("peer index has no block means (use_mean_correction=False): pass means")
        means = means_from_peer(peer.k_mean, peer.v_mean, plan, k_descale, v_descale)
    return SparseIndex(seg_offsets=offsets, kv_tiles=tiles, means=means)


def ours_to_peer(index: SparseIndex, plan, dtype: torch.dtype, *, k_descale: float = 1.0,
                 v_descale: float = 1.0, with_means: bool = True) -> PeerIndex:
    """Our index as the peer's: each selected logical block re-expanded to all its 64-token
    tiles below ``Lkv``; means in the peer's layout and ``dtype``."""
    tpb = plan.config.tiles_per_block
    seg, n, _, _, lkv = _entries(index.seg_offsets, index.kv_tiles, plan)
    j = n // tpb
    if seg.numel():
        first = torch.ones_like(seg, dtype=torch.bool)
        first[1:] = (seg[1:] != seg[:-1]) | (j[1:] != j[:-1])
        seg, j, lkv = seg[first], j[first], lkv[first]
    emit = torch.clamp(-(-lkv // KV_TILE) - j * tpb, max=tpb)
    grp = torch.repeat_interleave(torch.arange(seg.numel(), device=seg.device), emit)
    start = torch.cumsum(emit, 0) - emit
    lane = torch.arange(grp.numel(), device=seg.device) - start[grp]
    offsets, tiles = _csr(seg[grp], j[grp] * tpb + lane, plan.num_segments)
    k_mean = v_mean = None
    if with_means:
        k_mean, v_mean = means_to_peer(index.means, plan, dtype, k_descale, v_descale)
    return PeerIndex(offsets, tiles, plan.total_tiles, plan.cu_qtiles.to(torch.int32), k_mean, v_mean)


def canonical(index: SparseIndex, plan) -> SparseIndex:
    """Our index with tiles no row sees removed (a no-op on our own indexes)."""
    seg, n, _, hi, lkv = _entries(index.seg_offsets, index.kv_tiles, plan)
    keep = (n * KV_TILE < lkv) & (n * KV_TILE <= hi)
    offsets, tiles = _csr(seg[keep], n[keep], plan.num_segments)
    return SparseIndex(seg_offsets=offsets, kv_tiles=tiles, means=index.means)


def overlap(a: SparseIndex, b: SparseIndex, plan) -> dict:
    """Agreement of two (canonical) indexes over (segment, tile) entries."""
    width = max(1, -(-plan.max_seqlen_kv // KV_TILE))
    keys = []
    for x in (canonical(a, plan), canonical(b, plan)):
        seg, n, *_ = _entries(x.seg_offsets, x.kv_tiles, plan)
        keys.append(seg * width + n)
    ka, kb = keys
    both = int(torch.isin(ka, kb).sum())
    union = ka.numel() + kb.numel() - both
    return {"tiles_a": ka.numel(), "tiles_b": kb.numel(), "tiles_both": both,
            "jaccard": both / union if union else 1.0,
            "only_a": ka.numel() - both, "only_b": kb.numel() - both}


# ---------------------------------------------------------------------------------------------
# CPU model of the peer's selection (for tests and --dry-run; the GPU run uses the real one)
# ---------------------------------------------------------------------------------------------


def peer_rule_index(q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, plan, *,
                    alpha: float, sink_blocks: int = 2, window_blocks: int = 4,
                    last_n_blocks: int = 0, block: int = 128, q_descale: float = 1.0,
                    k_descale: float = 1.0) -> PeerIndex:
    """Our reading of the peer's index stage (``flash_block_sparse_index_triton.py``), in plain
    PyTorch, bf16 inputs: per query tile, block scores ``q_r . mean_j(K)`` (means rounded to the
    input dtype) over the blocks fully visible to the tile's last row, a row counting a block only
    if it sees the block's first key; energies ``sum_r 2^(s - max)``; keep
    ``E_j >= alpha max_j E_j``, blocks ``j < sink_blocks``, and ``first_k - window + 1 <= j <=
    last_k`` (``first_k``/``last_k``: blocks of the tile's first and last query); the last
    ``last_n_blocks`` query tiles of each sequence keep every visible block."""
    from kernels.paged import gather_kv

    g, d = plan.group_size, plan.head_dim
    tpb = block // KV_TILE
    scale_log2 = plan.config.softmax_scale(d) * math.log2(math.e) * q_descale * k_descale
    kmeans, vmeans, lists = [], [], []
    for b in range(plan.batch_size):
        lq, lkv = plan.seqlens_q[b], plan.seqlens_kv[b]
        nblk = -(-lkv // block)
        kk = gather_kv(k_pages, plan.page_table, b, lkv).float()
        vv = gather_kv(v_pages, plan.page_table, b, lkv).float()
        pad = nblk * block - lkv
        cnt = torch.full((nblk,), float(block))
        cnt[-1] = block - pad
        km = torch.nn.functional.pad(kk, (0, 0, 0, 0, 0, pad)).view(nblk, block, *kk.shape[1:]).sum(1)
        vm = torch.nn.functional.pad(vv, (0, 0, 0, 0, 0, pad)).view(nblk, block, *vv.shape[1:]).sum(1)
        kmeans.append((km / cnt[:, None, None]).to(q.dtype))
        vmeans.append((vm / cnt[:, None, None]).to(q.dtype))
    max_blocks = max(x.shape[0] for x in kmeans)
    for h in range(plan.num_kv_heads):
        for b in range(plan.batch_size):
            lq, lkv = plan.seqlens_q[b], plan.seqlens_kv[b]
            prefix = lkv - lq
            q0 = plan.cu_seqlens_q_host[b]
            km = kmeans[b][:, h].float()
            n_tiles_kv = -(-lkv // KV_TILE)
            for tile in range(plan.qtiles[b]):
                r0, rows, pmin, pmax = plan.tile_rows(b, tile)
                r = torch.arange(r0, r0 + rows)
                pos, head = r // g, h * g + r % g
                first_k, last_k = (prefix + pmin) // block, (prefix + pmax) // block
                jj = torch.arange(last_k + 1)
                if tile >= plan.qtiles[b] - last_n_blocks:
                    keep = torch.ones(last_k + 1, dtype=torch.bool)
                else:
                    active = (prefix + pmax + 1) // block
                    s = (q[q0 + pos, head].float() @ km[:active].to(q.dtype).float().T) * scale_log2
                    s = s.masked_fill(prefix + pos[:, None] < torch.arange(active)[None, :] * block,
                                      float("-inf"))
                    energy = torch.zeros(last_k + 1)
                    if active:
                        energy[:active] = torch.exp2(s - s.max()).sum(0)
                    passed = (energy >= alpha * energy.max()) & (jj < active)
                    keep = passed | (jj < sink_blocks) | (jj >= first_k - window_blocks + 1)
                keep &= jj * block < lkv
                blocks = jj[keep]
                t = (blocks[:, None] * tpb + torch.arange(tpb)[None, :]).flatten()
                lists.append(t[t < n_tiles_kv])
    counts = torch.tensor([x.numel() for x in lists], dtype=torch.int64)
    offsets = torch.zeros(len(lists) + 1, dtype=torch.int32)
    offsets[1:] = torch.cumsum(counts, 0).to(torch.int32)
    tiles = torch.cat(lists).to(torch.int32) if lists else torch.zeros(0, dtype=torch.int32)
    dev = q.device
    k_mean = torch.zeros(plan.batch_size, max_blocks, plan.num_kv_heads, d, dtype=q.dtype)
    v_mean = torch.zeros_like(k_mean)
    for b in range(plan.batch_size):
        k_mean[b, : kmeans[b].shape[0]] = kmeans[b]
        v_mean[b, : vmeans[b].shape[0]] = vmeans[b]
    return PeerIndex(offsets.to(dev), tiles.to(dev), plan.total_tiles,
                     plan.cu_qtiles.to(torch.int32), k_mean.to(dev), v_mean.to(dev))
