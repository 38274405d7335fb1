"""What runs inside a prefill's attention range besides the kernels (docs/notes/attention_range_128k.md):
the plan-only tensors of the FP8 mean correction are built once per plan (one plan per forward,
shared by every layer), with the same bits as when each layer built them, and q reaches the index
and attention stages without a copy."""

import dataclasses

import pytest
import torch

from kernels import fp8, ops
from kernels import cutlass_attention as ca
from kernels.config import SparseConfig
from model_executor import ModelRunner, PrefillItem
from model_executor.loading import make_pool
from tests.test_fp8 import _plan, fp8_batch

CFG = SparseConfig(alpha=0.1, block_size=64, sink_tokens=64, window_tokens=64)


@pytest.fixture(scope="module")
def tiny():
    """The built-in tiny model with two layers, not four: "once per forward" against "once per
    layer" needs two layers, and the Triton interpreter runs every layer's kernels (tests/conftest.py's
    ``tiny`` otherwise)."""
    from model_executor.loading import build_tiny_model

    return build_tiny_model(seed=0, num_layers=2)


def _batch(seed):
    # a sequence with no new tokens between two others: its blocks still have rows
    return fp8_batch([70, 0, 33], [10, 200, 130], hq=4, hkv=2, d=32, page_size=16, granularity="seq_head",
                     seed=seed, block_size=64, device="cpu")


def test_block_seq_is_each_blocks_sequence_built_once():
    batch = _batch(seed=1)
    plan, _ = _plan(batch, CFG)
    want = [b for b, n in enumerate(plan.blocks) for _ in range(n)]  # from the host lists
    assert len(set(want)) == 3 and plan.block_seq.tolist() == want
    assert plan.block_seq.dtype == torch.int64 and plan.block_seq.device == plan.device
    assert plan.block_seq is plan.block_seq
    other = dataclasses.replace(plan, config=dataclasses.replace(CFG, mean_correction=False))
    assert other.block_seq is not plan.block_seq and torch.equal(other.block_seq, plan.block_seq)
    built = []
    assert plan.derived("k", lambda: built.append(1) or 7) == 7 and plan.derived("k", lambda: 8) == 7
    assert built == [1]
    assert other == dataclasses.replace(plan, config=other.config)  # the memo is not a field


def test_requantized_means_with_the_plans_block_seq_have_the_same_bits():
    batch = _batch(seed=2)
    plan, ds = _plan(batch, CFG)
    gen = torch.Generator().manual_seed(3)
    means = torch.randn(plan.total_blocks, 2, 32, generator=gen) * 4
    assert ds.k.shape == (3, 2) and not torch.equal(ds.k[0], ds.k[2])  # per-sequence descales
    for descale in (ds.k, ds.v):
        got = fp8.requantize_means(means, descale, plan.cu_blocks, block_seq=plan.block_seq)
        want = fp8.requantize_means(means, descale, plan.cu_blocks)
        assert got.dtype == fp8.FP8_DTYPE and torch.equal(got.view(torch.uint8), want.view(torch.uint8))
        assert torch.equal(fp8.block_descales(descale, plan.cu_blocks, plan.total_blocks, block_seq=plan.block_seq),
                           fp8.block_descales(descale, plan.cu_blocks, plan.total_blocks))
    cu_v, column = ca._aligned_block_columns(plan.cu_blocks, plan.total_blocks)
    cu_v2, column2 = ca._aligned_block_columns(plan.cu_blocks, plan.total_blocks, plan.block_seq)
    assert torch.equal(cu_v, cu_v2) and torch.equal(column, column2)


def _count_searchsorted(monkeypatch) -> list:
    calls = []
    real = torch.searchsorted

    def spy(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(torch, "searchsorted", spy)
    return calls


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_fp8_pool_prefill_builds_the_block_map_once_per_forward(tiny, monkeypatch, backend):
    """Before: every layer rebuilt each block's sequence (arange + searchsorted) twice."""
    if backend == "triton" and not ops.triton_available(torch.device("cpu")):
        pytest.skip("the Triton path needs TRITON_INTERPRET=1 on CPU")
    layers = tiny.model.config.num_hidden_layers
    assert layers >= 2
    pool = make_pool(tiny, num_pages=32, page_size=16, dtype=torch.float8_e4m3fn)
    runner = ModelRunner(tiny.model, pool, CFG, dense_below=0, backend=backend, fused_ops=False)
    runner.calibrate_kv_scales(list(range(1, 130)))
    prompt = torch.randint(0, 256, (200,), generator=torch.Generator().manual_seed(4)).tolist()
    runner.ensure_capacity("r", len(prompt))
    calls = _count_searchsorted(monkeypatch)
    runner.prefill([PrefillItem("r", prompt)])
    assert runner.last_state.layers_called == layers and runner.last_state.selected_tiles is not None
    assert len(calls) == 1


def test_cutlass_fp8_correction_operands_built_once_per_plan(monkeypatch):
    """The CUTLASS wrapper (its library faked, as test_cutlass_build does) called for two layers
    of one plan: the block map and the 64-aligned V-mean columns are built on the first only."""
    from kernels import cutlass_build as cb
    from kernels import reference as ref
    from kernels import schedule
    from tests.test_cutlass_build import _FakeLib, _FakePrepass

    batch = fp8_batch([150, 1], [70, 300], hq=8, hkv=2, d=128, page_size=16, granularity="head",
                      needles=1, seed=0, block_size=128, token_major_v=True, device="cpu")
    cfg = SparseConfig(alpha=0.1, block_size=128, sink_tokens=64, window_tokens=64)
    calls = _count_searchsorted(monkeypatch)
    plan, ds = _plan(batch, cfg)
    index = ref.build_index(batch.q, batch.k_pages, batch.v_pages, plan, descales=ds)  # builds the block map
    assert len(calls) == 1
    fake = _FakeLib()
    monkeypatch.setattr(ca, "check_inputs", lambda q, k, v: None)
    monkeypatch.setattr(cb, "load_library", lambda: fake)
    monkeypatch.setattr(schedule, "selected_blocks", _FakePrepass())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: type("S", (), {"cuda_stream": 0})())
    columns = []
    real_columns = ca._aligned_block_columns
    monkeypatch.setattr(ca, "_aligned_block_columns", lambda *a: columns.append(1) or real_columns(*a))
    for _ in range(2):
        ca.sparse_attention(batch.q, batch.k_pages, batch.v_pages, plan, index, num_splits=1, descales=ds)
    assert len(fake.calls) == 2 and columns == [1] and len(calls) == 1
    assert fake.calls[0]["cu_blocks_v"] == fake.calls[1]["cu_blocks_v"]  # the same tensor, not a rebuilt one


@pytest.mark.parametrize("kv_dtype", [None, torch.float8_e4m3fn], ids=["model_dtype_pool", "fp8_pool"])
def test_q_reaches_the_index_and_attention_without_a_copy(tiny, monkeypatch, kv_dtype):
    """With the model dtype's pool, the fused attention forward's RoPE output (RoPE + K/V write in
    one kernel, kernels.rope_kv) is the very tensor both stages read; with an FP8 pool, q's
    quantized copy (the q_quant range) is, and nothing else."""
    if not ops.triton_available(torch.device("cpu")):
        pytest.skip("the fused forward needs TRITON_INTERPRET=1 on CPU")
    from kernels import elementwise, fp8_gemm, rope_kv

    pool = make_pool(tiny, num_pages=32, page_size=16, dtype=kv_dtype)
    runner = ModelRunner(tiny.model, pool, CFG, dense_below=0, backend="triton", fused_ops=True)
    if kv_dtype is not None:
        runner.calibrate_kv_scales(list(range(1, 130)))
    made, seen = [], []

    def keep(fn, out_index=None):
        def wrapped(*a, **k):
            out = fn(*a, **k)
            made.append((out if out_index is None else out[out_index]).data_ptr())
            return out
        return wrapped

    def see(fn):
        def wrapped(q, *a, **k):
            seen.append(q.data_ptr())
            return fn(q, *a, **k)
        return wrapped

    monkeypatch.setattr(elementwise, "rotary", keep(elementwise.rotary))
    monkeypatch.setattr(fp8_gemm, "rotary_amax", keep(fp8_gemm.rotary_amax, 0))
    monkeypatch.setattr(fp8_gemm, "quantize_with_amax", keep(fp8_gemm.quantize_with_amax, 0))
    real_rope_kv = rope_kv.rope_kv_write

    def rope_kv_write(*a, **k):  # returns q, or (q, amax) with q_amax
        out = real_rope_kv(*a, **k)
        made.append((out[0] if isinstance(out, tuple) else out).data_ptr())
        return out

    monkeypatch.setattr(rope_kv, "rope_kv_write", rope_kv_write)
    monkeypatch.setattr(ops, "build_index_planned", see(ops.build_index_planned))
    monkeypatch.setattr(ops, "attention_planned", see(ops.attention_planned))
    prompt = torch.randint(0, 256, (200,), generator=torch.Generator().manual_seed(5)).tolist()
    runner.ensure_capacity("r", len(prompt))
    runner.prefill([PrefillItem("r", prompt)])
    layers = tiny.model.config.num_hidden_layers
    assert len(seen) == 2 * layers and set(seen) <= set(made)
