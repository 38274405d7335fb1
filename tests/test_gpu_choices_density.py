"""On a GPU (marker ``gpu``): the pieces of this wave that touch device memory or kernels.
- ``KVPool.fork`` on CUDA pools, bf16 and FP8 (whose V is token-major): the child's copy of the
  partial page holds the parent's bytes; a write into it leaves the parent's as they were.
- An ``n`` group decoded with CUDA graphs: forked page tables replay through the graphs, greedy
  choices of one group stay identical, and the pool ends clean.
- The block density counted on the device with the Triton index stage equals a count made on
  the host from the captured indexes."""

from __future__ import annotations

import pytest
import torch

from decode_worker.engine import DecodeEngine
from kernels import ops
from kernels.config import SparseConfig
from kv_cache import KVPool, KVPoolConfig
from model_executor import ModelRunner, SamplingParams, build_tiny_model
from model_executor.loading import make_pool
from prefill_worker.engine import PrefillEngine, PrefillRequest

pytestmark = pytest.mark.gpu


def _prompt(seed, n):
    g = torch.Generator().manual_seed(seed)
    return [256] + torch.randint(0, 256, (n - 1,), generator=g).tolist()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_fork_copies_the_partial_page_on_cuda(dtype):
    pool = KVPool(KVPoolConfig(num_layers=3, num_kv_heads=4, head_dim=128, page_size=16, dtype=dtype,
                               num_pages=32, device="cuda"))
    g = torch.Generator(device="cuda").manual_seed(3)
    pool.reserve("p", 40)  # pages 0, 1 full, page 2 holds 8 tokens
    slots = pool.slot_mapping(["p"], [0], [40], device="cuda")
    for layer in range(3):
        k = torch.randn(40, 4, 128, device="cuda", generator=g)
        v = torch.randn(40, 4, 128, device="cuda", generator=g)
        pool.write(layer, slots, k.to(torch.bfloat16), v.to(torch.bfloat16))
    pool.set_seq_len("p", 40)
    parent = pool.pages("p")
    kids = pool.fork("p", ["a", "b"])
    for kid in kids:
        assert kid[:2] == parent[:2] and kid[2] != parent[2]
        for raw in (pool.k_raw, pool.v_raw):
            assert torch.equal(raw[:, kid[2]].view(torch.uint8), raw[:, parent[2]].view(torch.uint8))
    before = [raw[:, parent[2]].clone() for raw in (pool.k_raw, pool.v_raw)]
    slot = pool.slot_mapping(["a"], [40], [1], device="cuda")
    for layer in range(3):
        pool.write(layer, slot, torch.ones(1, 4, 128, device="cuda", dtype=torch.bfloat16),
                   -torch.ones(1, 4, 128, device="cuda", dtype=torch.bfloat16))
    torch.cuda.synchronize()
    for raw, old in zip((pool.k_raw, pool.v_raw), before):
        assert torch.equal(raw[:, parent[2]].view(torch.uint8), old.view(torch.uint8))
        assert not torch.equal(raw[:, kids[0][2]].view(torch.uint8), old.view(torch.uint8))
    for rid in ("p", "a", "b"):
        pool.release(rid)
    assert pool.used_pages == 0


@pytest.mark.parametrize("kv", ["bf16", "fp8"])
def test_a_group_decodes_through_cuda_graphs(kv):
    loaded = build_tiny_model(seed=0, dtype=torch.bfloat16, device="cuda")
    pool = make_pool(loaded, num_pages=128, page_size=16, device="cuda",
                     dtype=torch.float8_e4m3fn if kv == "fp8" else None)
    runner = ModelRunner(loaded.model, pool, SparseConfig(alpha=0.0), dense_below=0, device="cuda")
    if kv == "fp8":
        runner.calibrate_kv_scales()
    graphs = runner.enable_decode_graphs(max_seqlen=512, batch_sizes=(1, 2, 4, 8))  # both groups: 6 rows
    prefill, decode = PrefillEngine(runner), DecodeEngine(runner, max_running=8)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=12)
    seeded = tuple(SamplingParams(temperature=1.0, seed=s, max_new_tokens=12) for s in (1, 2, 3))
    for rid, choices in (("greedy", (greedy,) * 3), ("seeded", seeded)):
        (res,) = prefill.prefill([PrefillRequest(rid, _prompt(7, 45), choices[0], choices=choices)])
        decode.add_group(rid, res.kv_len, [(f"{rid}#{k}", t, p) for k, (t, p) in
                                           enumerate(zip(res.first_tokens, choices))])
    decode.run_until_done()
    outs = {rid: [decode.pop_finished(f"{rid}#{k}").output_ids for k in range(3)] for rid in ("greedy", "seeded")}
    assert outs["greedy"][0] == outs["greedy"][1] == outs["greedy"][2] and len(outs["greedy"][0]) == 12
    assert len({tuple(o) for o in outs["seeded"]}) > 1
    assert graphs.stats["graph_steps"] > 0
    assert pool.used_pages == 0


def test_block_density_counted_on_the_device(monkeypatch):
    loaded = build_tiny_model(seed=0, dtype=torch.bfloat16, device="cuda")
    pool = make_pool(loaded, num_pages=256, page_size=16, device="cuda")
    runner = ModelRunner(loaded.model, pool, SparseConfig(alpha=0.9, block_size=64, sink_tokens=64,
                                                          window_tokens=64), dense_below=0, device="cuda")
    seen = []
    real = ops.build_index_planned

    def spy(q, k_pages, v_pages, plan, **kw):
        index = real(q, k_pages, v_pages, plan, **kw)
        seen.append((plan, index))
        return index

    monkeypatch.setattr(ops, "build_index_planned", spy)
    engine = PrefillEngine(runner, max_batch_tokens=8192)
    res = engine.prefill([PrefillRequest("a", _prompt(1, 1500), SamplingParams(temperature=0.0)),
                          PrefillRequest("b", _prompt(2, 700), SamplingParams(temperature=0.0))])
    from model_executor.attention import causal_tile_pairs

    for b, r in enumerate(res):
        selected = causal = 0
        for plan, index in seen:
            offsets = index.seg_offsets.tolist()
            for h in range(plan.num_kv_heads):
                lo = h * plan.total_tiles + plan.cu_qtiles_host[b]
                selected += offsets[lo + plan.qtiles[b]] - offsets[lo]
            causal += plan.num_kv_heads * causal_tile_pairs(plan)[b]
        assert r.block_density == selected / causal
        assert 0.0 < r.block_density < 1.0
