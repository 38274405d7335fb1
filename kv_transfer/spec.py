"""What a transport declares (:class:`TransportSpec`) and what its ends are built from
(:class:`BuildContext` for a replica's sender or receiver, :class:`RankContext` for a follower
rank's end in a TP group). Each transport's folder holds one ``spec`` module; the registry
(``kv_transfer.registry``) maps names to them. Standard library only: the registry imports it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class BuildContext:
    """What a replica's transport ends are built from (``serving.transports`` fills it in).

    device: the replica's KV pool device. host: its node's address. identity: how tickets name
        it as a sender (``replica_id`` plus what reaches it again).
    options: the ``transfer`` options as plain data (``lease_timeout_s``, and a section per
        transport: ``channel``, ``ipc``, ``object_store``, ...; each transport reads its own).
    peers: decode side: how receivers call the prefill replica that holds the pages (an object
        with ``async send_pages(sender, request)`` and ``async stage_pages(sender, request)``).
    group: the replica's TP group (``kv_transfer.group.RankGroup``) when it is one.
    make_caller: TP decode: how each rank makes its own ``peers.send_pages`` (picklable).
    fallback: the end of another transport this one moves pages through where it cannot
        itself (built first: ``auto`` on CUDA gives CUDA IPC the NCCL channel's end).
    fault_mode, rank_faults: drills: damage the last rank's part of the first ``rank_faults``
        frames a TP decode replica splits by head.
    """

    device: Any
    host: str = "127.0.0.1"
    identity: Mapping[str, str] = field(default_factory=dict)
    options: Mapping[str, Any] = field(default_factory=dict)
    peers: Any = None
    group: Any = None
    make_caller: Callable[[], Any] | None = None
    fallback: Any = None
    fault_mode: str | None = None
    rank_faults: int = 0

    def section(self, name: str) -> dict:
        """The options of one transport's section (empty: its defaults)."""
        return dict(self.options.get(name) or {})


@dataclass(frozen=True)
class RankContext:
    """A follower rank's view when it builds its end of a group transfer: its ``pool``, the
    group's head ``layout``, its ``rank`` and the ``setup`` its leader sent (plain data)."""

    pool: Any
    layout: Any
    rank: int
    setup: Mapping[str, Any]


Builder = Callable[[BuildContext], Any]


@dataclass(frozen=True)
class TransportSpec:
    """One transport: its capabilities and the builders of its ends.

    name: its registry key (what ``transfer.transport`` says).
    family: what a replica's choice calls its ends (``kv_transfer.choice.TransportChoice``):
        transports that share the same sender and receiver code share it ("channel" for
        ``nccl`` and ``gloo``).
    devices: the pool device types it moves ("cuda", "cpu"); empty: any.
    in_groups: it runs between TP groups (every rank moves its own heads); otherwise a TP
        group on either side ships over the object store instead.
    sender, receiver: ``BuildContext -> KVSender / KVReceiver`` of a TP=1 replica.
    group_sender, group_receiver: the same for a TP group (``context.group`` set).
    rank_end: ``(role, RankContext) -> object`` whose methods a follower rank runs for the
        group ends (role ``"send"`` or ``"receive"``).
    """

    name: str
    family: str
    summary: str = ""
    devices: tuple[str, ...] = ()
    in_groups: bool = False
    sender: Builder | None = None
    receiver: Builder | None = None
    group_sender: Builder | None = None
    group_receiver: Builder | None = None
    rank_end: Callable[[str, RankContext], Any] | None = None

    def moves(self, device_type: str) -> bool:
        """Whether it moves pools on devices of type ``device_type``."""
        return not self.devices or device_type in self.devices

    def build_sender(self, context: BuildContext) -> Any:
        return self._build("sender", context)

    def build_receiver(self, context: BuildContext) -> Any:
        return self._build("receiver", context)

    def _build(self, end: str, context: BuildContext) -> Any:
        grouped = context.group is not None
        make = getattr(self, f"group_{end}" if grouped else end)
        if make is None:
            raise ValueError(f"transfer.transport: {self.name!r} has no {'TP group ' if grouped else ''}{end}")
        return make(context)


__all__ = ["BuildContext", "RankContext", "TransportSpec"]
