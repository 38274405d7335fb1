"""The prefill's fused memory-bound ops against their unfused sequences, as fractions of the memory
roofline (issue #50).

Each op at one layer of a ``--tokens``-token prefill of Llama-3.1-8B's shape (hidden 4096, MLP 14336,
32/8 heads, d 128), bf16:

- ``silu_mul_quant`` (``kernels.fp8_gemm.silu_mul_quant``; per 128-wide group: ``fp8_block``, per
  token: ``fp8_channel``) against ``kernels.elementwise.silu_mul`` then ``quantize_activation``;
- ``rms_norm_quant`` (``kernels.fp8_gemm.rms_norm_quant``) against ``rms_norm`` then
  ``quantize_activation``, and the plain ``rms_norm`` (bf16 weights' norm) alone;
- ``rope_kv`` (``kernels.rope_kv.rope_kv_write``: RoPE of q and k and the paged K/V write; bf16
  pool, and the e4m3 pool with q's amax) against ``kernels.elementwise.rotary`` of q and k (with
  ``fp8_gemm.rotary_amax`` for q on the e4m3 pool) then ``KVTensors.write`` (the pool's own write:
  ``index_copy_`` for bf16, ``triton_fp8.write_pages`` for e4m3), slots shuffled over the pool.

Every fused result is checked equal (bytes) to the unfused one first; ``rms_norm_quant``'s ``y`` within
``Y_ULPS`` = 2 bf16 ulps of ``rms_norm``'s (its rows are reduced in another order, and y rounds twice)
and its quantization equal, byte for byte, to ``quantize_activation`` of that ``y`` (``AGREE``).
``differs`` says where a result is not byte-equal. Roofline: the bytes the op
must move (one read of each input, one write of each output: the fused op's traffic) over the
device's HBM copy bandwidth measured in the same run (``copy_gbps``: a 2 GiB device-to-device
``copy_``, read + write counted), and over the H200 ceiling the per-op profile uses (4.26 TB/s,
``benchmarks/profile_prefill.py``'s ``PEAKS``): ``x_copy`` and ``x_h200`` = time / roofline time
(1.0 at the ceiling). On an H100 ``x_h200`` cannot go below ~1.4 (its copy bandwidth is ~3 TB/s):
compare ``x_copy`` across devices.

Timing: the median of ``triton.testing.do_bench`` (CUDA); ``--cpu-smoke`` runs tiny shapes under
``TRITON_INTERPRET=1`` with a wall-clock median (checks the script; the numbers mean nothing).

Usage (GPU, ``PYTHONPATH=$PWD``): ``python3 benchmarks/bench_fused_ops.py [--tokens 32768]``; prints a
table and writes ``benchmarks/results/fused_ops_<gpu>.json`` (``--out``).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from evals.report import git_commit  # noqa: E402
from kernels import elementwise as ew  # noqa: E402
from kernels import fp8_gemm, rope_kv  # noqa: E402
from kernels.fp8 import FP8_DTYPE  # noqa: E402
from kv_cache import KVPoolConfig  # noqa: E402
from kv_cache.tensors import KVTensors  # noqa: E402

H200_HBM_BYTES_PER_S = 4.26e12  # benchmarks/profile_prefill.py PEAKS (/work/shared/BASELINES.md)


@dataclasses.dataclass(frozen=True)
class Shape:
    hidden: int = 4096
    intermediate: int = 14336
    q_heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    page_size: int = 64


SMOKE_SHAPE = Shape(hidden=256, intermediate=384, q_heads=4, kv_heads=2, head_dim=64, page_size=16)


@dataclasses.dataclass(frozen=True)
class BenchConfig:
    tokens: int = 32768
    shape: Shape = Shape()
    device: str = "cuda"
    repeats: int = 20  # CPU smoke only: wall-clock repeats (CUDA: do_bench's own)


@dataclasses.dataclass(frozen=True)
class Row:
    op: str
    variant: str
    fused_ms: float
    unfused_ms: float | None  # None: nothing to fuse (the op's roofline only)
    speedup: float | None
    gbytes: float  # the op's minimum traffic (the fused op's)
    roofline_ms_copy: float
    x_copy: float
    roofline_ms_h200: float
    x_h200: float
    equal: bool
    differs: str = ""  # where a fused result is not byte-equal: which part, how many elements, how far


def timer(device: str, repeats: int):
    if device == "cuda":
        import triton.testing

        return lambda fn: triton.testing.do_bench(fn, return_mode="median")

    def wall_ms(fn):
        fn()
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)

    return wall_ms


def copy_bytes_per_s(device: str, time_ms) -> float:
    """HBM copy bandwidth of this device (read + write bytes over the median copy time)."""
    n = (1 << 30) if device == "cuda" else (1 << 20)
    src = torch.empty(n, dtype=torch.int16, device=device)
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src))
    return 2 * src.numel() * src.element_size() / (ms * 1e-3)


def _bytes_equal(a, b) -> bool:
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(_bytes_equal(x, y) for x, y in zip(a, b))
    if isinstance(a, fp8_gemm.Fp8Activation):
        return _bytes_equal((a.x8, a.scale), (b.x8, b.scale))
    return a.shape == b.shape and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def _parts(a) -> list:
    if isinstance(a, (tuple, list)):
        return [p for x in a for p in _parts(x)]
    if isinstance(a, fp8_gemm.Fp8Activation):
        return _parts((a.x8, a.scale))
    return [a]


def differences(a, b) -> str:
    """Where ``a`` and ``b`` (tensors, Fp8Activations or tuples of them) differ: per differing
    part (in :func:`_bytes_equal`'s order: an activation is its e4m3 values then its scales), the
    elements that differ and the largest absolute difference in float32; "" when byte-equal."""
    out = []
    for i, (x, y) in enumerate(zip(_parts(a), _parts(b))):
        if _bytes_equal(x, y):
            continue
        if x.shape != y.shape:
            out.append(f"part {i}: shape {tuple(x.shape)} vs {tuple(y.shape)}")
            continue
        xf, yf = x.float(), y.float()
        bad = xf != yf
        out.append(f"part {i}: {int(bad.sum())} of {x.numel()} differ, max |diff| {float((xf - yf).abs().max()):.3g}")
    return "; ".join(out)


def ulps_apart(a: torch.Tensor, b: torch.Tensor) -> float:
    """The largest ``|a - b|`` in units of ``b``'s last place (bf16: 8 significant bits, so the ulp
    of ``m * 2**e``, ``0.5 <= m < 1``, is ``2**(e - 8)``); infinite for different shapes."""
    if a.shape != b.shape:
        return math.inf
    bf = b.float()
    ulp = torch.ldexp(torch.ones_like(bf), torch.frexp(bf).exponent - 8)
    return float(((a.float() - bf).abs() / ulp).max()) if a.numel() else 0.0


# y = w * bf16(x * inv): the two norms' rows are reduced in different orders, so the normed value
# may round one ulp apart, and the product with the weight rounds again: at most 2 ulps of y
Y_ULPS = 2


def rms_norm_quant_agrees(fused, unfused) -> bool:
    """The fused RMSNorm + quantization against the unfused sequence: ``y`` within
    :data:`Y_ULPS` of ``rms_norm``'s (the H100 run of session 48: 462 of 134M elements differ, by
    2 ulps at most), and what the fusion must not change, the quantization of its own ``y``,
    byte for byte."""
    (y, act), (y_ref, _) = fused, unfused
    return (ulps_apart(y, y_ref) <= Y_ULPS
            and _bytes_equal(act, fp8_gemm.quantize_activation(y, act.group, backend="triton")))


def rms_norm_quant_explain(fused, unfused) -> str:
    """Which half of :func:`rms_norm_quant_agrees` fails, and by how much."""
    (y, act), (y_ref, _) = fused, unfused
    own = differences(act, fp8_gemm.quantize_activation(y, act.group, backend="triton"))
    return f"y: at most {ulps_apart(y, y_ref):.3g} ulp from rms_norm's; its quantization: {own or 'equal'}"


# how a fused result is checked against its unfused sequence (default: byte for byte), and how a
# failed check is explained (default: differences)
AGREE = {"rms_norm_quant": rms_norm_quant_agrees}
EXPLAIN = {"rms_norm_quant": rms_norm_quant_explain}


def cases(cfg: BenchConfig, gen: torch.Generator):
    """(op, variant, fused fn, unfused fn or None, minimum bytes): each fn returns what is compared."""
    s, t, dev = cfg.shape, cfg.tokens, cfg.device
    bf = torch.bfloat16

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(dev, bf)

    out = []
    gate, up = randn(t, s.intermediate), randn(t, s.intermediate)
    for variant, group in (("group128", fp8_gemm.BLOCK), ("per_token", None)):
        ng = 1 if group is None else s.intermediate // group
        out.append(("silu_mul_quant", variant,
                    lambda g=group: fp8_gemm.silu_mul_quant(gate, up, g, backend="triton"),
                    lambda g=group: fp8_gemm.quantize_activation(ew.silu_mul(gate, up, backend="triton"), g,
                                                                 backend="triton"),
                    t * s.intermediate * (2 * 2 + 1) + t * ng * 4))
    x = randn(t, s.hidden)
    w = (1 + 0.1 * torch.randn(s.hidden, generator=gen)).to(dev, bf)
    out.append(("rms_norm_quant", "group128",
                lambda: fp8_gemm.rms_norm_quant(x, w, 1e-5, fp8_gemm.BLOCK, backend="triton"),
                lambda: (lambda y: (y, fp8_gemm.quantize_activation(y, fp8_gemm.BLOCK, backend="triton")))(
                    ew.rms_norm(x, w, 1e-5, backend="triton")),
                t * s.hidden * (2 + 2 + 1) + t * (s.hidden // fp8_gemm.BLOCK) * 4))
    # the bf16 weights' norm: nothing to fuse it with, its roofline only
    out.append(("rms_norm", "bf16", lambda: ew.rms_norm(x, w, 1e-5, backend="triton"), None, t * s.hidden * 2 * 2))
    d = s.head_dim
    q, k, v = randn(t, s.q_heads, d), randn(t, s.kv_heads, d), randn(t, s.kv_heads, d)
    inv = 1.0 / (500000.0 ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    ang = torch.arange(t, dtype=torch.float64)[:, None] * inv[None]
    ang = torch.cat([ang, ang], dim=1)
    cos, sin = ang.cos().to(dev, bf), ang.sin().to(dev, bf)
    pages = -(-t // s.page_size) + 1
    slots = torch.randperm(pages * s.page_size, generator=gen)[:t].to(dev)
    for variant, dtype in (("bf16_pool", bf), ("e4m3_pool", FP8_DTYPE)):
        pools = [KVTensors(KVPoolConfig(num_layers=1, num_kv_heads=s.kv_heads, head_dim=d, page_size=s.page_size,
                                        dtype=dtype, device=dev, num_pages=pages)) for _ in range(2)]
        fp8 = dtype == FP8_DTYPE
        for p in pools:
            if fp8:
                p.set_scales(0, 0.01, 0.01)

        def fused(p=pools[0], fp8=fp8):
            r = rope_kv.rope_kv_write(q, k, v, cos, sin, slots, p.k[0], p.v[0],
                                      k_descale=p.k_scale[0] if fp8 else None,
                                      v_descale=p.v_scale[0] if fp8 else None, q_amax=fp8, backend="triton")
            return (*(r if fp8 else (r,)), p.k_raw, p.v_raw)

        def unfused(p=pools[1], fp8=fp8):
            qr = fp8_gemm.rotary_amax(q, cos, sin, backend="triton") if fp8 else (ew.rotary(q, cos, sin, backend="triton"),)
            p.write(0, slots, ew.rotary(k, cos, sin, backend="triton"), v, backend="triton" if fp8 else "auto")
            return (*qr, p.k_raw, p.v_raw)

        kv_elem = 1 if fp8 else 2
        nbytes = t * (2 * s.q_heads * d * 2 + 2 * s.kv_heads * d * 2 + 2 * d * 2 + 2 * s.kv_heads * d * kv_elem)
        out.append(("rope_kv", variant, fused, unfused, nbytes))
    return out


def run(cfg: BenchConfig) -> dict:
    time_ms = timer(cfg.device, cfg.repeats)
    copy_bps = copy_bytes_per_s(cfg.device, time_ms)
    gen = torch.Generator().manual_seed(0)
    rows = []
    with torch.no_grad():
        for op, variant, fused, unfused, nbytes in cases(cfg, gen):
            a, b = (None, None) if unfused is None else (fused(), unfused())
            equal = unfused is None or AGREE.get(op, _bytes_equal)(a, b)
            differs = "" if a is None else differences(a, b)
            if not equal and op in EXPLAIN:
                differs += " (" + EXPLAIN[op](a, b) + ")"
            f = time_ms(fused)
            u = time_ms(unfused) if unfused is not None else None
            roof_copy, roof_h200 = 1e3 * nbytes / copy_bps, 1e3 * nbytes / H200_HBM_BYTES_PER_S
            rows.append(Row(op, variant, f, u, None if u is None else u / f, nbytes / 1e9, roof_copy,
                            f / roof_copy, roof_h200, f / roof_h200, equal, differs))
    return {"copy_gbps": copy_bps / 1e9, "rows": [dataclasses.asdict(r) for r in rows]}


def table(result: dict) -> str:
    lines = [f"HBM copy {result['copy_gbps']:.0f} GB/s (this device), H200 ceiling {H200_HBM_BYTES_PER_S / 1e9:.0f} GB/s",
             "| op | variant | fused ms | unfused ms | speedup | GB | x copy roof | x H200 roof | equal |",
             "|---|---|---:|---:|---:|---:|---:|---:|---|"]
    for r in result["rows"]:
        unfused = "-" if r["unfused_ms"] is None else f"{r['unfused_ms']:.3f}"
        speedup = "-" if r["speedup"] is None else f"{r['speedup']:.2f}"
        lines.append(f"| {r['op']} | {r['variant']} | {r['fused_ms']:.3f} | {unfused} | {speedup} "
                     f"| {r['gbytes']:.3f} | {r['x_copy']:.2f} | {r['x_h200']:.2f} | {'yes' if r['equal'] else 'NO'} |")
    return "\n".join(lines)


def _gpu_tag() -> str:
    name = torch.cuda.get_device_name().lower()
    return next((tag for tag in ("h200", "h100", "a100") if tag in name), "gpu")


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=None, help=f"tokens of the prefill layer (default {BenchConfig.tokens})")
    ap.add_argument("--out", default=None, help="JSON path (default benchmarks/results/fused_ops_<gpu>.json)")
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on CPU under TRITON_INTERPRET=1")
    args = ap.parse_args(argv)
    if args.tokens is not None and args.tokens < 1:
        ap.error(f"--tokens: expected >= 1, got {args.tokens}")
    if args.cpu_smoke:
        if os.environ.get("TRITON_INTERPRET") != "1":
            ap.error("--cpu-smoke: set TRITON_INTERPRET=1")
        cfg = BenchConfig(tokens=args.tokens or 40, shape=SMOKE_SHAPE, device="cpu", repeats=2)
        out = Path(args.out) if args.out else None
    else:
        if not torch.cuda.is_available():
            ap.error("needs a CUDA GPU (or --cpu-smoke under TRITON_INTERPRET=1)")
        cfg = BenchConfig(tokens=args.tokens or BenchConfig.tokens)
        out = Path(args.out) if args.out else ROOT / "benchmarks" / "results" / f"fused_ops_{_gpu_tag()}.json"
    result = {"benchmark": "fused memory-bound ops vs their unfused sequences, fraction of roofline",
              "config": dataclasses.asdict(cfg), "env": _env(cfg.device), **run(cfg)}
    print(table(result), flush=True)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {out}")
    if not all(r["equal"] for r in result["rows"]):
        raise SystemExit("bench_fused_ops: a fused result differs from its unfused sequence (equal: NO): "
                         + "; ".join(f"{r['op']} {r['variant']}: {r['differs']}" for r in result["rows"] if not r["equal"]))
    return result


def _env(device: str) -> dict:
    import triton

    return {"gpu": torch.cuda.get_device_name() if device == "cuda" else "cpu", "torch": torch.__version__,
            "triton": triton.__version__, "commit": git_commit(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": "PYTHONPATH=$PWD python3 benchmarks/bench_fused_ops.py " + " ".join(sys.argv[1:])}


if __name__ == "__main__":
    main()
