"""Triton attention stage (kernels/triton_attention.py) against the PyTorch reference.

CPU CI runs the real kernel under TRITON_INTERPRET=1 at small sizes; ``-m gpu`` tests run it
compiled on CUDA up to 32K. Tolerance (STYLE.md 5): ``max|out - ref| <= 2 max|out_lowprec - ref|
+ 1e-3`` with ``ref`` the reference on fp32-upcast inputs and ``out_lowprec`` the same math done
in the input dtype by PyTorch (``_lowprec_sparse_attention``); lse within 1e-3.
"""

from __future__ import annotations

import math
import os

import pytest
import torch

from kernels import SparseConfig, plan_prefill
from kernels import reference as ref
from kernels.config import KV_TILE
from kernels.paged import gather_kv
from tests.helpers import make_batch, poison_empty

ON_GPU = torch.cuda.is_available()
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"

needs_triton = pytest.mark.skipif(
    not (ON_GPU or INTERPRET), reason="Triton needs CUDA or TRITON_INTERPRET=1"
)
pytestmark = needs_triton
DEVICE = "cuda" if ON_GPU and not INTERPRET else "cpu"

if ON_GPU or INTERPRET:
    from kernels import triton_attention as ta


# ------------------------------------------------------------------------------------------
# helpers
# ------------------------------------------------------------------------------------------


def _case(seqlens_q, prefixes, *, hq, hkv, d, page_size, cfg, dtype=torch.bfloat16, seed=0,
          needles=3, device=DEVICE):
    batch = make_batch(seqlens_q, prefixes, num_qo_heads=hq, num_kv_heads=hkv, head_dim=d,
                       page_size=page_size, seed=seed, dtype=dtype, device=device,
                       needles=needles, needle_gain=3.0 * math.sqrt(d),
                       block_size=cfg.block_size)
    plan = plan_prefill(*batch.args(), cfg)
    return batch, plan


def _lowprec_sparse_attention(q, k_pages, v_pages, plan, index):
    """The reference's math with every operand and intermediate in ``q.dtype``: what a plain
    PyTorch implementation at that precision gets (the error scale of the tolerance)."""
    cfg, dt = plan.config, q.dtype
    bs, g, d = cfg.block_size, plan.group_size, q.shape[-1]
    scale = cfg.softmax_scale(d)
    out = torch.zeros(q.shape, dtype=dt, device=q.device)
    offsets = index.seg_offsets.tolist()
    for b in range(plan.batch_size):
        lkv, prefix = plan.seqlens_kv[b], plan.prefix(b)
        q0, lq = plan.cu_seqlens_q_host[b], plan.seqlens_q[b]
        keys = gather_kv(k_pages, plan.page_table, b, lkv)
        vals = gather_kv(v_pages, plan.page_table, b, lkv)
        blk0 = plan.cu_blocks_host[b]
        for h in range(plan.num_kv_heads):
            qp = q[q0 : q0 + lq, h * g : (h + 1) * g].reshape(lq * g, d)
            for tile in range(plan.qtiles[b]):
                seg = h * plan.total_tiles + plan.cu_qtiles_host[b] + tile
                r0, rows, _, _, _, nfull = ref._tile_geometry(plan, b, tile)
                tiles = index.kv_tiles[offsets[seg] : offsets[seg + 1]].long()
                j = (tiles[:, None] * KV_TILE + torch.arange(KV_TILE, device=q.device)).flatten()
                j = j[j < lkv]
                qt = qp[r0 : r0 + rows]
                pos = (r0 + torch.arange(rows, device=q.device)) // g + prefix
                s = (qt @ keys[j, h].T) * scale
                s = s.masked_fill(j[None, :] > pos[:, None], float("-inf"))
                v = vals[j, h]
                corr = _correction_blocks(plan, index, b, tile, tiles)
                if cfg.mean_correction and corr.numel():
                    size = torch.clamp((corr + 1) * bs, max=lkv) - corr * bs
                    kbar = index.means.kbar[blk0 + corr, h].to(dt)
                    sbar = (qt @ kbar.T) * scale + torch.log(size.float()).to(dt)[None, :]
                    s = torch.cat([s, sbar], 1)
                    v = torch.cat([v, index.means.vbar[blk0 + corr, h].to(dt)], 0)
                p = torch.softmax(s, dim=1)
                o = p @ v
                out[q0 + pos - prefix, h * g + (r0 + torch.arange(rows, device=q.device)) % g] = o
    return out


def _correction_blocks(plan, index, b, tile, tiles):
    """C(I): fully visible blocks none of whose tiles are selected."""
    _, _, _, _, _, nfull = ref._tile_geometry(plan, b, tile)
    keep = torch.ones(nfull, dtype=torch.bool, device=tiles.device)
    sel = torch.unique(tiles // plan.config.tiles_per_block)
    keep[sel[sel < nfull]] = False
    return keep.nonzero().flatten()


def _pruning_stats(plan, index):
    """(pruned visible tiles, correction blocks) over all segments: the test must exercise both."""
    offsets = index.seg_offsets.tolist()
    pruned = corrected = 0
    for h in range(plan.num_kv_heads):
        for b in range(plan.batch_size):
            for tile in range(plan.qtiles[b]):
                seg = h * plan.total_tiles + plan.cu_qtiles_host[b] + tile
                _, _, _, hi, _, _ = ref._tile_geometry(plan, b, tile)
                visible = min(hi // KV_TILE + 1, -(-plan.seqlens_kv[b] // KV_TILE))
                tiles = index.kv_tiles[offsets[seg] : offsets[seg + 1]].long()
                pruned += visible - tiles.numel()
                corrected += _correction_blocks(plan, index, b, tile, tiles).numel()
    return pruned, corrected


def _nan_outputs(monkeypatch):
    """Kernel outputs and split partials start as NaN: any element left unwritten shows."""
    poison_empty(monkeypatch, ta)


def _check_close(out, lse, batch, plan, index):
    q32 = batch.q.float()
    expect, expect_lse = ref.sparse_attention(q32, batch.k_pages.float(), batch.v_pages.float(),
                                              plan, index)
    assert out.dtype == batch.q.dtype and out.shape == batch.q.shape
    assert lse.dtype == torch.float32 and lse.shape == batch.q.shape[:2]
    err = (out.float() - expect).abs().max().item()
    if batch.q.dtype == torch.float32:
        tol = 2e-5
    else:
        low = _lowprec_sparse_attention(batch.q, batch.k_pages, batch.v_pages, plan, index)
        tol = 2 * (low.float() - expect).abs().max().item() + 1e-3
    assert err <= tol, f"max|out - ref| = {err:.3g} > {tol:.3g}"
    lse_err = (lse - expect_lse).abs().max().item()
    assert lse_err <= 1e-3, f"max|lse - ref| = {lse_err:.3g}"


# ------------------------------------------------------------------------------------------
# against the reference (interpreter on CPU)
# ------------------------------------------------------------------------------------------

# (seqlens_q, prefixes, hq, hkv, d, page_size, block_size, mean_correction, sink = window tokens)
# One needle block per sequence; small sink/window so that the index prunes and corrects.
CASES = [
    ([333], [0], 4, 1, 64, 16, 64, True, 64),  # g=4, odd length, per-row page lookup
    ([200, 1, 77], [130, 0, 250], 8, 1, 128, 64, 128, True, 0),  # g=8, prefixes, single token
    ([190, 257], [64, 0], 2, 2, 64, 1, 64, True, 0),  # g=1 (MHA), page_size 1
    ([300], [211], 4, 1, 128, 256, 128, False, 0),  # g=4, no correction, big pages
    ([97, 160], [400, 33], 4, 1, 64, 256, 128, True, 0),  # long prefix, partial last pages
    ([129], [450], 8, 1, 64, 64, 192, True, 0),  # Bs = 3 tiles (not a power of two)
]


def _case_id(c):
    return f"lq{c[0]}-p{c[1]}-g{c[2] // c[3]}-d{c[4]}-ps{c[5]}-bs{c[6]}-corr{int(c[7])}-sw{c[8]}"


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_matches_reference(case, monkeypatch):
    seqlens_q, prefixes, hq, hkv, d, page_size, block_size, corr, sink_window = case
    cfg = SparseConfig(alpha=0.1, block_size=block_size, sink_tokens=sink_window,
                       window_tokens=sink_window, mean_correction=corr)
    batch, plan = _case(seqlens_q, prefixes, hq=hq, hkv=hkv, d=d, page_size=page_size, cfg=cfg,
                        needles=1)
    index = ref.build_index(batch.q, batch.k_pages, batch.v_pages, plan)
    pruned, corrected = _pruning_stats(plan, index)
    assert pruned > 0 and corrected > 0, "inputs must make the index prune and correct"
    _nan_outputs(monkeypatch)
    out, lse = ta.sparse_attention(batch.q, batch.k_pages, batch.v_pages, plan, index, num_splits=1)
    _check_close(out, lse, batch, plan, index)


def test_correction_changes_the_output():
    """Mean correction on vs off differ where blocks were corrected (so the test above can fail)."""
    base = dict(alpha=0.1, block_size=64, sink_tokens=64, window_tokens=64)
    outs = []
    for corr in (True, False):
        cfg = SparseConfig(mean_correction=corr, **base)
        batch, plan = _case([300], [100], hq=4, hkv=1, d=64, page_size=64, cfg=cfg,
                            dtype=torch.float32)
        index = ref.build_index(batch.q, batch.k_pages, batch.v_pages, plan)
        outs.append(ta.sparse_attention(batch.q, batch.k_pages, batch.v_pages, plan, index)[0])
    assert (outs[0] - outs[1]).abs().max().item() > 1e-2


def test_alpha0_equals_dense():
    cfg = SparseConfig(alpha=0.0, block_size=64, sink_tokens=0, window_tokens=0)
    batch, plan = _case([150, 70], [90, 0], hq=4, hkv=2, d=64, page_size=16, cfg=cfg,
                        dtype=torch.float32)
    index = ref.build_index(batch.q, batch.k_pages, batch.v_pages, plan)
    out, lse = ta.sparse_attention(batch.q, batch.k_pages, batch.v_pages, plan, index)
    dense, dense_lse = ref.dense_attention(batch.q, batch.k_pages, batch.v_pages, plan)
    assert (out - dense).abs().max().item() <= 2e-5
    assert (lse - dense_lse).abs().max().item() <= 2e-5


@pytest.mark.parametrize("page_size,dtype", [(64, torch.float32), (16, torch.bfloat16)])
def test_dense_flag_equals_dense(page_size, dtype, monkeypatch):
    cfg = SparseConfig(block_size=128)
    batch, plan = _case([140, 1, 45], [60, 9, 0], hq=8, hkv=2, d=64, page_size=page_size,
                        cfg=cfg, dtype=dtype)
    _nan_outputs(monkeypatch)
    out, lse = ta.sparse_attention(batch.q, batch.k_pages, batch.v_pages, plan, None, dense=True)
    dense, dense_lse = ref.dense_attention(batch.q.float(), batch.k_pages.float(),
                                           batch.v_pages.float(), plan)
    err = (out.float() - dense).abs().max().item()
    # bf16: output rounding (half an ulp of |out| < 4) plus bf16 probabilities
    assert err <= (2e-5 if dtype == torch.float32 else 2e-2)
    assert (lse - dense_lse).abs().max().item() <= 1e-4


@pytest.mark.parametrize("dense", [False, True])
def test_split_equals_unsplit(dense, monkeypatch):
    cfg = SparseConfig(alpha=0.1, block_size=64, sink_tokens=64, window_tokens=64)
    batch, plan = _case([260, 5], [120, 0], hq=4, hkv=1, d=64, page_size=16, cfg=cfg,
                        dtype=torch.float32)
    index = None if dense else ref.build_index(batch.q, batch.k_pages, batch.v_pages, plan)
    _nan_outputs(monkeypatch)
    args = (batch.q, batch.k_pages, batch.v_pages, plan, index)
    base, base_lse = ta.sparse_attention(*args, num_splits=1, dense=dense)
    for splits in (2, 7):  # 7 > some segments' tile counts: empty splits
        out, lse = ta.sparse_attention(*args, num_splits=splits, dense=dense)
        assert (out - base).abs().max().item() <= 1e-5
        assert (lse - base_lse).abs().max().item() <= 1e-5
    if not dense:
        _check_close(base, base_lse, batch, plan, index)


def test_config_num_splits_is_used(monkeypatch):
    cfg = SparseConfig(alpha=0.1, block_size=64, sink_tokens=64, window_tokens=64, num_splits=3)
    batch, plan = _case([200], [50], hq=4, hkv=1, d=64, page_size=64, cfg=cfg)
    assert ta.auto_num_splits(plan) == 3
    index = ref.build_index(batch.q, batch.k_pages, batch.v_pages, plan)
    _nan_outputs(monkeypatch)
    out, lse = ta.sparse_attention(batch.q, batch.k_pages, batch.v_pages, plan, index)
    _check_close(out, lse, batch, plan, index)


def test_auto_num_splits_heuristic():
    cfg = SparseConfig()
    batch, plan = _case([4], [700], hq=4, hkv=1, d=64, page_size=64, cfg=cfg)
    # 1 segment with 11 tiles of work on 132 SMs: split (at least 4 tiles per split)
    assert ta.auto_num_splits(plan, num_sms=132) == 2
    batch, plan = _case([300] * 4, [0] * 4, hq=4, hkv=1, d=64, page_size=64, cfg=cfg)
    assert ta.auto_num_splits(plan, num_sms=4) == 1


def test_empty_batch():
    cfg = SparseConfig()
    batch, plan = _case([0, 0], [5, 0], hq=4, hkv=2, d=64, page_size=16, cfg=cfg, needles=0)
    index = ref.build_index(batch.q, batch.k_pages, batch.v_pages, plan)
    for dense in (False, True):
        out, lse = ta.sparse_attention(batch.q, batch.k_pages, batch.v_pages, plan, index,
                                       dense=dense)
        assert out.shape == (0, 4, 64) and lse.shape == (0, 4)


def test_zero_length_sequences_among_others(monkeypatch):
    cfg = SparseConfig(alpha=0.1, block_size=64, sink_tokens=64, window_tokens=64)
    batch, plan = _case([0, 150, 0], [70, 90, 0], hq=4, hkv=1, d=64, page_size=16, cfg=cfg)
    index = ref.build_index(batch.q, batch.k_pages, batch.v_pages, plan)
    _nan_outputs(monkeypatch)
    out, lse = ta.sparse_attention(batch.q, batch.k_pages, batch.v_pages, plan, index)
    _check_close(out, lse, batch, plan, index)


def test_fp16_and_padded_head_dim(monkeypatch):
    cfg = SparseConfig(alpha=0.1, block_size=64, sink_tokens=64, window_tokens=64)
    batch, plan = _case([170], [40], hq=2, hkv=1, d=80, page_size=64, cfg=cfg,
                        dtype=torch.float16)
    index = ref.build_index(batch.q, batch.k_pages, batch.v_pages, plan)
    _nan_outputs(monkeypatch)
    out, lse = ta.sparse_attention(batch.q, batch.k_pages, batch.v_pages, plan, index)
    _check_close(out, lse, batch, plan, index)


def test_dispatch_through_ops():
    """ops dispatches to the kernel asked for and counts the call under that kernel's name
    (what replicas report as ``attention_kernels``)."""
    from kernels.ops import attention_kernel_calls, attention_planned

    cfg = SparseConfig(alpha=0.1, block_size=64, sink_tokens=64, window_tokens=64)
    batch, plan = _case([100], [30], hq=4, hkv=1, d=64, page_size=64, cfg=cfg,
                        dtype=torch.float32)
    index = ref.build_index(batch.q, batch.k_pages, batch.v_pages, plan)
    before = attention_kernel_calls()
    out, lse = attention_planned(batch.q, batch.k_pages, batch.v_pages, plan, index,
                                 backend="triton")
    expect, expect_lse = ref.sparse_attention(batch.q, batch.k_pages, batch.v_pages, plan, index)
    assert (out - expect).abs().max().item() <= 2e-5
    attention_planned(batch.q, batch.k_pages, batch.v_pages, plan, index, backend="reference")
    # auto: the reference on a CPU; on a GPU Triton (fp32 inputs: the CUTLASS kernel takes 16-bit or e4m3)
    attention_planned(batch.q, batch.k_pages, batch.v_pages, plan, index, backend="auto")
    after = attention_kernel_calls()
    delta = {k: after.get(k, 0) - before.get(k, 0) for k in ("triton", "reference", "cutlass")}
    on_gpu = batch.q.is_cuda
    assert delta == {"triton": 1 + on_gpu, "reference": 2 - on_gpu, "cutlass": 0}
    with pytest.raises(ValueError, match="backend"):
        attention_planned(batch.q, batch.k_pages, batch.v_pages, plan, index, backend="flash")
    assert attention_kernel_calls() == after  # a refused call counts nothing


@pytest.mark.parametrize("kwargs,match", [
    (dict(index=None), "index"),
    (dict(num_splits=0), "num_splits"),
    (dict(num_splits=2.0), "num_splits"),
    (dict(num_splits=True), "num_splits"),
])
def test_bad_arguments_raise(kwargs, match):
    cfg = SparseConfig()
    batch, plan = _case([10], [0], hq=2, hkv=1, d=64, page_size=16, cfg=cfg, needles=0)
    index = ref.build_index(batch.q, batch.k_pages, batch.v_pages, plan)
    call = dict(index=index)
    call.update(kwargs)
    idx = call.pop("index")
    with pytest.raises(ValueError, match=match):
        ta.sparse_attention(batch.q, batch.k_pages, batch.v_pages, plan, idx, **call)


# ------------------------------------------------------------------------------------------
# GPU (compiled) up to 32K
# ------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("length,page_size,corr", [
    (32768, 64, True), (8192, 16, True), (8192, 256, False), (3001, 1, True),
])
def test_gpu_against_reference(length, page_size, corr):
    cfg = SparseConfig(alpha=0.1, block_size=128, sink_tokens=256, window_tokens=512,
                       mean_correction=corr)
    # varlen: the long sequence plus a short one with a cached prefix
    batch, plan = _case([length, 333], [0, 1000], hq=8, hkv=2, d=128, page_size=page_size,
                        cfg=cfg, dtype=torch.bfloat16, device="cuda", needles=length // 512)
    index = ref.build_index(batch.q, batch.k_pages, batch.v_pages, plan)
    pruned, corrected = _pruning_stats(plan, index)
    assert pruned > 0 and corrected > 0
    out, lse = ta.sparse_attention(batch.q, batch.k_pages, batch.v_pages, plan, index)
    assert torch.isfinite(out).all()
    _check_close(out, lse, batch, plan, index)


@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 128])
def test_gpu_fp32_dense_fits_shared_memory(d):
    # fp32 tiles are twice the bytes of bf16: the launch config must still fit (a d=128 fp32
    # dense call once asked for 262 KB of shared memory on the H200)
    batch, plan = _case([700, 129], [0, 300], hq=8, hkv=2, d=d, page_size=64,
                        cfg=SparseConfig(), dtype=torch.float32, device="cuda")
    out, lse = ta.sparse_attention(batch.q, batch.k_pages, batch.v_pages, plan, None, dense=True)
    dense, dense_lse = ref.dense_attention(batch.q, batch.k_pages, batch.v_pages, plan)
    assert (out - dense).abs().max().item() <= 2e-5
    assert (lse - dense_lse).abs().max().item() <= 2e-5


@pytest.mark.gpu
def test_gpu_dense_and_splits_no_host_sync():
    cfg = SparseConfig(alpha=0.1, block_size=128, sink_tokens=256, window_tokens=512)
    batch, plan = _case([4096, 100], [0, 3000], hq=32, hkv=8, d=128, page_size=64, cfg=cfg,
                        dtype=torch.bfloat16, device="cuda", needles=8)
    index = ref.build_index(batch.q, batch.k_pages, batch.v_pages, plan)
    args = (batch.q, batch.k_pages, batch.v_pages, plan, index)
    ta.sparse_attention(*args)  # compile outside the sync check
    ta.sparse_attention(*args, num_splits=4)
    ta.sparse_attention(*args, dense=True)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        base, base_lse = ta.sparse_attention(*args, num_splits=1)
        split, split_lse = ta.sparse_attention(*args, num_splits=4)
        dense, dense_lse = ta.sparse_attention(*args, dense=True)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert (split.float() - base.float()).abs().max().item() <= 2 ** -7
    assert (split_lse - base_lse).abs().max().item() <= 1e-4
    expect, expect_lse = ref.dense_attention(batch.q.float(), batch.k_pages.float(),
                                             batch.v_pages.float(), plan)
    assert (dense.float() - expect).abs().max().item() <= 2 ** -8 * 6 + 1e-3
    assert (dense_lse - expect_lse).abs().max().item() <= 1e-3
