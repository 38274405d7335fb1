"""Pairwise channels: a request's KV pages from a prefill replica's device straight into a
decode replica's device, over a 2-rank process group that the pair builds for itself.

Serve replicas come and go, so there is no group over all of them: a *channel* joins one
sender (a prefill replica, rank 0) and one receiver (a decode replica, rank 1), is opened the
first time that pair transfers and is rebuilt after any failure. It is a standalone
``torch.distributed`` backend (``init_process_group`` and the default group are never used):
the receiver hosts one ``TCPStore`` on a free port of its node's address, each channel gets a
``PrefixStore`` namespace ``fpkv/<sender>/<receiver>/<generation>/`` in it, and both ends
build ``ProcessGroupNCCL`` (CUDA pools) or ``ProcessGroupGloo`` (CPU pools) on that prefix.
The backend follows the pools' device, so the CPU tests run exactly the code that moves
GPU pages with NCCL.

One transfer (the header travels through Ray, the payload over the channel):
1. ``export`` (sender, after prefill): gathers the request's pages (all layers, K then V,
   whole pages) into one contiguous staging buffer on the pool's device (``index_select``,
   no host copy), computes :func:`payload_checksum` there and returns a ticket with the
   msgpack :class:`~kv_transfer.transfer.KVFrameHeader` (``checksum_kind="wsum64"``) and the
   sender's address. The staging buffer is kept until it is sent or the ticket discarded.
2. ``receive`` (receiver): checks the ticket and the geometry, reserves the pages in its own
   pool (all or nothing: ``TransferFailure.POOL_EXHAUSTED`` otherwise, and the sender is not
   even called), then - one transfer at a time per pair - asks the sender, through
   ``call_sender`` (a Ray call pinned to that replica), to send over channel ``generation``
   while it posts the matching receive into a staging buffer on its device. Both ends run
   the blocking collective work in worker threads, never on the replica's event loop.
3. The receiver recomputes the checksum on its device, compares, and scatters the buffer
   into its pages. Any failure releases those pages and raises ``TransferError``.

The checksum (:func:`payload_checksum`) is a position-weighted sum computed where the data
lives; CRC-32 on the GPU would cost more than the transfer. It guards against our own bugs
(a gather/scatter or ordering mistake, two transfers crossing on one channel, a wrong
buffer), not against the wire: NCCL and TCP guarantee delivery integrity.

Failures never hang a request: channel set-up is bounded by ``connect_timeout_s`` (store
connection, gloo rendezvous, NCCL unique-id exchange), a transfer by
``transfer_timeout_s + bytes / min_bytes_per_s``. A timeout, a dead or unreachable peer,
a sender that no longer holds the pages or a checksum mismatch raise ``TransferError``
(``LOST``, ``UNAVAILABLE`` or ``CHECKSUM``: all retryable, and the service retries such a
request over the object store) and mark the channel broken on this side; the next transfer
between the pair opens a new generation, and the other end drops its older generation when
it sees the newer one. A gloo wait cannot be interrupted: its worker thread stays blocked
until its own timeout, while the request has already failed.

NCCL: a hung transfer's communicator is aborted by us. So that a timeout aborts the channel
and not the replica process, ``TORCH_NCCL_ASYNC_ERROR_HANDLING`` defaults to 2 (clean up
only) in processes that open NCCL channels, unless the environment already sets it.

Ownership is unchanged (docs/ARCHITECTURE.md): the sender's pages stay allocated until the
decode side has adopted them and the lease stream is closed; the staging copy goes as soon
as it is sent or the lease ends.
"""

from __future__ import annotations

import asyncio
import collections
import datetime
import functools
import itertools
import logging
import os
import threading
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any

import torch

from .pool import KVPool
from .transfer import (
    MAX_REQUEST_ID_LEN,
    KVFrameHeader,
    KVTransport,
    TransferError,
    TransferFailure,
    TransferTicket,
    adopt_pages,
    check_geometry,
    describe_pages,
)

logger = logging.getLogger(__name__)

CHANNEL_BACKENDS = {"cuda": "nccl", "cpu": "gloo"}  # pool device type -> process-group backend
SENDER, RECEIVER = 0, 1
_PREFIX_ROOT = "fpkv/"
_MAX_NAME_LEN = 256
# NCCL's own watchdog: far beyond our deadlines (we abort first), only a last resort.
_NCCL_WATCHDOG_S = 600.0
_SEND_REQUEST_KEYS = frozenset(
    {"request_id", "sender_id", "receiver_id", "host", "port", "prefix", "generation", "backend", "timeout_s"}
)
_REPLY_REASONS = (TransferFailure.LOST, TransferFailure.UNAVAILABLE)

SendCall = Callable[[dict, dict], Awaitable[Any]]  # (sender address, send request) -> reply dict


@dataclass(frozen=True)
class ChannelConfig:
    """Time bounds of channel transfers.

    connect_timeout_s: opening a channel (store connection, rendezvous, NCCL unique-id
        exchange), and waiting behind other transfers of the same pair.
    transfer_timeout_s, min_bytes_per_s: a transfer that has not completed within
        ``transfer_timeout_s + payload_bytes / min_bytes_per_s`` counts as hung.
    idle_reopen_s: a receiver opens a new generation instead of reusing a channel idle
        longer than this; senders drop channels idle for twice as long (dead receivers).
    """

    connect_timeout_s: float = 30.0
    transfer_timeout_s: float = 10.0
    min_bytes_per_s: float = 1e9
    idle_reopen_s: float = 300.0

    def __post_init__(self) -> None:
        for name in ("connect_timeout_s", "transfer_timeout_s", "min_bytes_per_s", "idle_reopen_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"{name}: expected a positive number, got {value!r}")

    def transfer_budget_s(self, payload_bytes: int) -> float:
        return self.transfer_timeout_s + payload_bytes / self.min_bytes_per_s


# ---------------------------------------------------------------------------- payload
_CHECKSUM_COLUMNS = 1024  # words per row of the 2-D view
_MIX = (1, 0x100000001B3, 0x9E3779B1, 0x85EBCA77)  # distinct odd weights for the four parts
_U64 = (1 << 64) - 1


def payload_checksum(payload: torch.Tensor) -> int:
    """A 64-bit checksum of a contiguous ``uint8`` payload, computed on its device.

    The payload is read as int32 words laid out ``[rows, 1024]``; with row sums ``r_i`` and
    column sums ``c_j`` (each mod 2**32) the checksum is ``sum (i+1) r_i + M sum (j+1) c_j``
    (plus the leftover words and bytes, weighted by position), all in wrapping int64. Two
    reductions over the data and none of its size in temporaries. Integer sums wrap the
    same way whatever the reduction order, so sender and receiver agree bit for bit.
    Detects any single changed word, swapped rows (pages in the wrong order) and swapped
    words within a row; it is not cryptographic. One host sync (the returned int).
    """
    if not isinstance(payload, torch.Tensor) or payload.dtype != torch.uint8 or payload.dim() != 1:
        raise ValueError(f"payload: expected a 1-D uint8 tensor, got {_describe(payload)}")
    if not payload.is_contiguous():
        raise ValueError("payload: expected a contiguous tensor")
    dev = payload.device
    n = payload.numel()
    nwords = n // 4
    total = torch.zeros((), dtype=torch.int64, device=dev)
    if nwords:
        words = payload[: nwords * 4].view(torch.int32)
        cols = min(_CHECKSUM_COLUMNS, nwords)
        rows = nwords // cols
        grid = words[: rows * cols].view(rows, cols)
        # int32 sums: the accumulator wraps (or is truncated) mod 2**32 identically on both ends
        row_sums = grid.sum(dim=1, dtype=torch.int32).to(torch.int64)
        col_sums = grid.sum(dim=0, dtype=torch.int32).to(torch.int64)
        total += (row_sums * torch.arange(1, rows + 1, dtype=torch.int64, device=dev)).sum() * _MIX[0]
        total += (col_sums * torch.arange(1, cols + 1, dtype=torch.int64, device=dev)).sum() * _MIX[1]
        rest = words[rows * cols :].to(torch.int64)
        if rest.numel():
            total += (rest * torch.arange(1, rest.numel() + 1, dtype=torch.int64, device=dev)).sum() * _MIX[2]
    tail = payload[nwords * 4 :].to(torch.int64)
    if tail.numel():
        total += (tail * torch.arange(1, tail.numel() + 1, dtype=torch.int64, device=dev)).sum() * _MIX[3]
    return int(total.item()) & _U64


_WORDS = (torch.int64, torch.int32, torch.int16, torch.uint8)


def _word_view(pool: KVPool) -> tuple[torch.Tensor, torch.Tensor]:
    """The pool's K and V as the widest integer words a row of ``head_dim`` elements divides
    into (int64 for bf16 and fp8 at d = 128): index_select/index_copy_ move one element per
    index computation, so 8-byte words move 8x the bytes per step of a byte view (and integer
    views also cover FP8, which those kernels do not support). A copy is exact either way."""
    row_bytes = pool.head_dim * pool.k.element_size()
    for word in _WORDS:
        size = torch.empty((), dtype=word).element_size()
        if row_bytes % size == 0:
            return pool.k.view(word), pool.v.view(word)
    raise AssertionError("unreachable: uint8 divides every row")


def gather_pages(pool: KVPool, pages: list[int]) -> torch.Tensor:
    """``pages`` of every layer, K then V, as one contiguous ``uint8`` tensor on the pool's
    device: ``[2, num_layers, len(pages), page_size, num_kv_heads, head_dim]`` elements' bytes,
    flat."""
    k, v = _word_view(pool)
    out = torch.empty((2, k.shape[0], len(pages), *k.shape[2:]), dtype=k.dtype, device=pool.device)
    if pages:
        index = torch.tensor(pages, dtype=torch.long, device=pool.device)
        for part, src in enumerate((k, v)):
            torch.index_select(src, 1, index, out=out[part])
    return out.view(-1).view(torch.uint8)


def scatter_pages(pool: KVPool, pages: list[int], payload: torch.Tensor) -> None:
    """The inverse of :func:`gather_pages`: ``payload`` into ``pages`` of ``pool``."""
    k, v = _word_view(pool)
    if not pages:
        return
    block = payload.view(k.dtype).view(2, k.shape[0], len(pages), *k.shape[2:])
    index = torch.tensor(pages, dtype=torch.long, device=pool.device)
    for part, dst in enumerate((k, v)):
        dst.index_copy_(1, index, block[part])


# ---------------------------------------------------------------------------- one channel
class ChannelBroken(RuntimeError):
    """The channel was closed (by us, after a failure elsewhere) while an operation used it."""


def _nccl_error_handling_default() -> None:
    # Training jobs want a hung collective to take the process down (the default, 3); a
    # server whose peers come and go wants the communicator aborted and the replica alive.
    os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")


class Channel:
    """One end of a pair's process group. Rank 0 sends, rank 1 (whose replica hosts the store
    at ``store_addr``) receives. ``run`` and ``abort`` block: call them from a worker thread.

    Each end opens its own client connection to the store: a rendezvous blocked on one
    channel (a peer that never comes) must not hold up the other channels of that store."""

    def __init__(self, backend: str, *, rank: int, prefix: str, generation: int, host: str,
                 device: torch.device, connect_timeout_s: float, store_addr: tuple[str, int]) -> None:
        if backend not in CHANNEL_BACKENDS.values():
            raise ValueError(f"backend: expected one of {sorted(CHANNEL_BACKENDS.values())}, got {backend!r}")
        if rank not in (SENDER, RECEIVER):
            raise ValueError(f"rank: expected {SENDER} (sender) or {RECEIVER} (receiver), got {rank!r}")
        if (not isinstance(store_addr, tuple) or len(store_addr) != 2 or not isinstance(store_addr[0], str)
                or not isinstance(store_addr[1], int)):
            raise ValueError(f"store_addr: expected (host, port) of the receiver's store, got {store_addr!r}")
        self.backend = backend
        self.rank = rank
        self.prefix = prefix
        self.generation = generation
        self.host = host
        self.device = device
        self.connect_timeout_s = connect_timeout_s
        self._store: Any = None  # our client connection to the store
        self._store_addr = store_addr
        self.pg: Any = None
        self.broken = False
        self.lock = threading.Lock()  # one transfer at a time over this channel
        self.last_used = time.monotonic()
        self.transfers = 0

    def __repr__(self) -> str:
        state = "broken" if self.broken else ("open" if self.pg is not None else "new")
        return f"Channel({self.backend}, rank={self.rank}, {self.prefix!r}, {state})"

    def _open(self) -> None:
        from torch.distributed import PrefixStore, TCPStore

        timeout = datetime.timedelta(seconds=self.connect_timeout_s)
        if self._store is None:
            host, port = self._store_addr
            self._store = TCPStore(host, port, None, False, timeout)  # connects, bounded by timeout
        store = PrefixStore(self.prefix, self._store)
        if self.backend == "gloo":
            from torch.distributed import ProcessGroupGloo

            opts = ProcessGroupGloo._Options()
            opts._timeout = timeout
            opts._devices = [ProcessGroupGloo.create_device(hostname=self.host)]
            pg = ProcessGroupGloo(store, self.rank, 2, opts)  # the rendezvous: waits for the peer
        else:
            if not torch.distributed.is_nccl_available():
                raise ChannelBroken("this torch build has no NCCL")
            _nccl_error_handling_default()
            from torch.distributed import ProcessGroupNCCL

            opts = ProcessGroupNCCL.Options()
            opts._timeout = datetime.timedelta(seconds=max(_NCCL_WATCHDOG_S, 4 * self.connect_timeout_s))
            opts.is_high_priority_stream = False
            if hasattr(opts, "group_name"):  # for NCCL's logs; unique per end (a test may hold both)
                opts.group_name = f"{self.prefix}rank{self.rank}"
            pg = ProcessGroupNCCL(store, self.rank, 2, opts)  # lazy: the communicator comes with the first op
        if self.broken:  # closed while we were connecting
            _abort_pg(pg)
            raise ChannelBroken(f"{self.prefix} was closed while it opened")
        self.pg = pg

    def run(self, tensor: torch.Tensor, timeout_s: float) -> None:
        """Send (rank 0) or receive (rank 1) ``tensor`` whole, opening the channel first if
        needed; raises on failure or after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        if self.broken:
            raise ChannelBroken(f"{self.prefix} is closed")
        with _device_guard(self.device):
            if self.pg is None:
                self._open()
            peer = 1 - self.rank
            work = self.pg.send([tensor], peer, 0) if self.rank == SENDER else self.pg.recv([tensor], peer, 0)
            self._wait(work, deadline)
        self.transfers += 1
        self.last_used = time.monotonic()

    def _wait(self, work: Any, deadline: float) -> None:
        if self.backend == "gloo":
            # gloo reports completion only through wait(); its timeout closes the channel's pairs
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"{self.prefix}: no time left to wait")
            work.wait(datetime.timedelta(seconds=remaining))
            return
        # NCCL: poll the work's end event so that a closed channel or the deadline ends the
        # wait (a blocking wait could not be interrupted); short sleeps keep the added latency
        # under half a millisecond for a transfer that itself takes a few
        pause = 2e-5
        while not work.is_completed():
            if self.broken:
                raise ChannelBroken(f"{self.prefix} was closed during the transfer")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.prefix}: transfer not complete before the deadline")
            time.sleep(pause)
            pause = min(pause * 2, 5e-4)
        work.wait()  # orders this thread's stream after the transfer; raises the work's error

    def mark_broken(self) -> None:
        """Instant (any thread): no new operation starts on this channel."""
        self.broken = True

    def abort(self) -> None:
        """Blocking: close the process group (aborting what is in flight where the backend can)."""
        self.broken = True
        pg = self.pg
        if pg is not None:
            _abort_pg(pg)
        self._store = None  # our client connection (the receiver's hosted store lives on)


def _abort_pg(pg: Any) -> None:
    for name in ("abort", "shutdown"):
        fn = getattr(pg, name, None)
        if fn is None:
            continue
        try:
            fn()
            return
        except Exception as exc:  # best effort: the channel is being dropped anyway
            logger.debug("process group %s() failed: %r", name, exc)


class _device_guard:
    """``torch.cuda.device(device)`` for CUDA devices with an index; nothing otherwise."""

    def __init__(self, device: torch.device) -> None:
        self._ctx = torch.cuda.device(device) if device.type == "cuda" and device.index is not None else None

    def __enter__(self) -> None:
        if self._ctx is not None:
            self._ctx.__enter__()

    def __exit__(self, *exc: Any) -> None:
        if self._ctx is not None:
            self._ctx.__exit__(*exc)


# ---------------------------------------------------------------------------- the transport
@dataclass
class _Staged:
    payload: torch.Tensor  # flat uint8 on the pool's device
    header: KVFrameHeader
    fault: str | None


@dataclass(frozen=True)
class _SendRequest:
    """What a receiver asks a sender: send ``request_id``'s staged pages over this channel."""

    request_id: str
    sender_id: str
    receiver_id: str
    host: str
    port: int
    prefix: str
    generation: int
    backend: str
    timeout_s: float

    @classmethod
    def parse(cls, obj: Any) -> "_SendRequest":
        """Strict: exact key set, typed and bounded fields (``ValueError`` naming the field)."""
        if not isinstance(obj, dict) or set(obj) != _SEND_REQUEST_KEYS:
            got = sorted(map(str, obj)) if isinstance(obj, dict) else type(obj).__name__
            raise ValueError(f"request: expected the keys {sorted(_SEND_REQUEST_KEYS)}, got {got}")
        for key in ("request_id", "sender_id", "receiver_id", "host", "prefix", "backend"):
            value = obj[key]
            if not isinstance(value, str) or not value or len(value) > max(MAX_REQUEST_ID_LEN, _MAX_NAME_LEN) * 2:
                raise ValueError(f"{key}: expected a short non-empty str, got {value!r:.80}")
        if not obj["prefix"].startswith(_PREFIX_ROOT) or not obj["prefix"].endswith("/"):
            raise ValueError(f"prefix: expected '{_PREFIX_ROOT}.../', got {obj['prefix']!r}")
        for key, lo, hi in (("port", 1, 65535), ("generation", 1, 1 << 62)):
            value = obj[key]
            if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
                raise ValueError(f"{key}: expected an int in [{lo}, {hi}], got {value!r}")
        timeout = obj["timeout_s"]
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout <= 86400:
            raise ValueError(f"timeout_s: expected a number in (0, 86400], got {timeout!r}")
        return cls(**obj)


def _reply(ok: bool, reason: TransferFailure | None = None, message: str = "") -> dict:
    return {"ok": ok, "reason": reason.value if reason is not None else None, "message": message}


class ChannelTransport(KVTransport):
    """KV transfers over pairwise channels (see the module docstring). One instance per
    replica serves both roles: ``export``/``serve_send`` on prefill replicas, ``receive`` on
    decode replicas.

    device: the KV pool's device; it picks the backend (CUDA: NCCL, CPU: gloo) and the
        transport's ``name`` (what tickets say).
    host: this replica's node address: the receiver's store listens there, gloo binds to it.
    identity: how tickets name this replica as a sender (``replica_id`` plus whatever
        ``call_sender`` needs to reach it again, e.g. Serve's app and deployment names).
    call_sender: receiver side, ``async (sender, request) -> reply``: deliver ``request`` to
        the sender replica ``sender`` (from the ticket) and return its ``serve_send`` reply.
    """

    fault_modes = ("flip", "break")

    def __init__(self, device: str | torch.device, *, host: str = "127.0.0.1", identity: dict | None = None,
                 call_sender: SendCall | None = None, config: ChannelConfig | None = None,
                 max_workers: int = 8) -> None:
        try:
            dev = torch.device(device)
        except (RuntimeError, TypeError) as exc:
            raise ValueError(f"device: expected a torch device, got {device!r}") from exc
        if dev.type not in CHANNEL_BACKENDS:
            raise ValueError(f"device: channels move CUDA (NCCL) or CPU (gloo) pools, got {device!r}")
        config = ChannelConfig() if config is None else config
        if not isinstance(config, ChannelConfig):
            raise ValueError(f"config: expected a ChannelConfig, got {type(config).__name__}")
        identity = {"replica_id": "local", **(identity or {})}
        for key, value in identity.items():
            if not isinstance(key, str) or not isinstance(value, str) or not value or len(value) > _MAX_NAME_LEN:
                raise ValueError(f"identity: expected short non-empty str values, got {key!r}: {value!r}")
        if not isinstance(host, str) or not host:
            raise ValueError(f"host: expected this node's address, got {host!r}")
        self.device = dev
        self.backend = CHANNEL_BACKENDS[dev.type]
        self.name = self.backend
        self.host = host
        self.identity = identity
        self.call_sender = call_sender
        self.config = config
        self._executor = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix=f"kv-{self.backend}")
        self._lock = threading.Lock()  # _staged and _outbound (event loop and worker threads)
        self._staged: dict[str, _Staged] = {}
        self._outbound: dict[str, Channel] = {}  # sender side, by receiver replica id
        self._inbound: dict[str, Channel] = {}  # receiver side, by sender replica id (event loop only)
        self._inbound_locks: dict[str, asyncio.Lock] = {}
        self._store: Any = None  # receiver side: the TCPStore this replica hosts
        self._generations = itertools.count(1)
        self._counts: collections.Counter = collections.Counter()
        self._closed = False

    @property
    def replica_id(self) -> str:
        return self.identity["replica_id"]

    # -- sender --------------------------------------------------------------------------
    def export(self, pool: KVPool, request_id: str, *, fault: str | None = None) -> TransferTicket:
        if fault is not None and fault not in self.fault_modes:
            raise ValueError(f"fault: channels inject one of {self.fault_modes}, got {fault!r}")
        if pool.device.type != self.device.type:
            raise TransferError(
                TransferFailure.UNAVAILABLE, f"a {self.backend} channel moves {self.device.type} pools, this one is on "
                f"{pool.device}", request_id,
            )
        header, pages = describe_pages(pool, request_id, checksum_kind="wsum64")
        payload = gather_pages(pool, pages)
        header = replace(header, checksum=payload_checksum(payload))
        if fault == "flip" and payload.numel():
            payload[-1:].bitwise_xor_(0xFF)  # after the checksum: the receiver must notice
        with self._lock:
            self._staged[request_id] = _Staged(payload, header, fault)
        handle = {"header": header.encode(), "sender": {**self.identity, "host": self.host}}
        return TransferTicket(request_id, self.name, header.num_tokens, header.num_pages, header.payload_bytes, handle)

    def discard(self, ticket: TransferTicket) -> None:
        with self._lock:
            self._staged.pop(ticket.request_id, None)

    async def serve_send(self, request: dict) -> dict:
        """Sender side of a transfer, called by the receiver (through ``call_sender``): send
        the staged pages over the requested channel. Returns ``{"ok", "reason", "message"}``."""
        try:
            req = _SendRequest.parse(request)
        except ValueError as exc:
            return _reply(False, TransferFailure.UNAVAILABLE, f"bad send request: {exc}")
        if req.backend != self.backend:
            return _reply(False, TransferFailure.UNAVAILABLE, f"this replica sends over {self.backend}, not {req.backend}")
        if req.sender_id != self.replica_id:  # routed to the wrong replica (ours has gone)
            return _reply(False, TransferFailure.UNAVAILABLE,
                          f"the pages are on replica {req.sender_id}, this is {self.replica_id}")
        with self._lock:
            staged = self._staged.get(req.request_id)
        if staged is None:
            return _reply(False, TransferFailure.LOST, f"no staged pages for {req.request_id!r} (lease ended or already sent)")
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, self._send_blocking, req, staged)

    def _outbound_channel(self, req: _SendRequest) -> Channel:
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

    def _send_blocking(self, req: _SendRequest, staged: _Staged) -> dict:
        deadline = time.monotonic() + req.timeout_s
        try:
            channel = self._outbound_channel(req)
        except ChannelBroken as exc:
            return _reply(False, TransferFailure.UNAVAILABLE, str(exc))
        if not channel.lock.acquire(timeout=req.timeout_s):
            return _reply(False, TransferFailure.UNAVAILABLE, f"channel {channel.prefix} busy")
        try:
            if staged.fault == "break":
                raise ChannelBroken("fault injection: channel broken before sending")
            channel.run(staged.payload, timeout_s=max(deadline - time.monotonic(), 1e-3))
        except Exception as exc:
            self._drop_outbound(req.receiver_id, channel)
            self._counts["channel_failures"] += 1
            logger.warning("KV send of %s over %s failed: %r", req.request_id, channel.prefix, exc)
            return _reply(False, TransferFailure.LOST, f"send failed: {type(exc).__name__}: {exc}")
        finally:
            channel.lock.release()
        with self._lock:  # sent: the staging copy is no longer needed
            if self._staged.get(req.request_id) is staged:
                del self._staged[req.request_id]
        self._counts["channel_sends"] += 1
        self._counts["channel_bytes_sent"] += staged.header.payload_bytes
        return _reply(True)

    def _drop_outbound(self, receiver_id: str, channel: Channel) -> None:
        channel.mark_broken()
        with self._lock:
            if self._outbound.get(receiver_id) is channel:
                del self._outbound[receiver_id]
        channel.abort()

    # -- receiver ------------------------------------------------------------------------
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
        if not isinstance(handle, dict) or set(handle) != {"header", "sender"} or not isinstance(handle["header"], bytes):
            raise TransferError(TransferFailure.MALFORMED, "ticket: expected a handle {header: bytes, sender: {...}}", rid)
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

    async def receive(self, ticket: TransferTicket, pool: KVPool) -> list[int]:
        header, sender = self._read_ticket(ticket)
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

    async def _pull(self, header: KVFrameHeader, sender: dict, pool: KVPool, pages: list[int]) -> None:
        loop = asyncio.get_running_loop()
        rid, cfg = header.request_id, self.config
        sender_id = sender["replica_id"]
        budget = cfg.transfer_budget_s(header.payload_bytes)
        lock = self._inbound_locks.setdefault(sender_id, asyncio.Lock())
        try:
            await asyncio.wait_for(lock.acquire(), timeout=cfg.connect_timeout_s + budget)
        except asyncio.TimeoutError:
            self._counts["channel_failures"] += 1
            raise TransferError(TransferFailure.UNAVAILABLE, f"the channel from {sender_id} stayed busy", rid) from None
        channel: Channel | None = None
        try:
            channel = await self._inbound_channel(sender_id, pool.device)
            timeout = budget + (cfg.connect_timeout_s if channel.pg is None else 0.0)
            payload = torch.empty(header.payload_bytes, dtype=torch.uint8, device=pool.device)
            request = {
                "request_id": rid, "sender_id": sender_id, "receiver_id": self.replica_id, "host": self.host,
                "port": int(self._store.port), "prefix": channel.prefix, "generation": channel.generation,
                "backend": self.backend, "timeout_s": timeout,
            }
            reply = asyncio.ensure_future(self.call_sender(sender, request))
            recv = loop.run_in_executor(self._executor, functools.partial(channel.run, payload, timeout))
            try:
                await self._await_transfer(channel, sender_id, recv, reply, timeout, rid)
            finally:
                if not reply.done():
                    reply.cancel()
            got = await loop.run_in_executor(self._executor, payload_checksum, payload)
            if got != header.checksum:
                self._drop_inbound(sender_id, channel)  # two transfers may have crossed: resynchronise
                raise TransferError(
                    TransferFailure.CHECKSUM,
                    f"payload wsum64 {got:016x} (computed here) does not match the sender's {header.checksum:016x}", rid,
                )
            await loop.run_in_executor(self._executor, scatter_pages, pool, pages, payload)
            self._counts["channel_receives"] += 1
            self._counts["channel_bytes_received"] += header.payload_bytes
        except TransferError:
            self._counts["channel_failures"] += 1
            raise
        except asyncio.CancelledError:  # the request went away mid-transfer: do not reuse a busy channel
            if channel is not None:
                self._drop_inbound(sender_id, channel)
            raise
        except Exception as exc:  # anything else (a device error in the scatter, ...) ends this transfer
            logger.exception("KV receive of %s failed", rid)
            if channel is not None:
                self._drop_inbound(sender_id, channel)
            self._counts["channel_failures"] += 1
            raise TransferError(TransferFailure.LOST, f"{type(exc).__name__}: {exc}", rid) from exc
        finally:
            lock.release()

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

    # -- both ----------------------------------------------------------------------------
    def counters(self) -> dict[str, int]:
        with self._lock:
            open_out = sum(not c.broken for c in self._outbound.values())
            staged = len(self._staged)
        keys = ("channel_sends", "channel_receives", "channel_failures", "channels_opened",
                "channel_bytes_sent", "channel_bytes_received")
        out = {k: int(self._counts[k]) for k in keys}
        out["channels_open"] = open_out + sum(not c.broken for c in self._inbound.values())
        out["channel_staged"] = staged  # staging copies not yet sent or discarded
        return out

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        with self._lock:
            channels = list(self._outbound.values()) + list(self._inbound.values())
            self._outbound.clear()
            self._staged.clear()
        self._inbound.clear()
        for ch in channels:
            ch.mark_broken()
        for ch in channels:
            ch.abort()
        self._executor.shutdown(wait=False, cancel_futures=True)
        self._store = None


def _reply_failure(reply: asyncio.Future) -> tuple[TransferFailure | None, str]:
    """(reason, message) of a failed ``serve_send`` reply, (None, "") for success."""
    if reply.cancelled():
        return TransferFailure.LOST, "the call was cancelled"
    exc = reply.exception()
    if exc is not None:  # the sender replica died, could not be reached, ...
        return TransferFailure.LOST, f"{type(exc).__name__}: {exc}"
    obj = reply.result()
    if not isinstance(obj, dict) or not isinstance(obj.get("ok"), bool):
        return TransferFailure.LOST, f"unexpected reply {type(obj).__name__}"
    if obj["ok"]:
        return None, ""
    try:
        reason = TransferFailure(obj.get("reason"))
    except ValueError:
        reason = TransferFailure.LOST
    if reason not in _REPLY_REASONS:
        reason = TransferFailure.LOST
    return reason, str(obj.get("message"))[:500]


def _describe(x: object) -> str:
    if isinstance(x, torch.Tensor):
        return f"a {x.dtype} tensor of shape {tuple(x.shape)}"
    return type(x).__name__
