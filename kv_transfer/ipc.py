"""Same-GPU KV transfers over CUDA IPC: the decode replica maps the prefill replica's KV pool
and copies the request's pages device to device.

Why: a prefill and a decode replica sharing one GPU (``num_gpus: 0.5`` each, the default
deployment on a one-GPU machine) cannot open an NCCL channel (NCCL refuses two ranks on one
device), and the object store moves about 0.5 GB/s through host memory (30 s for the 17 GB of
a 128K-token request). Here the bytes never leave the GPU.

One transfer:
1. ``export`` (prefill replica, after prefill): waits until the prefill's writes are
   done (an event on the current stream), describes the pages (``describe_pages``,
   ``checksum_kind="none"``) and returns a ticket holding the msgpack header, the sender's
   identity and process id, the physical GPU's UUID, the sender's page ids and pool size, and
   CUDA IPC handles of the pool's K and V storages (``UntypedStorage._share_cuda_``, taken
   once per pool and cached: each share wraps the storage for torch's cross-process refcount).
   Nothing is copied: the pages stay valid under the prefill lease, which lasts until the
   decode replica acknowledges.
2. ``receive`` (decode replica): checks the ticket strictly (``MALFORMED``), the geometry
   (``SHAPE``) and that its own pool is on the same physical GPU (by UUID: device indices
   differ between processes under ``CUDA_VISIBLE_DEVICES``), else ``UNAVAILABLE`` or the
   fallback below. It reserves pages (``adopt_pages``), opens the sender's storages
   (``UntypedStorage._new_shared_cuda``, once per (sender replica, storage handle), cached),
   copies remote pages into its own with ``index_select``/``index_copy_`` on integer word
   views (exact bytes, bf16 and fp8 alike) on a side stream, at most ``copy_chunk_bytes`` of
   temporaries at a time, and synchronizes before it returns, so the acknowledgement that
   lets the prefill replica free its pages implies the copy is complete. Any failure
   releases the reserved pages and raises ``TransferError``.

No checksum: nothing sits between the bytes read and the bytes written (no wire, no staging
buffer, no reordering), so a CRC or the channel's on-device sum would re-read the whole
payload to check one copy kernel. The header says so (``checksum_kind="none"``).

Fallback (``auto`` on CUDA): with ``fallback`` (the NCCL channel's sender on a prefill
replica, its receiver on a decode replica) pages also move between pools on different GPUs,
so one deployment works whether Ray puts the pair on one GPU or two. It is lazy: the ticket carries the IPC part only, and a receiver on another GPU asks
the sender (``call_sender``: the prefill replica's ``stage_pages``, which runs
``serve_stage``) to export the pages over the fallback, then receives that ticket. Exporting
both up front would stage a full copy of every request's pages (the channel's staging
buffer) even when the pair shares a GPU, the very case this transport is for.

The lease and the clock: the sender's pages are read in place, so they must still be the
request's when the copy ends. The prefill replica frees them when the ingress closes the lease
(after ``adopted``: the copy is done) or after ``lease_timeout_s``; the ticket carries that
deadline (``expires_at``, wall clock, both ends being on one host) and the receiver neither
starts nor acknowledges a copy past it (``LOST``).

A sender that goes away: CUDA calls freeing an exported allocation before every importer has
closed it undefined behaviour, and does not say what an open mapping of an exited process
does (keeps its memory allocated, or dangles). Either way a mapping whose sender is gone must
be closed and never read again: ``sweep`` (at every receive, and from the decode replica's
health check) closes mappings idle for ``idle_close_s`` or whose sender process no longer
exists; a copy checks that its sender is still alive before it acknowledges. See
RELIABILITY.md for what a sender dying during a copy can do.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import math
import os
import threading
import time
import weakref
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from kv_cache.pool import KVPool
from kv_cache.tensors import copy_word, pool_page_words

from .transfer import (
    KVFrameHeader,
    KVReceiver,
    KVSender,
    KVTransport,
    TransferError,
    TransferFailure,
    TransferTicket,
    adopt_pages,
    check_geometry,
    describe_pages,
)
from .wire import StagePages, StageReply, reply_reason

IPC_NAME = "cuda_ipc"
_MAX_NAME_LEN = 256
_MAX_HANDLE_BYTES = 4096
_MAX_INT = 1 << 62
_HANDLE_KEYS = frozenset(
    {"header", "sender", "device_uuid", "pid", "pidns", "pool_pages", "pages", "k", "v", "fallback", "expires_at"}
)
_STORAGE_KEYS = frozenset({"handle", "size", "offset", "ref_counter", "ref_counter_offset", "tensor_offset"})
_REPLY_REASONS = (TransferFailure.LOST, TransferFailure.UNAVAILABLE)
_BROKEN_UUID = "fault-injection:no-such-gpu"

# async (sender identity from the ticket, stage request) -> the sender's serve_stage reply
StageCall = Callable[[dict, StagePages], Awaitable[Any]]

# Storages this process exported, by (IPC handle, offset): CUDA refuses to open a handle in the
# process that made it, so a receiver in the sender's own process (tests, single-process
# tools) reads the storage directly. Weak: the exporting transport holds the tensors.
_LOCAL_EXPORTS: "weakref.WeakValueDictionary[tuple[bytes, int], torch.Tensor]" = weakref.WeakValueDictionary()


def device_uuid(device: str | torch.device) -> str | None:
    """The physical GPU's UUID for a CUDA device of this process, ``None`` for other devices."""
    dev = torch.device(device)
    if dev.type != "cuda":
        return None
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    return str(torch.cuda.get_device_properties(index).uuid)


def _pid_namespace() -> str | None:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return None


def _process_alive(pid: int, pidns: str | None) -> bool | None:
    """Whether process ``pid`` of pid namespace ``pidns`` exists; ``None`` when this process
    cannot tell (another namespace: the same number may name someone else here)."""
    if pidns is None or pidns != _pid_namespace():
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        pass
    try:  # a process that exited but was not reaped yet still answers kill(0): its state says
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    return state not in (b"Z", b"X")


# ---------------------------------------------------------------------------- ticket parts
@dataclasses.dataclass(frozen=True)
class _Storage:
    """One shared storage (K or V) of the sender's pool: what ``_new_shared_cuda`` needs, and
    where the pool tensor starts in it (bytes)."""

    handle: bytes
    size: int
    offset: int
    ref_counter: bytes
    ref_counter_offset: int
    tensor_offset: int


@dataclasses.dataclass(frozen=True)
class _IpcTicket:
    header: KVFrameHeader
    sender: dict
    device_uuid: str
    pid: int
    pidns: str | None
    pool_pages: int
    pages: list[int]
    k: _Storage
    v: _Storage
    fallback: str | None
    expires_at: float | None

    @property
    def sender_id(self) -> str:
        return self.sender["replica_id"]

    @property
    def region_bytes(self) -> int:
        """Bytes of the sender's K (or V) tensor: ``[layers, pool_pages, page_size, heads, head_dim]``."""
        h = self.header
        elem = torch.empty((), dtype=h.torch_dtype).element_size()
        return h.num_layers * self.pool_pages * h.page_size * h.num_kv_heads * h.head_dim * elem


def _malformed(message: str, rid: str | None) -> TransferError:
    return TransferError(TransferFailure.MALFORMED, f"ticket: {message}", rid)


def _int_field(obj: dict, key: str, minimum: int, rid: str | None) -> int:
    value = obj[key]
    if isinstance(value, bool) or not isinstance(value, int) or not minimum <= value < _MAX_INT:
        raise _malformed(f"{key}: expected an int >= {minimum}, got {value!r:.80}", rid)
    return value


def _bytes_field(obj: dict, key: str, rid: str | None) -> bytes:
    value = obj[key]
    if not isinstance(value, bytes) or not 0 < len(value) <= _MAX_HANDLE_BYTES:
        raise _malformed(f"{key}: expected 1 to {_MAX_HANDLE_BYTES} bytes", rid)
    return value


def _short_str(value: Any) -> bool:
    return isinstance(value, str) and 0 < len(value) <= _MAX_NAME_LEN


def _parse_storage(obj: Any, part: str, rid: str | None) -> _Storage:
    if not isinstance(obj, dict) or set(obj) != _STORAGE_KEYS:
        raise _malformed(f"{part}: expected a map with the keys {sorted(_STORAGE_KEYS)}", rid)
    return _Storage(
        handle=_bytes_field(obj, "handle", rid),
        size=_int_field(obj, "size", 1, rid),
        offset=_int_field(obj, "offset", 0, rid),
        ref_counter=_bytes_field(obj, "ref_counter", rid),
        ref_counter_offset=_int_field(obj, "ref_counter_offset", 0, rid),
        tensor_offset=_int_field(obj, "tensor_offset", 0, rid),
    )


def parse_ticket(ticket: Any, name: str = IPC_NAME) -> _IpcTicket:
    """Strict reading of a cuda_ipc ticket: ``MALFORMED`` for anything but the exact layout
    ``export`` writes, ``UNAVAILABLE`` for another transport's ticket, ``REQUEST_MISMATCH``
    when the header names another request. Reads no device memory."""
    rid = getattr(ticket, "request_id", None)
    rid = rid if isinstance(rid, str) else None
    if not isinstance(ticket, TransferTicket):
        raise TransferError(TransferFailure.MALFORMED, f"ticket: expected a TransferTicket, got {type(ticket).__name__}")
    if ticket.transport != name:
        raise TransferError(TransferFailure.UNAVAILABLE, f"ticket: a {ticket.transport!r} transfer, this receiver takes {name!r}", rid)
    handle = ticket.handle
    if not isinstance(handle, dict) or set(handle) != _HANDLE_KEYS:
        got = sorted(map(str, handle)) if isinstance(handle, dict) else type(handle).__name__
        raise _malformed(f"handle: expected the keys {sorted(_HANDLE_KEYS)}, got {got}", rid)
    if not isinstance(handle["header"], bytes):
        raise _malformed("header: expected msgpack bytes", rid)
    header = KVFrameHeader.decode(handle["header"])
    if header.checksum_kind != "none":
        raise _malformed(f"checksum_kind: same-GPU copies carry 'none', got {header.checksum_kind!r}", rid)
    if header.request_id != ticket.request_id:
        raise TransferError(TransferFailure.REQUEST_MISMATCH,
                            f"ticket for {ticket.request_id!r} carries the header of {header.request_id!r}", rid)
    sender = handle["sender"]
    if (not isinstance(sender, dict) or "replica_id" not in sender or len(sender) > 16
            or not all(_short_str(k) and _short_str(v) for k, v in sender.items())):
        raise _malformed("sender: expected short str fields incl. replica_id", rid)
    if not _short_str(handle["device_uuid"]):
        raise _malformed(f"device_uuid: expected a GPU UUID string, got {handle['device_uuid']!r:.80}", rid)
    pidns = handle["pidns"]
    if pidns is not None and not _short_str(pidns):
        raise _malformed("pidns: expected None or a short str", rid)
    pool_pages = _int_field(handle, "pool_pages", 1, rid)
    pages = handle["pages"]
    if (not isinstance(pages, list) or len(pages) != header.num_pages
            or not all(type(p) is int and 0 <= p < pool_pages for p in pages)):
        raise _malformed(f"pages: expected {header.num_pages} page ids in [0, {pool_pages})", rid)
    fallback = handle["fallback"]
    if fallback is not None and not _short_str(fallback):
        raise _malformed("fallback: expected None or a transport name", rid)
    expires_at = handle["expires_at"]
    if expires_at is not None and (isinstance(expires_at, bool) or not isinstance(expires_at, (int, float))
                                   or not math.isfinite(expires_at) or expires_at <= 0):
        raise _malformed("expires_at: expected None or a positive wall-clock time", rid)
    spec = _IpcTicket(
        header=header, sender=dict(sender), device_uuid=handle["device_uuid"], pid=_int_field(handle, "pid", 1, rid),
        pidns=pidns, pool_pages=pool_pages, pages=list(pages), k=_parse_storage(handle["k"], "k", rid),
        v=_parse_storage(handle["v"], "v", rid), fallback=fallback,
        expires_at=float(expires_at) if expires_at is not None else None,
    )
    for part, storage in (("k", spec.k), ("v", spec.v)):
        if storage.tensor_offset + spec.region_bytes > storage.size:
            raise _malformed(f"{part}: a pool of {pool_pages} pages ({spec.region_bytes} bytes at offset "
                             f"{storage.tensor_offset}) does not fit the {storage.size}-byte storage", rid)
    return spec


def _reply(ok: bool, reason: TransferFailure | None = None, message: str = "", ticket: Any = None) -> StageReply:
    return StageReply(ok, reason.value if reason is not None else None, message, ticket)


def _staged_ticket(reply: Any, transport: str, rid: str) -> TransferTicket:
    """The fallback ticket in a ``serve_stage`` reply, or the ``TransferError`` it reports."""
    reason, message = reply_reason(reply, StageReply)
    if reason is not None:
        if not isinstance(reply, StageReply):
            raise TransferError(reason, f"stage: {message}", rid)
        raise TransferError(reason, f"sender: {message}", rid)
    ticket = reply.ticket
    if not isinstance(ticket, TransferTicket) or ticket.transport != transport or ticket.request_id != rid:
        raise TransferError(TransferFailure.LOST, f"stage: expected a {transport!r} ticket for {rid!r}, "
                            f"got {type(ticket).__name__}", rid)
    return ticket


# ---------------------------------------------------------------------------- copying
def _sender_words(base: torch.Tensor, storage: _Storage, spec: _IpcTicket, word: torch.dtype) -> torch.Tensor:
    """The sender's K or V storage as ``[layers, pool_pages, page_words]`` of ``word``, from the
    uint8 view of its whole storage (pages copied whole: V's layout inside a page, token-major in
    FP8 pools, is the same at both ends since it follows from the dtype)."""
    h = spec.header
    region = base[storage.tensor_offset: storage.tensor_offset + spec.region_bytes]
    return region.view(word).view(h.num_layers, spec.pool_pages, -1)


def copy_pages(src: torch.Tensor, dst: torch.Tensor, src_pages: torch.Tensor, dst_pages: torch.Tensor,
               chunk_bytes: int) -> None:
    """``dst[:, dst_pages[i]] = src[:, src_pages[i]]`` for pool-shaped ``[layers, pages, ...]``
    tensors, through gathered temporaries of at most ``chunk_bytes`` (at least one page of one
    layer): one request can be a good part of the GPU, its copy must not need as much again."""
    if src.dtype != dst.dtype or src.shape[0] != dst.shape[0] or src.shape[2:] != dst.shape[2:]:
        raise ValueError(f"src: expected [layers, *, ...] like dst {tuple(dst.shape)} {dst.dtype}, "
                         f"got {tuple(src.shape)} {src.dtype}")
    if src_pages.shape != dst_pages.shape or src_pages.dim() != 1:
        raise ValueError(f"src_pages: expected a 1-D index like dst_pages {tuple(dst_pages.shape)}, "
                         f"got {tuple(src_pages.shape)}")
    if isinstance(chunk_bytes, bool) or not isinstance(chunk_bytes, int) or chunk_bytes < 1:
        raise ValueError(f"chunk_bytes: expected a positive int, got {chunk_bytes!r}")
    layers, n = src.shape[0], src_pages.numel()
    if n == 0:
        return
    page_bytes = src[0, 0].numel() * src.element_size()
    pages_per_chunk = max(1, min(n, chunk_bytes // page_bytes))
    layers_per_chunk = 1
    if pages_per_chunk == n:  # a whole layer fits: take several layers per kernel
        layers_per_chunk = max(1, min(layers, chunk_bytes // (page_bytes * n)))
    for l0 in range(0, layers, layers_per_chunk):
        l1 = min(layers, l0 + layers_per_chunk)
        for p0 in range(0, n, pages_per_chunk):
            p1 = min(n, p0 + pages_per_chunk)
            dst[l0:l1].index_copy_(1, dst_pages[p0:p1], src[l0:l1].index_select(1, src_pages[p0:p1]))


@contextlib.contextmanager
def _copy_stream(device: torch.device):
    """CUDA: a side stream, ordered after the work already queued on the current stream (a
    decode step may still read pages freed just before we took them); yields its
    ``synchronize``. Other devices: nothing to order."""
    if device.type != "cuda":
        yield lambda: None
        return
    with torch.cuda.device(device):
        stream = torch.cuda.Stream(device=device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            yield stream.synchronize


@dataclasses.dataclass
class _Mapping:
    """A sender storage opened in this process (``base``: uint8 over the whole storage)."""

    base: torch.Tensor
    sender_id: str
    pid: int
    pidns: str | None
    users: int = 0
    last_used: float = dataclasses.field(default_factory=time.monotonic)


@dataclasses.dataclass
class _SharedPool:
    """A pool's K and V storages as shared once (ticket parts), and what keeps them registered."""

    uuid: str
    k: dict
    v: dict
    keep: tuple


# ---------------------------------------------------------------------------- the transport
class CudaIpcTransport(KVTransport):
    """KV transfers between pools on one physical GPU over CUDA IPC (see the module
    docstring). One instance per replica serves both roles: ``export``/``serve_stage`` on
    prefill replicas, ``receive`` on decode replicas.

    identity: how tickets name this replica as a sender (``replica_id`` plus what
        ``call_sender`` needs to reach it, e.g. Serve's app and deployment names).
    fallback: the transport for pools on different GPUs, this replica's end of it (``auto``:
        the NCCL channel's ``ChannelSender`` on a prefill replica, ``ChannelReceiver`` on a
        decode replica); ``None``: such a transfer fails ``UNAVAILABLE``. The transport owns
        it (``close`` closes it).
    call_sender: receiver side, ``async (sender, request) -> reply``: deliver a stage request
        to the sender replica and return its ``serve_stage`` reply (needed for the fallback).
    lease_timeout_s: sender side: how long the sender keeps exported pages at most (the
        prefill lease); tickets carry the deadline. ``None``: no deadline.
    copy_chunk_bytes: receiver side: the most temporary device memory one copy step takes.
    idle_close_s: receiver side: mappings unused this long are closed.
    stage_timeout_s: receiver side: how long the sender may take to stage over the fallback.
    uuid_of: ``device -> physical GPU UUID or None`` (``device_uuid``; tests substitute it).
    """

    name = IPC_NAME
    fault_modes = ("break",)  # the ticket names a GPU nobody has and offers no fallback
    reads_pages_after_export = True  # the receiver copies them out of this pool
    releases_after_receive = True  # the copy leaves the sender's lease to the receiver's release

    def __init__(self, *, identity: dict | None = None, fallback: KVSender | KVReceiver | None = None,
                 call_sender: StageCall | None = None, lease_timeout_s: float | None = None,
                 copy_chunk_bytes: int = 256 << 20, idle_close_s: float = 60.0, stage_timeout_s: float = 30.0,
                 uuid_of: Callable[[torch.device], str | None] | None = None, max_workers: int = 4) -> None:
        identity = {"replica_id": "local", **(identity or {})}
        for key, value in identity.items():
            if not _short_str(key) or not _short_str(value):
                raise ValueError(f"identity: expected short non-empty str values, got {key!r}: {value!r}")
        if fallback is not None and (not isinstance(fallback, (KVSender, KVReceiver)) or fallback.name == self.name):
            raise ValueError(f"fallback: expected another transport's sender or receiver, got {fallback!r}")
        if call_sender is not None and not callable(call_sender):
            raise ValueError(f"call_sender: expected an async callable, got {type(call_sender).__name__}")
        for arg, value in (("lease_timeout_s", lease_timeout_s), ("idle_close_s", idle_close_s),
                           ("stage_timeout_s", stage_timeout_s)):
            if value is None and arg == "lease_timeout_s":
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
                raise ValueError(f"{arg}: expected a positive number, got {value!r}")
        if isinstance(copy_chunk_bytes, bool) or not isinstance(copy_chunk_bytes, int) or copy_chunk_bytes < 1:
            raise ValueError(f"copy_chunk_bytes: expected a positive int, got {copy_chunk_bytes!r}")
        if uuid_of is not None and not callable(uuid_of):
            raise ValueError(f"uuid_of: expected a callable, got {type(uuid_of).__name__}")
        if isinstance(max_workers, bool) or not isinstance(max_workers, int) or max_workers < 1:
            raise ValueError(f"max_workers: expected a positive int, got {max_workers!r}")
        self.identity = identity
        self.fallback = fallback
        self.call_sender = call_sender
        self.lease_timeout_s = lease_timeout_s
        self.copy_chunk_bytes = copy_chunk_bytes
        self.idle_close_s = float(idle_close_s)
        self.stage_timeout_s = float(stage_timeout_s)
        self._uuid_of = uuid_of or device_uuid
        self._executor = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="kv-ipc")
        self._lock = threading.Lock()  # the dicts below (event loop and worker threads)
        self._share_lock = threading.Lock()  # a pool's first exports, concurrent: share it once
        self._shared: "weakref.WeakKeyDictionary[KVPool, _SharedPool]" = weakref.WeakKeyDictionary()
        self._exported: dict[str, threading.Lock] = {}  # sender: request id -> its staging lock
        self._staged: dict[str, TransferTicket] = {}  # sender: fallback tickets staged for receivers
        self._mappings: dict[tuple[str, bytes, int], _Mapping] = {}  # receiver: opened sender storages
        self._counts: collections.Counter = collections.Counter()
        self._closed = False
        self.device_error: str | None = None  # a CUDA error after a failed copy: this process's context is unusable

    @property
    def replica_id(self) -> str:
        return self.identity["replica_id"]

    # -- sender --------------------------------------------------------------------------
    def export(self, pool: KVPool, request_id: str, *, fault: str | None = None) -> TransferTicket:
        if fault is not None and fault not in self.fault_modes:
            raise ValueError(f"fault: cuda_ipc injects one of {self.fault_modes}, got {fault!r}")
        if self._closed:
            raise TransferError(TransferFailure.UNAVAILABLE, "the transport is closed (replica stopping)", request_id)
        header, pages = describe_pages(pool, request_id, checksum_kind="none")
        shared = self._share_pool(pool)
        if pool.device.type == "cuda":
            # The prefill wrote the pages on the current (default) stream and read the first token
            # back, so they are normally done; this makes it hold whatever ran before. An event
            # on the stream, not a device sync: that would also wait for the next batch, which
            # the batcher may be running already.
            written = torch.cuda.Event()
            written.record(torch.cuda.current_stream(pool.device))
            written.synchronize()
        handle = {
            "header": header.encode(),
            "sender": dict(self.identity),
            "device_uuid": shared.uuid,
            "pid": os.getpid(),
            "pidns": _pid_namespace(),
            "pool_pages": pool.num_pages,
            "pages": list(pages),
            "k": dict(shared.k),
            "v": dict(shared.v),
            "fallback": self.fallback.name if self.fallback is not None else None,
            "expires_at": time.time() + self.lease_timeout_s if self.lease_timeout_s is not None else None,
        }
        if fault == "break":
            handle.update(device_uuid=_BROKEN_UUID, fallback=None)
        with self._lock:
            self._exported[request_id] = threading.Lock()
            self._counts["ipc_exports"] += 1
        return TransferTicket(request_id, self.name, header.num_tokens, header.num_pages, header.payload_bytes, handle)

    def _share_pool(self, pool: KVPool) -> _SharedPool:
        # once per storage: every share wraps the storage again for torch's refcount
        with self._share_lock:
            with self._lock:
                shared = self._shared.get(pool)
            if shared is not None:
                return shared
            uuid = self._uuid_of(pool.device)
            if not _short_str(uuid):
                raise TransferError(TransferFailure.UNAVAILABLE,
                                    f"cuda_ipc shares pools on CUDA devices, this one is on {pool.device}")
            (k, keep_k), (v, keep_v) = self._share_storage(pool.k_raw), self._share_storage(pool.v_raw)
            shared = _SharedPool(uuid, k, v, (keep_k, keep_v))
            with self._lock:
                self._shared[pool] = shared
            return shared

    def _share_storage(self, tensor: torch.Tensor) -> tuple[dict, Any]:
        """The ticket part for ``tensor``'s storage, and what must stay alive with the pool."""
        if tensor.device.type != "cuda":
            raise TransferError(TransferFailure.UNAVAILABLE, f"cuda_ipc shares CUDA pools, this one is on {tensor.device}")
        storage = tensor.untyped_storage()
        try:
            _dev, handle, size, offset, ref_counter, ref_counter_offset, _event, _sync = storage._share_cuda_()
        except Exception as exc:  # e.g. an allocator that cannot export (cudaMallocAsync backend)
            raise TransferError(TransferFailure.UNAVAILABLE, f"cannot share the KV pool over CUDA IPC: "
                                f"{type(exc).__name__}: {exc}; use transport nccl or object_store") from None
        if not handle or not ref_counter:
            raise TransferError(TransferFailure.UNAVAILABLE, "torch gave no CUDA IPC handle for the pool")
        part = {"handle": bytes(handle), "size": int(size), "offset": int(offset), "ref_counter": bytes(ref_counter),
                "ref_counter_offset": int(ref_counter_offset),
                "tensor_offset": tensor.storage_offset() * tensor.element_size()}
        base = torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(storage, 0, (int(size),), (1,))
        _LOCAL_EXPORTS[(part["handle"], part["offset"])] = base
        return part, base

    def discard(self, ticket: TransferTicket) -> None:
        """The lease ended: forget the export, and drop a fallback staging of it. Waits for a
        staging that is gathering the pages right now, since the caller frees them next."""
        rid = ticket.request_id
        with self._lock:
            lock = self._exported.pop(rid, None)
        if lock is not None:
            with lock:
                pass
        with self._lock:
            staged = self._staged.pop(rid, None)
        if staged is not None and self.fallback is not None:
            self.fallback.discard(staged)

    @property
    def serves_sends(self) -> bool:
        """Sends go over the fallback channel, where there is one."""
        return isinstance(self.fallback, KVSender) and self.fallback.serves_sends

    async def serve_send(self, request: Any) -> Any:
        """A receiver on another GPU pulls staged pages over the fallback channel."""
        if not isinstance(self.fallback, KVSender):
            return await super().serve_send(request)
        return await self.fallback.serve_send(request)

    serves_stages = True  # without a fallback it refuses each stage itself

    def health_error(self) -> str | None:
        return self.device_error

    def serve_stage(self, pool: KVPool, request: StagePages) -> StageReply:
        """Sender side of a fallback transfer (blocking: run it in a worker thread): export the
        pages of an exported request, still under its lease, over ``fallback`` for a receiver on
        another GPU. An ``ok`` reply carries the fallback's ticket."""
        try:
            req = StagePages.parse(request)
            rid, sender_id, transport = req.request_id, req.sender_id, req.transport
        except ValueError as exc:
            return _reply(False, TransferFailure.UNAVAILABLE, f"bad stage request: {exc}")
        if not isinstance(self.fallback, KVSender) or transport != self.fallback.name:
            have = self.fallback.name if self.fallback is not None else None
            return _reply(False, TransferFailure.UNAVAILABLE, f"this replica stages over {have!r}, not {transport!r}")
        if sender_id != self.replica_id:  # routed to the wrong replica (ours has gone)
            return _reply(False, TransferFailure.UNAVAILABLE, f"the pages are on replica {sender_id}, this is {self.replica_id}")
        with self._lock:
            lock = self._exported.get(rid)
        if lock is None:
            return _reply(False, TransferFailure.LOST, f"no exported pages for {rid!r} (lease ended)")
        with lock:
            with self._lock:
                if self._exported.get(rid) is not lock:
                    return _reply(False, TransferFailure.LOST, f"the lease of {rid!r} ended")
            try:
                ticket = self.fallback.export(pool, rid)
            except TransferError as exc:
                reason = exc.reason if exc.reason in _REPLY_REASONS else TransferFailure.LOST
                return _reply(False, reason, f"staging over {transport}: {exc.detail}")
            except Exception as exc:
                return _reply(False, TransferFailure.LOST, f"staging over {transport}: {type(exc).__name__}: {exc}")
            with self._lock:
                self._staged[rid] = ticket
                self._counts["ipc_stages"] += 1
        return _reply(True, ticket=ticket)

    # -- receiver ------------------------------------------------------------------------
    async def receive(self, ticket: TransferTicket, pool: KVPool) -> list[int]:
        spec = parse_ticket(ticket, self.name)
        rid = spec.header.request_id
        if self._closed:
            raise TransferError(TransferFailure.UNAVAILABLE, "the transport is closed (replica stopping)", rid)
        check_geometry(spec.header, pool)
        self.sweep()
        local = self._uuid_of(pool.device)
        if local is not None and local == spec.device_uuid:
            return await self._receive_mapped(spec, pool)
        if (isinstance(self.fallback, KVReceiver) and spec.fallback == self.fallback.name
                and self.call_sender is not None):
            return await self._receive_via_fallback(spec, pool)
        self._counts["ipc_failures"] += 1
        offer = (f"; the sender offers {spec.fallback!r}, this replica has "
                 f"{self.fallback.name if self.fallback is not None else None!r}" if spec.fallback else "")
        raise TransferError(TransferFailure.UNAVAILABLE,
                            f"the pages are on GPU {spec.device_uuid}, this pool on {local or pool.device}{offer}", rid)

    async def _receive_mapped(self, spec: _IpcTicket, pool: KVPool) -> list[int]:
        rid = spec.header.request_id
        if spec.expires_at is not None and time.time() >= spec.expires_at:
            self._counts["ipc_failures"] += 1
            raise TransferError(TransferFailure.LOST, "the prefill lease has expired: its pages may be reused", rid)
        pages = adopt_pages(pool, spec.header)
        loop = asyncio.get_running_loop()
        try:
            copy = loop.run_in_executor(self._executor, self._copy_blocking, spec, pool, pages)
        except RuntimeError:  # executor shut down: closing
            pool.release(rid)
            raise TransferError(TransferFailure.UNAVAILABLE, "the transport is closed (replica stopping)", rid) from None
        try:
            await asyncio.shield(copy)
        except asyncio.CancelledError:
            # The copy may still be writing into the reserved pages. Hand them back only once
            # it is done, and before the caller sees the cancellation: its cleanup frees what
            # the request holds, and a page freed mid-copy could be taken by another request.
            while not copy.done():
                try:
                    await asyncio.wait({copy})
                except asyncio.CancelledError:
                    pass
            if not copy.cancelled():
                copy.exception()  # retrieved: the request is gone, its copy's outcome with it
            pool.release(rid)
            raise
        except TransferError as exc:
            pool.release(rid)
            self._counts["ipc_failures"] += 1
            if exc.request_id is None:
                raise TransferError(exc.reason, exc.detail, rid) from None
            raise
        except Exception as exc:
            pool.release(rid)
            self._counts["ipc_failures"] += 1
            self._check_device(pool.device)
            raise TransferError(TransferFailure.LOST, f"copy failed: {type(exc).__name__}: {exc}", rid) from exc
        # the copy read the sender's pages in place: they must have been the request's until now
        late = spec.expires_at is not None and time.time() >= spec.expires_at
        if late or _process_alive(spec.pid, spec.pidns) is False:
            pool.release(rid)
            self._counts["ipc_failures"] += 1
            why = "the prefill lease expired" if late else f"the sender process {spec.pid} exited"
            raise TransferError(TransferFailure.LOST, f"{why} during the copy: the pages read may be stale", rid)
        self._counts["ipc_receives"] += 1
        self._counts["ipc_bytes_received"] += spec.header.payload_bytes
        return pages

    def _copy_blocking(self, spec: _IpcTicket, pool: KVPool, pages: list[int]) -> None:
        h = spec.header
        if not pages:
            return
        page_bytes = h.page_size * h.num_kv_heads * h.head_dim * torch.empty((), dtype=h.torch_dtype).element_size()
        word = copy_word(page_bytes, spec.k.tensor_offset, spec.v.tensor_offset)
        mappings: list[_Mapping] = []
        try:
            for part in (spec.k, spec.v):
                mappings.append(self._map(spec, part, pool.device))
            sources = [_sender_words(m.base, part, spec, word) for m, part in zip(mappings, (spec.k, spec.v))]
            with _copy_stream(pool.device) as synchronize:
                src_index = torch.tensor(spec.pages, dtype=torch.long, device=pool.device)
                dst_index = torch.tensor(pages, dtype=torch.long, device=pool.device)
                for src, dst in zip(sources, pool_page_words(pool, word)):
                    copy_pages(src, dst, src_index, dst_index, self.copy_chunk_bytes)
                synchronize()
        finally:
            with self._lock:
                now = time.monotonic()
                for m in mappings:
                    m.users -= 1
                    m.last_used = now

    def _map(self, spec: _IpcTicket, part: _Storage, device: torch.device) -> _Mapping:
        """The sender's storage ``part`` opened here (cached), marked in use."""
        key = (spec.sender_id, part.handle, part.offset)
        with self._lock:
            mapping = self._mappings.get(key)
            if mapping is not None:
                mapping.users += 1
                return mapping
        base = self._open_storage(part, spec.pid, device)  # slow: outside the lock
        if base.dtype != torch.uint8 or base.dim() != 1 or base.numel() != part.size:
            raise TransferError(TransferFailure.UNAVAILABLE, f"opened storage: expected {part.size} bytes",
                                spec.header.request_id)
        with self._lock:
            mapping = self._mappings.get(key)
            if mapping is None:  # no other transfer opened it meanwhile
                mapping = self._mappings[key] = _Mapping(base, spec.sender_id, spec.pid, spec.pidns)
                self._counts["ipc_mappings_opened"] += 1
            mapping.users += 1
            return mapping

    def _open_storage(self, part: _Storage, pid: int, device: torch.device) -> torch.Tensor:
        """A uint8 tensor over the sender's whole storage ``part``, on ``device`` (the same
        physical GPU under this process's index)."""
        if pid == os.getpid():
            base = _LOCAL_EXPORTS.get((part.handle, part.offset))
            if base is None:
                raise TransferError(TransferFailure.UNAVAILABLE, "no such storage was exported by this process")
            return base
        try:
            index = device.index if device.index is not None else torch.cuda.current_device()
            # no IPC event: export waited for the prefill's writes before the ticket left
            storage = torch.UntypedStorage._new_shared_cuda(
                index, part.handle, part.size, part.offset, part.ref_counter, part.ref_counter_offset, b"", False
            )
        except Exception as exc:  # sender gone, handle of another machine, expandable segment without pidfd rights
            raise TransferError(TransferFailure.UNAVAILABLE,
                                f"cannot open the sender's CUDA IPC handle: {type(exc).__name__}: {exc}") from None
        return torch.empty(0, dtype=torch.uint8, device=device).set_(storage, 0, (part.size,), (1,))

    def _check_device(self, device: torch.device) -> None:
        """After a failed copy: is this process's CUDA context still usable? A fault (reading
        a mapping whose memory went away) is sticky; the replica must then be replaced."""
        if device.type != "cuda":
            return
        try:
            torch.cuda.synchronize(device)
        except Exception as exc:
            self.device_error = f"{type(exc).__name__}: {exc}"

    async def _receive_via_fallback(self, spec: _IpcTicket, pool: KVPool) -> list[int]:
        rid = spec.header.request_id
        request = StagePages(request_id=rid, sender_id=spec.sender_id, transport=self.fallback.name)
        try:
            reply = await asyncio.wait_for(self.call_sender(dict(spec.sender), request), timeout=self.stage_timeout_s)
            ticket = _staged_ticket(reply, self.fallback.name, rid)
        except asyncio.TimeoutError:
            self._counts["ipc_failures"] += 1
            raise TransferError(TransferFailure.LOST, f"the sender did not stage the pages within "
                                f"{self.stage_timeout_s:g}s", rid) from None
        except TransferError:
            self._counts["ipc_failures"] += 1
            raise
        except Exception as exc:  # the sender replica died, could not be reached, ...
            self._counts["ipc_failures"] += 1
            raise TransferError(TransferFailure.LOST, f"stage call: {type(exc).__name__}: {exc}", rid) from None
        self._counts["ipc_fallbacks"] += 1
        return await self.fallback.receive(ticket, pool)

    def sweep(self) -> int:
        """Close mappings no transfer uses that were idle for ``idle_close_s`` or whose sender
        process is gone; returns how many. Cheap: call it often (the decode replica's health
        check does)."""
        now = time.monotonic()
        with self._lock:
            gone = [key for key, m in self._mappings.items() if m.users == 0 and (
                now - m.last_used > self.idle_close_s or _process_alive(m.pid, m.pidns) is False)]
            dropped = [self._mappings.pop(key) for key in gone]
            self._counts["ipc_mappings_closed"] += len(dropped)
        if dropped:
            # the last reference closes the IPC mapping after a stream sync: not on the event loop
            try:
                self._executor.submit(dropped.clear)
            except RuntimeError:  # executor shut down (closing)
                dropped.clear()
        return len(gone)

    # -- both ----------------------------------------------------------------------------
    def counters(self) -> dict[str, int]:
        keys = ("ipc_exports", "ipc_stages", "ipc_receives", "ipc_bytes_received", "ipc_failures", "ipc_fallbacks",
                "ipc_mappings_opened", "ipc_mappings_closed")
        out = dict(self.fallback.counters()) if self.fallback is not None else {}
        with self._lock:
            out.update({k: int(self._counts[k]) for k in keys})
            out["ipc_exported"] = len(self._exported)  # leases not yet ended
            out["ipc_mappings_open"] = len(self._mappings)
        return out

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        with self._lock:
            self._mappings.clear()
            self._exported.clear()
            self._staged.clear()
            self._shared.clear()
        self._executor.shutdown(wait=False, cancel_futures=True)
        if self.fallback is not None:
            self.fallback.close()
