"""Which transports a replica uses: the one decision, from where the replica sits
(:class:`Placement`: its role, its pool's device, both sides' TP sizes) and the
``transfer.transport`` option, read against what each registered transport declares
(``kv_transfer.registry``, ``TransportSpec``). ``serving.transports`` builds what it names.

A prefill replica has one sender (and the object store, for the retry after a failed channel
or IPC transfer); a decode replica has one receiver per kind of ticket it may be handed (always
the object store). The rules (docs/ARCHITECTURE.md "KV transfer", "Tensor parallelism"):
:func:`select_transport` reads the option against the device (``auto``: :data:`AUTO`); a TP
group on either side uses only transports that run between groups (:func:`group_transport`:
``auto`` on CUDA becomes the NCCL channel, ``cuda_ipc`` alone the object store); a TP=1 decode
replica keeps the receivers of its own device's choice whatever the prefill side is (a TP
prefill group then ships over a channel or the object store, both of which it has).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .registry import get_transport, transport_names

RETRY = "object_store"  # every replica has it: the retry after a failed transfer, and what groups fall back on
# What ``auto`` means per pool device type: for CUDA pools CUDA IPC when the receiver's pool is on
# the sender's GPU, the NCCL channel otherwise (a chosen kind "a+b": transport a, whose ends fall
# back on b's); the object store elsewhere.
IPC_OR_NCCL = "cuda_ipc+nccl"
AUTO = {"cuda": IPC_OR_NCCL, "cpu": RETRY}


def _parts(kind: str) -> list[str]:
    return kind.split("+")


def select_transport(requested: str, *, device: str | torch.device) -> str:
    """Which transport a replica whose KV pool lives on ``device`` exports with: ``requested``
    itself, or ``auto``'s choice for the device (:data:`AUTO`). ``cuda_ipc`` alone fails a
    transfer to a pool on another GPU, which the service then retries over the object store.
    A transport that does not move pools of this device (``nccl`` and ``cuda_ipc``: CUDA;
    ``gloo``: CPU) is refused with ``ValueError``: a configuration error, not a silent slowdown.
    """
    kind = torch.device(device).type
    if requested == "auto":
        return AUTO.get(kind, RETRY)
    spec = get_transport(requested)  # ValueError naming transfer.transport for an unknown name
    if not spec.moves(kind):
        fits = [n for n in transport_names(options_only=True) if get_transport(n).moves(kind)]
        raise ValueError(f"transfer.transport: {requested!r} moves {' or '.join(d.upper() for d in spec.devices)} "
                         f"KV pools, this one is on {device}; use one of {('auto', *fits)}")
    return requested


def tp_transport_choice(kind: str) -> str:
    """How KV moves when either side is a TP group, for ``select_transport``'s ``kind``: the
    family of :func:`group_transport`'s answer (``"channel"``: pairwise channels per (prefill
    rank, decode rank) pair; ``"object_store"``: one merged frame, split by head on a TP decode
    replica)."""
    try:
        return get_transport(group_transport(kind, 2, 1)).family
    except ValueError:
        raise ValueError(f"kind: expected a select_transport() result, got {kind!r}") from None


def group_transport(kind: str, prefill_tp: int, decode_tp: int) -> str:
    """The transport a deployment uses for ``select_transport``'s ``kind`` given both sides'
    TP sizes: ``kind`` itself when neither side is a group; else its first part that runs
    between groups (``TransportSpec.in_groups``: ``auto`` on CUDA is the NCCL channel), or the
    object store. CUDA IPC never joins a group (docs/ARCHITECTURE.md "Tensor parallelism")."""
    for name, size in (("prefill_tp", prefill_tp), ("decode_tp", decode_tp)):
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"{name}: expected a TP size >= 1, got {size!r}")
    specs = [get_transport(p) for p in _parts(kind)]
    if prefill_tp == 1 and decode_tp == 1:
        return kind
    return next((s.name for s in specs if s.in_groups), RETRY)


ROLES = ("prefill", "decode")


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
    """What a replica builds. ``sender`` (a prefill replica; None on a decode replica) and
    ``receivers`` (a decode replica's, ``"object_store"`` first) name ends by their transports'
    family: ``"object_store"``, ``"channel"``, ``"cuda_ipc"``; ``"a+b"`` is a's end falling back
    on b's; ``"tp_"`` marks a TP group's ranks each moving their own heads. ``grouped``: build
    the TP group's variants; ``warning``: the option asked for what this placement cannot do
    (the replica logs it); ``kind``: the transports to build, by registry name (``"a+b"`` as
    above; the object store of the retries aside)."""

    sender: str | None
    receivers: tuple[str, ...]
    grouped: bool
    warning: str | None = None
    kind: str = RETRY


def choose_transports(requested: str, placement: Placement) -> TransportChoice:
    """The transports of a replica at ``placement`` for the ``transfer.transport`` option
    ``requested`` (``ValueError`` naming ``transfer.transport`` where the device cannot do it)."""
    if not isinstance(placement, Placement):
        raise ValueError(f"placement: expected a Placement, got {type(placement).__name__}")
    own = select_transport(requested, device=placement.device)
    grouped = placement.grouped
    if placement.role == "prefill" or grouped:
        kind = group_transport(own, placement.prefill_tp, placement.decode_tp)
    else:  # a TP=1 decode replica receives whatever its device's choice can
        kind = own
    specs = [get_transport(p) for p in _parts(kind)]
    if placement.role == "decode":
        return TransportChoice(None, (RETRY, *(s.family for s in reversed(specs) if s.name != RETRY)), grouped,
                               kind=kind)
    warning = None
    if kind == RETRY and own not in (RETRY, AUTO.get(placement.device.type)):
        side = "a TP prefill replica ships" if grouped else "a TP decode group receives"
        usable = [n for n in transport_names(options_only=True) if n != RETRY
                  and get_transport(n).in_groups and get_transport(n).moves(placement.device.type)]
        warning = (f"transfer.transport {own!r}: {side} over the object store "
                   f"(use {' or '.join(repr(n) for n in ('auto', *usable))} to reach every rank)")
    sender = "+".join(s.family for s in specs)
    if grouped and kind != RETRY:
        sender = f"tp_{sender}"
    return TransportChoice(sender, (), grouped, warning, kind)


__all__ = ["AUTO", "IPC_OR_NCCL", "Placement", "RETRY", "ROLES", "TransportChoice", "choose_transports",
           "group_transport", "select_transport", "tp_transport_choice"]
