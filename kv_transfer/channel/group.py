"""Channels between TP groups (docs/ARCHITECTURE.md "Tensor parallelism"): every rank moves its
own KV heads over its own pairwise channel, so pages go from each prefill rank's device straight
to each decode rank's, with no gather to a leader.

- prefill: :class:`TPChannelTransport` (the leader's sender, relaying receivers' send requests
  to the followers) over each follower's :class:`RankChannel`;
- decode: :class:`TPChannelReceiver`, every rank pulling its own heads at once
  (``ChannelReceiver.receive_heads``; each follower's :class:`RankReceiver`), settled all or
  nothing by :func:`receive_group`.

The followers run in other processes: the leader reaches them through its
``kv_transfer.group.RankGroup`` (``serving.tp_group`` over Ray), which builds their ends from
this transport's spec (:func:`rank_end`) at their first call. Each decode rank ``r`` receives
as ``<replica>:tp<r>`` and hosts its own store, so every (prefill rank, decode rank) pair has
its own channel, store prefix and generations.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import threading
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from kv_cache.heads import HeadLayout
from kv_cache.pool import KVPool

from ..errors import TransferError, TransferFailure
from ..group import RankEnd, RankGroup, rank_failed
from ..header import KVFrameHeader
from ..interfaces import KVReceiver, KVSender, TransferTicket
from ..spec import BuildContext, RankContext
from ..wire import SendPages, SendReply
from .config import ChannelConfig

RANK_CALL_TIMEOUT_S = 30.0  # a follower's export or discard (no data moves: bookkeeping only)


class TPChannelTransport(KVSender):
    """The channel transport of a TP prefill group (sender side): every rank ships its own KV
    heads over its own channel to the receiving replica (one pairwise channel per (prefill
    rank, decode replica) pair), so pages go from each rank's device straight to the decode
    device, with no gather to the leader and no extra copy.

    ``export`` (leader, after prefill) has every rank record its pages (``ChannelSender.export``:
    no copy; the follower ranks through ``followers``) and returns one ticket: the whole
    request's header, the leader's Serve identity (where the receiver's send requests go) and
    ``tp``: the group's head layout and each rank's header (its heads, its FP8 scales). The
    receiver (``ChannelReceiver.receive_heads``) computes which heads it needs from which rank
    (``transfer_routes``), reserves its pages once, and asks the ranks one after the other
    (``serve_send`` with ``rank`` and ``heads``: the leader relays to the rank). All or nothing:
    a failure on any rank fails the receive, which releases its pages; the lease (one per
    request, on the leader: prefill_worker/leases.py) ends once every route's send has
    succeeded (the receiver's ``pulls``; a rank may send to several decode ranks, so a rank
    keeps its export across sends), at the first failed send, or on release / expiry, and
    ending it discards the export on every rank *before* the pages are freed (``discard``
    waits for the followers).

    ``followers``: one object per rank ``1..N-1`` with ``export(request_id, fault) -> header
    bytes`` (blocking), ``async send(request) -> reply`` and ``discard(request_id)`` (blocking).
    ``fault`` (drills, tests) is injected on the last rank only: one rank failing must fail the
    whole transfer."""

    fault_modes = ("flip", "break")
    reads_pages_after_export = True
    serves_sends = True

    def __init__(self, leader: Any, layout: HeadLayout, followers: Sequence[Any], *, identity: dict,
                 host: str) -> None:
        if len(followers) != layout.tp_size - 1:
            raise ValueError(f"followers: expected {layout.tp_size - 1} (ranks 1..{layout.tp_size - 1}), got "
                             f"{len(followers)}")
        self.leader = leader
        self.layout = layout
        self.followers = list(followers)
        self.identity = dict(identity)
        self.host = host
        self.name = leader.name

    @staticmethod
    def rank_identity(replica_id: str, rank: int) -> dict:
        """The channel identity of rank ``rank`` of the replica ``replica_id``."""
        return {"replica_id": f"{replica_id}:tp{rank}"}

    def export(self, pool: KVPool, request_id: str, *, fault: str | None = None) -> Any:
        if fault is not None and fault not in self.fault_modes:
            raise ValueError(f"fault: channels inject one of {self.fault_modes}, got {fault!r}")
        last = self.layout.tp_size - 1
        ticket0 = self.leader.export(pool, request_id, fault=fault if last == 0 else None)
        headers = [ticket0.handle["header"]]
        try:
            for rank, follower in enumerate(self.followers, start=1):
                headers.append(follower.export(request_id, fault if rank == last else None))
        except BaseException:
            self._discard_ranks(request_id, len(headers))
            raise
        first = KVFrameHeader.decode(headers[0])
        per_head = first.payload_bytes // first.num_kv_heads
        whole = dataclasses.replace(first, num_kv_heads=self.layout.num_kv_heads,
                                    payload_bytes=per_head * self.layout.num_kv_heads, k_scale=None, v_scale=None)
        handle = {"header": whole.encode(), "sender": {**self.identity, "host": self.host},
                  "tp": {"num_q_heads": self.layout.num_q_heads, "num_kv_heads": self.layout.num_kv_heads,
                         "tp_size": self.layout.tp_size, "ranks": headers}}
        return TransferTicket(request_id, self.name, whole.num_tokens, whole.num_pages, whole.payload_bytes, handle)

    def _discard_ranks(self, request_id: str, count: int) -> None:
        self.leader.discard(TransferTicket(request_id, self.name, 0, 0, 0))
        for follower in self.followers[:max(count - 1, 0)]:
            try:
                follower.discard(request_id)
            except Exception:  # noqa: BLE001 - a dead rank ends the replica anyway
                pass

    def discard(self, ticket: Any) -> None:
        """The lease ended: every rank forgets the export (a send under way fails) before the
        caller frees the pages."""
        self._discard_ranks(ticket.request_id, self.layout.tp_size)

    async def serve_send(self, request: SendPages) -> SendReply:
        """A receiver's send request for one rank (``request.rank``): the leader sends its
        own heads, a follower's request is relayed to it."""
        rank = request.rank if isinstance(request, SendPages) else None
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.layout.tp_size:
            return SendReply(False, TransferFailure.UNAVAILABLE.value,
                             f"rank: expected a rank of this TP group in [0, {self.layout.tp_size}), got {rank!r}")
        if rank == 0:
            return await self.leader.serve_send(request)
        try:
            return await self.followers[rank - 1].send(request)
        except Exception as exc:  # noqa: BLE001 - a dead or unreachable rank
            return SendReply(False, TransferFailure.LOST.value, f"TP rank {rank}: {type(exc).__name__}: {str(exc)[:300]}")

    def counters(self) -> dict[str, int]:
        return self.leader.counters()

    def close(self) -> None:
        self.leader.close()


class RankChannel:
    """A follower rank's side of :class:`TPChannelTransport` over its own ``ChannelSender``
    and pool, in the rank's process (a TP rank actor's methods call it; tests use it in
    process)."""

    def __init__(self, transport: Any, pool: KVPool) -> None:
        self.transport, self.pool = transport, pool

    def export(self, request_id: str, fault: str | None = None) -> bytes:
        return self.transport.export(self.pool, request_id, fault=fault).handle["header"]

    def send_blocking(self, request: SendPages) -> SendReply:
        return self.transport.serve_send_blocking(request)

    async def send(self, request: SendPages) -> SendReply:
        return await self.transport.serve_send(request)

    def discard(self, request_id: str) -> None:
        self.transport.discard(TransferTicket(request_id, self.transport.name, 0, 0, 0))

    def counters(self) -> dict[str, int]:
        return self.transport.counters()



async def receive_group(receives: Sequence[Awaitable[Any]], release: Callable[[], Any]) -> None:
    """Driver of a decode group's channel receive (``ChannelReceiver.receive_heads`` on every
    rank at once, each pulling its own heads): waits for *every* rank's receive, then settles
    all or nothing. If any failed, ``release()`` (every rank lets the request's pages go; it
    may return an awaitable) runs once no rank can still take or write pages, and the
    lowest-numbered rank's ``TransferError`` is raised (retryable as its reason is); any other
    exception (a dead rank, a bug) is raised after the release the same way, the
    TransferErrors of other ranks aside. A rank's awaitable may also *return* its
    ``TransferError`` (a follower whose outcome comes back as a value). Cancelled (the
    request went away mid-transfer): the ranks' receives go on to their end in the background
    (each is bounded by its channel's deadlines), then ``release()`` runs, so no rank keeps
    the pages."""
    gathered = asyncio.gather(*receives, return_exceptions=True)
    try:
        outcomes = await asyncio.shield(gathered)
    except asyncio.CancelledError:
        task = asyncio.ensure_future(_release_after(gathered, release))
        _BACKGROUND.add(task)
        task.add_done_callback(_BACKGROUND.discard)
        raise
    errors = [o if isinstance(o, BaseException) else None for o in outcomes]  # raised or returned
    failed = next((e for e in errors if e is not None and not isinstance(e, TransferError)), None)
    failed = failed or next((e for e in errors if e is not None), None)
    if failed is None:
        return
    await _release(release)
    raise failed


_BACKGROUND: set = set()  # receive_group's releases after a cancelled receive


async def _release(release: Callable[[], Any]) -> None:
    out = release()
    if inspect.isawaitable(out):
        await out


async def _release_after(gathered: Any, release: Callable[[], Any]) -> None:
    await asyncio.wait({gathered})
    try:
        await _release(release)
    except Exception:  # noqa: BLE001 - nobody is left to tell; a dead rank ends its replica anyway
        import logging

        logging.getLogger(__name__).exception("releasing the pages of a cancelled group receive failed")


class _FollowerChannel:
    """The leader's handle on a follower's :class:`RankChannel` (``TPChannelTransport``'s
    ``followers``), through the group."""

    def __init__(self, group: RankGroup, rank: int, end: RankEnd) -> None:
        self.group, self.rank, self.end = group, rank, end

    def export(self, request_id: str, fault: str | None = None) -> bytes:
        g = self.group
        try:
            return g.results([g.submit(self.rank, self.end, "export", request_id, fault)], RANK_CALL_TIMEOUT_S)[0]
        except Exception as exc:  # noqa: BLE001 - a dead rank: the replica is broken
            raise rank_failed(self.rank, f"channel export of {request_id!r}", exc) from None

    async def send(self, request: Any) -> Any:  # SendPages -> SendReply
        return await self.group.result(self.group.submit(self.rank, self.end, "send_blocking", request))

    def discard(self, request_id: str) -> None:
        g = self.group
        g.results([g.submit(self.rank, self.end, "discard", request_id)], RANK_CALL_TIMEOUT_S)


def _setup(context: BuildContext, rank: int, **extra: Any) -> dict:
    """What follower ``rank`` builds its channel end from (plain data: it travels to the rank)."""
    section = context.section("channel")
    return {"host": context.host, "identity": TPChannelTransport.rank_identity(context.identity["replica_id"], rank),
            "channel": section, **extra}


def _end_args(setup: dict) -> dict:
    section = dict(setup.get("channel") or {})
    max_workers = section.pop("max_workers", 8)
    return {"host": setup["host"], "identity": setup["identity"], "config": ChannelConfig(**section),
            "max_workers": max_workers}


def group_sender(context: BuildContext) -> TPChannelTransport:
    """The channel sender (``nccl`` on CUDA, ``gloo`` on CPU) of a TP prefill replica: every
    rank sends its own heads over its own channel. ``context.identity``: the leader's Serve
    identity (where receivers send their requests)."""
    from .send import ChannelSender

    g = context.group
    leader = ChannelSender(g.pool.device, **_end_args(_setup(context, 0)))
    followers = [_FollowerChannel(g, rank, RankEnd(leader.name, "send", _setup(context, rank)))
                 for rank in range(1, g.size)]
    return TPChannelTransport(leader, g.layout, followers, identity=context.identity, host=context.host)


class RankReceiver:
    """A follower decode rank's end: pulls its own KV heads of a ticket's request from the
    prefill ranks holding them, on an event loop of its own (the rank's calls are threaded
    and blocking)."""

    def __init__(self, context: RankContext) -> None:
        from .recv import ChannelReceiver

        self.context = context
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, name="kv-rank-receive", daemon=True).start()
        self.transport = ChannelReceiver(context.pool.device, call_sender=context.setup["make_caller"](),
                                         **_end_args(dict(context.setup)))

    def receive(self, ticket: Any) -> TransferError | None:
        """The rank's receive; returns the ``TransferError`` (the leader settles every rank's
        outcome) or None. On a failure nothing stays allocated here."""
        c = self.context
        future = asyncio.run_coroutine_threadsafe(
            self.transport.receive_heads(ticket, c.pool, dst_layout=c.layout, dst_rank=c.rank), self.loop)
        try:
            future.result()
        except TransferError as exc:
            return exc
        return None

    def counters(self) -> dict[str, int]:
        return self.transport.counters()


class TPChannelReceiver(KVReceiver):
    """The channel receiver (``gloo`` on CPU, ``nccl`` on CUDA) of a TP decode replica: every
    rank pulls its own heads at once (rank 0 here, the followers' :class:`RankReceiver`), then
    the group settles all or nothing (:func:`receive_group`): any rank failing releases the
    request on every rank and raises that rank's retryable ``TransferError`` (the replica
    answers ``TransferFailed`` with ``fallback: object_store``). A follower that does not
    answer is ``RankFailed`` (reported to the group: the replica ends)."""

    def __init__(self, group: RankGroup, leader: Any, ends: Sequence[RankEnd]) -> None:
        self.group, self.leader, self.ends = group, leader, list(ends)
        self.name = leader.name

    async def receive(self, ticket, pool):
        g = self.group
        rid = getattr(ticket, "request_id", None)
        handles = [g.submit(rank, end, "receive", ticket) for rank, end in enumerate(self.ends, start=1)]

        async def follower(rank: int, handle: Any) -> Any:
            try:
                return await g.result(handle, g.timeout_s)
            except Exception as exc:  # noqa: BLE001 - a dead rank: the replica is broken
                failed = rank_failed(rank, f"channel receive of {rid!r}", exc)
                g.report_failure(failed)
                raise failed from None

        receives = [self.leader.receive_heads(ticket, g.pool, dst_layout=g.layout, dst_rank=0)]
        receives += [follower(r, h) for r, h in enumerate(handles, start=1)]
        # release: every rank, in lockstep (blocking calls: off the event loop)
        await receive_group(receives, lambda: asyncio.to_thread(g.release, rid))
        return g.pool.pages(rid)

    def counters(self) -> dict[str, int]:
        return self.leader.counters()

    def close(self) -> None:
        self.leader.close()


def group_receiver(context: BuildContext) -> TPChannelReceiver:
    """The channel receiver of a TP decode replica (``context.make_caller()``: how a rank
    reaches the prefill replica holding the pages; each follower makes its own, once)."""
    from .recv import ChannelReceiver

    g = context.group
    leader = ChannelReceiver(g.pool.device, call_sender=context.make_caller(), **_end_args(_setup(context, 0)))
    ends = [RankEnd(leader.name, "receive", _setup(context, rank, make_caller=context.make_caller))
            for rank in range(1, g.size)]
    return TPChannelReceiver(g, leader, ends)


def rank_end(role: str, context: RankContext) -> Any:
    """A follower rank's end: its :class:`RankChannel` (``"send"``) or :class:`RankReceiver`."""
    if role == "send":
        from .send import ChannelSender

        return RankChannel(ChannelSender(context.pool.device, **_end_args(dict(context.setup))), context.pool)
    if role == "receive":
        return RankReceiver(context)
    raise ValueError(f"role: expected 'send' or 'receive', got {role!r}")
