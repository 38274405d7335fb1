"""Builds a replica's transport ends from its :class:`~kv_transfer.choice.TransportChoice`,
asking each named transport's spec (``kv_transfer.registry``): no transport is named here
but the object store every replica keeps for retries.

A kind ``"a+b"`` builds b's end first and hands it to a's as its fallback (``auto`` on CUDA:
the NCCL channel's end behind CUDA IPC's). A TP group's context (``BuildContext.group``)
builds the specs' group ends.
"""

from __future__ import annotations

import dataclasses

from .choice import RETRY, TransportChoice
from .interfaces import KVReceiver, KVSender
from .registry import get_transport
from .spec import BuildContext


def _check(choice: TransportChoice, context: BuildContext) -> None:
    if not isinstance(choice, TransportChoice):
        raise ValueError(f"choice: expected a TransportChoice, got {type(choice).__name__}")
    if choice.grouped and context.group is None:
        raise ValueError("group: a TP placement needs its TP group")


def build_retry_sender(choice: TransportChoice, context: BuildContext) -> KVSender:
    """The object store's sender (a failed transfer's retry asks for it)."""
    _check(choice, context)
    return get_transport(RETRY).build_sender(context)


def build_sender(choice: TransportChoice, context: BuildContext, retry: KVSender | None = None) -> KVSender:
    """The sender of a prefill replica (``retry``: its object store's, reused when the choice
    is the object store)."""
    _check(choice, context)
    if choice.kind == RETRY and retry is not None:
        return retry
    end = None
    for name in reversed(choice.kind.split("+")):
        end = get_transport(name).build_sender(dataclasses.replace(context, fallback=end))
    return end


def build_receivers(choice: TransportChoice, context: BuildContext) -> dict[str, KVReceiver]:
    """The receivers of a decode replica, by the ticket ``transport`` each takes (its ``name``)."""
    _check(choice, context)
    receivers = {RETRY: get_transport(RETRY).build_receiver(context)}
    end = None
    for name in reversed(choice.kind.split("+")):
        if name == RETRY:
            continue
        end = get_transport(name).build_receiver(dataclasses.replace(context, fallback=end))
        receivers[end.name] = end
    return receivers


__all__ = ["build_receivers", "build_retry_sender", "build_sender"]
