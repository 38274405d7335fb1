"""Which transport pair a replica uses: the one decision, from where the replica sits
(:class:`Placement`: its role, its pool's device, both sides' TP sizes) and the ``transport``
option. ``serving.transports`` builds what it names.

A prefill replica has one sender (and the object store, for the retry after a failed channel
or IPC transfer); a decode replica has one receiver per kind of ticket it may be handed (always
the object store). The rules (docs/ARCHITECTURE.md "KV transfer", "Tensor parallelism"):
``select_transport`` reads the option against the device; a TP group on either side never
uses CUDA IPC (``group_transport``: ``auto`` becomes the NCCL channel, ``cuda_ipc`` alone the
object store); a TP=1 decode replica keeps the receivers of its own device's choice whatever
the prefill side is (a TP prefill group then ships over a channel or the object store, both
of which it has).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .tp_transfer import group_transport
from .transfer import IPC_OR_NCCL, select_transport

ROLES = ("prefill", "decode")
# What a sender is built as: a frame through the object store; a pairwise channel (nccl/gloo);
# every rank of a TP prefill group on its own channel; a CUDA IPC mapping, alone or with the
# channel for pools on other GPUs.
SENDERS = ("object_store", "channel", "tp_channel", "cuda_ipc", "cuda_ipc+channel")
# What a decode replica receives with (a TP decode group builds each over its ranks).
RECEIVERS = ("object_store", "channel", "cuda_ipc")


@dataclass(frozen=True)
class Placement:
    """Where a replica sits: ``role`` (``"prefill"`` or ``"decode"``), the ``device`` of its KV
    pool, and the TP sizes of the prefill and decode deployments (its own is its role's)."""

    role: str
    device: torch.device
    prefill_tp: int = 1
    decode_tp: int = 1

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role: expected one of {ROLES}, got {self.role!r}")
        try:
            object.__setattr__(self, "device", torch.device(self.device))
        except (RuntimeError, TypeError):
            raise ValueError(f"device: expected a torch device, got {self.device!r}") from None
        for name in ("prefill_tp", "decode_tp"):
            size = getattr(self, name)
            if isinstance(size, bool) or not isinstance(size, int) or size < 1:
                raise ValueError(f"{name}: expected a TP size >= 1, got {size!r}")

    @property
    def grouped(self) -> bool:
        """This replica is a TP group (its role's TP size > 1)."""
        return (self.prefill_tp if self.role == "prefill" else self.decode_tp) > 1


@dataclass(frozen=True)
class TransportChoice:
    """A prefill replica's ``sender`` (one of :data:`SENDERS`; None on a decode replica) or a
    decode replica's ``receivers`` (of :data:`RECEIVERS`, ``"object_store"`` first); ``grouped``:
    build the TP group's variants; ``warning``: the option asked for what this placement cannot
    do (the replica logs it)."""

    sender: str | None
    receivers: tuple[str, ...]
    grouped: bool
    warning: str | None = None


def choose_transports(requested: str, placement: Placement) -> TransportChoice:
    """The transports of a replica at ``placement`` for the ``transfer.transport`` option
    ``requested`` (``ValueError`` naming ``transport`` where the device cannot do it)."""
    if not isinstance(placement, Placement):
        raise ValueError(f"placement: expected a Placement, got {type(placement).__name__}")
    own = select_transport(requested, device=placement.device)
    grouped = placement.grouped
    if placement.role == "prefill":
        kind = group_transport(own, placement.prefill_tp, placement.decode_tp)
        warning = None
        if kind == "object_store" and own == "cuda_ipc":
            side = "a TP prefill replica ships" if grouped else "a TP decode group receives"
            warning = (f"transfer.transport 'cuda_ipc': {side} over the object store "
                       "(use 'auto' or 'nccl' for channels to every rank)")
        if kind == "object_store":
            sender = "object_store"
        elif kind == "cuda_ipc":
            sender = "cuda_ipc"
        elif kind == IPC_OR_NCCL:
            sender = "cuda_ipc+channel"
        else:
            sender = "tp_channel" if grouped else "channel"
        return TransportChoice(sender, (), grouped, warning)
    kind = group_transport(own, placement.prefill_tp, placement.decode_tp) if grouped else own
    receivers = ["object_store"]
    if kind not in ("object_store", "cuda_ipc"):
        receivers.append("channel")
    if kind in ("cuda_ipc", IPC_OR_NCCL):
        receivers.append("cuda_ipc")
    return TransportChoice(None, tuple(receivers), grouped)


__all__ = ["Placement", "RECEIVERS", "ROLES", "SENDERS", "TransportChoice", "choose_transports"]
