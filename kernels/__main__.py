"""``python -m kernels demo``: the operator on structured synthetic inputs.

Builds inputs with sinks, a local band, vertical stripes, slash diagonals and planted needles
(``kernels.synthetic``, calibrated to the paper's density for the length), runs the index and
attention stages, and prints the density, needle recall, retained softmax mass, the error against
exact dense attention (with and without mean correction) and the stage timings (dense: torch
SDPA). The PyTorch reference runs on CPU (default size: a few seconds), Triton on CUDA.

Every result line reads ``name  value`` so that scripts can pick fields out; ``--json`` writes
them all.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time

import torch

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1], got {text!r}") from None
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1], got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m kernels", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    demo = sub.add_parser(
        "demo", help="run the operator on structured synthetic inputs",
        description="FlashPrefill V2 on structured synthetic inputs: density, fidelity, timing.",
    )
    demo.set_defaults(subparser=demo)
    demo.add_argument("--seqlen", type=_positive_int, default=4096, help="tokens per sequence (4096)")
    demo.add_argument("--batch", type=_positive_int, default=1, help="sequences (1)")
    demo.add_argument("--heads", type=_positive_int, default=8, help="query heads (8)")
    demo.add_argument("--kv-heads", type=_positive_int, default=2, help="KV heads (2)")
    demo.add_argument("--head-dim", type=_positive_int, default=64, help="head dim, a multiple of 16 <= 256 (64)")
    demo.add_argument("--alpha", type=_fraction, default=0.1, help="selection threshold in [0, 1] (0.1)")
    demo.add_argument("--block-size", type=_positive_int, default=128, help="logical key block, a multiple of 64 (128)")
    demo.add_argument("--density", type=float, default=None,
                      help="target density of the inputs in (0, 1] (default: the paper's at this length)")
    demo.add_argument("--backend", choices=("auto", "reference", "triton"), default="auto")
    demo.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    demo.add_argument("--dtype", choices=tuple(_DTYPES), default="bf16")
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--json", metavar="PATH", default=None, help="also write the results as JSON")
    return parser


def _run_timed(device: torch.device, fn):
    """``(fn(), milliseconds)``. On CUDA: the median of ``triton.testing.do_bench`` after a first
    call (compilation); on CPU the first call itself (the reference is slow, the number is only
    indicative there)."""
    if device.type == "cuda":
        from triton.testing import do_bench

        result = fn()
        return result, float(do_bench(fn, warmup=25, rep=100, return_mode="median"))
    t0 = time.perf_counter()
    result = fn()
    return result, (time.perf_counter() - t0) * 1e3


def _dense_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    """Causal dense attention with torch SDPA (flash on CUDA): the timing baseline."""
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    return lambda: torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=True, enable_gqa=True)


def run_demo(args: argparse.Namespace) -> dict:
    from . import fidelity, ops
    from .config import SparseConfig
    from .synthetic import structured_inputs

    if args.device == "auto":
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        device = torch.device(args.device)
    if args.heads % args.kv_heads:
        raise ValueError(f"--heads: expected a multiple of --kv-heads ({args.kv_heads}), got {args.heads}")
    if args.density is not None and not 0.0 < args.density <= 1.0:
        raise ValueError(f"--density: expected a number in (0, 1], got {args.density}")
    cfg = SparseConfig(alpha=args.alpha, block_size=args.block_size)
    backend = ops.resolve_backend(args.backend, device)
    x = structured_inputs(
        args.seqlen, batch=args.batch, num_qo_heads=args.heads, num_kv_heads=args.kv_heads,
        head_dim=args.head_dim, target_density=args.density, dtype=_DTYPES[args.dtype],
        device=device, seed=args.seed, config=dataclasses.replace(SparseConfig(), block_size=args.block_size),
    )
    q, k_pages, v_pages, plan = fidelity.prepare_paged(x.q, x.k, x.v, cfg)
    if backend == "triton":
        try:
            from . import triton_attention, triton_index  # noqa: F401
        except ImportError as exc:
            if args.backend == "triton":
                raise
            print(f"note: Triton kernels unavailable ({exc}); using the reference", file=sys.stderr)
            backend = "reference"
    uncorrected = fidelity.without_correction(plan)
    corrected = dataclasses.replace(plan, config=dataclasses.replace(plan.config, mean_correction=True))

    index, index_ms = _run_timed(device, lambda: ops.build_index_planned(q, k_pages, v_pages, plan, backend=backend))
    (out_c, _), attention_ms = _run_timed(
        device, lambda: ops.attention_planned(q, k_pages, v_pages, corrected, index, backend=backend)
    )
    out_u, _ = ops.attention_planned(q, k_pages, v_pages, uncorrected, index, backend=backend)
    _, dense_ms = _run_timed(device, _dense_sdpa(x.q, x.k, x.v))
    times = {"index_ms": index_ms, "attention_ms": attention_ms, "dense_ms": dense_ms}
    report = fidelity.metrics(q, k_pages, v_pages, plan, index, out_c, out_u, needle_blocks=x.needle_blocks)
    return {
        "seqlen": args.seqlen, "batch": args.batch, "num_qo_heads": args.heads,
        "num_kv_heads": args.kv_heads, "head_dim": args.head_dim, "dtype": args.dtype,
        "device": str(device), "backend": backend, "alpha": cfg.alpha, "block_size": cfg.block_size,
        "sink_tokens": cfg.sink_tokens, "window_tokens": cfg.window_tokens,
        "target_density": x.target_density, "predicted_density": x.predicted_density,
        "stripes_per_head": x.num_stripes,
        "slash_heads": [h for h, d in enumerate(x.slash_offsets) if d is not None],
        "needles": int(x.needle_blocks.shape[0]),
        **report, **times,
    }


def _print(r: dict) -> None:
    print("FlashPrefill V2 demo: structured inputs (sink, local band, stripes, slash, needles)")
    print(f"  B={r['batch']} L={r['seqlen']} heads={r['num_qo_heads']}/{r['num_kv_heads']} "
          f"d={r['head_dim']} {r['dtype']} on {r['device']}, backend {r['backend']}; alpha={r['alpha']} "
          f"block={r['block_size']} sink={r['sink_tokens']} window={r['window_tokens']}")
    print(f"  pattern: {r['stripes_per_head']} stripe blocks per KV head, slash in KV heads "
          f"{r['slash_heads']}, {r['needles']} needles")

    def num(v, fmt):
        return "n/a" if v is None else format(v, fmt)

    rows = [
        ("density", num(r["density"], ".4f")),
        ("target_density", num(r["target_density"], ".4f")),
        ("predicted_density", num(r["predicted_density"], ".4f")),
        ("needle_recall", f"{num(r['needle_recall'], '.4f')} ({r['needle_pairs']} needle-tile pairs)"),
        ("retained_mass", num(r["retained_mass"], ".6f")),
        ("retained_mass_min", num(r["retained_mass_min"], ".6f")),
        ("rel_l2", num(r["rel_l2_corrected"], ".3e") + "  (mean correction)"),
        ("max_abs", num(r["max_abs_corrected"], ".3e") + "  (mean correction)"),
        ("rel_l2_no_correction", num(r["rel_l2_uncorrected"], ".3e")),
        ("max_abs_no_correction", num(r["max_abs_uncorrected"], ".3e")),
        ("rel_l2_dtype_floor", num(r["rel_l2_dtype_floor"], ".3e") + "  (exact output rounded to dtype)"),
        ("index_ms", num(r["index_ms"], ".3f")),
        ("attention_ms", num(r["attention_ms"], ".3f")),
        ("dense_ms", num(r["dense_ms"], ".3f") + "  (torch SDPA, causal)"),
    ]
    for name, value in rows:
        print(f"{name:<22} {value}")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        result = run_demo(args)
    except ValueError as exc:
        args.subparser.error(str(exc))  # exits 2 with the usage line
    _print(result)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
