"""The local transport: frames that stay in process (tests and single-process tools). Not a
value of ``transfer.transport``: a replica never builds it."""

from __future__ import annotations

from kv_cache.pool import KVPool

from .faults import FRAME_FAULTS, maybe_corrupt
from .frame import adopt_frame, frame_ticket, pack_pages
from .interfaces import KVTransport, TransferTicket
from .spec import BuildContext, TransportSpec


class LocalTransport(KVTransport):
    """In-process frames (tests and single-process tools)."""

    name = "local"
    fault_modes = FRAME_FAULTS

    def export(self, pool: KVPool, request_id: str, *, fault: str | None = None) -> TransferTicket:
        frame = maybe_corrupt(pack_pages(pool, request_id), fault)
        return frame_ticket(self.name, pool, request_id, frame, frame)

    async def receive(self, ticket: TransferTicket, pool: KVPool) -> list[int]:
        return adopt_frame(pool, ticket.handle, request_id=ticket.request_id)


def _end(context: BuildContext) -> LocalTransport:
    return LocalTransport()


LOCAL = TransportSpec(name="local", family="local", summary="in-process frames (tests and single-process tools)",
                      sender=_end, receiver=_end)
