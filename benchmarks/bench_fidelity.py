"""Fidelity of FlashPrefill V2 against exact dense attention over the alpha grid, with and
without mean correction, on structured synthetic inputs (kernels/synthetic.py).

For every (input family, dtype, length, alpha): index density, needle recall, retained softmax
mass, and the relative L2 / max abs error of the output (mean correction on and off, same index)
against exact dense attention.

Input families (one draw per length, Llama-3.1-8B attention shape 32/8 heads, d=128, on GPU):
- ``structured``: ``synthetic.structured_inputs`` calibrated to the paper's Table 3 density. By
  design every planted block clears the threshold by >= 1.5 nats and every background block
  misses it by >= 2 nats for any alpha in about [0.0125, 0.3], so density and error are
  (nearly) flat along the alpha grid: this family measures the operator at the paper's
  density, not the threshold.
- ``graded``: the same generator at its density floor (no stripes), plus *graded stripes*: in
  every KV head without a slash pattern, each background key block ``J`` gets a block-constant
  key offset along the group's mean query direction that adds ``c_J`` nats to the logit of
  every query (``c_J`` ~ exponential with mean ``--graded-mean``, clipped at ``SALIENT_LOGIT -
  0.4`` so the planted maxima stay the maxima). Block scores then spread continuously below the
  maximum, as in real models, and the alpha grid moves the density (0.2 -> 0.0125 raises it
  several-fold, cf. the paper's Table 9).

Reference. Exact dense attention in fp32 on fp32 copies of the (bf16) inputs: on CUDA the Triton
dense path (``triton_attention.sparse_attention(..., dense=True)``, fp32 operands, IEEE dots),
on CPU ``reference.dense_attention``. Sequences with more than ``--ref-blocks`` 128-position
query blocks are measured on a uniform random subset of that many blocks (the last one always
included), each run as its own varlen sequence over the shared K/V pages (bottom-right causal
with a prefix): the JSON's ``reference`` field says which rows were measured. Density and
needle recall always cover every query.

Retained mass per (query, head) is ``exp(lse_nocorr - lse_dense)``: the uncorrected sparse
kernel's log-partition covers exactly the selected visible keys (``fidelity.retained_mass``,
without a second pass over the scores).

FP8: the same draw quantized to e4m3 with amax descales (q per KV-head group, K and V per KV
head: ``kernels/fp8.py``); errors are against the same fp32 dense reference (on the unquantized
inputs), so they include the quantization of q, K and V.

    PYTHONPATH=$PWD python benchmarks/bench_fidelity.py               # H200: ~1-2 min
    PYTHONPATH=$PWD python benchmarks/bench_fidelity.py --quick       # H200: 8K and 64K
    PYTHONPATH=$PWD python benchmarks/bench_fidelity.py --device cpu  # CPU smoke (2K, 4K), ~30 s

Writes ``benchmarks/results/fidelity.json`` (CPU smoke: ``fidelity_cpu.json``) and prints a
table last.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from pathlib import Path

import torch

from evals.report import RESULTS_DIR, environment
from kernels import fidelity, ops, reference
from kernels import fp8 as fp8_ops
from kernels._checks import OPERATOR_DTYPES
from kernels.config import Q_TILE, SparseConfig
from kernels.synthetic import SALIENT_LOGIT, StructuredInputs, paper_density, structured_inputs

ALPHAS = (0.0125, 0.025, 0.05, 0.1, 0.2)
LENGTHS = (4096, 8192, 16384, 32768, 65536, 131072)
QUICK_LENGTHS = (8192, 65536)
CPU_LENGTHS = (2048, 4096)
FAMILIES = ("structured", "graded")
GRADED_MEAN = 1.5  # nats
GRADED_CAP = SALIENT_LOGIT - 0.4  # the tile maximum is >= SALIENT_LOGIT (the sink block)
REF_BLOCK = Q_TILE  # positions per sampled query block
# GPU: the paper's shape and selection settings. CPU smoke: a small shape and a small block /
# sink / window so that the index prunes at 1-2K tokens.
GPU_SHAPE = dict(num_qo_heads=32, num_kv_heads=8, head_dim=128)
CPU_SHAPE = dict(num_qo_heads=8, num_kv_heads=2, head_dim=64)
CPU_CONFIG = dict(block_size=64, sink_tokens=64, window_tokens=128)
CPU_STRUCTURED_DENSITY = 0.35


# ---------------------------------------------------------------------------------------------
# Inputs


def graded_inputs(
    seqlen: int, *, num_qo_heads: int, num_kv_heads: int, head_dim: int, config: SparseConfig,
    dtype: torch.dtype, device: torch.device, seed: int = 0, mean: float = GRADED_MEAN,
    cap: float = GRADED_CAP,
) -> tuple[StructuredInputs, dict]:
    """Structured inputs at their density floor plus graded stripes (see the module docstring).

    Returns the inputs (``predicted_density`` is NaN: the calibration does not model the
    grading) and a summary of the planted levels.
    """
    base = structured_inputs(
        seqlen, num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
        target_density=1e-6, dtype=torch.float32, device=device, seed=seed, config=config,
    )
    bs = config.block_size
    nb = -(-seqlen // bs)
    g = num_qo_heads // num_kv_heads
    scale = config.softmax_scale(head_dim)
    sink_blocks = -(-config.sink_tokens // bs)
    gen = torch.Generator().manual_seed(10_000 + seed)
    k = base.k.clone()
    graded_heads, levels_all = [], []
    for h in range(num_kv_heads):
        if base.slash_offsets[h] is not None:
            continue  # every free block of a slash head is salient for some query block
        levels = torch.empty(nb).exponential_(1.0 / mean, generator=gen).clamp_(max=cap)
        skip = set(range(min(sink_blocks, nb))) | set(base.stripe_blocks[h])
        skip |= {int(r[2]) // bs for r in base.needle_blocks.tolist() if r[1] == h}
        levels[sorted(skip)] = 0.0
        u = base.q[0, :, h * g : (h + 1) * g].double().mean((0, 1))  # the group's mean query
        offset = levels.double()[:, None] * u[None, :].cpu() / (scale * float(u.norm()) ** 2)
        k[0, :, h] += offset.repeat_interleave(bs, 0)[:seqlen].to(device=device, dtype=k.dtype)
        graded_heads.append(h)
        levels_all.append(levels[levels > 0])
    flat = torch.cat(levels_all) if levels_all else torch.zeros(0)
    x = dataclasses.replace(
        base, q=base.q.to(dtype), k=k.to(dtype), v=base.v.to(dtype), predicted_density=math.nan,
    )
    info = {
        "graded_kv_heads": graded_heads, "mean_nats": mean, "cap_nats": cap,
        "graded_blocks": int(flat.numel()),
        "levels_mean": float(flat.mean()) if flat.numel() else None,
        "levels_at_cap": float((flat >= cap).float().mean()) if flat.numel() else None,
        "floor_density": base.predicted_density,
    }
    return x, info


def make_inputs(family: str, seqlen: int, shape: dict, config: SparseConfig, dtype: torch.dtype,
                device: torch.device, seed: int, structured_density: float | None,
                graded_mean: float) -> tuple[StructuredInputs, dict]:
    if family == "structured":
        x = structured_inputs(seqlen, **shape, target_density=structured_density, dtype=dtype,
                              device=device, seed=seed, config=config)
        return x, {"target_density": x.target_density, "predicted_density": x.predicted_density,
                   "stripes_per_head": x.num_stripes}
    if family == "graded":
        return graded_inputs(seqlen, **shape, config=config, dtype=dtype, device=device, seed=seed,
                             mean=graded_mean)
    raise ValueError(f"family: expected one of {FAMILIES}, got {family!r}")


def fp8_dtype() -> torch.dtype | None:
    """The FP8 input dtype the operator accepts, or None (no FP8 path yet)."""
    for name in ("float8_e4m3fn", "float8_e4m3fnuz"):
        dt = getattr(torch, name, None)
        if dt is not None and dt in OPERATOR_DTYPES:
            return dt
    return None


# ---------------------------------------------------------------------------------------------
# Dense reference on (a subset of) query blocks


def reference_blocks(seqlen: int, max_blocks: int, gen: torch.Generator) -> list[tuple[int, int]]:
    """Query position ranges to measure: everything as one range when the sequence has at most
    ``max_blocks`` 128-position blocks (or ``max_blocks == 0``), else a sorted random subset of
    blocks, the last block always included."""
    n = -(-seqlen // REF_BLOCK)
    if max_blocks <= 0 or n <= max_blocks:
        return [(0, seqlen)]
    pick = torch.randperm(n - 1, generator=gen)[: max_blocks - 1].tolist() + [n - 1]
    return [(b * REF_BLOCK, min((b + 1) * REF_BLOCK, seqlen)) for b in sorted(pick)]


def dense_reference(
    q32: torch.Tensor, k32_pages: torch.Tensor, v32_pages: torch.Tensor, page_table: torch.Tensor,
    blocks: list[tuple[int, int]], config: SparseConfig, backend: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Exact fp32 attention for the query rows in ``blocks`` (one sequence, ``q32 [L, Hq, d]``):
    ``(rows [R] int64, out [R, Hq, d] fp32, lse [R, Hq] fp32)``. Each block runs as a varlen
    sequence whose keys are the shared pages up to the block's end."""
    device = q32.device
    rows = torch.cat([torch.arange(s, e, device=device) for s, e in blocks])
    cu = torch.tensor([0] + [e - s for s, e in blocks], device=device).cumsum(0).to(torch.int32)
    seqlens = torch.tensor([e for _, e in blocks], dtype=torch.int32, device=device)
    table = page_table[:1].expand(len(blocks), -1).contiguous()
    qs = q32.index_select(0, rows)
    plan = ops.plan_prefill(qs, k32_pages, v32_pages, table, cu, seqlens, config)
    if backend == "triton":
        from kernels import triton_attention

        out, lse = triton_attention.sparse_attention(qs, k32_pages, v32_pages, plan, None, dense=True)
    else:
        out, lse = reference.dense_attention(qs, k32_pages, v32_pages, plan,
                                             chunk=fidelity.query_chunk(plan, device))
    return rows, out.float(), lse.float()


# ---------------------------------------------------------------------------------------------
# One length


def measure_length(
    x: StructuredInputs, alphas, base_config: SparseConfig, backend: str, ref_blocks: int,
    seed: int, dtypes: dict[str, torch.dtype],
) -> tuple[list[dict], dict]:
    """Rows (one per dtype and alpha) and the reference description for one input draw."""
    seqlen = x.q.shape[1]
    qf, k_pages, v_pages, plan = fidelity.prepare_paged(x.q, x.k, x.v, base_config)
    gen = torch.Generator().manual_seed(seed + seqlen)
    blocks = reference_blocks(seqlen, ref_blocks, gen)
    t0 = time.perf_counter()
    rows_idx, ref, lse_ref = dense_reference(
        qf.float(), k_pages.float(), v_pages.float(), plan.page_table, blocks, base_config, backend
    )
    ref_norm = float(ref.norm())
    _sync(qf.device)
    ref_seconds = time.perf_counter() - t0
    measured = int(rows_idx.numel())
    ref_info = {
        "kind": "exact fp32 dense on fp32 copies of the inputs",
        "implementation": "triton_attention.sparse_attention(dense=True), fp32 IEEE dots"
        if backend == "triton" else "reference.dense_attention (fp32)",
        "query_rows": "all" if len(blocks) == 1 and blocks[0] == (0, seqlen) else
        f"random subset of {len(blocks)} query blocks of {REF_BLOCK} positions (last included)",
        "measured_positions": measured, "fraction_of_queries": measured / seqlen,
        "seconds": ref_seconds,
    }
    out_rows = []
    for dname, dtype in dtypes.items():
        descales = None
        if dtype == x.q.dtype:
            q_d, kp_d, vp_d = qf, k_pages, v_pages
        elif dtype == fp8_ops.FP8_DTYPE:
            q_d, qd = fp8_ops.quantize_queries(qf, plan.cu_seqlens_q, plan.num_kv_heads)
            kp_d, kd = fp8_ops.quantize_per_head_pages(k_pages)
            vp_d, vd = fp8_ops.quantize_per_head_pages(v_pages)
            descales = ops.plan_descales(q_d, plan, qd, kd, vd)
        else:
            q_d, kp_d, vp_d = qf.to(dtype), k_pages.to(dtype), v_pages.to(dtype)
        out_dtype = fp8_ops.OUT_DTYPE if dtype == fp8_ops.FP8_DTYPE else dtype
        floor = float((ref.to(out_dtype).float() - ref).norm()) / max(ref_norm, 1e-30)
        for alpha in alphas:
            t0 = time.perf_counter()
            cfg_on = dataclasses.replace(base_config, alpha=float(alpha), mean_correction=True)
            plan_on = dataclasses.replace(plan, config=cfg_on)
            plan_off = fidelity.without_correction(plan_on)
            index = ops.build_index_planned(q_d, kp_d, vp_d, plan_on, backend=backend, descales=descales)
            out_on, _ = ops.attention_planned(q_d, kp_d, vp_d, plan_on, index, backend=backend,
                                              descales=descales)
            out_off, lse_off = ops.attention_planned(q_d, kp_d, vp_d, plan_off, index, backend=backend,
                                                     descales=descales)
            mass = torch.exp(lse_off.float().index_select(0, rows_idx) - lse_ref).clamp(0.0, 1.0)
            rel_on, max_on = fidelity.output_error(out_on.index_select(0, rows_idx), ref)
            rel_off, max_off = fidelity.output_error(out_off.index_select(0, rows_idx), ref)
            recall, pairs = fidelity.needle_recall(index, plan_on, x.needle_blocks)
            density = fidelity.index_density(index, plan_on)
            _sync(qf.device)
            out_rows.append({
                "dtype": dname, "alpha": float(alpha), "density": density,
                "retained_mass": float(mass.mean()), "retained_mass_min": float(mass.min()),
                "rel_l2_corrected": rel_on, "rel_l2_uncorrected": rel_off,
                "max_abs_corrected": max_on, "max_abs_uncorrected": max_off,
                "rel_l2_dtype_floor": floor, "needle_recall": recall, "needle_pairs": pairs,
                "seconds": time.perf_counter() - t0,
            })
    return out_rows, ref_info


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ---------------------------------------------------------------------------------------------
# CLI


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto",
                   help="cpu: small smoke mode (8/2 heads, d=64, block/sink/window 64/64/128)")
    p.add_argument("--quick", action="store_true", help=f"lengths {list(QUICK_LENGTHS)} only")
    p.add_argument("--lengths", type=int, nargs="+", default=None)
    p.add_argument("--alphas", type=float, nargs="+", default=list(ALPHAS))
    p.add_argument("--families", nargs="+", choices=FAMILIES, default=list(FAMILIES))
    p.add_argument("--ref-blocks", type=int, default=256,
                   help="measure errors on at most this many random 128-position query blocks "
                        "per length (0: every query); density and recall cover every query")
    p.add_argument("--graded-mean", type=float, default=GRADED_MEAN,
                   help="mean of the graded stripe levels in nats (graded family)")
    p.add_argument("--no-fp8", action="store_true", help="skip FP8 even where it is available")
    p.add_argument("--backend", choices=("auto", "reference", "triton"), default="auto")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads (default: 1 in CPU mode, where the reference's many small "
                        "ops run faster on one thread and do not fight other jobs; unchanged on GPU)")
    p.add_argument("--out", default=None, help="JSON path (default benchmarks/results/fidelity.json, "
                                               "CPU: fidelity_cpu.json)")
    return p


def main(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    if args.device == "auto":
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: CUDA is not available")
    cpu = device.type == "cpu"
    threads = args.threads if args.threads is not None else (1 if cpu else None)
    saved_threads = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        return _run(args, device, cpu)
    finally:
        torch.set_num_threads(saved_threads)


def _run(args: argparse.Namespace, device: torch.device, cpu: bool) -> dict:
    shape = CPU_SHAPE if cpu else GPU_SHAPE
    base_config = SparseConfig(**CPU_CONFIG) if cpu else SparseConfig()
    lengths = args.lengths or list(CPU_LENGTHS if cpu else (QUICK_LENGTHS if args.quick else LENGTHS))
    backend = ops.resolve_backend(args.backend, device)
    for a in args.alphas:
        if not 0.0 < a <= 1.0:
            raise SystemExit(f"--alphas: expected values in (0, 1], got {a}")
    dtypes = {"bf16": torch.bfloat16}
    fp8 = None if args.no_fp8 else fp8_dtype()
    if fp8 is not None:
        dtypes["fp8"] = fp8
        fp8_note = ("run: the same draw quantized to e4m3 with amax descales (q per KV-head group, "
                    "K/V per KV head); errors against the unquantized fp32 reference")
    elif args.no_fp8:
        fp8_note = "skipped: --no-fp8"
    else:
        fp8_note = ("skipped: no FP8 path in kernels (kernels._checks.FLOAT_DTYPES has no float8 "
                    "dtype; triton_attention does not implement eq. 15 yet)")
    print(f"device {device}, backend {backend}, heads {shape['num_qo_heads']}/{shape['num_kv_heads']} "
          f"d={shape['head_dim']}, config {dataclasses.asdict(base_config)}; fp8 {fp8_note}", flush=True)

    rows, inputs_meta = [], []
    t_start = time.perf_counter()
    for family in args.families:
        for length in lengths:
            t0 = time.perf_counter()
            structured_density = CPU_STRUCTURED_DENSITY if cpu else None
            x, meta = make_inputs(family, length, shape, base_config, torch.bfloat16, device,
                                  args.seed, structured_density, args.graded_mean)
            gen_s = time.perf_counter() - t0
            res, ref_info = measure_length(x, args.alphas, base_config, backend, args.ref_blocks,
                                           args.seed, dtypes)
            for r in res:
                rows.append({"family": family, "seqlen": length, **r})
            inputs_meta.append({"family": family, "seqlen": length, "generate_seconds": gen_s,
                                "needles": int(x.needle_blocks.shape[0]), **meta,
                                "reference": ref_info})
            del x
            print(f"done {family} L={length} in {time.perf_counter() - t0:.1f}s "
                  f"(reference {ref_info['seconds']:.1f}s on {ref_info['measured_positions']} positions)",
                  flush=True)
    total_s = time.perf_counter() - t_start
    payload = {
        "benchmark": "fidelity of FlashPrefill V2 vs exact dense attention over the alpha grid "
                     "(benchmarks/bench_fidelity.py)",
        "environment": environment(),
        "device": str(device), "backend": backend, "mode": "cpu-smoke" if cpu else
        ("quick" if args.quick else "full"),
        "shape": {"batch": 1, **shape}, "sparse_config": dataclasses.asdict(base_config),
        "alphas": list(args.alphas), "lengths": lengths, "families": list(args.families),
        "seed": args.seed, "fp8": fp8_note, "ref_blocks": args.ref_blocks,
        "graded": {"mean_nats": args.graded_mean, "cap_nats": GRADED_CAP},
        "paper_density": {str(n): paper_density(n) for n in lengths if n >= 4096},
        "inputs": inputs_meta, "rows": rows, "total_seconds": total_s,
    }
    path = Path(args.out) if args.out else RESULTS_DIR / ("fidelity_cpu.json" if cpu else "fidelity.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2) + "\n")
    print(f"\nwrote {path} ({total_s:.1f}s)")
    print_table(payload)
    return payload


def print_table(payload: dict, file=None) -> None:
    file = file or sys.stdout

    def f(v, fmt):
        return "   n/a" if v is None else format(v, fmt)

    print(f"{'family':<10} {'dtype':<5} {'length':>7} {'alpha':>7} | {'density':>7} {'recall':>6} "
          f"{'mass':>7} {'mass min':>8} | {'relL2 corr':>10} {'relL2 off':>10} | "
          f"{'max corr':>9} {'max off':>9} | {'dtype floor':>11}", file=file)
    for r in payload["rows"]:
        print(f"{r['family']:<10} {r['dtype']:<5} {r['seqlen']:>7} {r['alpha']:>7.4f} | "
              f"{r['density']:>7.4f} {f(r['needle_recall'], '6.3f')} {r['retained_mass']:>7.4f} "
              f"{r['retained_mass_min']:>8.4f} | {r['rel_l2_corrected']:>10.3e} "
              f"{r['rel_l2_uncorrected']:>10.3e} | {r['max_abs_corrected']:>9.3e} "
              f"{r['max_abs_uncorrected']:>9.3e} | {r['rel_l2_dtype_floor']:>11.3e}", file=file)


if __name__ == "__main__":
    main()
