"""Admission at the ingress: how many generation requests one ingress replica runs at once.

At most ``ingress.max_inflight`` run; up to ``ingress.max_queued`` more wait here, in arrival
order; one past that is refused at once with 429 ``overloaded`` and ``Retry-After`` (gRPC
``RESOURCE_EXHAUSTED`` with the ``retry-after`` trailer). A request counts its prompts (a list
of prompts runs one prefill call and one decode stream per prompt at a time).

Why a queue of our own: without it every request goes straight to the worker deployments'
handles, and once their replicas are at ``max_ongoing_requests`` Serve's router keeps
re-probing them for each waiting call (200 concurrent requests gave 1,376 "Failed to route
request" warnings). Here a waiting request costs a future in a deque, its wait is visible
(``flashprefill_ingress_queued_requests``), and the worker deployments are sized for this
bound (``router.app.worker_max_ongoing``), so Serve's router always finds a replica with room.

A :class:`Ticket` is what an admitted request holds; it gives its slots back once
(``release``), or, should a response be dropped before it ran (a stream whose body was never
iterated), when it is garbage-collected.
"""

from __future__ import annotations

import asyncio
import collections
import logging

from serving.errors import RequestError
from serving.metrics import Metrics

logger = logging.getLogger("ray.serve")


class Ticket:
    """The slots of one admitted request; :meth:`release` gives them back (idempotent)."""

    __slots__ = ("_admission", "weight", "_loop")

    def __init__(self, admission: "Admission", weight: int) -> None:
        self._admission: Admission | None = admission
        self.weight = weight
        self._loop = asyncio.get_running_loop()

    def release(self) -> None:
        admission, self._admission = self._admission, None
        if admission is not None:
            admission._release(self.weight)

    def __del__(self) -> None:  # the safety net: a response dropped before its body ran
        admission, self._admission = self._admission, None
        if admission is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(admission._release, self.weight)


class Admission:
    """A bounded, first-come first-served gate for one ingress replica (one event loop)."""

    def __init__(self, max_inflight: int, max_queued: int, *, retry_after_s: int,
                 metrics: Metrics | None = None) -> None:
        if not isinstance(max_inflight, int) or max_inflight < 1:
            raise ValueError(f"max_inflight: expected an int >= 1, got {max_inflight!r}")
        if not isinstance(max_queued, int) or max_queued < 0:
            raise ValueError(f"max_queued: expected an int >= 0, got {max_queued!r}")
        if not isinstance(retry_after_s, int) or retry_after_s < 0:
            raise ValueError(f"retry_after_s: expected an int >= 0, got {retry_after_s!r}")
        self.max_inflight = max_inflight
        self.max_queued = max_queued
        self.retry_after_s = retry_after_s
        self.metrics = metrics if metrics is not None else Metrics()
        self.running = 0  # slots held by admitted requests
        self.rejected = 0
        self._waiting: collections.deque[tuple[asyncio.Future, int]] = collections.deque()

    @property
    def queued(self) -> int:
        return len(self._waiting)

    def stats(self) -> dict:
        return {"running": self.running, "queued": self.queued, "rejected": self.rejected,
                "max_inflight": self.max_inflight, "max_queued": self.max_queued}

    async def acquire(self, weight: int = 1) -> Ticket:
        """Waits for ``weight`` slots (at most ``max_inflight``: a request larger than the bound
        runs alone); RequestError 429 when the queue is full."""
        if weight < 1:
            raise ValueError(f"weight: expected >= 1, got {weight}")
        weight = min(weight, self.max_inflight)
        if not self._waiting and self.running + weight <= self.max_inflight:
            self.running += weight
            self._report()
            return Ticket(self, weight)
        if len(self._waiting) >= self.max_queued:
            self.rejected += 1
            self.metrics.inc("ingress_rejected_requests_total")
            raise RequestError(
                f"ingress overloaded: {self.running} requests running (ingress.max_inflight {self.max_inflight}) "
                f"and {len(self._waiting)} waiting (ingress.max_queued {self.max_queued}); retry later",
                status=429, code="overloaded", retry_after_s=self.retry_after_s or 1)
        granted = asyncio.get_running_loop().create_future()
        entry = (granted, weight)
        self._waiting.append(entry)
        self._report()
        try:
            await granted
        except asyncio.CancelledError:
            if granted.done() and not granted.cancelled():  # granted, then the client left
                self._release(weight)
            else:
                try:
                    self._waiting.remove(entry)
                except ValueError:
                    pass
                self._grant()  # a larger request at the head may have blocked smaller ones
                self._report()
            raise
        return Ticket(self, weight)

    def _release(self, weight: int) -> None:
        self.running = max(self.running - weight, 0)
        self._grant()
        self._report()

    def _grant(self) -> None:
        """Admit waiting requests in arrival order while their slots fit."""
        while self._waiting:
            granted, weight = self._waiting[0]
            if granted.done():  # cancelled while waiting
                self._waiting.popleft()
                continue
            if self.running + weight > self.max_inflight:
                return
            self._waiting.popleft()
            self.running += weight
            granted.set_result(None)

    def _report(self) -> None:
        self.metrics.set("ingress_running_requests", self.running)
        self.metrics.set("ingress_queued_requests", len(self._waiting))
