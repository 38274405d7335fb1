"""The page manager: who holds which KV page. No tensors: the pages' K/V live in ``KVTensors``
(``kv_cache.tensors``); ``KVPool`` (``kv_cache.pool``) puts the two together.

Two levels, one lock:
- Pages (``BlockPool``, the manager's ``blocks``): a LIFO free list, a holder count per page,
  and the prefix cache (a digest -> page map and its inverse). ``allocate`` takes free pages first and then evicts cached
  pages that no request holds, least recently released first; ``hold`` adds a holder (a shared
  prefix page, a fork's full pages); ``free`` drops one, and a page whose last holder went goes
  back to the free list, or, if cached, to the evictable pages (most recently released last).
  Dropping a holder a page does not have is a double free: ``ValueError``, nothing changed.
- Requests: each one's page list and ``seq_len`` (tokens written). ``reserve`` / ``adopt`` /
  ``reserve_with_prefix`` / ``fork`` / ``release`` are the page operations a request needs, each
  all-or-nothing: ``PoolExhausted`` leaves every count as it was.

A fresh manager hands out pages ``0, 1, 2, ...``; a released request's pages go back so that its
first page is reused first. The order is deterministic for a given sequence of calls.

Thread safety: every public method takes the one ``threading.Lock`` (Ray actors may run async
handlers on several threads).
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

from kernels._scalars import check_int


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


@dataclass
class _Request:
    pages: list[int] = field(default_factory=list)
    seq_len: int = 0


@dataclass(frozen=True)
class ForkCopy:
    """The one page copy a fork needs: the parent's partial last page ``src`` into each child's
    own last page ``dsts`` (in child order)."""

    src: int
    dsts: tuple[int, ...]


class BlockPool:
    """The pages level of a ``PageManager``: the LIFO free list, each held page's holder count,
    the prefix cache (digest -> page and back) and the cached pages no request holds, least
    recently released first. No lock: the manager calls it under its own."""

    def __init__(self, num_pages: int) -> None:
        self.free: list[int] = list(range(num_pages - 1, -1, -1))  # pop() -> 0, 1, ...
        self.refs: dict[int, int] = {}  # page -> holders (> 1: a shared prefix page or a fork's)
        self.cache: dict[bytes, int] = {}  # prefix digest -> page
        self.digest_of: dict[int, bytes] = {}  # cached page -> its digest
        self.evictable: collections.OrderedDict[int, None] = collections.OrderedDict()  # LRU first

    @property
    def available(self) -> int:
        """Pages an allocation can take: free ones and cached ones no request holds."""
        return len(self.free) + len(self.evictable)

    def take(self, n: int) -> list[int]:
        """(``n <= available`` checked) free pages first, then evicted cached ones."""
        pages = []
        for _ in range(max(n, 0)):
            if self.free:
                page = self.free.pop()
            else:
                page, _ = self.evictable.popitem(last=False)
                del self.cache[self.digest_of.pop(page)]
            self.refs[page] = 1
            pages.append(page)
        return pages

    def hold(self, pages: Sequence[int]) -> None:
        for page in pages:
            self.evictable.pop(page, None)
            self.refs[page] = self.refs.get(page, 0) + 1

    def drop(self, pages: Sequence[int]) -> int:
        # checked first: a double free changes nothing (and would otherwise put a page on the
        # free list twice, to be handed to two requests)
        for page, times in collections.Counter(pages).items():
            if self.refs.get(page, 0) < times:
                raise ValueError(f"pages: page {page!r} freed {times} time(s) but has "
                                 f"{self.refs.get(page, 0)} holder(s) (a double free)")
        back = 0
        for page in pages:
            left = self.refs[page] - 1
            if left:
                self.refs[page] = left
                continue
            del self.refs[page]
            back += 1
            if page in self.digest_of:
                self.evictable[page] = None
            else:
                self.free.append(page)
        return back

    def match(self, digests: Sequence[bytes]) -> list[int]:
        """The cached pages of the longest cached prefix of ``digests``."""
        pages = []
        for d in digests:
            page = self.cache.get(d)
            if page is None:
                break
            pages.append(page)
        return pages

    def register(self, pages: Sequence[int], digests: Sequence[bytes]) -> int:
        """Cache ``pages`` under ``digests`` (pairwise); a digest already cached keeps its page, a
        page already cached keeps its digest. Returns how many pages were newly cached."""
        added = 0
        for page, d in zip(pages, digests):
            if d in self.cache or page in self.digest_of:
                continue
            self.cache[d] = page
            self.digest_of[page] = d
            added += 1
        return added

    def clear_cache(self) -> int:
        """Forget every cached prefix: evictable pages go back to the free list; returns how many
        digests were cached."""
        n = len(self.cache)
        self.free.extend(reversed(self.evictable))
        self.evictable.clear()
        self.cache.clear()
        self.digest_of.clear()
        return n


class PageManager:
    """Page allocation, holder counts, the prefix cache and the request table of one pool of
    ``num_pages`` pages of ``page_size`` tokens: the pages level is :attr:`blocks` (a
    :class:`BlockPool`), the requests level is here, both under one lock."""

    def __init__(self, num_pages: int, page_size: int) -> None:
        self.num_pages = check_int("num_pages", num_pages, minimum=1)
        self.page_size = check_int("page_size", page_size, minimum=1)
        self._lock = threading.Lock()
        self.blocks = BlockPool(num_pages)
        self._requests: dict[str, _Request] = {}

    # ------------------------------------------------------------------ pages
    @property
    def free_pages(self) -> int:
        """Pages an allocation can take: free ones and cached ones no request holds."""
        return self.blocks.available

    @property
    def used_pages(self) -> int:
        return self.num_pages - self.free_pages

    def pages_for(self, num_tokens: int) -> int:
        """Pages needed to hold ``num_tokens`` tokens."""
        return -(-num_tokens // self.page_size)

    def allocate(self, n: int) -> list[int]:
        """``n`` pages with one holder each (the caller); ``PoolExhausted`` takes none."""
        check_int("n", n, minimum=0)
        with self._lock:
            if n > self.free_pages:
                raise PoolExhausted(n, self.free_pages)
            return self.blocks.take(n)

    def hold(self, pages: Sequence[int]) -> None:
        """One more holder for each of ``pages`` (held or evictable ones: an evictable page is
        taken back from eviction). ``ValueError`` for a free page, nothing changed."""
        with self._lock:
            for page in pages:
                if page not in self.blocks.refs and page not in self.blocks.evictable:
                    raise ValueError(f"pages: page {page!r} is free; allocate it instead")
            self.blocks.hold(pages)

    def free(self, pages: Sequence[int]) -> int:
        """One holder less for each of ``pages`` (see the module docstring for where a page goes);
        returns how many went back. ``ValueError`` on a double free, nothing changed."""
        with self._lock:
            return self.blocks.drop(pages)

    def page_holders(self, page: int) -> int:
        """How many holders ``page`` has (0: free or evictable)."""
        with self._lock:
            return self.blocks.refs.get(page, 0)

    # ------------------------------------------------------------------ requests
    def reserve(self, request_id: str, num_tokens: int) -> list[int]:
        """Grow ``request_id``'s page list (creating the request if new) to hold
        ``num_tokens`` tokens in total; returns the whole page list.

        All-or-nothing: raises ``PoolExhausted`` and allocates nothing when the free pages
        do not suffice. Never shrinks: a ``num_tokens`` within the pages already held is a
        no-op. ``ValueError`` if ``num_tokens`` is negative or below the request's
        ``seq_len`` (committed tokens cannot be dropped this way; ``release`` instead).
        """
        check_int("num_tokens", num_tokens, minimum=0)
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
            req.pages.extend(self.blocks.take(need))
            return list(req.pages)

    def adopt(self, request_id: str, num_tokens: int) -> list[int]:
        """Receive side of a KV transfer: reserve pages for a new request whose
        ``num_tokens`` tokens of K/V will be copied in, and set its ``seq_len`` to
        ``num_tokens``. The caller copies the pages before any reader uses the request.
        ``ValueError`` if the request already exists; ``PoolExhausted`` as ``reserve``."""
        check_int("num_tokens", num_tokens, minimum=0)
        with self._lock:
            if request_id in self._requests:
                raise ValueError(f"request_id: {request_id!r} already holds pages in this pool")
            need = self.pages_for(num_tokens)
            if need > self.free_pages:
                raise PoolExhausted(need, self.free_pages, request_id)
            req = self._requests[request_id] = _Request(seq_len=num_tokens, pages=self.blocks.take(need))
            return list(req.pages)

    def release(self, request_id: str) -> int:
        """Let go of the request's pages; returns how many it held. Unknown ids: 0. A page goes
        back when no request holds it any more."""
        with self._lock:
            req = self._requests.pop(request_id, None)
            if req is None:
                return 0
            self.blocks.drop(req.pages[::-1])  # the request's first page is reused first
            return len(req.pages)

    def fork(self, parent_id: str, child_ids: Sequence[str]) -> tuple[list[list[int]], ForkCopy | None]:
        """Copy-on-write forks of ``parent_id``: each child gets the parent's ``seq_len``, holds
        the parent's full pages within it (one more holder each) and, when the last page is
        partial, a fresh page of its own for it. Returns each child's page list and the copy the
        caller makes of that partial page (``None``: page-aligned, nothing to copy).
        All-or-nothing: ``PoolExhausted`` takes nothing. ``KeyError`` if the parent holds no
        pages, ``ValueError`` for a child id in use or given twice."""
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
                own = self.blocks.take(1) if partial else []
                self.blocks.hold(shared)
                self._requests[cid] = _Request(pages=shared + own, seq_len=parent.seq_len)
                out.append(shared + own)
            copy = ForkCopy(parent.pages[full], tuple(p[-1] for p in out)) if partial and out else None
        return out, copy

    def rename(self, request_id: str, new_id: str) -> None:
        """Move ``request_id``'s pages and ``seq_len`` to ``new_id`` in one step (nothing is
        freed or allocated). ``KeyError`` if ``request_id`` holds no pages, ``ValueError`` if
        ``new_id`` already does."""
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

    def page_lists(self, request_ids: Sequence[str]) -> list[list[int]]:
        """The page lists of ``request_ids``, read under one lock (``KeyError`` for an unknown id)."""
        with self._lock:
            return [list(self._get(r).pages) for r in request_ids]

    def seq_len(self, request_id: str) -> int:
        with self._lock:
            return self._get(request_id).seq_len

    def set_seq_len(self, request_id: str, n: int) -> None:
        """Record that tokens ``[0, n)`` are written; ``n`` must fit in the pages held."""
        check_int("n", n, minimum=0)
        with self._lock:
            req = self._get(request_id)
            cap = len(req.pages) * self.page_size
            if n > cap:
                raise ValueError(
                    f"n: expected <= {cap} (the {len(req.pages)} pages held by {request_id!r}); "
                    "reserve more first"
                )
            req.seq_len = n

    # ------------------------------------------------------------------ prefix cache
    def cached_prefix_pages(self, digests: Sequence[bytes]) -> int:
        """How many leading pages of ``digests`` the cache holds (a lookup; nothing is taken)."""
        with self._lock:
            return len(self.blocks.match(digests))

    def reserve_with_prefix(self, request_id: str, digests: Sequence[bytes], num_tokens: int) -> int:
        """Create ``request_id`` holding pages for ``num_tokens`` tokens, its first pages the
        cached ones of the longest cached prefix among ``digests`` (shared, not copied), the
        rest new; its ``seq_len`` is the tokens of the shared pages, which it returns.
        All-or-nothing as ``reserve``: ``PoolExhausted`` leaves the pool as it was.
        ``ValueError`` if the request exists or the digests cover more than ``num_tokens``."""
        check_int("num_tokens", num_tokens, minimum=0)
        if len(digests) * self.page_size > num_tokens:
            raise ValueError(f"digests: {len(digests)} pages of {self.page_size} tokens are more than "
                             f"num_tokens ({num_tokens})")
        with self._lock:
            if request_id in self._requests:
                raise ValueError(f"request_id: {request_id!r} already holds pages in this pool")
            shared = self.blocks.match(digests)
            need = self.pages_for(num_tokens) - len(shared)
            # shared pages no one holds are evictable: taking them leaves that many fewer to take
            reclaim = sum(1 for p in shared if p in self.blocks.evictable)
            if need > self.free_pages - reclaim:
                raise PoolExhausted(need, self.free_pages - reclaim, request_id)
            self.blocks.hold(shared)
            self._requests[request_id] = _Request(pages=shared + self.blocks.take(need), seq_len=len(shared) * self.page_size)
            return len(shared) * self.page_size

    def cache_prefix(self, request_id: str, digests: Sequence[bytes]) -> int:
        """Register ``request_id``'s first ``len(digests)`` pages (written: within its
        ``seq_len``) under ``digests``; a digest already cached keeps its page. Returns how many
        pages were newly cached."""
        with self._lock:
            req = self._get(request_id)
            if len(digests) * self.page_size > req.seq_len:
                raise ValueError(f"digests: {len(digests)} pages of {self.page_size} tokens are more than the "
                                 f"{req.seq_len} tokens written for {request_id!r}")
            return self.blocks.register(req.pages, digests)

    def clear_prefix_cache(self) -> int:
        """Forget every cached prefix (pages held by requests stay theirs); returns how many."""
        with self._lock:
            return self.blocks.clear_cache()

    def stats(self) -> dict:
        with self._lock:
            return {
                "num_pages": self.num_pages,
                "free_pages": self.free_pages,
                "used_pages": self.used_pages,
                "requests": len(self._requests),
                "cached_pages": len(self.blocks.cache),
                "evictable_pages": len(self.blocks.evictable),
                "page_size": self.page_size,
            }
