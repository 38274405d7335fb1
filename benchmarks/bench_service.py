"""Service benchmark: the whole disaggregated service under open-loop load, dense vs sparse prefill.

Deploys the Ray Serve application (``router.launcher``: a local Ray on 127.0.0.1, 1 prefill and
1 decode replica) once per configuration, drives it over HTTP with Poisson arrivals
(``benchmarks/open_loop.py``) at each rate, tears it down, and moves on:

- ``dense``: ``alpha=0`` (every visible block: dense prefill through the same kernels);
- ``sparse_bf16``: ``alpha=0.1`` (the default), bf16 KV pools;
- ``sparse_fp8``: as ``sparse_bf16`` with ``kv_cache_dtype: "fp8_e4m3"`` (with ``--fp8`` or named in ``--configs``;
  recorded as skipped, with the reason, when ``ServiceConfig`` does not know the option or the
  replicas refuse it);
- ``sparse_bf16_chunk8k`` / ``sparse_bf16_chunk16k``: ``sparse_bf16`` with
  ``prefill_chunk_tokens`` 8192 / 16384;
- ``sparse_bf16_sjf`` / ``dense_sjf`` (only when named): ``sparse_bf16`` / ``dense`` with
  ``prefill_schedule: "shortest_first"`` (least causal work first; a prompt waiting 60 s goes
  ahead); ``targets`` compares the two at their lowest common rate
  (``ttft_p50_ratio_shortest_first``), the schedule-fair view of the TTFT target.

Model: ``builtin:structured-8b`` (Llama-3.1-8B's shape, weights constructed to show sinks,
locality and retrieval; ``model_executor/structured_model.py``), bf16, built from the seed on each
replica's GPU. Prompts: ``haystack_ids`` token ids, lengths drawn with the seed from
``--lengths`` (default 4K..128K, powers of two), one distinct prompt per request and the same
sequence in every cell; ``--max-tokens`` (64) output tokens, which the structured model
always produces in full (no stop token). Arrival times: one seeded unit-rate sequence scaled by
1/rate, so every cell replays the same workload, faster or slower.

``--fused-ops off`` runs every configuration with ``runtime.fused_ops: false`` (transformers'
eager norms, MLP and RoPE), as cells measured before the fused kernels existed did; default on.
Every cell starts with empty prefix caches (``PrefillServer.clear_prefix_cache`` on each prefill
replica; the cell records how many pages that dropped): the cells replay the same prompts, which
would otherwise hit pages an earlier cell cached. ``--shared-prefix-tokens N`` makes every prompt one shared document of ``N`` tokens followed by its
own tokens (what the prefix cache serves; a cell's summary counts ``cached_prompt_tokens``); run it
with ``sparse_bf16`` (prefix cache on, the default) and ``sparse_bf16_nocache`` (or ``dense`` /
``dense_nocache``) into their own ``--out``: ``--merge`` refuses a file of another workload.
``--cuda-graphs off`` likewise runs eager decode steps (``decode.cuda_graphs: false``), as
cells measured before the decode CUDA graphs did; each configuration records
``decode_graphs``, its decode replicas' graph status and step counts.

Placement: ``--gpus 1`` puts both replicas on one GPU (``num_gpus: 0.5`` each; KV pools ``auto``:
what each replica's memory plan leaves in its half, or a refusal at start that says why, e.g.
whole 128K bf16 prompts on an H100); ``--gpus 2`` gives each its own GPU (4096 and 10240 pages). The prefill replica takes whole prompts up to the longest
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
Per configuration, ``attention_kernels``: the prefill replica's attention-stage calls by the
kernel that ran (``cutlass``, ``triton``, ``reference``), i.e. what ``auto`` chose.

Usage (GPU host, repository root, Ray importable): ``PYTHONPATH=$PWD python3
benchmarks/bench_service.py --gpus 1 --requests 24 --cell-seconds 10 --drain-seconds 15
--time-budget-s 540``;
``--configs dense,sparse_bf16`` and ``--merge`` (keep the other configurations already in the
output file, and a configuration's cells at rates this run does not measure; every cell records
its commit and date) split a run in parts, down to one cell. ``--cpu-smoke``: the tiny structured model on CPU, one
configuration, two short cells, a temporary output file (seconds). Writes
``benchmarks/results/service_h200.json`` (``--out``) and PNG plots next to it; prints a table.

Groups at once, one GPU (pair) each: ``--parallel "dense,sparse_bf16;sparse_fp8,sparse_bf16_chunk8k,
sparse_bf16_chunk16k" --gpus 1`` (instead of ``--configs``; naming ``sparse_fp8`` runs it) starts
one ``bench_service.py`` per group (``;``-separated), group k on GPU k (``--gpus 1``) or GPUs 2k
and 2k+1 (``--gpus 2``), refused when the host has fewer (``CUDA_VISIBLE_DEVICES`` when set, else
``nvidia-smi``); with ``--cpu-smoke`` every group runs on CPU. Each group gets the same workload
options, its own ``CUDA_VISIBLE_DEVICES``, HTTP and gRPC ports, ``RAY_TMPDIR`` (so ``ray.init``
starts a fresh local cluster of its own: its own session, GCS and raylet, recorded as
``ray_cluster``), no ``RAY_ADDRESS``, its own dashboard metrics port and 1/groups of Ray's
default object store share; it runs in its own session, its output is prefixed ``[gK]`` on
stdout and kept in ``<out stem>_parallel/groupK.log`` next to its partial results
``groupK.json``. With ``--time-budget-s`` each group gets the remaining budget less
``CHILD_MARGIN_S`` (60 s on GPUs: its teardown) and a group still running ``KILL_MARGIN_S``
before the end is stopped with every process of its session (recorded). The partial results
are merged into ``--out`` as each group ends and at the end (with ``--merge``, the file's other
configurations stay): every configuration gets its ``placement`` (group, GPUs, layout), the
groups' records (status, error, ports, command, Ray cluster) are under ``parallel``, a failed
group's configurations are recorded with its error and the others' results kept; table,
``targets`` and plots as for one process. SIGTERM or Ctrl-C stops every group too.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime
import json
import os
import random
import shutil
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
from evals.report import git_commit  # noqa: E402

from benchmarks.load_test import completion_body, encode_body  # noqa: E402
from serving.config import DEFAULT_CHUNK_TOKENS  # noqa: E402
from benchmarks.open_loop import CellSpec, records_to_json, run_cell, summarize  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "service_h200.json"
CONFIG_ORDER = ("dense", "sparse_bf16", "sparse_fp8", "sparse_bf16_chunk8k", "sparse_bf16_chunk16k", "sparse_bf16_sjf",
                "dense_sjf", "sparse_bf16_nocache", "dense_nocache", "sparse_fp8w_sjf", "dense_served",
                "sparse_bf16_served", "sparse_fp8w_served")
# the service's own scheduling defaults (issue 47: chunks of prefill.chunk_tokens, shortest first),
# which base_options replaces with whole prompts in arrival order for the recorded cells
SERVED = {"prefill_chunk_tokens": DEFAULT_CHUNK_TOKENS, "prefill_schedule": "shortest_first"}
# Service options by their flat names (serving/config.py OPTION_ALIASES: ``alpha`` is ``sparse.alpha``,
# ``prefill_chunk_tokens`` is ``prefill.chunk_tokens``, ...): the names the recorded results use
CONFIGURATIONS: dict[str, dict[str, Any]] = {
    "dense": {"alpha": 0.0},
    "sparse_bf16": {"alpha": 0.1},
    "sparse_fp8": {"alpha": 0.1, "kv_cache_dtype": "fp8_e4m3"},
    "sparse_bf16_chunk8k": {"alpha": 0.1, "prefill_chunk_tokens": 8192},
    "sparse_bf16_chunk16k": {"alpha": 0.1, "prefill_chunk_tokens": 16384},
    # not in the issue's grid (run it by name): the prefill queue by least causal work first
    "sparse_bf16_sjf": {"alpha": 0.1, "prefill_schedule": "shortest_first", "prefill_max_wait_s": 60.0},
    "dense_sjf": {"alpha": 0.0, "prefill_schedule": "shortest_first", "prefill_max_wait_s": 60.0},
    # the prefix cache off (on by default): the baseline of a --shared-prefix-tokens workload
    "sparse_bf16_nocache": {"alpha": 0.1, "prefix_caching": False},
    "dense_nocache": {"alpha": 0.0, "prefix_caching": False},
    # FP8 (e4m3, per-channel) weights in every linear layer, the step-level shortest_first policy
    "sparse_fp8w_sjf": {"alpha": 0.1, "weight_dtype": "fp8_channel", "prefill_schedule": "shortest_first",
                        "prefill_max_wait_s": 60.0},
    # as served (issue 50's cells): the scheduling and sparse defaults (the last tiles dense, the
    # first-key rule), pools from the replica's memory plan; only the sparsity and the weights set
    "dense_served": {"alpha": 0.0, **SERVED},
    "sparse_bf16_served": {"alpha": 0.1, **SERVED},
    "sparse_fp8w_served": {"alpha": 0.1, "weight_dtype": "fp8_channel", **SERVED},
}
SMOKE_CHUNK_DIVISOR = 64  # --cpu-smoke: 8K / 16K chunks become 128 / 256 tokens (its prompts are 256..512)
# (prefill, decode) pages of 64 tokens per replica; None: "auto", what the replica's memory plan
# (model_executor/memory_plan.py) leaves in its half of the card (one GPU's 2560 / 5120 fit an H200
# only: an H100 refuses them at start)
POOL_PAGES = {1: (None, None), 2: (4096, 10240)}
DEPLOY_ESTIMATE_S = {"gpu": 45.0, "cpu": 20.0}  # start two replicas + warm-up, for the time budget
WARMUP_TIMEOUT_S = 600.0  # the first configuration's warm-up compiles the Triton kernels
QUIET = {"enable_access_log": False}  # no log line per request and replica call during the cells
TEARDOWN_S = 20.0  # graceful shutdown bound of every replica: a cut cell may leave a forward running
# --parallel: a child's --time-budget-s is the parent's remaining budget less this (its teardown,
# Ray shutdown and plots run past its own budget); children still running KILL_MARGIN_S before the
# parent's budget ends are stopped (SIGTERM to the process group, SIGKILL KILL_GRACE_S later)
CHILD_MARGIN_S = {"gpu": 60.0, "cpu": 20.0}
KILL_MARGIN_S = 10.0
KILL_GRACE_S = 10.0
RAY_OBJECT_STORE_PROPORTION = 0.3  # Ray's default share of memory per cluster; --parallel divides it among groups


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
    fused_ops: bool = True  # runtime.fused_ops of every configuration (fused norms, MLP, RoPE on CUDA)
    cuda_graphs: bool = True  # decode.cuda_graphs of every configuration (decode steps from CUDA graphs)
    shared_prefix_tokens: int = 0  # every prompt starts with the same this many tokens (a shared document)

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
        if not 0 <= self.shared_prefix_tokens < min(self.lengths):
            raise ValueError(f"shared_prefix_tokens: expected 0 <= n < the shortest prompt ({min(self.lengths)}), "
                             f"got {self.shared_prefix_tokens}")
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
    """ServiceConfig options (flat names) shared by every configuration (see the module docstring)."""
    longest = max(cfg.lengths)
    common = {
        "model": cfg.model, "seed": cfg.seed, "max_model_len": longest + cfg.max_tokens,
        "default_max_tokens": cfg.max_tokens, "max_batch_tokens": longest,
        "max_queued_prefill_tokens": 1 << 40, "adopt_wait_s": 600.0, "lease_timeout_s": 900.0,
        "max_request_bytes": 16 << 20, "batch_wait_ms": 2.0, "transport": cfg.transport,
        "fused_ops": cfg.fused_ops, "cuda_graphs": cfg.cuda_graphs,
        # whole prompts in arrival order unless a configuration says otherwise: what the recorded
        # cells ran (the service's defaults before chunked shortest_first, issue 47)
        "prefill_chunk_tokens": 0, "prefill_schedule": "fcfs",
    }
    if cfg.smoke:
        return {**common, "device": "cpu", "dtype": "float32", "torch_threads": 1, "page_size": 16,
                "prefill_kv_pages": 256, "decode_kv_pages": 512, "block_size": 64, "sink_tokens": 64,
                "window_tokens": 128, "dense_below": 0}
    pages = dict(zip(("prefill_kv_pages", "decode_kv_pages"), POOL_PAGES[cfg.gpus]))
    pages = {k: v for k, v in {"prefill_kv_pages": cfg.prefill_kv_pages or pages["prefill_kv_pages"],
                               "decode_kv_pages": cfg.decode_kv_pages or pages["decode_kv_pages"]}.items() if v}
    return {**common, "device": "cuda", "dtype": "bfloat16", "page_size": 64, **pages}


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
    from serving.config import ServiceConfig

    try:
        return ServiceConfig.from_dict(options), None
    except ValueError as exc:  # serving.config.ConfigError
        return None, f"ServiceConfig refused the options: {exc}"


def replica_options(cfg: BenchConfig) -> dict[str, Any]:
    """Deployment options of the prefill and decode replicas (one each)."""
    if cfg.smoke:
        actor = {"num_cpus": 0.5, "num_gpus": 0}
    else:  # 1 GPU: half each (each pool sized by its memory plan in its half); 2 GPUs: Ray gives each its own
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
    with the seed, each prompt a distinct ``haystack_ids`` draw. With ``shared_prefix_tokens``
    every prompt is the same draw of that many tokens (one document) followed by a distinct
    draw for the rest (the questions): what the prefix cache serves."""
    from evals.structured_model import haystack_ids
    from model_executor.loading import structured_spec

    spec = structured_spec(cfg.model)
    rng = random.Random(cfg.seed)
    shared = cfg.shared_prefix_tokens
    doc = haystack_ids(spec, shared, seed=cfg.seed * 7_919 + 1)[0].tolist() if shared else []
    out = []
    for i in range(cfg.requests):
        n = rng.choice(cfg.lengths)
        ids = haystack_ids(spec, n - shared + (1 if shared else 0), seed=cfg.seed * 1_000_003 + i)[0].tolist()
        ids = doc + ids[1:] if shared else ids  # the document keeps the BOS, the rest drops its own
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


def clear_prefix_caches(app: str) -> int:
    """Empty every prefill replica's prefix cache (calls pinned to each replica): each cell
    replays the same prompts, and pages a previous cell cached would turn them into hits."""
    from ray import serve

    from router.launcher import replica_stats
    from router.scheduling import routing_hint

    handle = serve.get_deployment_handle("PrefillServer", app_name=app)
    return sum(handle.clear_prefix_cache.remote(routing=routing_hint(replica=s["replica_id"])).result(timeout_s=60)["cleared"]
               for s in replica_stats(app, "PrefillServer"))


def prefill_attention_kernels(app: str) -> list[dict]:
    """Per prefill replica: attention-stage calls by the kernel that ran (``cutlass``, ``triton``,
    ``reference``; ``kernels.ops.attention_kernel_calls``), so a run shows what ``auto`` chose."""
    from router.launcher import replica_stats

    return [s.get("attention_kernels", {}) for s in replica_stats(app, "PrefillServer")]


def decode_graph_stats(app: str) -> list[dict]:
    """Per decode replica: whether its decode steps ran from CUDA graphs (``decode_graphs``: on,
    off or why eager) and how many steps ran in a graph and eagerly."""
    from router.launcher import replica_stats

    keep = ("decode_graphs", "decode_graph_steps", "decode_eager_steps")
    return [{k: s[k] for k in keep if k in s} for s in replica_stats(app, "DecodeServer")]


# ---------------------------------------------------------------------------------------------
# environment
# ---------------------------------------------------------------------------------------------


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
            "commit": git_commit(), "command": "PYTHONPATH=$PWD python3 benchmarks/bench_service.py " + shlex.join(argv),
            "PYTORCH_CUDA_ALLOC_CONF": os.environ.get("PYTORCH_CUDA_ALLOC_CONF")}


def layout_text(cfg: BenchConfig) -> str:
    """Where the replicas of one configuration run."""
    return ("CPU (smoke)" if cfg.smoke else
            "1 GPU: prefill and decode replicas share it (num_gpus 0.5 each)" if cfg.gpus == 1 else
            "2 GPUs: one per replica (num_gpus 1 each)")


def ray_cluster() -> dict:
    """The local cluster this process started (which one, when several run on the host)."""
    import ray

    ctx = ray.get_runtime_context()
    return {"gcs_address": ctx.gcs_address, "session": ctx.get_session_name(),
            "RAY_TMPDIR": os.environ.get("RAY_TMPDIR"), "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES")}


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
    ("other", "other_s", "{:.2f}"), ("commit", "commit", "{}"),
]


def table_rows(configurations: list[dict]) -> list[dict]:
    rows = []
    for conf in configurations:
        if conf["status"] != "ok" and not conf.get("cells"):
            rows.append({"config": conf["name"], "note": f"{conf['status']}: {conf.get('reason', '')}"})
            continue
        for cell in sorted(conf.get("cells", []), key=lambda c: c["rate"]):
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
            row["commit"] = (cell.get("commit") or "")[:7] or None  # cells merged over runs keep their own
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


def prefill_by_length(configurations: list[dict]) -> dict:
    """Per configuration, over the completed requests of all its cells, by prompt length: how many,
    and the server-side ``prefill_s`` minimum (the forward with the least company: the prompt
    alone, or with the fewest batched beside it) and median. ``mix_mean_min_s``: the minima's
    mean weighted by how often each length was drawn, i.e. the GPU time one request of the mix
    needs when nothing queues; ``dense / sparse`` of it bounds the throughput ratio an overloaded
    GPU can show (the linear layers, norms and decode steps cost both the same)."""
    out: dict[str, Any] = {}
    for conf in configurations:
        times: dict[int, list[float]] = {}
        for cell in conf.get("cells", []):
            for rec in cell.get("records") or []:
                t = (rec.get("timing") or {}).get("prefill_s")
                if rec.get("status") == "ok" and t is not None:
                    times.setdefault(int(rec["prompt_len"]), []).append(float(t))
        if not times:
            continue
        lengths = {n: {"n": len(v), "min_s": min(v), "median_s": sorted(v)[len(v) // 2]}
                   for n, v in sorted(times.items())}
        total = sum(d["n"] for d in lengths.values())
        out[conf["name"]] = {"lengths": lengths,
                             "mix_mean_min_s": sum(d["n"] * d["min_s"] for d in lengths.values()) / total}
    return out


def format_prefill_by_length(by: dict) -> str:
    names = list(by)
    # by length as a number: a summary read back from JSON has its lengths as string keys
    lengths = sorted({n for v in by.values() for n in v["lengths"]}, key=int)
    if not names:
        return ""
    lines = ["prefill s (min / median) by prompt length: " + " | ".join(names)]
    for n in lengths:
        parts = []
        for name in names:
            d = by[name]["lengths"].get(n)
            parts.append("-" if d is None else f"{d['min_s']:.2f} / {d['median_s']:.2f}")
        lines.append(f"{n:>7} " + " | ".join(parts))
    lines.append("mix mean of the minima: " + " | ".join(f"{by[x]['mix_mean_min_s']:.2f}" for x in names))
    return "\n".join(lines)


def summaries(configurations: list[dict]) -> dict:
    """What a results file derives from its cells: ``table``, ``targets``, ``prefill_by_length``."""
    by = prefill_by_length(configurations)
    return {"table": table_rows(configurations), "targets": targets(configurations, by), "prefill_by_length": by}


def _ttft_p50_ratio(dense: dict, sparse: dict, rate: float) -> dict:
    """The TTFT target's record: dense over sparse P50 TTFT (completed requests) at ``rate``."""
    return {"rate": rate, "dense_over_sparse": dense["ttft_p50_s"] / sparse["ttft_p50_s"], "target": 3.0}


def targets(configurations: list[dict], by_length: dict | None = None) -> dict:
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
            out["ttft_p50_ratio_at_lowest_rate"] = _ttft_p50_ratio(d, s, lo)
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
    # the same comparison with both prefill queues shortest-first (run by name, not in the grid)
    common = sorted({r for n, r in cells if n == "dense_sjf"} & {r for n, r in cells if n == "sparse_bf16_sjf"})
    if common:
        d, s = cells[("dense_sjf", common[0])], cells[("sparse_bf16_sjf", common[0])]
        if d["ttft_p50_s"] and s["ttft_p50_s"]:
            out["ttft_p50_ratio_shortest_first"] = _ttft_p50_ratio(d, s, common[0])
    by = prefill_by_length(configurations) if by_length is None else by_length
    if "dense" in by and "sparse_bf16" in by:  # what the throughput ratio is bounded by (see prefill_by_length)
        out["prefill_alone_ratio_over_mix"] = by["dense"]["mix_mean_min_s"] / by["sparse_bf16"]["mix_mean_min_s"]
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
        cells = sorted((cell["summary"] for cell in c["cells"] if cell.get("summary") and cell["summary"]["ttft_p50_s"]),
                       key=lambda s: s["rate"])
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
        for cell in sorted(c["cells"], key=lambda cell: cell["rate"]):
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
        commit = git_commit()
        for rate in cfg.rates:
            if not budget.allows(cell_s):
                conf["cells"].append({"rate": rate, "status": "skipped: time budget"})
                continue
            idle = wait_idle(local.app_name, max(5.0, min(cfg.idle_timeout_s, budget.remaining() - cell_s)))
            cleared = clear_prefix_caches(local.app_name)  # every cell starts with a cold prefix cache
            spec = cfg.cell(rate)
            started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
            t_cell = time.monotonic()
            records = asyncio.run(run_cell(base_url, spec, prompts, max_tokens=cfg.max_tokens))
            summary = summarize(records, spec)
            conf["cells"].append({"rate": rate, "status": "ok", "commit": commit, "date": started,
                                  "idle_before": idle, "prefix_cache_cleared": cleared,
                                  "wall_s": time.monotonic() - t_cell,
                                  "summary": summary, "records": records_to_json(records)})
            on_cell(conf)
            p50 = summary["ttft_p50_s"]
            print(f"[{name}] rate {rate:g}/s: sent {summary['sent']} of {spec.requests} (not sent "
                  f"{summary['not_sent']}), completed {summary['completed']}, lost {summary['lost']} "
                  f"{summary['lost_by_reason'] or ''}, TTFT P50 {'-' if p50 is None else f'{p50:.2f} s'} (completed), "
                  f"{summary['output_tokens_per_s']:.1f} tok/s, {summary.get('cached_prompt_tokens', 0)} prompt tokens "
                  f"from the prefix cache ({time.monotonic() - t_cell:.1f} s)", flush=True)
        conf["attention_kernels"] = prefill_attention_kernels(local.app_name)
        print(f"[{name}] prefill attention calls by kernel: {conf['attention_kernels']}", flush=True)
        conf["decode_graphs"] = decode_graph_stats(local.app_name)
        print(f"[{name}] decode graphs: {conf['decode_graphs']}", flush=True)
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


def merge_configurations(previous: list[dict], done: list[dict]) -> list[dict]:
    """``--merge``: the output file's configurations with this run's, in ``CONFIG_ORDER``. A
    configuration this run reached replaces the file's record, except the file's measured cells
    at rates this run did not measure (absent or skipped here), which are kept, so a grid can be
    completed over several runs; every measured cell carries its own ``commit`` and ``date``."""
    old = {c["name"]: c for c in previous}
    merged = {}
    for conf in done:
        ours = {c["rate"]: c for c in conf.get("cells", []) if c.get("status") == "ok"}
        theirs = [c for c in old.get(conf["name"], {}).get("cells", [])
                  if c.get("status") == "ok" and c["rate"] not in ours]
        cells = conf.get("cells", [])
        if theirs:
            kept_rates = {c["rate"] for c in theirs}
            cells = sorted([c for c in cells if c["rate"] not in kept_rates] + theirs, key=lambda c: c["rate"])
        merged[conf["name"]] = {**conf, "cells": cells}
    for conf in previous:
        merged.setdefault(conf["name"], conf)
    order = {n: i for i, n in enumerate(CONFIG_ORDER)}
    return sorted(merged.values(), key=lambda c: order.get(c["name"], len(order)))


def parse_args(argv: list[str] | None = None) -> tuple[BenchConfig, argparse.Namespace]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gpus", type=int, default=1, help="1: both replicas share GPU 0; 2: one GPU each")
    ap.add_argument("--configs", default=None,
                    help=f"comma-separated, from {list(CONFIGURATIONS)} (default: all but sparse_fp8)")
    ap.add_argument("--fp8", action="store_true",
                    help="also run sparse_fp8 (kv.cache_dtype='fp8_e4m3'); naming it in --configs does too")
    ap.add_argument("--rates", default=None, help="requests/s, comma-separated (default 1,4,16)")
    ap.add_argument("--requests", type=int, default=None, help="requests per cell at most (default 100)")
    ap.add_argument("--cell-seconds", type=float, default=None, help="no request sent after this (default 120)")
    ap.add_argument("--drain-seconds", type=float, default=None,
                    help="in-flight requests cut this long after --cell-seconds (default 60)")
    ap.add_argument("--request-timeout", type=float, default=None, help="per request, seconds (default 300)")
    ap.add_argument("--lengths", default=None, help="prompt lengths drawn from, comma-separated (default 4K..128K)")
    ap.add_argument("--max-tokens", type=int, default=None, help="output tokens per request (default 64)")
    ap.add_argument("--shared-prefix-tokens", type=int, default=None,
                    help="every prompt starts with the same this many tokens (a shared document; default 0): run "
                         "with sparse_bf16 and sparse_bf16_nocache to measure the prefix cache")
    ap.add_argument("--prefill-kv-pages", type=int, default=None)
    ap.add_argument("--decode-kv-pages", type=int, default=None)
    ap.add_argument("--time-budget-s", type=float, default=None,
                    help="skip (and record) configurations and cells that would end past this")
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--transport", default=None, choices=("auto", "object_store", "nccl", "cuda_ipc"),
                    help="KV transport of every configuration (default auto: CUDA IPC on a shared GPU, "
                         "NCCL channels between GPUs)")
    ap.add_argument("--fused-ops", choices=("on", "off"), default=None,
                    help="runtime.fused_ops of every configuration (default on: fused RMSNorm, SiLU MLP and "
                         "RoPE on CUDA; off: transformers' eager modules, as runs before these kernels)")
    ap.add_argument("--cuda-graphs", choices=("on", "off"), default=None,
                    help="decode.cuda_graphs of every configuration (default on: decode steps replayed "
                         "from CUDA graphs on CUDA; off: eager decode steps, as runs before them)")
    ap.add_argument("--http-port", type=int, default=None)
    ap.add_argument("--grpc-port", type=int, default=None)
    ap.add_argument("--out", default=None, help=f"JSON path (default {RESULTS.relative_to(ROOT)}); plots beside it")
    ap.add_argument("--merge", action="store_true",
                    help="keep the configurations already in --out, and their cells at rates this run does not measure")
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny structured model on CPU, two short cells")
    ap.add_argument("--parallel", default=None, metavar="GROUPS",
                    help="groups of configurations separated by ';', e.g. 'dense,sparse_bf16;sparse_fp8,"
                         "sparse_bf16_chunk8k': the groups run at the same time, each in its own process and local "
                         "Ray, group k on GPU k (--gpus 1) or GPUs 2k and 2k+1 (--gpus 2), on CPU with --cpu-smoke; "
                         "naming sparse_fp8 runs it (no --fp8); results merged into --out")
    ap.add_argument("--plot-only", action="store_true",
                    help="no run: recompute the table, targets and prefill-by-length summary of an existing --out "
                         "file from its cells, redraw the plots, reprint")
    ap.add_argument("--merge-from", action="append", default=None, metavar="FILE",
                    help="with --plot-only: first merge FILE's configurations into --out as --merge would (cells at "
                         "rates --out lacks are added, a rate both measured takes FILE's); refused when FILE's "
                         "workload or layout differs. Repeatable: e.g. the results of plans run on separate GPUs")
    args = ap.parse_args(argv)
    if args.merge_from and not args.plot_only:
        ap.error("--merge-from: only with --plot-only (a run merges its own cells with --merge)")
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
                      ("time_budget_s", "time_budget_s"), ("seed", "seed"), ("http_port", "http_port"),
                      ("grpc_port", "grpc_port"), ("shared_prefix_tokens", "shared_prefix_tokens")):
        if getattr(args, flag) is not None:
            values[key] = getattr(args, flag)
    values["fp8"] = args.fp8 or "sparse_fp8" in values.get("configs", ())  # naming it runs it
    if args.transport is not None:
        values["transport"] = args.transport
    if args.fused_ops is not None:
        values["fused_ops"] = args.fused_ops == "on"
    if args.cuda_graphs is not None:
        values["cuda_graphs"] = args.cuda_graphs == "on"
    groups = None
    if args.parallel is not None:
        for flag, given in (("--configs", args.configs is not None), ("--plot-only", args.plot_only),
                            ("--http-port", args.http_port is not None), ("--grpc-port", args.grpc_port is not None)):
            if given:
                ap.error(f"--parallel: not with {flag} (the groups name the configurations; each group gets free "
                         "ports; --plot-only redraws a merged file without --parallel)")
        try:
            groups = parse_groups(args.parallel)
        except ValueError as exc:
            ap.error(str(exc))
        values["configs"] = tuple(n for n in CONFIG_ORDER if any(n in g for g in groups))
        if args.fp8 and "sparse_fp8" not in values["configs"]:
            ap.error("--fp8: with --parallel, name sparse_fp8 in a group instead")
        values["fp8"] = "sparse_fp8" in values["configs"]
    try:
        cfg = BenchConfig(**values)
    except ValueError as exc:
        ap.error(str(exc))
    args.groups = None
    if groups is not None:
        margin = CHILD_MARGIN_S["cpu" if cfg.smoke else "gpu"]
        if cfg.time_budget_s is not None and cfg.time_budget_s <= margin:
            ap.error(f"--time-budget-s: with --parallel it must exceed {margin:g} s (each group's process gets the "
                     f"budget less {margin:g} s for its teardown), got {cfg.time_budget_s:g}")
        try:
            args.groups = assign_devices(groups, cfg, visible_gpus())
        except ValueError as exc:
            ap.error(str(exc))
    return cfg, args


def write_json(path: Path, obj: Any) -> None:
    """Whole or not at all: a reader (the ``--parallel`` parent) or a kill never sees half a file."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1))
    os.replace(tmp, path)


# what must agree for two results files' cells to sit in one table (the same prompts, arrivals,
# outputs and replica layout)
WORKLOAD_KEYS = ("model", "gpus", "requests", "lengths", "max_tokens", "seed", "smoke", "shared_prefix_tokens")
WORKLOAD_DEFAULTS = {"shared_prefix_tokens": 0}  # what files written before a key existed ran with


def workload_differences(mine: dict, theirs: dict) -> list[str]:
    """The ``WORKLOAD_KEYS`` on which two results files' ``config`` differ."""
    return [k for k in WORKLOAD_KEYS if mine.get(k, WORKLOAD_DEFAULTS.get(k)) != theirs.get(k, WORKLOAD_DEFAULTS.get(k))]


def previous_configurations(out_path: Path, cfg: "BenchConfig", merge: bool) -> list[dict]:
    """``--merge``: the configurations already in ``out_path`` (none without it or the file);
    SystemExit, before anything runs, if that file measured another workload or layout."""
    if not (merge and out_path.exists()):
        return []
    earlier = json.loads(out_path.read_text())
    mine = json.loads(json.dumps(dataclasses.asdict(cfg)))  # as a results file holds it (lists, not tuples)
    differ = workload_differences(mine, earlier["config"]) if "config" in earlier else []  # no config: nothing to check
    if differ:
        raise SystemExit(f"bench_service: --merge: {out_path} holds another workload or layout ("
                         + ", ".join(f"{k}: {earlier.get('config', {}).get(k)!r} vs {mine.get(k)!r}" for k in differ)
                         + "); write to another --out")
    return earlier.get("configurations", [])


def merge_results_file(result: dict, other_path: Path) -> None:
    """``--merge-from``: ``other_path``'s configurations into ``result`` (as ``--merge``)."""
    if not other_path.exists():
        raise SystemExit(f"bench_service: --merge-from: {other_path} is missing")
    other = json.loads(other_path.read_text())
    mine, theirs = result.get("config", {}), other.get("config", {})
    differ = workload_differences(mine, theirs)
    if differ:
        raise SystemExit(f"bench_service: --merge-from: {other_path} has another workload or layout ("
                         + ", ".join(f"{k}: {theirs.get(k)!r} vs {mine.get(k)!r}" for k in differ) + ")")
    result["configurations"] = merge_configurations(result.get("configurations", []), other.get("configurations", []))
    result.setdefault("merged_from", []).append({"file": str(other_path), "env": other.get("env"),
                                                 "placement": other.get("placement")})


def plot_only(out_path: Path, merge_from: list[str] | None = None) -> dict:
    """Recompute the table, targets and prefill-by-length summary of a results file from its cells
    (after merging ``merge_from`` files into it), redraw the plots and reprint (no Ray, no GPU)."""
    if not out_path.exists():
        raise SystemExit(f"bench_service: --plot-only needs an existing results file, {out_path} is missing")
    result = json.loads(out_path.read_text())
    for other in merge_from or ():
        merge_results_file(result, Path(other))
    confs = result.get("configurations", [])
    result.update(summaries(confs))  # everything derived from the cells, recomputed by this code
    result["plots"] = plot(confs, out_path)
    write_json(out_path, result)
    print(format_table(result["table"]))
    if result["prefill_by_length"]:
        print(format_prefill_by_length(result["prefill_by_length"]))
    print("targets:", json.dumps(result["targets"]))
    print("plots:", result["plots"])
    return result


# ---------------------------------------------------------------------------------------------
# --parallel: groups of configurations in child processes, each with its own local Ray
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Group:
    """One ``--parallel`` group: its configurations and the host GPUs its process sees."""

    index: int
    configs: tuple[str, ...]
    devices: tuple[str, ...] = ()  # CUDA_VISIBLE_DEVICES entries; () on CPU (--cpu-smoke)


def parse_groups(spec: str) -> list[tuple[str, ...]]:
    """``"a,b;c"`` -> ``[("a", "b"), ("c",)]``, each group in ``CONFIG_ORDER``; ValueError for an
    empty group or name, an unknown configuration, or one named in two groups."""
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"--parallel: expected groups of configurations separated by ';', got {spec!r}")
    groups: list[tuple[str, ...]] = []
    seen: dict[str, int] = {}
    for k, part in enumerate(spec.split(";")):
        names = [x.strip() for x in part.split(",")]
        if not all(names):
            raise ValueError(f"--parallel: group {k} of {spec!r} is empty or has an empty name (separate groups with "
                             "';' and the configurations of a group with ',')")
        for name in names:
            if name not in CONFIGURATIONS:
                raise ValueError(f"--parallel: unknown configuration {name!r} in group {k}; expected names from "
                                 f"{list(CONFIGURATIONS)}")
            if name in seen:
                where = f"group {seen[name]} and group {k}" if seen[name] != k else f"group {k} twice"
                raise ValueError(f"--parallel: {name!r} is in {where}; each configuration runs once")
            seen[name] = k
        groups.append(tuple(n for n in CONFIG_ORDER if n in names))
    return groups


def visible_gpus() -> list[str]:
    """The GPUs the groups may use: the entries of ``CUDA_VISIBLE_DEVICES`` when it is set, else
    the indices of every GPU ``nvidia-smi`` lists (no CUDA in this process)."""
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None:
        return [d.strip() for d in env.split(",") if d.strip()]
    return [str(i) for i in range(len(_gpus()))]


def assign_devices(groups: list[tuple[str, ...]], cfg: BenchConfig, visible: list[str]) -> list[Group]:
    """Group k gets ``visible[k * gpus : (k + 1) * gpus]`` (nothing on CPU); ValueError when the
    host has too few."""
    if cfg.smoke:
        return [Group(k, g) for k, g in enumerate(groups)]
    need = len(groups) * cfg.gpus
    if len(visible) < need:
        raise ValueError(f"--parallel: {len(groups)} group(s) with --gpus {cfg.gpus} need {need} GPU(s), this host has "
                         f"{len(visible)} ({','.join(visible) or 'none visible'})")
    return [Group(k, g, tuple(visible[k * cfg.gpus:(k + 1) * cfg.gpus])) for k, g in enumerate(groups)]


def child_argv(cfg: BenchConfig, group: Group, *, out: Path, http_port: int, grpc_port: int,
               time_budget_s: float | None) -> list[str]:
    """The arguments of a group's ``bench_service.py``: the parent's workload (every option
    spelled out, so the seed, prompts and cells are the same), the group's configurations,
    its own ports, partial output and budget."""
    argv = ["--cpu-smoke"] if cfg.smoke else ["--gpus", str(cfg.gpus)]
    argv += ["--configs", ",".join(group.configs), "--rates", ",".join(repr(r) for r in cfg.rates),
             "--requests", str(cfg.requests), "--cell-seconds", repr(cfg.cell_seconds),
             "--drain-seconds", repr(cfg.drain_seconds), "--request-timeout", repr(cfg.request_timeout_s),
             "--lengths", ",".join(str(n) for n in cfg.lengths), "--max-tokens", str(cfg.max_tokens),
             "--shared-prefix-tokens", str(cfg.shared_prefix_tokens),
             "--seed", str(cfg.seed), "--transport", cfg.transport, "--fused-ops", "on" if cfg.fused_ops else "off",
             "--cuda-graphs", "on" if cfg.cuda_graphs else "off",
             "--http-port", str(http_port), "--grpc-port", str(grpc_port), "--out", str(out)]
    for flag, value in (("--prefill-kv-pages", cfg.prefill_kv_pages), ("--decode-kv-pages", cfg.decode_kv_pages),
                        ("--time-budget-s", time_budget_s)):
        if value is not None:
            argv += [flag, repr(value)]
    if "sparse_fp8" in group.configs:
        argv.append("--fp8")
    return argv


def child_env(group: Group, *, groups: int, ray_tmpdir: str, metrics_port: int, commit: str,
              base: dict[str, str] | None = None) -> dict[str, str]:
    """A group's environment: its GPUs, a Ray temp dir of its own (its own session and
    ``ray_current_cluster``: ``ray.init`` starts a fresh cluster, never joins another group's),
    no ``RAY_ADDRESS``, its own dashboard metrics port, ``1/groups`` of Ray's default object
    store share (the groups share the host's /dev/shm), the parent's commit."""
    env = dict(os.environ if base is None else base)
    env.pop("RAY_ADDRESS", None)
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p != str(ROOT)]
    env.update({"PYTHONPATH": os.pathsep.join([str(ROOT), *paths]), "RAY_TMPDIR": ray_tmpdir,
                "DASHBOARD_METRIC_PORT": str(metrics_port), "GIT_COMMIT": commit, "PYTHONUNBUFFERED": "1",
                "RAY_DEFAULT_OBJECT_STORE_MEMORY_PROPORTION": f"{RAY_OBJECT_STORE_PROPORTION / groups:.4f}"})
    if group.devices:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(group.devices)
    return env


def _free_ports(n: int) -> list[int]:
    """``n`` distinct free loopback ports (all bound at once, then released)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _pump(stream, log: Path, prefix: str, lock: threading.Lock, out) -> None:
    """Copy a child's output to its log and, line by line with ``prefix``, to ``out``."""
    with open(log, "w", encoding="utf-8") as f:
        for line in stream:
            f.write(line)
            f.flush()
            with lock:
                out.write(prefix + line)
                out.flush()


def session_members(sid: int) -> list[int]:
    """Live (not zombie) processes of session ``sid`` (Linux ``/proc``; [] elsewhere). A child
    started in its own session keeps its local Ray there: the GCS, raylet and agents share the
    child's process group, Ray's workers (replicas, controller) each make their own group."""
    out = []
    try:
        entries = os.listdir("/proc")
    except OSError:
        return out
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read().decode(errors="replace")
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2:].split()  # state ppid pgrp session ...
        if len(fields) > 3 and fields[0] != "Z" and fields[3] == str(sid):
            out.append(int(entry))
    return out


def _signal_session(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
    for pid in session_members(proc.pid):
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def stop_group(proc: subprocess.Popen, grace_s: float = KILL_GRACE_S) -> str:
    """Stop a child started with ``start_new_session``: SIGTERM to its process group and every
    process of its session (its local Ray and Ray's workers), SIGKILL to whatever is left after
    ``grace_s``. Returns what it took."""
    _signal_session(proc, signal.SIGTERM)
    t_end = time.monotonic() + grace_s
    while time.monotonic() < t_end and (proc.poll() is None or session_members(proc.pid)):
        time.sleep(0.1)
    how = "SIGTERM"
    if proc.poll() is None or session_members(proc.pid):
        how = f"SIGTERM, SIGKILL after {grace_s:g} s"
        _signal_session(proc, signal.SIGKILL)
    proc.wait()
    return how


def run_children(commands: list[list[str]], envs: list[dict[str, str]], logs: list[Path], *,
                 deadline: float | None = None, on_exit=lambda k, outcome: None, out=None,
                 grace_s: float = KILL_GRACE_S) -> list[dict]:
    """Run the commands at once, each in its own session, output to its log and to ``out``
    (stdout) prefixed ``[gK]``; children still running at ``deadline`` (``time.monotonic()``)
    are stopped with every process of their session (:func:`stop_group`). ``on_exit(k, outcome)`` when
    child k ends. Returns per child: returncode, wall_s, killed (how, or None), pid."""
    out = sys.stdout if out is None else out
    lock = threading.Lock()
    t0 = time.monotonic()
    procs: list[subprocess.Popen] = []
    pumps: list[threading.Thread] = []
    outcomes = [{"returncode": None, "wall_s": None, "killed": None} for _ in commands]
    try:
        for k, (cmd, env, log) in enumerate(zip(commands, envs, logs)):
            log.parent.mkdir(parents=True, exist_ok=True)
            proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, text=True, errors="replace", bufsize=1,
                                    start_new_session=True)
            procs.append(proc)
            outcomes[k]["pid"] = proc.pid  # also its session and process group id
            pump = threading.Thread(target=_pump, args=(proc.stdout, log, f"[g{k}] ", lock, out), daemon=True)
            pump.start()
            pumps.append(pump)
        while True:
            for k, proc in enumerate(procs):
                if outcomes[k]["returncode"] is None and proc.poll() is not None:
                    outcomes[k].update(returncode=proc.returncode, wall_s=time.monotonic() - t0)
                    on_exit(k, dict(outcomes[k]))
            running = [k for k, o in enumerate(outcomes) if o["returncode"] is None]
            if not running:
                break
            if deadline is not None and time.monotonic() >= deadline:
                for k in running:
                    with lock:
                        out.write(f"[g{k}] time budget: stopping group {k} (session {procs[k].pid})\n")
                        out.flush()
                    outcomes[k]["killed"] = f"time budget: {stop_group(procs[k], grace_s)} at " \
                                            f"{time.monotonic() - t0:.0f} s"
                    outcomes[k].update(returncode=procs[k].returncode, wall_s=time.monotonic() - t0)
                    on_exit(k, dict(outcomes[k]))
                break
            time.sleep(0.2)
    except BaseException as exc:  # Ctrl-C, SIGTERM (see run_parallel), a failed start: no child outlives this
        for k, proc in enumerate(procs):
            if proc.poll() is None:
                how = stop_group(proc, grace_s)
                outcomes[k].update(returncode=proc.returncode, wall_s=time.monotonic() - t0,
                                   killed=f"interrupted ({type(exc).__name__}: {exc}): {how}")
                on_exit(k, dict(outcomes[k]))
        raise
    finally:
        for pump in pumps:
            pump.join(timeout=5.0)  # a Ray process that kept the pipe open does not hold the parent
    return outcomes


def _tail(path: Path, lines: int = 15, chars: int = 1500) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])[-chars:]


def read_partial(path: Path) -> tuple[dict | None, str | None]:
    """A group's partial results, or (None, why not)."""
    try:
        return json.loads(path.read_text()), None
    except FileNotFoundError:
        return None, "no partial results file"
    except (OSError, ValueError) as exc:
        return None, f"unreadable partial results: {exc}"[:300]


def merge_groups(cfg: BenchConfig, groups: list[Group], records: list[dict]) -> list[dict]:
    """Every group's configurations, in ``CONFIG_ORDER``, each with its ``placement`` (group,
    host GPUs, layout). ``records[k]``: group k's record (``status``, ``error``, ``partial``:
    its results or None). A configuration a failed or stopped group did not finish is kept
    with its completed cells and ``status: error``; one it never reached is recorded as not
    run, with the group's error."""
    confs: dict[str, dict] = {}
    for group, rec in zip(groups, records):
        place = {"group": group.index, "gpus": list(group.devices), "layout": layout_text(cfg)}
        got = {c["name"]: c for c in (rec.get("partial") or {}).get("configurations", [])}
        for name in group.configs:
            conf = got.get(name)
            if rec["status"] == "running":  # an intermediate save: as far as the group got
                conf = conf or {"name": name, "service_options": dict(CONFIGURATIONS[name]), "cells": [],
                                "status": "pending", "reason": f"group {group.index} is still running"}
            elif conf is None:
                conf = {"name": name, "service_options": dict(CONFIGURATIONS[name]), "cells": [], "status": "error",
                        "reason": f"not run: group {group.index} {rec['status']}: {rec.get('error')}"[:1500]}
            elif conf.get("status") == "running":
                conf = {**conf, "status": "error",
                        "reason": f"cut: group {group.index} {rec['status']} during this configuration (its "
                                  f"completed cells are kept): {rec.get('error')}"[:1500]}
            confs[name] = {**conf, "placement": place}
    return [confs[n] for n in CONFIG_ORDER if n in confs]


def group_record(group: Group, outcome: dict, partial_path: Path, log: Path, **extra) -> dict:
    """Group k's record from its process's outcome and partial file."""
    partial, why = read_partial(partial_path)
    tail = None
    if outcome.get("killed"):
        status, error = "killed", outcome["killed"]
    elif outcome.get("returncode") == 0 and partial is not None:
        status, error = "ok", None
    elif outcome.get("returncode") is None:
        status, error = "running", None
    else:
        tail = _tail(log)
        last = next((line.strip() for line in reversed(tail.splitlines()) if line.strip()), "(empty log)")
        status = "error"
        error = f"exit status {outcome.get('returncode')}" + (f", {why}" if why else "") + f"; last log line: {last}"
    return {"index": group.index, "configs": list(group.configs), "gpus": list(group.devices), "status": status,
            "error": error[:1000] if error else error, "log_tail": tail, "returncode": outcome.get("returncode"),
            "wall_s": outcome.get("wall_s"), "pid": outcome.get("pid"),
            "log": str(log), "partial_path": str(partial_path), **extra,
            "ray_cluster": ((partial or {}).get("env") or {}).get("ray_cluster"), "partial": partial}


def run_parallel(cfg: BenchConfig, groups: list[Group], argv: list[str], out_path: Path, merge: bool,
                 budget: Budget, child_command=None) -> dict:
    """``--parallel``: one ``bench_service.py`` per group at once (see :func:`child_argv`,
    :func:`child_env`), their output prefixed on stdout, their partial JSONs merged into
    ``out_path`` as each ends and at the end; table, targets, plots as a single run.
    ``child_command(k, argv)`` replaces the child's command line (tests)."""
    work = out_path.with_name(out_path.stem + "_parallel")
    work.mkdir(parents=True, exist_ok=True)
    for old in work.glob("group*"):  # a stale partial must not pass for this run's
        shutil.rmtree(old, ignore_errors=True) if old.is_dir() else old.unlink()
    env = environment(argv)  # env["gpus"]: every GPU of the host; env["command"]: this command
    commit = env["commit"]  # every child records the same commit
    print(env, flush=True)
    previous = previous_configurations(out_path, cfg, merge)
    margin = CHILD_MARGIN_S["cpu" if cfg.smoke else "gpu"]
    child_budget = None if cfg.time_budget_s is None else round(cfg.time_budget_s - budget.elapsed - margin, 1)
    deadline = None if cfg.time_budget_s is None else budget.t0 + cfg.time_budget_s - KILL_MARGIN_S
    if child_budget is not None and child_budget <= 0:
        raise SystemExit(f"bench_service: --time-budget-s {cfg.time_budget_s:g} leaves the groups no time")
    ports = _free_ports(3 * len(groups))
    tmp_root = "/tmp" if os.path.isdir("/tmp") else tempfile.gettempdir()  # short: Ray's socket paths
    commands, envs, logs, partials, extras = [], [], [], [], []
    for g in groups:
        http_port, grpc_port, metrics_port = ports[3 * g.index:3 * g.index + 3]
        partial, log = work / f"group{g.index}.json", work / f"group{g.index}.log"
        ray_tmp = tempfile.mkdtemp(prefix=f"raybench-g{g.index}-", dir=tmp_root)
        args = child_argv(cfg, g, out=partial, http_port=http_port, grpc_port=grpc_port, time_budget_s=child_budget)
        commands.append(child_command(g.index, args) if child_command else
                        [sys.executable, str(Path(__file__).resolve()), *args])
        envs.append(child_env(g, groups=len(groups), ray_tmpdir=ray_tmp, metrics_port=metrics_port, commit=commit))
        logs.append(log)
        partials.append(partial)
        extras.append({"http_port": http_port, "grpc_port": grpc_port, "time_budget_s": child_budget,
                       "RAY_TMPDIR": ray_tmp, "command": "python3 benchmarks/bench_service.py " + shlex.join(args)})
        print(f"[g{g.index}] {', '.join(g.configs)} on {'GPU ' + ','.join(g.devices) if g.devices else 'CPU'}: "
              f"{extras[-1]['command']}", flush=True)
    result: dict[str, Any] = {
        "benchmark": "service under open-loop load: dense vs sparse prefill (router/, prefill_worker/, decode_worker/)",
        "env": env, "config": dataclasses.asdict(cfg), "service_base_options": base_options(cfg),
        "placement": "parallel groups, each its own process and local Ray: " + "; ".join(
            f"group {g.index} ({', '.join(g.configs)}) on {'GPU ' + ','.join(g.devices) if g.devices else 'CPU'}"
            for g in groups) + f"; in each: {layout_text(cfg)}",
        "configurations": [],
    }
    outcomes: list[dict] = [{"returncode": None} for _ in groups]

    def save() -> None:
        records = [group_record(g, o, partials[g.index], logs[g.index], **extras[g.index])
                   for g, o in zip(groups, outcomes)]
        result["configurations"] = merge_configurations(previous, merge_groups(cfg, groups, records))
        result["parallel"] = {"spec": ";".join(",".join(g.configs) for g in groups), "child_margin_s": margin,
                              "kill_margin_s": KILL_MARGIN_S,
                              "groups": [{k: v for k, v in r.items() if k != "partial"} for r in records]}
        result.update(summaries(result["configurations"]))
        result["wall_s"] = budget.elapsed
        write_json(out_path, result)

    def ended(k: int, outcome: dict) -> None:
        outcomes[k] = outcome
        save()  # what the finished groups measured is on disk whatever happens to the others

    stopping = []

    def interrupted(signum, _frame):
        if not stopping:  # once: a second signal must not cut the groups' shutdown short
            stopping.append(signum)
            raise KeyboardInterrupt(f"signal {signal.Signals(signum).name}")  # run_children stops the groups

    # SIGTERM (a timeout around this run) or SIGINT (ignored by default in a background job)
    # must not leave the groups running, and holding their GPUs, after the parent
    handlers = {}
    if threading.current_thread() is threading.main_thread():
        handlers = {sig: signal.signal(sig, interrupted) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        outcomes[:] = run_children(commands, envs, logs, deadline=deadline, on_exit=ended)
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    save()
    for g in groups:
        status = result["parallel"]["groups"][g.index]["status"]
        if status == "ok":  # a failed group's Ray logs stay (the path is in the record)
            shutil.rmtree(extras[g.index]["RAY_TMPDIR"], ignore_errors=True)
        print(f"[g{g.index}] {status}" + ("" if status == "ok" else
              f": {result['parallel']['groups'][g.index]['error']}"), flush=True)
    result["plots"] = plot(result["configurations"], out_path)
    write_json(out_path, result)
    print(f"\nwrote {out_path} ({budget.elapsed:.0f} s; groups' logs and partial results in {work})")
    print_summary(result, cfg)
    return result


def print_summary(result: dict, cfg) -> None:
    """The run's bounds, the table and the targets (the last thing a run prints)."""
    print(f"{cfg.requests} requests at most per cell, none sent after {cfg.cell_seconds:g} s, in-flight ones cut "
          f"{cfg.drain_seconds:g} s later; prompts {list(cfg.lengths)} tokens, {cfg.max_tokens} output tokens. "
          "TTFT/TPOT: client side (s, ms); tok/s, req/s: over the busy time; queue..other: server-side medians (s).")
    print(format_table(result["table"]))
    if result.get("prefill_by_length"):
        print(format_prefill_by_length(result["prefill_by_length"]))
    print("targets:", json.dumps(result["targets"]))


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
        return plot_only(out_path, args.merge_from)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    previous = previous_configurations(out_path, cfg, args.merge)  # refuses another workload now
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")  # inherited by the replicas
    budget = Budget(cfg.time_budget_s)
    if args.groups is not None:
        return run_parallel(cfg, args.groups, argv, out_path, args.merge, budget)

    import ray
    from ray import serve

    from router.launcher import LocalServeOptions, start_local_ray, start_serve

    # a CPU smoke run reads nothing from Ray's dashboard: without it two groups' clusters start
    # on 2 loaded cores within Ray's fixed 30 s (seen timing out with it)
    local = LocalServeOptions(http_port=cfg.http_port, grpc_port=cfg.grpc_port,
                              num_cpus=max(8, os.cpu_count() or 1), include_dashboard=not cfg.smoke)
    start_local_ray(local)
    env = environment(argv)
    env["ray_cluster"] = ray_cluster()
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

    config = dataclasses.asdict(cfg)
    result: dict[str, Any] = {
        "benchmark": "service under open-loop load: dense vs sparse prefill (router/, prefill_worker/, decode_worker/)",
        "env": env, "config": config, "service_base_options": base_options(cfg),
        "placement": layout_text(cfg),
        "configurations": [],
    }

    def save(done: list[dict]) -> None:
        result["configurations"] = merge_configurations(previous, done)
        result.update(summaries(result["configurations"]))
        result["wall_s"] = budget.elapsed
        write_json(out_path, result)

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
    write_json(out_path, result)
    print(f"\nwrote {out_path} ({budget.elapsed:.0f} s)")
    print_summary(result, cfg)
    return result


if __name__ == "__main__":
    main()
