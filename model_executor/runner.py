"""ModelRunner: one forward pass of a transformers causal LM over our paged KV pool.

The runner packs a batch into ``input_ids [1, T]`` / ``position_ids [1, T]`` (positions
continue after each sequence's cached prefix), builds the :class:`ForwardBatch` the attention
function reads, and computes the LM head only where a next token is needed (the last position
of each sequence). It never allocates pages: the engines reserve them (``ensure_capacity``)
and release them; the runner writes K/V into reserved pages and advances ``seq_len``. A decode
step's metadata stays on the device between steps (``decode_metadata.py``), or in the CUDA
graphs' static buffers (``cuda_graphs.py``).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kernels import ops
from kernels._checks import canonical_device
from kernels.config import SparseConfig

from . import fp8_linear, fused, parallel
from .cuda_graphs import DEFAULT_BATCH_SIZES, DecodeGraphs
from .decode_metadata import DecodeMetadata
from .attention import (
    ATTENTION_NAME,
    BATCH_KWARG,
    ForwardBatch,
    ForwardMode,
    ForwardState,
    register_attention,
)

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PrefillItem:
    """``token_ids``: the new tokens of this forward (a whole prompt or one chunk of it);
    ``cached_len``: tokens of this request already in the pool (earlier chunks or a cached
    prefix); the new tokens attend to them. ``prompt_len``: the whole prompt's length when
    these tokens do not end it (chunked prefill); None: they do."""

    request_id: str
    token_ids: Sequence[int]
    cached_len: int = 0
    # the whole prompt's length when these tokens are a chunk that does not end it (the sparse
    # config's last_dense_tiles are the prompt's last tiles); None: they end the prompt
    prompt_len: int | None = None


class ModelRunner:
    """Runs ``model`` with FlashPrefill V2 prefill and paged decode over ``pool``.

    sparse_config: the prefill operator's options (``alpha=0``: dense).
    dense_below: batches whose longest sequence (prefix included) is shorter than this many
        tokens use exact dense attention.
    backend: kernels backend, ``"auto"`` (Triton on CUDA, the reference on CPU).
    fused_ops: run the model's RMSNorms, SiLU MLPs and Llama RoPE as fused kernels
        (``model_executor/fused.py``): ``None`` (default) on CUDA when ``backend`` runs kernels (not
        ``"reference"``) and the kernels pass ``fused.self_check`` there (else eager, with a
        warning), ``True`` always (Triton; on CPU under ``TRITON_INTERPRET=1``; ValueError if the
        check fails), ``False`` never (restores the eager modules of a model an earlier runner
        fused). ``fused_counts`` says what runs fused.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        pool,
        sparse_config: SparseConfig | None = None,
        *,
        dense_below: int = 1024,
        device: str | torch.device | None = None,
        backend: str = "auto",
        fused_ops: bool | None = None,
    ) -> None:
        if isinstance(dense_below, bool) or not isinstance(dense_below, int) or dense_below < 0:
            raise ValueError(f"dense_below: expected an int >= 0, got {dense_below!r}")
        if fused_ops not in (None, True, False):
            raise ValueError(f"fused_ops: expected None, True or False, got {fused_ops!r}")
        self.sparse_config = SparseConfig() if sparse_config is None else sparse_config
        if not isinstance(self.sparse_config, SparseConfig):
            raise ValueError(
                f"sparse_config: expected a SparseConfig, got {type(self.sparse_config).__name__}"
            )
        layers = getattr(getattr(model, "config", None), "num_hidden_layers", None)
        own = self.sparse_config.layer_alpha
        if isinstance(layers, int) and own is not None and len(own) > layers:
            raise ValueError(f"sparse_config.layer_alpha: expected at most one entry per layer ({layers}), "
                             f"got {len(own)} (a profile calibrated for another model?)")
        self.model = model
        self.pool = pool
        self.dense_below = dense_below
        self.backend = backend
        self.device = canonical_device(device) if device is not None else pool.k.device
        self._check_geometry()
        kernel_backend = ops.resolve_backend(backend, self.device)  # ValueError for an unknown or unusable one
        asked = fused_ops
        if asked is None:  # by default on CUDA, where the kernels build and agree with eager
            fused_ops = self.device.type == "cuda" and kernel_backend != "reference"
        elif asked and not ops.triton_available(self.device):
            raise ValueError(f"fused_ops: True needs Triton on {self.device} (CUDA, or TRITON_INTERPRET=1 on CPU)")
        why = fused.self_check(model, self.device) if fused_ops else None
        if why is not None:
            if asked:
                raise ValueError(f"fused_ops: the fused kernels fail their check on {self.device}: {why}")
            logger.warning("fused_ops: keeping transformers' eager modules (%s)", why)
            fused_ops = False
        if fused_ops:
            fused.install(model, backend="triton")
        else:
            fused.uninstall(model)
        self.fused_counts = fused.installed(model)
        # FP8 layers (model_executor/fp8_linear.py): their GEMM backend, the norms that quantize
        # for them, and with an FP8 pool the attention forward whose RoPE pass gives q's amax
        # (after fused's: both replace the same modules' forwards)
        if kernel_backend == "reference":
            linear_backend = "reference"
        else:  # on CUDA _scaled_mm / Triton; on CPU "triton" (the interpreter) when asked
            linear_backend = "auto" if self.device.type == "cuda" or backend != "triton" else "triton"
        self.fp8_counts = fp8_linear.install_forwards(model, kernels=bool(fused_ops), fp8_pool=pool.k_scale is not None,
                                                      linear_backend=linear_backend)
        parallel.install_reductions(model)  # a TP shard's all-reduces (a module replaced since gets its own)
        register_attention()
        model.set_attn_implementation(ATTENTION_NAME)
        self.vocab_size = int(model.config.vocab_size)
        self.last_state: ForwardState | None = None  # of the latest eager forward (a graph step keeps none), for tests
        self._last_rids: list[str] = []
        self.decode_graphs: DecodeGraphs | None = None  # enable_decode_graphs
        # the eager decode step's metadata, on the device between steps (decode_metadata.py)
        self.decode_metadata = DecodeMetadata(self.page_size, self.device)
        self.memory = self.memory_report()
        logger.info(
            "weights %.2f GiB (%s, %d FP8 layers, %.2f GiB saved vs the model dtype: room for %d more KV pages); "
            "KV pool %d pages of %d bytes (%.2f GiB); free device memory holds %s more pages",
            self.memory["weight_bytes"] / 2**30, self.memory["weight_dtype"], self.memory["fp8_layers"],
            self.memory["fp8_saved_bytes"] / 2**30, self.memory["pages_freed_by_fp8"], self.memory["pool_pages"],
            self.memory["page_bytes"], self.memory["pool_bytes"] / 2**30,
            "?" if self.memory["free_pages"] is None else self.memory["free_pages"],
        )

    def memory_report(self) -> dict:
        """Weight and KV pool memory (logged at start-up): ``weight_bytes`` (parameters and
        buffers), ``fp8_saved_bytes`` (what the FP8 layers save against the same layers in the
        model dtype, scales counted) and the KV pages that fit in it (``pages_freed_by_fp8``), the
        pool's ``pool_pages`` x ``page_bytes``, and ``free_pages``: pages the device's free memory
        holds now (CUDA; ``None`` elsewhere)."""
        wb = fp8_linear.weight_bytes(self.model)
        dense = next((p.dtype for p in self.model.parameters() if p.is_floating_point()), torch.bfloat16)
        elem = torch.empty((), dtype=dense).element_size()
        saved = 0
        for m in fp8_linear.fp8_layers(self.model).values():
            saved += m.weight.numel() * (elem - 1) - m.weight_scale.numel() * m.weight_scale.element_size()
        page_bytes = int(self.pool.page_bytes)
        free = None
        if self.device.type == "cuda":
            free = int(torch.cuda.mem_get_info(self.device)[0]) // page_bytes
        return {"weight_bytes": wb["total"], "fp8_weight_bytes": wb["fp8"], "fp8_layers": wb["fp8_layers"],
                "weight_dtype": fp8_linear.weight_dtype_of(self.model), "fp8_saved_bytes": max(saved, 0),
                "pages_freed_by_fp8": max(saved, 0) // page_bytes, "page_bytes": page_bytes,
                "pool_pages": int(self.pool.num_pages), "pool_bytes": int(self.pool.num_pages) * page_bytes,
                "free_pages": free}

    def enable_decode_graphs(
        self, *, max_seqlen: int, batch_sizes: Sequence[int] = DEFAULT_BATCH_SIZES, capture: bool = True
    ) -> DecodeGraphs:
        """Run ``decode`` steps from CUDA graphs (``model_executor/cuda_graphs.py``): one per
        batch size in ``batch_sizes``, for sequences up to ``max_seqlen`` tokens; other steps stay
        eager. Captures now (borrowing a few free pages meanwhile) and checks each graph against the
        eager step; ValueError if one does not reproduce it (the runner then stays eager).
        ``capture=False``: the same padded static-buffer step without graphs (CPU)."""
        self.decode_graphs = None  # an earlier set's memory goes before the new one is captured
        graphs = DecodeGraphs(self, max_seqlen=max_seqlen, batch_sizes=batch_sizes, capture=capture)
        self.decode_graphs = graphs
        return graphs

    def disable_decode_graphs(self) -> None:
        """Back to eager decode steps (the graphs' memory is freed)."""
        self.decode_graphs = None

    def _check_geometry(self) -> None:
        cfg = self.model.config
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        shard = parallel.shard_of(self.model)
        kv_heads = cfg.num_key_value_heads if shard is None else shard.layout.local_kv_heads
        want = (cfg.num_hidden_layers, kv_heads, head_dim)
        got = (self.pool.k.shape[0], self.pool.k.shape[3], self.pool.k.shape[4])
        if want != got:
            where = "the model config" if shard is None else f"rank {shard.tp.rank}'s shard of {shard.tp.size}"
            raise ValueError(
                "pool: expected (num_layers, num_kv_heads, head_dim) = "
                f"{want} from {where}, got {got}"
            )
        if self.pool.k.dtype not in (torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn):
            raise ValueError(
                f"pool: expected a float32, bfloat16, float16 or float8_e4m3fn pool, got {self.pool.k.dtype}"
            )
        if self.pool.k.device != self.device:
            raise ValueError(f"device: expected the pool's device {self.pool.k.device}, got {self.device}")

    @property
    def page_size(self) -> int:
        return int(self.pool.k.shape[2])

    def ensure_capacity(self, request_id: str, num_tokens: int) -> None:
        """Make sure ``request_id`` holds pages for ``num_tokens`` tokens in total (reserving
        more if needed; all-or-nothing, raises ``PoolExhausted``)."""
        held = len(self.pool.pages(request_id)) if self.pool.has(request_id) else 0
        if held * self.page_size < num_tokens:
            self.pool.reserve(request_id, num_tokens)

    def _check_tokens(self, name: str, ids: Sequence[int] | torch.Tensor) -> torch.Tensor:
        """Host-side int64 tensor of ``ids`` (one vectorised range check, no per-token loop)."""
        t = torch.as_tensor(ids if isinstance(ids, torch.Tensor) else list(ids), dtype=torch.int64)
        if t.numel():
            lo, hi = int(t.min()), int(t.max())
            if lo < 0 or hi >= self.vocab_size:
                bad = lo if lo < 0 else hi
                raise ValueError(f"{name}: token id {bad} is outside the vocabulary [0, {self.vocab_size})")
        return t

    def _check_room(self, request_id: str, start: int, length: int) -> None:
        if not self.pool.has(request_id):
            raise ValueError(f"request_id: {request_id!r} holds no pages; reserve them first")
        seq_len = self.pool.seq_len(request_id)
        if start != seq_len:
            raise ValueError(
                f"cached_len: expected {seq_len} (tokens of {request_id!r} in the pool), got {start}"
            )
        capacity = len(self.pool.pages(request_id)) * self.page_size
        if start + length > capacity:
            raise ValueError(
                f"request_id: {request_id!r} has room for {capacity} tokens, needs {start + length}; "
                "call ensure_capacity first"
            )

    @torch.inference_mode()
    def _forward(
        self,
        request_ids: list[str],
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        starts: list[int],
        lengths: list[int],
        mode: ForwardMode,
        logits_to_keep: torch.Tensor | int,
        calibrate_kv: float | None = None,
        sparse_config: SparseConfig | None = None,
        prompt_lens: list[int] | None = None,
    ) -> torch.Tensor:
        dev = self.device
        sparse = self.sparse_config if sparse_config is None else sparse_config
        cu = [0]
        for n in lengths:
            cu.append(cu[-1] + n)
        seqlens_kv = [s + n for s, n in zip(starts, lengths)]
        batch = ForwardBatch(
            pool=self.pool,
            page_table=self.pool.page_table(request_ids, device=dev),
            cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=dev),
            seqlens_kv=torch.tensor(seqlens_kv, dtype=torch.int32, device=dev),
            slots=self.pool.slot_mapping(request_ids, starts, lengths, device=dev),
            mode=mode,
            sparse_config=sparse,
            max_seqlen_kv=max(seqlens_kv),
            dense=max(seqlens_kv) < self.dense_below or (sparse_config is not None and sparse.alpha == 0
                                                             and not sparse.layer_alpha),
            backend=self.backend,
            calibrate_kv=calibrate_kv,
            # only a chunk that does not end its prompt needs it: the plan's default otherwise
            prompt_lens=(tuple(prompt_lens) if prompt_lens is not None
                         and any(n != kv for n, kv in zip(prompt_lens, seqlens_kv)) else None),
        )
        logits = self.run_model(batch, input_ids.to(dev), position_ids.to(dev), logits_to_keep)
        for rid, n in zip(request_ids, seqlens_kv):
            self.pool.set_seq_len(rid, n)
        self.last_state = batch.state
        self._last_rids = request_ids
        return logits

    def index_tile_counts(self) -> dict[str, tuple[int, int]]:
        """Of the latest eager prefill forward: per request id, ``(selected, causal)`` (query
        tile, 64-key tile) pairs summed over its sparse layers and KV heads (this rank's heads
        under TP); empty when it ran dense (no index was built). ``selected / causal`` is the
        block density the forward ran at. Reads a device tensor (one host sync): call it after
        the forward's logits are read anyway."""
        state = self.last_state
        if state is None or state.selected_tiles is None:
            return {}
        selected = state.selected_tiles.tolist()
        return {rid: (int(s), int(c)) for rid, s, c in zip(self._last_rids, selected, state.causal_tiles)}

    def run_model(
        self, batch: ForwardBatch, input_ids: torch.Tensor, position_ids: torch.Tensor,
        logits_to_keep: torch.Tensor | int,
    ) -> torch.Tensor:
        """The model over one packed batch whose metadata is built (device tensors, no host
        work): float32 logits ``[kept, V]``. Advances no ``seq_len``: the caller does. What the
        decode CUDA graphs capture (``model_executor/cuda_graphs.py``)."""
        with torch.inference_mode():
            out = self.model(
                input_ids=input_ids[None],
                position_ids=position_ids[None],
                use_cache=False,
                logits_to_keep=logits_to_keep,
                **{BATCH_KWARG: batch},
            )
            return out.logits[0].float()

    def prefill(self, items: Sequence[PrefillItem]) -> torch.Tensor:
        """Prefill a batch (whole prompts or chunks); returns float32 logits ``[B, V]`` of each
        item's last new token. Pages must be reserved for ``cached_len + len(token_ids)``."""
        return self.prefill_keeping(items)[0]

    def prefill_keeping(
        self, items: Sequence[PrefillItem], keep_all: Sequence[bool] | None = None,
        sparse_config: SparseConfig | None = None,
    ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """:meth:`prefill`, and for each item ``i`` with ``keep_all[i]`` the logits of every
        one of its new tokens (``[len(token_ids), V]``, keyed by ``i``): prompt logprobs. The
        forward is the same (sparse where the runner's sparse config says so); only more rows
        of the LM head are computed. ``sparse_config``: this forward's, instead of the
        runner's (per-request sparsity; ``alpha=0`` runs dense)."""
        if sparse_config is not None and not isinstance(sparse_config, SparseConfig):
            raise ValueError(f"sparse_config: expected a SparseConfig or None, got {type(sparse_config).__name__}")
        if keep_all is not None and len(keep_all) != len(items):
            raise ValueError(f"keep_all: expected one bool per item ({len(items)}), got {len(keep_all)}")
        if not items:
            return torch.empty(0, self.vocab_size, device=self.device), {}
        rids = [it.request_id for it in items]
        if len(set(rids)) != len(rids):
            raise ValueError(f"items: expected distinct request ids in one batch, got {rids}")
        starts, lengths, ids, pos, prompt_lens = [], [], [], [], []
        for it in items:
            n = len(it.token_ids)
            if n == 0:
                raise ValueError(f"token_ids: expected at least one new token for {it.request_id!r}")
            end = it.cached_len + n
            if it.prompt_len is not None and (isinstance(it.prompt_len, bool) or not isinstance(it.prompt_len, int)
                                              or it.prompt_len < end):
                raise ValueError(f"prompt_len: expected None or an int >= cached_len + len(token_ids) = {end} "
                                 f"for {it.request_id!r}, got {it.prompt_len!r}")
            prompt_lens.append(end if it.prompt_len is None else it.prompt_len)
            tokens = self._check_tokens("token_ids", it.token_ids)
            self._check_room(it.request_id, it.cached_len, n)
            starts.append(it.cached_len)
            lengths.append(n)
            ids.append(tokens)
            pos.append(torch.arange(it.cached_len, it.cached_len + n, dtype=torch.int64))
        last = torch.tensor(lengths, dtype=torch.int64).cumsum(0) - 1
        if keep_all is None or not any(keep_all):
            logits = self._forward(
                rids, torch.cat(ids), torch.cat(pos), starts, lengths, ForwardMode.PREFILL,
                logits_to_keep=last.to(self.device), sparse_config=sparse_config, prompt_lens=prompt_lens,
            )
            return logits, {}
        rows, where, spans = [], [], {}  # rows of the LM head; each item's last row; kept spans
        for i, (n, end) in enumerate(zip(lengths, last.tolist())):
            if keep_all[i]:
                spans[i] = (len(rows), n)
                rows.extend(range(end - n + 1, end + 1))
            else:
                rows.append(end)
            where.append(len(rows) - 1)
        logits = self._forward(
            rids, torch.cat(ids), torch.cat(pos), starts, lengths, ForwardMode.PREFILL,
            logits_to_keep=torch.tensor(rows, dtype=torch.int64, device=self.device), sparse_config=sparse_config,
            prompt_lens=prompt_lens,
        )
        return logits[where], {i: logits[a : a + n] for i, (a, n) in spans.items()}

    CALIBRATION_ID = "__fp8_kv_calibration__"

    def calibrate_kv_scales(self, token_ids: Sequence[int] | None = None, *, margin: float = 2.0) -> None:
        """FP8 pools: set every layer's K/V descales from one prefill of ``token_ids`` (default:
        2048 seeded pseudo-random ids, fewer if the free pages hold less), ``amax * margin /
        448`` rounded up to a power of two.
        Replicas of one model calibrated this way get identical scales, which KV transfer
        between them requires. The calibration request's pages are released afterwards."""
        if self.pool.k_scale is None:
            raise ValueError(f"pool: only FP8 pools have scales to calibrate, this one stores {self.pool.k.dtype}")
        if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not margin >= 1.0:
            raise ValueError(f"margin: expected a number >= 1, got {margin!r}")
        if token_ids is None:  # 2048 tokens, or what the free pages hold (the ids are a prefix)
            n = min(2048, self.pool.free_pages * self.page_size)
            gen = torch.Generator().manual_seed(0)
            token_ids = torch.randint(0, self.vocab_size, (2048,), generator=gen)[:n].tolist()
        ids = self._check_tokens("token_ids", token_ids)
        if ids.numel() == 0:
            raise ValueError("token_ids: expected at least one calibration token")
        rid = self.CALIBRATION_ID
        self.pool.reserve(rid, int(ids.numel()))
        try:
            self._forward(
                [rid], ids, torch.arange(ids.numel()), [0], [int(ids.numel())], ForwardMode.PREFILL,
                logits_to_keep=1, calibrate_kv=float(margin),
            )
        finally:
            self.pool.release(rid)

    def decode(self, request_ids: Sequence[str], last_token_ids: Sequence[int]) -> torch.Tensor:
        """One token per request (its latest sampled token, not yet in the pool); returns
        float32 logits ``[B, V]``. Pages must hold ``seq_len + 1`` tokens."""
        rids = list(request_ids)
        if len(rids) != len(last_token_ids):
            raise ValueError(
                f"last_token_ids: expected {len(rids)} ids (one per request), got {len(last_token_ids)}"
            )
        if not rids:
            return torch.empty(0, self.vocab_size, device=self.device)
        if len(set(rids)) != len(rids):
            raise ValueError(f"request_ids: expected distinct ids, got {rids}")
        ids = self._check_tokens("last_token_ids", last_token_ids)
        starts = []
        for rid in rids:
            if not self.pool.has(rid):
                raise ValueError(f"request_ids: {rid!r} holds no pages in the pool")
            start = self.pool.seq_len(rid)
            self._check_room(rid, start, 1)
            starts.append(start)
        if self.decode_graphs is not None:
            logits = self.decode_graphs.run(rids, ids, starts)
            if logits is not None:
                for rid, start in zip(rids, starts):
                    self.pool.set_seq_len(rid, start + 1)
                return logits
        meta = self.decode_metadata.prepare(rids, self.pool.manager.page_lists(rids), ids, starts)
        longest = max(starts) + 1
        batch = ForwardBatch(
            pool=self.pool, page_table=meta["page_table"], cu_seqlens_q=meta["cu_seqlens_q"],
            seqlens_kv=meta["seqlens_kv"], slots=meta["slots"], mode=ForwardMode.DECODE,
            sparse_config=self.sparse_config, max_seqlen_kv=longest, dense=longest < self.dense_below,
            backend=self.backend,
        )
        logits = self.run_model(batch, meta["input_ids"], meta["positions"], 0)
        for rid, start in zip(rids, starts):
            self.pool.set_seq_len(rid, start + 1)
        self.last_state = batch.state
        self._last_rids = rids
        return logits
