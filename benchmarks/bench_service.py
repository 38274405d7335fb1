"""Service benchmark: the whole disaggregated service under open-loop load, dense vs sparse prefill.

Deploys the Ray Serve application (``router.launcher``: a local Ray on 127.0.0.1, 1 prefill and
1 decode replica) once per configuration, drives it over HTTP with Poisson arrivals
(``benchmarks/open_loop.py``) at each rate, tears it down, and moves on:

- ``dense``: ``alpha=0`` (every visible block: dense prefill through the same kernels);
- ``sparse_bf16``: ``alpha=0.1`` (the default), bf16 KV pools;
- ``sparse_fp8``: as ``sparse_bf16`` with ``kv_cache_dtype: "fp8_e4m3"`` (only with ``--fp8``;
  recorded as skipped, with the reason, when ``ServiceConfig`` does not know the option or the
  replicas refuse it);
- ``sparse_bf16_chunk8k`` / ``sparse_bf16_chunk16k``: ``sparse_bf16`` with
  ``prefill_chunk_tokens`` 8192 / 16384.

Model: ``builtin:structured-8b`` (Llama-3.1-8B's shape, weights constructed to show sinks,
locality and retrieval; ``evals/structured_model.py``), bf16, built from the seed on each
replica's GPU. Prompts: ``haystack_ids`` token ids, lengths drawn with the seed from
``--lengths`` (default 4K..128K, powers of two), one distinct prompt per request and the same
sequence in every cell; ``--max-tokens`` (64) output tokens, which the structured model
always produces in full (no stop token). Arrival times: one seeded unit-rate sequence scaled by
1/rate, so every cell replays the same workload, faster or slower.

Placement: ``--gpus 1`` puts both replicas on one GPU (``num_gpus: 0.5`` each; KV pools 2560 and
5120 pages of 64 tokens: 20 and 40 GiB next to 2 x 16 GB of weights); ``--gpus 2`` gives each its
own GPU (4096 and 10240 pages). The prefill replica takes whole prompts up to the longest
(``max_batch_tokens``); its queue is unbounded and the decode replica waits up to
``adopt_wait_s`` = 600 s for room, so overload shows as queueing (TTFT), not as 429s.

Each cell is bounded (see ``open_loop``): at most ``--requests`` requests, none sent after
``--cell-seconds``, in-flight ones cut ``--drain-seconds`` later (counted lost, reason
``cut``). ``sent`` and ``not_sent`` are reported per cell: with the defaults (100 requests,
120 s + 60 s) one cell can take minutes, so a budgeted run passes smaller values and says so.
``--time-budget-s`` skips (and records) whatever would not fit. After each deploy the service
is warmed (one short request, plus one of two chunks in chunked configurations: the kernels
compile there, not in a cell), and before each cell it must be idle (empty queues, no leases,
nothing decoding; bounded wait, recorded).

Metrics per cell: sent, completed, lost (by reason), not sent, P50/P99 TTFT (of completed
requests; and of every sent request, ">=" where requests cut before their first token make it a
lower bound) and time per output token (client side, streaming), output tokens/s and
requests/s over the busy time, and medians of
the service's TTFT breakdown (``timing``: queue, prefill, export, transfer, first decode step;
``other``: TTFT outside queue + prefill + export). ``targets`` compares sparse with dense.

Usage (GPU host, repository root, Ray importable): ``PYTHONPATH=$PWD python3
benchmarks/bench_service.py --gpus 1 --requests 24 --cell-seconds 10 --drain-seconds 15
--time-budget-s 540``;
``--configs dense,sparse_bf16`` and ``--merge`` (keep the other configurations already in the
output file) split a run in parts. ``--cpu-smoke``: the tiny structured model on CPU, one
configuration, two short cells, a temporary output file (seconds). Writes
``benchmarks/results/service_h200.json`` (``--out``) and PNG plots next to it; prints a table.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.load_test import completion_body, encode_body  # noqa: E402
from benchmarks.open_loop import CellSpec, records_to_json, run_cell, summarize  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "service_h200.json"
CONFIG_ORDER = ("dense", "sparse_bf16", "sparse_fp8", "sparse_bf16_chunk8k", "sparse_bf16_chunk16k")
CONFIGURATIONS: dict[str, dict[str, Any]] = {
    "dense": {"alpha": 0.0},
    "sparse_bf16": {"alpha": 0.1},
    "sparse_fp8": {"alpha": 0.1, "kv_cache_dtype": "fp8_e4m3"},
    "sparse_bf16_chunk8k": {"alpha": 0.1, "prefill_chunk_tokens": 8192},
    "sparse_bf16_chunk16k": {"alpha": 0.1, "prefill_chunk_tokens": 16384},
}
SMOKE_CHUNK_DIVISOR = 64  # --cpu-smoke: 8K / 16K chunks become 128 / 256 tokens (its prompts are 256..512)
POOL_PAGES = {1: (2560, 5120), 2: (4096, 10240)}  # (prefill, decode) pages of 64 tokens per replica
DEPLOY_ESTIMATE_S = {"gpu": 45.0, "cpu": 20.0}  # start two replicas + warm-up, for the time budget
WARMUP_TIMEOUT_S = 600.0  # the first configuration's warm-up compiles the Triton kernels
QUIET = {"enable_access_log": False}  # no log line per request and replica call during the cells
TEARDOWN_S = 20.0  # graceful shutdown bound of every replica: a cut cell may leave a forward running


@dataclasses.dataclass(frozen=True)
class BenchConfig:
    """Everything a run depends on (recorded in the JSON)."""

    model: str = "builtin:structured-8b"
    gpus: int = 1
    configs: tuple[str, ...] = ("dense", "sparse_bf16", "sparse_bf16_chunk8k", "sparse_bf16_chunk16k")
    fp8: bool = False
    rates: tuple[float, ...] = (1.0, 4.0, 16.0)
    requests: int = 100
    cell_seconds: float = 120.0
    drain_seconds: float = 60.0
    request_timeout_s: float = 300.0
    lengths: tuple[int, ...] = (4096, 8192, 16384, 32768, 65536, 131072)
    max_tokens: int = 64
    seed: int = 0
    prefill_kv_pages: int | None = None
    decode_kv_pages: int | None = None
    time_budget_s: float | None = None
    idle_timeout_s: float = 180.0
    smoke: bool = False
    http_port: int = 8000
    grpc_port: int = 9000
    transport: str = "auto"  # KV transport of every configuration (auto: CUDA IPC on a shared GPU, else NCCL)

    def __post_init__(self) -> None:
        for name in self.configs:
            if name not in CONFIGURATIONS:
                raise ValueError(f"configs: expected names from {list(CONFIGURATIONS)}, got {name!r}")
        if len(set(self.configs)) != len(self.configs) or not self.configs:
            raise ValueError(f"configs: expected distinct names, at least one, got {list(self.configs)}")
        if self.gpus not in POOL_PAGES and not self.smoke:
            raise ValueError(f"gpus: expected 1 (both replicas share it) or 2 (one each), got {self.gpus!r}")
        if not self.rates or any(not (r > 0) for r in self.rates):
            raise ValueError(f"rates: expected positive requests/s, got {list(self.rates)}")
        if not self.lengths or any(n < 2 for n in self.lengths):
            raise ValueError(f"lengths: expected prompt lengths >= 2, got {list(self.lengths)}")
        if self.max_tokens < 2:
            raise ValueError(f"max_tokens: expected >= 2 (a first token and a decode step), got {self.max_tokens}")
        if self.time_budget_s is not None and self.time_budget_s <= 0:
            raise ValueError(f"time_budget_s: expected a positive number of seconds, got {self.time_budget_s}")
        CellSpec(rate=self.rates[0], requests=self.requests, cell_seconds=self.cell_seconds,
                 drain_seconds=self.drain_seconds, request_timeout_s=self.request_timeout_s)  # validates

    @property
    def run_configs(self) -> tuple[str, ...]:
        """Configurations in run order (``sparse_fp8`` joins with ``fp8``)."""
        wanted = set(self.configs) | ({"sparse_fp8"} if self.fp8 else set())
        return tuple(n for n in CONFIG_ORDER if n in wanted)

    def cell(self, rate: float) -> CellSpec:
        return CellSpec(rate=rate, requests=self.requests, cell_seconds=self.cell_seconds,
                        drain_seconds=self.drain_seconds, request_timeout_s=self.request_timeout_s, seed=self.seed)


SMOKE = dict(model="builtin:structured-tiny", gpus=0, configs=("sparse_bf16_chunk8k",), rates=(4.0, 16.0),
             requests=4, cell_seconds=2.0, drain_seconds=40.0, request_timeout_s=40.0, lengths=(256, 512),
             max_tokens=4, idle_timeout_s=30.0, smoke=True)


# ---------------------------------------------------------------------------------------------
# service configurations
# ---------------------------------------------------------------------------------------------


def base_options(cfg: BenchConfig) -> dict[str, Any]:
    """ServiceConfig options shared by every configuration (see the module docstring)."""
    longest = max(cfg.lengths)
    common = {
        "model": cfg.model, "seed": cfg.seed, "max_model_len": longest + cfg.max_tokens,
        "default_max_tokens": cfg.max_tokens, "max_batch_tokens": longest,
        "max_queued_prefill_tokens": 1 << 40, "adopt_wait_s": 600.0, "lease_timeout_s": 900.0,
        "max_request_bytes": 16 << 20, "batch_wait_ms": 2.0, "transport": cfg.transport,
    }
    if cfg.smoke:
        return {**common, "device": "cpu", "dtype": "float32", "torch_threads": 1, "page_size": 16,
                "prefill_kv_pages": 256, "decode_kv_pages": 512, "block_size": 64, "sink_tokens": 64,
                "window_tokens": 128, "dense_below": 0}
    prefill_pages, decode_pages = POOL_PAGES[cfg.gpus]
    return {**common, "device": "cuda", "dtype": "bfloat16", "page_size": 64,
            "prefill_kv_pages": cfg.prefill_kv_pages or prefill_pages,
            "decode_kv_pages": cfg.decode_kv_pages or decode_pages}


def service_options(cfg: BenchConfig, name: str) -> dict[str, Any]:
    """The ServiceConfig options of configuration ``name``."""
    if name not in CONFIGURATIONS:
        raise ValueError(f"name: expected one of {list(CONFIGURATIONS)}, got {name!r}")
    over = dict(CONFIGURATIONS[name])
    if cfg.smoke and "prefill_chunk_tokens" in over:
        over["prefill_chunk_tokens"] //= SMOKE_CHUNK_DIVISOR
    return {**base_options(cfg), **over}


def resolve_service_config(options: dict[str, Any]):
    """(ServiceConfig, None), or (None, why it cannot run) when ServiceConfig refuses the
    options (an option this checkout does not know yet, such as ``kv_cache_dtype``)."""
    from router.config import ServiceConfig

    try:
        return ServiceConfig.from_dict(options), None
    except (ValueError, TypeError) as exc:
        return None, f"ServiceConfig refused the options: {exc}"


def replica_options(cfg: BenchConfig) -> dict[str, Any]:
    """Deployment options of the prefill and decode replicas (one each)."""
    if cfg.smoke:
        actor = {"num_cpus": 0.5, "num_gpus": 0}
    else:  # 1 GPU: half each (both fit, see POOL_PAGES); 2 GPUs: Ray gives each its own
        actor = {"num_cpus": 1, "num_gpus": 0.5 if cfg.gpus == 1 else 1}
    # a replica that cannot start (out of memory, an option it refuses) fails the deploy at once
    # instead of being rebuilt (an 8B model each time) three times
    return {"num_replicas": 1, "ray_actor_options": actor, "max_constructor_retry_count": 1, "logging_config": QUIET,
            "graceful_shutdown_timeout_s": TEARDOWN_S}


# ---------------------------------------------------------------------------------------------
# workload
# ---------------------------------------------------------------------------------------------


def build_prompts(cfg: BenchConfig, model_id: str) -> list[tuple[int, bytes]]:
    """One (length, streaming request body) per request: lengths drawn from ``cfg.lengths``
    with the seed, each prompt a distinct ``haystack_ids`` draw."""
    from evals.structured_model import haystack_ids
    from model_executor.loading import structured_spec

    spec = structured_spec(cfg.model)
    rng = random.Random(cfg.seed)
    out = []
    for i in range(cfg.requests):
        n = rng.choice(cfg.lengths)
        ids = haystack_ids(spec, n, seed=cfg.seed * 1_000_003 + i)[0].tolist()
        out.append((n, encode_body(completion_body(model_id, ids, cfg.max_tokens, True))))
    return out


def warmup_lengths(cfg: BenchConfig, options: dict[str, Any]) -> list[int]:
    """The shortest prompt, and two chunks' worth when chunked (kernels compiled, chunk path run)."""
    out = [min(cfg.lengths)]
    chunk = options.get("prefill_chunk_tokens")
    if chunk:
        out.append(2 * chunk)
    return out


def warm_up(base_url: str, cfg: BenchConfig, model_id: str, options: dict[str, Any]) -> list[dict]:
    """Untimed requests, one at a time, before the first cell of a configuration."""
    import httpx

    from evals.structured_model import haystack_ids
    from model_executor.loading import structured_spec

    spec = structured_spec(cfg.model)
    done = []
    with httpx.Client(base_url=base_url, timeout=WARMUP_TIMEOUT_S) as client:
        for n in warmup_lengths(cfg, options):
            ids = haystack_ids(spec, n, seed=(1 << 30) + n)[0].tolist()  # not one of the measured prompts
            t0 = time.monotonic()
            r = client.post("/v1/completions", content=encode_body(completion_body(model_id, ids, 4, False)),
                            headers={"content-type": "application/json"})
            done.append({"prompt_len": n, "status": r.status_code, "seconds": time.monotonic() - t0,
                         "timing": r.json().get("timing") if r.status_code == 200 else r.text[:300]})
            if r.status_code != 200:
                raise RuntimeError(f"warm-up request of {n} tokens answered HTTP {r.status_code}: {r.text[:300]}")
    return done


def wait_idle(app: str, timeout_s: float) -> dict:
    """Wait (bounded) until both replicas have nothing queued, leased or running."""
    from router.launcher import replica_stats

    t0 = time.monotonic()
    while True:
        pre, dec = replica_stats(app, "PrefillServer"), replica_stats(app, "DecodeServer")
        idle = bool(pre and dec) and all(s["queued"] == 0 and s["leased"] == 0 and s["active"] == 0 for s in pre) \
            and all(s["streams"] == 0 and s["running"] == 0 for s in dec)
        waited = time.monotonic() - t0
        if idle or waited > timeout_s:
            keep = ("free_pages", "num_pages", "queued", "leased", "active", "streams", "running", "completed")
            return {"idle": idle, "waited_s": waited,
                    "prefill": [{k: s.get(k) for k in keep if k in s} for s in pre],
                    "decode": [{k: s.get(k) for k in keep if k in s} for s in dec]}
        time.sleep(0.25)


# ---------------------------------------------------------------------------------------------
# environment
# ---------------------------------------------------------------------------------------------


def _commit() -> str:
    if os.environ.get("GIT_COMMIT"):
        return os.environ["GIT_COMMIT"]
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                             timeout=10)
        if out.returncode == 0:
            dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                                   capture_output=True, text=True, timeout=10).stdout.strip()
            return out.stdout.strip() + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        pass
    return "unknown (no git checkout, GIT_COMMIT unset)"


def _gpus() -> list[str]:
    """GPU names from nvidia-smi (the driver process never touches CUDA itself)."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
        return [line.strip() for line in out.stdout.splitlines() if line.strip()] if out.returncode == 0 else []
    except (OSError, subprocess.SubprocessError):
        return []


def environment(argv: list[str]) -> dict:
    import ray
    import torch
    import transformers

    return {"gpus": _gpus(), "torch": torch.__version__, "cuda": torch.version.cuda, "ray": ray.__version__,
            "transformers": transformers.__version__, "python": sys.version.split()[0],
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "commit": _commit(), "command": "PYTHONPATH=$PWD python3 benchmarks/bench_service.py " + " ".join(argv),
            "PYTORCH_CUDA_ALLOC_CONF": os.environ.get("PYTORCH_CUDA_ALLOC_CONF")}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------------------------------------
# table, targets, plots
# ---------------------------------------------------------------------------------------------

COLUMNS = [
    ("config", "config", "{}"), ("rate", "rate", "{:g}"), ("sent", "sent", "{}"), ("done", "completed", "{}"),
    ("lost", "lost", "{}"), ("unsent", "not_sent", "{}"), ("TTFT p50", "ttft_p50_s", "{:.2f}"),
    ("TTFT p99", "ttft_p99_s", "{:.2f}"), ("p50 sent", "ttft_p50_sent", "{}"), ("p99 sent", "ttft_p99_sent", "{}"), ("TPOT p50 ms", "tpot_p50_ms", "{:.1f}"),
    ("TPOT p99 ms", "tpot_p99_ms", "{:.1f}"), ("tok/s", "output_tokens_per_s", "{:.1f}"),
    ("req/s", "requests_per_s", "{:.2f}"), ("queue", "queue_s", "{:.2f}"), ("prefill", "prefill_s", "{:.2f}"),
    ("export", "export_s", "{:.2f}"), ("transfer", "transfer_s", "{:.2f}"), ("1st dec", "first_decode_s", "{:.3f}"),
    ("other", "other_s", "{:.2f}"),
]


def table_rows(configurations: list[dict]) -> list[dict]:
    rows = []
    for conf in configurations:
        if conf["status"] != "ok" and not conf.get("cells"):
            rows.append({"config": conf["name"], "note": f"{conf['status']}: {conf.get('reason', '')}"})
            continue
        for cell in conf.get("cells", []):
            s = cell.get("summary")
            if s is None:
                rows.append({"config": conf["name"], "rate": cell["rate"], "note": cell.get("status", "")})
                continue
            row = {"config": conf["name"], **{k: s.get(k) for k in ("rate", "sent", "completed", "lost", "not_sent",
                                                                   "ttft_p50_s", "ttft_p99_s", "output_tokens_per_s",
                                                                   "requests_per_s")}}
            for q in ("p50", "p99"):
                v = s.get(f"tpot_{q}_s")
                row[f"tpot_{q}_ms"] = None if v is None else 1e3 * v
                v = s.get(f"ttft_{q}_sent_s")  # ">=": requests cut before their first token
                bound = ">=" if (s.get("ttft_sent_lower_bound") or {}).get(q) else ""
                row[f"ttft_{q}_sent"] = None if v is None else f"{bound}{v:.2f}"
            row.update(s.get("server_median_s") or {})
            rows.append(row)
    return rows


def format_table(rows: list[dict]) -> str:
    head = [c[0] for c in COLUMNS]
    body = []
    for r in rows:
        if "note" in r:
            note = r["note"] if len(r["note"]) <= 100 else r["note"][:97] + "..."  # the JSON has all of it
            body.append([r["config"], str(r.get("rate", "-"))] + ["-"] * (len(COLUMNS) - 2) + [note])
            continue
        body.append([("-" if r.get(k) is None else (r[k] if isinstance(r[k], str) else f.format(r[k])))
                     for _, k, f in COLUMNS])
    widths = [max([len(h)] + [len(b[i]) for b in body if i < len(b)]) for i, h in enumerate(head)]
    lines = ["  ".join(h.rjust(w) for h, w in zip(head, widths))]
    for b in body:
        cells = [c.rjust(w) for c, w in zip(b, widths)] + b[len(widths):]
        lines.append("  ".join(cells))
    return "\n".join(lines)


def targets(configurations: list[dict]) -> dict:
    """The issue's targets, from whatever cells ran: sparse (bf16) P50 TTFT at the lowest rate
    at least 3x below dense; output tokens/s at the highest rate at least 1.8x dense; no
    lost requests anywhere."""
    cells = {(c["name"], cell["rate"]): cell["summary"] for c in configurations for cell in c.get("cells", [])
             if cell.get("summary")}
    rates = sorted({rate for _, rate in cells})
    out: dict[str, Any] = {"lost_total": sum(s["lost"] for s in cells.values()),
                           "sent_total": sum(s["sent"] for s in cells.values())}
    out["zero_lost"] = out["lost_total"] == 0 if cells else None
    if rates:
        lo, hi = rates[0], rates[-1]
        d, s = cells.get(("dense", lo)), cells.get(("sparse_bf16", lo))
        if d and s and d["ttft_p50_s"] and s["ttft_p50_s"]:
            out["ttft_p50_ratio_at_lowest_rate"] = {"rate": lo, "dense_over_sparse": d["ttft_p50_s"] / s["ttft_p50_s"],
                                                    "target": 3.0}
        if d and s and d.get("ttft_p50_sent_s") and s.get("ttft_p50_sent_s"):
            # over every sent request; a lower bound on either side makes the ratio uncertain
            out["ttft_p50_sent_ratio_at_lowest_rate"] = {
                "rate": lo, "dense_over_sparse": d["ttft_p50_sent_s"] / s["ttft_p50_sent_s"], "target": 3.0,
                "dense_is_lower_bound": d["ttft_sent_lower_bound"]["p50"],
                "sparse_is_lower_bound": s["ttft_sent_lower_bound"]["p50"]}
        d, s = cells.get(("dense", hi)), cells.get(("sparse_bf16", hi))
        if d and s and d["output_tokens_per_s"]:
            out["throughput_ratio_at_highest_rate"] = {
                "rate": hi, "sparse_over_dense": s["output_tokens_per_s"] / d["output_tokens_per_s"], "target": 1.8}
    return out


def plot(configurations: list[dict], out_json: Path) -> list[str]:
    """PNG plots next to the JSON: TTFT (P50 solid, P99 dashed) and output tokens/s against the
    rate, and the server-side TTFT breakdown (medians) per configuration and rate."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        return [f"skipped: {exc}"]
    done = [c for c in configurations if any(cell.get("summary") for cell in c.get("cells", []))]
    if not done:
        return []
    paths = []
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for c in done:
        cells = [cell["summary"] for cell in c["cells"] if cell.get("summary") and cell["summary"]["ttft_p50_s"]]
        if not cells:
            continue
        rates = [s["rate"] for s in cells]
        line, = ax1.plot(rates, [s["ttft_p50_s"] for s in cells], "o-", label=f"{c['name']} P50")
        ax1.plot(rates, [s["ttft_p99_s"] for s in cells], "x--", color=line.get_color(), alpha=0.6)
        ax2.plot(rates, [s["output_tokens_per_s"] for s in cells], "o-", color=line.get_color(), label=c["name"])
    all_rates = sorted({cell["rate"] for c in done for cell in c["cells"] if cell.get("summary")})
    for ax, ylabel in ((ax1, "TTFT (s): P50 solid, P99 dashed"), (ax2, "output tokens/s")):
        ax.set_xscale("log")
        ax.set_xticks(all_rates, [f"{r:g}" for r in all_rates])
        ax.minorticks_off()
        ax.set_xlabel("offered rate (requests/s)")
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    ax1.set_yscale("log")
    fig.suptitle("Service under open-loop load (client side)")
    fig.tight_layout()
    path = out_json.with_name(out_json.stem + "_ttft_throughput.png")
    fig.savefig(path, dpi=120)
    plt.close(fig)
    paths.append(str(path))

    parts = ("queue_s", "prefill_s", "export_s", "other_s", "transfer_s", "first_decode_s")
    labels, stacks = [], {p: [] for p in parts}
    for c in done:
        for cell in c["cells"]:
            med = (cell.get("summary") or {}).get("server_median_s") or {}
            if med.get("ttft_s") is None:
                continue
            labels.append(f"{c['name']}\n{cell['rate']:g}/s")
            for p in parts:
                stacks[p].append(max(med.get(p) or 0.0, 0.0))
    if labels:
        fig, ax = plt.subplots(figsize=(max(6, 0.9 * len(labels)), 4.5))
        bottom = [0.0] * len(labels)
        for p in parts:
            ax.bar(range(len(labels)), stacks[p], bottom=bottom, label=p[:-2])
            bottom = [b + v for b, v in zip(bottom, stacks[p])]
        ax.set_xticks(range(len(labels)), labels, fontsize=7)
        ax.set_ylabel("seconds (medians)")
        ax.set_title("Server-side TTFT breakdown (medians): queue + prefill + export + other = TTFT;\n"
                     "after the first token: transfer (fetch + adopt), first decode step", fontsize=9)
        ax.legend(fontsize=8)
        ax.grid(True, axis="y", alpha=0.3)
        fig.tight_layout()
        path = out_json.with_name(out_json.stem + "_breakdown.png")
        fig.savefig(path, dpi=120)
        plt.close(fig)
        paths.append(str(path))
    return paths


# ---------------------------------------------------------------------------------------------
# the run
# ---------------------------------------------------------------------------------------------


class Budget:
    """Wall-clock budget of the whole run (``None``: unlimited)."""

    def __init__(self, seconds: float | None) -> None:
        self.seconds, self.t0 = seconds, time.monotonic()

    @property
    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def allows(self, need_s: float) -> bool:
        return self.seconds is None or self.elapsed + need_s <= self.seconds

    def remaining(self) -> float:
        return float("inf") if self.seconds is None else self.seconds - self.elapsed


def run_configuration(name: str, cfg: BenchConfig, local, budget: Budget, prompts_for, base_url: str,
                      on_cell=lambda conf: None) -> dict:
    """Deploy configuration ``name``, warm it up, run its cells, tear it down. Returns its
    record (``status``: ok, skipped or error, with ``reason``); ``on_cell(record)`` after each
    cell lets the caller save partial results."""
    from ray import serve

    from router.launcher import deploy

    options = service_options(cfg, name)
    conf: dict[str, Any] = {"name": name, "service_options": {k: options[k] for k in CONFIGURATIONS[name]},
                            "cells": []}
    if name == "sparse_fp8" and not cfg.fp8:
        return {**conf, "status": "skipped", "reason": "not requested (--fp8)"}
    service, why = resolve_service_config(options)
    if service is None:
        return {**conf, "status": "skipped", "reason": why}
    cell_s = cfg.cell_seconds + cfg.drain_seconds
    if not budget.allows(DEPLOY_ESTIMATE_S["cpu" if cfg.smoke else "gpu"] + cell_s):
        return {**conf, "status": "skipped", "reason": f"time budget ({budget.elapsed:.0f} of {cfg.time_budget_s:.0f} s used)"}
    t0 = time.monotonic()
    try:
        reps = replica_options(cfg)
        ingress = {"logging_config": QUIET, "graceful_shutdown_timeout_s": TEARDOWN_S}
        deploy(service, local, prefill=reps, decode=reps, ingress=ingress)
        conf["deploy_s"] = time.monotonic() - t0
        conf["warmup"] = warm_up(base_url, cfg, service.model_id, options)
        conf["warmup_s"] = time.monotonic() - t0 - conf["deploy_s"]
        print(f"[{name}] deployed in {conf['deploy_s']:.1f} s, warmed up in {conf['warmup_s']:.1f} s", flush=True)
        prompts = prompts_for(service.model_id)
        for rate in cfg.rates:
            if not budget.allows(cell_s):
                conf["cells"].append({"rate": rate, "status": "skipped: time budget"})
                continue
            idle = wait_idle(local.app_name, max(5.0, min(cfg.idle_timeout_s, budget.remaining() - cell_s)))
            spec = cfg.cell(rate)
            t_cell = time.monotonic()
            records = asyncio.run(run_cell(base_url, spec, prompts, max_tokens=cfg.max_tokens))
            summary = summarize(records, spec)
            conf["cells"].append({"rate": rate, "status": "ok", "idle_before": idle, "wall_s": time.monotonic() - t_cell,
                                  "summary": summary, "records": records_to_json(records)})
            on_cell(conf)
            p50 = summary["ttft_p50_s"]
            print(f"[{name}] rate {rate:g}/s: sent {summary['sent']} of {spec.requests} (not sent "
                  f"{summary['not_sent']}), completed {summary['completed']}, lost {summary['lost']} "
                  f"{summary['lost_by_reason'] or ''}, TTFT P50 {'-' if p50 is None else f'{p50:.2f} s'} (completed), "
                  f"{summary['output_tokens_per_s']:.1f} tok/s ({time.monotonic() - t_cell:.1f} s)", flush=True)
        conf["status"] = "ok"
    except Exception as exc:  # noqa: BLE001 - recorded; the next configuration still runs
        traceback.print_exc()
        conf["status"], conf["reason"] = "error", f"{type(exc).__name__}: {exc}"[:1500]
    finally:
        t1 = time.monotonic()
        try:
            serve.delete(local.app_name)
        except Exception as exc:  # noqa: BLE001
            conf["teardown_error"] = repr(exc)[:300]
        conf["teardown_s"] = time.monotonic() - t1
        conf["wall_s"] = time.monotonic() - t0
    return conf


def parse_args(argv: list[str] | None = None) -> tuple[BenchConfig, argparse.Namespace]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gpus", type=int, default=1, help="1: both replicas share GPU 0; 2: one GPU each")
    ap.add_argument("--configs", default=None,
                    help=f"comma-separated, from {list(CONFIGURATIONS)} (default: all but sparse_fp8)")
    ap.add_argument("--fp8", action="store_true", help="also run sparse_fp8 (ServiceConfig kv_cache_dtype='fp8_e4m3')")
    ap.add_argument("--rates", default=None, help="requests/s, comma-separated (default 1,4,16)")
    ap.add_argument("--requests", type=int, default=None, help="requests per cell at most (default 100)")
    ap.add_argument("--cell-seconds", type=float, default=None, help="no request sent after this (default 120)")
    ap.add_argument("--drain-seconds", type=float, default=None,
                    help="in-flight requests cut this long after --cell-seconds (default 60)")
    ap.add_argument("--request-timeout", type=float, default=None, help="per request, seconds (default 300)")
    ap.add_argument("--lengths", default=None, help="prompt lengths drawn from, comma-separated (default 4K..128K)")
    ap.add_argument("--max-tokens", type=int, default=None, help="output tokens per request (default 64)")
    ap.add_argument("--prefill-kv-pages", type=int, default=None)
    ap.add_argument("--decode-kv-pages", type=int, default=None)
    ap.add_argument("--time-budget-s", type=float, default=None,
                    help="skip (and record) configurations and cells that would end past this")
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--transport", default=None, choices=("auto", "object_store", "nccl", "cuda_ipc"),
                    help="KV transport of every configuration (default auto: CUDA IPC on a shared GPU, "
                         "NCCL channels between GPUs)")
    ap.add_argument("--http-port", type=int, default=None)
    ap.add_argument("--out", default=None, help=f"JSON path (default {RESULTS.relative_to(ROOT)}); plots beside it")
    ap.add_argument("--merge", action="store_true", help="keep the other configurations already in --out")
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny structured model on CPU, two short cells")
    ap.add_argument("--plot-only", action="store_true",
                    help="no run: redraw the plots and reprint the table of an existing --out file")
    args = ap.parse_args(argv)
    values: dict[str, Any] = dict(SMOKE) if args.cpu_smoke else {}
    if args.cpu_smoke:
        values["http_port"], values["grpc_port"] = _free_port(), _free_port()
    else:
        values["gpus"] = args.gpus
    if args.configs:
        values["configs"] = tuple(x.strip() for x in args.configs.split(",") if x.strip())
    if args.rates:
        values["rates"] = tuple(float(x) for x in args.rates.split(",") if x.strip())
    if args.lengths:
        values["lengths"] = tuple(int(x) for x in args.lengths.split(",") if x.strip())
    for flag, key in (("requests", "requests"), ("cell_seconds", "cell_seconds"), ("drain_seconds", "drain_seconds"),
                      ("request_timeout", "request_timeout_s"), ("max_tokens", "max_tokens"),
                      ("prefill_kv_pages", "prefill_kv_pages"), ("decode_kv_pages", "decode_kv_pages"),
                      ("time_budget_s", "time_budget_s"), ("seed", "seed"), ("http_port", "http_port")):
        if getattr(args, flag) is not None:
            values[key] = getattr(args, flag)
    values["fp8"] = args.fp8
    if args.transport is not None:
        values["transport"] = args.transport
    try:
        cfg = BenchConfig(**values)
    except ValueError as exc:
        ap.error(str(exc))
    return cfg, args


def plot_only(out_path: Path) -> dict:
    """Redraw the plots and reprint the table of a results file (no Ray, no GPU)."""
    if not out_path.exists():
        raise SystemExit(f"bench_service: --plot-only needs an existing results file, {out_path} is missing")
    result = json.loads(out_path.read_text())
    result["plots"] = plot(result.get("configurations", []), out_path)
    out_path.write_text(json.dumps(result, indent=1))
    print(format_table(table_rows(result.get("configurations", []))))
    print("plots:", result["plots"])
    return result


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else list(argv)
    cfg, args = parse_args(argv)
    if args.out:
        out_path = Path(args.out)
    elif cfg.smoke:
        out_path = Path(tempfile.gettempdir()) / "service_cpu_smoke.json"
    else:
        out_path = RESULTS
    if args.plot_only:
        return plot_only(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")  # inherited by the replicas
    budget = Budget(cfg.time_budget_s)

    import ray
    from ray import serve

    from router.launcher import LocalServeOptions, start_local_ray, start_serve

    local = LocalServeOptions(http_port=cfg.http_port, grpc_port=cfg.grpc_port,
                              num_cpus=max(8, os.cpu_count() or 1))
    start_local_ray(local)
    env = environment(argv)
    print(env, flush=True)
    if not cfg.smoke:
        have = ray.cluster_resources().get("GPU", 0)
        if have < cfg.gpus:
            raise SystemExit(f"bench_service: --gpus {cfg.gpus} but Ray sees {have:g} GPU(s)")
    start_serve(local)
    base_url = f"http://{local.host}:{local.http_port}"
    prompts_cache: dict[str, list] = {}

    def prompts_for(model_id: str):
        if model_id not in prompts_cache:
            t0 = time.monotonic()
            prompts_cache[model_id] = build_prompts(cfg, model_id)
            print(f"built {len(prompts_cache[model_id])} prompts in {time.monotonic() - t0:.1f} s", flush=True)
        return prompts_cache[model_id]

    previous = []
    if args.merge and out_path.exists():
        previous = json.loads(out_path.read_text()).get("configurations", [])
    config = dataclasses.asdict(cfg)
    result: dict[str, Any] = {
        "benchmark": "service under open-loop load: dense vs sparse prefill (router/, prefill_worker/, decode_worker/)",
        "env": env, "config": config, "service_base_options": base_options(cfg),
        "placement": ("CPU (smoke)" if cfg.smoke else
                      "1 GPU: prefill and decode replicas share it (num_gpus 0.5 each)" if cfg.gpus == 1 else
                      "2 GPUs: one per replica (num_gpus 1 each)"),
        "configurations": [],
    }

    def save(done: list[dict]) -> None:
        names = {c["name"] for c in done}
        result["configurations"] = [c for c in previous if c["name"] not in names] + done
        result["table"] = table_rows(result["configurations"])
        result["targets"] = targets(result["configurations"])
        result["wall_s"] = budget.elapsed
        out_path.write_text(json.dumps(result, indent=1))

    done: list[dict] = []
    try:
        for name in cfg.run_configs:
            conf = run_configuration(name, cfg, local, budget, prompts_for, base_url,
                                     on_cell=lambda partial: save(done + [{**partial, "status": "running"}]))
            done.append(conf)
            save(done)  # keep what we have if the run is cut short
            if conf["status"] != "ok":
                print(f"[{name}] {conf['status']}: {conf.get('reason')}", flush=True)
    finally:
        serve.shutdown()
        ray.shutdown()
    save(done)
    result["plots"] = plot(result["configurations"], out_path)
    out_path.write_text(json.dumps(result, indent=1))
    print(f"\nwrote {out_path} ({budget.elapsed:.0f} s)")
    print(f"{cfg.requests} requests at most per cell, none sent after {cfg.cell_seconds:g} s, in-flight ones cut "
          f"{cfg.drain_seconds:g} s later; prompts {list(cfg.lengths)} tokens, {cfg.max_tokens} output tokens. "
          "TTFT/TPOT: client side (s, ms); tok/s, req/s: over the busy time; queue..other: server-side medians (s).")
    print(format_table(result["table"]))
    print("targets:", json.dumps(result["targets"]))
    return result


if __name__ == "__main__":
    main()
