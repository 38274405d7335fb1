"""Varlen batch metadata (the "plan"): everything derived from sequence lengths.

Built once per batch on the host (one device->host copy of the lengths, like
FlashInfer's ``plan()``), then reused by every layer's ``run`` with no host sync.

Layout conventions shared by the reference and the kernels:
- PackGQA: for KV head ``h`` the packed rows of a sequence are ``r = p * g + t``
  (query position ``p``, query head ``h * g + t``); a query tile is ``Q_TILE`` rows.
- Query tiles are numbered globally: tile ``t = cu_qtiles[b] + I``.
- Segments (one CSR list each): ``seg = h * total_tiles + t``.
- Logical key blocks are numbered globally: block ``cu_blocks[b] + J``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ._checks import bad_page_entries, canonical_device, check_tensor, page_entry_error
from .config import KV_TILE, Q_TILE, SparseConfig

_INT_DTYPES = (torch.int32, torch.int64)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class PrefillPlan:
    """Host lists and int32 device tensors describing one varlen paged batch."""

    config: SparseConfig
    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    # host copies
    seqlens_q: tuple[int, ...]
    seqlens_kv: tuple[int, ...]
    qtiles: tuple[int, ...]  # query tiles per sequence
    blocks: tuple[int, ...]  # logical key blocks per sequence
    cu_seqlens_q_host: tuple[int, ...]
    cu_qtiles_host: tuple[int, ...]
    cu_blocks_host: tuple[int, ...]
    # device tensors (int32)
    cu_seqlens_q: torch.Tensor  # [B+1]
    seqlens_kv_t: torch.Tensor  # [B]
    cu_qtiles: torch.Tensor  # [B+1]
    cu_blocks: torch.Tensor  # [B+1]
    tile_seq: torch.Tensor  # [total_tiles] sequence of each query tile
    page_table: torch.Tensor  # [B, max_pages] int32
    # per sequence, the whole prompt's length (>= seqlens_kv: a chunk that does not end its
    # prompt); what config.last_dense_tiles counts from
    prompt_lens: tuple[int, ...] = ()

    @property
    def batch_size(self) -> int:
        return len(self.seqlens_q)

    @property
    def group_size(self) -> int:
        return self.num_qo_heads // self.num_kv_heads

    @property
    def total_q(self) -> int:
        return sum(self.seqlens_q)

    @property
    def total_tiles(self) -> int:
        return sum(self.qtiles)

    @property
    def total_blocks(self) -> int:
        return sum(self.blocks)

    @property
    def num_segments(self) -> int:
        return self.num_kv_heads * self.total_tiles

    @property
    def max_blocks(self) -> int:
        return max(self.blocks, default=0)

    @property
    def max_seqlen_kv(self) -> int:
        return max(self.seqlens_kv, default=0)

    @property
    def device(self) -> torch.device:
        return self.cu_seqlens_q.device

    def prefix(self, b: int) -> int:
        return self.seqlens_kv[b] - self.seqlens_q[b]

    @functools.cached_property
    def _derived(self) -> dict:
        # not a field: equality, hashing and dataclasses.replace ignore it (a replaced plan
        # starts empty), and the frozen instance's __dict__ still takes it
        return {}

    def derived(self, key: str, build: Callable[[], Any]) -> Any:
        """``build()`` on the first call with ``key``, that same value afterwards: device tensors
        that depend on the plan alone, which every layer of a forward would otherwise rebuild
        (the model shares one plan across its layers)."""
        if key not in self._derived:
            self._derived[key] = build()
        return self._derived[key]

    @property
    def causal_tiles(self) -> tuple[int, ...]:
        """Per sequence, the (query tile, 64-key tile) pairs of one KV head that causal attention
        touches at all: the tiles a dense prefill computes, and the most a segment of the index
        can list (its ``tile_limit``: ``64 n < Lkv`` and ``64 n <= pmax + P``). Host arithmetic
        over the query tiles, vectorized (a 128K prompt's 4096 tiles take tens of microseconds),
        once per plan."""

        def build() -> tuple[int, ...]:
            out = []
            for b in range(self.batch_size):
                rows = self.group_size * self.seqlens_q[b]
                ends = torch.clamp(torch.arange(1, self.qtiles[b] + 1, dtype=torch.int64) * Q_TILE, max=rows)
                last = (ends - 1) // self.group_size + self.prefix(b)  # the last position of each query tile
                out.append(int((last // KV_TILE + 1).sum()))
            return tuple(out)

        return self.derived("causal_tiles", build)

    @property
    def index_capacity(self) -> int:
        """The most CSR entries an index of this plan can need (every causal tile pair of every
        KV head): a ``kv_tiles`` of this size never overflows, so the index can be built without
        reading its entry count back (``kernels.ops.build_index_planned(capacity=...)``)."""
        return self.num_kv_heads * sum(self.causal_tiles)

    @property
    def block_seq(self) -> torch.Tensor:
        """int64 ``[total_blocks]`` on the device: the sequence of each logical key block (row
        ``cu_blocks[b] + J`` -> ``b``). Built on first use, once per plan."""

        def build() -> torch.Tensor:
            blocks = torch.arange(self.total_blocks, dtype=self.cu_blocks.dtype, device=self.device)
            return torch.searchsorted(self.cu_blocks[1:].contiguous(), blocks, right=True)

        return self.derived("block_seq", build)

    @property
    def dense_rows_from_host(self) -> tuple[int, ...]:
        """Per sequence, the first packed row of this batch in its prompt's last
        ``config.last_dense_tiles`` query tiles (``g * Lq``: none)."""
        return self.derived("dense_rows_from_host", lambda: tuple(_dense_rows_from(
            self.prompt_lens or self.seqlens_kv, self.seqlens_q, self.seqlens_kv, self.group_size,
            self.config.last_dense_tiles)))

    @property
    def dense_rows_from(self) -> torch.Tensor:
        """int32 ``[B]`` on the device: :attr:`dense_rows_from_host` (the index kernels' copy)."""
        return self.derived("dense_rows_from", lambda: torch.tensor(
            self.dense_rows_from_host, dtype=torch.int32, device=self.device))

    def dense_tile(self, b: int, tile: int) -> bool:
        """Whether query tile ``tile`` of sequence ``b`` is one of its prompt's last
        ``config.last_dense_tiles`` tiles (it holds a row at or past ``dense_rows_from``)."""
        r0, rows, _, _ = self.tile_rows(b, tile)
        return r0 + rows - 1 >= self.dense_rows_from_host[b]

    def tile_rows(self, b: int, tile: int) -> tuple[int, int, int, int]:
        """(first packed row, row count, pmin, pmax) of query tile ``tile`` of sequence ``b``."""
        g = self.group_size
        r0 = tile * Q_TILE
        r1 = min(r0 + Q_TILE, g * self.seqlens_q[b])
        return r0, r1 - r0, r0 // g, (r1 - 1) // g


def make_plan(
    cu_seqlens_q: object,
    seqlens_kv: object,
    page_table: object,
    *,
    num_qo_heads: int,
    num_kv_heads: int,
    head_dim: int,
    page_size: int,
    num_pages: int,
    config: SparseConfig,
    device: torch.device | str | None = None,
    prompt_lens: object = None,
) -> PrefillPlan:
    """Validate the batch metadata and derive the plan (one host sync for the lengths).

    ``prompt_lens``: per sequence, the length of the whole prompt this batch's tokens belong to
    (a host sequence of ints, each at least ``seqlens_kv[b]``); ``None``: each sequence's new
    tokens end its prompt (``seqlens_kv``). Only ``config.last_dense_tiles`` reads it."""
    if not isinstance(config, SparseConfig):
        raise ValueError(f"config: expected a SparseConfig, got {type(config).__name__}")
    cu = check_tensor("cu_seqlens_q", cu_seqlens_q, ndim=1, dtypes=_INT_DTYPES)
    skv = check_tensor("seqlens_kv", seqlens_kv, ndim=1, dtypes=_INT_DTYPES)
    pt = check_tensor("page_table", page_table, ndim=2, dtypes=_INT_DTYPES)
    device = canonical_device(device) if device is not None else cu.device
    for name, t in (("cu_seqlens_q", cu), ("seqlens_kv", skv), ("page_table", pt)):
        if t.device != device:
            raise ValueError(f"{name}: expected a tensor on {device}, got one on {t.device}")
    if cu.numel() < 1:
        raise ValueError("cu_seqlens_q: expected B+1 >= 1 entries, got an empty tensor")
    batch = cu.numel() - 1
    if skv.numel() != batch:
        raise ValueError(f"seqlens_kv: expected {batch} entries (len(cu_seqlens_q) - 1), got {skv.numel()}")
    if pt.shape[0] != batch:
        raise ValueError(f"page_table: expected {batch} rows (one per sequence), got {pt.shape[0]}")
    cu_h = [int(x) for x in cu.tolist()]
    skv_h = [int(x) for x in skv.tolist()]
    if cu_h[0] != 0:
        raise ValueError(f"cu_seqlens_q: expected cu_seqlens_q[0] == 0, got {cu_h[0]}")
    seqlens_q = [cu_h[i + 1] - cu_h[i] for i in range(batch)]
    for i, n in enumerate(seqlens_q):
        if n < 0:
            raise ValueError(
                f"cu_seqlens_q: expected non-decreasing offsets, got {cu_h[i]} then {cu_h[i + 1]} at index {i}"
            )
    for i, (lq, lkv) in enumerate(zip(seqlens_q, skv_h)):
        if lkv < lq:
            raise ValueError(
                f"seqlens_kv: expected seqlens_kv[{i}] >= query length {lq} (keys include the new tokens), got {lkv}"
            )
    need_pages = [_cdiv(n, page_size) for n in skv_h]
    max_need = max(need_pages, default=0)
    if max_need > pt.shape[1]:
        raise ValueError(
            f"page_table: expected at least {max_need} columns for seqlens_kv up to {max(skv_h)} "
            f"with page_size {page_size}, got {pt.shape[1]}"
        )
    if max_need:
        bad = bad_page_entries(pt, torch.tensor(need_pages), num_pages)
        if bool(bad.any()):
            b, c = (int(x) for x in bad.nonzero()[0].tolist())
            raise page_entry_error(pt, b, c, num_pages)
    g = num_qo_heads // num_kv_heads
    plens = _check_prompt_lens(prompt_lens, skv_h)
    qtiles = [_cdiv(g * n, Q_TILE) for n in seqlens_q]
    blocks = [_cdiv(n, config.block_size) for n in skv_h]

    def cumsum(xs: list[int]) -> list[int]:
        out = [0]
        for x in xs:
            out.append(out[-1] + x)
        return out

    i32 = dict(dtype=torch.int32, device=device)
    tile_seq = [b for b, n in enumerate(qtiles) for _ in range(n)]
    return PrefillPlan(
        config=config,
        num_qo_heads=num_qo_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        page_size=page_size,
        seqlens_q=tuple(seqlens_q),
        seqlens_kv=tuple(skv_h),
        qtiles=tuple(qtiles),
        blocks=tuple(blocks),
        cu_seqlens_q_host=tuple(cu_h),
        cu_qtiles_host=tuple(cumsum(qtiles)),
        cu_blocks_host=tuple(cumsum(blocks)),
        cu_seqlens_q=torch.tensor(cu_h, **i32),
        seqlens_kv_t=torch.tensor(skv_h, **i32),
        cu_qtiles=torch.tensor(cumsum(qtiles), **i32),
        cu_blocks=torch.tensor(cumsum(blocks), **i32),
        tile_seq=torch.tensor(tile_seq, **i32),
        page_table=pt.to(torch.int32).contiguous(),
        prompt_lens=plens,
    )


def _check_prompt_lens(prompt_lens: object, seqlens_kv: list[int]) -> tuple[int, ...]:
    """``prompt_lens`` validated (``()`` for None: every sequence ends its prompt)."""
    if prompt_lens is None:
        return ()
    if isinstance(prompt_lens, torch.Tensor):
        prompt_lens = prompt_lens.tolist()
    if isinstance(prompt_lens, (str, bytes)) or not hasattr(prompt_lens, "__len__"):
        raise ValueError(f"prompt_lens: expected None or one int per sequence, got {prompt_lens!r}")
    lens = list(prompt_lens)
    if len(lens) != len(seqlens_kv):
        raise ValueError(f"prompt_lens: expected {len(seqlens_kv)} entries (one per sequence), got {len(lens)}")
    for i, (n, lkv) in enumerate(zip(lens, seqlens_kv)):
        if isinstance(n, bool) or not isinstance(n, int) or n < lkv:
            raise ValueError(
                f"prompt_lens: expected prompt_lens[{i}] an int >= seqlens_kv[{i}] = {lkv} "
                f"(the prompt includes this batch's tokens), got {n!r}"
            )
    return tuple(lens)


def _dense_rows_from(
    prompt_lens: tuple[int, ...], seqlens_q: tuple[int, ...], seqlens_kv: tuple[int, ...], g: int,
    last_dense_tiles: int,
) -> list[int]:
    """Per sequence, the first packed row of this batch that belongs to its prompt's last
    ``last_dense_tiles`` query tiles. The prompt's tiles are counted from its first token
    (cached prefix included): the last ones start at row ``Q_TILE * (ceil(g * L / Q_TILE) - N)``
    of the whole prompt, which is row ``- g * P`` of this batch's ``g * Lq`` rows. Clamped to
    ``[0, g * Lq]`` (``g * Lq``: no dense row)."""
    out = []
    for n, lq, lkv in zip(prompt_lens, seqlens_q, seqlens_kv):
        rows = g * lq
        if last_dense_tiles == 0:
            out.append(rows)
            continue
        first = Q_TILE * max(_cdiv(g * n, Q_TILE) - last_dense_tiles, 0) - g * (lkv - lq)
        out.append(min(max(first, 0), rows))
    return out
