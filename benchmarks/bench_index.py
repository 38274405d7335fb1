"""Index stage on the H200: block means, fused score/select + compaction, memory, density.

Times ``kernels.triton_index`` (the operator's index stage) at B=1, Hq=32, Hkv=8, d=128, bf16,
page_size 64, default ``SparseConfig`` (block 128, alpha 0.1, sink 256, window 512), on the
structured inputs of ``kernels.synthetic.structured_qkv`` (random Gaussian inputs if that
module is missing). Columns:

- ``means``: the paged block-means kernel (reads K and V once: ``GB/s`` over those bytes).
- ``select``: score + threshold + force + cumsum + compaction with ``capacity`` given (no
  host sync; what a serving step runs). ``TFLOP/s`` over the index GEMM actually done
  (``2 d`` per (packed row, visible block)).
- ``total``: means + select with ``capacity`` given; ``total_sync``: the ``capacity=None``
  call (one host read of nnz to size the CSR exactly).
- ``peak_MiB``: ``torch.cuda.max_memory_allocated`` during one ``capacity=None`` call minus
  what was allocated before it (outputs + scratch), ``out_MiB`` the outputs alone.
- ``nnz`` (selected 64-token tiles over all segments) and ``density`` (selected key-query
  pairs over causal pairs, per query head: ``kernels.fidelity.index_density``, on the GPU).

Correctness is checked first at the smallest length against ``kernels.reference.build_index``.
``--sweep`` also times a few score-kernel launch configurations at the largest length (to
re-tune ``IndexLaunch`` defaults).

Usage (H200): ``PYTHONPATH=$PWD python3 benchmarks/bench_index.py`` (about a minute; writes
``benchmarks/results/index_h200.json``). ``--device cpu`` with ``TRITON_INTERPRET=1`` and tiny
``--lengths`` only smoke-tests the script; ``--cpu-smoke`` is that at L=256 with 4/1 heads and
d=64 (CI).
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
import warnings
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch
import triton

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from evals.report import git_commit  # noqa: E402

from kernels import reference  # noqa: E402
from kernels.config import SparseConfig  # noqa: E402
from kernels.ops import plan_prefill  # noqa: E402
from kernels.paged import contiguous_to_paged  # noqa: E402
from kernels.triton_index import (  # noqa: E402
    IndexLaunch,
    block_means,
    build_index,
    build_index_with_status,
    select_and_compact,
)

MIB = 2**20


@dataclass(frozen=True)
class IndexBenchConfig:
    lengths: tuple[int, ...] = (4096, 8192, 16384, 32768, 65536, 131072)
    num_qo_heads: int = 32
    num_kv_heads: int = 8
    head_dim: int = 128
    page_size: int = 64
    dtype: str = "bfloat16"
    target_density: float | None = None  # None: the generator's paper-like default
    check_length: int = 4096  # compare with the reference at this length (0: skip)
    sweep: bool = False
    warmup_ms: int = 25
    rep_ms: int = 100
    seed: int = 0
    device: str = "cuda"


@dataclass
class IndexResult:
    seqlen: int
    means_ms: float
    select_ms: float
    total_ms: float
    total_sync_ms: float
    means_gbps: float
    index_tflops: float
    peak_extra_mib: float | None
    out_mib: float
    nnz: int
    density: float
    inputs: str
    sweep: list[dict] = field(default_factory=list)


def _time_ms(fn, cfg: IndexBenchConfig) -> float:
    if cfg.device == "cuda":
        return float(triton.testing.do_bench(fn, warmup=cfg.warmup_ms, rep=cfg.rep_ms,
                                             return_mode="median"))
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _inputs(cfg: IndexBenchConfig, seqlen: int):
    dtype = getattr(torch, cfg.dtype)
    try:
        from kernels.synthetic import structured_qkv

        q, k, v = structured_qkv(
            seqlen, batch=1, num_qo_heads=cfg.num_qo_heads, num_kv_heads=cfg.num_kv_heads,
            head_dim=cfg.head_dim, target_density=cfg.target_density, dtype=dtype,
            device=cfg.device, seed=cfg.seed,
        )
        kind = "structured"
    except ImportError as err:
        warnings.warn(f"kernels.synthetic unavailable ({err}); timing random Gaussian inputs")
        gen = torch.Generator(device=cfg.device).manual_seed(cfg.seed)
        shape = (1, seqlen)
        q = torch.randn(*shape, cfg.num_qo_heads, cfg.head_dim, generator=gen, device=cfg.device, dtype=dtype)
        k = torch.randn(*shape, cfg.num_kv_heads, cfg.head_dim, generator=gen, device=cfg.device, dtype=dtype)
        v = torch.randn(*shape, cfg.num_kv_heads, cfg.head_dim, generator=gen, device=cfg.device, dtype=dtype)
        kind = "randn"
    k_pages, table = contiguous_to_paged(k, cfg.page_size)
    v_pages, _ = contiguous_to_paged(v, cfg.page_size)
    del k, v
    q = q.reshape(seqlen, cfg.num_qo_heads, cfg.head_dim)
    i32 = dict(dtype=torch.int32, device=cfg.device)
    plan = plan_prefill(q, k_pages, v_pages, table, torch.tensor([0, seqlen], **i32),
                        torch.tensor([seqlen], **i32), SparseConfig())
    return q, k_pages, v_pages, plan, kind


def _index_gemm_work(plan) -> int:
    """(packed row, visible block) pairs scored: each costs 2 d FLOPs and one exp2."""
    bs = plan.config.block_size
    pairs = 0
    for b in range(plan.batch_size):
        for tile in range(plan.qtiles[b]):
            _, rows, _, pmax = plan.tile_rows(b, tile)
            pairs += rows * ((pmax + plan.prefix(b)) // bs + 1)
    return pairs * plan.num_kv_heads


def _density(index, plan) -> float:
    try:
        from kernels.fidelity import index_density
    except ImportError:
        return reference.density(index, plan)
    return index_density(index, plan)


def _check(q, k_pages, v_pages, plan) -> str:
    got = build_index(q, k_pages, v_pages, plan)
    want = reference.build_index(q, k_pages, v_pages, plan)
    if torch.equal(got.seg_offsets, want.seg_offsets) and torch.equal(got.kv_tiles, want.kv_tiles):
        return "identical CSR"
    same = int((got.seg_offsets == want.seg_offsets).sum())
    return (f"CSR differs (threshold ties?): nnz {int(got.seg_offsets[-1])} vs "
            f"{int(want.seg_offsets[-1])}, {same}/{plan.num_segments + 1} equal offsets")


SWEEP = (
    IndexLaunch(),
    IndexLaunch(programs_per_sm=2),
    # the default caps the bf16 score kernel at 168 registers (166, no stack: three 4-warp programs
    # an SM); uncapped it needs 181 since 17b5ff8 (benchmarks/index_resources.py), two an SM
    IndexLaunch(score_maxnreg=None),
    IndexLaunch(score_stages=3, programs_per_sm=2),
    IndexLaunch(score_maxnreg=128, programs_per_sm=4),
    IndexLaunch(block_n=128, score_warps=8, score_maxnreg=128, programs_per_sm=2),
    IndexLaunch(block_n=128, score_warps=8, score_stages=3, programs_per_sm=1),
    IndexLaunch(block_n=64, score_warps=8, programs_per_sm=2),
)


def index_parts(q, k_pages, v_pages, plan, time_ms, *, descales=None) -> dict:
    """The index stage whole and by parts, in ms by ``time_ms(fn)``: ``means``, ``select``
    (score + threshold + compaction, ``capacity`` given: no host sync), ``total`` (both, no
    sync) and ``total_sync`` (``capacity=None``: one read of nnz, what ``build_index_planned``
    and so bench_peer's ``index_ms`` run), plus ``nnz``. One function, so that bench_index and
    ``bench_peer.py --index-parts`` time the same calls."""
    _, required = build_index_with_status(q, k_pages, v_pages, plan, descales=descales)
    nnz = int(required)
    means, kbar_q = block_means(k_pages, v_pages, plan, q.dtype, descales=descales)
    return {
        "nnz": nnz,
        "means_ms": time_ms(lambda: block_means(k_pages, v_pages, plan, q.dtype, descales=descales)),
        "select_ms": time_ms(lambda: select_and_compact(q, plan, means, kbar_q, capacity=nnz, descales=descales)),
        "total_ms": time_ms(lambda: build_index_with_status(q, k_pages, v_pages, plan, capacity=nnz,
                                                            descales=descales)),
        "total_sync_ms": time_ms(lambda: build_index(q, k_pages, v_pages, plan, descales=descales)),
    }


def run_one(cfg: IndexBenchConfig, seqlen: int, sweep: bool) -> IndexResult:
    q, k_pages, v_pages, plan, kind = _inputs(cfg, seqlen)
    if cfg.check_length and seqlen == cfg.check_length:
        print(f"check at L={seqlen}: {_check(q, k_pages, v_pages, plan)}", flush=True)
    cuda = cfg.device == "cuda"

    # peak extra memory of the capacity=None call (outputs + scratch)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    index, required = build_index_with_status(q, k_pages, v_pages, plan)
    peak = (torch.cuda.max_memory_allocated() - before) / MIB if cuda else None
    nnz = int(required)
    out_bytes = sum(t.numel() * t.element_size() for t in (
        index.seg_offsets, index.kv_tiles, index.means.kbar, index.means.vbar))
    density = _density(index, plan)
    capacity = nnz  # a serving step would use a bound; this times the same kernels, no sync
    del index

    parts = index_parts(q, k_pages, v_pages, plan, lambda fn: _time_ms(fn, cfg))
    t_means, t_select, t_total, t_sync = (parts[k] for k in ("means_ms", "select_ms", "total_ms", "total_sync_ms"))

    pairs = _index_gemm_work(plan)
    kv_bytes = 2 * seqlen * cfg.num_kv_heads * cfg.head_dim * q.element_size()
    result = IndexResult(
        seqlen=seqlen, means_ms=t_means, select_ms=t_select, total_ms=t_total,
        total_sync_ms=t_sync, means_gbps=kv_bytes / t_means / 1e6,
        index_tflops=2 * cfg.head_dim * pairs / t_select / 1e9,
        peak_extra_mib=peak, out_mib=out_bytes / MIB, nnz=nnz, density=density, inputs=kind,
    )
    if sweep:
        means, kbar_q = block_means(k_pages, v_pages, plan, q.dtype)
        for launch in SWEEP:
            ms = _time_ms(lambda: select_and_compact(q, plan, means, kbar_q, capacity=capacity,
                                                     launch=launch), cfg)
            result.sweep.append({"launch": asdict(launch), "select_ms": ms})
            print(f"  sweep L={seqlen}: {ms:7.3f} ms  {launch}", flush=True)
    return result


def _loaded_resources() -> list[dict]:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import index_resources
    from kernels import triton_index

    return [r for fn in (triton_index._block_means_kernel, triton_index._score_select_kernel,
                         triton_index._compact_kernel) for r in index_resources.launched_resources(fn)]


def _table(rows: list[IndexResult]) -> str:
    head = (f"{'L':>7} {'means ms':>9} {'GB/s':>6} {'select ms':>10} {'TFLOP/s':>8} "
            f"{'total ms':>9} {'sync ms':>8} {'peak MiB':>9} {'out MiB':>8} {'nnz':>10} "
            f"{'density':>8}")
    lines = [head, "-" * len(head)]
    for r in rows:
        peak = f"{r.peak_extra_mib:9.1f}" if r.peak_extra_mib is not None else f"{'-':>9}"
        lines.append(
            f"{r.seqlen:>7} {r.means_ms:9.3f} {r.means_gbps:6.0f} {r.select_ms:10.3f} "
            f"{r.index_tflops:8.1f} {r.total_ms:9.3f} {r.total_sync_ms:8.3f} {peak} "
            f"{r.out_mib:8.1f} {r.nnz:>10} {r.density:8.4f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=None)
    parser.add_argument("--sweep", action="store_true", help="time score-kernel launch variants at the largest length")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--target-density", type=float, default=None)
    parser.add_argument("--check-length", type=int, default=None)
    parser.add_argument("--cpu-smoke", action="store_true",
                        help="--device cpu, L=256, 4/1 heads, d=64 (set TRITON_INTERPRET=1)")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "index_h200.json")
    args = parser.parse_args(argv)
    cfg = IndexBenchConfig(device=args.device, sweep=args.sweep, target_density=args.target_density)
    if args.cpu_smoke:
        cfg = replace(cfg, device="cpu", lengths=(256,), num_qo_heads=4, num_kv_heads=1, head_dim=64)
    if args.lengths:
        cfg = replace(cfg, lengths=tuple(args.lengths))
    cfg = replace(cfg, check_length=args.check_length if args.check_length is not None
                  else min(cfg.lengths))
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device (use --device cpu with TRITON_INTERPRET=1 to smoke-test)")

    rows = []
    for seqlen in cfg.lengths:
        rows.append(run_one(cfg, seqlen, sweep=cfg.sweep and seqlen == max(cfg.lengths)))
        print(f"L={seqlen} done: total {rows[-1].total_ms:.3f} ms", flush=True)
        if cfg.device == "cuda":
            torch.cuda.empty_cache()

    gpu = torch.cuda.get_device_name() if cfg.device == "cuda" else "cpu (interpreter)"
    report = {
        "benchmark": "index stage (means + score/select/compact)",
        "gpu": gpu,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": git_commit(),
        "config": asdict(cfg),
        "launch": asdict(IndexLaunch()),
        # what the driver loaded: whether the launch's programs_per_sm all fit an SM (#38)
        "kernels_loaded": _loaded_resources(),
        "rows": [asdict(r) for r in rows],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"\nwrote {args.out}")
    print(f"{gpu}, torch {torch.__version__}, triton {triton.__version__}, B=1, "
          f"Hq={cfg.num_qo_heads}, Hkv={cfg.num_kv_heads}, d={cfg.head_dim}, {cfg.dtype}, "
          f"page {cfg.page_size}, {rows[0].inputs if rows else '-'} inputs")
    print(_table(rows))


if __name__ == "__main__":
    main()
