"""The bytes of a channel transfer on a device: a request's pages gathered into a contiguous
chunk and scattered back (whole pages, or a TP rank's KV heads), the chunk's checksum, the side
streams the copies run on. No process group and no Ray: ``kv_transfer.channel`` moves these
chunks; the benchmarks time them alone.

A chunk is K then V of layers ``[l0, l1)`` of the pages, in the pool's storage layout
(``kv_cache.tensors``), flat ``uint8``: both ends hold the same layout, so the bytes move as
they lie.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any

import torch

from kv_cache.pool import KVPool
from kv_cache.tensors import pool_page_words

from ..header import _U64


def chunk_layers(num_layers: int, layers_per_chunk: int) -> list[tuple[int, int]]:
    """The layer ranges ``[l0, l1)`` of a transfer's chunks, in order; the last may be shorter."""
    return [(l0, min(l0 + layers_per_chunk, num_layers)) for l0 in range(0, num_layers, layers_per_chunk)]


_CHECKSUM_COLUMNS = 1024  # words per row of the 2-D view
_MIX = (1, 0x100000001B3, 0x9E3779B1, 0x85EBCA77)  # distinct odd weights for the four parts


def payload_checksum(payload: torch.Tensor) -> int:
    """A 64-bit checksum of a contiguous ``uint8`` payload, computed on its device.

    The payload is read as int32 words laid out ``[rows, 1024]``; with row sums ``r_i`` and
    column sums ``c_j`` (each mod 2**32) the checksum is ``sum (i+1) r_i + M sum (j+1) c_j``
    (plus the leftover words and bytes, weighted by position), all in wrapping int64. Two
    reductions over the data and none of its size in temporaries. Integer sums wrap the
    same way whatever the reduction order, so sender and receiver agree bit for bit.
    Detects any single changed word, swapped rows (pages in the wrong order) and swapped
    words within a row; it is not cryptographic. One host sync (the returned int); channels
    keep the value on the device (one per chunk) and read all of them once.
    """
    if not isinstance(payload, torch.Tensor) or payload.dtype != torch.uint8 or payload.dim() != 1:
        raise ValueError(f"payload: expected a 1-D uint8 tensor, got {_describe(payload)}")
    if not payload.is_contiguous():
        raise ValueError("payload: expected a contiguous tensor")
    return int(_wsum64(payload).item()) & _U64


def _wsum64(payload: torch.Tensor) -> torch.Tensor:
    """:func:`payload_checksum` as a 0-d int64 tensor on the payload's device (no host sync)."""
    dev = payload.device
    n = payload.numel()
    nwords = n // 4
    total = torch.zeros((), dtype=torch.int64, device=dev)
    if nwords:
        words = payload[: nwords * 4].view(torch.int32)
        cols = min(_CHECKSUM_COLUMNS, nwords)
        rows = nwords // cols
        grid = words[: rows * cols].view(rows, cols)
        # int32 sums: the accumulator wraps (or is truncated) mod 2**32 identically on both ends
        row_sums = grid.sum(dim=1, dtype=torch.int32).to(torch.int64)
        col_sums = grid.sum(dim=0, dtype=torch.int32).to(torch.int64)
        total += (row_sums * torch.arange(1, rows + 1, dtype=torch.int64, device=dev)).sum() * _MIX[0]
        total += (col_sums * torch.arange(1, cols + 1, dtype=torch.int64, device=dev)).sum() * _MIX[1]
        rest = words[rows * cols :].to(torch.int64)
        if rest.numel():
            total += (rest * torch.arange(1, rest.numel() + 1, dtype=torch.int64, device=dev)).sum() * _MIX[2]
    tail = payload[nwords * 4 :].to(torch.int64)
    if tail.numel():
        total += (tail * torch.arange(1, tail.numel() + 1, dtype=torch.int64, device=dev)).sum() * _MIX[3]
    return total


def _page_index(pages: list[int] | torch.Tensor, device: torch.device) -> torch.Tensor:
    if isinstance(pages, torch.Tensor):
        return pages
    index = torch.tensor(pages, dtype=torch.long)
    if device.type == "cuda":
        # through pinned memory: a copy from pageable memory would synchronise the stream
        return index.pin_memory().to(device, non_blocking=True)
    return index


def _block_shape(pool: KVPool, word: torch.Tensor, layers: tuple[int, int] | None,
                 num_pages: int) -> tuple[int, int, tuple[int, ...], int]:
    """(l0, l1, the word shape of those layers' K and V of ``num_pages`` pages, their bytes)."""
    if layers is None:
        layers = (0, pool.num_layers)
    if (not isinstance(layers, tuple) or len(layers) != 2 or not all(isinstance(x, int) for x in layers)
            or not 0 <= layers[0] < layers[1] <= pool.num_layers):
        raise ValueError(f"layers: expected (l0, l1) with 0 <= l0 < l1 <= {pool.num_layers}, got {layers!r}")
    shape = (2, layers[1] - layers[0], num_pages, *word.shape[2:])
    return layers[0], layers[1], shape, math.prod(shape) * word.element_size()


def _check_bytes(name: str, buf: object, device: torch.device, *, exact: int | None = None,
                 at_least: int | None = None) -> None:
    if (not isinstance(buf, torch.Tensor) or buf.dtype != torch.uint8 or buf.dim() != 1
            or not buf.is_contiguous()):
        raise ValueError(f"{name}: expected a contiguous 1-D uint8 tensor, got {_describe(buf)}")
    if buf.device != device:  # the pool tensors' device: it has an index even where the config had none
        raise ValueError(f"{name}: expected a tensor on the pool's device {device}, got one on {buf.device}")
    if exact is not None and buf.numel() != exact:
        raise ValueError(f"{name}: expected {exact} bytes, got {buf.numel()}")
    if at_least is not None and buf.numel() < at_least:
        raise ValueError(f"{name}: expected at least {at_least} bytes, got {buf.numel()}")


def gather_pages(pool: KVPool, pages: list[int] | torch.Tensor, layers: tuple[int, int] | None = None,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """Layers ``[l0, l1)`` (default: all) of ``pages``, K then V, as one contiguous ``uint8``
    tensor on the pool's device: ``[2, l1 - l0, len(pages)]`` pages of the pool's storage
    (``k_raw``/``v_raw``), flat. ``pages``: page ids, or their int64 index on
    the pool's device. ``out``: a contiguous ``uint8`` buffer whose first bytes receive the
    gather (the result is that view), instead of a new tensor."""
    k, v = pool_page_words(pool)
    l0, l1, shape, nbytes = _block_shape(pool, k, layers, len(pages))
    if out is None:
        block = torch.empty(shape, dtype=k.dtype, device=pool.device)
    else:
        _check_bytes("out", out, k.device, at_least=nbytes)
        block = out[:nbytes].view(k.dtype).view(shape)
    if len(pages):
        index = _page_index(pages, pool.device)
        for part, src in enumerate((k, v)):
            torch.index_select(src[l0:l1], 1, index, out=block[part])
    return block.view(-1).view(torch.uint8)


def scatter_pages(pool: KVPool, pages: list[int] | torch.Tensor, payload: torch.Tensor,
                  layers: tuple[int, int] | None = None) -> None:
    """The inverse of :func:`gather_pages`: ``payload`` into layers ``[l0, l1)`` of ``pages``."""
    k, v = pool_page_words(pool)
    l0, l1, shape, nbytes = _block_shape(pool, k, layers, len(pages))
    _check_bytes("payload", payload, k.device, exact=nbytes)
    if not len(pages):
        return
    block = payload.view(k.dtype).view(shape)
    index = _page_index(pages, pool.device)
    for part, dst in enumerate((k, v)):
        dst[l0:l1].index_copy_(1, index, block[part])


def _head_dims(pool: KVPool) -> tuple[int, int]:
    """The heads' dimension of ``k_raw`` and ``v_raw`` (FP8 V is token-major)."""
    return 3, (2 if pool.config.v_token_major else 3)


def _check_heads(pool: KVPool, heads: Any) -> list[int]:
    if (not isinstance(heads, (list, tuple)) or not heads or len(set(heads)) != len(heads)
            or any(isinstance(h, bool) or not isinstance(h, int) or not 0 <= h < pool.num_kv_heads for h in heads)):
        raise ValueError(f"heads: expected distinct KV heads of the pool, in [0, {pool.num_kv_heads}), got {heads!r}")
    return list(heads)


def heads_bytes(pool: KVPool, layers: tuple[int, int], num_pages: int, num_heads: int) -> int:
    """Bytes of K and V of ``num_heads`` heads of layers ``[l0, l1)`` of ``num_pages`` pages."""
    return 2 * (layers[1] - layers[0]) * num_pages * pool.page_size * num_heads * pool.head_dim * pool.k.element_size()


def gather_heads(pool: KVPool, pages: list[int] | torch.Tensor, layers: tuple[int, int], heads: list[int],
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`gather_pages` restricted to the KV heads ``heads`` (in that order): for K then V,
    ``[l1 - l0, len(pages)]`` pages of the pool's storage with only those heads, flat ``uint8``
    (a TP group's transfers: a rank ships the heads a receiver needs). Bytes, not elements:
    ``index_select`` has no FP8 kernels, and the copy is exact anyway."""
    heads = _check_heads(pool, heads)
    l0, l1, _, _ = _block_shape(pool, pool_page_words(pool)[0], layers, len(pages))
    nbytes = heads_bytes(pool, (l0, l1), len(pages), len(heads))
    if out is None:
        out = torch.empty(nbytes, dtype=torch.uint8, device=pool.device)
    else:
        _check_bytes("out", out, pool.k_raw.device, at_least=nbytes)
    out = out[:nbytes]
    if len(pages):
        index = _page_index(pages, pool.device)
        head_index = torch.tensor(heads, dtype=torch.long).to(pool.device)
        half = nbytes // 2
        for part, (src, hd) in enumerate(zip((pool.k_raw, pool.v_raw), _head_dims(pool))):
            block = src.view(torch.uint8)[l0:l1].index_select(1, index).index_select(hd, head_index)
            out[part * half:(part + 1) * half].copy_(block.reshape(-1))
    return out


def scatter_heads(pool: KVPool, pages: list[int] | torch.Tensor, payload: torch.Tensor, layers: tuple[int, int],
                  heads: list[int]) -> None:
    """The inverse of :func:`gather_heads`: ``payload`` into heads ``heads`` (in that order) of
    layers ``[l0, l1)`` of ``pages``; the pages' other heads are left as they are."""
    heads = _check_heads(pool, heads)
    l0, l1, _, _ = _block_shape(pool, pool_page_words(pool)[0], layers, len(pages))
    nbytes = heads_bytes(pool, (l0, l1), len(pages), len(heads))
    _check_bytes("payload", payload, pool.k_raw.device, exact=nbytes)
    if not len(pages):
        return
    index = _page_index(pages, pool.device)
    half = nbytes // 2
    for part, (dst, hd) in enumerate(zip((pool.k_raw, pool.v_raw), _head_dims(pool))):
        dst_bytes = dst.view(torch.uint8)[l0:l1]
        shape = list(dst_bytes.shape)
        shape[1], shape[hd] = len(pages), len(heads)
        block = payload[part * half:(part + 1) * half].view(shape)
        for j, h in enumerate(heads):
            dst_bytes.select(hd, h).index_copy_(1, index, block.select(hd, j))


def _clear_pages(pool: KVPool, pages: list[int]) -> None:
    """Zero ``pages`` in every layer and wait for it (failure paths only)."""
    if not pages:
        return
    lane = _Lane(pool.device)
    with _device_guard(pool.device), lane.use():
        index = _page_index(pages, pool.device)
        for part in pool_page_words(pool):
            part.index_fill_(1, index, 0)
    lane.synchronize()


class _Lane:
    """A side CUDA stream for one end of a transfer's copies and checksums: they overlap the
    NCCL work, and nothing else in the replica (decode steps, the next prefill) orders after
    them or they after it. On CPU there is no stream: every method is a no-op and the work
    runs in the calling thread, in program order."""

    def __init__(self, device: torch.device) -> None:
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def use(self) -> contextlib.AbstractContextManager:
        """Make the stream current: kernels, allocations and NCCL operations started inside
        are ordered after the work already queued on it."""
        return torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext()

    def wait(self, event: Any) -> None:
        if self.stream is not None and event is not None:
            self.stream.wait_event(event)

    def follow(self, other: "_Lane") -> None:
        if self.stream is not None:
            self.stream.wait_stream(other.stream)

    def mark(self) -> Any:
        """An event after the work queued so far (None on CPU: that work is done)."""
        if self.stream is None:
            return None
        event = torch.cuda.Event()
        event.record(self.stream)
        return event

    def synchronize(self) -> None:
        if self.stream is not None:
            self.stream.synchronize()


class _device_guard:
    """``torch.cuda.device(device)`` for CUDA devices with an index; nothing otherwise."""

    def __init__(self, device: torch.device) -> None:
        self._ctx = torch.cuda.device(device) if device.type == "cuda" and device.index is not None else None

    def __enter__(self) -> None:
        if self._ctx is not None:
            self._ctx.__enter__()

    def __exit__(self, *exc: Any) -> None:
        if self._ctx is not None:
            self._ctx.__exit__(*exc)


def _describe(x: object) -> str:
    if isinstance(x, torch.Tensor):
        return f"a {x.dtype} tensor of shape {tuple(x.shape)}"
    return type(x).__name__
