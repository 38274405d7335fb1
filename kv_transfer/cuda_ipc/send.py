"""The sending end of CUDA IPC transfers (a prefill replica): ``CudaIpcSender`` shares its
pool's storages and hands out tickets to the request's pages, and stages them over its
fallback channel for a receiver on another GPU. How a transfer goes, the lease and the clock:
``kv_transfer.cuda_ipc``'s docstring.
"""

from __future__ import annotations

import dataclasses
import math
import os
import threading
import time
import weakref
from typing import Any

import torch

from kv_cache.pool import KVPool

from ..errors import TransferError, TransferFailure
from ..header import describe_pages
from ..interfaces import KVSender, TransferTicket
from ..wire import StagePages, StageReply
from .common import _BROKEN_UUID, CudaIpcEnd, _LOCAL_EXPORTS, _pid_namespace, _reply, _REPLY_REASONS, _short_str


@dataclasses.dataclass
class _SharedPool:
    """A pool's K and V storages as shared once (ticket parts), and what keeps them registered."""

    uuid: str
    k: dict
    v: dict
    keep: tuple


class CudaIpcSender(CudaIpcEnd, KVSender):
    """The sender of CUDA IPC transfers. Settings as :class:`~kv_transfer.cuda_ipc.common.CudaIpcEnd` (its
    ``fallback`` a ``KVSender``: ``serve_stage`` exports over it, ``serve_send`` sends over it),
    and

    lease_timeout_s: how long the sender keeps exported pages at most (the prefill lease);
        tickets carry the deadline. ``None``: no deadline.
    """

    _fallback_end = KVSender
    fault_modes = ("break",)  # the ticket names a GPU nobody has and offers no fallback
    reads_pages_after_export = True  # the receiver copies them out of this pool
    serves_stages = True  # without a fallback it refuses each stage itself

    def __init__(self, *, identity: dict | None = None, fallback: KVSender | None = None,
                 lease_timeout_s: float | None = None,
                 uuid_of: Any = None) -> None:
        super().__init__(identity=identity, fallback=fallback, uuid_of=uuid_of)
        if lease_timeout_s is not None and (isinstance(lease_timeout_s, bool) or not isinstance(
                lease_timeout_s, (int, float)) or not 0 < lease_timeout_s < math.inf):
            raise ValueError(f"lease_timeout_s: expected a positive number, got {lease_timeout_s!r}")
        self.lease_timeout_s = lease_timeout_s
        self._share_lock = threading.Lock()  # a pool's first exports, concurrent: share it once
        self._shared: "weakref.WeakKeyDictionary[KVPool, _SharedPool]" = weakref.WeakKeyDictionary()
        self._exported: dict[str, threading.Lock] = {}  # request id -> its staging lock
        self._staged: dict[str, TransferTicket] = {}  # fallback tickets staged for receivers

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
        return self.fallback is not None and self.fallback.serves_sends

    async def serve_send(self, request: Any) -> Any:
        """A receiver on another GPU pulls staged pages over the fallback channel."""
        if self.fallback is None:
            return await super().serve_send(request)
        return await self.fallback.serve_send(request)

    def serve_stage(self, pool: KVPool, request: StagePages) -> StageReply:
        """Sender side of a fallback transfer (blocking: run it in a worker thread): export the
        pages of an exported request, still under its lease, over ``fallback`` for a receiver on
        another GPU. An ``ok`` reply carries the fallback's ticket."""
        try:
            req = StagePages.parse(request)
            rid, sender_id, transport = req.request_id, req.sender_id, req.transport
        except ValueError as exc:
            return _reply(False, TransferFailure.UNAVAILABLE, f"bad stage request: {exc}")
        if self.fallback is None or transport != self.fallback.name:
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

    def _held(self) -> tuple[int, int]:
        return len(self._exported), 0

    def _forget(self) -> None:
        self._exported.clear()
        self._staged.clear()
        self._shared.clear()


__all__ = ["CudaIpcSender"]
