"""A test-only KV transport, the whole of it in one module: its sender and receiver (a
``dict`` shared by both ends stands in for a wire), its config and what it declares. A test
registers it with one line (``register_transport("toy", "tests.toy_transport:TOY")``); nothing
else in the tree names it. It carries frames (``kv_transfer.frame``), so a transfer through it
is checked as the object store's are."""

from __future__ import annotations

from dataclasses import dataclass

from kv_transfer.errors import TransferError, TransferFailure
from kv_transfer.frame import adopt_frame, frame_ticket, pack_pages
from kv_transfer.interfaces import KVReceiver, KVSender
from kv_transfer.spec import TransportSpec


@dataclass(frozen=True)
class ToyConfig:
    """The options of its section (``transfer.toy``): how many frames the wire holds."""

    capacity: int = 4


class ToySender(KVSender):
    name = "toy"
    keeps_frame_until_released = True

    def __init__(self, wire: dict, config: ToyConfig) -> None:
        self.wire, self.config = wire, config

    def export(self, pool, request_id, *, fault=None):
        if len(self.wire) >= self.config.capacity:
            raise TransferError(TransferFailure.UNAVAILABLE, "the toy wire is full", request_id)
        frame = pack_pages(pool, request_id)
        self.wire[request_id] = frame
        return frame_ticket(self.name, pool, request_id, frame, request_id)

    def discard(self, ticket):
        self.wire.pop(ticket.request_id, None)


class ToyReceiver(KVReceiver):
    name = "toy"

    def __init__(self, wire: dict) -> None:
        self.wire = wire

    async def receive(self, ticket, pool):
        frame = self.wire.pop(ticket.handle, None)
        if frame is None:
            raise TransferError(TransferFailure.LOST, "not on the toy wire", ticket.request_id)
        return adopt_frame(pool, frame, request_id=ticket.request_id)


WIRE: dict = {}  # one process: both ends share it

TOY = TransportSpec(
    name="toy", family="toy", devices=("cpu",), summary="frames through a dict (tests)",
    sender=lambda c: ToySender(WIRE, ToyConfig(**c.section("toy"))),
    receiver=lambda c: ToyReceiver(WIRE),
)

__all__ = ["TOY", "ToyConfig", "ToyReceiver", "ToySender"]
