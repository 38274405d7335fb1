"""What counting a prefill's block density costs (``ForwardState.count_index``, the number behind
``usage.sparse_attention.density``), next to the attention layer it is counted in.

Per length: structured inputs in the Llama-3.1-8B attention shape (Hq 32, Hkv 8, d 128, bf16) at
the paper's density, one plan, then the median time of
- the index stage (``build_index_planned``) and the attention stage (``attention_planned``,
  ``auto``: CUTLASS where its library loads, else Triton), i.e. one layer's sparse attention;
- ``count_index`` as every layer after a forward's first runs it (the per-layer device work the
  service adds; the causal counts are cached per plan);
- the host read of the counts (``tolist``) and the causal tile count (host arithmetic over the
  plan's query tiles), each done once per forward, not per layer.
It prints a table and writes ``benchmarks/results/density_count.json``. The counted block
density is checked against a count made here from the CSR on the host.

    python benchmarks/bench_density_count.py                 # 8K, 32K, 128K on the GPU
    python benchmarks/bench_density_count.py --lengths 512 --device cpu   # a dry run
    python benchmarks/bench_density_count.py --cpu-smoke --out /tmp/d.json  # CI: L=256, 4/1 heads, d=64
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_operator import BenchConfig, _env, bench_ms, make_inputs, paged_plan  # noqa: E402
from kernels.config import SparseConfig  # noqa: E402
from kernels.ops import attention_planned, build_index_planned  # noqa: E402
from kernels.synthetic import paper_density  # noqa: E402
from model_executor.attention import ForwardState, causal_tile_pairs  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "density_count.json"


def run(length: int, device: torch.device, backend: str, budget_ms: float,
        cfg: BenchConfig = BenchConfig()) -> dict:
    q, k, v, source = make_inputs(length, 1, paper_density(length), cfg, device)
    config = SparseConfig()
    qf, kp, vp, plan = paged_plan(q, k, v, config, page_size=64)
    index = build_index_planned(qf, kp, vp, plan, backend=backend)

    def layer():
        idx = build_index_planned(qf, kp, vp, plan, backend=backend)
        attention_planned(qf, kp, vp, plan, idx, backend="auto" if backend == "triton" else backend)

    state = ForwardState()
    state.count_index(plan, index)  # the first layer of a forward also computes the causal counts
    counting = ForwardState()
    counting.count_index(plan, index)

    def count():  # every later layer: the device work alone
        counting.count_index(plan, index)

    def read():
        state.selected_tiles.tolist()

    layer_ms = bench_ms(layer, device, budget_ms)
    count_ms = bench_ms(count, device, budget_ms)
    read_ms = bench_ms(read, device, budget_ms)
    t0 = time.perf_counter()  # host arithmetic, once per forward and head shape (cached by the state)
    for _ in range(5):
        causal_tile_pairs(plan)
    causal_ms = (time.perf_counter() - t0) * 1e3 / 5
    # check: the device count against the CSR read on the host
    offsets = index.seg_offsets.tolist()
    selected = offsets[-1] - offsets[0]
    causal = plan.num_kv_heads * causal_tile_pairs(plan)[0]
    got = state.selected_tiles.tolist()[0] / state.causal_tiles[0]
    assert got == selected / causal, (got, selected / causal)
    return {"length": length, "source": source, "block_density": round(got, 4),
            "layer_ms": round(layer_ms, 4), "count_ms": round(count_ms, 4), "read_ms": round(read_ms, 4),
            "causal_host_ms": round(causal_ms, 4),
            "count_pct_of_layer": round(100 * count_ms / layer_ms, 3)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[8192, 32768, 131072])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--budget-ms", type=float, default=300.0)
    p.add_argument("--cpu-smoke", action="store_true", help="--device cpu, L=256, 4/1 heads, d=64")
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    cfg = BenchConfig()
    if args.cpu_smoke:
        args.device = "cpu"
        cfg = dataclasses.replace(cfg, device="cpu", num_qo_heads=4, num_kv_heads=1, head_dim=64)
        if args.lengths == p.get_default("lengths"):
            args.lengths = [256]
    device = torch.device(args.device)
    backend = "triton" if device.type == "cuda" else "reference"
    rows = [run(n, device, backend, args.budget_ms, cfg) for n in args.lengths]
    head = (f"{'length':>8} {'density':>8} {'layer ms':>9} {'count ms':>9} {'count %':>8} {'read ms':>8} "
            f"{'causal ms':>9}")
    print(head)
    for r in rows:
        print(f"{r['length']:>8} {r['block_density']:>8.4f} {r['layer_ms']:>9.3f} {r['count_ms']:>9.4f} "
              f"{r['count_pct_of_layer']:>8.3f} {r['read_ms']:>8.4f} {r['causal_host_ms']:>9.3f}")
    out = {"env": _env(device), "backend": backend, "command": "python " + " ".join(["benchmarks/bench_density_count.py",
                                                                                     *(argv or sys.argv[1:])]),
           "rows": rows}
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(out, indent=2) + "\n")
        outdir = os.environ.get("OUT")
        if outdir:
            Path(outdir, args.out.name).write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
