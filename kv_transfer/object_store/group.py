"""The object store between TP groups (docs/ARCHITECTURE.md "Tensor parallelism"): a TP prefill
replica ships one ordinary frame merged from every rank's KV heads (``merge_frames``), so
decode replicas of any TP receive it; a TP decode replica fetches an ordinary frame, verifies
it whole, splits it by KV head over its ranks (``split_frame``) and adopts on every rank at
once, all or nothing. The followers' parts run as :class:`FrameRankEnd`.
"""

from __future__ import annotations

import asyncio
from typing import Any

from kv_cache.heads import HeadLayout

from ..faults import corrupt_frame, maybe_corrupt
from ..frame import frame_ticket
from ..group import RankEnd, RankGroup, rank_failed
from ..spec import RankContext
from ..tp_transfer import adopt_rank_frame, export_rank, merge_frames, settle, split_frame
from .transport import ObjectStoreTransport

_SEND = RankEnd("object_store", "send")
_RECEIVE = RankEnd("object_store", "receive")


def rank_frame(pool: Any, request_id: str, layout: HeadLayout, rank: int):
    """Rank ``rank``'s frame of ``request_id`` for a single decode rank."""
    dst = HeadLayout(layout.num_q_heads, layout.num_kv_heads, 1)
    return export_rank(pool, request_id, layout, dst, rank)[0]


class FrameRankEnd:
    """A follower rank's part: its frame of a request (prefill), its split of one (decode)."""

    def __init__(self, context: RankContext) -> None:
        self.context = context

    def export_frame(self, request_id: str) -> Any:
        c = self.context
        return rank_frame(c.pool, request_id, c.layout, c.rank)

    def adopt_frame(self, request_id: str, frame: Any) -> Any:
        """Verify and adopt this rank's split; returns the ``TransferError`` (the leader
        tallies every rank's outcome) or None. Nothing stays allocated here on a failure."""
        c = self.context
        return adopt_rank_frame(c.pool, frame, c.layout, c.rank, request_id)

    def counters(self) -> dict[str, int]:
        return {}


class TPObjectStoreTransport(ObjectStoreTransport):
    """An object-store sender whose frames hold every rank's heads: a TP prefill replica feeds
    TP=1 decode replicas unchanged (they receive ordinary frames)."""

    def __init__(self, group: RankGroup, fetch_timeout_s: float) -> None:
        super().__init__(fetch_timeout_s=fetch_timeout_s)
        self.group = group

    def export(self, pool, request_id, *, fault=None):
        import ray

        g = self.group
        handles = [g.submit(r, _SEND, "export_frame", request_id) for r in range(1, g.size)]
        frames = {0: rank_frame(g.pool, request_id, g.layout, 0)}
        try:
            frames.update({r: f for r, f in enumerate(g.results(handles, g.timeout_s), start=1)})
        except Exception as exc:  # noqa: BLE001 - a dead rank: the replica is broken
            raise rank_failed(None, f"export of {request_id!r}", exc) from None
        frame = maybe_corrupt(merge_frames(frames, g.layout), fault)
        return frame_ticket(self.name, g.pool, request_id, frame, [ray.put(frame)])


def group_exporter(group: RankGroup, fetch_timeout_s: float) -> TPObjectStoreTransport:
    return TPObjectStoreTransport(group, fetch_timeout_s)


class TPObjectStoreReceiver(ObjectStoreTransport):
    """The object-store receiver of a TP decode replica: fetch the ordinary frame (as TP=1),
    verify it and split it by KV head over the ranks, adopt on every rank at once (the leader
    here, each follower its :meth:`FrameRankEnd.adopt_frame`), then settle all or nothing: a
    failure on any rank releases the request on every rank and raises that rank's
    ``TransferError`` (the ingress prefills again when it is retryable). A follower that does
    not answer is ``RankFailed`` (reported to the group: the replica ends). ``fault_mode`` /
    ``faults``: damage the last rank's split frame of the first ``faults`` transfers (drills)."""

    def __init__(self, group: RankGroup, fetch_timeout_s: float, *, fault_mode: str | None = None,
                 faults: int = 0) -> None:
        super().__init__(fetch_timeout_s=fetch_timeout_s)
        self.group = group
        self.fault_mode = fault_mode
        self.faults_left = faults if fault_mode in ObjectStoreTransport.fault_modes else 0

    async def receive(self, ticket, pool):
        frame = await self.fetch(ticket)
        return await asyncio.to_thread(self.adopt, ticket.request_id, frame)

    def adopt(self, request_id: str, frame: Any) -> list[int]:
        g = self.group
        frames = split_frame(frame, g.layout, request_id=request_id)
        if self.faults_left > 0:
            self.faults_left -= 1
            last = g.size - 1
            frames[last] = corrupt_frame(frames[last], self.fault_mode)
        handles = [g.submit(r, _RECEIVE, "adopt_frame", request_id, frames[r]) for r in range(1, g.size)]
        try:
            outcomes = [adopt_rank_frame(g.pool, frames[0], g.layout, 0, request_id)]
        except BaseException:  # not a transfer failure (a bug): nothing may stay on any rank
            g.wait(handles, g.timeout_s)
            g.release(request_id)
            raise
        try:
            outcomes += g.results(handles, g.timeout_s)
        except Exception as exc:  # noqa: BLE001 - a dead rank: the replica is broken
            failed = rank_failed(None, f"receive of {request_id!r}", exc)
            g.report_failure(failed)
            raise failed from None
        settle(outcomes, lambda: g.release(request_id))  # release: every rank, in lockstep
        return g.pool.pages(request_id)


def group_receiver(group: RankGroup, fetch_timeout_s: float, *, fault_mode: str | None = None,
                   faults: int = 0) -> TPObjectStoreReceiver:
    return TPObjectStoreReceiver(group, fetch_timeout_s, fault_mode=fault_mode, faults=faults)


__all__ = ["FrameRankEnd", "TPObjectStoreReceiver", "TPObjectStoreTransport", "group_exporter", "group_receiver",
           "rank_frame"]
