"""The transport interface: a :class:`KVSender` (prefill side) hands out a
:class:`TransferTicket`, a :class:`KVReceiver` (decode side) takes it; :class:`KVTransport`
plays both ends. The transports themselves live one per folder (``object_store/``,
``channel/``, ``cuda_ipc/``) and are built by name through ``kv_transfer.registry``.

Ownership: the sender keeps its pages until the receiver acknowledges (the service closes
the prefill replica's lease stream once the decode replica has adopted them), so a failed
transfer leaves the sender's copy intact until the lease ends.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Any

from kv_cache.pool import KVPool

from .errors import TransferError, TransferFailure


@dataclass(frozen=True)
class TransferTicket:
    """What the sender hands to whoever routes the request to a receiver.

    ``transport`` names the receiver that can take it ("local", "object_store", a channel
    backend: "nccl", "gloo", or "cuda_ipc"). ``handle`` is transport-specific: the frame itself
    (local), a one-element list holding the ``ObjectRef`` (object store; the list keeps Ray
    from resolving the ref when the ticket is passed as an argument), the msgpack header plus
    the sender's address (channels), or the header plus the sender's GPU, pages and CUDA IPC
    handles of its pool (cuda_ipc).

    ``sender``: the replica that holds something for this ticket until the receiver is done
    (its pages under a lease, or the frame's reference), as its Serve app, deployment and
    replica id: where ``release_pages`` goes. None: nothing is held.
    """

    request_id: str
    transport: str
    num_tokens: int
    num_pages: int
    nbytes: int
    handle: Any = field(repr=False, default=None)
    sender: Any = field(repr=False, default=None)


class KVSender(abc.ABC):
    """The sending end of a transport (a prefill replica): ``export`` a request's pages as a
    ticket, ``discard`` it when done, and answer the receiver's side calls: ``serve_send``
    (channels: send the pages now) and ``serve_stage`` (CUDA IPC: stage them on the fallback
    channel). ``serves_sends`` / ``serves_stages`` say whether it answers them; the replica
    refuses a call its sender does not answer, without asking which transport it holds."""

    name: str = "abstract"
    fault_modes: tuple[str, ...] = ()  # what ``export(fault=...)`` can inject
    # True when the receiver reads the pages out of the sender's pool after ``export`` (a
    # channel send, a CUDA IPC copy): the sender keeps them under a lease until then. False
    # when ``export`` copied them (a frame): the sender may free them at once.
    reads_pages_after_export: bool = False
    # True when the sender must keep the exported frame alive until the receiver has fetched it
    # (the object store: see ObjectStoreTransport): the replica holds the ticket under a lease
    # then, but frees the pages at once.
    keeps_frame_until_released: bool = False
    # True when ``serve_send`` can send pages over a channel (the replica's lease then counts
    # the sends): the channels, and CUDA IPC with a channel fallback.
    serves_sends: bool = False
    serves_stages: bool = False  # True when ``serve_stage`` answers (CUDA IPC)

    @abc.abstractmethod
    def export(self, pool: KVPool, request_id: str, *, fault: str | None = None) -> TransferTicket:
        """Ship ``request_id``'s pages; ``fault`` (one of ``fault_modes``) damages the transfer on
        purpose (fault-injection drills and tests)."""

    def discard(self, ticket: TransferTicket) -> None:
        """Sender-side cleanup of a ticket that is done with (received or abandoned)."""

    async def serve_send(self, request: Any) -> Any:
        """A receiver's ``kv_transfer.wire.SendPages``; the ``SendReply`` (with ``serves_sends``)."""
        raise TransferError(TransferFailure.UNAVAILABLE, f"{self.name!r} does not send over channels")

    def serve_stage(self, pool: KVPool, request: Any) -> Any:
        """A receiver's ``kv_transfer.wire.StagePages`` (blocking); the ``StageReply`` (with
        ``serves_stages``)."""
        raise TransferError(TransferFailure.UNAVAILABLE, f"{self.name!r} does not stage pages")

    def counters(self) -> dict[str, int]:
        """Counters for the replica's stats (none by default)."""
        return {}

    def close(self) -> None:
        """Release what the transport holds (connections, threads); the replica is stopping."""


class KVReceiver(abc.ABC):
    """The receiving end of a transport (a decode replica): ``receive`` a ticket's pages into
    a pool (``TransferError`` on failure, nothing left allocated)."""

    name: str = "abstract"
    # True when the sender still holds something for the ticket after a receive (the pages
    # after a CUDA IPC copy, the frame's reference after an object-store fetch): the receiver's
    # replica then calls ``release_pages`` on it at once. False when the transfer itself ended
    # the lease (a channel send) or there was none (a local frame).
    releases_after_receive: bool = False

    @abc.abstractmethod
    async def receive(self, ticket: TransferTicket, pool: KVPool) -> list[int]: ...

    def health_error(self) -> str | None:
        """Why this replica can no longer receive (a CUDA context broken by a copy), or None."""
        return None

    def sweep(self) -> int:
        """Periodic upkeep (the replica's health check calls it); returns what it closed."""
        return 0

    def counters(self) -> dict[str, int]:
        """Counters for the replica's stats (none by default)."""
        return {}

    def close(self) -> None:
        """Release what the transport holds (connections, threads); the replica is stopping."""


class KVTransport(KVSender, KVReceiver):
    """A transport that plays both ends (one instance per replica serves its role's end)."""

    name: str = "abstract"

    def counters(self) -> dict[str, int]:
        return {}

    def close(self) -> None:
        pass

