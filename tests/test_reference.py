"""The PyTorch reference operator against independent brute-force math."""

import math

import pytest
import torch

from kernels import SparseConfig, plan_prefill, sparse_attention, sparse_prefill
from kernels import reference as ref
from tests.helpers import make_batch


def brute_dense(batch, num_qo_heads, scale=None):
    """Full-matrix causal softmax attention per sequence, fp64."""
    outs, lses = [], []
    cu = batch.cu_seqlens_q.tolist()
    for b, (k, v) in enumerate(zip(batch.keys, batch.values)):
        q = batch.q[cu[b] : cu[b + 1]].double()
        lq, lkv = q.shape[0], k.shape[0]
        g = num_qo_heads // k.shape[1]
        kk = k.double().repeat_interleave(g, 1)
        vv = v.double().repeat_interleave(g, 1)
        sc = scale or 1 / math.sqrt(q.shape[-1])
        s = torch.einsum("qhd,khd->hqk", q, kk) * sc
        pos = torch.arange(lq)[:, None] + (lkv - lq)
        s = s.masked_fill(torch.arange(lkv)[None, :] > pos, float("-inf"))
        lse = torch.logsumexp(s, -1)
        outs.append(torch.einsum("hqk,khd->qhd", torch.softmax(s, -1), vv))
        lses.append(lse.T)
    return torch.cat(outs), torch.cat(lses)


def brute_selection(batch, cfg, num_qo_heads):
    """Independent per-tile statement of SPEC's index rules -> {seg: sorted tile list}."""
    hkv = batch.keys[0].shape[1]
    g = num_qo_heads // hkv
    bs = cfg.block_size
    cu = batch.cu_seqlens_q.tolist()
    tiles_per_seq = [-(-g * (cu[b + 1] - cu[b]) // 128) for b in range(len(batch.keys))]
    total_tiles = sum(tiles_per_seq)
    result = {}
    for h in range(hkv):
        t_global = 0
        for b, k in enumerate(batch.keys):
            lq, lkv = cu[b + 1] - cu[b], k.shape[0]
            prefix = lkv - lq
            nb = -(-lkv // bs)
            kbar = torch.stack([k[j * bs : (j + 1) * bs, h].mean(0) for j in range(nb)]) if nb else None
            rows_q = batch.q[cu[b] : cu[b + 1], h * g : (h + 1) * g].reshape(lq * g, batch.q.shape[-1]).float()
            for tile in range(tiles_per_seq[b]):
                r = torch.arange(tile * 128, min(tile * 128 + 128, g * lq))
                pos = r // g + prefix
                lo, hi = int(pos.min()), int(pos.max())
                vis = [j for j in range(nb) if j * bs <= hi]
                full = [j for j in vis if min((j + 1) * bs, lkv) - 1 <= lo]
                s = cfg.softmax_scale(k.shape[-1]) * rows_q[r] @ kbar[vis].to(batch.q.dtype).float().T
                e = torch.exp(s - s.max()).sum(0)
                keep = set()
                for i, j in enumerate(vis):
                    passes = j in full and bool(e[i] >= cfg.alpha * e.max())
                    sink = j * bs < cfg.sink_tokens
                    window = min((j + 1) * bs, lkv) - 1 >= lo + 1 - cfg.window_tokens
                    if passes or sink or window:
                        keep.add(j)
                tiles = sorted(
                    n for j in keep for n in range(j * bs // 64, (j + 1) * bs // 64)
                    if n * 64 < lkv and n * 64 <= hi
                )
                result[h * total_tiles + t_global + tile] = tiles
            t_global += tiles_per_seq[b]
    return result


CASES = [
    # seqlens_q, prefixes, Hq, Hkv, d, page_size
    ([300, 1, 517], [0, 40, 200], 8, 2, 64, 16),
    ([129, 0, 64], [5, 9, 0], 4, 4, 64, 1),
    ([700], [131], 8, 1, 128, 256),
]


@pytest.mark.parametrize("lq,prefix,hq,hkv,d,ps", CASES)
def test_alpha_zero_equals_dense(lq, prefix, hq, hkv, d, ps):
    batch = make_batch(lq, prefix, num_qo_heads=hq, num_kv_heads=hkv, head_dim=d, page_size=ps, seed=1)
    cfg = SparseConfig(alpha=0.0, block_size=64, sink_tokens=0, window_tokens=0)
    out, lse = sparse_prefill(*batch.args(), cfg, backend="reference")
    want, want_lse = brute_dense(batch, hq)
    assert (out.double() - want).abs().max() < 1e-5
    assert (lse.double() - want_lse).abs().max() < 1e-5
    plan = plan_prefill(*batch.args(), cfg)
    dense, dense_lse = ref.dense_attention(batch.q, batch.k_pages, batch.v_pages, plan, chunk=97)
    assert (dense.double() - want).abs().max() < 1e-5
    assert (dense_lse.double() - want_lse).abs().max() < 1e-5


@pytest.mark.parametrize("lq,prefix,hq,hkv,d,ps", CASES)
@pytest.mark.parametrize("alpha", [0.05, 0.3, 1.0])
def test_index_matches_brute_force_rules(lq, prefix, hq, hkv, d, ps, alpha):
    batch = make_batch(lq, prefix, num_qo_heads=hq, num_kv_heads=hkv, head_dim=d, page_size=ps,
                       seed=2, needles=2)
    cfg = SparseConfig(alpha=alpha, block_size=64, sink_tokens=64, window_tokens=128)
    plan = plan_prefill(*batch.args(), cfg)
    index = ref.build_index(batch.q, batch.k_pages, batch.v_pages, plan)
    want = brute_selection(batch, cfg, hq)
    assert plan.num_segments == len(want)
    offsets = index.seg_offsets.tolist()
    for seg, tiles in want.items():
        assert index.kv_tiles[offsets[seg] : offsets[seg + 1]].tolist() == tiles, seg
    if alpha >= 0.3 and max(a + b for a, b in zip(lq, prefix)) > 400:
        assert ref.density(index, plan) < 0.9  # the rules actually prune here


def test_block_means_are_exact_means():
    batch = make_batch([70, 3], [60, 0], num_qo_heads=2, num_kv_heads=2, head_dim=64, page_size=16, seed=3)
    cfg = SparseConfig(block_size=64)
    plan = plan_prefill(*batch.args(), cfg)
    means = ref.block_means(batch.k_pages, batch.v_pages, plan)
    k0 = batch.keys[0]
    assert torch.allclose(means.kbar[0], k0[:64].mean(0), atol=1e-6)
    assert torch.allclose(means.kbar[1], k0[64:128].mean(0), atol=1e-6)
    assert torch.allclose(means.kbar[2], k0[128:].mean(0), atol=1e-6)  # short last block
    assert torch.allclose(means.vbar[3], batch.values[1].mean(0), atol=1e-6)


def test_page_size_does_not_change_the_result():
    outs = []
    for ps in (1, 16, 64, 256):
        batch = make_batch([250, 77], [90, 3], num_qo_heads=4, num_kv_heads=2, head_dim=64,
                           page_size=ps, seed=4, needles=2)
        cfg = SparseConfig(alpha=0.2, block_size=64, sink_tokens=64, window_tokens=64)
        outs.append(sparse_prefill(*batch.args(), cfg, backend="reference"))
    for out, lse in outs[1:]:
        assert torch.allclose(out, outs[0][0], atol=1e-6)
        assert torch.allclose(lse, outs[0][1], atol=1e-6)


def _correction_inputs(seed):
    """Blocks with low internal variance: each key/value block = a block direction + small
    noise, many of moderate weight -> pruned blocks carry real mass."""
    g = torch.Generator().manual_seed(seed)
    lq, hq, hkv, d, bs = 1024, 4, 1, 64, 64
    nb = lq // bs
    kdir = torch.randn(nb, 1, d, generator=g) * 0.6
    vdir = torch.randn(nb, 1, d, generator=g)
    k = kdir.repeat_interleave(bs, 0) + 0.2 * torch.randn(lq, hkv, d, generator=g)
    v = vdir.repeat_interleave(bs, 0) + 0.2 * torch.randn(lq, hkv, d, generator=g)
    q = torch.randn(1, lq, hq, d, generator=g) + kdir[torch.randint(0, nb, (1,), generator=g)]
    return q, k[None], v[None]


@pytest.mark.parametrize("seed", [5, 6])
def test_mean_correction_brings_output_closer_to_dense(seed):
    q, k, v = _correction_inputs(seed)
    base = dict(alpha=0.5, block_size=64, sink_tokens=64, window_tokens=64)
    dense, _ = sparse_attention(q, k, v, SparseConfig(alpha=0.0), backend="reference")
    with_c, _ = sparse_attention(q, k, v, SparseConfig(mean_correction=True, **base), backend="reference")
    without, _ = sparse_attention(q, k, v, SparseConfig(mean_correction=False, **base), backend="reference")
    err_c = (with_c - dense).norm() / dense.norm()
    err_n = (without - dense).norm() / dense.norm()
    assert err_n > 0.02  # pruning loses real mass on these inputs
    assert err_c < 0.5 * err_n


def test_lse_includes_the_correction_mass():
    q, k, v = _correction_inputs(7)
    cfg = dict(alpha=0.5, block_size=64, sink_tokens=64, window_tokens=64)
    _, lse_dense = sparse_attention(q, k, v, SparseConfig(alpha=0.0), backend="reference")
    _, lse_c = sparse_attention(q, k, v, SparseConfig(mean_correction=True, **cfg), backend="reference")
    _, lse_n = sparse_attention(q, k, v, SparseConfig(mean_correction=False, **cfg), backend="reference")
    assert (lse_n <= lse_dense + 1e-5).all()  # dropping blocks only removes mass
    assert (lse_c - lse_dense).abs().mean() < (lse_n - lse_dense).abs().mean()


def test_density_counts_visible_pairs():
    # one sequence of 512 queries, block 64, keep only sink (first block) and window 64
    batch = make_batch([512], [0], num_qo_heads=1, num_kv_heads=1, head_dim=64, page_size=64, seed=8)
    cfg = SparseConfig(alpha=1.0, block_size=64, sink_tokens=1, window_tokens=1)
    plan = plan_prefill(*batch.args(), cfg)
    index = ref.build_index(batch.q, batch.k_pages, batch.v_pages, plan)
    want = brute_selection(batch, cfg, 1)
    selected = 0
    for seg, tiles in want.items():
        for p in range(seg * 128, seg * 128 + 128):
            selected += sum(min(64 * n + 64, p + 1) - 64 * n for n in tiles if 64 * n <= p)
    assert ref.density(index, plan) == pytest.approx(selected / (512 * 513 / 2))
    assert ref.density(index, plan) < 1.0


def test_empty_batch_and_empty_sequences():
    cfg = SparseConfig()
    q = torch.randn(0, 4, 64)
    kp = torch.randn(2, 16, 2, 64)
    out, lse = sparse_prefill(q, kp, kp.clone(), torch.zeros(0, 1, dtype=torch.int32),
                              torch.zeros(1, dtype=torch.int32), torch.zeros(0, dtype=torch.int32),
                              cfg, backend="reference")
    assert out.shape == (0, 4, 64) and lse.shape == (0, 4)
    batch = make_batch([0, 5], [3, 0], num_qo_heads=4, num_kv_heads=2, head_dim=64, page_size=16, seed=9)
    out, lse = sparse_prefill(*batch.args(), cfg, backend="reference")
    want, want_lse = brute_dense(batch, 4)
    assert out.shape == (5, 4, 64)
    assert (out.double() - want).abs().max() < 1e-5


def test_contiguous_call_matches_paged():
    g = torch.Generator().manual_seed(10)
    q = torch.randn(2, 200, 8, 64, generator=g)
    k = torch.randn(2, 200, 2, 64, generator=g)
    v = torch.randn(2, 200, 2, 64, generator=g)
    cfg = SparseConfig(alpha=0.3, block_size=64, sink_tokens=0, window_tokens=64)
    out, lse = sparse_attention(q, k, v, cfg, page_size=16, backend="reference")
    assert out.shape == q.shape and lse.shape == (2, 200, 8)
    for b in range(2):
        o1, l1 = sparse_attention(q[b : b + 1], k[b : b + 1], v[b : b + 1], cfg, page_size=64,
                                  backend="reference")
        assert torch.allclose(o1[0], out[b], atol=1e-6) and torch.allclose(l1[0], lse[b], atol=1e-6)
