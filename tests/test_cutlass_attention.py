"""CUTLASS attention stage (kernels/csrc/sparse_attn_fwd.cu) against the PyTorch reference, on
a GPU (``-m gpu``; skipped without CUDA or without the library).

Same cases and tolerances as tests/test_triton_attention.py (STYLE.md 5:
``max|out - ref| <= 2 max|out_lowprec - ref| + 1e-3``, lse within 1e-3), in bf16 and fp16,
with outputs and split partials poisoned with NaN first so that unwritten rows show. A failing
comparison prints where the bad rows are (tile, row in tile, head offset, diagonal or not) and
how the Triton kernel does on the same inputs, so that one run is enough to debug from.

Sanitizer (tiny shapes, one test):
``compute-sanitizer --tool memcheck python -m pytest tests/test_cutlass_attention.py -m gpu -k sanitizer -q``
(also ``--tool racecheck`` and ``--tool synccheck``).
"""

from __future__ import annotations


import pytest
import torch

from kernels import SparseConfig
from kernels import reference as ref
from kernels.config import KV_TILE, Q_TILE

ON_GPU = torch.cuda.is_available()


def _library_reason() -> str | None:
    if not ON_GPU:
        return "needs a CUDA GPU"
    from kernels import cutlass_build

    return cutlass_build.unavailable_reason()


_REASON = _library_reason()
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(_REASON is not None, reason=f"CUTLASS library: {_REASON}")]

from kernels import cutlass_attention as ca  # noqa: E402
from kernels import triton_attention as ta  # noqa: E402
from tests.helpers import poison_empty  # noqa: E402
from tests.test_triton_attention import (CASES, _case, _case_id,  # noqa: E402
                                         _lowprec_sparse_attention, _pruning_stats)

DEVICE = "cuda"


# ------------------------------------------------------------------------------------------
# helpers
# ------------------------------------------------------------------------------------------


_KERNEL = {"variant": None, "max_ctas": None}


@pytest.fixture(autouse=True, params=["ws128", "ws64", "ws128_pingpong", "ws128_persistent",
                                      "ws128_persistent/2", "ws128_persistent_nopingpong",
                                      "ws128_persistent_nopingpong/3"])
def kernel_variant(request):
    """Every test runs each compiled kernel variant (cutlass_build.KERNELS) through ``_run``;
    ``/2``, ``/3``: a persistent kernel on 2 or 3 CTAs, so each CTA walks many work units (its ring and
    Q barriers carried from unit to unit)."""
    name, _, ctas = request.param.partition("/")
    _KERNEL["variant"] = name
    _KERNEL["max_ctas"] = int(ctas) if ctas else None
    yield name
    _KERNEL["variant"] = _KERNEL["max_ctas"] = None


@pytest.fixture(autouse=True)
def _nan_outputs(monkeypatch):
    """Kernel outputs and split partials start as NaN: any element left unwritten shows."""
    poison_empty(monkeypatch, ca)


def _diagnose(out, expect, plan, tol, label):
    """Where the rows over ``tol`` are: printed on failure (pytest shows it with the assert)."""
    err = (out.float() - expect.float()).abs()
    err = torch.where(torch.isnan(err), torch.full_like(err, float("inf")), err)
    row_err = err.amax(-1)  # [Tq, Hq]
    bad = (row_err > tol).nonzero()
    lines = [f"{label}: {bad.shape[0]} of {row_err.numel()} (token, head) rows over tol {tol:.3g}; "
             f"NaN elements {int(torch.isnan(out.float()).sum())}"]
    if bad.shape[0] == 0:
        return "\n".join(lines)
    g = plan.group_size
    cu = plan.cu_seqlens_q_host
    info = {"tile": {}, "row_in_tile": {}, "head_off": {}, "diag": {}, "seq": {}, "kv_head": {}}
    for tok, head in bad[:4096].tolist():
        b = max(i for i in range(plan.batch_size) if cu[i] <= tok)
        pos = tok - cu[b]
        r = pos * g + head % g
        tile, rin = divmod(r, Q_TILE)
        prefix = plan.prefix(b)
        r0 = tile * Q_TILE
        lo = r0 // g + prefix
        diag_tiles = (pos + prefix) // KV_TILE - (lo + 1) // KV_TILE + 1
        for key, val in (("tile", tile), ("row_in_tile", rin // 16 * 16), ("head_off", head % g),
                         ("diag", diag_tiles), ("seq", b), ("kv_head", head // g)):
            info[key][val] = info[key].get(val, 0) + 1
    for key, hist in info.items():
        top = sorted(hist.items(), key=lambda kv: -kv[1])[:12]
        lines.append(f"  by {key}: {top}")
    tok, head = bad[0].tolist()
    lines.append(f"  first bad (token {tok}, head {head}): out {out[tok, head, :6].float().tolist()} "
                 f"ref {expect[tok, head, :6].float().tolist()}")
    return "\n".join(lines)


def _check_close(out, lse, batch, plan, index, label=""):
    """The Triton test's check, with a diagnosis on failure and Triton's error for scale."""
    q32 = batch.q.float()
    expect, expect_lse = ref.sparse_attention(q32, batch.k_pages.float(), batch.v_pages.float(),
                                              plan, index)
    assert out.dtype == batch.q.dtype and out.shape == batch.q.shape
    assert lse.dtype == torch.float32 and lse.shape == batch.q.shape[:2]
    low = _lowprec_sparse_attention(batch.q, batch.k_pages, batch.v_pages, plan, index)
    tol = 2 * (low.float() - expect).abs().max().item() + 1e-3
    err = (out.float() - expect).abs().nan_to_num(float("inf")).max().item()
    lse_err = (lse - expect_lse).abs().nan_to_num(float("inf")).max().item()
    if err > tol or lse_err > 1e-3:
        tri, tri_lse = ta.sparse_attention(batch.q, batch.k_pages, batch.v_pages, plan, index,
                                           num_splits=1)
        tri_err = (tri.float() - expect).abs().max().item()
        msg = _diagnose(out, expect, plan, tol, f"cutlass {label}")
        lse_bad = ((lse - expect_lse).abs().nan_to_num(float("inf")) > 1e-3).sum().item()
        pytest.fail(f"max|out - ref| = {err:.3g} (tol {tol:.3g}), max|lse - ref| = {lse_err:.3g} "
                    f"({lse_bad} rows); triton on the same inputs: {tri_err:.3g}\n{msg}")
    print(f"{label}: max|out - ref| {err:.3g} (tol {tol:.3g}), max|lse - ref| {lse_err:.3g}")


def _run(batch, plan, index, **kw):
    out, lse = ca.sparse_attention(batch.q, batch.k_pages, batch.v_pages, plan, index,
                                   kernel=_KERNEL["variant"], max_ctas=_KERNEL["max_ctas"], **kw)
    torch.cuda.synchronize()  # a kernel fault surfaces here, in the test that caused it
    return out, lse


# ------------------------------------------------------------------------------------------
# first: the smallest cases (a crash here explains the rest)
# ------------------------------------------------------------------------------------------


def test_kernel_attributes_no_spill(kernel_variant):
    from kernels import cutlass_build

    threads = 384
    for dtype, d in (("bfloat16", 64), ("bfloat16", 128), ("float16", 64), ("float16", 128),
                     ("float8_e4m3fn", 128)):
        attrs = cutlass_build.kernel_attributes(dtype, d, kernel_variant)
        print(f"{kernel_variant} fwd<{dtype}, d{d}>: {attrs}")
        assert attrs["local_bytes"] == 0
        assert attrs["max_threads"] >= threads  # launchable with its threads at this smem
        assert attrs["shared_bytes"] <= 227 * 1024


@pytest.mark.parametrize("dense", [True, False])
def test_smoke_single_tile(dense):
    """One sequence of 40 tokens, g=2: one 80-row query tile, one K/V tile, no prefix."""
    cfg = SparseConfig(alpha=0.1, block_size=64, sink_tokens=64, window_tokens=64)
    batch, plan = _case([40], [0], hq=2, hkv=1, d=128, page_size=64, cfg=cfg, device=DEVICE)
    index = ref.build_index(batch.q, batch.k_pages, batch.v_pages, plan)
    out, lse = _run(batch, plan, None if dense else index, num_splits=1, dense=dense)
    if dense:
        expect, expect_lse = ref.dense_attention(batch.q.float(), batch.k_pages.float(),
                                                 batch.v_pages.float(), plan)
        err = (out.float() - expect).abs().nan_to_num(float("inf")).max().item()
        print(f"dense smoke: max err {err:.3g}, lse err "
              f"{(lse - expect_lse).abs().nan_to_num(float('inf')).max().item():.3g}")
        assert err <= 2e-2, _diagnose(out, expect, plan, 2e-2, "dense smoke")
        assert (lse - expect_lse).abs().max().item() <= 1e-3
    else:
        _check_close(out, lse, batch, plan, index, "sparse smoke")


# ------------------------------------------------------------------------------------------
# against the reference: the Triton test's cases, bf16 and fp16
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_matches_reference(case, dtype):
    seqlens_q, prefixes, hq, hkv, d, page_size, block_size, corr, sink_window = case
    cfg = SparseConfig(alpha=0.1, block_size=block_size, sink_tokens=sink_window,
                       window_tokens=sink_window, mean_correction=corr)
    batch, plan = _case(seqlens_q, prefixes, hq=hq, hkv=hkv, d=d, page_size=page_size, cfg=cfg,
                        dtype=dtype, needles=1, device=DEVICE)
    index = ref.build_index(batch.q, batch.k_pages, batch.v_pages, plan)
    pruned, corrected = _pruning_stats(plan, index)
    assert pruned > 0 and corrected > 0, "inputs must make the index prune and correct"
    out, lse = _run(batch, plan, index, num_splits=1)
    _check_close(out, lse, batch, plan, index, _case_id(case))


# GQA 8 over several KV heads, page sizes 1/16/64/128, d 64/128, prefixes
MORE = [
    ([517, 64], [0, 300], 16, 2, 128, 128, 128, True, 128),
    ([300, 2, 129], [77, 0, 500], 32, 4, 64, 16, 64, True, 64),
    ([250], [390], 8, 2, 128, 1, 128, True, 0),
    ([1, 1], [0, 700], 8, 1, 128, 64, 128, True, 0),  # single-token queries, one long prefix
]


@pytest.mark.parametrize("case", MORE, ids=_case_id)
def test_more_shapes(case):
    seqlens_q, prefixes, hq, hkv, d, page_size, block_size, corr, sink_window = case
    cfg = SparseConfig(alpha=0.1, block_size=block_size, sink_tokens=sink_window,
                       window_tokens=sink_window, mean_correction=corr)
    batch, plan = _case(seqlens_q, prefixes, hq=hq, hkv=hkv, d=d, page_size=page_size, cfg=cfg,
                        needles=2, device=DEVICE)
    index = ref.build_index(batch.q, batch.k_pages, batch.v_pages, plan)
    out, lse = _run(batch, plan, index, num_splits=1)
    _check_close(out, lse, batch, plan, index, _case_id(case))


# every K/V load path by page size (sparse_attn_fwd.cu, launch): cp.async row gathers (1, 4, 24:
# not a divisor of 64), TMA per page for whole tiles (8, 16, 32: a box of page_size rows) and
# per tile (64); each case also has partial last tiles (Lkv 433, 77, 251) on cp.async with
# zero fill, a varlen batch with prefixes, two KV heads, correction on (one split) and off (two)
PAGE_CASES = [(1, 128), (4, 64), (8, 64), (16, 128), (24, 128), (32, 128), (64, 128)]


@pytest.mark.parametrize("page_size,d", PAGE_CASES, ids=[f"ps{c[0]}-d{c[1]}" for c in PAGE_CASES])
def test_page_sizes(page_size, d):
    for corr, splits in ((True, 1), (False, 2)):
        cfg = SparseConfig(alpha=0.1, block_size=64, sink_tokens=64, window_tokens=64,
                           mean_correction=corr)
        batch, plan = _case([333, 77, 1], [100, 0, 250], hq=8, hkv=2, d=d, page_size=page_size,
                            cfg=cfg, needles=2, device=DEVICE)
        assert all(n % 64 for n in plan.seqlens_kv)  # every sequence ends in a partial tile
        index = ref.build_index(batch.q, batch.k_pages, batch.v_pages, plan)
        pruned, corrected = _pruning_stats(plan, index)
        assert pruned > 0 and corrected > 0, "inputs must make the index prune and correct"
        out, lse = _run(batch, plan, index, num_splits=splits)
        _check_close(out, lse, batch, plan, index, f"ps{page_size} d{d} corr{int(corr)}")


def test_correction_changes_the_output():
    base = dict(alpha=0.1, block_size=64, sink_tokens=64, window_tokens=64)
    outs = []
    for corr in (True, False):
        cfg = SparseConfig(mean_correction=corr, **base)
        batch, plan = _case([300], [100], hq=4, hkv=1, d=64, page_size=64, cfg=cfg,
                            dtype=torch.bfloat16, device=DEVICE)
        index = ref.build_index(batch.q, batch.k_pages, batch.v_pages, plan)
        outs.append(_run(batch, plan, index)[0])
    assert (outs[0].float() - outs[1].float()).abs().max().item() > 1e-2


@pytest.mark.parametrize("page_size,d", [(64, 128), (16, 64), (1, 128)])
def test_dense_flag_equals_dense(page_size, d):
    cfg = SparseConfig(block_size=128)
    batch, plan = _case([140, 1, 45], [60, 9, 0], hq=8, hkv=2, d=d, page_size=page_size,
                        cfg=cfg, dtype=torch.bfloat16, device=DEVICE)
    out, lse = _run(batch, plan, None, dense=True)
    dense, dense_lse = ref.dense_attention(batch.q.float(), batch.k_pages.float(),
                                           batch.v_pages.float(), plan)
    err = (out.float() - dense).abs().nan_to_num(float("inf")).max().item()
    assert err <= 2e-2, _diagnose(out, dense, plan, 2e-2, "dense")
    assert (lse - dense_lse).abs().max().item() <= 1e-3


@pytest.mark.parametrize("dense", [False, True])
def test_split_equals_unsplit(dense):
    cfg = SparseConfig(alpha=0.1, block_size=64, sink_tokens=64, window_tokens=64)
    batch, plan = _case([260, 5], [120, 0], hq=4, hkv=1, d=64, page_size=16, cfg=cfg,
                        dtype=torch.bfloat16, device=DEVICE)
    index = None if dense else ref.build_index(batch.q, batch.k_pages, batch.v_pages, plan)
    base, base_lse = _run(batch, plan, index, num_splits=1, dense=dense)
    for splits in (2, 3, 7):  # 7 > some segments' tile counts: empty splits
        out, lse = _run(batch, plan, index, num_splits=splits, dense=dense)
        diff = (out.float() - base.float()).abs().nan_to_num(float("inf")).max().item()
        # unsplit rounds once to bf16; split rounds the fp32 merge: one bf16 ulp at |out| < 4
        assert diff <= 2 ** -6, f"splits={splits}: {diff:.3g}\n" + _diagnose(out, base, plan, 2 ** -6, f"split {splits}")
        assert (lse - base_lse).abs().max().item() <= 1e-4, f"splits={splits}"
    if not dense:
        _check_close(base, base_lse, batch, plan, index, "split base")


def test_config_num_splits_is_used():
    cfg = SparseConfig(alpha=0.1, block_size=64, sink_tokens=64, window_tokens=64, num_splits=3)
    batch, plan = _case([200], [50], hq=4, hkv=1, d=128, page_size=64, cfg=cfg, device=DEVICE)
    index = ref.build_index(batch.q, batch.k_pages, batch.v_pages, plan)
    out, lse = _run(batch, plan, index)
    _check_close(out, lse, batch, plan, index, "config splits")


def test_empty_batch():
    cfg = SparseConfig()
    batch, plan = _case([0, 0], [5, 0], hq=4, hkv=2, d=64, page_size=16, cfg=cfg, needles=0,
                        device=DEVICE)
    index = ref.build_index(batch.q, batch.k_pages, batch.v_pages, plan)
    for dense in (False, True):
        out, lse = _run(batch, plan, index, dense=dense)
        assert out.shape == (0, 4, 64) and lse.shape == (0, 4)


def test_zero_length_sequences_among_others():
    cfg = SparseConfig(alpha=0.1, block_size=64, sink_tokens=64, window_tokens=64)
    batch, plan = _case([0, 150, 0], [70, 90, 0], hq=4, hkv=1, d=64, page_size=16, cfg=cfg,
                        device=DEVICE)
    index = ref.build_index(batch.q, batch.k_pages, batch.v_pages, plan)
    out, lse = _run(batch, plan, index)
    _check_close(out, lse, batch, plan, index, "zero-length among others")


@pytest.mark.parametrize("length,page_size,corr", [
    (32768, 64, True), (8192, 16, True), (8192, 128, False), (3001, 1, True),
])
def test_long_against_reference(length, page_size, corr):
    cfg = SparseConfig(alpha=0.1, block_size=128, sink_tokens=256, window_tokens=512,
                       mean_correction=corr)
    batch, plan = _case([length, 333], [0, 1000], hq=8, hkv=2, d=128, page_size=page_size,
                        cfg=cfg, dtype=torch.bfloat16, device=DEVICE, needles=length // 512)
    index = ref.build_index(batch.q, batch.k_pages, batch.v_pages, plan)
    out, lse = _run(batch, plan, index)  # automatic splits
    assert torch.isfinite(out).all()
    _check_close(out, lse, batch, plan, index, f"L={length} ps={page_size}")


def test_no_host_sync_and_dense_splits_agree(kernel_variant):
    cfg = SparseConfig(alpha=0.1, block_size=128, sink_tokens=256, window_tokens=512)
    batch, plan = _case([4096, 100], [0, 3000], hq=32, hkv=8, d=128, page_size=64, cfg=cfg,
                        dtype=torch.bfloat16, device=DEVICE, needles=8)
    index = ref.build_index(batch.q, batch.k_pages, batch.v_pages, plan)
    args = (batch.q, batch.k_pages, batch.v_pages, plan, index)
    args_kw = dict(kernel=kernel_variant, max_ctas=_KERNEL["max_ctas"])
    ca.sparse_attention(*args, **args_kw)  # load the library, compile the prepass
    ca.sparse_attention(*args, **args_kw, num_splits=4)
    ca.sparse_attention(*args, **args_kw, dense=True)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        base, base_lse = ca.sparse_attention(*args, **args_kw, num_splits=1)
        split, split_lse = ca.sparse_attention(*args, **args_kw, num_splits=4)
        dense, dense_lse = ca.sparse_attention(*args, **args_kw, dense=True)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert (split.float() - base.float()).abs().max().item() <= 2 ** -7 * 2
    assert (split_lse - base_lse).abs().max().item() <= 1e-4
    expect, expect_lse = ref.dense_attention(batch.q.float(), batch.k_pages.float(),
                                             batch.v_pages.float(), plan)
    assert (dense.float() - expect).abs().max().item() <= 2 ** -8 * 6 + 1e-3
    assert (dense_lse - expect_lse).abs().max().item() <= 1e-3


def test_dispatch_through_ops():
    from kernels.ops import attention_planned

    cfg = SparseConfig(alpha=0.1, block_size=64, sink_tokens=64, window_tokens=64)
    batch, plan = _case([100], [30], hq=4, hkv=1, d=64, page_size=64, cfg=cfg,
                        dtype=torch.bfloat16, device=DEVICE)
    index = ref.build_index(batch.q, batch.k_pages, batch.v_pages, plan)
    forced = attention_planned(batch.q, batch.k_pages, batch.v_pages, plan, index,
                               backend="cutlass")
    auto = attention_planned(batch.q, batch.k_pages, batch.v_pages, plan, index)
    assert torch.equal(forced[0], auto[0])  # auto picked cutlass: bitwise the same
    _check_close(*forced, batch, plan, index, "ops cutlass")
    # fp32 is not supported: forcing cutlass raises (auto falls back to Triton: CPU tests)
    q32 = batch.q.float()
    with pytest.raises(ValueError, match="q: the CUTLASS kernel supports bfloat16"):
        attention_planned(q32, batch.k_pages.float(), batch.v_pages.float(), plan, index,
                          backend="cutlass")


@pytest.mark.parametrize("kwargs,match", [
    (dict(index=None), "index"),
    (dict(num_splits=0), "num_splits"),
    (dict(num_splits=2.0), "num_splits"),
    (dict(num_splits=True), "num_splits"),
    (dict(kernel="ws256"), "kernel"),
    (dict(max_ctas=0), "max_ctas"),
    (dict(max_ctas=1.5), "max_ctas"),
])
def test_bad_arguments_raise(kwargs, match):
    cfg = SparseConfig()
    batch, plan = _case([10], [0], hq=2, hkv=1, d=64, page_size=16, cfg=cfg, needles=0,
                        device=DEVICE)
    index = ref.build_index(batch.q, batch.k_pages, batch.v_pages, plan)
    call = dict(index=index, kernel=_KERNEL["variant"], max_ctas=_KERNEL["max_ctas"])
    call.update(kwargs)
    idx = call.pop("index")
    with pytest.raises(ValueError, match=match):
        ca.sparse_attention(batch.q, batch.k_pages, batch.v_pages, plan, idx, **call)


# ------------------------------------------------------------------------------------------
# FP8 (e4m3, token-major V): the FP8 test's accuracy bar (tests/test_fp8.py: relative L2 of the
# output at most 5e-2 against the fp32 reference on the same dequantized inputs)
# ------------------------------------------------------------------------------------------


def _fp8_case(seqlens, prefixes, *, page_size, granularity="seq_head", corr=True, needles=3,
              seed=5, token_major=True, block_size=64, sink_window=64, hq=8, hkv=2):
    from tests.test_fp8 import _plan, fp8_batch

    batch = fp8_batch(seqlens, prefixes, hq=hq, hkv=hkv, d=128, page_size=page_size,
                      granularity=granularity, needles=needles, seed=seed, block_size=block_size,
                      token_major_v=token_major, device=DEVICE)
    cfg = SparseConfig(alpha=0.1, block_size=block_size, sink_tokens=sink_window,
                       window_tokens=sink_window, mean_correction=corr)
    plan, ds = _plan(batch, cfg)
    return batch, cfg, plan, ds


def _check_fp8(out, lse, batch, cfg, plan, index, corr, label):
    from kernels import ops
    from tests.test_fp8 import rel_l2

    plan32 = ops.plan_prefill(*batch.deq_args(), cfg)
    want, want_lse = ref.sparse_attention(batch.q_deq, batch.k_deq, batch.v_deq, plan32, index)
    assert out.dtype == torch.bfloat16 and out.shape == batch.q.shape
    assert torch.isfinite(out).all() and not torch.isnan(lse).any(), label
    err = rel_l2(out, want)
    lse_err = (lse - want_lse).abs().max().item()
    print(f"{label}: rel L2 {err:.3g}, max|lse - ref| {lse_err:.3g}")
    assert err <= 5e-2, f"{label}: rel L2 {err:.3g}\n" + _diagnose(out, want, plan, 0.1, label)
    # P's rounding never enters lse; e4m3 means in the scores and the fp8 wgmma's accumulator
    # move it by a few 1e-3 (as the Triton kernel on the H200)
    assert lse_err <= 1e-2, f"{label}: max|lse - ref| {lse_err:.3g}"


FP8_CASES = [  # (granularity, page_size, correction, splits): page 48 -> cp.async chunks
    ("seq_head", 64, True, 1),
    ("head", 16, True, 2),
    ("tensor", 128, False, 1),
    ("seq_head", 48, True, 3),
    ("seq_head", 64, True, None),
]


@pytest.mark.parametrize("granularity,page_size,corr,splits", FP8_CASES,
                         ids=[f"{c[0]}-ps{c[1]}-corr{int(c[2])}-s{c[3]}" for c in FP8_CASES])
def test_fp8_matches_reference(granularity, page_size, corr, splits):
    batch, cfg, plan, ds = _fp8_case([320, 100, 1], [0, 250, 40], page_size=page_size,
                                     granularity=granularity, corr=corr)
    index = ref.build_index(batch.q, batch.k_pages, batch.v_pages, plan, descales=ds)
    out, lse = _run(batch, plan, index, num_splits=splits, descales=ds)
    _check_fp8(out, lse, batch, cfg, plan, index, corr, f"fp8 {granularity} ps{page_size}")


def test_fp8_dense_flag():
    batch, cfg, plan, ds = _fp8_case([140, 1, 45], [60, 9, 0], page_size=16, corr=False)
    out, lse = _run(batch, plan, None, dense=True, descales=ds)
    from kernels import ops
    from tests.test_fp8 import rel_l2

    plan32 = ops.plan_prefill(*batch.deq_args(), cfg)
    want, want_lse = ref.dense_attention(batch.q_deq, batch.k_deq, batch.v_deq, plan32)
    assert rel_l2(out, want) <= 5e-2
    assert (lse - want_lse).abs().max().item() <= 1e-2


@pytest.mark.parametrize("page_size", [16, 32, 48, 64])
def test_fp8_page_sizes(page_size):
    """e4m3 by page size: K by TMA per page (16, 32) or per tile (64), V^T by cp.async below 64
    keys a page; 48: cp.async for both. Partial last tiles, varlen, correction on and off."""
    for corr, splits in ((True, 1), (False, 2)):
        batch, cfg, plan, ds = _fp8_case([333, 77, 1], [100, 0, 250], page_size=page_size,
                                         corr=corr)
        assert all(n % 64 for n in plan.seqlens_kv)
        index = ref.build_index(batch.q, batch.k_pages, batch.v_pages, plan, descales=ds)
        out, lse = _run(batch, plan, index, num_splits=splits, descales=ds)
        _check_fp8(out, lse, batch, cfg, plan, index, corr, f"fp8 ps{page_size} corr{int(corr)}")


@pytest.mark.parametrize("length,page_size", [(16384, 64), (4099, 16)])
def test_fp8_long_against_reference(length, page_size):
    batch, cfg, plan, ds = _fp8_case([length, 500], [0, 3000], page_size=page_size,
                                     needles=length // 512, seed=13, block_size=128,
                                     sink_window=256)
    index = ref.build_index(batch.q, batch.k_pages, batch.v_pages, plan, descales=ds)
    out, lse = _run(batch, plan, index, descales=ds)  # automatic splits
    _check_fp8(out, lse, batch, cfg, plan, index, True, f"fp8 L={length} ps={page_size}")


def test_fp8_dispatch_through_ops():
    """auto takes CUTLASS for token-major fp8 V (bitwise the forced call) and Triton for
    row-major V (bitwise Triton's); forcing CUTLASS on row-major V raises."""
    from kernels.ops import attention_planned

    batch, cfg, plan, ds = _fp8_case([200, 64], [0, 100], page_size=64, seed=9)
    index = ref.build_index(batch.q, batch.k_pages, batch.v_pages, plan, descales=ds)
    forced = attention_planned(batch.q, batch.k_pages, batch.v_pages, plan, index,
                               backend="cutlass", descales=ds)
    auto = attention_planned(batch.q, batch.k_pages, batch.v_pages, plan, index, descales=ds)
    assert torch.equal(forced[0], auto[0]) and torch.equal(forced[1], auto[1])
    _check_fp8(*forced, batch, cfg, plan, index, True, "ops fp8 cutlass")
    row_v = batch.v_pages.contiguous()  # the same values, row-major
    auto_row = attention_planned(batch.q, batch.k_pages, row_v, plan, index, descales=ds)
    tri = ta.sparse_attention(batch.q, batch.k_pages, row_v, plan, index, descales=ds)
    assert torch.equal(auto_row[0], tri[0])
    with pytest.raises(ValueError, match="v_pages: the CUTLASS kernel takes float8_e4m3fn V token-major"):
        attention_planned(batch.q, batch.k_pages, row_v, plan, index, backend="cutlass", descales=ds)
    with pytest.raises(ValueError, match="descales"):
        ca.sparse_attention(batch.q, batch.k_pages, batch.v_pages, plan, index)


# ------------------------------------------------------------------------------------------
# compute-sanitizer target: tiny shapes covering every code path (see the module docstring)
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("d,page_size", [(128, 64), (64, 16), (128, 1), (128, 8)])
def test_sanitizer_paths(d, page_size):
    cfg = SparseConfig(alpha=0.1, block_size=64, sink_tokens=64, window_tokens=64)
    batch, plan = _case([150, 1], [70, 30], hq=4, hkv=2, d=d, page_size=page_size, cfg=cfg,
                        dtype=torch.bfloat16, device=DEVICE, needles=1)
    index = ref.build_index(batch.q, batch.k_pages, batch.v_pages, plan)
    for kw in (dict(num_splits=1), dict(num_splits=2), dict(num_splits=1, dense=True)):
        out, lse = _run(batch, plan, None if kw.get("dense") else index, **kw)
        assert torch.isfinite(out).all() and not torch.isnan(lse).any(), kw


@pytest.mark.parametrize("page_size", [64, 16])
def test_sanitizer_paths_fp8(page_size):
    batch, cfg, plan, ds = _fp8_case([150, 1], [70, 30], page_size=page_size, needles=1, hq=4)
    index = ref.build_index(batch.q, batch.k_pages, batch.v_pages, plan, descales=ds)
    for kw in (dict(num_splits=1), dict(num_splits=2), dict(num_splits=1, dense=True)):
        out, lse = _run(batch, plan, None if kw.get("dense") else index, descales=ds, **kw)
        assert torch.isfinite(out).all() and not torch.isnan(lse).any(), kw
