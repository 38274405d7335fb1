"""The measured block density a prefill reports (``PrefillResult.block_density``, the
service's ``usage.sparse_attention.density``): selected over causal (query tile, 64-key tile)
pairs, summed over sparse layers and KV heads. Checked against counts made here from the
indexes the layers built (captured around ``ops.build_index_planned``) with plain loops."""

from __future__ import annotations

import pytest
import torch

from kernels import ops
from kernels.config import KV_TILE, Q_TILE, SparseConfig
from model_executor import ModelRunner, SamplingParams
from model_executor.attention import causal_tile_pairs
from prefill_worker.engine import PrefillEngine, PrefillRequest
from router.offline import make_pool

SPARSE = SparseConfig(alpha=0.9, block_size=64, sink_tokens=64, window_tokens=64)
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=1)


def _prompts(lengths, seed):
    g = torch.Generator().manual_seed(seed)
    return [[256] + torch.randint(0, 256, (n - 1,), generator=g).tolist() for n in lengths]


def _brute_causal(seqlens_q, seqlens_kv, group):
    """Per sequence: (query tile, key tile) pairs with at least one causal (row, key) pair."""
    out = []
    for lq, lkv in zip(seqlens_q, seqlens_kv):
        prefix, rows = lkv - lq, group * lq
        n = 0
        for t in range(-(-rows // Q_TILE)):
            positions = {r // group + prefix for r in range(t * Q_TILE, min((t + 1) * Q_TILE, rows))}
            n += sum(1 for kt in range(-(-lkv // KV_TILE)) if any(kt * KV_TILE <= p for p in positions))
        out.append(n)
    return out


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 2), (4, 1)])
def test_causal_tile_pairs_equals_brute_force(heads, kv_heads):
    g = torch.Generator().manual_seed(heads * 10 + kv_heads)
    seqlens_q = [int(x) for x in torch.randint(1, 300, (3,), generator=g)]
    prefixes = [0, int(torch.randint(1, 200, (1,), generator=g)), 64]
    seqlens_kv = [q + p for q, p in zip(seqlens_q, prefixes)]
    page_size = 16
    pages = [-(-n // page_size) for n in seqlens_kv]
    table = torch.zeros(3, max(pages), dtype=torch.int32)
    start = 0
    for b, n in enumerate(pages):
        table[b, :n] = torch.arange(start, start + n)
        start += n
    cu = torch.tensor([0, *torch.tensor(seqlens_q).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.zeros(int(cu[-1]), heads, 64)
    k = torch.zeros(start, page_size, kv_heads, 64)
    plan = ops.plan_prefill(q, k, k, table, cu, torch.tensor(seqlens_kv, dtype=torch.int32), SparseConfig(alpha=0.5))
    assert causal_tile_pairs(plan) == _brute_causal(seqlens_q, seqlens_kv, heads // kv_heads)


def _capture(monkeypatch):
    seen = []
    real = ops.build_index_planned

    def spy(q, k_pages, v_pages, plan, **kw):
        index = real(q, k_pages, v_pages, plan, **kw)
        seen.append((plan, index))
        return index

    monkeypatch.setattr(ops, "build_index_planned", spy)
    return seen


def _expected(seen, rids_per_forward, rid):
    """selected / causal of ``rid`` over every captured layer, counted segment by segment."""
    selected = causal = 0
    for (plan, index), rids in zip(seen, rids_per_forward):
        if rid not in rids:
            continue
        b = rids.index(rid)
        offsets = index.seg_offsets.tolist()
        g = plan.group_size
        for h in range(plan.num_kv_heads):
            for t in range(plan.qtiles[b]):
                seg = h * plan.total_tiles + plan.cu_qtiles_host[b] + t
                selected += offsets[seg + 1] - offsets[seg]
        causal += plan.num_kv_heads * _brute_causal([plan.seqlens_q[b]], [plan.seqlens_kv[b]], g)[0]
    return selected / causal


def test_block_density_of_batched_and_chunked_prompts(tiny, monkeypatch):
    pool = make_pool(tiny, num_pages=128, page_size=16)
    runner = ModelRunner(tiny.model, pool, SPARSE, dense_below=0)
    engine = PrefillEngine(runner, max_batch_tokens=4096, chunk_size=192)
    seen = _capture(monkeypatch)
    prompts = _prompts([500, 260, 90], seed=3)
    rids = ["a", "b", "c"]
    forwards = []  # request ids of each forward's batch, one entry per layer call
    for rid, p in zip(rids, prompts):
        engine.add_request(PrefillRequest(rid, p, GREEDY))
    results = {}
    while engine.has_unfinished():
        before = len(seen)
        out = engine.step()
        forwards += [[c.request_id for c in out.chunks]] * (len(seen) - before)
        results.update({r.request_id: r for r in out.finished})
    layers = tiny.model.config.num_hidden_layers
    assert len(seen) == layers * engine.forward_batches
    for rid in rids:
        got = results[rid].block_density
        assert got is not None and 0.0 < got <= 1.0
        assert got == pytest.approx(_expected(seen, forwards, rid), rel=1e-12)
    # a long prompt under alpha 0.9 skips tiles: the count is not the causal total
    assert results["a"].block_density < 1.0


def test_dense_prompts_report_no_block_density(tiny):
    pool = make_pool(tiny, num_pages=64, page_size=16)
    runner = ModelRunner(tiny.model, pool, SPARSE, dense_below=10_000)  # every batch dense
    engine = PrefillEngine(runner, max_batch_tokens=4096)
    (res,) = engine.prefill([PrefillRequest("d", _prompts([300], seed=5)[0], GREEDY)])
    assert res.block_density is None
    runner = ModelRunner(tiny.model, make_pool(tiny, num_pages=64, page_size=16), SPARSE, dense_below=0)
    engine = PrefillEngine(runner, max_batch_tokens=4096)
    # a request at alpha 0 runs dense beside a sparse one: only the sparse one reports a density
    dense, sparse = engine.prefill([PrefillRequest("x", _prompts([300], seed=6)[0], GREEDY, sparse_alpha=0.0),
                                    PrefillRequest("y", _prompts([300], seed=7)[0], GREEDY)])
    assert dense.block_density is None
    assert sparse.block_density is not None and 0.0 < sparse.block_density <= 1.0
