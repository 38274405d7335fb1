"""The sending end of channel transfers (a prefill replica): ``ChannelSender`` records a
request's pages at ``export`` and sends them when the receiver asks (``serve_send``). The
protocol, the failure handling and the TP variant are in ``kv_transfer.channel``'s docstring.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any

import torch

from kv_cache.pool import KVPool

from ..errors import TransferError, TransferFailure
from ..header import describe_pages, KVFrameHeader, _U64
from ..interfaces import KVSender, TransferTicket
from ..wire import _reply, SendPages, SendReply
from .config import ChannelConfig
from .end import ChannelEnd
from .pages import chunk_layers, _device_guard, gather_heads, gather_pages, _page_index, _wsum64
from .process_group import Channel, ChannelBroken, _Op, SENDER

logger = logging.getLogger(__name__)


@dataclass
class _Export:
    """A request's pages that a receiver may ask for. No copy: they stay in ``pool``, under
    the prefill replica's lease, until the decode side has them."""

    pool: KVPool
    pages: list[int]
    header: KVFrameHeader
    fault: str | None
    ready: Any  # CUDA event after the writes of the pages; None on CPU
    discarded: bool = False  # the lease ended: the pages may already belong to another request



class ChannelSender(ChannelEnd, KVSender):
    """The sender of channel transfers (see ``kv_transfer.channel``): ``export`` after prefill,
    ``serve_send`` when a receiver asks for the pages. Settings as :class:`ChannelEnd`."""

    fault_modes = ("flip", "break")
    reads_pages_after_export = True  # the send reads them from the pool
    serves_sends = True

    def __init__(self, device: str | torch.device, *, host: str = "127.0.0.1", identity: dict | None = None,
                 config: ChannelConfig | None = None, max_workers: int = 8) -> None:
        super().__init__(device, host=host, identity=identity, config=config, max_workers=max_workers)
        self._exports: dict[str, _Export] = {}  # under _lock
        self._outbound: dict[str, Channel] = {}  # by receiver replica id, under _lock

    def export(self, pool: KVPool, request_id: str, *, fault: str | None = None) -> TransferTicket:
        if fault is not None and fault not in self.fault_modes:
            raise ValueError(f"fault: channels inject one of {self.fault_modes}, got {fault!r}")
        if pool.device.type != self.device.type:
            raise TransferError(
                TransferFailure.UNAVAILABLE, f"a {self.backend} channel moves {self.device.type} pools, this one is on "
                f"{pool.device}", request_id,
            )
        header, pages = describe_pages(pool, request_id, checksum_kind="wsum64")
        ready = None
        if pool.device.type == "cuda":
            # The pages were written on this device's current stream (the prefill engine's;
            # its first-token readback has synchronised it already). The send's gathers wait
            # for this event on the device: no host sync here, and no false wait on a next
            # prefill batch queued meanwhile.
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(pool.device))
        with self._lock:
            self._exports[request_id] = _Export(pool, pages, header, fault, ready)
        handle = {"header": header.encode(), "sender": {**self.identity, "host": self.host}}
        return TransferTicket(request_id, self.name, header.num_tokens, header.num_pages, header.payload_bytes, handle)

    def discard(self, ticket: TransferTicket) -> None:
        """The lease ended: forget the export; a send of it still under way is answered as failed."""
        with self._lock:
            exp = self._exports.pop(ticket.request_id, None)
            if exp is not None:
                exp.discarded = True

    async def serve_send(self, request: SendPages) -> SendReply:
        """Sender side of a transfer, called by the receiver (through ``call_sender``): send
        the exported pages over the requested channel. The reply's ``checksums`` are the
        per-chunk checksums when ``ok``."""
        checked = self._check_send(request)
        if isinstance(checked, SendReply):
            return checked
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, self._send_blocking, *checked)

    def serve_send_blocking(self, request: SendPages) -> SendReply:
        """:meth:`serve_send` in the calling thread (a TP rank actor's worker thread)."""
        checked = self._check_send(request)
        return checked if isinstance(checked, SendReply) else self._send_blocking(*checked)

    def _check_send(self, request: SendPages) -> SendReply | tuple[SendPages, _Export]:
        """The parsed request and its export, or the failure reply."""
        try:
            req = SendPages.parse(request)
        except ValueError as exc:
            return _reply(False, TransferFailure.UNAVAILABLE, f"bad send request: {exc}")
        if req.backend != self.backend:
            return _reply(False, TransferFailure.UNAVAILABLE, f"this replica sends over {self.backend}, not {req.backend}")
        if req.sender_id != self.replica_id:  # routed to the wrong replica (ours has gone)
            return _reply(False, TransferFailure.UNAVAILABLE,
                          f"the pages are on replica {req.sender_id}, this is {self.replica_id}")
        with self._lock:
            exp = self._exports.get(req.request_id)
        if exp is None:
            return _reply(False, TransferFailure.LOST,
                          f"no exported pages for {req.request_id!r} (lease ended or already sent)")
        if req.layers_per_chunk > exp.header.num_layers:
            return _reply(False, TransferFailure.UNAVAILABLE, f"bad send request: layers_per_chunk: expected at most "
                          f"the {exp.header.num_layers} layers, got {req.layers_per_chunk}")
        if req.heads is not None and max(req.heads) >= exp.header.num_kv_heads:
            return _reply(False, TransferFailure.UNAVAILABLE, f"bad send request: heads: expected local KV heads in "
                          f"[0, {exp.header.num_kv_heads}), got {list(req.heads)}")
        return req, exp

    def _outbound_channel(self, req: SendPages) -> Channel:
        stale: list[Channel] = []
        with self._lock:
            now = time.monotonic()
            for rid, ch in list(self._outbound.items()):  # receivers that went away
                if rid != req.receiver_id and now - ch.last_used > 2 * self.config.idle_reopen_s:
                    stale.append(self._outbound.pop(rid))
            ch = self._outbound.get(req.receiver_id)
            if ch is not None and (ch.generation > req.generation or (ch.generation == req.generation and ch.broken)):
                raise ChannelBroken(f"generation {req.generation} is stale (this end is at {ch.generation}"
                                    f"{', broken' if ch.broken else ''})")
            if ch is None or ch.generation < req.generation:
                if ch is not None:
                    stale.append(ch)
                ch = Channel(self.backend, rank=SENDER, prefix=req.prefix, generation=req.generation, host=self.host,
                             device=self.device, connect_timeout_s=self.config.connect_timeout_s,
                             store_addr=(req.host, req.port))
                self._outbound[req.receiver_id] = ch
                self._counts["channels_opened"] += 1
        for old in stale:
            old.abort()
        return ch

    def _send_blocking(self, req: SendPages, exp: _Export) -> SendReply:
        deadline = time.monotonic() + req.timeout_s
        try:
            channel = self._outbound_channel(req)
        except ChannelBroken as exc:
            return _reply(False, TransferFailure.UNAVAILABLE, str(exc))
        if not channel.lock.acquire(timeout=req.timeout_s):
            return _reply(False, TransferFailure.UNAVAILABLE, f"channel {channel.prefix} busy")
        try:
            if exp.fault == "break":
                raise ChannelBroken("fault injection: channel broken before sending")
            checksums = self._send_chunks(channel, req, exp, deadline)
        except Exception as exc:
            self._drop_outbound(req.receiver_id, channel)
            self._counts["channel_failures"] += 1
            logger.warning("KV send of %s over %s failed: %r", req.request_id, channel.prefix, exc)
            return _reply(False, TransferFailure.LOST, f"send failed: {type(exc).__name__}: {exc}")
        finally:
            channel.lock.release()
        with self._lock:
            lapsed = exp.discarded
            # sent: a retry goes over the object store. A TP group's send (``heads``) keeps the
            # export: several decode ranks may need heads of this rank; its lease discards it.
            if req.heads is None and self._exports.get(req.request_id) is exp:
                del self._exports[req.request_id]
        if lapsed:  # released during the send: what was read may be another request's
            self._counts["channel_failures"] += 1
            return _reply(False, TransferFailure.LOST, "the lease on the pages ended during the send")
        self._counts["channel_sends"] += 1
        self._counts["channel_bytes_sent"] += (exp.header.payload_bytes if req.heads is None else
                                               exp.header.payload_bytes // exp.header.num_kv_heads * len(req.heads))
        return _reply(True, checksums=checksums)

    def _send_chunks(self, channel: Channel, req: SendPages, exp: _Export, deadline: float) -> list[int]:
        """Blocking: gather, checksum and send ``exp``'s pages chunk by chunk through a ring of
        staging buffers; returns the chunks' checksums."""
        pool, header = exp.pool, exp.header
        plan = chunk_layers(header.num_layers, req.layers_per_chunk)
        heads = None if req.heads is None or list(req.heads) == list(range(header.num_kv_heads)) else list(req.heads)
        layer_bytes = header.payload_bytes // header.num_layers
        if heads is not None:  # some of this rank's heads (TP groups)
            layer_bytes = layer_bytes // header.num_kv_heads * len(heads)
        depth = min(self.config.ring_depth, len(plan))
        flip = len(plan) // 2 if exp.fault == "flip" else None  # a middle chunk
        channel.open()
        (lane,) = self._lanes_for("send", req.receiver_id, pool.device, 1)
        with _device_guard(pool.device), lane.use():
            lane.wait(exp.ready)
            index = _page_index(exp.pages, pool.device)
            ring = [torch.empty(req.layers_per_chunk * layer_bytes, dtype=torch.uint8, device=pool.device)
                    for _ in range(depth)]
            sums = torch.zeros(len(plan), dtype=torch.int64, device=pool.device)
            ops: list[_Op] = []
            for i, layers in enumerate(plan):
                if i >= depth:
                    channel.after(ops[i - depth], deadline)  # the slot's previous send has completed
                if heads is None:
                    chunk = gather_pages(pool, index, layers, out=ring[i % depth])
                else:
                    chunk = gather_heads(pool, index, layers, heads, out=ring[i % depth])
                sums[i] = _wsum64(chunk)
                if i == flip and chunk.numel():
                    chunk[-1:].bitwise_xor_(0xFF)  # after its checksum: the receiver must notice
                ops.append(channel.post(chunk, tag=i))  # NCCL: after the gather, in stream order
            channel.finish(ops, deadline)
            return [x & _U64 for x in sums.tolist()]

    def _drop_outbound(self, receiver_id: str, channel: Channel) -> None:
        channel.mark_broken()
        with self._lock:
            if self._outbound.get(receiver_id) is channel:
                del self._outbound[receiver_id]
        channel.abort()

    def _tally(self) -> tuple[int, int]:
        with self._lock:
            return sum(not c.broken for c in self._outbound.values()), len(self._exports)

    def _detach(self) -> list[Channel]:
        with self._lock:
            channels = list(self._outbound.values())
            self._outbound.clear()
            for exp in self._exports.values():
                exp.discarded = True
            self._exports.clear()
        return channels


__all__ = ["ChannelSender"]
