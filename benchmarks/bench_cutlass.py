"""CUTLASS vs Triton attention stage on the H200, same plan and index (bench_operator's shape).

B=1, 32 query / 8 KV heads, d=128, bf16, 64-token pages, structured synthetic inputs
(``kernels.synthetic.structured_qkv`` at the paper's density for each length), index from the
Triton index stage. Per length:

- correctness first: at the first length (8K) both kernels against the reference on the same
  index (``check_err``, ``triton_check_err``); at every length ``max|cutlass - triton|``;
- ``attention_ms`` / ``attention_nocorr_ms``: ``kernels.cutlass_attention.sparse_attention`` with
  and without mean correction, ``triton_*`` the Triton kernel on the same inputs and splits;
- ``dense_ms`` / ``triton_dense_ms``: ``dense=True`` (every visible tile) up to 32K;
- effective TFLOP/s over the selected work (``4 d`` per selected (head, query, key) pair, as
  bench_operator), dense TFLOP/s over the causal pairs.

``--kernels ws128,ws64`` times each compiled variant (``cutlass_build.KERNELS``) on the same
inputs after checking it against the first; the row's main columns are the first variant's,
``by_kernel`` holds every variant's times (a second table).

Usage (H200, ``PYTHONPATH=$PWD``, ``FLASHPREFILL_CUTLASS_LIB`` pointing at a prebuilt library):
``python3 benchmarks/bench_cutlass.py`` (about 2 minutes). ``--cpu-smoke`` (``TRITON_INTERPRET=1``,
CI) runs everything but the CUTLASS launch at a tiny shape: inputs, plan, index, the Triton
kernel and the reference, the CUTLASS input checks (up to "needs a CUDA tensor"), the JSON. Prints a table last; adds rows with
``kernel="cutlass"`` to ``benchmarks/results/operator_h200.json`` (earlier cutlass rows of the same
case are replaced, every other row is kept; ``--out`` to write elsewhere).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_operator as bo  # noqa: E402
from kernels import cutlass_attention as ca  # noqa: E402
from kernels import cutlass_build  # noqa: E402
from kernels import reference  # noqa: E402
from kernels import schedule  # noqa: E402
from kernels import triton_attention as ta  # noqa: E402
from kernels.config import SparseConfig  # noqa: E402

LENGTHS = (8192, 32768, 131072)
DENSE_MAX = 32768


def run_length(length: int, cfg: bo.BenchConfig, device, env, check_reference: bool,
               kernels: tuple[str, ...] = (cutlass_build.DEFAULT_KERNEL,)) -> dict:
    op_cfg = SparseConfig()
    row: dict = {"batch": 1, "seqlen": length, "dtype": cfg.dtype, "kernel": "cutlass",
                 "target_density": None, "gpu": env["gpu"], "date": env["date"],
                 "commit": env["commit"], "errors": {}}
    t0 = time.time()
    on_gpu = device.type == "cuda"
    q, k, v, row["inputs"] = bo.make_inputs(length, 1, None, cfg, device)
    qf, k_pages, v_pages, plan = bo.paged_plan(q, k, v, op_cfg, cfg.page_size)
    plan_nc = dataclasses.replace(plan, config=dataclasses.replace(op_cfg, mean_correction=False))
    build, row["index_backend"] = bo.index_builder(device)
    index = build(qf, k_pages, v_pages, plan)
    splits = schedule.auto_num_splits(plan, schedule.num_sms(device.index))
    row["num_splits"] = splits
    sel_pairs = bo.selected_pairs(plan, index)
    all_pairs = bo.causal_pairs(plan)
    row["density"] = sel_pairs / all_pairs
    row["nnz_tiles"] = int(index.seg_offsets[-1])
    work_flop = 4.0 * plan.head_dim * sel_pairs
    dense_flop = 4.0 * plan.head_dim * all_pairs
    if not on_gpu:
        return _run_length_cpu(row, qf, k_pages, v_pages, plan, plan_nc, index, splits, cfg, device,
                               work_flop, t0)

    def ours(p=plan, dense=False, kernel=kernels[0]):
        return ca.sparse_attention(qf, k_pages, v_pages, p, None if dense else index,
                                   num_splits=splits, dense=dense, kernel=kernel)

    def triton(p=plan, dense=False):
        return ta.sparse_attention(qf, k_pages, v_pages, p, None if dense else index,
                                   num_splits=splits, dense=dense)

    # correctness before timing
    out, lse = ours()
    torch.cuda.synchronize()
    tri, tri_lse = triton()
    row["finite"] = bool(torch.isfinite(out).all()) and bool(torch.isfinite(lse).all())
    row["diff_vs_triton"] = float((out.float() - tri.float()).abs().max())
    row["lse_diff_vs_triton"] = float((lse - tri_lse).abs().max())
    if check_reference:
        expect, expect_lse = reference.sparse_attention(qf, k_pages, v_pages, plan, index)
        row["check"] = "reference"
        row["check_err"] = float((out.float() - expect.float()).abs().max())
        row["lse_err"] = float((lse - expect_lse).abs().max())
        row["triton_check_err"] = float((tri.float() - expect.float()).abs().max())
    err = row.get("check_err", row["diff_vs_triton"])
    row["check_ok"] = row["finite"] and err <= cfg.check_tol
    row["kernel_variant"] = kernels[0]
    for other in kernels[1:]:  # every variant must agree with the first before any timing
        o2, l2 = ours(kernel=other)
        d = float((o2.float() - out.float()).abs().max())
        row.setdefault("variant_diff", {})[other] = d
        row["check_ok"] = row["check_ok"] and bool(torch.isfinite(o2).all()) and d <= cfg.check_tol
        del o2, l2
    del out, lse, tri, tri_lse
    print(f"L={length}: density {row['density']:.3f}, splits {splits}, "
          f"check {row.get('check_err')}, vs triton {row['diff_vs_triton']:.3g}", flush=True)

    budget = cfg.budget_ms
    row["attention_ms"] = bo.bench_ms(ours, device, budget)
    row["attention_nocorr_ms"] = bo.bench_ms(lambda: ours(plan_nc), device, budget)
    row["triton_attention_ms"] = bo.bench_ms(triton, device, budget)
    row["triton_attention_nocorr_ms"] = bo.bench_ms(lambda: triton(plan_nc), device, budget)
    row["attention_tflops"] = work_flop / row["attention_ms"] / 1e9
    row["attention_nocorr_tflops"] = work_flop / row["attention_nocorr_ms"] / 1e9
    row["triton_attention_tflops"] = work_flop / row["triton_attention_ms"] / 1e9
    row["triton_attention_nocorr_tflops"] = work_flop / row["triton_attention_nocorr_ms"] / 1e9
    row["speedup_vs_triton"] = row["triton_attention_ms"] / row["attention_ms"]
    row["speedup_nocorr_vs_triton"] = row["triton_attention_nocorr_ms"] / row["attention_nocorr_ms"]
    if length <= DENSE_MAX:
        row["dense_ms"] = bo.bench_ms(lambda: ours(dense=True), device, budget)
        row["triton_dense_ms"] = bo.bench_ms(lambda: triton(dense=True), device, budget)
        row["dense_tflops"] = dense_flop / row["dense_ms"] / 1e9
        row["triton_dense_tflops"] = dense_flop / row["triton_dense_ms"] / 1e9
    by_kernel = {}
    for kern in kernels:  # the first is timed above; each variant's times side by side
        t = {"attention_ms": row["attention_ms"], "attention_nocorr_ms": row["attention_nocorr_ms"]}
        if kern != kernels[0]:
            t = {"attention_ms": bo.bench_ms(lambda: ours(kernel=kern), device, budget),
                 "attention_nocorr_ms": bo.bench_ms(lambda: ours(plan_nc, kernel=kern), device, budget)}
            if length <= DENSE_MAX:
                t["dense_ms"] = bo.bench_ms(lambda: ours(dense=True, kernel=kern), device, budget)
        elif "dense_ms" in row:
            t["dense_ms"] = row["dense_ms"]
        t["attention_tflops"] = work_flop / t["attention_ms"] / 1e9
        t["attention_nocorr_tflops"] = work_flop / t["attention_nocorr_ms"] / 1e9
        t["speedup_vs_triton"] = row["triton_attention_ms"] / t["attention_ms"]
        by_kernel[kern] = t
    row["by_kernel"] = by_kernel
    row["case_s"] = time.time() - t0
    del q, k, v, qf, k_pages, v_pages, index
    torch.cuda.empty_cache()
    return row


def _run_length_cpu(row, qf, k_pages, v_pages, plan, plan_nc, index, splits, cfg, device,
                    work_flop, t0) -> dict:
    """The row without the CUTLASS launch: its input checks must stop at the device alone (any
    other ValueError is a bug the GPU run would hit), the Triton kernel against the reference."""
    try:
        ca.check_inputs(qf, k_pages, v_pages)
    except ValueError as e:
        if "CUDA" not in str(e):
            raise
        row["errors"]["cutlass"] = f"skipped: {e}"[:200]
    else:
        raise RuntimeError("cutlass_attention.check_inputs accepted CPU tensors")

    def triton(p=plan, dense=False):
        return ta.sparse_attention(qf, k_pages, v_pages, p, None if dense else index,
                                   num_splits=splits, dense=dense)

    tri, tri_lse = triton()
    expect, expect_lse = reference.sparse_attention(qf, k_pages, v_pages, plan, index)
    row["finite"] = bool(torch.isfinite(tri).all()) and bool(torch.isfinite(tri_lse).all())
    row["check"] = "reference"
    row["triton_check_err"] = float((tri.float() - expect.float()).abs().max())
    row["check_ok"] = row["finite"] and row["triton_check_err"] <= cfg.check_tol
    row["triton_attention_ms"] = bo.bench_ms(triton, device, cfg.budget_ms)
    row["triton_attention_nocorr_ms"] = bo.bench_ms(lambda: triton(plan_nc), device, cfg.budget_ms)
    row["triton_dense_ms"] = bo.bench_ms(lambda: triton(dense=True), device, cfg.budget_ms)
    row["triton_attention_tflops"] = work_flop / row["triton_attention_ms"] / 1e9
    row["by_kernel"] = {}
    row["case_s"] = time.time() - t0
    return row


COLUMNS = [
    ("L", "seqlen", "{}"), ("dens", "density", "{:.3f}"), ("splits", "num_splits", "{}"),
    ("cut ms", "attention_ms", "{:.2f}"), ("tri ms", "triton_attention_ms", "{:.2f}"),
    ("x tri", "speedup_vs_triton", "{:.2f}"), ("cut TF", "attention_tflops", "{:.0f}"),
    ("tri TF", "triton_attention_tflops", "{:.0f}"),
    ("cut nc", "attention_nocorr_ms", "{:.2f}"), ("tri nc", "triton_attention_nocorr_ms", "{:.2f}"),
    ("nc TF", "attention_nocorr_tflops", "{:.0f}"),
    ("dense", "dense_ms", "{:.2f}"), ("tri dense", "triton_dense_ms", "{:.2f}"),
    ("dense TF", "dense_tflops", "{:.0f}"), ("err", "check_err", "{:.3g}"),
    ("tri err", "triton_check_err", "{:.3g}"), ("vs tri", "diff_vs_triton", "{:.3g}"),
    ("ok", "check_ok", "{}"), ("errors", "errors", "{}"),
]


VARIANT_COLUMNS = [
    ("L", "seqlen", "{}"), ("kernel", "kernel_variant", "{}"), ("ms", "attention_ms", "{:.2f}"),
    ("TF", "attention_tflops", "{:.0f}"), ("nc ms", "attention_nocorr_ms", "{:.2f}"),
    ("nc TF", "attention_nocorr_tflops", "{:.0f}"), ("dense ms", "dense_ms", "{:.2f}"),
    ("x tri", "speedup_vs_triton", "{:.2f}"),
]


def merge_rows(path: Path, new_rows: list[dict], env: dict) -> None:
    """Add ``new_rows`` to the results file, replacing only cutlass rows of the same case."""
    data = json.loads(path.read_text()) if path.is_file() else {"env": env, "rows": []}
    keys = {bo._row_key(r) for r in new_rows}  # (kernel, dtype, V layout, B, L, target): cutlass rows only
    kept = [r for r in data.get("rows", []) if bo._row_key(r) not in keys]
    data["rows"] = kept + new_rows
    data["env_cutlass"] = env  # the top-level env stays bench_operator's
    path.write_text(json.dumps(data, indent=1))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lengths", type=str, default=",".join(str(x) for x in LENGTHS))
    ap.add_argument("--budget-ms", type=float, default=300.0)
    ap.add_argument("--out", type=str, default=str(ROOT / "benchmarks/results/operator_h200.json"))
    ap.add_argument("--kernels", type=str, default=",".join(cutlass_build.KERNELS),
                    help="variants to time (the first fills the row's main columns)")
    ap.add_argument("--cpu-smoke", action="store_true",
                    help="CI: CPU, L=256, 4/1 heads, d=64, no CUTLASS launch (set TRITON_INTERPRET=1)")
    args = ap.parse_args(argv)
    if args.cpu_smoke and args.lengths == ",".join(str(x) for x in LENGTHS):
        args.lengths = "256"
    kernels = tuple(k for k in args.kernels.split(",") if k)
    bad = [k for k in kernels if k not in cutlass_build.KERNELS]
    if not kernels or bad:
        ap.error(f"--kernels: expected names from {tuple(cutlass_build.KERNELS)}, got {args.kernels!r}")
    device = torch.device("cpu" if args.cpu_smoke else "cuda")
    env = bo._env(device)
    cfg = dataclasses.replace(bo.BenchConfig(), budget_ms=args.budget_ms, device=device.type)
    if args.cpu_smoke:  # no library: building it here would take minutes and it cannot run
        env["cutlass_library"] = None
        env["cutlass_unavailable"] = cutlass_build.unavailable_reason() or "needs CUDA"
        cfg = dataclasses.replace(cfg, num_qo_heads=4, num_kv_heads=1, head_dim=64)
    else:
        env["cutlass_library"] = str(cutlass_build.library_path())
        env["cutlass_kernels"] = {f"{k}_bf16_d{d}": cutlass_build.kernel_attributes("bfloat16", d, k)
                                  for k in kernels for d in (64, 128)}
    print(env, flush=True)
    rows = []
    lengths = [int(x) for x in args.lengths.split(",") if x]
    t_start = time.time()
    for i, length in enumerate(lengths):
        try:
            row = run_length(length, cfg, device, env, check_reference=(i == 0 and length <= 16384),
                             kernels=kernels)
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            row = {"batch": 1, "seqlen": length, "kernel": "cutlass", "dtype": cfg.dtype,
                   "target_density": None, "errors": {"case": repr(e)[:300]}}
            if device.type == "cuda":
                torch.cuda.empty_cache()
        rows.append(row)
        print({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()}, flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    merge_rows(out, rows, env)
    print(f"\nadded {len(rows)} cutlass rows to {out} ({time.time() - t_start:.0f} s)")
    print(bo.table(rows, COLUMNS))
    variant_rows = [{"seqlen": r["seqlen"], "kernel_variant": k, **t}
                    for r in rows for k, t in r.get("by_kernel", {}).items()]
    print()
    print(bo.table(variant_rows, VARIANT_COLUMNS))


if __name__ == "__main__":
    main()
