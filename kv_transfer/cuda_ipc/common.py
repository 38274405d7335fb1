"""What both ends of CUDA IPC transfers read: the ticket and its checks, the copy, and
``CudaIpcEnd`` (identity, fallback, counters, closing). The transport itself:
``kv_transfer.cuda_ipc``'s docstring."""


from __future__ import annotations

import abc
import collections
import contextlib
import dataclasses
import math
import os
import threading
import weakref
from collections.abc import Awaitable, Callable
from typing import Any

import torch

from ..errors import TransferError, TransferFailure
from ..header import KVFrameHeader
from ..interfaces import TransferTicket
from ..wire import reply_reason, StagePages, StageReply

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


# ---------------------------------------------------------------------------- both ends
_COUNTER_KEYS = ("ipc_exports", "ipc_stages", "ipc_receives", "ipc_bytes_received", "ipc_failures", "ipc_fallbacks",
                 "ipc_mappings_opened", "ipc_mappings_closed")


class CudaIpcEnd(abc.ABC):
    """What the sender and the receiver of CUDA IPC transfers share (see the module docstring).

    identity: how tickets name this replica as a sender (``replica_id`` plus what
        ``call_sender`` needs to reach it, e.g. Serve's app and deployment names).
    fallback: this replica's end of the transport for pools on different GPUs (``auto``: the
        NCCL channel's ``ChannelSender`` on a prefill replica, ``ChannelReceiver`` on a decode
        replica); ``None``: such a transfer fails ``UNAVAILABLE``. This end owns it (``close``
        closes it).
    uuid_of: ``device -> physical GPU UUID or None`` (``device_uuid``; tests substitute it).
    """

    name = IPC_NAME
    _fallback_end: type  # what a fallback must be: a sender's sends over it, a receiver's receives

    def __init__(self, *, identity: dict | None = None, fallback: Any = None,
                 uuid_of: Callable[[torch.device], str | None] | None = None) -> None:
        identity = {"replica_id": "local", **(identity or {})}
        for key, value in identity.items():
            if not _short_str(key) or not _short_str(value):
                raise ValueError(f"identity: expected short non-empty str values, got {key!r}: {value!r}")
        if fallback is not None and (not isinstance(fallback, self._fallback_end) or fallback.name == self.name):
            raise ValueError(f"fallback: expected another transport's {self._fallback_end.__name__}, got {fallback!r}")
        if uuid_of is not None and not callable(uuid_of):
            raise ValueError(f"uuid_of: expected a callable, got {type(uuid_of).__name__}")
        self.identity = identity
        self.fallback = fallback
        self._uuid_of = uuid_of or device_uuid
        self._lock = threading.Lock()  # the end's tables (event loop and worker threads)
        self._counts: collections.Counter = collections.Counter()
        self._closed = False

    @property
    def replica_id(self) -> str:
        return self.identity["replica_id"]

    @abc.abstractmethod
    def _held(self) -> tuple[int, int]:
        """Under ``_lock``: (exports whose lease has not ended, sender storages mapped here)."""

    @abc.abstractmethod
    def _forget(self) -> None:
        """Under ``_lock``, closing: drop the end's tables."""

    def _shutdown(self) -> None:
        """Closing, after ``_forget``: stop the end's worker threads (if it has any)."""

    def counters(self) -> dict[str, int]:
        out = dict(self.fallback.counters()) if self.fallback is not None else {}
        with self._lock:
            out.update({k: int(self._counts[k]) for k in _COUNTER_KEYS})
            out["ipc_exported"], out["ipc_mappings_open"] = self._held()  # leases not yet ended; mappings
        return out

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        with self._lock:
            self._forget()
        self._shutdown()
        if self.fallback is not None:
            self.fallback.close()


__all__ = ["IPC_NAME", "CudaIpcEnd", "copy_pages", "device_uuid", "parse_ticket"]
