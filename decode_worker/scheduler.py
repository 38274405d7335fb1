"""DecodeScheduler: the one decode scheduler of a replica (no model, no Ray, no event loop).

It decides three things, in one place, over the replica's KV pool:

Admission to the replica (``claim`` / ``settle``)
    A request about to be adopted claims the pages its adoption takes (``adoption_pages``: its
    K/V as shipped, plus a copy of the partial last page for each extra choice of a group). It
    is admitted when they fit in the free pages next to the other claims still in flight and a
    *watermark* of free pages kept back for running sequences' growth; a request alone in the
    replica is admitted whenever the pool holds it. Its growth is not reserved up front: a chat
    whose ``max_tokens`` defaults to "until the context ends" claims its prompt's pages, not its
    whole context's. Once adopted (``settle``) the pool itself counts its pages.
Admission to the running batch (``schedule``)
    Adopted requests wait in arrival order; each step the oldest join the batch while it has
    fewer than ``max_running`` and the free pages (less the claims in flight) stay at or above
    the watermark, or when nothing runs. No overtaking: a waiting request holds back those
    behind it.
The page budget and preemption (``schedule``)
    Pages grow as tokens are generated: before each step every running sequence gets the page
    its next token needs (``ensure_capacity``). When the pool has none, the newest sequence
    holding pages (waiting or running, latest arrival first; it may be the one that asked) is
    preempted: it leaves the scheduler, its pages go back, and the engine ends it with
    ``kv_exhausted``. The replica cannot rebuild a freed sequence (it holds the prompt's K/V, not
    its tokens): the ingress recomputes it through its resume path (``router/pipeline.py``).

Thread use: ``claim`` / ``settle`` / ``leave`` run on the replica's event loop while a step
(``schedule``) may run in a worker thread; the claims sit behind a lock, the queues are only
touched by the engine (one step at a time).
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable
from typing import Any

# The share of the pool kept free for running sequences' growth (vLLM keeps 1% of its blocks).
WATERMARK_FRACTION = 0.01


def _check_int(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name}: expected an int >= {minimum}, got {value!r}")
    return value


def default_watermark(num_pages: int) -> int:
    """``WATERMARK_FRACTION`` of ``num_pages``, at least one page (none in a one-page pool)."""
    return min(max(1, int(num_pages * WATERMARK_FRACTION)), num_pages - 1)


class DecodeScheduler:
    """See the module doc.

    pool: the replica's pages (``num_pages``, ``page_size``, ``free_pages``, ``has``, ``pages``,
        ``seq_len``, ``reserve``, ``release``: a ``KVPool`` or a ``PageManager``).
    max_running: sequences decoded per step.
    watermark_pages: free pages kept for growth (default ``default_watermark``).
    ensure_capacity: ``(request_id, num_tokens)`` -> None, reserves pages for ``num_tokens``
        tokens or raises ``PoolExhausted`` (default ``pool.reserve`` when the request holds
        fewer; a TP replica passes its lockstep runner's, which reserves on every rank).
    """

    def __init__(self, pool: Any, *, max_running: int = 256, watermark_pages: int | None = None,
                 ensure_capacity: Callable[[str, int], None] | None = None) -> None:
        _check_int("max_running", max_running, 1)
        if watermark_pages is None:
            watermark_pages = default_watermark(int(pool.num_pages))
        _check_int("watermark_pages", watermark_pages, 0)
        if watermark_pages >= pool.num_pages:
            raise ValueError(f"watermark_pages: expected fewer than the pool's {pool.num_pages} pages, "
                             f"got {watermark_pages}")
        if ensure_capacity is not None and not callable(ensure_capacity):
            raise ValueError(f"ensure_capacity: expected a callable, got {ensure_capacity!r}")
        self.pool = pool
        self.page_size = int(pool.page_size)
        self.max_running = max_running
        self.watermark_pages = watermark_pages
        self._ensure = ensure_capacity or self._reserve
        self._lock = threading.Lock()
        self._claims: dict[str, int] = {}  # request -> pages claimed for its adoption, not yet adopted
        self._claimed = 0
        self._order = itertools.count()
        self._arrival: dict[str, int] = {}  # every sequence in the queues -> its arrival number
        self._waiting: list[str] = []  # adopted, in arrival order
        self._running: list[str] = []  # in admission (= arrival) order
        self.preempted = 0  # sequences preempted so far

    # -- admission to the replica ------------------------------------------------------
    def adoption_pages(self, kv_len: int, num_choices: int = 1) -> int:
        """Pages a request of ``kv_len`` tokens of K/V takes when adopted: its pages, plus a copy
        of the partial last page for every choice after the first (``KVPool.fork``)."""
        _check_int("kv_len", kv_len, 1)
        _check_int("num_choices", num_choices, 1)
        partial = 1 if kv_len % self.page_size else 0
        return -(-kv_len // self.page_size) + partial * (num_choices - 1)

    @property
    def claimed_pages(self) -> int:
        """Pages claimed by requests whose adoption is in flight."""
        return self._claimed

    @property
    def room_pages(self) -> int:
        """Free pages a new claim may take now: free, less the claims in flight and the watermark."""
        return max(0, self.pool.free_pages - self._claimed - self.watermark_pages)

    def fits_ever(self, pages: int) -> bool:
        return pages <= self.pool.num_pages

    def claim(self, request_id: str, pages: int) -> bool:
        """Claim ``pages`` for ``request_id``'s adoption if they fit now (see the module doc);
        False leaves nothing claimed."""
        if not isinstance(request_id, str):
            raise ValueError(f"request_id: expected a str, got {request_id!r}")
        _check_int("pages", pages, 0)
        with self._lock:
            if request_id in self._claims or request_id in self._arrival:
                raise ValueError(f"request_id: {request_id!r} is already admitted")
            free = self.pool.free_pages - self._claimed
            alone = not self._claims and not self._arrival
            if pages <= free - self.watermark_pages or (alone and pages <= free):
                self._claims[request_id] = pages
                self._claimed += pages
                return True
            return False

    def settle(self, request_id: str) -> None:
        """``request_id``'s claim ends: adopted (the pool counts its pages now) or given up.
        Unknown ids are ignored (a claim settles once)."""
        with self._lock:
            self._claimed -= self._claims.pop(request_id, 0)

    # -- the queues --------------------------------------------------------------------
    def add(self, request_id: str) -> None:
        """An adopted sequence (it holds its pages in the pool) waits to run."""
        if request_id in self._arrival:
            raise ValueError(f"request_id: {request_id!r} is already scheduled")
        if not self.pool.has(request_id):
            raise ValueError(f"request_id: {request_id!r} holds no pages in the pool")
        self._arrival[request_id] = next(self._order)
        self._waiting.append(request_id)

    def finish(self, request_id: str) -> bool:
        """``request_id`` ended (finished, cancelled, failed): out of the queues, its pages back
        to the pool. False if it held none and was not scheduled."""
        known = self._arrival.pop(request_id, None) is not None
        for queue in (self._waiting, self._running):
            if request_id in queue:
                queue.remove(request_id)
        if self.pool.has(request_id):
            self.pool.release(request_id)
            return True
        return known

    @property
    def waiting(self) -> list[str]:
        return list(self._waiting)

    @property
    def running(self) -> list[str]:
        return list(self._running)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._arrival

    def has_unfinished(self) -> bool:
        return bool(self._waiting or self._running)

    # -- one step ----------------------------------------------------------------------
    def _reserve(self, request_id: str, num_tokens: int) -> None:
        if len(self.pool.pages(request_id)) * self.page_size < num_tokens:
            self.pool.reserve(request_id, num_tokens)

    def _needs_page(self, request_id: str) -> int:
        return int(self.pool.seq_len(request_id) + 1 > len(self.pool.pages(request_id)) * self.page_size)

    def _admit(self) -> None:
        while self._waiting and len(self._running) < self.max_running:
            rid = self._waiting[0]
            spare = self.pool.free_pages - self._claimed - self._needs_page(rid)
            if self._running and spare < self.watermark_pages:
                break
            self._waiting.pop(0)
            self._running.append(rid)

    def _victim(self) -> str:
        """The newest sequence holding pages: the last waiting one, else the last running one."""
        return self._waiting[-1] if self._waiting else self._running[-1]

    def schedule(self) -> tuple[list[str], list[str]]:
        """The next step: ``(batch, preempted)``. ``batch``: the running sequences, each holding
        a page for its next token; ``preempted``: sequences taken out (pages released) to make
        room, newest first; the caller ends them."""
        from kv_cache import PoolExhausted

        self._admit()
        preempted: list[str] = []
        for rid in list(self._running):
            while rid in self._running:
                try:
                    self._ensure(rid, self.pool.seq_len(rid) + 1)
                    break
                except PoolExhausted:
                    victim = self._victim()
                    self.finish(victim)
                    self.preempted += 1
                    preempted.append(victim)
        return list(self._running), preempted


__all__ = ["WATERMARK_FRACTION", "DecodeScheduler", "default_watermark"]
