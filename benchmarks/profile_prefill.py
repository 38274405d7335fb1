"""Per-op profile of one prefill of the structured 8B-shaped model: where the TTFT goes, op by op,
and how far each op is from its own roofline (issue #39).

What runs: ``bench_ttft``'s TTFT path on the structured model (``--models structured`` there:
``build_structured_llama`` at Llama-3.1-8B's shape, a ``haystack_ids`` prompt, B = 1) for each
``--weight-dtype`` (``bf16``, ``fp8_tensor``, ``fp8_channel``, ``fp8_block``): page reservation,
``ModelRunner.prefill`` (fused ops, sparse attention, K/V into the pool, LM head on the last
position) and the greedy first token read back on the host. One warm run first (kernels compile,
shapes specialise; CUDA only), then one unprofiled timed run (``ttft_ms``), then one run under
``torch.profiler`` (``profiled_ms``: the profiler's own cost is the difference).

Attribution: the forward's steps run inside ``kernels.ranges.op_range`` ranges (``op::qkv_gemm``,
``op::norm``, ... in ``model_executor`` and the attention back-ends); this script adds
``op::embed`` and ``op::lm_head`` (module hooks) and ``op::sampling``. On CUDA each device
activity (kernel, memcpy, memset) is charged to the innermost range enclosing the host call that
launched it (the profiler's correlation ids: the runtime launch call, else the linked op); activities outside every range are
``unannotated``; ``host gaps`` is the wall time of the profiled run in which the GPU ran nothing
(wall minus the union of device activities: launch latency, host syncs, Python between kernels).
On CPU (``--device cpu``, the smoke test: the tiny 2-layer model, 128 tokens, float32, Triton
kernels under ``TRITON_INTERPRET=1``) an op's time is its range's host time less the ranges nested
in it, and ``unannotated`` the rest of the wall time. Either way the rows sum to the wall time of
the profiled run and the shares to 1.

What ran inside each range (``detail`` in the JSON, every op; ``--detail index,attention,...``
prints those ops' tables): on CUDA each device activity's name (kernel, memcpy, memset) with its
summed time and count, on CPU the range's direct host calls; the longest 12 per op. It answers
what an op's row holds besides its own kernel (docs/notes/attention_range_128k.md).

``correction`` is the host-launched preparation of the mean-correction operands (requantized or
hi/lo-split block means, the selected-block bitmap); the correction's own math runs inside the
attention kernel and is counted there.

Roofline per op (``roofline``): FLOPs and bytes moved by the op over the whole prefill, from the
model's shapes (``op_costs``: every term is written out there), and ``max(FLOPs / peak, bytes /
bandwidth)`` with the H200 ceilings measured in ``/work/shared/BASELINES.md`` (2026-11-30, one
H200, torch 2.11): bf16 GEMM 680 TFLOP/s, FP8 ``torch._scaled_mm`` 1272 TFLOP/s, HBM copy 4.26 TB/s.
``x roof`` = measured / roofline (1.0: at the ceiling). The attention's FLOPs count the pairs its
index selected in this run (``ModelRunner.index_tile_counts``). The CPU smoke run prints the same
columns against the same H200 ceilings (the numbers mean nothing there; the columns are tested).

Usage (H200, ``PYTHONPATH=$PWD``):
``python3 benchmarks/profile_prefill.py --length 131072 --weight-dtype bf16,fp8_channel,fp8_block``
(~3 minutes: one model build per weight dtype); ``--detail OPS`` prints what ran inside those ops'
ranges; ``--trace DIR`` also writes each run's Chrome
trace. ``--device cpu`` smoke-tests the script. Prints a table per weight dtype; writes
``benchmarks/results/profile_prefill_h200.json`` (CPU: a temp file).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
import bench_ttft as bt  # noqa: E402

from kernels.config import KV_TILE, Q_TILE  # noqa: E402
from kernels.ranges import OPS, PREFIX, op_range  # noqa: E402
from model_executor.runner import PrefillItem  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "profile_prefill_h200.json"
# /work/shared/BASELINES.md, "Ceilings" (measured on the lent H200, 2026-11-30)
PEAKS = {"bf16_flops": 680e12, "fp8_flops": 1272e12, "hbm_bytes_per_s": 4.26e12,
         "source": "/work/shared/BASELINES.md (H200, 2026-11-30): bf16 GEMM 8192^3 680 TFLOP/s, "
                   "fp8 torch._scaled_mm 1272 TFLOP/s, HBM copy 4.26 TB/s"}
OUTER = "profile::ttft"
UNANNOTATED = "unannotated"
HOST_GAPS = "host gaps"
DETAIL_NAME_CHARS = 120  # CUTLASS/Triton kernel names run to hundreds of characters
ROW_ORDER = OPS + (UNANNOTATED, HOST_GAPS)


@dataclasses.dataclass(frozen=True)
class ProfileConfig:
    length: int = 131072
    weight_dtypes: tuple[str, ...] = ("bf16", "fp8_channel", "fp8_block")
    device: str = "cuda"
    backend: str = "auto"
    kv_dtype: str = "model"
    trace_dir: str | None = None


# ---------------------------------------------------------------------------------------------
# attribution
# ---------------------------------------------------------------------------------------------


def _op_of(event) -> str | None:
    """The op of the innermost ``op::`` range enclosing ``event`` (itself included), else None."""
    e = event
    while e is not None:
        if e.name.startswith(PREFIX):
            return e.name[len(PREFIX):]
        e = e.cpu_parent
    return None


def _union_us(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def _is_device(e) -> bool:
    return getattr(e.device_type, "name", str(e.device_type)) in ("CUDA", "PrivateUse1", "XPU", "MTIA")


def attribute(events, outer: str = OUTER) -> dict:
    """Op times (us) of one profiled run from the profiler's events (see the module doc):
    ``{"wall_us", "device": bool, "ops": {name: us}}`` whose ``ops`` sum to ``wall_us``."""
    events = list(events)
    outers = [e for e in events if e.name == outer and not _is_device(e)]
    if len(outers) != 1:
        raise ValueError(f"events: expected one {outer!r} range, got {len(outers)}")
    root = outers[0]
    t0, t1 = root.time_range.start, root.time_range.end
    wall = t1 - t0
    ops: dict[str, float] = {}
    detail: dict[str, dict[str, list]] = {}  # op -> what ran in it -> [us, count]
    methods: dict[str, int] = {}  # device activities per way they were attributed (diagnostics)
    device = [e for e in events if _is_device(e) and not e.is_user_annotation
              and not e.name.startswith((PREFIX, "profile::"))]
    if device:
        # Which op a device activity belongs to, first way that answers:
        # 1. its host side: the runtime call that launched it (same CUPTI correlation id; placed
        #    in the host tree by time), else the frontend op it links to (torch's own
        #    association); the two id spaces are kept apart;
        # 2. the innermost device-side ``op::`` annotation around it (Kineto's
        #    gpu_user_annotation: a record_function range's span on the GPU stream).
        host_events = [e for e in events if not _is_device(e) and e.id]
        runtime = {e.id: e for e in host_events if getattr(e, "linked_correlation_id", 0) > 0}
        frontend = {e.id: e for e in host_events if getattr(e, "linked_correlation_id", 0) == 0}
        annotations = sorted(((e.time_range.start, e.time_range.end, e.name[len(PREFIX):]) for e in events
                              if _is_device(e) and e.name.startswith(PREFIX)), key=lambda r: r[1] - r[0])
        spans = []
        for e in device:
            a, b = max(e.time_range.start, t0), min(e.time_range.end, t1)
            if b <= a:
                continue
            spans.append((a, b))
            host = runtime.get(e.id) or frontend.get(getattr(e, "linked_correlation_id", 0))
            op = _op_of(host) if host is not None else None
            how = "host event"
            if op is None:
                mid = (e.time_range.start + e.time_range.end) / 2
                op = next((name for lo, hi, name in annotations if lo <= mid <= hi), None)  # shortest first
                how = "device annotation" if op is not None else UNANNOTATED
            key = op if op is not None else UNANNOTATED
            ops[key] = ops.get(key, 0.0) + (b - a)
            _add_detail(detail, key, e.name, b - a)
            methods[how] = methods.get(how, 0) + 1
        busy = _union_us(spans)
        # overlapping activities (another stream) count once in busy: scale them into it
        total = sum(ops.values())
        if total > busy > 0:
            ops = {k: v * busy / total for k, v in ops.items()}
        ops[HOST_GAPS] = max(0.0, wall - busy)
        return {"wall_us": wall, "device": True, "ops": ops, "attributed_by": methods, "detail": detail}
    ranges = [e for e in events if e.name.startswith(PREFIX) and not _is_device(e)
              and e.time_range.start >= t0 and e.time_range.end <= t1]

    def nested_range_us(e) -> float:
        out = 0.0
        for c in e.cpu_children:
            out += (c.time_range.end - c.time_range.start) if c.name.startswith(PREFIX) else nested_range_us(c)
        return out

    covered = 0.0
    for e in ranges:
        own = max(0.0, (e.time_range.end - e.time_range.start) - nested_range_us(e))
        name = e.name[len(PREFIX):]
        ops[name] = ops.get(name, 0.0) + own
        covered += own
        for c in e.cpu_children:  # the host calls the range made itself (nested ranges: their own rows)
            if not c.name.startswith(PREFIX):
                _add_detail(detail, name, c.name, c.time_range.end - c.time_range.start)
    ops[UNANNOTATED] = max(0.0, wall - covered)
    return {"wall_us": wall, "device": False, "ops": ops, "detail": detail}


def _add_detail(detail: dict, op: str, name: str, us: float) -> None:
    row = detail.setdefault(op, {}).setdefault(name[:DETAIL_NAME_CHARS], [0.0, 0])
    row[0] += us
    row[1] += 1


def detail_rows(attr: dict, top: int = 12) -> dict[str, list[dict]]:
    """Per op, what ran inside its range, longest first: device activities (kernel, memcpy,
    memset names) on CUDA, the range's direct host calls on CPU; ``us`` summed over the prefill
    (unscaled for overlap), ``calls`` how many."""
    out = {}
    for op, names in attr.get("detail", {}).items():
        ranked = sorted(names.items(), key=lambda kv: -kv[1][0])[:top]
        out[op] = [{"name": n, "us": us, "calls": calls} for n, (us, calls) in ranked]
    return out


# ---------------------------------------------------------------------------------------------
# rooflines
# ---------------------------------------------------------------------------------------------


def op_costs(config, tokens: int, weight_dtype: str, act_bytes: int, kv_bytes: int, *,
             selected_tiles: int | None, fp8_counts: dict, block_size: int) -> dict[str, tuple[float, float, bool]]:
    """``{op: (FLOPs, bytes, fp8_math)}`` of one prefill of ``tokens`` tokens (B = 1): the work
    each op must do at least (one read of its inputs, one write of its outputs)."""
    t, h, i = tokens, int(config.hidden_size), int(config.intermediate_size)
    hq, hkv = int(config.num_attention_heads), int(config.num_key_value_heads)
    d = int(getattr(config, "head_dim", None) or h // hq)
    layers, vocab = int(config.num_hidden_layers), int(config.vocab_size)
    e = act_bytes
    fp8 = weight_dtype.startswith("fp8")
    w = 1 if fp8 else e  # weight bytes per element
    a = 1 if fp8 else e  # the GEMM's activation operand: e4m3 for FP8 weights

    def gemm(n: int, k: int) -> tuple[float, float, bool]:
        return 2.0 * t * n * k * layers, float(layers * (t * k * a + n * k * w + t * n * e)), fp8

    qk_heads = hq + hkv
    out: dict[str, tuple[float, float, bool]] = {
        "embed": (0.0, float(2 * t * h * e), False),
        "qkv_gemm": gemm((hq + 2 * hkv) * d, h),
        "o_gemm": gemm(h, hq * d),
        "gate_up_gemm": gemm(2 * i, h),
        "down_gemm": gemm(h, i),
        # 2 norms a layer and the final one; FP8 layers' norms also write the e4m3 copy
        "norm": (0.0, float((2 * layers + 1) * t * h * 2 * e + (2 * layers * t * h if fp8 else 0)), False),
        "rope": (0.0, float(layers * t * (qk_heads * d * 2 * e + 2 * d * e)), False),
        "kv_write": (0.0, float(layers * t * 2 * hkv * d * (e + kv_bytes)), False),
        # RoPE with the K/V write (kernels.rope_kv): q, k, v, cos, sin read once, q and the
        # pool's K/V written once (the rotated k is never stored elsewhere)
        "rope_kv": (0.0, float(layers * t * (2 * hq * d * e + 2 * hkv * d * e + 2 * d * e + 2 * hkv * d * kv_bytes)),
                    False),
        # SiLU-mul reads gate and up and writes the product (bf16) or its e4m3 quantization
        "silu_mul": (0.0, float(layers * t * i * (2 * e + (1 if fp8 and fp8_counts.get("silu_quant") else e))), False),
        "lm_head": (2.0 * h * vocab, float(vocab * h * e), False),
        "sampling": (0.0, float(vocab * 4), False),
    }
    if fp8:  # inputs quantized by a separate pass: o_proj's always, down_proj's unless fused
        k_sum = hq * d + (0 if fp8_counts.get("silu_quant") else i)
        out["act_quant"] = (0.0, float(layers * t * k_sum * (e + 1)), False)
    if kv_bytes == 1:
        out["q_quant"] = (0.0, float(layers * t * hq * d * (e + 1)), False)
    if selected_tiles is not None:  # sparse: the (query row, key) pairs of the selected tiles
        pairs = float(selected_tiles) * Q_TILE * KV_TILE
        kv_read = float(selected_tiles) * KV_TILE * d * 2 * kv_bytes  # each tile's K and V
    else:  # dense (no index): every causal pair, K and V read once
        pairs = layers * hq * t * (t + 1) / 2
        kv_read = float(layers * hkv * t * d * 2 * kv_bytes)
    out["attention"] = (4.0 * d * pairs, float(layers * t * hq * d * 2 * e) + kv_read, kv_bytes == 1)
    blocks = -(-t // block_size)
    # index: q and k read once, block means scored against every earlier block mean
    out["index"] = (2.0 * d * hq * blocks * (blocks + 1) / 2 * layers, float(layers * t * qk_heads * d * e), False)
    out["correction"] = (0.0, float(layers * blocks * hkv * d * 4 * 2 * 2), False)
    return out


def roofline_ms(flops: float, nbytes: float, fp8_math: bool) -> float:
    peak = PEAKS["fp8_flops"] if fp8_math else PEAKS["bf16_flops"]
    return 1e3 * max(flops / peak, nbytes / PEAKS["hbm_bytes_per_s"])


def rows_of(attr: dict, costs: dict) -> list[dict]:
    total = sum(attr["ops"].values())
    rows = []
    for name in ROW_ORDER:
        if name not in attr["ops"]:
            continue
        ms = attr["ops"][name] / 1e3
        row = {"op": name, "ms": ms, "share": attr["ops"][name] / total if total else 0.0}
        if name in costs:
            flops, nbytes, fp8_math = costs[name]
            roof = roofline_ms(flops, nbytes, fp8_math)
            row.update(gflop=flops / 1e9, gbytes=nbytes / 1e9, roofline_ms=roof,
                       bound="compute" if flops / (PEAKS["fp8_flops"] if fp8_math else PEAKS["bf16_flops"])
                       >= nbytes / PEAKS["hbm_bytes_per_s"] else "memory",
                       x_roofline=ms / roof if roof > 0 else None)
        rows.append(row)
    return rows


def detail_table(run: dict, ops: tuple[str, ...], layers: int | None = None) -> str:
    """What ran inside each of ``ops``' ranges (``--detail``), with ms per layer when ``layers``."""
    lines = [f"\n{run['weight_dtype']}: inside the ranges of {', '.join(ops)} "
             f"({'device activities' if run['device'] else 'host calls'})",
             "| op | what | ms | calls | ms / layer |", "|---|---|---:|---:|---:|"]
    for op in ops:
        for r in run.get("detail", {}).get(op, []):
            per = "-" if not layers else f"{r['us'] / 1e3 / layers:.3f}"
            lines.append(f"| {op} | {r['name']} | {r['us'] / 1e3:.3f} | {r['calls']} | {per} |")
    return "\n".join(lines)


def table(weight_dtype: str, run: dict) -> str:
    head = (f"\n{weight_dtype}: L={run['length']}  ttft {run['ttft_ms']:.1f} ms unprofiled, "
            f"{run['profiled_ms']:.1f} ms profiled ({'GPU activity' if run['device'] else 'host ranges'})\n"
            "| op | ms | share | GFLOP | GB | bound | roofline ms | x roof |\n|---|---:|---:|---:|---:|---|---:|---:|")
    lines = [head]
    for r in run["rows"]:
        if "roofline_ms" in r:
            lines.append(f"| {r['op']} | {r['ms']:.2f} | {r['share']:.3f} | {r['gflop']:.1f} | {r['gbytes']:.2f} | "
                         f"{r['bound']} | {r['roofline_ms']:.3f} | "
                         f"{'-' if r['x_roofline'] is None else format(r['x_roofline'], '.2f')} |")
        else:
            lines.append(f"| {r['op']} | {r['ms']:.2f} | {r['share']:.3f} | - | - | - | - | - |")
    lines.append(f"| total | {sum(r['ms'] for r in run['rows']):.2f} | {sum(r['share'] for r in run['rows']):.3f} "
                 "| | | | | |")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# one weight dtype
# ---------------------------------------------------------------------------------------------


def _hook_ranges(model) -> list:
    """``op::embed`` and ``op::lm_head`` around those modules (the model's own forward calls them)."""
    handles = []
    for name, module in (("embed", model.get_input_embeddings()), ("lm_head", model.get_output_embeddings())):
        stack: list = []

        def pre(_m, _args, name=name, stack=stack):
            r = op_range(name)
            r.__enter__()
            stack.append(r)

        def post(_m, _args, _out, stack=stack):
            stack.pop().__exit__(None, None, None)

        handles += [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]
    return handles


def _explain_unannotated(events, samples: int = 6) -> None:
    """Most device time found no op: print what the events hold, so the attribution can be
    fixed from one run's output (a profiler build whose ids or annotations differ)."""
    events = list(events)
    host = [e for e in events if not _is_device(e)]
    dev = [e for e in events if _is_device(e)]
    print(f"[attribution] host events {len(host)} ({sum(e.name.startswith(PREFIX) for e in host)} op ranges), "
          f"device events {len(dev)} ({sum(bool(e.is_user_annotation) for e in dev)} annotations, "
          f"{sum(e.name.startswith(PREFIX) for e in dev)} named op::)")
    by_id: dict = {}
    for e in host:
        by_id.setdefault(e.id, []).append(e)
    for e in [e for e in dev if not e.is_user_annotation][:samples]:
        linked = getattr(e, "linked_correlation_id", None)
        found = by_id.get(e.id, []) + (by_id.get(linked, []) if linked else [])
        chains = []
        for h in found[:2]:
            chain, p = [], h
            while p is not None and len(chain) < 6:
                chain.append(p.name)
                p = p.cpu_parent
            chains.append(" < ".join(chain))
        print(f"[attribution] kernel {e.name[:60]!r} id={e.id} linked={linked} -> {chains or 'no host event'}")


def profile_one(cfg: ProfileConfig, tcfg, device: torch.device, weight_dtype: str) -> dict:
    model = bt.build_model("structured", tcfg, device, weight_dtype)
    side = bt.Ours(model, tcfg, device, 1, cfg.length, 0)
    ids = bt.prompts("structured", tcfg, 1, cfg.length, model.config.vocab_size)
    runner, rid = side.runner, side.rids[0]
    handles = _hook_ranges(model)

    def ttft() -> list[int]:
        runner.ensure_capacity(rid, len(ids[0]))
        logits = runner.prefill([PrefillItem(rid, ids[0], 0)])
        with op_range("sampling"):
            return side.sampler(logits, [bt.GREEDY], [0]).tolist()

    try:
        if device.type == "cuda":  # warm: compiles, specialises (the CPU interpreter compiles nothing)
            ttft()
            side.release()
        ms, first = bt._timed(ttft, device)
        tiles = runner.index_tile_counts().get(rid)
        side.release()
        activities = [torch.profiler.ProfilerActivity.CPU]
        if device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        bt._sync(device)
        with torch.profiler.profile(activities=activities) as prof:
            t0 = time.perf_counter()
            with torch.profiler.record_function(OUTER):
                first_p = ttft()
                bt._sync(device)
            profiled_ms = (time.perf_counter() - t0) * 1e3
        side.release()
        if cfg.trace_dir:
            Path(cfg.trace_dir).mkdir(parents=True, exist_ok=True)
            prof.export_chrome_trace(str(Path(cfg.trace_dir) / f"prefill_{weight_dtype}_{cfg.length}.json"))
    finally:
        for h in handles:
            h.remove()
    events = prof.events()
    attr = attribute(events)
    if attr.get("attributed_by") and attr["ops"].get(UNANNOTATED, 0.0) > 0.5 * attr["wall_us"]:
        _explain_unannotated(events)
    act_bytes = next(model.parameters()).element_size()
    kv_bytes = side.pool.k.element_size()
    costs = op_costs(model.config, cfg.length, weight_dtype, act_bytes, kv_bytes,
                     selected_tiles=None if tiles is None else tiles[0], fp8_counts=runner.fp8_counts,
                     block_size=tcfg.block_size)
    run = {"weight_dtype": weight_dtype, "length": cfg.length, "layers": int(model.config.num_hidden_layers),
           "ttft_ms": ms, "profiled_ms": profiled_ms,
           "wall_us": attr["wall_us"], "device": attr["device"], "first_token": first[0],
           "first_token_profiled": first_p[0], "index_tiles": tiles, "fp8_counts": runner.fp8_counts,
           "fused_counts": runner.fused_counts, "rows": rows_of(attr, costs), "detail": detail_rows(attr)}
    del side, runner, model
    bt._cleanup(device)
    return run


# ---------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------


def parse_args(argv=None) -> tuple[ProfileConfig, argparse.Namespace]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--length", type=int, default=None, help="prompt length (default 131072; CPU 128)")
    ap.add_argument("--weight-dtype", type=str, default="bf16,fp8_channel,fp8_block",
                    help=f"comma-separated, from {list(bt.WEIGHT_DTYPES)}")
    ap.add_argument("--backend", choices=("auto", "triton", "cutlass"), default="auto")
    ap.add_argument("--kv-dtype", choices=("model", "fp8_e4m3"), default="model")
    ap.add_argument("--device", type=str, default="cuda", help="'cpu': the smoke test (tiny model, 128 tokens)")
    ap.add_argument("--trace", type=str, default=None, help="folder for each run's Chrome trace")
    ap.add_argument("--detail", type=str, default="",
                    help="comma-separated ops (e.g. index,attention,correction): also print what ran inside "
                         "their ranges (the JSON holds it for every op)")
    ap.add_argument("--out", type=str, default=None,
                    help=f"JSON path (default {RESULTS.relative_to(ROOT)}; on CPU a temp file)")
    args = ap.parse_args(argv)
    names = tuple(dict.fromkeys(w for w in args.weight_dtype.split(",") if w))
    for w in names:
        if w not in bt.WEIGHT_DTYPES:
            ap.error(f"--weight-dtype: expected names from {list(bt.WEIGHT_DTYPES)}, got {w!r}")
    if not names:
        ap.error("--weight-dtype: expected at least one weight dtype")
    for op in (o for o in args.detail.split(",") if o):
        if op not in ROW_ORDER:
            ap.error(f"--detail: expected op names from {list(ROW_ORDER)}, got {op!r}")
    cpu = torch.device(args.device).type == "cpu"
    length = args.length if args.length is not None else (128 if cpu else 131072)
    if length < 1:
        ap.error(f"--length: expected a positive prompt length, got {length}")
    return ProfileConfig(length=length, weight_dtypes=names, device=args.device, backend=args.backend,
                         kv_dtype=args.kv_dtype, trace_dir=args.trace), args


def bench_config(cfg: ProfileConfig):
    """bench_ttft's config for one B = 1 prompt of ``cfg.length`` (tiny on CPU, fused ops where
    Triton runs: the interpreter on CPU)."""
    from kernels import ops

    tcfg = bt.TTFTBenchConfig(models=("structured",), lengths=(cfg.length,), batches=(1,), decode_lengths=(),
                              sdpa=False, device=cfg.device, backend=cfg.backend, kv_dtype=cfg.kv_dtype,
                              weight_dtypes=cfg.weight_dtypes)
    device = torch.device(cfg.device)
    if device.type == "cpu":
        tcfg = dataclasses.replace(tcfg, **{**bt.TINY_OVERRIDES, "lengths": (cfg.length,), "batches": (1,),
                                            "decode_lengths": ()})
    fused = "on" if ops.triton_available(device) else "off"
    return dataclasses.replace(tcfg, fused_ops=fused)


def main(argv=None) -> dict:
    argv = sys.argv[1:] if argv is None else list(argv)
    cfg, args = parse_args(argv)
    device = bt.resolve_device(cfg.device, "profile_prefill")
    out_path = Path(args.out) if args.out else (RESULTS if device.type == "cuda"
                                                 else Path(tempfile.gettempdir()) / "profile_prefill_cpu.json")
    out_path.parent.mkdir(parents=True, exist_ok=True)
    tcfg = bench_config(cfg)
    env = bt._env(device, argv)
    env["command"] = "PYTHONPATH=$PWD python3 benchmarks/profile_prefill.py " + " ".join(argv)
    result = {"benchmark": "per-op profile of one prefill (structured 8B-shaped model, B=1)", "env": env,
              "config": dataclasses.asdict(cfg), "bench_ttft_config": dataclasses.asdict(tcfg), "peaks": PEAKS,
              "runs": []}
    for weight_dtype in cfg.weight_dtypes:
        run = profile_one(cfg, tcfg, device, weight_dtype)
        result["runs"].append(run)
        out_path.write_text(json.dumps(result, indent=1))  # keep what we have if killed
        print(table(weight_dtype, run), flush=True)
        detail = tuple(o for o in args.detail.split(",") if o)
        if detail:
            print(detail_table(run, detail, run["layers"]), flush=True)
    out_path.write_text(json.dumps(result, indent=1))
    print(f"\nwrote {out_path}")
    return result


if __name__ == "__main__":
    main()
