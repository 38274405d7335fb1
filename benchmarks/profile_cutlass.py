"""One CUTLASS attention launch per variant on bench_operator's inputs, for Nsight Compute.

Builds the structured 8B-shaped case of ``benchmarks/bench_cutlass.py`` at one length, warms
every variant up, then launches each once inside an NVTX range named after it, so that
``ncu --nvtx --nvtx-include "<variant>/"`` (or ``--kernel-name regex:ws_kernel``) picks one
launch. Usage on the H200 (library prebuilt, ``PYTHONPATH=$PWD``)::

    ncu --set full --nvtx --nvtx-include "ws128/" -o ws128 python3 benchmarks/profile_cutlass.py --length 32768

Prints nothing but the case; the numbers come from ncu. ``--out`` also writes the case as JSON.
``--cpu-smoke`` (``TRITON_INTERPRET=1``, CI): the same case at L=256, 4/1 heads, d=64 on the CPU,
each variant's call stopped by the CUTLASS input check at "needs a CUDA tensor".
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_operator as bo  # noqa: E402
from kernels import cutlass_attention as ca  # noqa: E402
from kernels import cutlass_build  # noqa: E402
from kernels.config import SparseConfig  # noqa: E402


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--length", type=int, default=32768)
    ap.add_argument("--kernels", default=",".join(cutlass_build.KERNELS))
    ap.add_argument("--dense", action="store_true", help="every visible tile instead of the index")
    ap.add_argument("--cpu-smoke", action="store_true", help="CPU, tiny shape, no launch (set TRITON_INTERPRET=1)")
    ap.add_argument("--out", default=None, help="write the case (length, density, variants) as JSON here")
    args = ap.parse_args(argv)
    kernels = [k for k in args.kernels.split(",") if k]
    bad = [k for k in kernels if k not in cutlass_build.KERNELS]
    if not kernels or bad:
        ap.error(f"--kernels: expected names from {tuple(cutlass_build.KERNELS)}, got {args.kernels!r}")
    device = torch.device("cpu" if args.cpu_smoke else "cuda")
    cfg = bo.BenchConfig(device=device.type)
    if args.cpu_smoke:
        cfg = dataclasses.replace(cfg, num_qo_heads=4, num_kv_heads=1, head_dim=64)
    q, k, v, _ = bo.make_inputs(args.length, 1, None, cfg, device)
    qf, k_pages, v_pages, plan = bo.paged_plan(q, k, v, SparseConfig(), cfg.page_size)
    build, _ = bo.index_builder(device)
    index = None if args.dense else build(qf, k_pages, v_pages, plan)

    def launch(kernel: str):
        return ca.sparse_attention(qf, k_pages, v_pages, plan, index, num_splits=1,
                                   dense=args.dense, kernel=kernel)

    case = {"length": args.length, "dense": args.dense, "kernels": kernels, "device": device.type,
            "shape": [cfg.num_qo_heads, cfg.num_kv_heads, cfg.head_dim], "launched": {}}
    if index is not None:
        case["density"] = bo.selected_pairs(plan, index) / bo.causal_pairs(plan)
    for kern in kernels:
        if device.type == "cuda":
            launch(kern)
            case["launched"][kern] = True
            continue
        try:  # the call reaches the device check, after every argument check
            launch(kern)
        except ValueError as e:
            if "CUDA" not in str(e):
                raise
            case["launched"][kern] = False
    if device.type == "cuda":
        torch.cuda.synchronize()
        for kern in kernels:
            torch.cuda.nvtx.range_push(kern)
            launch(kern)
            torch.cuda.nvtx.range_pop()
        torch.cuda.synchronize()
    print(f"length {args.length}, dense {args.dense}, kernels {kernels}")
    if args.out:
        Path(args.out).write_text(json.dumps(case, indent=1))


if __name__ == "__main__":
    main()
