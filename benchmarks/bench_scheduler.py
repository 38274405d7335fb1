"""Prefill scheduling on CPU: TTFT of short prompts that arrive while long ones are chunked.

Runs the tiny built-in model (dense prefill, CPU) through ``PrefillEngine`` one forward at a
time, as a prefill replica's loop does (``prefill_worker.deployment.PrefillLoop``), with
prompts arriving at seeded wall-clock times: ``--longs`` long prompts one long-prefill apart
and ``--shorts`` short prompts at uniform random times over that span. Four cells:

- ``batch``: the engine's earlier batch-level discipline (``interleave=False``: a batch runs
  all its chunks before anything else is admitted), under ``fcfs`` and ``shortest_first``;
- ``step``: the step-level scheduler (``prefill_worker/scheduler.py``), both policies.

Time is virtual and load-independent: torch runs on one thread and each forward advances the
clock by the CPU time that thread spent in it (``time.thread_time``), so other processes on the
machine change nothing; an idle engine jumps to the next arrival. The arrival times are scaled
by a forward's measured time (a calibration prompt first), so the load is the same relative to
the machine whatever its speed.
Prints a table last; writes ``benchmarks/results/scheduler_cpu.json``. Every cell's first
tokens are checked equal to the batch-fcfs cell's (dense prefill: scheduling moves no result).

    PYTHONPATH=$PWD .venv/bin/python benchmarks/bench_scheduler.py
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from evals.report import environment, write_json  # noqa: E402
from kernels.config import SparseConfig  # noqa: E402
from model_executor import ModelRunner, SamplingParams, build_tiny_model  # noqa: E402
from model_executor.loading import make_pool  # noqa: E402
from prefill_worker.engine import PrefillEngine, PrefillRequest  # noqa: E402

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=1)
CELLS = [("batch", "fcfs"), ("batch", "shortest_first"), ("step", "fcfs"), ("step", "shortest_first")]


def workload(args, long_prefill_s: float) -> list[tuple[float, str, list[int]]]:
    """(arrival offset s, request id, prompt), in arrival order; seeded."""
    rng = random.Random(args.seed)
    span = args.longs * long_prefill_s
    out = []
    for i in range(args.longs):
        out.append((i * long_prefill_s, f"long{i}", [256] + [rng.randrange(256) for _ in range(args.long_tokens - 1)]))
    for i in range(args.shorts):
        out.append((rng.uniform(0.0, span), f"short{i}",
                    [256] + [rng.randrange(256) for _ in range(args.short_tokens - 1)]))
    return sorted(out, key=lambda x: x[0])


class VirtualClock:
    """Seconds of CPU time spent in forwards (plus idle jumps to arrivals)."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def forward(self, fn):
        t = time.thread_time()
        out = fn()
        self.now += time.thread_time() - t
        return out


def make_engine(model, args, *, interleave: bool, policy: str, clock=time.monotonic) -> PrefillEngine:
    pages = (args.longs * args.long_tokens + args.shorts * args.short_tokens) // args.page_size + 64
    pool = make_pool(model, num_pages=pages, page_size=args.page_size)
    runner = ModelRunner(model.model, pool, SparseConfig(alpha=0.0), dense_below=0)
    return PrefillEngine(runner, max_batch_tokens=args.chunk, chunk_size=args.chunk, policy=policy,
                         max_wait_s=args.max_wait_s, interleave=interleave, clock=clock)


def calibrate(model, args) -> float:
    """Median seconds of a forward of ``chunk`` tokens over a long prompt (after a warm-up
    prompt: the first forwards of a process are several times slower)."""
    e = make_engine(model, args, interleave=True, policy="fcfs")
    times = []
    for rid in ("warm-up", "calibration"):
        e.add_request(PrefillRequest(rid, [256] + [1] * (args.long_tokens - 1), GREEDY))
        times = []
        while e.has_unfinished():
            t = time.thread_time()
            e.step()
            times.append(time.thread_time() - t)
        e.release(rid)
    return statistics.median(times)


def run_cell(model, args, arrivals, *, interleave: bool, policy: str) -> dict:
    clock = VirtualClock()
    e = make_engine(model, args, interleave=interleave, policy=policy, clock=clock)
    pending = list(arrivals)
    arrived: dict[str, float] = {}
    first: dict[str, tuple[float, int]] = {}
    forwards = 0
    while pending or e.has_unfinished():
        while pending and pending[0][0] <= clock.now:
            at, rid, prompt = pending.pop(0)
            e.add_request(PrefillRequest(rid, prompt, GREEDY))
            arrived[rid] = at
        if not e.has_unfinished():
            clock.now = max(clock.now, pending[0][0])  # idle: on to the next arrival
            continue
        out = clock.forward(e.step)
        forwards += 1
        for res in out.finished:
            first[res.request_id] = (clock.now, res.first_token)
            e.release(res.request_id)
    makespan = clock.now
    ttft = {rid: first[rid][0] - arrived[rid] for rid in arrived}
    short = [v for k, v in ttft.items() if k.startswith("short")]
    long_ = [v for k, v in ttft.items() if k.startswith("long")]
    tokens = sum(len(p) for _, _, p in arrivals)
    return {
        "discipline": "step" if interleave else "batch", "policy": policy,
        "short_ttft_p50_s": statistics.median(short), "short_ttft_mean_s": statistics.fmean(short),
        "short_ttft_max_s": max(short),
        "long_ttft_p50_s": statistics.median(long_), "long_ttft_mean_s": statistics.fmean(long_),
        "long_ttft_max_s": max(long_),
        "all_ttft_mean_s": statistics.fmean(ttft.values()),
        "makespan_s": makespan, "prompt_tokens_per_s": tokens / makespan, "forwards": forwards,
        "first_tokens": {rid: first[rid][1] for rid in sorted(first)},
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--long-tokens", type=int, default=1536)
    ap.add_argument("--short-tokens", type=int, default=48)
    ap.add_argument("--longs", type=int, default=3)
    ap.add_argument("--shorts", type=int, default=12)
    ap.add_argument("--chunk", type=int, default=256, help="chunk size = token budget of a forward")
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--max-wait-s", type=float, default=30.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="scheduler_cpu.json", help="a file name under benchmarks/results/, or an absolute path (written there)")
    args = ap.parse_args(argv)
    import torch

    torch.manual_seed(args.seed)
    torch.set_num_threads(1)  # the virtual clock counts this thread's CPU time
    model = build_tiny_model(seed=0)
    t_fwd = calibrate(model, args)
    long_prefill_s = t_fwd * -(-args.long_tokens // args.chunk)
    arrivals = workload(args, long_prefill_s)
    run_cell(model, args, arrivals[:2], interleave=True, policy="fcfs")  # warm the short shapes too
    rows = [run_cell(model, args, arrivals, interleave=d == "step", policy=p) for d, p in CELLS]
    ref = rows[0]["first_tokens"]
    for r in rows:
        r["first_tokens_equal_batch_fcfs"] = r["first_tokens"] == ref
    payload = {"benchmark": "bench_scheduler", "env": environment(), "args": vars(args),
               "calibration_forward_s": t_fwd, "long_prefill_s": long_prefill_s, "cells": rows}
    path = write_json(args.out, payload)
    base = {r["policy"]: r for r in rows if r["discipline"] == "batch"}
    print(f"# bench_scheduler: tiny model, CPU (one thread, virtual time), {args.longs} x {args.long_tokens}-token and {args.shorts} x "
          f"{args.short_tokens}-token prompts, chunk = budget = {args.chunk}; forward {t_fwd * 1e3:.1f} ms")
    print("| discipline | policy | short TTFT P50 s | short mean s | short max s | long TTFT mean s | "
          "all mean s | prompt tok/s | forwards | short P50 vs batch | same first tokens |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for r in rows:
        speed = base[r["policy"]]["short_ttft_p50_s"] / r["short_ttft_p50_s"]
        print(f"| {r['discipline']} | {r['policy']} | {r['short_ttft_p50_s']:.3f} | {r['short_ttft_mean_s']:.3f} | "
              f"{r['short_ttft_max_s']:.3f} | {r['long_ttft_mean_s']:.3f} | {r['all_ttft_mean_s']:.3f} | "
              f"{r['prompt_tokens_per_s']:.0f} | {r['forwards']} | {speed:.2f}x | {r['first_tokens_equal_batch_fcfs']} |")
    print(f"wrote {path}")
    return 0 if all(r["first_tokens_equal_batch_fcfs"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
