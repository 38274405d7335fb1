"""Dense paged decode on the H200: time per decode step of one attention layer.

Our Triton kernel (``kernels.decode.paged_decode``: PackGQA + split-KV over shuffled 64-token
pages) against PyTorch SDPA on the same K/V already gathered into contiguous ``[B, Hkv, L, d]``
(the gather is not timed: SDPA gets the easier layout for free). Decode reads every key and
value once, so the figure of merit is HBM bandwidth: ``GB/s = K+V bytes / time``.

Checks correctness first (fp32 reference, bf16 SDPA error as the tolerance), then times:
``auto`` (the serving call: ``check_values=False``, ``max_seqlen_kv`` given, no host sync),
a sweep of fixed ``num_splits`` (to tune the automatic choice) and SDPA in two forms (native
GQA with ``enable_gqa=True``, and the flash backend on K/V repeated to every query head); the
faster SDPA form is the baseline.

Usage (H200, ``PYTHONPATH=$PWD``): ``python3 benchmarks/bench_decode.py``. Prints a table and
writes ``benchmarks/results/decode_h200.json`` (``--out`` elsewhere). Runs in about a minute.
``--cpu-smoke`` (``TRITON_INTERPRET=1``, CI): B=1,2 at 256 keys, 4/1 heads, d=64, one call per
timing, the same checks and JSON.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
import triton
from triton.testing import do_bench

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from evals.report import git_commit  # noqa: E402

from kernels.decode import paged_decode  # noqa: E402
from kernels.triton_decode import _num_sms, choose_num_splits  # noqa: E402


@dataclass(frozen=True)
class DecodeBenchConfig:
    batch_sizes: tuple[int, ...] = (1, 8)
    contexts: tuple[int, ...] = (32768, 131072)
    num_qo_heads: int = 32
    num_kv_heads: int = 8
    head_dim: int = 128
    page_size: int = 64
    dtype: str = "bfloat16"
    split_sweep: tuple[int, ...] = (1, 4, 8, 16, 32, 64)
    warmup_ms: int = 25
    rep_ms: int = 100
    seed: int = 0
    device: str = "cuda"  # "cpu" (with TRITON_INTERPRET=1 and tiny sizes) only smoke-tests the script


@dataclass
class DecodeResult:
    batch: int
    context: int
    kv_bytes: int
    auto_splits: int
    auto_us: float
    auto_gbps: float
    sdpa_us: float | None
    sdpa_form: str
    sdpa_gbps: float | None
    speedup_vs_sdpa: float | None
    sweep_us: dict[int, float] = field(default_factory=dict)
    best_splits: int = 0
    best_us: float = 0.0
    max_err: float = 0.0
    sdpa_err: float = 0.0
    lse_err: float = 0.0
    tflops: float = 0.0


def _bench(fn, cfg: DecodeBenchConfig) -> float:
    """Median milliseconds."""
    if cfg.device == "cpu":  # smoke test: one timed call
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    return do_bench(fn, warmup=cfg.warmup_ms, rep=cfg.rep_ms, return_mode="median")


def _fp32_reference(q, k, v, scale):
    """q [B, Hq, d], k/v [B, Hkv, L, d] contiguous -> out [B, Hq, d], lse [B, Hq] (fp32)."""
    bsz, hq, d = q.shape
    hkv = k.shape[1]
    qg = q.float().view(bsz, hkv, hq // hkv, d)
    s = torch.einsum("bhgd,bhld->bhgl", qg, k.float()) * scale
    lse = torch.logsumexp(s, dim=-1)
    out = torch.einsum("bhgl,bhld->bhgd", torch.softmax(s, dim=-1), v.float())
    return out.reshape(bsz, hq, d), lse.reshape(bsz, hq)


def run_one(cfg: DecodeBenchConfig, batch: int, context: int) -> DecodeResult:
    dev = torch.device(cfg.device)
    dtype = getattr(torch, cfg.dtype)
    hq, hkv, d, ps = cfg.num_qo_heads, cfg.num_kv_heads, cfg.head_dim, cfg.page_size
    gen = torch.Generator(device=dev).manual_seed(cfg.seed + batch * 7 + context)
    pages_per_seq = context // ps
    num_pages = batch * pages_per_seq
    k_pages = torch.randn(num_pages, ps, hkv, d, device=dev, dtype=dtype, generator=gen)
    v_pages = torch.randn(num_pages, ps, hkv, d, device=dev, dtype=dtype, generator=gen)
    q = torch.randn(batch, hq, d, device=dev, dtype=dtype, generator=gen)
    # shuffled pages, as a pool hands them out after some churn
    page_table = torch.randperm(num_pages, device=dev, generator=gen).to(torch.int32).view(batch, pages_per_seq)
    seqlens_kv = torch.full((batch,), context, dtype=torch.int32, device=dev)
    scale = d**-0.5

    def gathered(pages):  # [B, Hkv, L, d] contiguous, the layout SDPA wants
        x = pages[page_table.long()].view(batch, context, hkv, d)
        return x.transpose(1, 2).contiguous()

    k_c, v_c = gathered(k_pages), gathered(v_pages)

    def ours(num_splits: int = 0):
        return paged_decode(
            q, k_pages, v_pages, page_table, seqlens_kv, scale=scale, num_splits=num_splits,
            max_seqlen_kv=context, check_values=False,
        )

    def sdpa():  # native GQA: reads each K/V head once if the dispatched backend supports it
        return F.scaled_dot_product_attention(q[:, :, None], k_c, v_c, scale=scale, enable_gqa=True)[:, :, 0]

    def sdpa_flash_expanded(k_e, v_e):  # flash backend on K/V repeated to every query head
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            return F.scaled_dot_product_attention(q[:, :, None], k_e, v_e, scale=scale)[:, :, 0]

    # correctness first (validated call, auto splits)
    out, lse = paged_decode(q, k_pages, v_pages, page_table, seqlens_kv, scale=scale, max_seqlen_kv=context)
    ref_out, ref_lse = _fp32_reference(q, k_c, v_c, scale)
    max_err = (out.float() - ref_out).abs().max().item()
    lse_err = (lse - ref_lse).abs().max().item()
    try:
        sdpa_out = sdpa()
        sdpa_err = (sdpa_out.float() - ref_out).abs().max().item()
    except RuntimeError as exc:  # keep the run going; report the baseline as missing
        print(f"SDPA failed at B={batch} L={context}: {exc!r}"[:300], flush=True)
        sdpa_out, sdpa_err = None, float("nan")
    tol = 2 * (sdpa_err if sdpa_out is not None else 0.0) + 1e-3
    if not (max_err <= tol and lse_err <= 1e-3):
        raise SystemExit(
            f"decode mismatch at B={batch} L={context}: max_err {max_err:.3g} (tol {tol:.3g}), "
            f"lse_err {lse_err:.3g}"
        )
    del ref_out, ref_lse

    kv_bytes = 2 * batch * context * hkv * d * k_pages.element_size()
    auto_splits = choose_num_splits(batch, hkv, context, _num_sms(dev))
    auto_ms = _bench(lambda: ours(0), cfg)
    sweep = {s: _bench(lambda s=s: ours(s), cfg) * 1e3 for s in cfg.split_sweep}
    best_splits = min(sweep, key=sweep.get)
    sdpa_ms = _bench(sdpa, cfg) if sdpa_out is not None else None
    k_e = k_c.repeat_interleave(hq // hkv, dim=1)
    v_e = v_c.repeat_interleave(hq // hkv, dim=1)
    try:
        sdpa_flash_expanded(k_e, v_e)
        flash_ms = _bench(lambda: sdpa_flash_expanded(k_e, v_e), cfg)
    except RuntimeError as exc:
        print(f"SDPA flash (expanded) failed at B={batch} L={context}: {exc!r}"[:300], flush=True)
        flash_ms = None
    del k_e, v_e, k_c, v_c, k_pages, v_pages
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    # the baseline is the faster SDPA form
    if flash_ms is not None and (sdpa_ms is None or flash_ms < sdpa_ms):
        sdpa_ms, sdpa_form = flash_ms, "flash, K/V expanded to Hq"
    else:
        sdpa_form = "default dispatch, enable_gqa"
    flops = 4 * batch * hq * context * d
    return DecodeResult(
        batch=batch,
        context=context,
        kv_bytes=kv_bytes,
        auto_splits=auto_splits,
        auto_us=auto_ms * 1e3,
        auto_gbps=kv_bytes / auto_ms / 1e6,
        sdpa_us=None if sdpa_ms is None else sdpa_ms * 1e3,
        sdpa_form=sdpa_form if sdpa_ms is not None else "failed",
        sdpa_gbps=None if sdpa_ms is None else kv_bytes / sdpa_ms / 1e6,
        speedup_vs_sdpa=None if sdpa_ms is None else sdpa_ms / auto_ms,
        sweep_us=sweep,
        best_splits=best_splits,
        best_us=sweep[best_splits],
        max_err=max_err,
        sdpa_err=sdpa_err,
        lse_err=lse_err,
        tflops=flops / auto_ms / 1e9,
    )


def print_table(results: list[DecodeResult]) -> None:
    head = (
        f"{'B':>2} {'L':>7} {'KV MiB':>7} | {'splits':>6} {'ours us':>8} {'GB/s':>6} | "
        f"{'best S':>6} {'best us':>8} | {'SDPA us':>8} {'GB/s':>6} | {'speedup':>7} | {'max err':>8}"
    )
    print("\nDecode attention, one layer, Hq=32 Hkv=8 d=128 bf16 (--cpu-smoke: 4/1, d=64), page 64 (shuffled); SDPA on "
          "pre-gathered contiguous K/V (faster of enable_gqa and flash on expanded K/V); "
          "GB/s over the K/V bytes")
    print(head)
    print("-" * len(head))
    for r in results:
        sdpa_us = f"{r.sdpa_us:8.1f}" if r.sdpa_us is not None else f"{'n/a':>8}"
        sdpa_bw = f"{r.sdpa_gbps:6.0f}" if r.sdpa_gbps is not None else f"{'n/a':>6}"
        speed = f"{r.speedup_vs_sdpa:6.2f}x" if r.speedup_vs_sdpa is not None else f"{'n/a':>7}"
        print(
            f"{r.batch:>2} {r.context:>7} {r.kv_bytes / 2**20:7.0f} | {r.auto_splits:>6} {r.auto_us:8.1f} "
            f"{r.auto_gbps:6.0f} | {r.best_splits:>6} {r.best_us:8.1f} | {sdpa_us} {sdpa_bw} | "
            f"{speed} | {r.max_err:8.2e}"
        )


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny sizes on the CPU (set TRITON_INTERPRET=1)")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "decode_h200.json")
    args = ap.parse_args(argv)
    cfg = DecodeBenchConfig()
    if args.cpu_smoke:
        cfg = dataclasses.replace(cfg, batch_sizes=(1, 2), contexts=(256,), num_qo_heads=4,
                                  num_kv_heads=1, head_dim=64, split_sweep=(1, 2), device="cpu")
    elif not torch.cuda.is_available():
        raise SystemExit("bench_decode needs a CUDA GPU (--cpu-smoke for the CPU smoke run)")
    dev = torch.device(cfg.device)
    env = {
        "gpu": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu",
        "num_sms": _num_sms(dev),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": git_commit(),
        "command": " ".join(["PYTHONPATH=$PWD python3 benchmarks/bench_decode.py",
                             *(sys.argv[1:] if argv is None else argv)]),
    }
    print(env, flush=True)
    results = []
    for batch in cfg.batch_sizes:
        for context in cfg.contexts:
            r = run_one(cfg, batch, context)
            results.append(r)
            print(asdict(r), flush=True)

    print_table(results)
    path = args.out
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"env": env, "config": asdict(cfg), "results": [asdict(r) for r in results]}, indent=1))
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
