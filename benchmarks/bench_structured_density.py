"""Index-stage density of the structured Llama-3.1-8B-shaped model (model_executor/structured_model.py)
at 4K..128K with the paper's settings (alpha 0.1, block 128, sink 256, window 512), against the
paper's Table 3 densities for Llama-3.1-8B on needle-in-a-haystack inputs.

The model has the 8B shape with ``--layers`` layers (default 2: layers 0 and 1 are measured on
their real post-RoPE q/k inside a transformers forward). Prints a table last and writes
``benchmarks/results/structured_density.json``.

    PYTHONPATH=$PWD python benchmarks/bench_structured_density.py        # H200: ~1-2 min
"""

from __future__ import annotations

import argparse
import time
from dataclasses import asdict, dataclass

import torch

from evals.report import environment, write_json
from evals.structured_model import (
    build_structured_llama, haystack_ids, head_type, llama31_8b_spec, measure_density, tiny_spec,
)
from kernels.config import SparseConfig

PAPER_LLAMA31_8B = {4096: 0.760, 8192: 0.542, 16384: 0.336, 32768: 0.187, 65536: 0.090, 131072: 0.046}


@dataclass
class Row:
    length: int
    density: float
    per_layer: list[float]
    per_kv_head: list[list[float]]
    paper: float | None
    ratio_to_paper: float | None
    seconds: float


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--lengths", type=int, nargs="+", default=sorted(PAPER_LLAMA31_8B))
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--backend", default="auto", choices=["auto", "reference", "triton"])
    p.add_argument("--tiny", action="store_true",
                   help="the tiny CPU-test shape (tiny_spec: hidden 512, 8/2 heads, d 64) instead of the 8B's")
    p.add_argument("--out", default="structured_density.json", help="a file name under benchmarks/results/, or an absolute path (written there)")
    args = p.parse_args(argv)

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    make_spec = tiny_spec if args.tiny else llama31_8b_spec
    spec = make_spec(num_layers=args.layers, seed=args.seed)
    t0 = time.perf_counter()
    model = build_structured_llama(spec, device=device, dtype=dtype)
    build_s = time.perf_counter() - t0
    print(f"built {args.layers}-layer 8B-shaped model in {build_s:.1f}s", flush=True)
    config = SparseConfig()
    rows: list[Row] = []
    for length in args.lengths:
        t0 = time.perf_counter()
        recs = measure_density(model, haystack_ids(spec, length, seed=args.seed), config,
                               layers=args.layers, backend=args.backend)
        if device == "cuda":
            torch.cuda.synchronize()
        sec = time.perf_counter() - t0
        dens = sum(r.density for r in recs) / len(recs)
        paper = PAPER_LLAMA31_8B.get(length)
        rows.append(Row(length, dens, [r.density for r in recs], [r.per_kv_head for r in recs],
                        paper, dens / paper if paper else None, sec))
        print(f"done L={length} in {sec:.1f}s", flush=True)

    types = [[head_type(spec, layer, kv).name for kv in range(spec.num_key_value_heads)]
             for layer in range(args.layers)]
    path = write_json(args.out, {
        "benchmark": "index density of the structured Llama-3.1-8B-shaped model vs paper Table 3",
        "shape": "tiny" if args.tiny else "llama-3.1-8b",
        "environment": environment(),
        "device": device, "dtype": str(dtype).replace("torch.", ""), "backend": args.backend,
        "layers_measured": list(range(args.layers)), "kv_head_types": types,
        "spec": asdict(spec), "sparse_config": asdict(config), "build_seconds": build_s,
        "rows": [asdict(r) for r in rows],
    })
    print(f"\nwrote {path}")
    print(f"layers measured: {list(range(args.layers))} of an 8B-shaped model; KV head types {types}")
    print(f"{'length':>7} | {'density':>8} {'paper':>7} {'ratio':>6} | per layer")
    for r in rows:
        paper = f"{r.paper:7.3f}" if r.paper else "      -"
        ratio = f"{r.ratio_to_paper:6.2f}" if r.ratio_to_paper else "     -"
        print(f"{r.length:>7} | {r.density:8.3f} {paper} {ratio} | "
              + " ".join(f"{x:.3f}" for x in r.per_layer))


if __name__ == "__main__":
    main()
