"""The paged KV pool: one preallocated K and one V tensor per model, handed out in pages.

Layout (the paged layout of SPEC.md, one pool for all layers):
- ``k``, ``v``: separate tensors ``[num_layers, num_pages, page_size, num_kv_heads, head_dim]``.
  Layer ``l``'s ``k_pages = pool.k[l]`` (a view) is what the attention kernels take.
- A page holds ``page_size`` tokens x ``num_kv_heads`` x ``head_dim`` for K and for V, in
  every layer: one page id addresses the same slots in all layers, so a request needs one
  page list, not one per layer. ``page_bytes`` is the K+V size of one page over all layers.
- Token ``j`` of a request lives at page ``pages[j // page_size]``, slot ``j % page_size``;
  its flat slot (for ``write``) is ``pages[j // page_size] * page_size + j % page_size``.
- Free list: LIFO. A fresh pool hands out pages ``0, 1, 2, ...``; released pages are pushed
  back so that the most recently freed page (the request's first page first) is reused
  first. The order is deterministic for a given sequence of calls.

FP8 (``torch.float8_e4m3fn``): pages store ``x / scale`` rounded to e4m3 (saturating at
+-448); ``k_scale``/``v_scale`` ``[num_layers, num_kv_heads]`` float32 are the descale
factors (``x ~= stored * scale``). They start at 1.0; set them per layer once, before the
first write of that layer (``set_scales`` or ``calibrate_scales`` from an amax): changing a
scale does not rescale pages already written. V is stored *token-major* (``v_raw``
``[num_layers, num_pages, num_kv_heads, head_dim, page_size]``; ``v`` is the same memory seen
as ``[num_layers, num_pages, page_size, num_kv_heads, head_dim]``): the K-major operand that
Hopper's fp8 tensor cores take for P V, so the CUTLASS attention stage reads it directly. A page
is still one contiguous block per layer; transfers copy ``k_raw``/``v_raw`` page by page, and
both ends of a transfer hold the same layout (it follows from the dtype).

Bookkeeping per request: its page list and ``seq_len`` (tokens written/committed). Pages
only grow (``reserve``) until ``release``. ``fork`` makes copy-on-write children of a request
(the ``n`` choices of one prompt on a decode replica): they share its full pages by reference
and each gets its own copy of its last, partial page. Allocation is all-or-nothing and raises the typed
``PoolExhausted`` that the scheduler acts on (preempt, queue, or spill).

Prefix cache (prefill replicas, ``PrefillEngine(prefix_cache=True)``): a full page of prompt
tokens can be registered under a digest of the whole prefix up to its end (``prefix_digests``:
a BLAKE2b chain over the token ids, page by page, so equal digests mean equal prefixes, not
merely equal pages). A later request whose prompt starts with cached pages takes them
(``reserve_with_prefix``) and computes only the rest. Pages are reference counted: a cached
page held by no request is *evictable*, counts as free, and is reused (least recently released
first) only when the free list is empty; a page several requests hold goes back when the last
one releases it. Cached pages are full and never written again (a request writes only past its
matched prefix).

CUDA pools are allocated outside torch's expandable segments (see ``_plain_cuda_segments``) so
that a decode replica on the same GPU can map them through CUDA IPC (``kv_transfer.ipc``).

Thread safety: one ``threading.Lock`` guards the free list and the request table (Ray
actors may run async handlers on several threads). ``write`` touches only tensor data of
pages the caller owns and takes no lock.
"""

from __future__ import annotations

import collections
import contextlib
import os
import re
import threading
from dataclasses import dataclass, field
from typing import Sequence

import torch

from kernels import fp8
from kernels._checks import canonical_device

from .prefix import prefix_digests

POOL_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn)


class PoolExhausted(RuntimeError):
    """Not enough free pages for a reservation; nothing was allocated.

    ``requested``: pages the call needed beyond what the request already held;
    ``free``: free pages at the time of the call; ``request_id``: who asked.
    """

    def __init__(self, requested: int, free: int, request_id: str | None = None) -> None:
        self.requested = requested
        self.free = free
        self.request_id = request_id
        who = f" for request {request_id!r}" if request_id is not None else ""
        super().__init__(f"KV pool exhausted{who}: needs {requested} more pages, {free} free")

    def __reduce__(self):  # keep the typed fields across pickling (Ray ships exceptions)
        return (type(self), (self.requested, self.free, self.request_id))


def _check_positive_int(name: str, value: object, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name}: expected an int >= {minimum}, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name}: expected an int >= {minimum}, got {value}")
    return value


@dataclass(frozen=True)
class KVPoolConfig:
    """Shape, dtype and capacity of a pool. Give exactly one of ``num_pages`` and
    ``memory_budget_bytes`` (capacity ``memory_budget_bytes // page_bytes``)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    page_size: int = 64
    dtype: torch.dtype = torch.bfloat16
    device: str | torch.device = "cpu"
    num_pages: int | None = None
    memory_budget_bytes: int | None = None

    def __post_init__(self) -> None:
        _check_positive_int("num_layers", self.num_layers)
        _check_positive_int("num_kv_heads", self.num_kv_heads)
        _check_positive_int("head_dim", self.head_dim)
        _check_positive_int("page_size", self.page_size)
        if self.dtype not in POOL_DTYPES:
            want = ", ".join(str(d).replace("torch.", "") for d in POOL_DTYPES)
            raise ValueError(f"dtype: expected one of ({want}), got {self.dtype!r}")
        try:
            torch.device(self.device)
        except (RuntimeError, TypeError) as exc:
            raise ValueError(f"device: expected a torch device or its name, got {self.device!r}") from exc
        if (self.num_pages is None) == (self.memory_budget_bytes is None):
            raise ValueError(
                "num_pages: expected exactly one of num_pages and memory_budget_bytes, got "
                f"num_pages={self.num_pages!r}, memory_budget_bytes={self.memory_budget_bytes!r}"
            )
        if self.num_pages is not None:
            _check_positive_int("num_pages", self.num_pages)
        else:
            _check_positive_int("memory_budget_bytes", self.memory_budget_bytes)
            if self.memory_budget_bytes < self.page_bytes:
                raise ValueError(
                    f"memory_budget_bytes: expected at least one page ({self.page_bytes} bytes "
                    f"for K+V over {self.num_layers} layers), got {self.memory_budget_bytes}"
                )

    @property
    def page_bytes(self) -> int:
        """K+V bytes of one page over all layers."""
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.page_size * self.num_kv_heads * self.head_dim * elem

    @property
    def v_token_major(self) -> bool:
        """V stored token-major (FP8 pools: the K-major operand of fp8 wgmma)."""
        return self.dtype == torch.float8_e4m3fn

    @property
    def capacity(self) -> int:
        """Number of pages the pool holds."""
        if self.num_pages is not None:
            return self.num_pages
        return self.memory_budget_bytes // self.page_bytes


@dataclass
class _Request:
    pages: list[int] = field(default_factory=list)
    seq_len: int = 0


class KVPool:
    """Preallocated paged K/V storage for all layers plus per-request page lists."""

    def __init__(self, config: KVPoolConfig) -> None:
        if not isinstance(config, KVPoolConfig):
            raise ValueError(f"config: expected a KVPoolConfig, got {type(config).__name__}")
        self.config = config
        self.num_pages = config.capacity
        self.page_size = config.page_size
        self.page_bytes = config.page_bytes
        self.num_layers = config.num_layers
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.dtype = config.dtype
        self.device = canonical_device(config.device)  # cuda:<current>, as the tensors report it
        shape = (config.num_layers, self.num_pages, config.page_size, config.num_kv_heads, config.head_dim)
        # zeros, not empty: padding slots hold finite values, so a masked read stays finite
        with _plain_cuda_segments(self.device):
            self.k = torch.zeros(shape, dtype=config.dtype, device=self.device)
            if config.v_token_major:
                self.v_raw = torch.zeros((*shape[:2], shape[3], shape[4], shape[2]), dtype=config.dtype,
                                         device=self.device)
                self.v = self.v_raw.permute(0, 1, 4, 2, 3)
            else:
                self.v = self.v_raw = torch.zeros(shape, dtype=config.dtype, device=self.device)
        self.k_raw = self.k
        if config.dtype == torch.float8_e4m3fn:
            scale_shape = (config.num_layers, config.num_kv_heads)
            self.k_scale: torch.Tensor | None = torch.ones(scale_shape, dtype=torch.float32, device=self.device)
            self.v_scale: torch.Tensor | None = torch.ones(scale_shape, dtype=torch.float32, device=self.device)
        else:
            self.k_scale = None
            self.v_scale = None
        self._lock = threading.Lock()
        self._free: list[int] = list(range(self.num_pages - 1, -1, -1))  # pop() -> 0, 1, ...
        self._requests: dict[str, _Request] = {}
        self._refs: dict[int, int] = {}  # page -> requests holding it (> 1: a shared prefix page)
        self._cache: dict[bytes, int] = {}  # prefix digest -> page (prefix cache)
        self._digest_of: dict[int, bytes] = {}  # cached page -> its digest
        self._evictable: collections.OrderedDict[int, None] = collections.OrderedDict()  # LRU first

    # ------------------------------------------------------------------ accounting
    @property
    def free_pages(self) -> int:
        """Pages a reservation can take: free ones and cached ones no request holds."""
        return len(self._free) + len(self._evictable)

    @property
    def used_pages(self) -> int:
        return self.num_pages - self.free_pages

    def _take(self, n: int) -> list[int]:
        """``n`` pages for a request (lock held, ``n <= free_pages`` checked): free ones first,
        then evicted cached ones, least recently released first."""
        pages = []
        for _ in range(max(n, 0)):
            if self._free:
                page = self._free.pop()
            else:
                page, _ = self._evictable.popitem(last=False)
                del self._cache[self._digest_of.pop(page)]
            self._refs[page] = 1
            pages.append(page)
        return pages

    def pages_for(self, num_tokens: int) -> int:
        """Pages needed to hold ``num_tokens`` tokens."""
        return -(-num_tokens // self.page_size)

    def reserve(self, request_id: str, num_tokens: int) -> list[int]:
        """Grow ``request_id``'s page list (creating the request if new) to hold
        ``num_tokens`` tokens in total; returns the whole page list.

        All-or-nothing: raises ``PoolExhausted`` and allocates nothing when the free pages
        do not suffice. Never shrinks: a ``num_tokens`` within the pages already held is a
        no-op. ``ValueError`` if ``num_tokens`` is negative or below the request's
        ``seq_len`` (committed tokens cannot be dropped this way; ``release`` instead).
        """
        _check_positive_int("num_tokens", num_tokens, minimum=0)
        with self._lock:
            req = self._requests.get(request_id)
            held = len(req.pages) if req is not None else 0
            if req is not None and num_tokens < req.seq_len:
                raise ValueError(
                    f"num_tokens: expected >= the request's seq_len {req.seq_len} "
                    f"(request {request_id!r}), got {num_tokens}"
                )
            need = self.pages_for(num_tokens) - held
            if need > self.free_pages:
                raise PoolExhausted(need, self.free_pages, request_id)
            if req is None:
                req = self._requests[request_id] = _Request()
            req.pages.extend(self._take(need))
            return list(req.pages)

    def adopt(self, request_id: str, num_tokens: int) -> list[int]:
        """Receive side of a KV transfer: reserve pages for a new request whose
        ``num_tokens`` tokens of K/V will be copied in, and set its ``seq_len`` to
        ``num_tokens``. The caller copies the pages before any reader uses the request.
        ``ValueError`` if the request already exists; ``PoolExhausted`` as ``reserve``."""
        _check_positive_int("num_tokens", num_tokens, minimum=0)
        with self._lock:
            if request_id in self._requests:
                raise ValueError(f"request_id: {request_id!r} already holds pages in this pool")
            need = self.pages_for(num_tokens)
            if need > self.free_pages:
                raise PoolExhausted(need, self.free_pages, request_id)
            req = self._requests[request_id] = _Request(seq_len=num_tokens, pages=self._take(need))
            return list(req.pages)

    def release(self, request_id: str) -> int:
        """Let go of the request's pages; returns how many it held. Unknown ids: 0. A page goes
        back when no request holds it any more: to the free list, or, if cached, to the
        evictable pages (most recently released last)."""
        with self._lock:
            req = self._requests.pop(request_id, None)
            if req is None:
                return 0
            for page in reversed(req.pages):  # the request's first page is reused first
                left = self._refs[page] - 1
                if left:
                    self._refs[page] = left
                    continue
                del self._refs[page]
                if page in self._digest_of:
                    self._evictable[page] = None
                else:
                    self._free.append(page)
            return len(req.pages)

    # ------------------------------------------------------------------ forks (n choices)
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
        child_ids = list(child_ids)
        if len(set(child_ids)) != len(child_ids) or parent_id in child_ids:
            raise ValueError(f"child_ids: expected distinct new ids, got {child_ids!r}")
        with self._lock:
            parent = self._get(parent_id)
            for cid in child_ids:
                if cid in self._requests:
                    raise ValueError(f"child_ids: {cid!r} already holds pages in this pool")
            full, partial = divmod(parent.seq_len, self.page_size)
            need = len(child_ids) if partial else 0
            if need > self.free_pages:
                raise PoolExhausted(need, self.free_pages, child_ids[0] if child_ids else parent_id)
            shared = parent.pages[:full]
            out = []
            for cid in child_ids:
                own = self._take(1) if partial else []
                for page in shared:
                    self._refs[page] += 1
                self._requests[cid] = _Request(pages=shared + own, seq_len=parent.seq_len)
                out.append(shared + own)
            src = parent.pages[full] if partial else None
        if src is not None:  # the copies: pages the caller owns, outside the lock (as ``write``)
            dst = torch.tensor([p[-1] for p in out], dtype=torch.long, device=self.device)
            for raw in (self.k_raw, self.v_raw):  # every layer; V token-major or not, a page is one block
                words = raw.view(torch.uint8).view(self.num_layers, self.num_pages, -1)
                words[:, dst] = words[:, src].unsqueeze(1)
        return out

    def page_holders(self, page: int) -> int:
        """How many requests hold ``page`` (0: free or evictable)."""
        with self._lock:
            return self._refs.get(page, 0)

    # ------------------------------------------------------------------ prefix cache
    def prefix_digests(self, token_ids: Sequence[int]) -> list[bytes]:
        """Digest of each *full* page of ``token_ids`` (``kv_transfer.prefix``): page ``i``'s
        stands for tokens ``[0, (i + 1) * page_size)``."""
        if isinstance(token_ids, torch.Tensor):
            token_ids = token_ids.tolist()
        return prefix_digests(token_ids, self.page_size)

    def _match(self, digests: Sequence[bytes]) -> list[int]:
        pages = []
        for d in digests:
            page = self._cache.get(d)
            if page is None:
                break
            pages.append(page)
        return pages

    def cached_prefix_pages(self, digests: Sequence[bytes]) -> int:
        """How many leading pages of ``digests`` the cache holds (a lookup; nothing is taken)."""
        with self._lock:
            return len(self._match(digests))

    def reserve_with_prefix(self, request_id: str, digests: Sequence[bytes], num_tokens: int) -> int:
        """Create ``request_id`` holding pages for ``num_tokens`` tokens, its first pages the
        cached ones of the longest cached prefix among ``digests`` (shared, not copied), the
        rest new; its ``seq_len`` is the tokens of the shared pages, which it returns.
        All-or-nothing as ``reserve``: ``PoolExhausted`` leaves the pool as it was.
        ``ValueError`` if the request exists or the digests cover more than ``num_tokens``."""
        _check_positive_int("num_tokens", num_tokens, minimum=0)
        if len(digests) * self.page_size > num_tokens:
            raise ValueError(f"digests: {len(digests)} pages of {self.page_size} tokens are more than "
                             f"num_tokens ({num_tokens})")
        with self._lock:
            if request_id in self._requests:
                raise ValueError(f"request_id: {request_id!r} already holds pages in this pool")
            shared = self._match(digests)
            need = self.pages_for(num_tokens) - len(shared)
            # shared pages no one holds are evictable: taking them leaves that many fewer to take
            reclaim = sum(1 for p in shared if p in self._evictable)
            if need > self.free_pages - reclaim:
                raise PoolExhausted(need, self.free_pages - reclaim, request_id)
            for page in shared:
                if page in self._evictable:
                    del self._evictable[page]
                self._refs[page] = self._refs.get(page, 0) + 1
            self._requests[request_id] = _Request(pages=shared + self._take(need), seq_len=len(shared) * self.page_size)
            return len(shared) * self.page_size

    def cache_prefix(self, request_id: str, digests: Sequence[bytes]) -> int:
        """Register ``request_id``'s first ``len(digests)`` pages (written: within its
        ``seq_len``) under ``digests`` (from ``prefix_digests`` of its tokens); a digest already
        cached keeps its page. Returns how many pages were newly cached."""
        with self._lock:
            req = self._get(request_id)
            if len(digests) * self.page_size > req.seq_len:
                raise ValueError(f"digests: {len(digests)} pages of {self.page_size} tokens are more than the "
                                 f"{req.seq_len} tokens written for {request_id!r}")
            added = 0
            for page, d in zip(req.pages, digests):
                if d in self._cache or page in self._digest_of:
                    continue
                self._cache[d] = page
                self._digest_of[page] = d
                added += 1
            return added

    def clear_prefix_cache(self) -> int:
        """Forget every cached prefix (pages held by requests stay theirs); returns how many."""
        with self._lock:
            n = len(self._cache)
            self._free.extend(reversed(self._evictable))
            self._evictable.clear()
            self._cache.clear()
            self._digest_of.clear()
            return n

    def rename(self, request_id: str, new_id: str) -> None:
        """Move ``request_id``'s pages and ``seq_len`` to ``new_id`` in one step (nothing is
        freed or allocated). A KV channel uses it to take pages that its device may still write
        out of a request that is being torn down. ``KeyError`` if ``request_id`` holds no pages,
        ``ValueError`` if ``new_id`` already does."""
        with self._lock:
            if new_id in self._requests:
                raise ValueError(f"new_id: {new_id!r} already holds pages in this pool")
            self._requests[new_id] = self._get(request_id)
            del self._requests[request_id]

    def _get(self, request_id: str) -> _Request:
        req = self._requests.get(request_id)
        if req is None:
            raise KeyError(f"request_id: {request_id!r} holds no pages in this pool")
        return req

    def has(self, request_id: str) -> bool:
        with self._lock:
            return request_id in self._requests

    def pages(self, request_id: str) -> list[int]:
        with self._lock:
            return list(self._get(request_id).pages)

    def seq_len(self, request_id: str) -> int:
        with self._lock:
            return self._get(request_id).seq_len

    def set_seq_len(self, request_id: str, n: int) -> None:
        """Record that tokens ``[0, n)`` are written; ``n`` must fit in the pages held."""
        _check_positive_int("n", n, minimum=0)
        with self._lock:
            req = self._get(request_id)
            cap = len(req.pages) * self.page_size
            if n > cap:
                raise ValueError(
                    f"n: expected <= {cap} (the {len(req.pages)} pages held by {request_id!r}); "
                    "reserve more first"
                )
            req.seq_len = n

    def stats(self) -> dict:
        with self._lock:
            return {
                "num_pages": self.num_pages,
                "free_pages": self.free_pages,
                "used_pages": self.used_pages,
                "requests": len(self._requests),
                "cached_pages": len(self._cache),
                "evictable_pages": len(self._evictable),
                "page_size": self.page_size,
                "dtype": str(self.dtype).replace("torch.", ""),
                "page_bytes": self.page_bytes,
            }

    # ------------------------------------------------------------------ addressing
    def page_table(self, request_ids: Sequence[str], *, device=None) -> torch.Tensor:
        """int32 ``[B, max_pages]`` (at least one column), row ``b`` the pages of
        ``request_ids[b]``, padded with 0 (never read past ``seqlens_kv``)."""
        with self._lock:
            lists = [list(self._get(r).pages) for r in request_ids]
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
        with self._lock:
            lists = [list(self._get(r).pages) for r in request_ids]
        for rid, p, start, length in zip(request_ids, lists, starts, lengths):
            _check_positive_int("starts", int(start), minimum=0)
            _check_positive_int("lengths", int(length), minimum=0)
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
        """Scatter ``k, v [T, Hkv, d]`` into layer ``layer`` at flat ``slots [T]`` (from
        ``slot_mapping``; their values are not checked, to stay free of host syncs).
        FP8 pools store ``x / scale`` saturated to e4m3: with ``backend`` ``"auto"`` (on CUDA) or
        ``"triton"`` one fused kernel quantizes and scatters K and V (``kernels/triton_fp8.py``),
        ``"reference"`` does it in eager PyTorch; the same bytes either way."""
        if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < self.num_layers:
            raise ValueError(f"layer: expected an int in [0, {self.num_layers}), got {layer!r}")
        if not isinstance(slots, torch.Tensor) or slots.dim() != 1 or slots.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"slots: expected a 1-D int64 (or int32) tensor, got {_describe(slots)}")
        if slots.device != self.device:
            raise ValueError(f"slots: expected a tensor on {self.device}, got one on {slots.device}")
        want = (slots.shape[0], self.num_kv_heads, self.head_dim)
        for name, x in (("k", k), ("v", v)):
            if not isinstance(x, torch.Tensor) or tuple(x.shape) != want:
                raise ValueError(f"{name}: expected shape {want} (T from slots), got {_describe(x)}")
            if not x.is_floating_point():
                raise ValueError(f"{name}: expected a floating-point tensor, got {x.dtype}")
            if x.device != self.device:
                raise ValueError(f"{name}: expected a tensor on {self.device}, got one on {x.device}")
        if backend not in ("auto", "triton", "reference"):
            raise ValueError(f"backend: expected 'auto', 'triton' or 'reference', got {backend!r}")
        if self.k_scale is not None and (backend == "triton" or (backend == "auto" and self.device.type == "cuda")):
            from kernels import triton_fp8
            from kernels.ops import triton_available

            if not triton_available(self.device):
                raise ValueError(f"backend: 'triton' needs a CUDA pool or TRITON_INTERPRET=1, this one is on {self.device}")
            triton_fp8.write_pages(_last_contiguous(k), _last_contiguous(v), slots.contiguous(),
                                   self.k_scale[layer], self.v_scale[layer], self.k[layer], self.v_raw[layer])
            return
        index = slots.long()
        for pages, x, scale in ((self.k, k, self.k_scale), (self.v, v, self.v_scale)):
            data = x.to(self.dtype) if scale is None else quantize_fp8(x, scale[layer])
            if pages is self.v and self.config.v_token_major:
                # [pages, H, d, page_size] bytes: token t at (slot // page_size, :, :, slot % page_size)
                raw = self.v_raw[layer].view(torch.uint8)
                raw[index // self.page_size, :, :, index % self.page_size] = data.view(torch.uint8)
                continue
            flat = pages[layer].view(-1, self.num_kv_heads, self.head_dim)
            if scale is None:
                flat.index_copy_(0, index, data)
            else:
                flat.view(torch.uint8).index_copy_(0, index, data.view(torch.uint8))

    def set_scales(self, layer: int, k_scale: torch.Tensor | float, v_scale: torch.Tensor | float) -> None:
        """FP8 pools: set layer ``layer``'s descale factors (a float or ``[num_kv_heads]``)."""
        if self.k_scale is None:
            raise ValueError(f"k_scale: only FP8 pools have scales, this pool stores {self.dtype}")
        for name, dst, val in (("k_scale", self.k_scale, k_scale), ("v_scale", self.v_scale, v_scale)):
            t = torch.as_tensor(val, dtype=torch.float32, device=self.device).expand(self.num_kv_heads)
            if not bool(torch.isfinite(t).all()) or not bool((t > 0).all()):
                raise ValueError(f"{name}: expected positive finite scales, got {t.tolist()}")
            dst[layer] = t

    def calibrate_scales(self, layer: int, k: torch.Tensor, v: torch.Tensor, *, margin: float = 1.0) -> None:
        """FP8 pools: per-KV-head scales ``amax * margin / 448`` from sample ``k, v [T, Hkv, d]``."""
        self.set_scales(layer, fp8_scale_from_amax(k, margin=margin), fp8_scale_from_amax(v, margin=margin))


_EXPANDABLE_ON = re.compile(r"expandable_segments\s*:\s*True")


@contextlib.contextmanager
def _plain_cuda_segments(device: torch.device):
    """Allocate outside torch's expandable segments, where the process turned them on through
    ``PYTORCH_CUDA_ALLOC_CONF`` / ``PYTORCH_ALLOC_CONF``.

    Why: a same-GPU decode replica maps this pool through CUDA IPC (``kv_transfer.ipc``). A
    plain segment is shared with ``cudaIpcGetMemHandle``; an expandable one through a POSIX fd
    that the importer pulls with ``pidfd_getfd``, which needs ptrace rights over the exporter
    that sibling Ray workers usually lack (Yama ``ptrace_scope=1``, container seccomp). The
    pool is one fixed allocation, so expandable segments buy it nothing. The setting is
    process-wide while it lasts (pools are built at replica start, before serving); the
    original string is set back whole, since parsing a settings string resets the keys it
    leaves out."""
    conf_var = next((v for v in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")
                     if _EXPANDABLE_ON.search(os.environ.get(v, ""))), None)
    if device.type != "cuda" or conf_var is None:
        yield
        return
    original = os.environ[conf_var]
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None) or torch.cuda.memory._set_allocator_settings
    try:
        setter(_EXPANDABLE_ON.sub("expandable_segments:False", original))
        switched = True
    except Exception:  # an allocator without the option: allocate as configured
        switched = False
    try:
        yield
    finally:
        if switched:
            setter(original)


_COPY_WORDS = (torch.int64, torch.int32, torch.int16, torch.uint8)


def copy_word(*byte_counts: int) -> torch.dtype:
    """The widest integer dtype dividing every one of ``byte_counts`` (a K/V row of head_dim
    elements, a tensor's byte offset, ...), for copying pages through integer views:
    index_select/index_copy_ move one element per index computation, so 8-byte words move 8x
    the bytes per step of a byte view, and integer views also cover FP8, which those kernels
    lack. The copy is exact whatever the word."""
    for word in _COPY_WORDS:
        size = torch.empty((), dtype=word).element_size()
        if all(n % size == 0 for n in byte_counts):
            return word
    raise AssertionError("unreachable: uint8 divides everything")


def pool_page_words(pool: "KVPool", word: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``pool.k_raw`` and ``pool.v_raw`` as ``[num_layers, num_pages, words]`` views of ``word``
    (default: the widest integer one page of one layer divides into): a page of a layer is one
    contiguous run of the storage whatever V's layout, so transfers copy pages as words."""
    if word is None:
        word = copy_word(pool.page_size * pool.num_kv_heads * pool.head_dim * pool.k.element_size())
    shape = (pool.num_layers, pool.num_pages, -1)
    return (pool.k_raw.view(torch.uint8).view(shape).view(word),
            pool.v_raw.view(torch.uint8).view(shape).view(word))


def fp8_scale_from_amax(x: torch.Tensor, *, margin: float = 1.0) -> torch.Tensor:
    """Per-head descale ``[H]`` so that ``x [T, H, d] / scale`` spans e4m3's range."""
    return fp8.descale_from_amax(x.detach().float().abs().amax(dim=(0, 2)), margin=margin)


def quantize_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x [T, H, d] / scale [H]`` saturated to +-448 and rounded to e4m3 (``kernels.fp8``)."""
    return fp8.quantize(x, scale.view(1, -1, 1))


def _padded_table(lists: list[list[int]], dtype: torch.dtype) -> torch.Tensor:
    """``[len(lists), max(1, longest)]`` page ids, rows padded with 0 (one tensor from padded
    lists: a tensor copy per row costs ~10 us a row)."""
    width = max(1, max((len(p) for p in lists), default=0))
    return torch.tensor([p + [0] * (width - len(p)) for p in lists], dtype=dtype).reshape(len(lists), width)


def _last_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _describe(x: object) -> str:
    if isinstance(x, torch.Tensor):
        return f"a {x.dtype} tensor of shape {tuple(x.shape)}"
    return type(x).__name__
