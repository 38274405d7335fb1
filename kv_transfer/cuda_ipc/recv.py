"""The receiving end of CUDA IPC transfers (a decode replica): ``CudaIpcReceiver`` maps the
sender's pool storages and copies a request's pages into its own pool, or asks the sender
to stage them over the fallback channel when the pools are on different GPUs. How a
transfer goes, a sender that goes away: ``kv_transfer.cuda_ipc``'s docstring.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import os
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from kv_cache.pool import KVPool
from kv_cache.tensors import copy_word, pool_page_words

from ..errors import TransferError, TransferFailure
from ..header import adopt_pages, check_geometry
from ..interfaces import KVReceiver, TransferTicket
from ..wire import StagePages
from .common import (
    _LOCAL_EXPORTS,
    CudaIpcEnd,
    StageCall,
    _copy_stream,
    _IpcTicket,
    _process_alive,
    _sender_words,
    _staged_ticket,
    _Storage,
    copy_pages,
    parse_ticket,
)


@dataclasses.dataclass
class _Mapping:
    """A sender storage opened in this process (``base``: uint8 over the whole storage)."""

    base: torch.Tensor
    sender_id: str
    pid: int
    pidns: str | None
    users: int = 0
    last_used: float = dataclasses.field(default_factory=time.monotonic)


class CudaIpcReceiver(CudaIpcEnd, KVReceiver):
    """The receiver of CUDA IPC transfers. Settings as :class:`~kv_transfer.cuda_ipc.common.CudaIpcEnd` (its
    ``fallback`` a ``KVReceiver``, for the pages a sender stages on another GPU), and

    call_sender: ``async (sender, request) -> reply``: deliver a stage request to the sender
        replica and return its ``serve_stage`` reply (needed for the fallback).
    copy_chunk_bytes: the most temporary device memory one copy step takes.
    idle_close_s: mappings unused this long are closed.
    stage_timeout_s: how long the sender may take to stage over the fallback.
    """

    _fallback_end = KVReceiver
    releases_after_receive = True  # the copy leaves the sender's lease to the receiver's release

    def __init__(self, *, identity: dict | None = None, fallback: KVReceiver | None = None,
                 call_sender: StageCall | None = None, copy_chunk_bytes: int = 256 << 20, idle_close_s: float = 60.0,
                 stage_timeout_s: float = 30.0, uuid_of: Any = None, max_workers: int = 4) -> None:
        super().__init__(identity=identity, fallback=fallback, uuid_of=uuid_of)
        if call_sender is not None and not callable(call_sender):
            raise ValueError(f"call_sender: expected an async callable, got {type(call_sender).__name__}")
        for arg, value in (("idle_close_s", idle_close_s), ("stage_timeout_s", stage_timeout_s)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
                raise ValueError(f"{arg}: expected a positive number, got {value!r}")
        if isinstance(copy_chunk_bytes, bool) or not isinstance(copy_chunk_bytes, int) or copy_chunk_bytes < 1:
            raise ValueError(f"copy_chunk_bytes: expected a positive int, got {copy_chunk_bytes!r}")
        if isinstance(max_workers, bool) or not isinstance(max_workers, int) or max_workers < 1:
            raise ValueError(f"max_workers: expected a positive int, got {max_workers!r}")
        self.call_sender = call_sender
        self.copy_chunk_bytes = copy_chunk_bytes
        self.idle_close_s = float(idle_close_s)
        self.stage_timeout_s = float(stage_timeout_s)
        self._executor = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="kv-ipc")
        self._mappings: dict[tuple[str, bytes, int], _Mapping] = {}  # opened sender storages
        self.device_error: str | None = None  # a CUDA error after a failed copy: this process's context is unusable

    def health_error(self) -> str | None:
        return self.device_error

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
        if self.fallback is not None and spec.fallback == self.fallback.name and self.call_sender is not None:
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

    def _held(self) -> tuple[int, int]:
        return 0, len(self._mappings)

    def _forget(self) -> None:
        self._mappings.clear()

    def _shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


__all__ = ["CudaIpcReceiver"]
