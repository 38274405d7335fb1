"""Edge cases of ``sparse_prefill`` against an independent float64 oracle written here:
lse under mean correction in 16-bit (the term uses the fp32 means), rows whose tile would keep
no key they can see (``window_tokens = 0``), exact ties at the threshold, NaN containment in
the index stage and the opt-in ``check_finite``, and the Triton interpreter outside pytest.

The oracle follows docs/SEMANTICS.md literally, one query tile at a time, in float64: exact
block means rounded once to fp32, scoring operands rounded to q's dtype (choice 1), energies
with non-finite scores counted as -inf, ``E_J >= alpha max E`` with ``E_J > 0``, forced sink and
window blocks (at least the block holding key ``pmin + P``), and the attention sums with the
correction term over the fp32 means. ``cutlass`` cases are GPU tests (``-m gpu``).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from kernels import SparseConfig, ops
from kernels.config import KV_TILE, Q_TILE
from kernels.paged import paginate

ROOT = Path(__file__).resolve().parents[1]
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
ON_GPU = torch.cuda.is_available() and not INTERPRET
DEVICE = "cuda" if ON_GPU else "cpu"
# lse of the correction term: the means rounded to bf16 put it off by >= 1.5e-4 on these cases;
# compiled kernels add approximate exp2/log2 and other sum orders
LSE_TOL = 2e-5 if ON_GPU else 5e-6

needs_triton = pytest.mark.skipif(not (ON_GPU or INTERPRET), reason="Triton needs CUDA or TRITON_INTERPRET=1")
gpu_only = [pytest.mark.gpu, pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU (compiled kernels)")]
BACKENDS = [
    pytest.param("reference", id="reference"),
    pytest.param("triton", id="triton", marks=needs_triton),
    pytest.param("cutlass", id="cutlass", marks=gpu_only),
]


# ------------------------------------------------------------------------------------ inputs
class Batch:
    def __init__(self, q, keys, values, seqlens_q, *, page_size, seed=0):
        self.q, self.keys, self.values = q, keys, values
        self.seqlens_q = list(seqlens_q)
        self.seqlens_kv = [k.shape[0] for k in keys]
        gen = torch.Generator().manual_seed(seed + 1)
        self.k_pages, self.page_table = paginate(keys, page_size, generator=gen, spare_pages=1)
        gen = torch.Generator().manual_seed(seed + 1)
        self.v_pages, _ = paginate(values, page_size, generator=gen, spare_pages=1)
        cu = [0]
        for n in self.seqlens_q:
            cu.append(cu[-1] + n)
        self.cu = torch.tensor(cu, dtype=torch.int32)

    def args(self, q=None):
        q = self.q if q is None else q
        return tuple(x.to(DEVICE) for x in (q, self.k_pages, self.v_pages, self.page_table, self.cu,
                                             torch.tensor(self.seqlens_kv, dtype=torch.int32)))


def random_batch(seqlens_q, seqlens_kv, hq, hkv, d, *, dtype, page_size, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(sum(seqlens_q), hq, d, generator=g).to(dtype)
    keys = [torch.randn(n, hkv, d, generator=g).to(dtype) for n in seqlens_kv]
    values = [torch.randn(n, hkv, d, generator=g).to(dtype) for n in seqlens_kv]
    return Batch(q, keys, values, seqlens_q, page_size=page_size, seed=seed)


def run(batch, cfg, backend, q=None):
    """(out, lse, index) of one backend; cutlass runs its attention stage on Triton's index."""
    args = batch.args(q)
    plan = ops.plan_prefill(*args, cfg)
    index = ops.build_index_planned(args[0], args[1], args[2], plan, backend=backend)
    out, lse = ops.attention_planned(args[0], args[1], args[2], plan, index, backend=backend)
    return out.cpu(), lse.cpu(), index, plan


# ------------------------------------------------------------------------------------ oracle
def _tiles(batch, hkv, hq):
    """(b, h, I, seg, rows r, positions p, heads) of every segment, in segment order."""
    g = hq // hkv
    qtiles = [-(-g * n // Q_TILE) for n in batch.seqlens_q]
    cu_tiles = [0]
    for n in qtiles:
        cu_tiles.append(cu_tiles[-1] + n)
    for h in range(hkv):
        for b, lq in enumerate(batch.seqlens_q):
            for tile in range(qtiles[b]):
                rows = torch.arange(tile * Q_TILE, min(tile * Q_TILE + Q_TILE, g * lq))
                yield b, h, tile, h * cu_tiles[-1] + cu_tiles[b] + tile, rows, rows // g, h * g + rows % g


def _blocks(lkv, bs):
    return [(j * bs, min((j + 1) * bs, lkv)) for j in range(-(-lkv // bs))]


def _fp32_means(x, blocks):
    """Exact means (float64 sums of the stored values), rounded once to fp32, as float64."""
    return torch.stack([x[a:e].double().mean(0).float().double() for a, e in blocks])


def oracle_select(batch, cfg, hkv):
    """{seg: (selected block ids, energies float64 [nvis])} by SEMANTICS's index stage."""
    q = batch.q
    hq, d = q.shape[1], q.shape[2]
    scale = cfg.softmax_scale(d)
    bs = cfg.block_size
    cu = batch.cu.tolist()
    result = {}
    for b, h, tile, seg, rows, pos, heads in _tiles(batch, hkv, hq):
        lkv, lq = batch.seqlens_kv[b], batch.seqlens_q[b]
        prefix = lkv - lq
        lo, hi = int(pos[0]) + prefix, int(pos[-1]) + prefix
        blocks = _blocks(lkv, bs)[: hi // bs + 1]
        kbar = _fp32_means(batch.keys[b][:, h], blocks).float().to(q.dtype).double()  # choice 1
        qt = q[cu[b] + pos, heads].double()
        # per (row, block) products summed along d: equal operands give equal scores
        s = scale * (qt[:, None, :] * kbar[None, :, :]).sum(-1)
        s = torch.where(torch.isfinite(s), s, torch.full_like(s, -math.inf))
        top = s.max()
        energy = torch.exp(s - (top if torch.isfinite(top) else 0.0)).sum(0)
        full = torch.tensor([e - 1 <= lo for _, e in blocks])
        if cfg.alpha == 0:
            passes = full
        else:
            passes = full & (energy >= cfg.alpha * energy.max()) & (energy > 0)
        sink = torch.tensor([a < cfg.sink_tokens for a, _ in blocks])
        window = torch.tensor([e - 1 >= lo + 1 - max(cfg.window_tokens, 1) for _, e in blocks])
        result[seg] = ({j for j in range(len(blocks)) if passes[j] or sink[j] or window[j]}, energy)
    return result


def oracle_attention(batch, cfg, hkv, selected):
    """float64 ``(out [Tq, Hq, d], lse [Tq, Hq])`` given the selected blocks of each segment."""
    q = batch.q
    hq, d = q.shape[1], q.shape[2]
    scale = cfg.softmax_scale(d)
    bs = cfg.block_size
    cu = batch.cu.tolist()
    out = torch.zeros(q.shape, dtype=torch.float64)
    lse = torch.zeros(q.shape[:2], dtype=torch.float64)
    for b, h, tile, seg, rows, pos, heads in _tiles(batch, hkv, hq):
        lkv, lq = batch.seqlens_kv[b], batch.seqlens_q[b]
        prefix = lkv - lq
        lo = int(pos[0]) + prefix
        blocks = _blocks(lkv, bs)
        k, v = batch.keys[b][:, h].double(), batch.values[b][:, h].double()
        kbar, vbar = _fp32_means(batch.keys[b][:, h], blocks), _fp32_means(batch.values[b][:, h], blocks)
        keys = torch.tensor([j for J in sorted(selected[seg]) for j in range(*blocks[J])], dtype=torch.long)
        corr = [J for J, (a, e) in enumerate(blocks) if e - 1 <= lo and J not in selected[seg]]
        for p, head in zip(pos.tolist(), heads.tolist()):
            qi = q[cu[b] + p, head].double()
            ks = keys[keys <= p + prefix]
            logits, vals = [scale * (k[ks] @ qi)], [v[ks]]
            if cfg.mean_correction and corr:
                size = torch.tensor([blocks[J][1] - blocks[J][0] for J in corr], dtype=torch.float64)
                logits.append(scale * (kbar[corr] @ qi) + size.log())
                vals.append(vbar[corr])
            s, vv = torch.cat(logits), torch.cat(vals)
            m = s.max() if s.numel() else torch.tensor(-math.inf, dtype=torch.float64)
            w = torch.exp(s - m)
            out[cu[b] + p, head] = (w @ vv) / w.sum()
            lse[cu[b] + p, head] = m + w.sum().log()
    return out, lse


def selected_blocks(index, plan):
    """{seg: set of logical blocks with a listed tile} of a kernel's CSR."""
    offsets = index.seg_offsets.cpu().tolist()
    tiles = index.kv_tiles.cpu()
    tpb = plan.config.tiles_per_block
    return {seg: {int(t) // tpb for t in tiles[offsets[seg]:offsets[seg + 1]]} for seg in range(len(offsets) - 1)}


def check_selection(got, want, alpha, rtol=1e-3):
    """Exact match but for blocks whose oracle energy ratio sits within ``rtol`` of alpha."""
    for seg, (blocks, energy) in want.items():
        ratio = energy / energy.max()
        for J in got[seg] ^ blocks:
            assert abs(float(ratio[J]) - alpha) <= rtol * alpha, (
                f"segment {seg}, block {J}: ratio {float(ratio[J]):.6f}, alpha {alpha}; "
                f"got {sorted(got[seg])}, want {sorted(blocks)}")


# ------------------------------------------------------- 1. lse under correction (16-bit)
LSE_CASES = {
    # the shapes: q [16, 1, 64], one sequence, Lkv 1024, MQA 1/1, alpha 0.3
    "short": dict(seqlens_q=[16], seqlens_kv=[1024], hq=1, hkv=1, d=64, page_size=64, seed=7,
                  cfg=SparseConfig(alpha=0.3, mean_correction=True)),
    # varlen with one-token sequences, 32/2 heads, page 256, alpha 1 (most blocks corrected);
    # window 64 isolates the means from the window-0 rule, window 0 takes both
    "varlen": dict(seqlens_q=[5, 1, 7, 1], seqlens_kv=[158, 507, 1007, 1], hq=32, hkv=2, d=64,
                   page_size=256, seed=3,
                   cfg=SparseConfig(alpha=1.0, block_size=64, sink_tokens=0, window_tokens=64)),
    "varlen_window0": dict(seqlens_q=[5, 1, 7, 1], seqlens_kv=[158, 507, 1007, 1], hq=32, hkv=2,
                           d=64, page_size=256, seed=3,
                           cfg=SparseConfig(alpha=1.0, block_size=64, sink_tokens=0, window_tokens=0)),
    "d128": dict(seqlens_q=[9, 130], seqlens_kv=[1500, 700], hq=4, hkv=2, d=128, page_size=48,
                 seed=5, cfg=SparseConfig(alpha=1.0, block_size=128, sink_tokens=0, window_tokens=64)),
    "d128_fp16": dict(seqlens_q=[9, 130], seqlens_kv=[1500, 700], hq=4, hkv=2, d=128, page_size=48,
                      seed=5, dtype=torch.float16,
                      cfg=SparseConfig(alpha=1.0, block_size=128, sink_tokens=0, window_tokens=64)),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", sorted(LSE_CASES))
def test_lse_under_correction_uses_fp32_means(case, backend):
    spec = dict(LSE_CASES[case])
    cfg = spec.pop("cfg")
    dtype = spec.pop("dtype", torch.bfloat16)
    hq, hkv = spec["hq"], spec["hkv"]
    batch = random_batch(spec["seqlens_q"], spec["seqlens_kv"], hq, hkv, spec["d"], dtype=dtype,
                         page_size=spec["page_size"], seed=spec["seed"])
    out, lse, index, plan = run(batch, cfg, backend)
    want = oracle_select(batch, cfg, hkv)
    got = selected_blocks(index, plan)
    check_selection(got, want, cfg.alpha)
    ref_out, ref_lse = oracle_attention(batch, cfg, hkv, got)
    # the means rounded to bf16 put lse off by 1.5e-4 here (varlen; 2.7e-3 in the issue's
    # sweep), to fp16 by 2e-5 (d128_fp16); the fp32 means leave fp32 rounding
    assert (lse.double() - ref_lse).abs().max() <= LSE_TOL
    floor = (ref_out.to(dtype).double() - ref_out).abs().max()
    assert (out.double() - ref_out).abs().max() <= 4 * floor + 2e-3


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU (compiled kernels)")
@pytest.mark.parametrize("case", ["varlen", "d128"])
@pytest.mark.parametrize("kernel", ["ws128", "ws64", "ws128_pingpong", "ws128_persistent",
                                    "ws128_persistent_nopingpong"])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_cutlass_variants_correction_uses_fp32_means(case, kernel, num_splits):
    """Every CUTLASS variant (kBlockN 128 and 64: 64 and 32 hi + lo means per chunk) and the
    split path against the oracle, on Triton's index."""
    from kernels import cutlass_attention as ca

    spec = dict(LSE_CASES[case])
    cfg = spec.pop("cfg")
    batch = random_batch(spec["seqlens_q"], spec["seqlens_kv"], spec["hq"], spec["hkv"], spec["d"],
                         dtype=torch.bfloat16, page_size=spec["page_size"], seed=spec["seed"])
    args = batch.args()
    plan = ops.plan_prefill(*args, cfg)
    index = ops.build_index_planned(args[0], args[1], args[2], plan, backend="triton")
    out, lse = ca.sparse_attention(args[0], args[1], args[2], plan, index, kernel=kernel,
                                   num_splits=num_splits, max_ctas=3 if "persistent" in kernel else None)
    ref_out, ref_lse = oracle_attention(batch, cfg, spec["hkv"], selected_blocks(index, plan))
    assert (lse.cpu().double() - ref_lse).abs().max() <= LSE_TOL
    floor = (ref_out.to(torch.bfloat16).double() - ref_out).abs().max()
    assert (out.cpu().double() - ref_out).abs().max() <= 4 * floor + 2e-3


# ------------------------------------------------------- 2. no row without a visible key
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("hq,seqlens_q,seqlens_kv", [(1, [10], [265]), (2, [70, 10], [198, 265])])
def test_window_zero_leaves_no_row_without_keys(backend, hq, seqlens_q, seqlens_kv):
    """``window_tokens = 0``, ``sink_tokens = 0``, correction off: the diagonal block alone is
    forced, and a row at ``pmin`` whose last visible key ends a pruned, fully visible block
    would see nothing (NaN before). The block holding key ``pmin + P`` is forced now."""
    cfg = SparseConfig(alpha=0.1, block_size=128, sink_tokens=0, window_tokens=0, mean_correction=False)
    d, hkv = 64, 1
    g = torch.Generator().manual_seed(11)
    direction = torch.randn(d, generator=g)
    direction = direction / direction.norm()
    q = (torch.randn(sum(seqlens_q), hq, d, generator=g) + 4 * direction).to(torch.bfloat16)
    keys, values = [], []
    for lkv in seqlens_kv:
        k = torch.randn(lkv, hkv, d, generator=g)
        k[256:, :] += 6 * direction  # the diagonal block dominates: blocks 0 and 1 are pruned
        keys.append(k.to(torch.bfloat16))
        values.append(torch.randn(lkv, hkv, d, generator=g).to(torch.bfloat16))
    batch = Batch(q, keys, values, seqlens_q, page_size=16, seed=11)
    out, lse, index, plan = run(batch, cfg, backend)
    want = oracle_select(batch, cfg, hkv)
    got = selected_blocks(index, plan)
    assert got == {seg: blocks for seg, (blocks, _) in want.items()}
    # the construction prunes block 1 by the threshold: only the new rule keeps it
    assert any(1 in blocks and not (e[1] >= cfg.alpha * e.max()) for blocks, e in want.values())
    assert torch.isfinite(out.float()).all() and torch.isfinite(lse).all()
    ref_out, ref_lse = oracle_attention(batch, cfg, hkv, got)
    assert (lse.double() - ref_lse).abs().max() <= 2e-5
    assert (out.double() - ref_out).abs().max() <= 2e-2


# ------------------------------------------------------- 3. ties at the threshold
@pytest.mark.parametrize("backend", [p for p in BACKENDS if p.id != "cutlass"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("kind", ["copy", "permuted"])
def test_ties_at_the_threshold_are_kept(backend, dtype, kind):
    """Two blocks with equal scoring operands at the maximum, ``alpha = 1``: ``E_J >= alpha
    max E`` keeps both. ``permuted``: the second block holds the first one's tokens in another
    order (its exact mean is the same)."""
    cfg = SparseConfig(alpha=1.0, block_size=64, sink_tokens=0, window_tokens=0, mean_correction=False)
    hq, hkv, d, lq, prefix = 4, 2, 64, 64, 640
    g = torch.Generator().manual_seed(21)
    direction = torch.randn(hkv, d, generator=g)
    direction = direction / direction.norm(dim=-1, keepdim=True)
    q = (torch.randn(lq, hq, d, generator=g) + 3 * direction.repeat_interleave(hq // hkv, 0)).to(dtype)
    k = torch.randn(lq + prefix, hkv, d, generator=g)
    pairs = [(1, 6), (3, 9)]  # (source, twin) blocks, all fully visible for every row
    for src, twin in pairs[:1]:
        k[src * 64:(src + 1) * 64] += 2.5 * direction
    src, twin = pairs[0]
    block = k[src * 64:(src + 1) * 64]
    if kind == "permuted":
        block = block[torch.randperm(64, generator=g)]
    k[twin * 64:(twin + 1) * 64] = block
    v = torch.randn(lq + prefix, hkv, d, generator=g)
    batch = Batch(q, [k.to(dtype)], [v.to(dtype)], [lq], page_size=32, seed=21)
    want = oracle_select(batch, cfg, hkv)
    for blocks, energy in want.values():  # the construction is an exact tie at the maximum
        assert energy[src] == energy[twin] == energy.max() and {src, twin} <= blocks
    _, _, index, plan = run(batch, cfg, backend)
    got = selected_blocks(index, plan)
    for seg, (blocks, _) in want.items():
        assert {src, twin} <= got[seg], f"segment {seg}: {sorted(got[seg])}, want both {src} and {twin}"
        assert got[seg] == blocks


# ------------------------------------------------------- 4. NaN containment, check_finite
def _nan_batch(dtype=torch.bfloat16, seed=31):
    """One full 128-row tile (g = 2, 64 new tokens) after a 448-token prefix; the queries lean
    towards one direction and blocks 1 and 4 hold keys along it, so alpha = 0.05 prunes the
    other fully visible blocks by a wide margin."""
    g = torch.Generator().manual_seed(seed)
    direction = torch.randn(64, generator=g)
    direction = direction / direction.norm()
    q = torch.randn(64, 2, 64, generator=g) + 3 * direction
    k = torch.randn(512, 1, 64, generator=g)
    for blk in (1, 4):
        k[blk * 64:(blk + 1) * 64] += 12 * direction
    v = torch.randn(512, 1, 64, generator=g)
    return Batch(q.to(dtype), [k.to(dtype)], [v.to(dtype)], [64], page_size=64, seed=seed)


@pytest.mark.parametrize("backend", BACKENDS)
def test_nan_query_row_changes_no_other_row(backend):
    """A NaN in one query row: its own output is NaN, and every other row of its tile is
    bit for bit what it is when that row holds a finite value that leaves the selection as it
    is (its energy is counted as -inf; before, NaN energies switched the threshold off)."""
    cfg = SparseConfig(alpha=0.05, block_size=64, sink_tokens=0, window_tokens=64)
    batch = _nan_batch()
    token, head = 20, 1
    q_fin = batch.q.clone()
    q_fin[token, head] *= 1e-3  # near-zero scores: a finite row that barely moves the energies
    q_nan = batch.q.clone()
    q_nan[token, head, 5] = float("nan")
    nan_batch = Batch(q_nan, batch.keys, batch.values, batch.seqlens_q, page_size=64, seed=31)
    fin_batch = Batch(q_fin, batch.keys, batch.values, batch.seqlens_q, page_size=64, seed=31)
    want = oracle_select(nan_batch, cfg, 1)
    want_fin = oracle_select(fin_batch, cfg, 1)
    assert {s: b for s, (b, _) in want.items()} == {s: b for s, (b, _) in want_fin.items()}
    assert any(len(b) < len(e) for b, e in want.values())  # the threshold does prune
    out_nan, lse_nan, index_nan, plan = run(nan_batch, cfg, backend)
    out_fin, lse_fin, index_fin, _ = run(fin_batch, cfg, backend)
    got = selected_blocks(index_nan, plan)
    check_selection(got, want, cfg.alpha)
    assert got == selected_blocks(index_fin, plan)
    others = torch.ones(out_nan.shape[:2], dtype=torch.bool)
    others[token, head] = False
    assert torch.equal(out_nan[others], out_fin[others])
    assert torch.equal(lse_nan[others], lse_fin[others])
    assert torch.isnan(out_nan[token, head].float()).all()
    assert not torch.isfinite(lse_nan[token, head])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("bad", ["nan", "inf"])
def test_non_finite_key_leaves_other_blocks_selection(backend, bad):
    """A NaN (or Inf) key makes its block's scores non-finite in every tile: that block never
    passes the threshold, and the others are selected as if it were not there. Rows that read
    the key are not finite; the rest match the oracle."""
    cfg = SparseConfig(alpha=0.05, block_size=64, sink_tokens=0, window_tokens=64, mean_correction=False)
    batch = _nan_batch(seed=33)
    bad_block = 2
    batch.keys[0][bad_block * 64 + 7, 0, 3] = float(bad)
    batch = Batch(batch.q, batch.keys, batch.values, batch.seqlens_q, page_size=64, seed=33)
    want = oracle_select(batch, cfg, 1)
    for blocks, energy in want.values():
        assert energy[bad_block] == 0 and bad_block not in blocks
    out, lse, index, plan = run(batch, cfg, backend)
    got = selected_blocks(index, plan)
    check_selection(got, want, cfg.alpha)
    ref_out, ref_lse = oracle_attention(batch, cfg, 1, got)
    finite = torch.isfinite(ref_lse) & torch.isfinite(ref_out).all(-1)
    assert finite.all()  # the bad block is pruned for every tile here
    assert (lse.double() - ref_lse).abs().max() <= 2e-5
    assert (out.double() - ref_out).abs().max() <= 2e-2


def test_check_finite_names_the_tensor():
    batch = random_batch([40, 0, 9], [100, 30, 9], 4, 2, 64, dtype=torch.bfloat16, page_size=16, seed=41)
    args = batch.args()
    cfg = SparseConfig(block_size=64)
    # unused page slots hold NaN (paginate's poison): only the tokens the batch reads count
    assert torch.isnan(batch.k_pages.float()).any()
    ops.sparse_prefill(*args, cfg, backend="reference", check_finite=True)
    ops.build_index(*args, cfg, backend="reference", check_finite=True)
    for name, position in (("q", 0), ("k_pages", 1), ("v_pages", 2)):
        for value in (float("nan"), float("inf"), float("-inf")):
            bad = list(args)
            t = bad[position].clone()
            if position == 0:
                t[45, 3, 7] = value
            else:
                page = int(batch.page_table[2, 0])
                t[page, 8, 1, 60] = value  # sequence 2, token 8
            bad[position] = t
            with pytest.raises(ValueError, match=rf"^{name}: expected finite"):
                ops.sparse_prefill(*bad, cfg, backend="reference", check_finite=True)
            with pytest.raises(ValueError, match=rf"^{name}: expected finite"):
                ops.build_index(*bad, cfg, backend="reference", check_finite=True)
    qc = torch.randn(1, 64, 2, 64)
    kc, vc = torch.randn(1, 64, 1, 64), torch.randn(1, 64, 1, 64)
    ops.sparse_attention(qc, kc, vc, cfg, backend="reference", check_finite=True)
    kc[0, 10, 0, 0] = float("nan")
    with pytest.raises(ValueError, match=r"^k: expected finite"):
        ops.sparse_attention(qc, kc, vc, cfg, backend="reference", check_finite=True)


# ------------------------------------------------------- 5. the interpreter outside pytest
_SCRIPT = textwrap.dedent('''
    import torch
    from kernels import SparseConfig, sparse_prefill
    from kernels.paged import paginate
    g = torch.Generator().manual_seed(0)
    lq, lkv, hq, hkv, d = [100, 37], [300, 37], 4, 2, 64
    q = torch.randn(sum(lq), hq, d, generator=g).to(torch.bfloat16)
    ks = [torch.randn(n, hkv, d, generator=g).to(torch.bfloat16) for n in lkv]
    vs = [torch.randn(n, hkv, d, generator=g).to(torch.bfloat16) for n in lkv]
    kp, pt = paginate(ks, 16, generator=torch.Generator().manual_seed(1))
    vp, _ = paginate(vs, 16, generator=torch.Generator().manual_seed(1))
    cu = torch.tensor([0, lq[0], lq[0] + lq[1]], dtype=torch.int32)
    skv = torch.tensor(lkv, dtype=torch.int32)
    cfg = SparseConfig(alpha=0.0, block_size=64)  # dense: the index cannot differ
    out, lse = sparse_prefill(q, kp, vp, pt, cu, skv, cfg, backend="triton")
    ref, ref_lse = sparse_prefill(q.float(), kp.float(), vp.float(), pt, cu, skv, cfg, backend="reference")
    print("out_err", float((out.float() - ref).abs().max()))
    print("lse_err", float((lse - ref_lse).abs().max()))
''')


def _clean_env():
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST")}
    env.update(TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    return env


def test_interpreter_outside_pytest_computes_bf16_correctly(tmp_path):
    """A user's script under TRITON_INTERPRET=1 (no conftest): bf16 through Triton's loops and
    tl.dot. Before the fixes moved into kernels/, numpy 2.4 made it crash, and bf16 dots
    multiplied bit patterns."""
    pytest.importorskip("triton")
    script = tmp_path / "user_script.py"
    script.write_text(_SCRIPT)
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=_clean_env(),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    fields = dict(line.split() for line in proc.stdout.splitlines() if line.count(" ") == 1)
    assert float(fields["out_err"]) <= 2e-2  # bf16 output rounding and bf16 P
    assert float(fields["lse_err"]) <= 1e-4


def test_demo_under_the_interpreter_outside_pytest(tmp_path):
    """``python -m kernels demo --backend triton`` on CPU under TRITON_INTERPRET=1 reports the
    same fidelity as the reference run of the same inputs."""
    pytest.importorskip("triton")
    tiny = ["demo", "--seqlen", "512", "--heads", "2", "--kv-heads", "1", "--head-dim", "32",
            "--device", "cpu", "--block-size", "64"]
    results = {}
    for backend in ("triton", "reference"):
        path = tmp_path / f"{backend}.json"
        proc = subprocess.run([sys.executable, "-m", "kernels", *tiny, "--backend", backend, "--json", str(path)],
                              cwd=ROOT, env=_clean_env(), capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        results[backend] = json.loads(path.read_text())
    tri, ref = results["triton"], results["reference"]
    assert tri["backend"] == "triton"
    assert tri["density"] == pytest.approx(ref["density"], abs=0.02)
    assert tri["needle_recall"] == ref["needle_recall"]  # None: no needles at this length
    assert tri["retained_mass"] == pytest.approx(ref["retained_mass"], abs=0.02)
    assert tri["rel_l2_corrected"] <= 1.5 * ref["rel_l2_corrected"] + 5e-3
    assert tri["rel_l2_uncorrected"] <= 1.5 * ref["rel_l2_uncorrected"] + 5e-3
