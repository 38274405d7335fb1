"""Decode steps from CUDA graphs against eager decode steps, by batch size and context length.

What a decode replica does each step: ``ensure_capacity`` for every request, ``ModelRunner.decode``
(one token per request over the paged KV pool), the greedy next token on the host. Eager: the
model's ~800 kernels a step launched from Python; graphs: ``ModelRunner.enable_decode_graphs``
(``model_executor/cuda_graphs.py``), one replay per step. Time per step = wall of ``--steps``
steps (each ends on the host reading its tokens), median of ``--repeats``.

Each case ``B:L`` reserves ``B`` requests holding ``L - 1`` tokens of random K/V (written into the
pool; no prefill: the decode step does not care where the K/V came from), then times eager and
graph steps from the same state. Before timing, one step of each from the same state is compared
(the graph runs the decode kernel with the split count chosen for its ``max_seqlen``, eager for
the batch's longest sequence, so they differ in rounding only): max |graph - eager| over the
logits' scale, and whether the greedy tokens agree.

Usage (H200, ``PYTHONPATH=$PWD``): ``python3 benchmarks/bench_decode_graphs.py``; prints a table and
writes ``benchmarks/results/decode_graphs_h200.json`` (``--out``). ``--cpu-smoke``: the tiny model
on CPU with the padded static-buffer step and no graphs (``capture=False``): checks the script,
times nothing meaningful.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from evals.report import git_commit  # noqa: E402
from kernels.config import SparseConfig  # noqa: E402
from model_executor import ModelRunner, load_model  # noqa: E402
from model_executor.loading import make_pool  # noqa: E402

CASES = ((1, 4096), (1, 32768), (1, 131072), (8, 4096), (8, 32768), (32, 4096), (64, 4096))
SMOKE_CASES = ((1, 40), (3, 100))
PAGE_SIZE = 64
CHECK_RTOL = 2e-2  # as model_executor.cuda_graphs checks its graphs


def parse_cases(text: str) -> tuple[tuple[int, int], ...]:
    cases = []
    for part in text.split(","):
        try:
            b, n = (int(x) for x in part.split(":"))
        except ValueError:
            raise ValueError(f"--cases: expected B:L pairs separated by commas, got {part!r}") from None
        if b < 1 or n < 2:
            raise ValueError(f"--cases: expected B >= 1 and L >= 2, got {part!r}")
        cases.append((b, n))
    return tuple(cases)


class Case:
    """``batch`` requests with ``length - 1`` tokens of random K/V in ``runner``'s pool."""

    def __init__(self, runner: ModelRunner, batch: int, length: int, extra: int, gen_device: str):
        self.runner, self.pool = runner, runner.pool
        self.rids = [f"b{i}" for i in range(batch)]
        self.start = length - 1
        gen = torch.Generator(device=gen_device).manual_seed(batch * 1_000_003 + length)
        dtype = next(runner.model.parameters()).dtype
        for rid in self.rids:
            self.pool.reserve(rid, length + extra)
            slots = self.pool.slot_mapping([rid], [0], [self.start], device=runner.device)
            shape = (self.start, self.pool.num_kv_heads, self.pool.head_dim)
            for layer in range(self.pool.num_layers):
                k = torch.randn(shape, generator=gen, device=gen_device, dtype=dtype)
                v = torch.randn(shape, generator=gen, device=gen_device, dtype=dtype)
                self.pool.write(layer, slots, k.to(runner.device), v.to(runner.device))
            self.pool.set_seq_len(rid, self.start)
        self.tokens = torch.randint(0, runner.vocab_size, (batch,), generator=torch.Generator().manual_seed(length)).tolist()

    def reset(self) -> None:
        for rid in self.rids:
            self.pool.set_seq_len(rid, self.start)

    def step(self) -> torch.Tensor:
        for rid in self.rids:
            self.runner.ensure_capacity(rid, self.pool.seq_len(rid) + 1)
        logits = self.runner.decode(self.rids, self.tokens)
        self.tokens = logits.argmax(-1).tolist()  # the host waits for the step, as the engine does
        return logits

    def release(self) -> None:
        for rid in self.rids:
            self.pool.release(rid)


def time_steps(case: Case, steps: int, repeats: int, warmup: int) -> float:
    """Median seconds per step over ``repeats`` runs of ``steps`` steps (from the case's start)."""
    times = []
    for _ in range(repeats):
        case.reset()
        for _ in range(warmup):
            case.step()
        t0 = time.perf_counter()
        for _ in range(steps):
            case.step()
        times.append((time.perf_counter() - t0) / steps)
    return statistics.median(times)


def run(runner: ModelRunner, graphs, cases, steps: int, repeats: int, warmup: int, gen_device: str) -> list[dict]:
    rows = []
    extra = warmup + steps + 2
    for batch, length in cases:
        case = Case(runner, batch, length, extra, gen_device)
        try:
            runner.decode_graphs = None
            case.reset()
            toks = list(case.tokens)
            want = case.step()
            runner.decode_graphs = graphs
            case.reset()
            case.tokens = toks
            before = dict(graphs.stats)
            got = case.step()
            in_graph = graphs.stats["graph_steps"] > before["graph_steps"]
            scale = want.abs().max().item() + 1.0
            err = (got - want).abs().max().item() / scale
            agree = bool(torch.equal(got.argmax(-1), want.argmax(-1)))
            runner.decode_graphs = None
            eager_s = time_steps(case, steps, repeats, warmup)
            runner.decode_graphs = graphs
            graph_s = time_steps(case, steps, repeats, warmup)
        finally:
            runner.decode_graphs = graphs
            case.release()
        row = {"batch": batch, "length": length, "eager_ms": eager_s * 1e3, "graph_ms": graph_s * 1e3,
               "speedup": eager_s / graph_s, "graph_tok_s": batch / graph_s, "eager_tok_s": batch / eager_s,
               "ran_in_graph": in_graph, "max_rel_diff": err, "tokens_agree": agree,
               "ok": in_graph and err <= CHECK_RTOL and agree}
        rows.append(row)
        print(f"B={batch:3d} L={length:7d}  eager {row['eager_ms']:8.2f} ms  graph {row['graph_ms']:8.2f} ms  "
              f"x{row['speedup']:5.2f}  {row['graph_tok_s']:8.1f} tok/s  rel diff {err:.2e}  "
              f"{'ok' if row['ok'] else 'MISMATCH' if in_graph else 'NOT IN GRAPH'}", flush=True)
    return rows


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="builtin:structured-8b")
    ap.add_argument("--cases", default=None, help="B:L pairs, comma-separated (default "
                    + ",".join(f"{b}:{n}" for b, n in CASES) + ")")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "decode_graphs_h200.json"))
    ap.add_argument("--cpu-smoke", action="store_true")
    args = ap.parse_args(argv)
    if args.steps < 1 or args.repeats < 1 or args.warmup < 0:
        ap.error("--steps and --repeats: expected >= 1, --warmup >= 0")
    try:
        cases = parse_cases(args.cases) if args.cases else None
    except ValueError as exc:
        ap.error(str(exc))
    if args.cpu_smoke:
        device, model_name, cases, capture = torch.device("cpu"), "builtin:tiny", cases or SMOKE_CASES, False
    else:
        if not torch.cuda.is_available():
            ap.error("needs a CUDA GPU (or --cpu-smoke)")
        device, model_name, cases, capture = torch.device("cuda", 0), args.model, cases or CASES, True
    loaded = load_model(model_name, device=device)
    tokens = max(b * (n + args.warmup + args.steps + 2) for b, n in cases)
    # per request at most one partly used page, plus the page the capture borrows
    pages = max(-(-tokens // PAGE_SIZE) + b + 1 for b, _ in cases)
    pool = make_pool(loaded, num_pages=pages, page_size=PAGE_SIZE)
    runner = ModelRunner(loaded.model, pool, SparseConfig(), device=device)
    max_seqlen = max(n for _, n in cases) + args.warmup + args.steps + 2
    sizes = sorted({b for b, _ in cases})
    t0 = time.perf_counter()
    graphs = runner.enable_decode_graphs(max_seqlen=max_seqlen, batch_sizes=sizes, capture=capture)
    capture_s = time.perf_counter() - t0
    env = {"gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
           "torch": torch.__version__, "commit": git_commit(),
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "command": "PYTHONPATH=$PWD python3 benchmarks/bench_decode_graphs.py " + " ".join(sys.argv[1:] if argv is None else argv)}
    print(f"{model_name}: fused {runner.fused_counts}; graphs for batch sizes {sizes} up to {graphs.max_seqlen} "
          f"tokens captured and checked in {capture_s:.1f} s", flush=True)
    rows = run(runner, graphs, cases, args.steps, args.repeats, args.warmup, "cuda" if device.type == "cuda" else "cpu")
    result = {"benchmark": "decode steps: CUDA graphs vs eager (time per step, host waits for each step's tokens)",
              "env": env, "model": model_name, "page_size": PAGE_SIZE, "steps": args.steps, "repeats": args.repeats,
              "warmup": args.warmup, "fused_counts": runner.fused_counts, "graph_batch_sizes": sizes,
              "graph_max_seqlen": graphs.max_seqlen, "capture": capture, "capture_s": capture_s, "rows": rows}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out}")
    if not all(r["ok"] for r in rows):
        raise SystemExit("bench_decode_graphs: a graph step disagrees with the eager step or did not run in a graph")
    return result


if __name__ == "__main__":
    main()
