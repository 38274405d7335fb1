"""The paged KV pool: one preallocated K and one V tensor per model, handed out in pages.

``KVPool`` is the one object the engines, the model runner and the transports hold. It puts
together two parts that know nothing of each other:
- ``manager: PageManager`` (``kv_cache.manager``): who holds which page. Per request its page
  list and ``seq_len`` (tokens written/committed); a LIFO free list; holder counts; the prefix
  cache. Pages only grow (``reserve``) until ``release``. ``fork`` makes copy-on-write children
  of a request (the ``n`` choices of one prompt on a decode replica): they share its full pages
  by reference and each gets its own copy of its last, partial page. Allocation is
  all-or-nothing and raises the typed ``PoolExhausted`` that the scheduler acts on (preempt,
  queue, or spill).
- ``tensors: KVTensors`` (``kv_cache.tensors``): the K/V tensors (``k``, ``v``, ``k_raw``,
  ``v_raw``; the layout is described there), the FP8 descales and ``write``.
The pool adds what needs both: the addressing (``page_table``, ``slot_mapping``: page lists
turned into device tensors) and the page copy of a fork.

Prefix cache (prefill replicas, ``PrefillEngine(prefix_cache=True)``): a full page of prompt
tokens can be registered under a digest of the whole prefix up to its end (``prefix_digests``:
a BLAKE2b chain over the token ids, page by page, so equal digests mean equal prefixes, not
merely equal pages). A later request whose prompt starts with cached pages takes them
(``reserve_with_prefix``) and computes only the rest. Pages are reference counted: a cached
page held by no request is *evictable*, counts as free, and is reused (least recently released
first) only when the free list is empty; a page several requests hold goes back when the last
one releases it. Cached pages are full and never written again (a request writes only past its
matched prefix).

Thread safety: the manager's lock guards the free list and the request table (Ray actors may
run async handlers on several threads). ``write`` touches only tensor data of pages the caller
owns and takes no lock.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kernels._scalars import check_int

from .config import KVPoolConfig
from .manager import PageManager
from .prefix import prefix_digests
from .tensors import KVTensors


def _tensors_attr(name: str) -> property:
    def get(pool: "KVPool") -> torch.Tensor | None:
        return getattr(pool.tensors, name)

    def set_(pool: "KVPool", value: torch.Tensor | None) -> None:
        setattr(pool.tensors, name, value)

    return property(get, set_, doc=f"``tensors.{name}`` (``kv_cache.tensors.KVTensors``)")


class KVPool:
    """Preallocated paged K/V storage for all layers plus per-request page lists."""

    def __init__(self, config: KVPoolConfig) -> None:
        if not isinstance(config, KVPoolConfig):
            raise ValueError(f"config: expected a KVPoolConfig, got {type(config).__name__}")
        self.config = config
        self.tensors = KVTensors(config)
        self.manager = PageManager(config.capacity, config.page_size)
        self.num_pages = config.capacity
        self.page_size = config.page_size
        self.page_bytes = config.page_bytes
        self.num_layers = config.num_layers
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.dtype = config.dtype
        self.device = self.tensors.device

    # ------------------------------------------------------------------ the tensors
    # the tensors' own attributes, read and set through the pool (a test re-seats k and v at an
    # odd storage offset): one place holds each tensor, so ``write`` sees what readers see
    k = _tensors_attr("k")
    v = _tensors_attr("v")
    k_raw = _tensors_attr("k_raw")
    v_raw = _tensors_attr("v_raw")
    k_scale = _tensors_attr("k_scale")
    v_scale = _tensors_attr("v_scale")

    # ------------------------------------------------------------------ accounting
    @property
    def free_pages(self) -> int:
        """Pages a reservation can take: free ones and cached ones no request holds."""
        return self.manager.free_pages

    @property
    def used_pages(self) -> int:
        return self.manager.used_pages

    def pages_for(self, num_tokens: int) -> int:
        """Pages needed to hold ``num_tokens`` tokens."""
        return self.manager.pages_for(num_tokens)

    def reserve(self, request_id: str, num_tokens: int) -> list[int]:
        """``PageManager.reserve``: grow the request's page list to ``num_tokens`` tokens,
        all-or-nothing (``PoolExhausted``); returns the whole page list."""
        return self.manager.reserve(request_id, num_tokens)

    def adopt(self, request_id: str, num_tokens: int) -> list[int]:
        """``PageManager.adopt``: pages for a new request whose K/V a transfer copies in."""
        return self.manager.adopt(request_id, num_tokens)

    def release(self, request_id: str) -> int:
        """``PageManager.release``: let go of the request's pages; returns how many it held
        (unknown ids: 0)."""
        return self.manager.release(request_id)

    def fork(self, parent_id: str, child_ids: Sequence[str]) -> list[list[int]]:
        """Copy-on-write forks of ``parent_id`` (the choices of one prompt: ``n`` / ``best_of``).
        Each child gets the parent's ``seq_len`` and holds the parent's *full* pages within it by
        reference (one more holder each); the parent's last, partial page (``seq_len`` not a
        multiple of ``page_size``) is copied into a fresh page per child, since each one appends
        into its slots. Pages the parent reserved past ``seq_len`` are not shared. Returns each
        child's page list. All-or-nothing: ``PoolExhausted`` (one page per child when the last
        page is partial) takes nothing. ``release`` of the parent and the children in any order
        keeps the accounting exact: a shared page goes back with its last holder.
        ``KeyError`` if the parent holds no pages, ``ValueError`` for a child id in use or given
        twice."""
        out, copy = self.manager.fork(parent_id, child_ids)
        if copy is not None:  # pages the caller owns, outside the lock (as ``write``)
            self.tensors.copy_pages(copy.src, copy.dsts)
        return out

    def page_holders(self, page: int) -> int:
        """How many requests hold ``page`` (0: free or evictable)."""
        return self.manager.page_holders(page)

    # ------------------------------------------------------------------ prefix cache
    def prefix_digests(self, token_ids: Sequence[int]) -> list[bytes]:
        """Digest of each *full* page of ``token_ids`` (``kv_cache.prefix``): page ``i``'s
        stands for tokens ``[0, (i + 1) * page_size)``."""
        if isinstance(token_ids, torch.Tensor):
            token_ids = token_ids.tolist()
        return prefix_digests(token_ids, self.page_size)

    def cached_prefix_pages(self, digests: Sequence[bytes]) -> int:
        """How many leading pages of ``digests`` the cache holds (a lookup; nothing is taken)."""
        return self.manager.cached_prefix_pages(digests)

    def reserve_with_prefix(self, request_id: str, digests: Sequence[bytes], num_tokens: int) -> int:
        """``PageManager.reserve_with_prefix``: a new request whose first pages are the cached
        ones of the longest cached prefix among ``digests``; returns their tokens."""
        return self.manager.reserve_with_prefix(request_id, digests, num_tokens)

    def cache_prefix(self, request_id: str, digests: Sequence[bytes]) -> int:
        """Register ``request_id``'s first ``len(digests)`` pages (written: within its
        ``seq_len``) under ``digests`` (from ``prefix_digests`` of its tokens); a digest already
        cached keeps its page. Returns how many pages were newly cached."""
        return self.manager.cache_prefix(request_id, digests)

    def clear_prefix_cache(self) -> int:
        """Forget every cached prefix (pages held by requests stay theirs); returns how many."""
        return self.manager.clear_prefix_cache()

    def rename(self, request_id: str, new_id: str) -> None:
        """Move ``request_id``'s pages and ``seq_len`` to ``new_id`` in one step (nothing is
        freed or allocated). A KV channel uses it to take pages that its device may still write
        out of a request that is being torn down. ``KeyError`` if ``request_id`` holds no pages,
        ``ValueError`` if ``new_id`` already does."""
        self.manager.rename(request_id, new_id)

    def has(self, request_id: str) -> bool:
        return self.manager.has(request_id)

    def pages(self, request_id: str) -> list[int]:
        return self.manager.pages(request_id)

    def seq_len(self, request_id: str) -> int:
        return self.manager.seq_len(request_id)

    def set_seq_len(self, request_id: str, n: int) -> None:
        """Record that tokens ``[0, n)`` are written; ``n`` must fit in the pages held."""
        self.manager.set_seq_len(request_id, n)

    def stats(self) -> dict:
        return {**self.manager.stats(), "dtype": str(self.dtype).replace("torch.", ""),
                "page_bytes": self.page_bytes}

    # ------------------------------------------------------------------ addressing
    def page_table(self, request_ids: Sequence[str], *, device=None) -> torch.Tensor:
        """int32 ``[B, max_pages]`` (at least one column), row ``b`` the pages of
        ``request_ids[b]``, padded with 0 (never read past ``seqlens_kv``)."""
        lists = self.manager.page_lists(request_ids)
        return _padded_table(lists, torch.int32).to(self.device if device is None else device)

    def slot_mapping(
        self, request_ids: Sequence[str], starts: Sequence[int], lengths: Sequence[int], *, device=None
    ) -> torch.Tensor:
        """int64 flat slots ``page * page_size + offset`` of tokens ``[start, start + length)``
        of each request, concatenated in order. The tokens must lie in reserved pages."""
        if not (len(request_ids) == len(starts) == len(lengths)):
            raise ValueError(
                f"starts: expected one start and one length per request ({len(request_ids)}), "
                f"got {len(starts)} starts and {len(lengths)} lengths"
            )
        lists = self.manager.page_lists(request_ids)
        for rid, p, start, length in zip(request_ids, lists, starts, lengths):
            check_int("starts", int(start), minimum=0)
            check_int("lengths", int(length), minimum=0)
            if start + length > len(p) * self.page_size:
                raise ValueError(
                    f"lengths: tokens [{start}, {start + length}) of {rid!r} exceed its "
                    f"{len(p)} reserved pages ({len(p) * self.page_size} tokens); reserve first"
                )
        # every request's positions at once (a decode step's host time at large batches)
        n = torch.tensor([int(x) for x in lengths], dtype=torch.int64)
        first = torch.tensor([int(x) for x in starts], dtype=torch.int64)
        row = torch.repeat_interleave(torch.arange(len(lists)), n)
        pos = torch.arange(int(n.sum())) - torch.repeat_interleave(n.cumsum(0) - n - first, n)
        slots = _padded_table(lists, torch.int64)[row, pos // self.page_size] * self.page_size + pos % self.page_size
        return slots.to(self.device if device is None else device)

    # ------------------------------------------------------------------ data
    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
              backend: str = "auto") -> None:
        """``KVTensors.write``: scatter ``k, v [T, Hkv, d]`` into layer ``layer`` at flat
        ``slots [T]`` (from ``slot_mapping``), quantizing for FP8 pools."""
        self.tensors.write(layer, slots, k, v, backend=backend)

    def set_scales(self, layer: int, k_scale: torch.Tensor | float, v_scale: torch.Tensor | float) -> None:
        """FP8 pools: set layer ``layer``'s descale factors (a float or ``[num_kv_heads]``)."""
        self.tensors.set_scales(layer, k_scale, v_scale)

    def calibrate_scales(self, layer: int, k: torch.Tensor, v: torch.Tensor, *, margin: float = 1.0) -> None:
        """FP8 pools: per-KV-head scales ``amax * margin / 448`` from sample ``k, v [T, Hkv, d]``."""
        self.tensors.calibrate_scales(layer, k, v, margin=margin)


def _padded_table(lists: list[list[int]], dtype: torch.dtype) -> torch.Tensor:
    """``[len(lists), max(1, longest)]`` page ids, rows padded with 0 (one tensor from padded
    lists: a tensor copy per row costs ~10 us a row)."""
    width = max(1, max((len(p) for p in lists), default=0))
    return torch.tensor([p + [0] * (width - len(p)) for p in lists], dtype=dtype).reshape(len(lists), width)
