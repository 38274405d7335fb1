"""The receiving end of channel transfers (a decode replica, or one rank of a TP decode
group): ``ChannelReceiver`` reserves a request's pages, asks the sender for them and lands
them chunk by chunk. The protocol, the failure handling ("Half-written pages") and the TP
variant are in ``kv_transfer.channel``'s docstring.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
import itertools
import logging
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any

import torch

from kv_cache.heads import HeadLayout
from kv_cache.pool import KVPool

from ..errors import TransferError, TransferFailure
from ..header import adopt_pages, check_geometry, _DTYPE_NAMES, KVFrameHeader, _U64
from ..interfaces import KVReceiver, TransferTicket
from ..routes import transfer_routes
from ..wire import _MAX_NAME_LEN, _PREFIX_ROOT, _reply_failure, _sender_checksums, SendPages
from .config import ChannelConfig
from .end import ChannelEnd
from .pages import chunk_layers, _clear_pages, _device_guard, _page_index, scatter_heads, scatter_pages, _wsum64
from .process_group import Channel, ChannelBroken, _Op, RECEIVER

logger = logging.getLogger(__name__)

# How long a failing receive waits for a scatter under way (or queued on the device) to end,
# so that its pages can go back to the pool before the error is raised; past it the
# receiving worker frees them when the write ends.
_SETTLE_S = 1.0


SendCall = Callable[[dict, SendPages], Awaitable[Any]]  # (sender address, send request) -> SendReply


class _Fence:
    """One receive's writes into its reserved pages, and who returns those pages to the pool
    when the transfer fails (see "Half-written pages" in the module docstring).

    The worker thread scatters chunk after chunk (CPU: in the thread; CUDA: queued on its
    lane, done once ``tail`` has completed); the event loop may give the transfer up at any
    moment. ``abandon`` (event loop) forbids further writes and says whether the pages can go
    back now; if not, it moves them to a private id that the worker frees when it exits."""

    SAFE, WORKER, STUCK = "safe", "worker", "stuck"

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._cancelled = False
        self._writing = False
        self._exited = False
        self._handoff: tuple[KVPool, str] | None = None
        self.touched = False  # a chunk was (or is being) scattered into the pages
        self.tail: Any = None  # CUDA: event after the last queued scatter

    # worker thread
    def begin_write(self) -> None:
        with self._lock:
            if self._cancelled:
                raise ChannelBroken("the receive was given up")
            self._writing = self.touched = True

    def end_write(self, tail: Any) -> None:
        with self._lock:
            self._writing = False
            self.tail = tail

    def pending(self) -> bool:
        with self._lock:
            return self._pending()

    def drain(self, timeout_s: float) -> bool:
        """Blocking: until no write is pending, at most ``timeout_s``; whether it got there."""
        deadline = time.monotonic() + timeout_s
        while self.pending():
            if time.monotonic() > deadline:
                return False
            time.sleep(1e-3)
        return True

    def exit(self) -> tuple[KVPool, str] | None:
        """The worker leaves; returns (pool, private id) when it is to free the pages."""
        with self._lock:
            self._exited = True
            return self._handoff

    # event loop
    def cancel(self) -> None:
        """No write starts after this."""
        with self._lock:
            self._cancelled = True

    def abandon(self, pool: KVPool, request_id: str) -> str:
        with self._lock:
            self._cancelled = True
            if not self._pending():
                return self.SAFE
            key = f"{request_id}\x00abandoned-{id(self):x}"
            pool.rename(request_id, key)
            if self._exited:  # it drained what it could and left
                return self.STUCK
            self._handoff = (pool, key)
            return self.WORKER

    def _pending(self) -> bool:
        return self._writing or (self.tail is not None and not self.tail.query())



class ChannelReceiver(ChannelEnd, KVReceiver):
    """The receiver of channel transfers (see ``kv_transfer.channel``): ``receive`` a ticket's
    pages, ``receive_heads`` one decode rank's KV heads of them. Settings as
    :class:`ChannelEnd`, and

    call_sender: ``async (sender, request) -> reply``: deliver ``request`` to the sender
        replica ``sender`` (from the ticket) and return its ``serve_send`` reply; None: this
        end can reach nobody (every receive fails ``UNAVAILABLE``).
    """

    def __init__(self, device: str | torch.device, *, host: str = "127.0.0.1", identity: dict | None = None,
                 call_sender: SendCall | None = None, config: ChannelConfig | None = None,
                 max_workers: int = 8) -> None:
        super().__init__(device, host=host, identity=identity, config=config, max_workers=max_workers)
        self.call_sender = call_sender
        self._inbound: dict[str, Channel] = {}  # by sender replica id (event loop only)
        self._inbound_locks: dict[str, asyncio.Lock] = {}
        self._store: Any = None  # the TCPStore this replica hosts
        self._generations = itertools.count(1)

    def _read_ticket(self, ticket: Any) -> tuple[KVFrameHeader, dict]:
        rid = getattr(ticket, "request_id", None)
        if not isinstance(ticket, TransferTicket):
            raise TransferError(TransferFailure.MALFORMED, f"ticket: expected a TransferTicket, got {type(ticket).__name__}")
        if ticket.transport != self.name:
            raise TransferError(
                TransferFailure.UNAVAILABLE, f"ticket: a {ticket.transport!r} transfer, this replica's channels use "
                f"{self.name!r} (its pool is on {self.device.type})", rid,
            )
        handle = ticket.handle
        if (not isinstance(handle, dict) or set(handle) - {"tp"} != {"header", "sender"}
                or not isinstance(handle["header"], bytes)):
            raise TransferError(TransferFailure.MALFORMED, "ticket: expected a handle {header: bytes, sender: {...}"
                                "[, tp: {...}]}", rid)
        sender = handle["sender"]
        if (not isinstance(sender, dict) or not {"replica_id", "host"} <= set(sender) or len(sender) > 16
                or not all(isinstance(k, str) and isinstance(v, str) and 0 < len(v) <= _MAX_NAME_LEN
                           for k, v in sender.items())):
            raise TransferError(TransferFailure.MALFORMED, "ticket: sender: expected short str fields incl. replica_id, host", rid)
        header = KVFrameHeader.decode(handle["header"])
        if header.checksum_kind != "wsum64":
            raise TransferError(TransferFailure.MALFORMED, f"checksum_kind: channels carry wsum64, got {header.checksum_kind!r}", rid)
        if header.request_id != ticket.request_id:
            raise TransferError(
                TransferFailure.REQUEST_MISMATCH, f"ticket for {ticket.request_id!r} carries the header of {header.request_id!r}", rid
            )
        return header, dict(sender)

    def _read_tp(self, ticket: TransferTicket, header: KVFrameHeader, num_q_heads: int | None
                 ) -> tuple[HeadLayout, list[KVFrameHeader], bool]:
        """The sender's head layout and its ranks' headers (``tp`` of a TP group's ticket; a
        single replica's ticket is a group of one), and whether the ticket came from a group."""
        rid = header.request_id
        tp = ticket.handle.get("tp")
        if tp is None:
            if num_q_heads is None:
                num_q_heads = header.num_kv_heads
            try:
                return HeadLayout(num_q_heads, header.num_kv_heads, 1), [header], False
            except ValueError as exc:
                raise TransferError(TransferFailure.SHAPE, f"ticket: {exc}", rid) from None
        if (not isinstance(tp, dict) or set(tp) != {"num_q_heads", "num_kv_heads", "tp_size", "ranks"}
                or not isinstance(tp["ranks"], list) or not all(isinstance(r, bytes) for r in tp["ranks"])):
            raise TransferError(TransferFailure.MALFORMED, "ticket: tp: expected {num_q_heads, num_kv_heads, tp_size, "
                                "ranks: [header bytes, one per rank]}", rid)
        try:
            src = HeadLayout(tp["num_q_heads"], tp["num_kv_heads"], tp["tp_size"])
        except (ValueError, TypeError) as exc:
            raise TransferError(TransferFailure.MALFORMED, f"ticket: tp: {exc}", rid) from None
        if len(tp["ranks"]) != src.tp_size:
            raise TransferError(TransferFailure.MALFORMED, f"ticket: tp: expected {src.tp_size} rank headers, got "
                                f"{len(tp['ranks'])}", rid)
        ranks = [KVFrameHeader.decode(raw) for raw in tp["ranks"]]
        same = ("request_id", "num_tokens", "num_pages", "num_layers", "page_size", "head_dim", "dtype", "checksum_kind")
        for s, h in enumerate(ranks):
            if any(getattr(h, k) != getattr(header, k) for k in same) or h.num_kv_heads != src.local_kv_heads:
                raise TransferError(TransferFailure.MALFORMED, f"ticket: tp: the header of rank {s} does not match the "
                                    f"group's ({src.local_kv_heads} local KV heads)", rid)
        return src, ranks, True

    async def receive(self, ticket: TransferTicket, pool: KVPool) -> list[int]:
        header, sender = self._read_ticket(ticket)
        if "tp" in ticket.handle:  # from a TP prefill group: this replica (TP 1) takes every head
            tp = ticket.handle["tp"]
            q = tp.get("num_q_heads") if isinstance(tp, dict) else None
            q = q if isinstance(q, int) and not isinstance(q, bool) else None
            kv = pool.num_kv_heads
            dst = HeadLayout(q, kv, 1) if q and kv and q % kv == 0 else None
            return await self.receive_heads(ticket, pool, dst_layout=dst, dst_rank=0)
        return await self._receive_whole(header, sender, pool)

    async def receive_heads(self, ticket: TransferTicket, pool: KVPool, *, dst_layout: HeadLayout | None,
                            dst_rank: int = 0) -> list[int]:
        """Receive into the pool of rank ``dst_rank`` of a decode group laid out as ``dst_layout``
        exactly that rank's KV heads, from every rank of the sender's group that holds some
        (:func:`kv_transfer.routes.transfer_routes`), one channel transfer per such rank, one
        after the other into the one set of reserved pages. Every rank header is checked
        (geometry, FP8 scales per head) before a page is taken; any failure releases the pages
        and raises (all or nothing for this rank; a decode group agrees over its ranks with
        ``kv_transfer.tp_transfer.agree``). A single replica's ticket is a group of one."""
        header, sender = self._read_ticket(ticket)
        rid = header.request_id
        if dst_layout is None:
            raise TransferError(TransferFailure.SHAPE, f"this pool's {pool.num_kv_heads} KV heads cannot take the "
                                "group's heads", rid)
        src, ranks, grouped = self._read_tp(ticket, header, dst_layout.num_q_heads)
        if (src.num_q_heads, src.num_kv_heads) != (dst_layout.num_q_heads, dst_layout.num_kv_heads):
            raise TransferError(TransferFailure.SHAPE, f"(num_q_heads, num_kv_heads): the sender has "
                                f"{(src.num_q_heads, src.num_kv_heads)}, this group "
                                f"{(dst_layout.num_q_heads, dst_layout.num_kv_heads)}", rid)
        if isinstance(dst_rank, bool) or not isinstance(dst_rank, int) or not 0 <= dst_rank < dst_layout.tp_size:
            raise ValueError(f"dst_rank: expected a rank of the decode group in [0, {dst_layout.tp_size}), got "
                             f"{dst_rank!r}")
        routes = transfer_routes(src, dst_layout)
        by_src = {s: rs for (s, d), rs in sorted(routes.items()) if d == dst_rank}
        filled = sorted(r.dst_local for rs in by_src.values() for r in rs)
        if filled != list(range(pool.num_kv_heads)):
            raise TransferError(TransferFailure.SHAPE, f"the routes fill heads {filled} of this rank's "
                                f"{pool.num_kv_heads}", rid)
        want = (pool.num_layers, pool.page_size, dst_layout.local_kv_heads, pool.head_dim, _DTYPE_NAMES[pool.dtype])
        got = (header.num_layers, header.page_size, pool.num_kv_heads, header.head_dim, header.dtype)
        if want != got:
            raise TransferError(TransferFailure.SHAPE, "(num_layers, page_size, num_kv_heads, head_dim, dtype): "
                                f"the transfer needs {want}, this rank's pool has {got}", rid)
        for s, rs in by_src.items():
            h = ranks[s]
            if (h.k_scale is None) != (pool.k_scale is None):
                raise TransferError(TransferFailure.SHAPE, f"FP8 scales: rank {s} of the sender and this pool "
                                    "disagree on having them", rid)
            if pool.k_scale is not None:
                n = h.num_kv_heads
                for r in rs:
                    for name, table in (("k_scale", pool.k_scale), ("v_scale", pool.v_scale)):
                        theirs = [getattr(h, name)[layer * n + r.src_local] for layer in range(h.num_layers)]
                        mine = [float(x) for x in table[:, r.dst_local].tolist()]
                        if theirs != mine:
                            raise TransferError(TransferFailure.SHAPE, f"FP8 scales of KV head {r.kv_head} differ "
                                                "between the sender's and the receiver's pool", rid)
        if self.call_sender is None:
            raise TransferError(TransferFailure.UNAVAILABLE, "this replica has no way to call the sender (call_sender)", rid)
        if self._closed:
            raise TransferError(TransferFailure.UNAVAILABLE, "the transport is closed (replica stopping)", rid)
        if pool.device.type != self.device.type:
            raise TransferError(TransferFailure.UNAVAILABLE, f"a {self.backend} channel cannot fill a pool on {pool.device}", rid)
        pages = adopt_pages(pool, header)
        try:
            for s, rs in by_src.items():
                h = ranks[s]
                part = dataclasses.replace(h, num_kv_heads=len(rs), payload_bytes=h.payload_bytes // h.num_kv_heads * len(rs))
                # pulls: every route of the transfer is one send, whichever decode rank asks for it
                await self._pull(part, sender, pool, pages,
                                 channel_id=f"{sender['replica_id']}:tp{s}" if grouped else None,
                                 extra={"rank": s, "heads": tuple(r.src_local for r in rs), "pulls": len(routes)},
                                 heads=[r.dst_local for r in rs])
        except BaseException:
            pool.release(rid)
            raise
        return pages

    async def _receive_whole(self, header: KVFrameHeader, sender: dict, pool: KVPool) -> list[int]:
        rid = header.request_id
        if pool.device.type != self.device.type:
            raise TransferError(TransferFailure.UNAVAILABLE, f"a {self.backend} channel cannot fill a pool on {pool.device}", rid)
        if self.call_sender is None:
            raise TransferError(TransferFailure.UNAVAILABLE, "this replica has no way to call the sender (call_sender)", rid)
        if self._closed:
            raise TransferError(TransferFailure.UNAVAILABLE, "the transport is closed (replica stopping)", rid)
        check_geometry(header, pool)
        pages = adopt_pages(pool, header)
        try:
            await self._pull(header, sender, pool, pages)
        except BaseException:
            pool.release(rid)
            raise
        return pages

    async def _pull(self, header: KVFrameHeader, sender: dict, pool: KVPool, pages: list[int], *,
                    channel_id: str | None = None, extra: dict | None = None, heads: list[int] | None = None) -> None:
        """One channel transfer into ``pages``: ``header`` describes what arrives (its heads
        only, for one rank of a TP group: ``heads`` are where they go in ``pool``, ``extra``
        what the send request adds, ``channel_id`` the rank's channel name)."""
        loop = asyncio.get_running_loop()
        rid, cfg = header.request_id, self.config
        sender_id = channel_id or sender["replica_id"]
        budget = cfg.transfer_budget_s(header.payload_bytes)
        lock = self._inbound_locks.setdefault(sender_id, asyncio.Lock())
        try:
            await asyncio.wait_for(lock.acquire(), timeout=cfg.connect_timeout_s + budget)
        except asyncio.TimeoutError:
            self._counts["channel_failures"] += 1
            raise TransferError(TransferFailure.UNAVAILABLE, f"the channel from {sender_id} stayed busy", rid) from None
        channel: Channel | None = None
        recv: asyncio.Future | None = None
        fence = _Fence()
        try:
            channel = await self._inbound_channel(sender_id, pool.device)
            timeout = budget + (cfg.connect_timeout_s if channel.pg is None else 0.0)
            layers_per_chunk = cfg.layers_per_chunk(header.num_layers, header.payload_bytes // header.num_layers)
            plan = chunk_layers(header.num_layers, layers_per_chunk)
            request = SendPages(request_id=rid, sender_id=sender_id, receiver_id=self.replica_id, host=self.host,
                                port=int(self._store.port), prefix=channel.prefix, generation=channel.generation,
                                backend=self.backend, timeout_s=timeout, layers_per_chunk=layers_per_chunk,
                                **(extra or {}))
            reply = asyncio.ensure_future(self.call_sender(sender, request))
            recv = loop.run_in_executor(self._executor, self._receive_blocking, channel, sender_id, pool, pages,
                                        plan, timeout, fence, heads)
            recv.add_done_callback(_retrieve)  # a receive given up on may fail later, unread
            try:
                await self._await_transfer(channel, sender_id, recv, reply, timeout, rid)
            finally:
                if not reply.done():
                    reply.cancel()
            sent = _sender_checksums(reply.result(), len(plan))
            if sent is None:
                self._drop_inbound(sender_id, channel)
                raise TransferError(TransferFailure.LOST, f"sender {sender_id}: a reply without {len(plan)} chunk "
                                    "checksums", rid)
            got = recv.result()
            bad = [i for i, (mine, theirs) in enumerate(zip(got, sent)) if mine != theirs]
            if bad:
                self._drop_inbound(sender_id, channel)  # two transfers may have crossed: resynchronise
                i = bad[0]
                raise TransferError(
                    TransferFailure.CHECKSUM,
                    f"chunk {i} of {len(plan)} (layers {plan[i][0]}..{plan[i][1] - 1}): wsum64 {got[i]:016x} "
                    f"(computed here) does not match the sender's {sent[i]:016x}"
                    + (f"; {len(bad)} chunks differ" if len(bad) > 1 else ""), rid,
                )
            self._counts["channel_receives"] += 1
            self._counts["channel_bytes_received"] += header.payload_bytes
        except TransferError:
            self._counts["channel_failures"] += 1
            await self._settle(fence, recv)
            self._abandon(fence, pool, rid, pages)
            raise
        except asyncio.CancelledError:  # the request went away mid-transfer: do not reuse a busy channel
            if channel is not None:
                self._drop_inbound(sender_id, channel)
            self._abandon(fence, pool, rid, pages)
            raise
        except Exception as exc:  # anything else (a device error in the scatter, ...) ends this transfer
            logger.exception("KV receive of %s failed", rid)
            if channel is not None:
                self._drop_inbound(sender_id, channel)
            self._counts["channel_failures"] += 1
            await self._settle(fence, recv)
            self._abandon(fence, pool, rid, pages)
            raise TransferError(TransferFailure.LOST, f"{type(exc).__name__}: {exc}", rid) from exc
        finally:
            lock.release()

    def _receive_blocking(self, channel: Channel, sender_id: str, pool: KVPool, pages: list[int],
                          plan: list[tuple[int, int]], timeout: float, fence: _Fence,
                          heads: list[int] | None = None) -> list[int]:
        """Worker thread: the receiving end of one transfer; returns the chunks' checksums.
        Whatever happens, it leaves no write into ``pages`` queued behind it that it could
        have stopped, and frees them if the event loop handed them over."""
        try:
            return self._recv_chunks(channel, sender_id, pool, pages, plan, timeout, fence, heads)
        except BaseException:
            channel.mark_broken()
            if fence.pending():  # scatters queued behind receives that may never complete:
                channel.abort()  # NCCL ends those receives, then the scatters run
                fence.drain(self.config.connect_timeout_s)
            raise
        finally:
            handoff = fence.exit()
            if handoff is not None:
                self._free_abandoned(fence, *handoff, pages)

    def _recv_chunks(self, channel: Channel, sender_id: str, pool: KVPool, pages: list[int],
                     plan: list[tuple[int, int]], timeout: float, fence: _Fence,
                     heads: list[int] | None = None) -> list[int]:
        deadline = time.monotonic() + timeout
        channel.open()
        elem = pool.k.element_size()
        nheads = pool.num_kv_heads if heads is None else len(heads)
        layer_bytes = 2 * len(pages) * pool.page_size * nheads * pool.head_dim * elem
        sizes = [(l1 - l0) * layer_bytes for l0, l1 in plan]  # the first is the largest
        depth = min(self.config.ring_depth, len(plan))
        post, lane = self._lanes_for("recv", sender_id, pool.device, 2)
        with _device_guard(pool.device):
            with lane.use():
                index = _page_index(pages, pool.device)
                ring = [torch.empty(sizes[0], dtype=torch.uint8, device=pool.device) for _ in range(depth)]
                sums = torch.zeros(len(plan), dtype=torch.int64, device=pool.device)
            post.follow(lane)  # the ring's memory may have served earlier work on the lane
            ops: list[_Op] = []
            freed: list[Any] = [None] * depth  # per slot: event after the scatter of its last chunk

            def land(j: int) -> None:  # chunk j: wait for it, checksum it, scatter it into the pages
                slot = ring[j % depth][: sizes[j]]
                with lane.use():
                    channel.after(ops[j], deadline)
                    sums[j] = _wsum64(slot)
                    fence.begin_write()
                    try:
                        if heads is None:
                            scatter_pages(pool, index, slot, plan[j])
                        else:
                            scatter_heads(pool, index, slot, plan[j], heads)
                    finally:
                        freed[j % depth] = lane.mark()
                        fence.end_write(freed[j % depth])

            landed = 0
            for i in range(len(plan)):
                while landed <= i - depth:  # the slot's previous chunk (ring_depth 1)
                    land(landed)
                    landed += 1
                with post.use():
                    post.wait(freed[i % depth])
                    ops.append(channel.post(ring[i % depth][: sizes[i]], tag=i))
                while landed < i:  # the previous chunk, while this one arrives
                    land(landed)
                    landed += 1
            while landed < len(plan):
                land(landed)
                landed += 1
            with lane.use():
                channel.finish(ops, deadline, tail=fence.tail)
                return [x & _U64 for x in sums.tolist()]

    @staticmethod
    async def _settle(fence: _Fence, recv: asyncio.Future | None) -> None:
        """Failure path: stop further writes, and give a write under way a moment to end (a
        sender's failure reply can overtake the scatter of the chunk it has just sent)."""
        fence.cancel()
        if recv is not None and fence.pending():
            await asyncio.wait({recv}, timeout=_SETTLE_S)

    def _abandon(self, fence: _Fence, pool: KVPool, rid: str, pages: list[int]) -> None:
        """Event loop, failure path: once this returns, ``receive`` may release what is left
        under ``rid`` (nothing, when the pages still had writes pending)."""
        outcome = fence.abandon(pool, rid)
        if outcome == _Fence.SAFE and fence.touched:
            _clear_pages(pool, pages)
        elif outcome == _Fence.STUCK:
            logger.error("KV receive of %s: scatters still queued after the channel was aborted; its %d pages stay "
                         "out of the pool", rid, len(pages))

    def _free_abandoned(self, fence: _Fence, pool: KVPool, key: str, pages: list[int]) -> None:
        """Worker thread, on exit: free pages the event loop gave up on while writes were pending."""
        if fence.pending():
            logger.error("KV receive: scatters still queued after the channel was aborted; %d pages stay out of "
                         "the pool", len(pages))
            return
        if fence.touched:
            _clear_pages(pool, pages)
        pool.release(key)

    async def _await_transfer(self, channel: Channel, sender_id: str, recv: asyncio.Future, reply: asyncio.Future,
                              timeout: float, rid: str) -> None:
        """Both the local receive and the sender's reply must succeed within ``timeout``
        (plus a grace for the reply's trip); the first failure closes the channel."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout + min(5.0, self.config.connect_timeout_s)
        pending: set[asyncio.Future] = {recv, reply}
        while pending:
            done, pending = await asyncio.wait(pending, timeout=max(deadline - loop.time(), 0.0),
                                               return_when=asyncio.FIRST_COMPLETED)
            if not done:
                self._drop_inbound(sender_id, channel)
                raise TransferError(TransferFailure.LOST, f"no transfer from {sender_id} within {timeout:.1f}s", rid)
            if reply in done:
                reason, message = _reply_failure(reply)
                if reason is not None:
                    self._drop_inbound(sender_id, channel)
                    raise TransferError(reason, f"sender {sender_id}: {message}", rid)
            if recv in done and recv.exception() is not None:
                exc = recv.exception()
                self._drop_inbound(sender_id, channel)
                raise TransferError(TransferFailure.LOST, f"receive from {sender_id} failed: {type(exc).__name__}: {exc}", rid)

    async def _inbound_channel(self, sender_id: str, device: torch.device) -> Channel:
        loop = asyncio.get_running_loop()
        if self._store is None:
            store = await loop.run_in_executor(self._executor, self._host_store)
            if self._store is None:  # two first transfers may race here: keep one store
                self._store = store
        ch = self._inbound.get(sender_id)
        if ch is not None and not ch.broken and time.monotonic() - ch.last_used <= self.config.idle_reopen_s:
            return ch
        if ch is not None:
            self._drop_inbound(sender_id, ch)
        gen = next(self._generations)
        ch = Channel(self.backend, rank=RECEIVER, prefix=f"{_PREFIX_ROOT}{sender_id}/{self.replica_id}/{gen}/",
                     generation=gen, host=self.host, device=device, connect_timeout_s=self.config.connect_timeout_s,
                     store_addr=(self.host, int(self._store.port)))
        self._inbound[sender_id] = ch
        self._counts["channels_opened"] += 1
        return ch

    def _host_store(self) -> Any:
        from torch.distributed import TCPStore

        return TCPStore(self.host, 0, None, True, datetime.timedelta(seconds=self.config.connect_timeout_s),
                        wait_for_workers=False)

    def _drop_inbound(self, sender_id: str, channel: Channel) -> None:
        """Event loop: mark ``channel`` broken at once, close it in a worker thread."""
        channel.mark_broken()
        if self._inbound.get(sender_id) is channel:
            del self._inbound[sender_id]
        try:
            self._executor.submit(channel.abort)
        except RuntimeError:  # executor shut down (closing): abort inline
            channel.abort()

    def _tally(self) -> tuple[int, int]:
        return sum(not c.broken for c in self._inbound.values()), 0

    def _detach(self) -> list[Channel]:
        channels = list(self._inbound.values())
        self._inbound.clear()
        return channels

    def close(self) -> None:
        super().close()
        self._store = None


def _retrieve(future: asyncio.Future) -> None:
    if not future.cancelled():
        future.exception()


__all__ = ["ChannelReceiver"]
