"""Our attention inside transformers models: paged KV pool writes, FlashPrefill V2 prefill,
paged decode.

The runner registers :func:`paged_attention_forward` under :data:`ATTENTION_NAME` in
transformers' ``AttentionInterface`` and calls the model on a *packed* batch
(``input_ids [1, T]``, ``position_ids [1, T]``) with one extra keyword argument,
``fpv2_batch=ForwardBatch(...)``, which transformers hands unchanged to every attention call.

No dense ``L x L`` mask is ever built: the name is deliberately *not* registered in the mask
interface, and for such names transformers passes ``attention_mask=None`` (checked with
transformers 5.17 and 5.24). :class:`ForwardState` counts the masks it sees, so tests can
check that.

FP8 KV pools (``float8_e4m3fn``): K/V are written quantized with the pool's per-layer, per-KV-head
descales; prefill quantizes q per tensor (amax on the device, no sync) and runs the FP8 operator
(``kernels/fp8.py``). A caller that already knows q's max ``|q|`` passes it as ``query_amax=`` (a
float32 ``[1]`` device tensor: ``model_executor/fp8_linear.py``'s attention forward gets it from
its RoPE pass, ``kernels.fp8_gemm.rotary_amax``), and the quantization is then one pass with
the same bits (no separate amax pass); decode keeps q in the model dtype and reads the e4m3 pages with the
descales. ``ForwardBatch.calibrate_kv`` (set by ``ModelRunner.calibrate_kv_scales``) makes each
layer set its scales from the batch's K/V amax, rounded up to a power of two, before writing.

Supported: causal full attention (Llama 3.x, Qwen2, Qwen3 full-attention layers), GQA/MQA.
Not supported: sliding-window layers, attention dropout, soft-capping, returning weights.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass, field
from typing import Any

import torch

from kernels import fp8, fp8_gemm, ops, reference, rope_kv
from kernels.config import SparseConfig
from kernels.plan import PrefillPlan
from kernels.ranges import op_range

# No "flash" (transformers would treat it as FlashAttention) and no "/" (a hub kernel).
ATTENTION_NAME = "fpv2_paged"
# The keyword argument of ``model(...)`` that carries the batch metadata.
BATCH_KWARG = "fpv2_batch"


class ForwardMode(enum.Enum):
    PREFILL = "prefill"
    DECODE = "decode"


@dataclass
class ForwardState:
    """Mutable scratch of one forward pass: the plan shared by all layers, and counters."""

    plans: dict[tuple, tuple[PrefillPlan, SparseConfig]] = field(default_factory=dict)
    layers_called: int = 0
    masks_seen: int = 0
    # what the sparse layers attended (:meth:`count_index`): per sequence of the batch, the
    # selected (query tile, key tile) pairs over every KV head and sparse layer (int64 device
    # tensor, read once after the forward), and the causal pairs of the same layers (host)
    selected_tiles: torch.Tensor | None = None
    causal_tiles: list[int] | None = None
    _causal_of: dict[int, tuple[list[int], torch.Tensor]] = field(default_factory=dict)

    def count_index(self, plan: PrefillPlan, index: Any) -> None:
        """Add one layer's index to :attr:`selected_tiles` / :attr:`causal_tiles`: a few small
        device ops (segment lengths summed per sequence), no host sync."""
        cached = self._causal_of.get(id(plan))
        if cached is None:  # once per plan (forward): the causal counts and the tiles' sequences
            cached = self._causal_of[id(plan)] = (
                [plan.num_kv_heads * n for n in causal_tile_pairs(plan)], plan.tile_seq.long())
        causal, tile_seq = cached
        seg = index.seg_offsets
        per_tile = (seg[1:] - seg[:-1]).view(plan.num_kv_heads, plan.total_tiles).sum(0, dtype=torch.int64)
        if self.selected_tiles is None:
            self.selected_tiles = torch.zeros(plan.batch_size, dtype=torch.int64, device=per_tile.device)
            self.causal_tiles = [0] * plan.batch_size
        self.selected_tiles.index_add_(0, tile_seq, per_tile)
        self.causal_tiles = [a + b for a, b in zip(self.causal_tiles, causal)]

    def count_dense(self, plan: PrefillPlan) -> None:
        """A layer that ran dense inside a sparse forward (``sparse.dense_layers``, a zero
        ``layer_alpha``) without an index: every causal tile counts as selected, as the index of
        such a layer lists them on the kernels' backends."""
        cached = self._causal_of.get(id(plan))
        if cached is None:
            cached = self._causal_of[id(plan)] = (
                [plan.num_kv_heads * n for n in causal_tile_pairs(plan)], plan.tile_seq.long())
        causal = cached[0]
        if self.selected_tiles is None:
            self.selected_tiles = torch.zeros(plan.batch_size, dtype=torch.int64, device=plan.device)
            self.causal_tiles = [0] * plan.batch_size
        self.selected_tiles += torch.tensor(causal, dtype=torch.int64, device=plan.device)
        self.causal_tiles = [a + b for a, b in zip(self.causal_tiles, causal)]

    def plan_for(
        self, key: tuple, build: Any
    ) -> tuple[PrefillPlan, SparseConfig]:
        if key not in self.plans:
            self.plans[key] = build()
        return self.plans[key]


def causal_tile_pairs(plan: PrefillPlan) -> list[int]:
    """Per sequence of ``plan``: the (query tile, 64-key tile) pairs of one KV head that causal
    attention touches at all, i.e. the tiles a dense prefill computes (``PrefillPlan.causal_tiles``)."""
    return list(plan.causal_tiles)


@dataclass(frozen=True)
class ForwardBatch:
    """Batch metadata of one packed forward pass (built by the runner).

    pool: the KV pool (``pool.k[layer]`` / ``pool.v[layer]`` are the layer's pages).
    page_table: int32 ``[B, max_pages]``; cu_seqlens_q: int32 ``[B+1]`` offsets of the new
    tokens in the packed batch; seqlens_kv: int32 ``[B]`` keys per sequence *including* the
    new tokens; slots: int64 ``[T]`` pool slot of each new token; max_seqlen_kv: the longest
    ``seqlens_kv`` (host int: decode picks its split count without a host sync).
    dense: use exact dense attention for this prefill (short batch, see ``dense_below``).
    backend: kernels backend ("auto": Triton on CUDA, the reference on CPU).
    """

    pool: Any
    page_table: torch.Tensor
    cu_seqlens_q: torch.Tensor
    seqlens_kv: torch.Tensor
    slots: torch.Tensor
    mode: ForwardMode
    sparse_config: SparseConfig
    max_seqlen_kv: int = 1
    dense: bool = False
    backend: str = "auto"
    state: ForwardState = field(default_factory=ForwardState)
    calibrate_kv: float | None = None  # FP8 pools: set each layer's scales (this margin) first
    # per sequence, the whole prompt's length where this forward prefills a chunk that does not
    # end it (sparse_config.last_dense_tiles counts the prompt's last tiles); None: all end here
    prompt_lens: tuple[int, ...] | None = None


def _to_tokens_major(x: torch.Tensor) -> torch.Tensor:
    """``[1, H, T, d]`` (transformers' layout) -> ``[T, H, d]`` contiguous."""
    return x[0].transpose(0, 1).contiguous()


# The most int32 CSR entries a layer's index may allocate for its worst case (every causal tile
# pair; 33.6M entries, 134 MB, at 128K tokens with 32/8 heads): up to it the index is built with
# no host sync (a per-layer read of its entry count, ~10 us of stall and launch gap each);
# past it, an exact-sized CSR after one read per layer (the worst case grows with L^2).
INDEX_CAPACITY_MAX_ENTRIES = 1 << 28


def index_capacity(plan: PrefillPlan) -> int | None:
    """``plan.index_capacity`` when it is within :data:`INDEX_CAPACITY_MAX_ENTRIES`, else None
    (the index reads its exact size back)."""
    cap = plan.index_capacity
    return cap if cap <= INDEX_CAPACITY_MAX_ENTRIES else None


def _prefill(
    batch: ForwardBatch, layer: int, q: torch.Tensor, scaling: float | None,
    query_amax: torch.Tensor | None = None,
) -> torch.Tensor:
    pool = batch.pool
    k_pages, v_pages = pool.k[layer], pool.v[layer]
    backend = ops.resolve_backend(batch.backend, q.device)
    q_descale = None
    if pool.k_scale is not None:  # FP8 pool: per-tensor q scale, computed on the device
        quant_backend = "reference" if backend == "reference" else "triton"
        with op_range("q_quant"):
            if query_amax is not None:  # from the QKV path's RoPE pass: the same bits, one pass fewer
                q, q_descale = fp8_gemm.quantize_with_amax(q, query_amax, backend=quant_backend)
            else:
                q, q_descale = fp8.quantize_per_tensor(q, backend=quant_backend)
    # the layer's own threshold: 0 in the first sparse.dense_layers, else its layer_alpha
    config = batch.sparse_config.for_layer(layer)
    if scaling is not None and config.scale is None:
        config = dataclasses.replace(config, scale=float(scaling))
    # dense by the model-level options (a runner configured with alpha 0 everywhere still runs
    # the sparse kernels at alpha 0: the numerical floor of the sparse path)
    layer_dense = config.alpha == 0 and batch.sparse_config.alpha_of_layer(layer) != batch.sparse_config.alpha
    dense = batch.dense or layer_dense
    if dense:
        config = dataclasses.replace(config, alpha=0.0)

    def build() -> tuple[PrefillPlan, SparseConfig]:
        plan = ops.plan_prefill(
            q, k_pages, v_pages, batch.page_table, batch.cu_seqlens_q, batch.seqlens_kv, config,
            batch.prompt_lens,
        )
        return plan, config

    # One plan (one host sync) per forward, shared by every layer with the same head shape.
    with op_range("index"):
        plan, _ = batch.state.plan_for((q.shape[1], q.shape[2], config), build)
    descales = None
    if q_descale is not None:  # the pool's scales were validated when set: no sync here
        descales = ops.plan_descales(q, plan, q_descale, pool.k_scale[layer], pool.v_scale[layer],
                                     check_values=False)
    if dense and backend == "reference":
        with op_range("attention"):
            out, _ = reference.dense_attention(q, k_pages, v_pages, plan, descales=descales)
        if layer_dense and not batch.dense:
            batch.state.count_dense(plan)
        return out
    with op_range("index"):
        index = ops.build_index_planned(q, k_pages, v_pages, plan, backend=backend, descales=descales,
                                        capacity=index_capacity(plan))
        batch.state.count_index(plan, index)
    # the unresolved choice: attention_planned is where "auto" picks the CUTLASS kernel (a
    # resolved "auto" is "triton" and would never reach it)
    with op_range("attention"):
        out, _ = ops.attention_planned(q, k_pages, v_pages, plan, index, backend=batch.backend, descales=descales)
    return out


def _decode(batch: ForwardBatch, layer: int, q: torch.Tensor, scaling: float | None) -> torch.Tensor:
    from kernels.decode import paged_decode

    scale = batch.sparse_config.scale if batch.sparse_config.scale is not None else scaling
    pool = batch.pool
    fp8_pool = pool.k_scale is not None
    out, _ = paged_decode(
        q, pool.k[layer], pool.v[layer], batch.page_table, batch.seqlens_kv,
        scale=scale, num_splits=batch.sparse_config.num_splits, max_seqlen_kv=batch.max_seqlen_kv,
        check_values=False,  # the pool built the page table and lengths, and checked its scales
        backend=batch.backend,
        k_descale=pool.k_scale[layer] if fp8_pool else None,
        v_descale=pool.v_scale[layer] if fp8_pool else None,
    )
    return out


def rope_kv_fusable(batch: object, dtype: torch.dtype) -> bool:
    """Whether a layer can write its K/V from its RoPE pass (:func:`rope_and_write_kv`): a batch of
    our runner, no FP8 scale calibration in this forward (it sets the scales from the rotated keys
    before the first write), and a pool of the model's ``dtype`` or e4m3."""
    return (isinstance(batch, ForwardBatch) and batch.calibrate_kv is None
            and (batch.pool.k_scale is not None or batch.pool.k.dtype == dtype))


def rope_and_write_kv(module: torch.nn.Module, batch: ForwardBatch, q: torch.Tensor, k: torch.Tensor,
                      v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, backend: str,
                      q_amax: bool = False):
    """RoPE of tokens-major ``q``, ``k`` and the write of the rotated ``k`` and ``v`` into layer
    ``module.layer_idx`` of the pool, one kernel (``kernels.rope_kv``; the same bytes as RoPE then
    ``pool.write``); returns the rotated ``q`` (and its amax with ``q_amax``). Pass
    ``kv_written=True`` to :func:`paged_attention_forward` afterwards. Check
    :func:`rope_kv_fusable` first."""
    pool, layer = batch.pool, module.layer_idx
    fp8_pool = pool.k_scale is not None
    with op_range("rope_kv"):
        return rope_kv.rope_kv_write(q, k, v, cos, sin, batch.slots, pool.k[layer], pool.v[layer],
                                     k_descale=pool.k_scale[layer] if fp8_pool else None,
                                     v_descale=pool.v_scale[layer] if fp8_pool else None,
                                     q_amax=q_amax, backend=backend)


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    query_amax: torch.Tensor | None = None,
    kv_written: bool = False,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers attention function: ``query [1, Hq, T, d]``, ``key/value [1, Hkv, T, d]``
    (not repeated for GQA) -> ``([1, T, Hq, d], None)``. ``query_amax``: ``max |query|`` (float32
    ``[1]``, on query's device) when the caller computed it (FP8 pools' prefill uses it).
    ``kv_written``: the caller already wrote ``key``/``value`` into the pool
    (:func:`rope_and_write_kv`); they are not written again."""
    batch = kwargs.get(BATCH_KWARG)
    if not isinstance(batch, ForwardBatch):
        raise ValueError(
            f"{BATCH_KWARG}: the '{ATTENTION_NAME}' attention needs a ForwardBatch passed as "
            f"model(..., {BATCH_KWARG}=...); got {type(batch).__name__}. Run the model through "
            "model_executor.ModelRunner"
        )
    if query.shape[0] != 1:
        raise ValueError(
            f"query: expected a packed batch of shape [1, Hq, T, d], got {tuple(query.shape)}"
        )
    if sliding_window is not None:
        raise ValueError(
            f"sliding_window: layers with sliding-window attention are not supported, got {sliding_window}"
        )
    if dropout:
        raise ValueError(f"dropout: expected 0.0 (inference only), got {dropout}")
    layer = getattr(module, "layer_idx", None)
    if layer is None:
        raise ValueError("module: expected an attention module with a layer_idx attribute")
    batch.state.layers_called += 1
    if attention_mask is not None:
        batch.state.masks_seen += 1

    pool = batch.pool
    # FP8 pools quantize in ``write``; the query keeps the model dtype (prefill quantizes it)
    work_dtype = query.dtype if pool.k_scale is not None else pool.k.dtype
    if not kv_written:
        k = _to_tokens_major(key).to(work_dtype)
        v = _to_tokens_major(value).to(work_dtype)
        if batch.calibrate_kv is not None and pool.k_scale is not None:
            pool.set_scales(layer, fp8.pow2_descale(k, batch.calibrate_kv), fp8.pow2_descale(v, batch.calibrate_kv))
        # the pool's write kernel (FP8 pools) follows the batch's choice; "auto"/"cutlass": Triton on CUDA
        with op_range("kv_write"):
            pool.write(layer, batch.slots, k, v,
                       backend=batch.backend if batch.backend in ("reference", "triton") else "auto")
    elif batch.calibrate_kv is not None:
        raise ValueError("kv_written: a forward that calibrates the FP8 scales writes K/V here, after setting them")
    q = _to_tokens_major(query).to(work_dtype)
    if batch.mode is ForwardMode.DECODE:
        with op_range("attention"):
            out = _decode(batch, layer, q, scaling)
    else:
        if query_amax is not None and (not isinstance(query_amax, torch.Tensor) or query_amax.dtype != torch.float32
                                       or query_amax.numel() != 1 or query_amax.device != q.device):
            raise ValueError(f"query_amax: expected a float32 tensor of one element on {q.device}, got "
                             f"{(query_amax.dtype, tuple(query_amax.shape), str(query_amax.device)) if isinstance(query_amax, torch.Tensor) else type(query_amax).__name__}")
        out = _prefill(batch, layer, q, scaling, query_amax)
    return out.to(query.dtype).unsqueeze(0), None


def register_attention() -> str:
    """Register our attention function with transformers (idempotent); returns its name."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, paged_attention_forward)
    return ATTENTION_NAME
