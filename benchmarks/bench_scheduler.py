"""Prefill scheduling on CPU: TTFT of short prompts that arrive while long ones are chunked.

Runs the tiny built-in model (dense prefill, CPU) through ``PrefillEngine`` one forward at a
time, as a prefill replica's loop does (``prefill_worker.deployment.PrefillLoop``), with
prompts arriving at seeded wall-clock times: ``--longs`` long prompts one long-prefill apart
and ``--shorts`` short prompts at uniform random times over that span. Two suites (``--suite``):

``policies`` (four cells, chunk = forward budget = ``--chunk``):
- ``batch``: the engine's earlier batch-level discipline (``interleave=False``: a batch runs
  all its chunks before anything else is admitted), under ``fcfs`` and ``shortest_first``;
- ``step``: the step-level scheduler (``prefill_worker/scheduler.py``), both policies.

``defaults``: the service's options (``serving/config.py``): the default forward budget
(``prefill.max_batch_tokens``) with ``--defaults-longs`` prompts of ``--defaults-long-tokens``
(above the budget, as the issue's 10K and 20K prompts), under the old defaults (whole prompts, ``fcfs``), chunked ``fcfs``, and the new
defaults (``prefill.chunk_tokens`` chunks, ``shortest_first`` bounded by ``prefill.max_wait_s``),
plus ``shortest_first`` at twice the default chunk. ``short_forwards_waited_max``: forwards that
began after a short prompt arrived and before its own (0: it ran in the forward after the one
it arrived during, so it waited at most one forward).

Time is virtual and load-independent: torch runs on one thread and each forward advances the
clock by the CPU time that thread spent in it (``time.thread_time``), so other processes on the
machine change nothing; an idle engine jumps to the next arrival. The arrival times are scaled
by a forward's measured time (a calibration prompt first), so the load is the same relative to
the machine whatever its speed.
Prints a table per suite; writes ``benchmarks/results/scheduler_cpu.json``. Every policies
cell's first tokens are checked equal to the batch-fcfs cell's (dense prefill: scheduling moves
no result); a defaults cell's are compared with the old defaults' and reported (other chunk
boundaries round differently: close, not always equal).

    PYTHONPATH=$PWD .venv/bin/python benchmarks/bench_scheduler.py
"""

from __future__ import annotations

import argparse
import random
from dataclasses import dataclass
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
from serving.config import ServiceConfig  # noqa: E402

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=1)
CELLS = [("batch", "fcfs"), ("batch", "shortest_first"), ("step", "fcfs"), ("step", "shortest_first")]


@dataclass(frozen=True)
class SchedulerCell:
    """One engine setting: ``chunk`` None prefills whole prompts (split at ``budget``)."""

    name: str
    policy: str
    budget: int
    chunk: int | None
    interleave: bool = True


def default_cells() -> list[SchedulerCell]:
    """The old service defaults, chunked fcfs, the new defaults and twice their chunk."""
    p = ServiceConfig().prefill
    return [SchedulerCell("old defaults (whole prompts)", "fcfs", p.max_batch_tokens, None),
            SchedulerCell("fcfs, default chunks", "fcfs", p.max_batch_tokens, p.chunk_size),
            SchedulerCell("defaults", p.schedule, p.max_batch_tokens, p.chunk_size),
            SchedulerCell(f"{p.schedule}, 2x chunks", p.schedule, p.max_batch_tokens, 2 * p.chunk_size)]


def workload(args, long_prefill_s: float, long_tokens: int, longs: int) -> list[tuple[float, str, list[int]]]:
    """(arrival offset s, request id, prompt), in arrival order; seeded."""
    rng = random.Random(args.seed)
    span = longs * long_prefill_s
    out = []
    for i in range(longs):
        out.append((i * long_prefill_s, f"long{i}", [256] + [rng.randrange(256) for _ in range(long_tokens - 1)]))
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


def make_engine(model, args, cell: SchedulerCell, long_tokens: int, clock=time.monotonic) -> PrefillEngine:
    pages = (max(args.longs, args.defaults_longs) * long_tokens + args.shorts * args.short_tokens) // args.page_size + 64
    pool = make_pool(model, num_pages=pages, page_size=args.page_size)
    runner = ModelRunner(model.model, pool, SparseConfig(alpha=0.0), dense_below=0)
    return PrefillEngine(runner, max_batch_tokens=cell.budget, chunk_size=cell.chunk, policy=cell.policy,
                         max_wait_s=args.max_wait_s, interleave=cell.interleave, clock=clock)


def calibrate(model, args, cell: SchedulerCell, long_tokens: int) -> list[float]:
    """Seconds of each forward of one long prompt alone under ``cell`` (after a warm-up prompt:
    the first forwards of a process are several times slower)."""
    e = make_engine(model, args, cell, long_tokens)
    times = []
    for rid in ("warm-up", "calibration"):
        e.add_request(PrefillRequest(rid, [256] + [1] * (long_tokens - 1), GREEDY))
        times = []
        while e.has_unfinished():
            t = time.thread_time()
            e.step()
            times.append(time.thread_time() - t)
        e.release(rid)
    return times


def run_cell(model, args, arrivals, cell: SchedulerCell, long_tokens: int) -> dict:
    clock = VirtualClock()
    e = make_engine(model, args, cell, long_tokens, clock=clock)
    pending = list(arrivals)
    arrived: dict[str, tuple[float, int]] = {}  # arrival time, forwards begun before it
    first: dict[str, tuple[float, int]] = {}
    waited: dict[str, int] = {}  # forwards begun after its arrival, before its own first chunk
    forwards = 0
    while pending or e.has_unfinished():
        while pending and pending[0][0] <= clock.now:
            at, rid, prompt = pending.pop(0)
            e.add_request(PrefillRequest(rid, prompt, GREEDY))
            arrived[rid] = (at, forwards)
        if not e.has_unfinished():
            clock.now = max(clock.now, pending[0][0])  # idle: on to the next arrival
            continue
        out = clock.forward(e.step)
        for c in out.chunks:
            waited.setdefault(c.request_id, forwards - arrived[c.request_id][1])
        forwards += 1
        for res in out.finished:
            first[res.request_id] = (clock.now, res.first_token)
            e.release(res.request_id)
    makespan = clock.now
    ttft = {rid: first[rid][0] - arrived[rid][0] for rid in arrived}
    short = [v for k, v in ttft.items() if k.startswith("short")]
    long_ = [v for k, v in ttft.items() if k.startswith("long")]
    tokens = sum(len(p) for _, _, p in arrivals)
    return {
        "cell": cell.name, "discipline": "step" if cell.interleave else "batch", "policy": cell.policy,
        "max_batch_tokens": cell.budget, "chunk_tokens": cell.chunk,
        "short_ttft_p50_s": statistics.median(short), "short_ttft_mean_s": statistics.fmean(short),
        "short_ttft_max_s": max(short),
        "short_forwards_waited_max": max(v for k, v in waited.items() if k.startswith("short")),
        "long_ttft_p50_s": statistics.median(long_), "long_ttft_mean_s": statistics.fmean(long_),
        "long_ttft_max_s": max(long_),
        "all_ttft_mean_s": statistics.fmean(ttft.values()),
        "makespan_s": makespan, "prompt_tokens_per_s": tokens / makespan, "forwards": forwards,
        "first_tokens": {rid: first[rid][1] for rid in sorted(first)},
    }


def run_suite(model, args, cells: list[SchedulerCell], long_tokens: int, longs: int, *, clock_cell: SchedulerCell,
              exact: bool) -> dict:
    """The cells over one workload: the long prompts one long prefill apart (alone, under
    ``clock_cell``). ``exact``: the first tokens must equal the first cell's (else reported)."""
    per_forward = calibrate(model, args, clock_cell, long_tokens)
    long_prefill_s = sum(per_forward)
    arrivals = workload(args, long_prefill_s, long_tokens, longs)
    run_cell(model, args, arrivals[:2], cells[0], long_tokens)  # warm the short shapes too
    rows = [run_cell(model, args, arrivals, cell, long_tokens) for cell in cells]
    ref = rows[0]["first_tokens"]
    for r in rows:
        r["first_tokens_equal_first_cell"] = r["first_tokens"] == ref
    return {"long_tokens": long_tokens, "longs": longs, "calibration_forward_s": statistics.median(per_forward),
            "long_prefill_s": long_prefill_s, "exact_first_tokens": exact, "cells": rows}


def print_suite(title: str, suite: dict, base_of) -> None:
    print(title)
    print("| cell | policy | chunk | short TTFT P50 s | short mean s | short max s | short forwards waited (max) | "
          "long TTFT mean s | all mean s | prompt tok/s | forwards | short P50 vs base | same first tokens |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for r in suite["cells"]:
        speed = base_of(r)["short_ttft_p50_s"] / r["short_ttft_p50_s"]
        print(f"| {r['cell']} | {r['policy']} | {r['chunk_tokens'] or 'whole'} | {r['short_ttft_p50_s']:.3f} | "
              f"{r['short_ttft_mean_s']:.3f} | {r['short_ttft_max_s']:.3f} | {r['short_forwards_waited_max']} | "
              f"{r['long_ttft_mean_s']:.3f} | {r['all_ttft_mean_s']:.3f} | {r['prompt_tokens_per_s']:.0f} | "
              f"{r['forwards']} | {speed:.2f}x | {r['first_tokens_equal_first_cell']} |")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--suite", choices=("policies", "defaults", "all"), default="all")
    ap.add_argument("--long-tokens", type=int, default=1536, help="policies: long prompt length")
    ap.add_argument("--defaults-long-tokens", type=int, default=12288,
                    help="defaults: long prompt length (above the forward budget: the old defaults split it there)")
    ap.add_argument("--defaults-longs", type=int, default=2, help="defaults: long prompts")
    ap.add_argument("--short-tokens", type=int, default=48)
    ap.add_argument("--longs", type=int, default=3)
    ap.add_argument("--shorts", type=int, default=12)
    ap.add_argument("--chunk", type=int, default=256, help="policies: chunk size = token budget of a forward")
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--max-wait-s", type=float, default=ServiceConfig().prefill.max_wait_s)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="scheduler_cpu.json", help="a file name under benchmarks/results/, or an absolute path (written there)")
    args = ap.parse_args(argv)
    import torch

    torch.manual_seed(args.seed)
    torch.set_num_threads(1)  # the virtual clock counts this thread's CPU time
    model = build_tiny_model(seed=0)
    payload: dict = {"benchmark": "bench_scheduler", "env": environment(), "args": vars(args)}
    ok = True
    if args.suite in ("policies", "all"):
        cells = [SchedulerCell(f"{d} {p}", p, args.chunk, args.chunk, interleave=d == "step") for d, p in CELLS]
        suite = payload["policies"] = run_suite(model, args, cells, args.long_tokens, args.longs, clock_cell=cells[2],
                                                exact=True)
        ok = all(r["first_tokens_equal_first_cell"] for r in suite["cells"])
        base = {r["policy"]: r for r in suite["cells"] if r["discipline"] == "batch"}
        print_suite(f"# policies: tiny model, CPU (one thread, virtual time), {args.longs} x {args.long_tokens}-token "
                    f"and {args.shorts} x {args.short_tokens}-token prompts, chunk = budget = {args.chunk}; forward "
                    f"{suite['calibration_forward_s'] * 1e3:.1f} ms; base: the batch cell of the same policy",
                    suite, lambda r: base[r["policy"]])
    if args.suite in ("defaults", "all"):
        cells = default_cells()
        suite = payload["defaults"] = run_suite(model, args, cells, args.defaults_long_tokens, args.defaults_longs,
                                                clock_cell=cells[2], exact=False)
        old = suite["cells"][0]
        print_suite(f"# defaults: tiny model, CPU (one thread, virtual time), {args.defaults_longs} x "
                    f"{args.defaults_long_tokens}-token and {args.shorts} x {args.short_tokens}-token prompts, "
                    f"forward budget {old['max_batch_tokens']}; one long prompt alone {suite['long_prefill_s']:.2f} s "
                    "in default chunks; base: the old defaults", suite, lambda r: old)
    path = write_json(args.out, payload)
    print(f"wrote {path}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
