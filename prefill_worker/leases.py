"""Page leases of a prefill replica: state with a deadline, swept by a timer.

A prompt's pages stay in the prefill replica's pool after its ``prefill`` call has returned
when the transport reads them later, from this pool (a channel sends them when the decode
replica asks; CUDA IPC lets the decode replica copy them in place). The replica then holds a
:class:`Lease` for the request: the ticket, the exporter that made it, and a deadline. A lease
ends, and the pages are freed, at the first of

- ``sent``: the channel sends of the pages finished (:meth:`LeaseTable.sent`): the first one
  that failed (a failed transfer is retried with a new prefill, never by sending these pages
  again), or the last of the ``pulls`` the receiver announced (one per (prefill rank, decode
  rank) route: a TP decode group's ranks each pull their own heads, from every prefill rank
  holding some; 1 for a whole-replica pull);
- ``released``: the decode replica is done with them (its IPC copy finished or failed, or it
  gave up before fetching), or the ingress gave up on the attempt;
- ``expired``: the deadline passed (a decode replica or ingress that died), found by the sweep.

No call is held open for a lease, so leases take no ``max_ongoing_requests`` slot and do not
feed the autoscaler's ongoing-request count.

The object store copies the pages into a frame at export: its pages are freed when ``prefill``
returns, but the replica keeps its reference to the frame under a lease that holds no pages
(``Lease.holds_pages`` False), ended the same ways (the decode replica releases it right after
its fetch). See ``kv_transfer.transfer.ObjectStoreTransport`` for why.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger("ray.serve")

END_REASONS = ("sent", "released", "expired", "stopped")


@dataclass
class Lease:
    request_id: str
    ticket: Any
    exporter: Any
    granted_at: float
    deadline: float
    sends: int = 0  # channel sends of the pages that succeeded so far
    holds_pages: bool = True  # False: only the ticket (a frame's reference), the pages are freed


class LeaseTable:
    """The leases of one replica (touched from its event loop only).

    ``on_end(lease, reason)`` frees what a lease holds; it is called exactly once per lease.
    ``clock`` is monotonic seconds (injectable for tests).
    """

    def __init__(self, timeout_s: float, on_end: Callable[[Lease, str], None], *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not timeout_s > 0:
            raise ValueError(f"timeout_s: expected a positive number of seconds, got {timeout_s!r}")
        self.timeout_s = float(timeout_s)
        self._on_end = on_end
        self._clock = clock
        self._leases: dict[str, Lease] = {}
        self.ended = dict.fromkeys(END_REASONS, 0)
        self._task: asyncio.Task | None = None

    def __len__(self) -> int:
        return len(self._leases)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._leases

    def grant(self, request_id: str, ticket: Any, exporter: Any, *, holds_pages: bool = True) -> Lease:
        if request_id in self._leases:
            raise ValueError(f"request_id: {request_id!r} already holds a lease")
        now = self._clock()
        lease = Lease(request_id, ticket, exporter, now, now + self.timeout_s, holds_pages=bool(holds_pages))
        self._leases[request_id] = lease
        return lease

    def holds_pages(self, request_id: str) -> bool:
        """Whether ``request_id``'s lease holds its pages (KeyError: it holds no lease)."""
        return self._leases[request_id].holds_pages

    def end(self, request_id: str, reason: str) -> bool:
        """End ``request_id``'s lease, if it holds one; False if it holds none (already ended)."""
        if reason not in END_REASONS:
            raise ValueError(f"reason: expected one of {END_REASONS}, got {reason!r}")
        lease = self._leases.pop(request_id, None)
        if lease is None:
            return False
        self.ended[reason] += 1
        try:
            self._on_end(lease, reason)
        except Exception:  # noqa: BLE001 - one lease's cleanup never stops the others'
            logger.exception("ending the lease of %s (%s) failed", request_id, reason)
        return True

    def sent(self, request_id: str, ok: bool, pulls: int = 1) -> bool:
        """A channel send of ``request_id``'s pages finished. ``pulls``: how many sends the
        receiving replica makes for the request in all (a send request's ``pulls``). The lease
        ends (``sent``) at the first failed send, or when ``pulls`` sends have succeeded; never
        earlier, so every decode rank of a group gets its heads. Returns whether it ended now
        (False: it goes on, or there was none)."""
        if isinstance(pulls, bool) or not isinstance(pulls, int) or pulls < 1:
            raise ValueError(f"pulls: expected an int >= 1, got {pulls!r}")
        lease = self._leases.get(request_id)
        if lease is None:
            return False
        if ok:
            lease.sends += 1
            if lease.sends < pulls:
                return False
        return self.end(request_id, "sent")

    def sweep(self) -> list[str]:
        """End every lease past its deadline; returns their request ids, oldest first."""
        now = self._clock()
        expired = [rid for rid, lease in self._leases.items() if lease.deadline <= now]
        for rid in expired:
            lease = self._leases[rid]
            logger.warning("prefill lease of %s expired after %.1fs; releasing its pages", rid, now - lease.granted_at)
            self.end(rid, "expired")
        return expired

    def end_all(self, reason: str = "stopped") -> int:
        ids = list(self._leases)
        for rid in ids:
            self.end(rid, reason)
        return len(ids)

    # -- the timer ---------------------------------------------------------------------
    @property
    def sweep_interval_s(self) -> float:
        return min(1.0, self.timeout_s / 4)

    def start(self) -> None:
        """Start the sweep timer on the running event loop (idempotent)."""
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run(), name="lease-sweep")

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.sweep_interval_s)
            self.sweep()

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None
