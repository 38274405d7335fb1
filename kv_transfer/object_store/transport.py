"""``ObjectStoreTransport``: frames (``kv_transfer.frame``) through Ray's object store."""

from __future__ import annotations

import numpy as np

from kv_cache.pool import KVPool

from ..errors import TransferError, TransferFailure
from ..faults import FRAME_FAULTS, maybe_corrupt
from ..frame import adopt_frame, frame_ticket, pack_pages
from ..interfaces import KVTransport, TransferTicket


class ObjectStoreTransport(KVTransport):
    """Frames through Ray's object store: works across nodes and for CPU or GPU pools (the
    frame is CPU bytes). The sender's process owns the object; when it dies the receiver's
    fetch fails with ``TransferFailure.LOST`` (retryable elsewhere).

    The sender keeps its own reference to the frame until the receiver has fetched it
    (``keeps_frame_until_released``: the prefill replica holds the ticket under a lease, the
    decode replica releases it right after the fetch). Ray's reference counting alone does not
    keep it: Serve returns every reply as an item of a streaming generator, and a reference
    nested in such an item can lose its count before the borrowers down the line fetch it
    (ray-project/ray#58080; ``scripts/ray_nested_ref_repro.py``, docs/notes/object_store_frame_lost.md)."""

    name = "object_store"
    fault_modes = FRAME_FAULTS
    keeps_frame_until_released = True
    releases_after_receive = True

    def __init__(self, fetch_timeout_s: float = 60.0) -> None:
        self.fetch_timeout_s = fetch_timeout_s

    def export(self, pool: KVPool, request_id: str, *, fault: str | None = None) -> TransferTicket:
        import ray

        frame = maybe_corrupt(pack_pages(pool, request_id), fault)
        return frame_ticket(self.name, pool, request_id, frame, [ray.put(frame)])

    async def receive(self, ticket: TransferTicket, pool: KVPool) -> list[int]:
        import asyncio

        frame = await self.fetch(ticket)
        # checksum + scatter off the event loop (large frames take a while)
        return await asyncio.to_thread(adopt_frame, pool, frame, request_id=ticket.request_id)

    async def fetch(self, ticket: TransferTicket) -> np.ndarray:
        """The ticket's frame out of the object store (not verified yet: see ``read_frame``)."""
        import asyncio

        import ray

        refs = ticket.handle
        if not isinstance(refs, list) or len(refs) != 1 or not isinstance(refs[0], ray.ObjectRef):
            raise TransferError(TransferFailure.MALFORMED, "ticket: expected [ObjectRef]", ticket.request_id)
        try:
            frame = await asyncio.wait_for(refs[0], timeout=self.fetch_timeout_s)
        except asyncio.TimeoutError:
            raise TransferError(TransferFailure.LOST, f"frame not fetched within {self.fetch_timeout_s}s", ticket.request_id) from None
        except Exception as exc:  # ObjectLostError, OwnerDiedError, ...
            raise TransferError(TransferFailure.LOST, f"{type(exc).__name__}: {exc}", ticket.request_id) from None
        if not isinstance(frame, np.ndarray) or frame.dtype != np.uint8 or frame.ndim != 1:
            # frames are plain uint8 arrays (Ray stores numpy arrays as raw buffers, no pickle)
            raise TransferError(TransferFailure.MALFORMED, f"frame: expected a 1-D uint8 array, got {type(frame).__name__}",
                                ticket.request_id)
        return frame

