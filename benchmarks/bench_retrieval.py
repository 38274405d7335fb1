"""Needle retrieval with the hand-built model (evals/retrieval.py): dense vs sparse vs sparse
without mean correction, 4K..128K, the paper's selection settings (alpha 0.1, block 128,
sink 256, window 512).

Three needles: a single key/value pair (``repeats=1``), and the pair repeated 16 or 48 times in
a row (32 or 96 tokens), whose block-mean evidence (``repeats * 16 / 128`` logits) can survive
the threshold or, once pruned, be partly restored by the mean correction. Each cell
runs the same ``--trials`` prompts through the three variants. Prints a table last and writes
``benchmarks/results/retrieval.json``.

    PYTHONPATH=$PWD python benchmarks/bench_retrieval.py            # H200: 1-2 min
    PYTHONPATH=$PWD python benchmarks/bench_retrieval.py --lengths 4096 --trials 8   # CPU smoke
"""

from __future__ import annotations

import argparse
import time
from dataclasses import asdict, dataclass, replace

import torch

from evals.report import environment, write_json
from evals.retrieval import NeedleModelConfig, NeedleRetrievalModel, run_trials
from kernels.config import SparseConfig

PAPER = SparseConfig()  # alpha 0.1, block 128, sink 256, window 512, mean correction on


@dataclass
class Row:
    length: int
    needle_repeats: int
    variant: str
    trials: int
    accuracy: float
    needle_selected: float
    density_layer2: float
    seconds: float


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[4096, 8192, 16384, 32768, 65536, 131072])
    p.add_argument("--trials", type=int, default=24)
    p.add_argument("--repeats", type=int, nargs="+", default=[1, 16, 48])
    p.add_argument("--batch-tokens", type=int, default=1 << 20, help="tokens per forward (batch = this / length)")
    p.add_argument("--backend", default="auto", choices=["auto", "reference", "triton"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="retrieval.json", help="a file name under benchmarks/results/, or an absolute path (written there)")
    args = p.parse_args(argv)

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model_cfg = NeedleModelConfig()
    model = NeedleRetrievalModel(model_cfg, device=device, dtype=dtype)
    variants = {
        "dense": replace(PAPER, alpha=0.0),
        "sparse": PAPER,
        "sparse_nocorr": replace(PAPER, mean_correction=False),
    }
    rows: list[Row] = []
    for repeats in args.repeats:
        for length in args.lengths:
            t0 = time.perf_counter()
            res = run_trials(
                model, length, args.trials, variants, seed=args.seed, needle_repeats=repeats,
                batch_size=max(1, args.batch_tokens // length), backend=args.backend,
            )
            if device == "cuda":
                torch.cuda.synchronize()
            sec = (time.perf_counter() - t0) / len(res)
            for r in res:
                rows.append(Row(length, repeats, r.variant, r.trials, r.accuracy,
                                r.needle_selected / r.trials, r.density_layer2, sec))
            print(f"done L={length} repeats={repeats} in {time.perf_counter() - t0:.1f}s", flush=True)

    path = write_json(args.out, {
        "benchmark": "needle retrieval, hand-built 2-layer induction model (evals/retrieval.py)",
        "environment": environment(),
        "device": device, "dtype": str(dtype).replace("torch.", ""), "backend": args.backend,
        "model": asdict(model_cfg), "sparse_config": asdict(PAPER), "seed": args.seed,
        "rows": [asdict(r) for r in rows],
    })
    print(f"\nwrote {path}")
    print(f"{'repeats':>7} {'length':>7} | {'dense':>6} {'sparse':>7} {'no-corr':>7} | "
          f"{'needle sel.':>11} {'density L2':>10}")
    for repeats in args.repeats:
        for length in args.lengths:
            cell = {r.variant: r for r in rows if r.length == length and r.needle_repeats == repeats}
            print(f"{repeats:>7} {length:>7} | {cell['dense'].accuracy:>6.2f} {cell['sparse'].accuracy:>7.2f} "
                  f"{cell['sparse_nocorr'].accuracy:>7.2f} | {cell['sparse'].needle_selected:>11.2f} "
                  f"{cell['sparse'].density_layer2:>10.3f}")


if __name__ == "__main__":
    main()
