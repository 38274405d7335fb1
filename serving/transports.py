"""The one factory of a replica's KV transports: ``kv_transfer.choice.choose_transports``
decides from the placement and the ``transfer`` options; this builds what it names, the TP
group's variants included (``serving.tp_group``), so the deployments never ask which
transport they hold.

A prefill replica gets :class:`PrefillTransports` (its sender, and the object store the retry
after a failed channel or IPC transfer asks for); a decode replica gets its receivers by the
ticket's ``transport`` name.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from kv_transfer.choice import Placement, TransportChoice, choose_transports
from kv_transfer.transfer import KVReceiver, KVSender, ObjectStoreTransport
from serving.config import ServiceConfig

logger = logging.getLogger("ray.serve")


@dataclass(frozen=True)
class TPGroup:
    """A TP replica's group (``serving.tp_group.start_group``): the leader's lockstep runner
    and the follower rank actors."""

    lock: Any
    actors: list


@dataclass(frozen=True)
class PrefillTransports:
    """``sender``: what the replica exports with; ``object_store``: what a retry asks for."""

    sender: KVSender
    object_store: KVSender
    choice: TransportChoice


def placement_of(config: ServiceConfig, role: str, device: Any) -> Placement:
    return Placement(role, device, prefill_tp=config.prefill.tensor_parallel_size,
                     decode_tp=config.decode.tensor_parallel_size)


def make_prefill_transports(config: ServiceConfig, placement: Placement, *, identity: dict, host: str,
                            group: TPGroup | None = None) -> PrefillTransports:
    """The sender a prefill replica at ``placement`` exports with (``group``: its TP group,
    needed when ``placement`` is one)."""
    choice = choose_transports(config.transfer.transport, placement)
    if choice.grouped and group is None:
        raise ValueError("group: a TP placement needs its TP group")
    if choice.warning:
        logger.warning(choice.warning)
    transfer = config.transfer
    fetch_s = transfer.object_store.fetch_timeout_s
    if choice.grouped:  # frames of every rank's heads, merged (the object store and retries)
        from serving.tp_group import make_tp_exporter

        object_store = make_tp_exporter(group.lock, group.actors, fetch_s)
    else:
        object_store = ObjectStoreTransport(fetch_timeout_s=fetch_s)
    if choice.sender == "object_store":
        return PrefillTransports(object_store, object_store, choice)
    if choice.sender == "tp_channel":
        from serving.tp_group import make_tp_channel_exporter

        return PrefillTransports(make_tp_channel_exporter(group.lock, group.actors, config, identity=identity,
                                                          host=host), object_store, choice)
    from kv_transfer.channel_send import ChannelSender

    channel = transfer.channel
    make_channel = lambda: ChannelSender(placement.device, host=host, identity=identity,  # noqa: E731
                                         config=channel.channel_config(), max_workers=channel.max_workers)
    if choice.sender == "channel":
        return PrefillTransports(make_channel(), object_store, choice)
    from kv_transfer.ipc_send import CudaIpcSender

    fallback = make_channel() if choice.sender == "cuda_ipc+channel" else None
    sender = CudaIpcSender(identity=identity, fallback=fallback, lease_timeout_s=transfer.lease_timeout_s)
    return PrefillTransports(sender, object_store, choice)


def make_decode_receivers(config: ServiceConfig, placement: Placement, *, identity: dict, host: str,
                          prefill: Any, group: TPGroup | None = None) -> dict[str, KVReceiver]:
    """The receivers of a decode replica at ``placement``, by the ticket ``transport`` they take.
    ``prefill``: the ``serving.prefill_client.PrefillClient`` the receivers call the prefill
    replicas with (a TP group's followers make their own: ``send_caller``)."""
    choice = choose_transports(config.transfer.transport, placement)
    if choice.grouped and group is None:
        raise ValueError("group: a TP placement needs its TP group")
    transfer = config.transfer
    fetch_s = transfer.object_store.fetch_timeout_s
    if choice.grouped:
        # object-store frames split by head over the ranks (the retry path), and channels into
        # every rank (each pulls its own heads)
        from serving.prefill_client import send_caller
        from serving.tp_group import make_tp_channel_receiver, make_tp_receiver

        fi = config.fault_injection
        receivers: dict[str, KVReceiver] = {
            "object_store": make_tp_receiver(group.lock, group.actors, fetch_s, fault_mode=fi.mode,
                                             faults=fi.corrupt_rank_frames)}
        if "channel" in choice.receivers:
            channels = make_tp_channel_receiver(group.lock, group.actors, config, identity=identity, host=host,
                                                make_caller=send_caller)
            receivers[channels.name] = channels
        return receivers
    receivers = {"object_store": ObjectStoreTransport(fetch_timeout_s=fetch_s)}
    channels = None
    if "channel" in choice.receivers:
        from kv_transfer.channel_recv import ChannelReceiver

        channels = ChannelReceiver(placement.device, host=host, identity=identity, call_sender=prefill.send_pages,
                                   config=transfer.channel.channel_config(), max_workers=transfer.channel.max_workers)
        receivers[channels.name] = channels
    if "cuda_ipc" in choice.receivers:
        from kv_transfer.ipc_recv import CudaIpcReceiver

        # the channel is also the IPC transport's way to pages on another GPU
        ipc = transfer.ipc
        receivers["cuda_ipc"] = CudaIpcReceiver(identity=identity, fallback=channels,
                                                call_sender=prefill.stage_pages if channels else None,
                                                copy_chunk_bytes=ipc.copy_chunk_bytes, idle_close_s=ipc.idle_close_s,
                                                stage_timeout_s=ipc.stage_timeout_s, max_workers=ipc.max_workers)
    return receivers


__all__ = ["PrefillTransports", "TPGroup", "make_decode_receivers", "make_prefill_transports", "placement_of"]
