"""FlashPrefill V2 operator on the H200: index stage + attention stage vs dense and sparse peers.

One row per case (batch, seqlen, target density) on structured synthetic inputs
(``kernels.synthetic.structured_qkv``: the paper's density for each length unless a target is
given), B x L tokens per batch, 32 query / 8 KV heads, d=128, bf16, 64-token pages:

- ``index_ms``: ``kernels.ops.build_index_planned(..., backend="triton")`` (the reference index
  when the Triton index stage is missing; then only short lengths are practical).
- ``attention_ms``: ``kernels.triton_attention.sparse_attention`` over that index (mean
  correction on); ``attention_nocorr_ms`` without correction; ``total_ms`` both stages in one
  call sequence; ``dense_triton_ms`` our ``dense=True`` path.
- Baselines in the same run: SDPA flash (FA2-class) and cuDNN (FA3-class) on K/V expanded to
  every query head (as ``shared/anchors/baselines.py``); FlexAttention on *exactly our selected
  pairs* (our CSR expanded into a ``BlockMask`` at 128 x 64, full blocks where all ``g`` PackGQA
  tiles of a 128-query block selected the tile, partial blocks with a ``mask_mod`` reading the
  selection, causal); FlashAttention-4 dense and block-sparse (``(128, 128)`` blocks, the union
  of our selection: a superset, its own density in ``fa4_density``) when ``flash_attn.cute``
  imports.
- Effective TFLOP/s over the selected work: ``4 d`` FLOPs per selected (query head, position,
  key) pair (``density`` x causal pairs); SDPA TFLOP/s over the causal pairs.

Correctness before timing: our output against the reference (``kernels.reference``, same index,
short lengths), otherwise against FlexAttention on the same pairs with correction off.

Usage (H200, ``PYTHONPATH=$PWD``): ``python3 benchmarks/bench_operator.py`` (about 5-8 minutes);
``--quick`` (32K and 128K, B=1); ``--lengths 32768,131072 --batch 1 --skip-baselines``;
``--fp8 --attention cutlass`` adds the CUTLASS FP8 rows (token-major V) beside Triton's. ``--tune`` sweeps num_warps / num_stages at 64K; ``--attention cutlass --merge`` times the
same operator with the CUTLASS attention stage (library via ``FLASHPREFILL_CUTLASS_LIB``) as
rows ``kernel="operator_cutlass"`` beside the Triton rows. Prints a table last; writes
``benchmarks/results/operator_h200.json``. ``--cpu-smoke`` (``TRITON_INTERPRET=1``, CI): L=256,
B=1, 4/1 heads, d=64 on the CPU, every step but the CUDA-only baselines' launches.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import json
import math
import os
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from evals.report import git_commit  # noqa: E402

from kernels import reference  # noqa: E402
from kernels.config import KV_TILE, Q_TILE, SparseConfig  # noqa: E402
from kernels.ops import build_index_planned, plan_prefill  # noqa: E402
from kernels.paged import contiguous_to_paged  # noqa: E402
from kernels import schedule  # noqa: E402
from kernels import triton_attention as ta  # noqa: E402

HQ, HKV, D = 32, 8, 128
LENGTHS = (4096, 8192, 16384, 32768, 65536, 131072)
SWEEP_LENGTH = 65536
SWEEP_DENSITIES = (0.05, 0.10, 0.25, 0.50, 1.0)


@dataclasses.dataclass(frozen=True)
class BenchConfig:
    lengths: tuple[int, ...] = LENGTHS
    batches: tuple[int, ...] = (1, 4)
    sweep: bool = True
    baselines: bool = True
    # baselines are capped where they cost minutes of GPU time (see --full)
    sdpa_max_tokens_b4: int = 4 * 32768  # SDPA / our dense path at B>1 up to 32K
    flex_min_len: int = 16384  # FlexAttention (one compile per shape) at B=1, L >= this
    flex_batch1_only: bool = True
    fa4_min_len: int = 32768
    reference_check_max_tokens: int = 16384
    check_tol: float = 0.0625  # bf16 outputs: a few ulps at |out| in [2, 4)
    page_size: int = 64
    dtype: str = "bfloat16"
    seed: int = 0
    num_splits: int | None = None
    budget_ms: float = 300.0  # timing budget per measurement
    device: str = "cuda"
    fp8: bool = False  # also time the FP8 (e4m3) operator on the same inputs (two V layouts)
    attention: str = "triton"  # attention stage: "triton" or "cutlass" (rows kernel="operator_cutlass")
    cutlass_kernel: str | None = None  # CUTLASS variant (cutlass_build.KERNELS; None: the default)
    # the 8B model's attention shape; --cpu-smoke shrinks it so the Triton interpreter finishes
    num_qo_heads: int = HQ
    num_kv_heads: int = HKV
    head_dim: int = D


# ---------------------------------------------------------------------------------------------
# timing and environment
# ---------------------------------------------------------------------------------------------


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def bench_ms(fn, device, budget_ms: float) -> float:
    """Median milliseconds: ``triton.testing.do_bench`` for short calls, a few timed calls
    (no L2 flush, irrelevant at that length) for calls over 20 ms."""
    if device.type != "cuda":
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    est = start.elapsed_time(end)
    if est < 20.0:
        from triton.testing import do_bench

        return float(do_bench(fn, warmup=25, rep=max(50, int(budget_ms / 3)), return_mode="median"))
    times = [est]
    for _ in range(max(1, min(20, int(budget_ms / est)))):
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    times.sort()
    return float(times[len(times) // 2])


def _env(device) -> dict:
    import triton

    env = {
        "torch": torch.__version__,
        "triton": triton.__version__,
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": git_commit(),
    }
    try:
        import flash_attn  # noqa: F401

        env["flash_attn"] = getattr(flash_attn, "__version__", "?")
    except Exception:
        env["flash_attn"] = None
    return env


# ---------------------------------------------------------------------------------------------
# inputs, index, work accounting
# ---------------------------------------------------------------------------------------------
def make_inputs(length: int, batch: int, target: float | None, cfg: BenchConfig, device):
    dtype = getattr(torch, cfg.dtype)
    source = "structured"
    try:
        from kernels.synthetic import structured_qkv

        q, k, v = structured_qkv(length, batch=batch, num_qo_heads=cfg.num_qo_heads,
                                 num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, target_density=target, dtype=dtype, device=device,
                                 seed=cfg.seed)
    except ImportError:
        source = "gaussian"  # no structure: the index keeps almost everything or nothing
        g = torch.Generator(device=device).manual_seed(cfg.seed)
        hq, hkv, d = cfg.num_qo_heads, cfg.num_kv_heads, cfg.head_dim
        q = torch.randn(batch, length, hq, d, generator=g, device=device, dtype=dtype)
        k = torch.randn(batch, length, hkv, d, generator=g, device=device, dtype=dtype)
        v = torch.randn(batch, length, hkv, d, generator=g, device=device, dtype=dtype)
    return q, k, v, source


def paged_plan(q, k, v, config: SparseConfig, page_size: int):
    batch, length = q.shape[:2]
    k_pages, table = contiguous_to_paged(k, page_size)
    v_pages, _ = contiguous_to_paged(v, page_size)
    dev = q.device
    cu = torch.arange(0, (batch + 1) * length, length, dtype=torch.int32, device=dev)
    skv = torch.full((batch,), length, dtype=torch.int32, device=dev)
    qf = q.reshape(batch * length, *q.shape[2:])
    plan = plan_prefill(qf, k_pages, v_pages, table, cu, skv, config)
    return qf, k_pages, v_pages, plan


def index_builder(device):
    """(callable, backend name): the Triton index stage, or the reference when it is missing."""
    try:
        from kernels import triton_index  # noqa: F401

        return (lambda q, kp, vp, plan: build_index_planned(q, kp, vp, plan, backend="triton")), "triton"
    except ImportError:
        return (lambda q, kp, vp, plan: reference.build_index(q, kp, vp, plan)), "reference"


def entry_geometry(plan, index):
    """Per CSR entry: (segment, tile n, r0, rows, lo = pmin + P, Lkv, g) as int64 device tensors."""
    off = index.seg_offsets.long()
    counts = off[1:] - off[:-1]
    nnz = int(off[-1])
    dev = off.device
    seg = torch.repeat_interleave(torch.arange(plan.num_segments, device=dev), counts)
    n = index.kv_tiles[:nnz].long()
    t = seg % plan.total_tiles
    b = plan.tile_seq.long()[t]
    cu_q = plan.cu_seqlens_q.long()
    lq = cu_q[b + 1] - cu_q[b]
    lkv = plan.seqlens_kv_t.long()[b]
    g = plan.group_size
    r0 = (t - plan.cu_qtiles.long()[b]) * Q_TILE
    rows = torch.minimum(r0 + Q_TILE, g * lq) - r0
    lo = r0 // g + lkv - lq
    return seg, n, r0, rows, lo, lkv, lq


def selected_pairs(plan, index) -> int:
    """Visible (query head, position, key) pairs the index selects (density numerator)."""
    seg, n, r0, rows, lo, lkv, lq = entry_geometry(plan, index)
    g = plan.group_size
    start = n * KV_TILE
    end = torch.minimum(start + KV_TILE, lkv)
    full = end <= lo + 1
    total = int((rows[full] * (end - start)[full]).sum())
    diag = (~full).nonzero().flatten()
    for c in range(0, diag.numel(), 1 << 20):
        i = diag[c : c + (1 << 20)]
        r = r0[i, None] + torch.arange(Q_TILE, device=r0.device)[None, :]
        ok = r < (r0[i] + rows[i])[:, None]
        pos = r // g + (lkv[i] - lq[i])[:, None]
        vis = (torch.minimum(end[i, None], pos + 1) - start[i, None]).clamp(min=0)
        total += int((vis * ok).sum())
    return total


def causal_pairs(plan) -> int:
    return plan.num_qo_heads * sum(
        lq * (lkv - lq) + lq * (lq + 1) // 2 for lq, lkv in zip(plan.seqlens_q, plan.seqlens_kv))


def selection_tensor(plan, index, batch: int, length: int):
    """Bool ``[B, Hkv, tiles per sequence, 64-token tiles]``: our CSR as a dense selection."""
    seg, n, *_ = entry_geometry(plan, index)
    ntiles = plan.qtiles[0]
    nkv = -(-length // KV_TILE)
    sel = torch.zeros(plan.num_segments, nkv, dtype=torch.bool, device=seg.device)
    sel[seg, n] = True
    return sel.view(plan.num_kv_heads, batch, ntiles, nkv).permute(1, 0, 2, 3).contiguous()


# ---------------------------------------------------------------------------------------------
# baselines
# ---------------------------------------------------------------------------------------------

_FLEX = None


def flex_fn():
    global _FLEX
    if _FLEX is None:
        import torch._dynamo
        from torch.nn.attention.flex_attention import flex_attention

        torch._dynamo.config.cache_size_limit = 64
        torch._dynamo.config.accumulated_cache_size_limit = 512
        _FLEX = torch.compile(flex_attention, dynamic=False)
    return _FLEX


def flex_block_mask(sel, batch: int, length: int, g: int):
    """Our exact selection as a FlexAttention BlockMask at (128 queries, 64 keys)."""
    from torch.nn.attention.flex_attention import BlockMask

    if Q_TILE % g:
        raise ValueError(f"FlexAttention comparison needs g | 128, got g={g}")
    n_qb = -(-length // Q_TILE)
    nkv = sel.shape[-1]
    per_qb = sel.view(batch, sel.shape[1], n_qb, g, nkv)  # the g PackGQA tiles of one 128-query block
    any_, all_ = per_qb.any(3), per_qb.all(3)
    qb = torch.arange(n_qb, device=sel.device)
    kb = torch.arange(nkv, device=sel.device)
    fully_visible = (kb[None, :] * KV_TILE + KV_TILE - 1) <= (qb[:, None] * Q_TILE)
    full = (all_ & fully_visible).repeat_interleave(g, dim=1)
    part = (any_ & ~(all_ & fully_visible)).repeat_interleave(g, dim=1)

    def csr(m):
        cnt = m.sum(-1, dtype=torch.int32)
        idx = torch.argsort(m.to(torch.int8), dim=-1, descending=True, stable=True).to(torch.int32)
        return cnt.contiguous(), idx.contiguous()

    pc, pi = csr(part)
    fc, fi = csr(full)
    return BlockMask.from_kv_blocks(pc, pi, fc, fi, BLOCK_SIZE=(Q_TILE, KV_TILE),
                                    mask_mod=_selection_mask_mod(sel, g),
                                    seq_lengths=(length, length))


_MASK_MODS: dict = {}


def _selection_mask_mod(sel, g: int):
    """Causal and "selected by the tile of this (head, position)": one function object per
    selection shape, reading the current selection from a holder, so that the density sweep
    (same shape, new selection) reuses the compiled FlexAttention kernel."""
    key = (tuple(sel.shape), g)
    if key not in _MASK_MODS:
        holder = [sel]

        def mask_mod(b, h, q_idx, kv_idx):
            tile = (q_idx * g + h % g) // Q_TILE
            return (q_idx >= kv_idx) & holder[0][b, h // g, tile, kv_idx // KV_TILE]

        _MASK_MODS[key] = (holder, mask_mod)
    holder, mask_mod = _MASK_MODS[key]
    holder[0] = sel
    return mask_mod


def fa4_block_sparse(sel, batch: int, length: int, g: int):
    """FA4 block-sparse tensors at (128, 128): the union of our selection (a superset) with the
    diagonal blocks as mask blocks (``causal=True``); returns (tensors, FA4's own density)."""
    from flash_attn.cute.block_sparsity import BlockSparseTensorsTorch

    n_qb = -(-length // Q_TILE)
    nkv = sel.shape[-1]
    pad = (-nkv) % 2
    s = torch.nn.functional.pad(sel, (0, pad)) if pad else sel
    hkv = sel.shape[1]
    blk = s.view(batch, hkv, n_qb, g, -1, 2).any(-1).any(3)  # [B, Hkv, nQb, nKb128]
    kb = torch.arange(blk.shape[-1], device=sel.device)
    qb = torch.arange(n_qb, device=sel.device)
    blk = blk & (kb[None, :] <= qb[:, None])
    diag = (kb[None, :] == qb[:, None])
    part = (blk & diag).repeat_interleave(g, dim=1)
    full = (blk & ~diag).repeat_interleave(g, dim=1)

    def csr(m):
        cnt = m.sum(-1, dtype=torch.int32)
        idx = torch.argsort(m.to(torch.int8), dim=-1, descending=True, stable=True).to(torch.int32)
        return cnt.contiguous(), idx.contiguous()

    pc, pi = csr(part)
    fc, fi = csr(full)
    pairs = float(full.sum()) * Q_TILE * Q_TILE + float(part.sum()) * Q_TILE * (Q_TILE + 1) / 2
    dens = pairs / (hkv * g * batch * length * (length + 1) / 2)
    bst = BlockSparseTensorsTorch(mask_block_cnt=pc, mask_block_idx=pi, full_block_cnt=fc,
                                  full_block_idx=fi, block_size=(Q_TILE, Q_TILE))
    return bst, dens


def _fa4():
    try:
        from flash_attn.cute import flash_attn_func

        return flash_attn_func
    except Exception:
        return None


# ---------------------------------------------------------------------------------------------
# one case
# ---------------------------------------------------------------------------------------------


def run_case(length: int, batch: int, target: float | None, cfg: BenchConfig, device, env,
             dense_cache: dict) -> dict:
    """One row. ``dense_cache`` keeps the mask-independent timings (SDPA, our dense path, FA4
    dense) per (batch, length) so the density sweep does not re-time them."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    op_cfg = SparseConfig()
    kernel = "triton" if cfg.attention == "triton" else "operator_cutlass"
    row: dict = {"batch": batch, "seqlen": length, "dtype": cfg.dtype, "kernel": kernel,
                 "attention_backend": cfg.attention, "target_density": target, "gpu": env["gpu"], "date": env["date"],
                 "commit": env["commit"], "errors": {}}
    t0 = time.time()
    q, k, v, row["inputs"] = make_inputs(length, batch, target, cfg, device)
    qf, k_pages, v_pages, plan = paged_plan(q, k, v, op_cfg, cfg.page_size)
    plan_nc = dataclasses.replace(plan, config=dataclasses.replace(op_cfg, mean_correction=False))
    build, row["index_backend"] = index_builder(device)
    index = build(qf, k_pages, v_pages, plan)
    _sync(device)
    splits = cfg.num_splits if cfg.num_splits is not None else schedule.auto_num_splits(
        plan, schedule.num_sms(device.index if device.type == "cuda" else None))
    row["num_splits"] = splits

    sel_pairs = selected_pairs(plan, index)
    all_pairs = causal_pairs(plan)
    row["density"] = sel_pairs / all_pairs
    row["nnz_tiles"] = int(index.seg_offsets[-1])
    work_flop = 4.0 * plan.head_dim * sel_pairs
    dense_flop = 4.0 * plan.head_dim * all_pairs

    if cfg.attention == "cutlass":
        from kernels import cutlass_attention as ca
        from kernels import cutlass_build

        variant = cfg.cutlass_kernel or cutlass_build.DEFAULT_KERNEL
        row["cutlass_kernel"] = variant

        def attend(*args, **kw):
            return ca.sparse_attention(*args, kernel=variant, **kw)
    else:
        attend = ta.sparse_attention

    def attention(p=plan, idx=index):
        return attend(qf, k_pages, v_pages, p, idx, num_splits=splits)

    # correctness first
    out, lse = attention()
    ok = bool(torch.isfinite(out).all()) and bool(torch.isfinite(lse).all())
    row["finite"] = ok
    if batch * length <= cfg.reference_check_max_tokens:
        expect, _ = reference.sparse_attention(qf, k_pages, v_pages, plan, index)
        row["check"] = "reference"
        row["check_err"] = float((out.float() - expect.float()).abs().max())
    fp8_rows = []
    if cfg.fp8:
        try:
            fp8_rows = run_fp8(q, k, v, qf, plan, index, out, splits, cfg, device, row,
                               sel_pairs, all_pairs)
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            row["errors"]["fp8"] = repr(e)[:300]
    del out, lse

    g = plan.group_size
    want_flex = cfg.baselines and length >= cfg.flex_min_len and (batch == 1 or not cfg.flex_batch1_only)
    want_sdpa = cfg.baselines and (batch == 1 or batch * length <= cfg.sdpa_max_tokens_b4)
    want_fa4 = cfg.baselines and batch == 1 and length >= cfg.fa4_min_len and device.type == "cuda"

    # timings: ours
    row["index_ms"] = bench_ms(lambda: build(qf, k_pages, v_pages, plan), device, cfg.budget_ms)
    row["attention_ms"] = bench_ms(attention, device, cfg.budget_ms)
    row["attention_nocorr_ms"] = bench_ms(lambda: attention(plan_nc), device, cfg.budget_ms)
    row["total_ms"] = bench_ms(lambda: attention(plan, build(qf, k_pages, v_pages, plan)), device,
                               cfg.budget_ms)
    row["attention_tflops"] = work_flop / row["attention_ms"] / 1e9
    row["total_tflops"] = work_flop / row["total_ms"] / 1e9
    cached = dense_cache.get((batch, length))
    if cached is not None:
        row.update(cached)
        want_sdpa = False
    if want_sdpa:
        row["dense_triton_ms"] = bench_ms(
            lambda: ta.sparse_attention(qf, k_pages, v_pages, plan, None, dense=True), device,
            cfg.budget_ms)

    # SDPA on K/V expanded to every query head
    if want_sdpa and device.type == "cuda":
        qh = q.transpose(1, 2)
        kh = k.repeat_interleave(g, dim=2).transpose(1, 2)
        vh = v.repeat_interleave(g, dim=2).transpose(1, 2)
        for name, backend in (("sdpa_flash_ms", SDPBackend.FLASH_ATTENTION),
                              ("sdpa_cudnn_ms", SDPBackend.CUDNN_ATTENTION)):
            try:
                with sdpa_kernel([backend]):
                    row[name] = bench_ms(lambda: F.scaled_dot_product_attention(qh, kh, vh, is_causal=True),
                                         device, cfg.budget_ms)
                row[name.replace("_ms", "_tflops")] = dense_flop / row[name] / 1e9
            except Exception as e:  # noqa: BLE001
                row["errors"][name] = repr(e)[:300]
        del qh, kh, vh

    sel = None
    if want_flex or want_fa4:
        sel = selection_tensor(plan, index, batch, length)

    if want_flex and device.type != "cuda":  # the mask is built (a smoke run checks it), not run
        bm = flex_block_mask(sel, batch, length, g)
        row["flex_mask_sparsity"] = float(bm.sparsity())
        row["errors"]["flex"] = "skipped: needs CUDA"
        del bm

    # FlexAttention on exactly our pairs (no correction): also the correctness check at long L
    if want_flex and device.type == "cuda":
        try:
            flex = flex_fn()
            qt = q.transpose(1, 2).contiguous()
            kt = k.transpose(1, 2).contiguous()
            vt = v.transpose(1, 2).contiguous()
            bm = flex_block_mask(sel, batch, length, g)
            t1 = time.time()
            kernel_options = None
            try:
                of = flex(qt, kt, vt, block_mask=bm, enable_gqa=True)
            except Exception as e:  # noqa: BLE001  tile sizes not dividing the 128x64 mask blocks
                row["errors"]["flex_default_tiles"] = repr(e)[:200]
                kernel_options = {"BLOCK_M": Q_TILE, "BLOCK_N": KV_TILE}
                of = flex(qt, kt, vt, block_mask=bm, enable_gqa=True, kernel_options=kernel_options)
            torch.cuda.synchronize()
            row["flex_compile_s"] = time.time() - t1
            ours, _ = attention(plan_nc)
            diff = (of.transpose(1, 2).reshape(qf.shape).float() - ours.float()).abs().max()
            row.setdefault("check", "flex")
            row["flex_max_diff"] = float(diff)
            del ours, of
            row["flex_attention_ms"] = bench_ms(
                lambda: flex(qt, kt, vt, block_mask=bm, enable_gqa=True, kernel_options=kernel_options),
                device, cfg.budget_ms)
            row["flex_tflops"] = work_flop / row["flex_attention_ms"] / 1e9
            del qt, kt, vt, bm
        except Exception as e:  # noqa: BLE001
            row["errors"]["flex"] = repr(e)[:300]
            traceback.print_exc()

    # FlashAttention-4 (CuTe DSL) when installed
    fa4 = _fa4() if want_fa4 else None
    if fa4 is not None:
        try:
            if "fa4_dense_ms" not in row:
                row["fa4_dense_ms"] = bench_ms(lambda: fa4(q, k, v, causal=True), device, cfg.budget_ms)
            bst, row["fa4_density"] = fa4_block_sparse(sel, batch, length, g)
            row["fa4_sparse_ms"] = bench_ms(lambda: fa4(q, k, v, causal=True, block_sparse_tensors=bst),
                                            device, cfg.budget_ms)
            row["fa4_sparse_tflops"] = 4.0 * plan.head_dim * row["fa4_density"] * all_pairs / row["fa4_sparse_ms"] / 1e9
        except Exception as e:  # noqa: BLE001
            row["errors"]["fa4"] = repr(e)[:300]

    dense_keys = ("dense_triton_ms", "sdpa_flash_ms", "sdpa_flash_tflops", "sdpa_cudnn_ms",
                  "sdpa_cudnn_tflops", "fa4_dense_ms")
    if cached is None:
        dense_cache[(batch, length)] = {k: row[k] for k in dense_keys if k in row}
    err = row.get("check_err", row.get("flex_max_diff"))
    row["check_ok"] = row["finite"] and (err is None or err <= cfg.check_tol)
    for base in ("sdpa_flash_ms", "sdpa_cudnn_ms", "fa4_dense_ms"):
        if row.get(base):
            row["speedup_total_vs_" + base[:-3]] = row[base] / row["total_ms"]
    row["case_s"] = time.time() - t0
    for r in fp8_rows:
        for base in ("sdpa_flash_ms", "sdpa_cudnn_ms", "fa4_dense_ms"):
            if row.get(base):
                r["speedup_total_vs_" + base[:-3]] = row[base] / r["total_ms"]
        r["speedup_total_vs_bf16"] = row["total_ms"] / r["total_ms"]
        r["speedup_attention_vs_bf16"] = row["attention_ms"] / r["attention_ms"]
    del q, k, v, qf, k_pages, v_pages, index, sel
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return [row, *fp8_rows]


def run_fp8(q, k, v, qf, plan, index, out_bf16, splits, cfg: BenchConfig, device, base: dict,
            sel_pairs: int, all_pairs: int) -> list[dict]:
    """FP8 rows of one case: the same inputs quantized with per-(sequence, KV head) amax
    descales, the FP8 index and attention, V stored row-major (Triton transposes the fp8 PV
    operand in shared memory) and token-major (already K-major). Accuracy beside speed:
    relative L2 of the FP8 operator output against the bf16 operator's (each with its own
    index), and of the FP8 attention against bf16 attention on the *bf16* index."""
    from kernels import fp8
    from kernels.ops import plan_descales

    q8, qd = fp8.quantize_queries(qf, plan.cu_seqlens_q, plan.num_kv_heads)
    k8, kd = fp8.quantize_bshd(k, per="head")
    v8, vd = fp8.quantize_bshd(v, per="head")
    k8p, _ = contiguous_to_paged(k8, cfg.page_size)
    v8p, _ = contiguous_to_paged(v8, cfg.page_size)
    del k8, v8
    ds = plan_descales(q8, plan, qd, kd, vd)
    plan_nc = dataclasses.replace(plan, config=dataclasses.replace(plan.config, mean_correction=False))
    q_ms = bench_ms(lambda: fp8.quantize_per_tensor(qf), device, cfg.budget_ms)
    rel = lambda a, b: float((a.float() - b.float()).norm() / b.float().norm())  # noqa: E731
    rows = []
    # Triton with both V layouts; with --attention cutlass also the CUTLASS attention stage
    # (token-major V only: Hopper's fp8 wgmma takes V K-major)
    combos = [("row_major", "triton"), ("token_major", "triton")]
    if cfg.attention == "cutlass":
        from kernels import cutlass_attention as ca
        from kernels import cutlass_build

        variant = cfg.cutlass_kernel or cutlass_build.DEFAULT_KERNEL
        combos.append(("token_major", "operator_cutlass"))
    for layout, kernel in combos:
        vp = v8p if layout == "row_major" else v8p.permute(0, 2, 3, 1).contiguous().permute(0, 3, 1, 2)
        row = {k_: base[k_] for k_ in ("batch", "seqlen", "target_density", "gpu", "date", "commit",
                                       "inputs", "num_splits")}
        row.update({"dtype": "fp8_e4m3", "kernel": kernel, "v_layout": layout,
                    "descales": "per (sequence, KV head), amax", "errors": {}})
        if kernel == "operator_cutlass":
            row["cutlass_kernel"] = variant
            attend = functools.partial(ca.sparse_attention, kernel=variant)
        else:
            attend = ta.sparse_attention

        def build(vp=vp):
            return build_index_planned(q8, k8p, vp, plan, backend="triton", descales=ds)

        idx8 = build()
        row["density"] = selected_pairs(plan, idx8) / all_pairs

        def attention(p=plan, idx=idx8, vp=vp, attend=attend):
            return attend(q8, k8p, vp, p, idx, num_splits=splits, descales=ds)

        out8, lse8 = attention()
        same_index, _ = attention(idx=index)
        row["finite"] = bool(torch.isfinite(out8).all()) and bool(torch.isfinite(lse8).all())
        row["rel_l2_vs_bf16"] = rel(out8, out_bf16)
        row["attn_rel_l2_vs_bf16_same_index"] = rel(same_index, out_bf16)
        del out8, lse8, same_index
        row["index_ms"] = bench_ms(build, device, cfg.budget_ms)
        row["attention_ms"] = bench_ms(attention, device, cfg.budget_ms)
        row["attention_nocorr_ms"] = bench_ms(lambda: attention(plan_nc), device, cfg.budget_ms)
        row["total_ms"] = bench_ms(lambda: attention(idx=build()), device, cfg.budget_ms)
        row["quantize_q_ms"] = q_ms  # per forward in a serving stack (K/V arrive quantized)
        work_flop = 4.0 * plan.head_dim * row["density"] * all_pairs
        row["attention_tflops"] = work_flop / row["attention_ms"] / 1e9
        row["total_tflops"] = work_flop / row["total_ms"] / 1e9
        row["check"] = "bf16"
        row["check_err"] = row["rel_l2_vs_bf16"]
        row["check_ok"] = row["finite"] and row["attn_rel_l2_vs_bf16_same_index"] <= 5e-2
        rows.append(row)
        del idx8, vp
    return rows


# ---------------------------------------------------------------------------------------------
# tuning sweep, table, main
# ---------------------------------------------------------------------------------------------


def tune(cfg: BenchConfig, device) -> list[dict]:
    """num_warps x num_stages of the attention kernel at 64K, B=1 (paper density)."""
    q, k, v, _ = make_inputs(SWEEP_LENGTH, 1, None, cfg, device)
    qf, k_pages, v_pages, plan = paged_plan(q, k, v, SparseConfig(), cfg.page_size)
    build, _ = index_builder(device)
    index = build(qf, k_pages, v_pages, plan)
    rows = []
    for warps, stages in ((4, 2), (4, 3), (8, 2), (8, 3), (8, 4)):
        for dense in (False, True):
            try:
                ms = bench_ms(lambda: ta.sparse_attention(qf, k_pages, v_pages, plan, None if dense else index,
                                                          dense=dense, _num_warps=warps,
                                                          _num_stages=stages), device, cfg.budget_ms)
            except Exception as e:  # noqa: BLE001
                ms = repr(e)[:120]
            rows.append({"num_warps": warps, "num_stages": stages, "dense": dense, "ms": ms})
            print(rows[-1], flush=True)
    return rows


COLUMNS = [
    ("B", "batch", "{}"), ("L", "seqlen", "{}"), ("kernel", "kernel", "{}"), ("dtype", "dtype", "{}"),
    ("V", "v_layout", "{}"),
    ("dens", "density", "{:.3f}"),
    ("index", "index_ms", "{:.2f}"), ("attn", "attention_ms", "{:.2f}"),
    ("nocorr", "attention_nocorr_ms", "{:.2f}"), ("total", "total_ms", "{:.2f}"),
    ("TF/s", "attention_tflops", "{:.0f}"), ("dense", "dense_triton_ms", "{:.1f}"),
    ("flash", "sdpa_flash_ms", "{:.1f}"), ("cudnn", "sdpa_cudnn_ms", "{:.1f}"),
    ("flex", "flex_attention_ms", "{:.2f}"), ("fa4", "fa4_dense_ms", "{:.1f}"),
    ("fa4sp", "fa4_sparse_ms", "{:.2f}"), ("x flash", "speedup_total_vs_sdpa_flash", "{:.1f}"),
    ("x cudnn", "speedup_total_vs_sdpa_cudnn", "{:.1f}"), ("x bf16", "speedup_total_vs_bf16", "{:.2f}"),
    ("check", "check", "{}"),
    ("err", "check_err", "{:.3g}"), ("flexdiff", "flex_max_diff", "{:.3g}"), ("ok", "check_ok", "{}"),
    ("errors", "errors", "{}"),
]


def table(rows: list[dict], columns: list[tuple[str, str, str]] = COLUMNS) -> str:
    """Right-aligned text table of ``rows`` over ``columns`` (header, key, format)."""
    head = [c[0] for c in columns]
    body = []
    for r in rows:
        cells = []
        for _, key, fmt in columns:
            val = r.get(key)
            if isinstance(val, dict):
                val = ",".join(val) or None
            cells.append("-" if val is None else (fmt.format(val) if not isinstance(val, str) else val))
        body.append(cells)
    widths = [max(len(h), *(len(b[i]) for b in body)) if body else len(h) for i, h in enumerate(head)]
    lines = ["  ".join(h.rjust(w) for h, w in zip(head, widths))]
    lines += ["  ".join(c.rjust(w) for c, w in zip(b, widths)) for b in body]
    return "\n".join(lines)


def parse_args(argv=None) -> tuple[BenchConfig, argparse.Namespace]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="32K and 128K at B=1, no density sweep")
    ap.add_argument("--lengths", type=str, default=None, help="comma-separated sequence lengths")
    ap.add_argument("--batch", type=str, default=None, help="comma-separated batch sizes (default 1,4)")
    ap.add_argument("--densities", type=str, default=None,
                    help="comma-separated target densities of the 64K sweep ('' for none)")
    ap.add_argument("--no-sweep", action="store_true", help="skip the 64K density sweep")
    ap.add_argument("--skip-baselines", action="store_true", help="time only our operator")
    ap.add_argument("--full", action="store_true",
                    help="baselines at every batch and length (minutes of GPU time)")
    ap.add_argument("--splits", type=int, default=None, help="force num_splits")
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--attention", choices=("triton", "cutlass"), default="triton",
                    help="attention stage of 'ours' (cutlass: rows kernel=operator_cutlass; use with --merge)")
    ap.add_argument("--cutlass-kernel", default=None,
                    help="with --attention cutlass: the compiled variant (kernels.cutlass_build.KERNELS)")
    ap.add_argument("--tune", action="store_true", help="num_warps/num_stages sweep at 64K")
    ap.add_argument("--fp8", action="store_true",
                    help="also FP8 rows (dtype=fp8_e4m3, V row-major and token-major) per case")
    ap.add_argument("--merge", action="store_true",
                    help="keep rows of --out whose (kernel, dtype, v_layout, B, L, target) this run does not produce")
    ap.add_argument("--device", type=str, default="cuda",
                    help="'cpu' (with TRITON_INTERPRET=1 and tiny --lengths) smoke-tests the script")
    ap.add_argument("--cpu-smoke", action="store_true",
                    help="CI smoke run: --device cpu, L=256, B=1, 4/1 heads, d=64, no sweep (set TRITON_INTERPRET=1)")
    ap.add_argument("--out", type=str, default=str(ROOT / "benchmarks/results/operator_h200.json"))
    args = ap.parse_args(argv)
    if args.cpu_smoke:
        args.device = "cpu"
    if args.cutlass_kernel is not None:
        from kernels import cutlass_build

        if args.attention != "cutlass" or args.cutlass_kernel not in cutlass_build.KERNELS:
            ap.error(f"--cutlass-kernel: needs --attention cutlass and one of "
                     f"{tuple(cutlass_build.KERNELS)}, got {args.cutlass_kernel!r}")
    cfg = BenchConfig(device=args.device, page_size=args.page_size, num_splits=args.splits,
                      fp8=args.fp8, attention=args.attention, cutlass_kernel=args.cutlass_kernel)
    if args.quick:
        cfg = dataclasses.replace(cfg, lengths=(32768, 131072), batches=(1,), sweep=False)
    if args.cpu_smoke:  # every baseline's CPU part too (flex_min_len=0: the BlockMask is built)
        cfg = dataclasses.replace(cfg, lengths=(256,), batches=(1,), sweep=False, flex_min_len=0,
                                  num_qo_heads=4, num_kv_heads=1, head_dim=64)
    if args.lengths:
        cfg = dataclasses.replace(cfg, lengths=tuple(int(x) for x in args.lengths.split(",") if x))
    if args.batch:
        cfg = dataclasses.replace(cfg, batches=tuple(int(x) for x in args.batch.split(",") if x))
    if args.no_sweep:
        cfg = dataclasses.replace(cfg, sweep=False)
    if args.skip_baselines:
        cfg = dataclasses.replace(cfg, baselines=False)
    if args.full:
        cfg = dataclasses.replace(cfg, sdpa_max_tokens_b4=1 << 62, flex_min_len=0,
                                  flex_batch1_only=False)
    return cfg, args


def _row_key(r: dict) -> tuple:
    return (r.get("kernel", "triton"), r.get("dtype", "bfloat16"), r.get("v_layout"), r.get("batch"),
            r.get("seqlen"), r.get("target_density"))


def _previous_rows(path: Path) -> list[dict]:
    """Rows of an earlier run (its ``rows`` and ``kept_rows``), each tagged with its env."""
    try:
        old = json.loads(path.read_text())
    except (OSError, ValueError):
        return []
    env = old.get("env", {})
    out = []
    for r in old.get("rows", []) + old.get("kept_rows", []):
        r = dict(r)
        r.setdefault("env", env)
        out.append(r)
    return out


def main(argv=None) -> None:
    cfg, args = parse_args(argv)
    device = torch.device(cfg.device)
    env = _env(device)
    print(env, flush=True)
    densities = SWEEP_DENSITIES
    if args.densities is not None:
        densities = tuple(float(x) for x in args.densities.split(",") if x)
    cases = [(n, b, None) for b in cfg.batches for n in cfg.lengths]
    if cfg.sweep and densities:
        cases += [(SWEEP_LENGTH, 1, dens) for dens in densities]
    rows = []
    result = {"env": env, "config": dataclasses.asdict(cfg), "rows": rows}
    out_path = Path(args.out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    t_start = time.time()
    if args.tune:
        result["tune"] = tune(cfg, device)
    dense_cache: dict = {}
    kept = _previous_rows(out_path) if args.merge else []
    for length, batch, target in cases:
        try:
            new = run_case(length, batch, target, cfg, device, env, dense_cache)
        except torch.cuda.OutOfMemoryError as e:
            new = [{"batch": batch, "seqlen": length, "target_density": target, "errors": {"oom": repr(e)[:300]}}]
            torch.cuda.empty_cache()
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            new = [{"batch": batch, "seqlen": length, "target_density": target, "errors": {"case": repr(e)[:300]}}]
        for row in new:
            rows.append(row)
            print({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()}, flush=True)
        out_path.write_text(json.dumps(result, indent=1))  # keep what we have if killed
    if kept:
        mine = {_row_key(r) for r in rows}
        result["kept_rows"] = [r for r in kept if _row_key(r) not in mine]
    result["wall_s"] = time.time() - t_start
    out_path.write_text(json.dumps(result, indent=1))
    print(f"\nwrote {out_path} ({result['wall_s']:.0f} s)")
    print(table(rows))


if __name__ == "__main__":
    main()
