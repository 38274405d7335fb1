"""Fused RMSNorm / SiLU-and-multiply / RoPE against transformers' eager ops, by token count.

What a forward sees per call: ``n`` calls issued back to back, then one synchronize; time per
call = wall / n, the median of ``repeats``. With few tokens (decode: one per request) the GPU
work is tiny and this is the host's issue time (Python, checks, launches); with many tokens
(prefill) it is the kernels' memory traffic. The crossover is where the fused path starts to
pay, and what ``model_executor.fused`` uses to leave small batches to the eager modules.

Eager: ``LlamaRMSNorm.forward``, ``act_fn(gate) * up`` with ``nn.SiLU``, transformers'
``apply_rotary_pos_emb`` on the ``[1, H, T, d]`` views of the tokens-major q/k (the eager
attention's layout). Fused: ``kernels.elementwise`` (Triton) on the same inputs, checked against
the references first (RMSNorm/SiLU within 2 ulps, RoPE bit for bit).

Usage (H200, ``PYTHONPATH=$PWD``): ``python3 benchmarks/bench_elementwise.py``; prints a table and
writes ``benchmarks/results/elementwise_h200.json`` (``--out``). ``--cpu-smoke``: tiny sizes on
CPU under ``TRITON_INTERPRET=1`` (checks the script, times nothing meaningful; run it through
``tests/test_bench_elementwise.py``, whose conftest fixes triton 3.6's interpreter rounding of
fp32 -> bf16, or RoPE reads as MISMATCH).
"""

from __future__ import annotations

import argparse
import datetime
import json
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

TOKENS = (1, 8, 64, 256, 1024, 4096, 16384, 65536)
SHAPE = {"hidden": 4096, "intermediate": 14336, "q_heads": 32, "kv_heads": 8, "head_dim": 128}  # Llama-3.1-8B
SMOKE_SHAPE = {"hidden": 64, "intermediate": 96, "q_heads": 4, "kv_heads": 2, "head_dim": 16}


def per_call_s(fn, n: int, repeats: int, sync) -> float:
    fn()
    sync()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        sync()
        times.append((time.perf_counter() - t0) / n)
    return statistics.median(times)


def cases(t: int, shape: dict, device: str, dtype: torch.dtype, gen: torch.Generator):
    """(op, eager callable, fused callable, check of the fused output) at ``t`` tokens."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb

    h, i, d = shape["hidden"], shape["intermediate"], shape["head_dim"]
    x = torch.randn(t, h, generator=gen).to(device, dtype)
    norm = LlamaRMSNorm(h, eps=1e-5).to(device, dtype)
    with torch.no_grad():
        norm.weight.copy_((1 + 0.1 * torch.randn(h, generator=gen)).to(dtype))
    gate = torch.randn(t, i, generator=gen).to(device, dtype)
    up = torch.randn(t, i, generator=gen).to(device, dtype)
    act = torch.nn.SiLU()
    q = torch.randn(t, shape["q_heads"], d, generator=gen).to(device, dtype)
    k = torch.randn(t, shape["kv_heads"], d, generator=gen).to(device, dtype)
    inv = 1.0 / (500000.0 ** (torch.arange(0, d, 2, dtype=torch.float) / d))
    freqs = torch.arange(t).float()[:, None] * inv[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos().to(device, dtype), emb.sin().to(device, dtype)

    def eager_rope():
        return apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos[None], sin[None])

    def fused_rope():
        return ew.rotary(q, cos, sin, backend="triton"), ew.rotary(k, cos, sin, backend="triton")

    return [
        ("rms_norm", lambda: norm(x), lambda: ew.rms_norm(x, norm.weight, 1e-5, backend="triton"),
         lambda got: ew.max_ulps(got, ew.rms_norm_reference(x, norm.weight, 1e-5)) <= 2.0),
        ("silu_mul", lambda: act(gate) * up, lambda: ew.silu_mul(gate, up, backend="triton"),
         lambda got: ew.max_ulps(got, ew.silu_mul_reference(gate, up)) <= 2.0),
        ("rotary", eager_rope, fused_rope,
         lambda got: all(torch.equal(g, w[0].transpose(0, 1)) for g, w in zip(got, eager_rope()))),
    ]


def run(tokens, shape, device: str, n: int, repeats: int) -> dict:
    dtype = torch.bfloat16
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    gen = torch.Generator().manual_seed(0)
    rows = []
    with torch.no_grad():
        for t in tokens:
            for op, eager, fused, check in cases(t, shape, device, dtype, gen):
                ok = bool(check(fused()))
                e = per_call_s(eager, n, repeats, sync)
                f = per_call_s(fused, n, repeats, sync)
                rows.append({"op": op, "tokens": t, "eager_us": e * 1e6, "fused_us": f * 1e6,
                             "speedup": e / f, "ok": ok})
                print(f"{op:9s} T={t:6d} eager {e * 1e6:9.1f} us  fused {f * 1e6:9.1f} us  "
                      f"x{e / f:5.2f}  {'ok' if ok else 'MISMATCH'}", flush=True)
    return {"rows": rows, "crossover_tokens": crossover(rows)}


def crossover(rows: list[dict]) -> dict:
    """Per op, the fewest tokens from which the fused path is at least as fast at every measured
    larger count (``None``: never)."""
    out = {}
    for op in dict.fromkeys(r["op"] for r in rows):
        mine = sorted((r for r in rows if r["op"] == op), key=lambda r: r["tokens"])
        first = None
        for r in reversed(mine):
            if r["speedup"] < 1.0:
                break
            first = r["tokens"]
        out[op] = first
    return out


def env_info(device: str) -> dict:
    import triton
    import transformers

    return {"gpu": torch.cuda.get_device_name() if device == "cuda" else "cpu", "torch": torch.__version__,
            "triton": triton.__version__, "transformers": transformers.__version__, "commit": git_commit(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": "PYTHONPATH=$PWD python3 benchmarks/bench_elementwise.py " + " ".join(sys.argv[1:])}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default=None, help=f"comma-separated (default {','.join(map(str, TOKENS))})")
    ap.add_argument("--calls", type=int, default=200, help="calls per timing (back to back, one sync)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "elementwise_h200.json"))
    ap.add_argument("--cpu-smoke", action="store_true")
    args = ap.parse_args(argv)
    if args.calls < 1 or args.repeats < 1:
        ap.error("--calls and --repeats: expected >= 1")
    try:
        tokens = tuple(int(s) for s in args.tokens.split(",")) if args.tokens else None
    except ValueError:
        ap.error(f"--tokens: expected comma-separated integers, got {args.tokens!r}")
    if tokens is not None and (not tokens or min(tokens) < 1):
        ap.error(f"--tokens: expected counts >= 1, got {args.tokens!r}")
    if args.cpu_smoke:
        if os.environ.get("TRITON_INTERPRET") != "1":
            ap.error("--cpu-smoke: set TRITON_INTERPRET=1")
        device, shape, tokens = "cpu", SMOKE_SHAPE, tokens or (1, 8)
    else:
        if not torch.cuda.is_available():
            ap.error("needs a CUDA GPU (or --cpu-smoke under TRITON_INTERPRET=1)")
        device, shape, tokens = "cuda", SHAPE, tokens or TOKENS
    result = {"benchmark": "fused elementwise vs eager, time per call issued back to back",
              "env": env_info(device), "shape": shape, "dtype": "bfloat16", "calls": args.calls,
              "repeats": args.repeats, **run(tokens, shape, device, args.calls, args.repeats)}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"crossover (fewest tokens from which fused is never slower): {result['crossover_tokens']}")
    print(f"wrote {out}")
    if not all(r["ok"] for r in result["rows"]):
        raise SystemExit("bench_elementwise: a fused result disagrees with its reference (see MISMATCH)")
    return result


if __name__ == "__main__":
    main()
