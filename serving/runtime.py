"""What a worker replica builds at start: the model, its KV pool and the ModelRunner.

Shared by the prefill and decode deployments (both load the same weights: the built-in models
are seeded, a local directory is read offline) and by the ingress (tokenizer only).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

import torch

from kernels._checks import canonical_device

from .config import ServiceConfig, resolve_max_model_len

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(config: ServiceConfig) -> torch.device:
    """The replica's device, with its index (``cuda:0``, not ``cuda``: as tensors report it)."""
    if config.model.device == "auto":
        if not torch.cuda.is_available():
            return torch.device("cpu")
    elif config.model.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device: 'cuda' was asked for but this replica sees no GPU (num_gpus in ray_actor_options?)")
    elif config.model.device == "cpu":
        return torch.device("cpu")
    return canonical_device("cuda")


def resolve_dtype(config: ServiceConfig, device: torch.device) -> torch.dtype:
    if config.model.dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[config.model.dtype]


CPU_AUTO_PAGES = 1024  # kv.*_pages "auto" on a CPU: no device memory to plan (the host's is shared)
DEFAULT_GPU_MEMORY_FRACTION = 0.9  # of the GPU share Ray gives a replica (gpu_memory_fraction null)
PREFILL_LOGIT_ROWS = 64  # prompts ending in one prefill forward that the plan counts logits for


def gpu_share() -> float:
    """The GPUs Ray gave this replica (``num_gpus``: 0.5 when prefill and decode share one), at
    most 1; 1 outside Ray."""
    try:
        import ray

        if ray.is_initialized():
            gpus = ray.get_runtime_context().get_assigned_resources().get("GPU")
            if gpus:
                return min(float(gpus), 1.0)
    except Exception:  # noqa: BLE001 - no runtime context: a process of its own
        pass
    return 1.0


def placement_share(config: ServiceConfig, cluster_gpus: float) -> float:
    """The ``num_gpus`` a worker replica gets by default (``router.app``): one GPU each with two or
    more, half each with one (prefill and decode share it), none without or on ``model.device`` cpu."""
    gpus = 0.0
    if config.model.device != "cpu":
        gpus = 1.0 if cluster_gpus >= 2 else 0.5 if cluster_gpus >= 1 else 0.0
    if config.model.device == "cuda" and gpus == 0.0:
        gpus = 1.0
    return gpus


def memory_fraction(config: ServiceConfig, side: str, share: float = 1.0) -> float:
    """``{side}.gpu_memory_fraction``, or 0.9 x ``share`` (the replica's GPU share) when null."""
    own = getattr(config, side).gpu_memory_fraction
    return float(own) if own is not None else DEFAULT_GPU_MEMORY_FRACTION * share


def plan_names(side: str) -> dict[str, str]:
    """The options behind ``plan_memory``'s arguments, for its messages."""
    return {"num_pages": f"kv.{side}_pages", "fraction": f"{side}.gpu_memory_fraction",
            "max_context": "model.max_model_len",
            "forward_tokens": "prefill.max_batch_tokens" if side == "prefill" else "decode.max_running"}


def replica_memory_plan(config: ServiceConfig, side: str, *, device_total_bytes: int, share: float = 1.0,
                        dtype: torch.dtype | None = None):
    """The memory plan (``model_executor.memory_plan``) of one ``side`` replica (one rank) of
    ``config`` on a CUDA device of ``device_total_bytes``, with ``share`` of it from Ray. A
    prefill forward: ``prefill.max_batch_tokens`` tokens (whole prompts are split at it, chunks
    fill it) at ``model.max_model_len`` keys; a decode step: ``decode.max_running`` sequences
    there, and with ``decode.cuda_graphs`` one more step's workspace for the graphs' pool.
    ValueError naming ``model.model`` for a model whose shape cannot be read here."""
    from model_executor.loading import model_shape
    from model_executor.memory_plan import plan_memory

    if side not in ("prefill", "decode"):
        raise ValueError(f"side: expected 'prefill' or 'decode', got {side!r}")
    shape = model_shape(config.model.model)
    if shape is None:
        raise ValueError(f"model.model: the shape of {config.model.model!r} cannot be read here (no config.json)")
    max_len = resolve_max_model_len(config)
    dtype = dtype or resolve_dtype(config, torch.device("cuda"))
    kv_dtype = torch.float8_e4m3fn if config.kv.cache_dtype == "fp8_e4m3" else dtype
    pages = getattr(config.kv, f"{side}_pages")
    if side == "prefill":
        tokens = min(config.prefill.max_batch_tokens, max_len)
        shape_args = {"forward_tokens": tokens, "sequences": 1, "logit_rows": min(tokens, PREFILL_LOGIT_ROWS)}
    else:
        n = config.decode.max_running
        shape_args = {"forward_tokens": n, "sequences": n, "logit_rows": n,
                      "extra_forwards": 1 if config.decode.cuda_graphs else 0}
    return plan_memory(
        shape, role=side, dtype=dtype, kv_dtype=kv_dtype, page_size=config.kv.page_size, max_context=max_len,
        device_total_bytes=int(device_total_bytes), fraction=memory_fraction(config, side, share),
        num_pages=None if pages == "auto" else pages, block_size=config.sparse.block_size,
        tp_size=getattr(config, side).tensor_parallel_size, fp8_weights=config.model.weight_dtype != "auto",
        fused_silu=config.runtime.fused_ops, **shape_args)


def check_plan(config: ServiceConfig, plan) -> None:
    """ValueError (naming the options) when ``plan`` does not fit; a pool smaller than one
    ``model.max_model_len`` sequence only when that option is set (unset, the service's limit is
    the smaller of the model's context and the pool: admission refuses longer requests)."""
    problems = plan.problems(plan_names(plan.role))
    if config.model.max_model_len is None:
        problems = [p for p in problems if not p.startswith("model.max_model_len")]
    if problems:
        raise ValueError("\n".join(problems))


def pool_pages(config: ServiceConfig, side: str, device: torch.device | None = None) -> int:
    """The KV pages of a ``side`` replica's pool: ``kv.{side}_pages``, or for "auto" what its
    memory plan holds (CUDA) or :data:`CPU_AUTO_PAGES`. On CUDA the plan is checked first, and
    the device's free memory against it (another process may hold part of the share): a
    ValueError naming the option to change when either does not fit."""
    from model_executor.memory_plan import CUDA_RESERVE_BYTES, gib

    device = device or resolve_device(config)
    pages = getattr(config.kv, f"{side}_pages")
    if device.type != "cuda":
        return CPU_AUTO_PAGES if pages == "auto" else pages
    free, total = torch.cuda.mem_get_info(device)
    plan = replica_memory_plan(config, side, device_total_bytes=total, share=gpu_share())
    check_plan(config, plan)
    usable = free + torch.cuda.memory_reserved(device) + CUDA_RESERVE_BYTES  # this process's own count back
    if usable < plan.need_bytes:
        raise ValueError(f"{side}.gpu_memory_fraction: the {side} replica needs {gib(plan.need_bytes)} "
                         f"({plan.summary()}), the GPU has {gib(free)} free of {gib(total)} (other processes hold "
                         f"the rest): lower {side}.gpu_memory_fraction or kv.{side}_pages, or free the GPU")
    logger.info("memory plan: %s", plan.summary())
    return plan.num_pages


def load_tokenizer(config: ServiceConfig) -> Any:
    """The tokenizer alone (the ingress never loads weights)."""
    from model_executor.loading import load_tokenizer as load

    return load(config.model.model)


@dataclass
class WorkerRuntime:
    """The model, pool and runner of one worker replica."""

    config: ServiceConfig
    loaded: Any
    pool: Any
    runner: Any
    device: torch.device
    decode_graphs: str = "off"  # what enable_decode_graphs did (routing stats)

    @classmethod
    def build(cls, config: ServiceConfig, *, num_pages: int) -> "WorkerRuntime":
        from kv_cache import KVPool, KVPoolConfig
        from model_executor.loading import load_model
        from model_executor.runner import ModelRunner

        if config.runtime.torch_threads:
            torch.set_num_threads(config.runtime.torch_threads)
        device = resolve_device(config)
        dtype = resolve_dtype(config, device)
        loaded = load_model(config.model.model, dtype=dtype, device=device, seed=config.model.seed,
                            weight_dtype=config.model.weight_dtype, rope_scaling=config.model.rope_scaling)
        kv_dtype = torch.float8_e4m3fn if config.kv.cache_dtype == "fp8_e4m3" else dtype
        pool = KVPool(
            KVPoolConfig(
                num_layers=loaded.num_layers, num_kv_heads=loaded.num_kv_heads, head_dim=loaded.head_dim,
                page_size=config.kv.page_size, dtype=kv_dtype, device=str(device), num_pages=num_pages,
            )
        )
        runner = ModelRunner(
            loaded.model, pool, config.sparse_config, dense_below=config.sparse.dense_below, device=device,
            fused_ops=None if config.runtime.fused_ops else False,  # None: fused where the runner runs kernels (CUDA)
        )
        if pool.k_scale is not None:  # same prompt, same model: every replica gets the same scales
            runner.calibrate_kv_scales(margin=config.kv.scale_margin)
        return cls(config, loaded, pool, runner, device)

    def enable_decode_graphs(self) -> str:
        """Decode replicas: capture the decode step as CUDA graphs (``decode.cuda_graphs``)
        for batch sizes up to ``max_running`` and sequences up to ``max_model_len``. Never raises:
        where graphs are off, impossible or fail their check the runner stays eager; returns (and
        keeps in ``decode_graphs``) what happened, for the replica's stats."""
        from model_executor.cuda_graphs import graph_batch_sizes

        if not self.config.decode.cuda_graphs:
            self.decode_graphs = "off: cuda_graphs is False"
        elif self.device.type != "cuda":
            self.decode_graphs = f"off: runs on {self.device}"
        else:
            sizes = graph_batch_sizes(self.config.decode.max_running)
            max_len = resolve_max_model_len(self.config)
            try:
                self.runner.enable_decode_graphs(max_seqlen=max_len, batch_sizes=sizes)
                self.decode_graphs = f"on: batch sizes {list(sizes)}, up to {max_len} tokens"
            except Exception as exc:  # noqa: BLE001 - a capture that fails leaves the replica eager
                self.runner.disable_decode_graphs()
                self.decode_graphs = f"eager: capture failed: {type(exc).__name__}: {exc}"[:500]
                logger.warning("decode CUDA graphs: %s", self.decode_graphs)
        return self.decode_graphs


def rss_bytes() -> int:
    """This process's resident memory (reported in routing stats; 0 where /proc is absent)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):  # not Linux
        return 0


def replica_id() -> str:
    """The Serve replica's id, or "local" outside Serve (unit tests)."""
    try:
        from ray import serve

        return serve.get_replica_context().replica_id.unique_id
    except Exception:
        return "local"


def node_ip() -> str:
    """This node's address as Ray knows it (channel stores listen there); loopback outside Ray."""
    try:
        import ray

        if ray.is_initialized():
            return ray.util.get_node_ip_address()
    except Exception:
        pass
    return "127.0.0.1"


def replica_identity() -> dict:
    """How a replica names itself in channel tickets: its Serve replica id, application and
    deployment (enough for a peer to call it back); ``{"replica_id": "local"}`` outside Serve."""
    try:
        from ray import serve

        ctx = serve.get_replica_context()
        return {"replica_id": ctx.replica_id.unique_id, "app": ctx.app_name, "deployment": ctx.deployment}
    except Exception:
        return {"replica_id": "local"}
