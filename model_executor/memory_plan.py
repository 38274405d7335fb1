"""A replica's memory plan: weights, the worst-case forward's activations and kernel workspace,
and the KV pool pages that the rest of its share of the device holds (vLLM profiles one
worst-case forward at start for the same reason: a pool sized by hand either wastes memory or
lets one long prompt run the device out of memory mid-service).

:func:`plan_memory` is pure arithmetic over the model's shape (no weights, no device): the
launcher prints it before anything starts, a replica sizes its pool from it. The worst-case
forward is ``forward_tokens`` new tokens of one sequence whose keys reach ``max_context`` (the
whole context: the most keys a chunk attends). What it counts, per layer (the peak of one layer
is the peak of the forward: a layer's temporaries are freed before the next layer runs):

- both phases: the layer's input ``T H``, which the model's loop holds until the layer returns
  (the H100 measurement of session 48 found the plan one ``T H`` short without it);
- attention phase: the residual and the normed hidden states ``2 T H``; q, k, v ``T (Hq + 2 Hkv) d``;
  the output ``T Hq d`` and its LSE ``T Hq`` fp32; ``o_proj``'s output ``T H``; fp32 split-KV
  partials and LSEs (``kernels/schedule.py``: at most ``MAX_SPLITS`` splits of ``T Hq d``, fewer
  as the rows pass ``PARTIAL_BYTES_CAP``, none once one split would); the block index (``kernels/triton_index.py``: fp32 K/V block means, the
  selection bits, the tile list, which is at most every visible 64-key tile of every query tile
  of every KV head; the correction's bits). Packed GQA: a query tile holds 128 rows of ``g = Hq/Hkv``
  heads.
- MLP phase: the residual and normed states ``2 T H``; gate, up and their SiLU product ``3 T I``
  (eager SiLU: one more ``T I``); ``down_proj``'s output and the residual sum ``2 T H``.
- once per forward: RoPE's cos/sin ``2 T d``; the logits of ``logit_rows`` rows (the LM head in the
  model dtype, then fp32, and one fp32 copy for sampling).

Decode replicas plan a forward of ``max_running`` one-token sequences at ``max_context`` (and,
with CUDA graphs, the graphs' pool: one more such forward). Outside torch's count, every CUDA
process also holds its context, cuBLAS and Triton workspaces and the caching allocator's slack:
``reserve_bytes`` (:data:`CUDA_RESERVE_BYTES` plus :data:`FRAGMENTATION` of the workspace).

Not counted: prompt logprobs over more than ``logit_rows`` rows of one forward (their LM head
grows with the chunk: ``rows x vocab x 10`` bytes), tensor-parallel all-reduce buffers (NCCL's
own), the decode CUDA graphs' static page tables (``max_running x pages`` int32: kilobytes).

:func:`measure_forward_peak` runs that worst-case forward through a real runner on CUDA and
returns ``torch.cuda.max_memory_allocated`` over it: the check of the arithmetic (a ``gpu`` test).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from kernels._scalars import check_int
from kernels.config import KV_TILE, Q_TILE
from kernels.schedule import MAX_SPLITS, NUM_SMS_DEFAULT, PARTIAL_BYTES_CAP

from .parallel import layout_of, shard_param_bytes

GIB = 1 << 30
CUDA_RESERVE_BYTES = 1 << 30  # CUDA context, cuBLAS / Triton workspaces: outside torch's allocator
FRAGMENTATION = 0.10  # the caching allocator's slack over the workspace
DECODE_MAX_SPLITS = 128  # kernels/triton_decode.choose_num_splits's bound
ROLES = ("prefill", "decode")


def gib(n: int) -> str:
    return f"{n / GIB:.2f} GiB"


def _elem(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


@dataclass(frozen=True)
class ForwardShape:
    """The worst-case forward of a role: ``tokens`` new tokens in ``sequences`` sequences (one
    new token each in decode), keys up to ``max_context`` per sequence, ``logit_rows`` rows of
    logits."""

    tokens: int
    sequences: int
    max_context: int
    logit_rows: int


def forward_bytes(config: Any, shape: ForwardShape, *, dtype: torch.dtype, block_size: int = 128,
                  tp_size: int = 1, fused_silu: bool = True, fp8_kv: bool = False,
                  num_sms: int = NUM_SMS_DEFAULT) -> int:
    """Peak bytes the forward ``shape`` allocates beyond the weights and the pool (module doc)."""
    layout = layout_of(config, tp_size)
    hq, hkv = layout.local_q_heads, layout.local_kv_heads
    d = int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)
    hidden, inter, vocab = int(config.hidden_size), int(config.intermediate_size) // tp_size, int(config.vocab_size)
    a = _elem(dtype)
    t, ctx = shape.tokens, shape.max_context
    g = hq // hkv
    if shape.sequences == 1:  # prefill: one long sequence's new tokens
        qtiles = math.ceil(g * t / Q_TILE)
        blocks = math.ceil(ctx / block_size)
        words = math.ceil(blocks / 32)
        kv_tiles = hkv * qtiles * math.ceil(ctx / KV_TILE)  # every visible tile, at most
        index = (2 * blocks * hkv * d * 4 + blocks * hkv * d * a  # fp32 K/V means, K means to score
                 + 2 * hkv * qtiles * words * 4 + kv_tiles * 4)  # selection + correction bits, tile list
        # kernels.schedule.auto_num_splits for this one sequence: split when its keys' tiles
        # exceed the average work per SM, within MAX_SPLITS and PARTIAL_BYTES_CAP
        work = hkv * qtiles * ((ctx - t / 2) / KV_TILE + 1)
        longest = math.ceil(ctx / KV_TILE)
        row_bytes = t * hq * (1 << (d - 1).bit_length()) * 4  # one split's fp32 partial output
        splits = math.ceil(longest * num_sms / work) if longest * num_sms > work else 1
        splits = min(splits, MAX_SPLITS, max(1, longest // 4), max(1, PARTIAL_BYTES_CAP // row_bytes))
        partials = splits * (row_bytes + t * hq * 4) if splits > 1 else 0
    else:  # decode: one token per sequence, split-KV partials
        index = 0
        partials = shape.sequences * hq * DECODE_MAX_SPLITS * (d + 1) * 4
    held = t * hidden * a  # the layer's input, held by the model's loop over the layers
    attention = (held + 2 * t * hidden * a + t * (hq + 2 * hkv) * d * a + t * hq * d * a + t * hq * 4 + partials + index
                 + t * hidden * a + (t * hq * d if fp8_kv else 0))
    mlp = held + 2 * t * hidden * a + (3 if fused_silu else 4) * t * inter * a + 2 * t * hidden * a
    per_forward = 2 * t * d * a + shape.logit_rows * vocab * (a + 8)
    return max(attention, mlp) + per_forward


def weight_bytes(config: Any, *, dtype: torch.dtype, tp_size: int = 1, fp8_weights: bool = False) -> int:
    """One rank's weights: ``parallel.shard_param_bytes`` in ``dtype``; FP8 projections at one
    byte a weight and one fp32 scale per output channel (the finest scale layout but blocks)."""
    a = _elem(dtype)
    total = shard_param_bytes(config, tp_size, bytes_per_param=a)
    if not fp8_weights:
        return total
    layout = layout_of(config, tp_size)
    hq, hkv = layout.local_q_heads, layout.local_kv_heads
    d = int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)
    hidden, inter = int(config.hidden_size), int(config.intermediate_size) // tp_size
    proj = hidden * d * (hq + 2 * hkv) + hq * d * hidden + 3 * hidden * inter
    rows = d * (hq + 2 * hkv) + hidden + 2 * inter + hidden
    return total - int(config.num_hidden_layers) * (proj * (a - 1) - rows * 4)


@dataclass(frozen=True)
class MemoryPlan:
    """A replica's memory: ``budget_bytes`` (its share of the device) = weights + workspace +
    reserve + the pool; ``max_pages``: the pages the budget holds after the rest; ``num_pages``:
    the pool's (given, or ``max_pages``); ``need_pages``: one sequence of ``max_context`` tokens."""

    role: str
    device_total_bytes: int
    fraction: float
    weight_bytes: int
    workspace_bytes: int
    reserve_bytes: int
    page_bytes: int
    page_size: int
    max_pages: int
    num_pages: int
    fixed_pages: bool
    forward: ForwardShape
    max_context: int

    @property
    def budget_bytes(self) -> int:
        return int(self.device_total_bytes * self.fraction)

    @property
    def pool_bytes(self) -> int:
        return self.num_pages * self.page_bytes

    @property
    def need_bytes(self) -> int:
        return self.weight_bytes + self.workspace_bytes + self.reserve_bytes + self.pool_bytes

    @property
    def need_pages(self) -> int:
        return math.ceil(self.max_context / self.page_size)

    @property
    def tokens(self) -> int:
        return self.num_pages * self.page_size

    def problems(self, names: Mapping[str, str] | None = None) -> list[str]:
        """Why this plan cannot run, one line each, naming what to change (``names`` maps the
        arguments of :func:`plan_memory` to what the caller calls them); empty if it fits."""
        n = {"num_pages": "num_pages", "fraction": "fraction", "max_context": "max_context",
             "forward_tokens": "forward_tokens", **(names or {})}
        out = []
        fixed_costs = self.weight_bytes + self.workspace_bytes + self.reserve_bytes
        if self.max_pages < 1:
            out.append(f"{n['fraction']}: {self.role} needs {gib(fixed_costs + self.page_bytes)} "
                       f"(weights {gib(self.weight_bytes)}, a {self.forward.tokens}-token forward's workspace "
                       f"{gib(self.workspace_bytes)}, reserve {gib(self.reserve_bytes)}, one KV page), its share "
                       f"{self.fraction:g} x {gib(self.device_total_bytes)} is {gib(self.budget_bytes)}: raise "
                       f"{n['fraction']}, lower {n['forward_tokens']}, or use FP8 weights / a bigger device")
        elif self.num_pages > self.max_pages:
            out.append(f"{n['num_pages']}: {self.num_pages} pages ({gib(self.pool_bytes)}) do not fit: {self.role} "
                       f"needs {gib(self.need_bytes)}, has {gib(self.budget_bytes)} ({self.fraction:g} x "
                       f"{gib(self.device_total_bytes)}; weights {gib(self.weight_bytes)}, workspace "
                       f"{gib(self.workspace_bytes)}, reserve {gib(self.reserve_bytes)}): at most {self.max_pages} "
                       f"pages; lower {n['num_pages']} or raise {n['fraction']}")
        if self.max_pages >= 1 and min(self.num_pages, self.max_pages) < self.need_pages:
            pages = min(self.num_pages, self.max_pages)
            out.append(f"{n['max_context']}: {self.max_context} tokens need {self.need_pages} KV pages "
                       f"({gib(self.need_pages * self.page_bytes)}), the {self.role} pool holds {pages} "
                       f"({pages * self.page_size} tokens, {gib(pages * self.page_bytes)}): lower "
                       f"{n['max_context']}, or make room (raise {n['fraction']}, lower {n['forward_tokens']}, "
                       "FP8 weights or KV)")
        return out

    def check(self, names: Mapping[str, str] | None = None) -> "MemoryPlan":
        """``self`` if it fits, else ValueError with :meth:`problems`."""
        problems = self.problems(names)
        if problems:
            raise ValueError("\n".join(problems))
        return self

    def summary(self) -> str:
        """One line: weights, workspace, KV pages = tokens, of the share."""
        return (f"{self.role}: weights {gib(self.weight_bytes)}, workspace {gib(self.workspace_bytes)} "
                f"({self.forward.tokens}-token forward at {self.max_context} keys) + reserve "
                f"{gib(self.reserve_bytes)}, KV {self.num_pages} pages = {self.tokens} tokens ({gib(self.pool_bytes)}"
                f"{', fixed' if self.fixed_pages else ''}); {gib(self.need_bytes)} of "
                f"{self.fraction:g} x {gib(self.device_total_bytes)}")


def plan_memory(
    config: Any,
    *,
    role: str,
    dtype: torch.dtype,
    kv_dtype: torch.dtype,
    page_size: int,
    forward_tokens: int,
    max_context: int,
    device_total_bytes: int,
    fraction: float,
    num_pages: int | None = None,
    sequences: int = 1,
    logit_rows: int = 1,
    block_size: int = 128,
    tp_size: int = 1,
    fp8_weights: bool = False,
    fused_silu: bool = True,
    reserve_bytes: int | None = None,
    extra_forwards: int = 0,
) -> MemoryPlan:
    """The memory plan of one replica (one rank under TP) of ``role`` ("prefill" or "decode").

    config: the model's shape (``model_executor.loading.model_shape``: layers, hidden and MLP
    widths, heads, head_dim, vocab, tie_word_embeddings). dtype / kv_dtype: the model's and the
    pool's. forward_tokens: the most new tokens one forward runs (prefill: the batch budget or
    the chunk; decode: ``max_running``, with ``sequences`` equal to it). max_context: the longest
    sequence (keys of the worst-case forward, and what one request's pages must hold).
    device_total_bytes x fraction: the replica's share of its device. num_pages: a fixed pool
    (None: what the share holds). reserve_bytes: memory outside torch's count (default
    :data:`CUDA_RESERVE_BYTES` plus :data:`FRAGMENTATION` of the workspace; 0 on a CPU).
    extra_forwards: forward workspaces held beside the running one (decode CUDA graphs' pool: 1).
    Never raises for a plan that does not fit: :meth:`MemoryPlan.check` does."""
    if role not in ROLES:
        raise ValueError(f"role: expected one of {ROLES}, got {role!r}")
    check_int("page_size", page_size, minimum=1)
    check_int("forward_tokens", forward_tokens, minimum=1)
    check_int("max_context", max_context, minimum=1)
    check_int("device_total_bytes", device_total_bytes, minimum=1)
    check_int("sequences", sequences, minimum=1)
    check_int("logit_rows", logit_rows, minimum=1)
    check_int("block_size", block_size, minimum=1)
    if num_pages is not None:
        check_int("num_pages", num_pages, minimum=1)
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 < fraction <= 1:
        raise ValueError(f"fraction: expected a number in (0, 1], got {fraction!r}")
    shape = ForwardShape(tokens=forward_tokens, sequences=sequences, max_context=max_context, logit_rows=logit_rows)
    workspace = forward_bytes(config, shape, dtype=dtype, block_size=block_size, tp_size=tp_size,
                              fused_silu=fused_silu, fp8_kv=kv_dtype == torch.float8_e4m3fn)
    workspace *= 1 + check_int("extra_forwards", extra_forwards, minimum=0)
    if reserve_bytes is None:
        reserve_bytes = CUDA_RESERVE_BYTES + int(FRAGMENTATION * workspace)
    weights = weight_bytes(config, dtype=dtype, tp_size=tp_size, fp8_weights=fp8_weights)
    layout = layout_of(config, tp_size)
    d = int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)
    page_bytes = 2 * int(config.num_hidden_layers) * page_size * layout.local_kv_heads * d * _elem(kv_dtype)
    left = int(device_total_bytes * fraction) - weights - workspace - reserve_bytes
    max_pages = max(left // page_bytes, 0)
    return MemoryPlan(role=role, device_total_bytes=int(device_total_bytes), fraction=float(fraction),
                      weight_bytes=weights, workspace_bytes=workspace, reserve_bytes=int(reserve_bytes),
                      page_bytes=page_bytes, page_size=page_size, max_pages=int(max_pages),
                      num_pages=int(max_pages if num_pages is None else num_pages), fixed_pages=num_pages is not None,
                      forward=shape, max_context=max_context)


def measure_forward_peak(runner: Any, forward_tokens: int, max_context: int, *, seed: int = 0) -> int:
    """CUDA only: the bytes one prefill forward of ``forward_tokens`` new tokens of one
    sequence whose keys reach ``max_context`` allocates at its peak over what was allocated
    before (``torch.cuda.max_memory_allocated``): what :func:`forward_bytes` bounds. The request's
    earlier ``max_context - forward_tokens`` keys are whatever the reserved pages hold (the
    memory does not depend on their values); its pages are released afterwards."""
    from .runner import PrefillItem

    check_int("forward_tokens", forward_tokens, minimum=1)
    check_int("max_context", max_context, minimum=forward_tokens)
    device = runner.device
    if device.type != "cuda":
        raise ValueError(f"runner: expected a runner on CUDA (torch.cuda.max_memory_allocated), got {device}")
    rid = "__memory_plan_check__"
    start = max_context - forward_tokens
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, runner.vocab_size, (forward_tokens,), generator=gen).tolist()
    runner.pool.reserve(rid, max_context)
    try:
        if start:
            runner.pool.set_seq_len(rid, start)
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        runner.prefill([PrefillItem(rid, ids, cached_len=start)])
        torch.cuda.synchronize(device)
        return int(torch.cuda.max_memory_allocated(device) - before)
    finally:
        runner.pool.release(rid)


__all__ = ["ForwardShape", "MemoryPlan", "plan_memory", "forward_bytes", "weight_bytes", "measure_forward_peak",
           "CUDA_RESERVE_BYTES", "FRAGMENTATION", "GIB"]
