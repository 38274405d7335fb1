"""A replica's KV transports, from the service's options: ``kv_transfer.choice.choose_transports``
decides from the placement and ``transfer.transport``, ``kv_transfer.factory`` builds what it
names by asking each transport's spec (``kv_transfer.registry``), the TP group's ends included,
so neither this module nor the deployments ask which transport they hold.

A prefill replica gets :class:`PrefillTransports` (its sender, and the object store the retry
after a failed channel or IPC transfer asks for); a decode replica gets its receivers by the
ticket's ``transport`` name.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from kv_transfer.choice import Placement, TransportChoice, choose_transports
from kv_transfer.factory import build_receivers, build_retry_sender, build_sender
from kv_transfer.interfaces import KVReceiver, KVSender
from kv_transfer.spec import BuildContext
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


def _context(config: ServiceConfig, placement: Placement, choice: TransportChoice, *, identity: dict, host: str,
             group: TPGroup | None, **extra: Any) -> BuildContext:
    if choice.grouped and group is None:
        raise ValueError("group: a TP placement needs its TP group")
    ranks = None
    if choice.grouped:
        from serving.tp_group import RayRankGroup

        ranks = RayRankGroup(group.lock, group.actors)
    fi = config.fault_injection
    return BuildContext(placement.device, host=host, identity=identity, options=config.transfer.model_dump(),
                        group=ranks, fault_mode=fi.mode, rank_faults=fi.corrupt_rank_frames, **extra)


def make_prefill_transports(config: ServiceConfig, placement: Placement, *, identity: dict, host: str,
                            group: TPGroup | None = None) -> PrefillTransports:
    """The sender a prefill replica at ``placement`` exports with (``group``: its TP group,
    needed when ``placement`` is one)."""
    choice = choose_transports(config.transfer.transport, placement)
    context = _context(config, placement, choice, identity=identity, host=host, group=group)
    if choice.warning:
        logger.warning(choice.warning)
    object_store = build_retry_sender(choice, context)
    return PrefillTransports(build_sender(choice, context, retry=object_store), object_store, choice)


def make_decode_receivers(config: ServiceConfig, placement: Placement, *, identity: dict, host: str,
                          prefill: Any, group: TPGroup | None = None) -> dict[str, KVReceiver]:
    """The receivers of a decode replica at ``placement``, by the ticket ``transport`` they take.
    ``prefill``: the ``serving.prefill_client.PrefillClient`` the receivers call the prefill
    replicas with (a TP group's followers make their own: ``send_caller``)."""
    from serving.prefill_client import send_caller

    choice = choose_transports(config.transfer.transport, placement)
    context = _context(config, placement, choice, identity=identity, host=host, group=group, peers=prefill,
                       make_caller=send_caller)
    return build_receivers(choice, context)


__all__ = ["PrefillTransports", "TPGroup", "make_decode_receivers", "make_prefill_transports", "placement_of"]
