"""Where sparse prefill pays for a model: whole-prompt prefill time, dense against sparse, per
length, and the ``sparse.dense_below`` those times imply.

For each length ``L``: one prompt of ``L`` token ids (seeded), prefilled whole (one forward,
``dense_below = 0``) through ``model_executor.runner.ModelRunner`` over a paged pool, once with
``alpha = 0`` (dense) and once with the sparse options under test (``--profile FILE``, the
shipped profile of ``--model`` by default, or the service's defaults with ``--profile none``);
medians of ``--reps`` timed runs after a warm-up (CUDA events on a GPU). The speed-up is dense
time over sparse time; the block density is the sparse forward's (``index_tile_counts``).

``dense_below`` is the smallest measured length from which every longer measured length runs
at least ``--min-speedup`` (default 1.1) faster sparse; if none does, the largest length + 1
(dense everywhere measured). It prints a table last and writes JSON
(``benchmarks/results/dense_below.json`` by default).

    python benchmarks/bench_dense_below.py --model DIR --lengths 1024,2048,4096,8192,16384,32768  # GPU
    python benchmarks/bench_dense_below.py --cpu-smoke --out /tmp/d.json   # CI: builtin:tiny, 256/512 tokens
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernels.config import SparseConfig  # noqa: E402
from model_executor.loading import load_model, make_pool  # noqa: E402
from model_executor.runner import ModelRunner, PrefillItem  # noqa: E402
from model_executor.sparse_profile import resolve_profile  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "dense_below.json"


MIN_SPEEDUP = 1.1  # sparse prefill pays from where it is at least this much faster, on


def implied_dense_below(rows: list[dict], min_speedup: float) -> int:
    """The smallest length from which every longer measured length has ``speedup >= min``."""
    rows = sorted(rows, key=lambda r: r["length"])
    below = rows[-1]["length"] + 1 if rows else 0
    for r in reversed(rows):
        if r["speedup"] < min_speedup:
            break
        below = r["length"]
    return below


def _time(fn, reps: int, device: torch.device) -> float:
    fn()  # warm-up (Triton compiles, allocator)
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def run(args: argparse.Namespace) -> dict:
    device = torch.device(args.device)
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    lengths = [int(x) for x in args.lengths.split(",")]
    profile = resolve_profile(args.profile, args.model) if args.profile != "none" else None
    sparse = profile.sparse_config() if profile is not None else SparseConfig(last_dense_tiles=2, energy_rule="first_key")
    rows = []
    for length in lengths:
        loaded = load_model(args.model, dtype=dtype, device=device, seed=0)
        trained = int(getattr(loaded.model.config, "max_position_embeddings", 0) or 0)
        if trained and length > trained:  # YaRN past the trained context, as the calibration does
            loaded = load_model(args.model, dtype=dtype, device=device, seed=0,
                                rope_scaling={"rope_type": "yarn", "factor": length / trained})
        pages = -(-length // args.page_size) + 1
        pool = make_pool(loaded, num_pages=pages, page_size=args.page_size)
        ids = torch.randint(0, int(loaded.model.config.vocab_size), (length,),
                            generator=torch.Generator().manual_seed(length)).tolist()
        out = {"length": length, "beyond_trained_context": bool(trained and length > trained)}
        for mode, config in (("dense", SparseConfig(alpha=0.0)), ("sparse", sparse)):
            runner = ModelRunner(loaded.model, pool, config, dense_below=0, device=device, backend=args.backend)

            def once(runner=runner):
                pool.reserve("r", length)
                try:
                    runner.prefill([PrefillItem("r", ids)])
                finally:
                    pool.release("r")

            out[f"{mode}_ms"] = round(_time(once, args.reps, device), 3)
            if mode == "sparse":
                pool.reserve("r", length)
                try:
                    runner.prefill([PrefillItem("r", ids)])
                    sel, causal = runner.index_tile_counts().get("r", (0, 0))
                finally:
                    pool.release("r")
                out["density"] = round(sel / causal, 4) if causal else None
        out["speedup"] = round(out["dense_ms"] / out["sparse_ms"], 3)
        rows.append(out)
        print(f"L={length}: dense {out['dense_ms']:.2f} ms, sparse {out['sparse_ms']:.2f} ms, "
              f"x{out['speedup']:.2f}, density {out['density']}", flush=True)
    below = implied_dense_below(rows, args.min_speedup)
    env = {"device": torch.cuda.get_device_name() if device.type == "cuda" else platform.processor() or "cpu",
           "torch": torch.__version__, "python": platform.python_version()}
    try:
        import triton
        import transformers

        env.update(triton=triton.__version__, transformers=transformers.__version__)
    except ImportError:
        pass
    return {"model": args.model, "dtype": args.dtype, "backend": args.backend, "sparse": sparse.__dict__ | {
        "layer_alpha": list(sparse.layer_alpha) if sparse.layer_alpha else None},
            "profile": args.profile, "min_speedup": args.min_speedup, "dense_below": below, "rows": rows,
            "env": env, "date": time.strftime("%Y-%m-%d"), "command": " ".join(sys.argv)}


def table(result: dict) -> str:
    lines = ["| length | dense ms | sparse ms | speed-up | density |", "|---:|---:|---:|---:|---:|"]
    for r in result["rows"]:
        mark = " (YaRN)" if r.get("beyond_trained_context") else ""
        ms = "".join(f" | {r[k]:.2f}" if k in r else " | -" for k in ("dense_ms", "sparse_ms"))
        lines.append(f"| {r['length']}{mark}{ms} | {r['speedup']:.2f}x | {r.get('density')} |")
    lines.append(f"\nimplied dense_below (speed-up >= {result['min_speedup']} from there on): {result['dense_below']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="builtin:smollm2-135m")
    ap.add_argument("--lengths", default="1024,2048,4096,8192,16384,32768")
    ap.add_argument("--profile", default="auto", help='"auto" (the shipped one), "none", or a file')
    ap.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--min-speedup", type=float, default=None,
                    help="the speed-up sparse must keep from dense_below on (default 1.1, or --results' own)")
    ap.add_argument("--cpu-smoke", action="store_true", help="builtin:tiny on CPU, 256 and 512 tokens, fp32")
    ap.add_argument("--out", default=str(RESULTS))
    ap.add_argument("--results", default=None, metavar="FILE",
                    help="take the rows from an earlier run's JSON instead of timing (e.g. a GPU run's, to write "
                         "the profile on another machine); its min_speedup applies unless given")
    ap.add_argument("--write-profile", default=None, metavar="FILE",
                    help="write the profile under test with the implied dense_below to FILE (the shipped one: "
                         "model_executor/profiles/<model>.json)")
    args = ap.parse_args(argv)
    if args.cpu_smoke:
        args.model, args.lengths, args.device, args.dtype, args.reps, args.profile = (
            "builtin:tiny", "256,512", "cpu", "fp32", 1, "none")
    if args.min_speedup is not None and args.min_speedup <= 0:
        ap.error("--min-speedup: expected a positive number")
    if args.results:
        try:
            result = json.loads(Path(args.results).read_text())
            rows = result["rows"]
            if not isinstance(rows, list) or not all(isinstance(r, dict) and {"length", "speedup"} <= set(r)
                                                     for r in rows):
                raise ValueError("rows: expected a list of {length, speedup, ...}")
        except (OSError, ValueError, KeyError, TypeError) as exc:
            ap.error(f"--results: {args.results}: not a bench_dense_below result ({exc})")
        if result.get("model") != args.model:
            ap.error(f"--results: measured {result.get('model')!r}, not --model {args.model!r}")
        result["min_speedup"] = args.min_speedup or result.get("min_speedup") or MIN_SPEEDUP
        result["dense_below"] = implied_dense_below(rows, float(result["min_speedup"]))
    else:
        args.min_speedup = args.min_speedup or MIN_SPEEDUP
        result = run(args)
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(table(result))
    if args.write_profile:
        profile = resolve_profile(args.profile, args.model)
        if profile is None:
            ap.error("--write-profile: needs a profile under test (--profile auto or a file)")
        provenance = {**profile.provenance, "dense_below": {
            "command": result["command"], "date": result["date"], "env": result["env"],
            "speedups": {r["length"]: r["speedup"] for r in result["rows"]}, "min_speedup": result["min_speedup"]}}
        written = dataclasses.replace(profile, dense_below=result["dense_below"], provenance=provenance)
        print(f"wrote {written.save(args.write_profile)} (dense_below {result['dense_below']})")
    return 0
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
