"""Launch/variant sweep of the two Triton kernels on the H200 in one call (fits a short lease).

For each length (B=1, Hq=32, Hkv=8, d=128, bf16, page 64, structured inputs as in
``bench_operator.py``) it builds the index once, then times with ``do_bench`` (median):

- attention variants of ``kernels.triton_attention.sparse_attention`` (private knobs
  ``_pair`` = two CSR entries per 128-wide step, ``_num_stages``, ``_num_warps``), with and
  without mean correction; each checked against the default variant (max |diff| of out / lse)
  and, when ``kernels/_attn_baseline.py`` exists (an untracked copy of an older kernel, for a
  same-run before/after), that copy too;
- the correction prepass alone (bf16 means cast + selected-block bitmask);
- at the largest length, ``IndexLaunch`` variants of the index select stage (CSR checked
  identical to the default launch's).

Usage (H200): ``PYTHONPATH=$PWD python3 benchmarks/tune_kernels.py [--lengths 32768,65536,131072]
[--json $OUT/tune.json] [--deadline-s 200]``. Prints a table last. ``--cpu-smoke``
(``TRITON_INTERPRET=1``, CI): L=256 at 4/1 heads, d=64, one call per timing; pick variants with
``--variants`` / ``--index-variants`` to keep it short.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import sys
import time
from pathlib import Path

import torch
import triton

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from kernels import schedule  # noqa: E402
from kernels import triton_attention as ta  # noqa: E402
from kernels import triton_index as ti  # noqa: E402
from kernels.config import SparseConfig  # noqa: E402

import bench_operator as bo  # noqa: E402

ATTN_VARIANTS = [
    # name, kwargs (the first is the reference of the diff column)
    ("default", {}),
    ("corr128", dict(_corr_blocks=128)),
    ("nopair", dict(_pair=False)),
    ("pair s2", dict(_pair=True, _num_stages=2)),
    ("nopair s4", dict(_pair=False, _num_stages=4)),
]
INDEX_VARIANTS = [
    ("default", ti.IndexLaunch()),
    ("pps2", ti.IndexLaunch(programs_per_sm=2)),
    ("pps4 maxnreg128", ti.IndexLaunch(score_maxnreg=128, programs_per_sm=4)),
    ("s3 pps2", ti.IndexLaunch(score_stages=3, programs_per_sm=2)),
    ("s3 pps3", ti.IndexLaunch(score_stages=3, programs_per_sm=3)),
    ("bn128 w8 r128 pps2", ti.IndexLaunch(block_n=128, score_warps=8, score_maxnreg=128, programs_per_sm=2)),
    ("bn64 w8 pps2", ti.IndexLaunch(block_n=64, score_warps=8, programs_per_sm=2)),
]


def ms(fn, device=None) -> float:
    if device is not None and device.type != "cuda":  # a smoke run checks plumbing, not speed
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))


def diff(a, b) -> float:
    return float((a.float() - b.float()).abs().max())


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", default="32768,65536,131072")
    ap.add_argument("--json", default=None)
    ap.add_argument("--deadline-s", type=float, default=1e9, help="skip what starts after this")
    ap.add_argument("--no-index", action="store_true")
    ap.add_argument("--flex", default="", help="comma-separated lengths at which to time FlexAttention")
    ap.add_argument("--variants", default=None, help="comma-separated attention variant names")
    ap.add_argument("--index-variants", default=None, help="comma-separated index launch variant names")
    ap.add_argument("--cpu-smoke", action="store_true",
                    help="CI: CPU, 4/1 heads, d=64 (set TRITON_INTERPRET=1 and a short --lengths)")
    args = ap.parse_args(argv)
    names = {v[0] for v in ATTN_VARIANTS} | {v[0] for v in INDEX_VARIANTS}
    for opt in (args.variants, args.index_variants):
        unknown = sorted(set((opt or "").split(",")) - names - {""})
        if unknown:
            ap.error(f"--variants/--index-variants: unknown {unknown}, expected names from {sorted(names)}")
    t_start = time.time()
    dev = torch.device("cpu" if args.cpu_smoke else "cuda")
    cfg = bo.BenchConfig(device=dev.type)
    if args.cpu_smoke:
        cfg = dataclasses.replace(cfg, num_qo_heads=4, num_kv_heads=1, head_dim=64)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    timed = lambda fn: ms(fn, dev)  # noqa: E731
    try:
        base = importlib.import_module("kernels._attn_baseline")
    except ImportError:
        base = None
    variants = ATTN_VARIANTS
    if args.variants:
        keep = set(args.variants.split(","))
        variants = [v for v in ATTN_VARIANTS if v[0] in keep or v[0] == "default"]
    index_variants = INDEX_VARIANTS
    if args.index_variants:
        keep = set(args.index_variants.split(","))
        index_variants = [v for v in INDEX_VARIANTS if v[0] in keep or v[0] == "default"]
    rows: list[dict] = []
    lengths = [int(x) for x in args.lengths.split(",") if x]

    def dump():
        if args.json:
            Path(args.json).write_text(json.dumps(rows, indent=1))

    for length in lengths:
        q, k, v, _ = bo.make_inputs(length, 1, None, cfg, dev)
        qf, kp, vp, plan = bo.paged_plan(q, k, v, SparseConfig(), cfg.page_size)
        del q, k, v
        plan_nc = dataclasses.replace(plan, config=dataclasses.replace(plan.config, mean_correction=False))
        index = ti.build_index(qf, kp, vp, plan)
        sync()
        dens = bo.selected_pairs(plan, index) / bo.causal_pairs(plan)
        work = 4.0 * plan.head_dim * dens * bo.causal_pairs(plan)
        print(f"L={length}: density {dens:.4f}, nnz {index.nnz}, t={time.time() - t_start:.0f}s", flush=True)
        ref = {}
        for corr, p in ((True, plan), (False, plan_nc)):
            ref[corr] = ta.sparse_attention(qf, kp, vp, p, index)
            if base is not None:
                o, l = base.sparse_attention(qf, kp, vp, p, index)
                t = timed(lambda: base.sparse_attention(qf, kp, vp, p, index))
                rows.append(dict(kind="attn", L=length, variant="BASELINE(old)", corr=corr, ms=t,
                                 tflops=work / t / 1e9, d_out=diff(o, ref[corr][0]),
                                 d_lse=diff(l, ref[corr][1])))
                print(rows[-1], flush=True)
                del o, l
        for name, kw in variants:
            for corr, p in ((True, plan), (False, plan_nc)):
                if time.time() - t_start > args.deadline_s:
                    break
                try:
                    o, l = ta.sparse_attention(qf, kp, vp, p, index, **kw)
                    t = timed(lambda: ta.sparse_attention(qf, kp, vp, p, index, **kw))
                    rows.append(dict(kind="attn", L=length, variant=name, corr=corr, ms=t,
                                     tflops=work / t / 1e9, d_out=diff(o, ref[corr][0]),
                                     d_lse=diff(l, ref[corr][1]),
                                     finite=bool(torch.isfinite(o).all())))
                    del o, l
                except Exception as e:  # noqa: BLE001
                    rows.append(dict(kind="attn", L=length, variant=name, corr=corr, error=repr(e)[:200]))
                print(rows[-1], flush=True)
                dump()

        # the correction prepass alone (what sparse_attention adds before the launch)
        def prepass():
            kb = index.means.kbar.to(qf.dtype)
            vb = index.means.vbar.to(qf.dtype)
            words = max(1, triton.cdiv(plan.max_blocks, 64)) * 2
            bits = torch.zeros((plan.num_segments, words), dtype=torch.int32, device=dev)
            schedule.selected_blocks[(plan.num_segments,)](index.seg_offsets, index.kv_tiles, bits, words,
                                                            TPB=plan.config.tiles_per_block, BLOCK_E=128,
                                                            num_warps=4)
            return kb, vb, bits
        rows.append(dict(kind="prepass", L=length, variant="cast+bits", ms=timed(prepass)))
        print(rows[-1], flush=True)

        if str(length) in args.flex.split(",") and dev.type != "cuda":
            rows.append(dict(kind="flex", L=length, variant="flex", error="skipped: needs CUDA"))
        elif str(length) in args.flex.split(",") and time.time() - t_start < args.deadline_s:
            # FlexAttention on exactly our pairs (bench_operator's BlockMask), no correction
            try:
                g = plan.group_size
                sel = bo.selection_tensor(plan, index, 1, length)
                bm = bo.flex_block_mask(sel, 1, length, g)
                flex = bo.flex_fn()
                qt = qf.view(1, length, plan.num_qo_heads, plan.head_dim).transpose(1, 2).contiguous()
                kt = torch.empty(1, plan.num_kv_heads, length, plan.head_dim, dtype=qf.dtype, device=dev)
                vt = torch.empty_like(kt)
                # contiguous K/V from the pages (page table is the identity here)
                kt[0] = kp.reshape(-1, plan.num_kv_heads, plan.head_dim)[:length].transpose(0, 1)
                vt[0] = vp.reshape(-1, plan.num_kv_heads, plan.head_dim)[:length].transpose(0, 1)
                t1 = time.time()
                of = flex(qt, kt, vt, block_mask=bm, enable_gqa=True)
                torch.cuda.synchronize()
                d = diff(of.transpose(1, 2).reshape(length, plan.num_qo_heads, plan.head_dim), ref[False][0])
                t = timed(lambda: flex(qt, kt, vt, block_mask=bm, enable_gqa=True))
                rows.append(dict(kind="flex", L=length, variant="flex (our pairs)", corr=False, ms=t,
                                 tflops=work / t / 1e9, d_out=d, compile_s=time.time() - t1))
                del qt, kt, vt, of, bm, sel
            except Exception as e:  # noqa: BLE001
                rows.append(dict(kind="flex", L=length, variant="flex", error=repr(e)[:200]))
            print(rows[-1], flush=True)

        if not args.no_index and length == max(lengths):
            means, kbar_q = ti.block_means(kp, vp, plan, qf.dtype)
            cap = index.nnz
            want, _ = ti.select_and_compact(qf, plan, means, kbar_q, capacity=cap)
            rows.append(dict(kind="index", L=length, variant="means", ms=timed(
                lambda: ti.block_means(kp, vp, plan, qf.dtype))))
            for name, launch in index_variants:
                if time.time() - t_start > args.deadline_s:
                    break
                try:
                    got, _ = ti.select_and_compact(qf, plan, means, kbar_q, capacity=cap, launch=launch)
                    same = bool(torch.equal(got.seg_offsets, want.seg_offsets)
                                and torch.equal(got.kv_tiles, want.kv_tiles))
                    t = timed(lambda: ti.select_and_compact(qf, plan, means, kbar_q, capacity=cap, launch=launch))
                    rows.append(dict(kind="index", L=length, variant=name, ms=t, same_csr=same))
                except Exception as e:  # noqa: BLE001
                    rows.append(dict(kind="index", L=length, variant=name, error=repr(e)[:200]))
                print(rows[-1], flush=True)
                dump()
        del qf, kp, vp, index, ref
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    dump()
    gpu = torch.cuda.get_device_name() if dev.type == "cuda" else "cpu"
    print(f"\n{gpu}, torch {torch.__version__}, triton {triton.__version__}, "
          f"{time.time() - t_start:.0f}s")
    print(f"{'kind':7} {'L':>7} {'variant':22} {'corr':>5} {'ms':>8} {'TF/s':>6} {'d_out':>8} {'d_lse':>8} other")
    for r in rows:
        if "error" in r:
            print(f"{r['kind']:7} {r['L']:>7} {r['variant']:22} {str(r.get('corr', '')):>5} ERROR {r['error'][:80]}")
            continue
        tf = f"{r['tflops']:6.0f}" if "tflops" in r else f"{'':6}"
        do = f"{r['d_out']:8.2g}" if "d_out" in r else f"{'':8}"
        dl = f"{r['d_lse']:8.2g}" if "d_lse" in r else f"{'':8}"
        other = "" if "same_csr" not in r else f"same_csr={r['same_csr']}"
        print(f"{r['kind']:7} {r['L']:>7} {r['variant']:22} {str(r.get('corr', '')):>5} {r['ms']:8.3f} {tf} {do} {dl} {other}")


if __name__ == "__main__":
    main()
