"""ServiceConfig: every option of the disaggregated service in one frozen dataclass.

The same dict travels as the application builder's ``args`` (``serve_config.yaml``), as the
constructor argument of every deployment, and from the ``python -m router serve`` flags.
Unknown keys are rejected so that a typo in a config file fails at deploy time.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from kernels.config import SparseConfig

TRANSPORTS = ("auto", "object_store", "nccl", "cuda_ipc", "gloo")
DTYPES = ("auto", "float32", "bfloat16", "float16")
KV_CACHE_DTYPES = ("auto", "fp8_e4m3")
PREFILL_SCHEDULES = ("fcfs", "shortest_first")  # prefill_worker.scheduler.PREFILL_POLICIES (a test keeps them equal)
DEVICES = ("auto", "cpu", "cuda")
FAULT_MODES = ("flip", "truncate", "break")


def _int(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name}: expected an int >= {minimum}, got {value!r}")
    return value


def _float(name: str, value: Any, minimum: float, maximum: float = math.inf) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (minimum <= value <= maximum):
        raise ValueError(f"{name}: expected a number in [{minimum}, {maximum}], got {value!r}")
    return float(value)


@dataclass(frozen=True)
class FaultInjection:
    """Drills and tests only (all off by default): damage the first ``corrupt_transfers`` KV
    transfers a prefill replica ships (``mode``: "flip" a byte, "truncate" the frame (object
    store only) or "break" the channel instead of sending (channels) or the ticket's GPU
    (cuda_ipc: the receiver finds no usable route); transfers the mode
    does not apply to are shipped intact and not counted); hold
    every prefill call ``prefill_delay_ms`` before it queues, and every decode step
    ``decode_step_delay_ms``, so that a drill can kill a replica mid-request."""

    corrupt_transfers: int = 0
    mode: str = "flip"
    prefill_delay_ms: float = 0.0
    decode_step_delay_ms: float = 0.0

    def __post_init__(self) -> None:
        _int("fault_injection.corrupt_transfers", self.corrupt_transfers, 0)
        _float("fault_injection.prefill_delay_ms", self.prefill_delay_ms, 0.0, 60_000.0)
        _float("fault_injection.decode_step_delay_ms", self.decode_step_delay_ms, 0.0, 60_000.0)
        if self.mode not in FAULT_MODES:
            raise ValueError(f"fault_injection.mode: expected one of {FAULT_MODES}, got {self.mode!r}")


@dataclass(frozen=True)
class ServiceConfig:
    """Options of the service (see docs/ARCHITECTURE.md for where each one acts).

    model: ``"builtin:tiny"``, ``"builtin:structured-8b"`` / ``"builtin:structured-tiny"`` (the
        structured benchmark models: token-id prompts, built from ``seed`` on each replica's
        device; see ``model_executor/loading.py``) or a local Hugging Face directory (read offline).
    served_model_name: the OpenAI ``model`` id clients must send (default: ``model``).
    device / dtype: where and in which dtype the workers run the model ("auto": CUDA and
        bfloat16 when the replica sees a GPU, else CPU and float32).
    page_size, prefill_kv_pages, decode_kv_pages: KV pool geometry per replica.
    weight_dtype: the linear layers' weights (``model_executor/fp8_linear.py``): "auto" (as the
        checkpoint stores them: bf16, or FP8 for an FP8 checkpoint), or quantize a bf16 checkpoint
        on load to e4m3 with one scale per tensor ("fp8_tensor"), per output channel
        ("fp8_channel", also "fp8_e4m3") or per 128x128 block ("fp8_block"); activations are
        quantized per call to match.
    kv_cache_dtype: "auto" (the model dtype) or "fp8_e4m3": FP8 KV pools on both sides and the
        FP8 prefill operator (q quantized per tensor); every replica calibrates identical
        power-of-two K/V scales from one fixed prompt at start (``kv_scale_margin`` x amax).
    alpha, block_size, sink_tokens, window_tokens, dense_below: the prefill operator.
    max_batch_tokens: prompt tokens per prefill forward (a longer prompt is split at this
        budget); batch_wait_ms: how long a prefill replica waits to grow a batch once the first
        request is in.
    prefill_chunk_tokens: chunked prefill: every prompt is prefilled in chunks of at most this
        many tokens, each chunk attending to the earlier ones through the pool (``None`` or 0:
        off, whole prompts per forward). At most ``max_batch_tokens``.
    max_queued_prefill_tokens: prompt tokens a prefill replica accepts into its queue before
        it answers "overloaded" (HTTP 429 / gRPC RESOURCE_EXHAUSTED, with Retry-After).
    prefill_schedule: the order in which a prefill replica takes its waiting prompts: "fcfs"
        (arrival order) or "shortest_first" (least causal work first: a lower median TTFT under
        overload, longer waits for long prompts), where a prompt waiting ``prefill_max_wait_s``
        or more goes ahead of all younger ones.
    max_running: requests one decode replica decodes per step.
    max_model_len: prompt + generated tokens per request.
    transport: how KV pages travel from prefill to decode. "object_store": framed CPU bytes
        through Ray's object store (any devices, any nodes). "nccl": pairwise channels between
        CUDA pools (GPU to GPU, no host copy); "gloo": the same channels between CPU pools.
        "cuda_ipc": the decode replica copies the pages out of the prefill replica's pool on
        the same GPU (CUDA IPC; pools on different GPUs fail over to the object store).
        "auto": for CUDA pools CUDA IPC where prefill and decode share a GPU and "nccl"
        between GPUs, else the object store. A failed channel or IPC transfer is retried over
        the object store. transfer_retries: new attempts after a retryable transfer failure.
    lease_timeout_s: how long a prefill replica keeps pages for a decode side that never
        acknowledges (a crashed ingress), then frees them.
    expected_density: the routing cost model's expected fraction of causal pairs computed
        by sparse prefill above ``dense_below``.
    fused_ops: on CUDA, run the model's RMSNorms and SiLU MLPs as fused Triton kernels
        (``model_executor/fused.py``, the eager modules' math); ``False``: transformers' eager modules.
    prefix_caching: prefill replicas keep the full KV pages of prompts they prefilled and let a
        later prompt that starts with the same tokens reuse them, computing only the rest
        (``KVPool`` prefix cache, least recently used pages evicted first when the pool needs
        room). ``usage.prompt_tokens_details.cached_tokens`` and ``timing.cached_tokens`` say how
        many prompt tokens a request reused. With sparse prefill the reused prefix is treated as
        a chunk boundary (as with ``prefill_chunk_tokens``).
    cuda_graphs: decode replicas on CUDA replay their decode steps from CUDA graphs, one per batch
        size up to ``max_running``, for sequences up to ``max_model_len`` tokens
        (``model_executor/cuda_graphs.py``); other steps run eagerly. A capture that fails or does
        not reproduce the eager step leaves the replica eager, with a warning (its stats say why).
    debug_routing: add replica ids to responses (the ``routing`` field).
    torch_threads: intra-op threads per worker replica (0: leave torch's default).
    decode_resumes: how many times a stream whose decode replica died is resumed (prompt +
        tokens so far prefilled again, decoding continues on a healthy replica).
    adopt_wait_s: how long a decode replica waits for free pages (running requests finishing)
        before it refuses a transfer as "pool exhausted" (bounded queueing, then 429).
    max_request_bytes: largest HTTP body / gRPC request message the ingress accepts (413 /
        INVALID_ARGUMENT beyond).
    auth_token: bearer token clients must send (``Authorization: Bearer ...``); prefer
        ``auth_token_env``, the name of an environment variable holding it (read by the
        ingress replica). Neither set: no auth. The token never reaches the workers or logs.
    """

    model: str = "builtin:tiny"
    served_model_name: str | None = None
    device: str = "auto"
    dtype: str = "auto"
    seed: int = 0
    page_size: int = 64
    kv_cache_dtype: str = "auto"
    weight_dtype: str = "auto"
    kv_scale_margin: float = 2.0
    prefill_kv_pages: int = 1024
    decode_kv_pages: int = 1024
    alpha: float = 0.1
    block_size: int = 128
    sink_tokens: int = 256
    window_tokens: int = 512
    dense_below: int = 1024
    max_batch_tokens: int = 8192
    prefill_chunk_tokens: int | None = None
    batch_wait_ms: float = 2.0
    max_queued_prefill_tokens: int = 262144
    prefill_schedule: str = "fcfs"
    prefill_max_wait_s: float = 30.0
    max_running: int = 64
    max_model_len: int = 32768
    default_max_tokens: int = 16
    transport: str = "auto"
    transfer_retries: int = 2
    lease_timeout_s: float = 120.0
    expected_density: float = 0.3
    fused_ops: bool = True
    cuda_graphs: bool = True
    prefix_caching: bool = True
    debug_routing: bool = False
    torch_threads: int = 0
    retry_after_s: int = 1
    decode_resumes: int = 2
    adopt_wait_s: float = 5.0
    max_request_bytes: int = 1 << 20
    auth_token: str | None = field(default=None, repr=False)
    auth_token_env: str | None = "FLASHPREFILL_API_TOKEN"
    fault_injection: FaultInjection = field(default_factory=FaultInjection)

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise ValueError(f"model: expected 'builtin:tiny' or a model directory, got {self.model!r}")
        from model_executor.loading import check_model_name

        check_model_name(self.model)
        if self.served_model_name is not None and (not isinstance(self.served_model_name, str) or not self.served_model_name):
            raise ValueError(f"served_model_name: expected a non-empty str, got {self.served_model_name!r}")
        if self.device not in DEVICES:
            raise ValueError(f"device: expected one of {DEVICES}, got {self.device!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype: expected one of {DTYPES}, got {self.dtype!r}")
        from model_executor import WEIGHT_DTYPES

        if self.weight_dtype not in WEIGHT_DTYPES:
            raise ValueError(f"weight_dtype: expected one of {tuple(WEIGHT_DTYPES)}, got {self.weight_dtype!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype: expected one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
        _float("kv_scale_margin", self.kv_scale_margin, 1.0, 1e6)
        if self.transport not in TRANSPORTS:
            raise ValueError(f"transport: expected one of {TRANSPORTS}, got {self.transport!r}")
        _int("seed", self.seed, 0)
        _int("page_size", self.page_size, 1)
        _int("prefill_kv_pages", self.prefill_kv_pages, 1)
        _int("decode_kv_pages", self.decode_kv_pages, 1)
        _int("dense_below", self.dense_below, 0)
        _int("max_batch_tokens", self.max_batch_tokens, 1)
        if self.prefill_chunk_tokens is not None:
            _int("prefill_chunk_tokens", self.prefill_chunk_tokens, 0)
            if self.prefill_chunk_tokens > self.max_batch_tokens:
                raise ValueError(
                    f"prefill_chunk_tokens: expected at most max_batch_tokens ({self.max_batch_tokens}), got "
                    f"{self.prefill_chunk_tokens}: raise max_batch_tokens or use smaller chunks")
        _float("batch_wait_ms", self.batch_wait_ms, 0.0, 10_000.0)
        _int("max_queued_prefill_tokens", self.max_queued_prefill_tokens, 1)
        if self.prefill_schedule not in PREFILL_SCHEDULES:
            raise ValueError(f"prefill_schedule: expected one of {PREFILL_SCHEDULES}, got {self.prefill_schedule!r}")
        _float("prefill_max_wait_s", self.prefill_max_wait_s, 0.0, 86400.0)
        _int("max_running", self.max_running, 1)
        _int("max_model_len", self.max_model_len, 2)
        _int("default_max_tokens", self.default_max_tokens, 1)
        _int("transfer_retries", self.transfer_retries, 0)
        _float("lease_timeout_s", self.lease_timeout_s, 0.1)
        _float("expected_density", self.expected_density, 0.0, 1.0)
        _int("torch_threads", self.torch_threads, 0)
        _int("retry_after_s", self.retry_after_s, 0)
        _int("decode_resumes", self.decode_resumes, 0)
        _float("adopt_wait_s", self.adopt_wait_s, 0.0, 3600.0)
        _int("max_request_bytes", self.max_request_bytes, 1024)
        if self.auth_token is not None and (not isinstance(self.auth_token, str) or not self.auth_token.strip()):
            raise ValueError("auth_token: expected a non-empty string or None (the value is not shown)")
        if self.auth_token_env is not None and (not isinstance(self.auth_token_env, str) or not self.auth_token_env):
            raise ValueError(f"auth_token_env: expected an environment variable name or None, got {self.auth_token_env!r}")
        if not isinstance(self.fused_ops, bool):
            raise ValueError(f"fused_ops: expected a bool, got {self.fused_ops!r}")
        if not isinstance(self.prefix_caching, bool):
            raise ValueError(f"prefix_caching: expected a bool, got {self.prefix_caching!r}")
        if not isinstance(self.cuda_graphs, bool):
            raise ValueError(f"cuda_graphs: expected a bool, got {self.cuda_graphs!r}")
        if not isinstance(self.debug_routing, bool):
            raise ValueError(f"debug_routing: expected a bool, got {self.debug_routing!r}")
        self.sparse_config  # validates alpha, block_size, sink/window via SparseConfig

    @property
    def model_id(self) -> str:
        return self.served_model_name or self.model

    @property
    def prefill_chunk_size(self) -> int | None:
        """``PrefillEngine``'s ``chunk_size``: None when chunked prefill is off."""
        return self.prefill_chunk_tokens or None

    @property
    def sparse_config(self) -> SparseConfig:
        return SparseConfig(
            alpha=self.alpha, block_size=self.block_size,
            sink_tokens=self.sink_tokens, window_tokens=self.window_tokens,
        )

    @classmethod
    def from_dict(cls, raw: dict | "ServiceConfig" | None) -> "ServiceConfig":
        if raw is None:
            return cls()
        if isinstance(raw, ServiceConfig):
            return raw
        if not isinstance(raw, dict):
            raise ValueError(f"config: expected a mapping of options, got {type(raw).__name__}")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(raw) - names)
        if unknown:
            raise ValueError(f"config: unknown option(s) {unknown}; known: {sorted(names)}")
        values = dict(raw)
        fi = values.get("fault_injection")
        if isinstance(fi, dict):
            values["fault_injection"] = FaultInjection(**fi)
        elif fi is not None and not isinstance(fi, FaultInjection):
            raise ValueError(f"fault_injection: expected a mapping, got {fi!r}")
        return cls(**values)

    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        return out

    def worker_dict(self) -> dict:
        """What the worker deployments get: everything but the auth secret."""
        out = self.to_dict()
        out["auth_token"] = None
        return out

    def replace(self, **changes: Any) -> "ServiceConfig":
        return dataclasses.replace(self, **changes)
