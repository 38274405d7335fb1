"""The KV transports by name: what each value of ``transfer.transport`` builds.

A transport lives in a folder of its own (``object_store/``, ``channel/``, ``cuda_ipc/``) whose
``spec`` module declares a :class:`kv_transfer.spec.TransportSpec`: what it can do (the pools'
devices it moves, whether it runs between TP groups) and how its ends are built. This module
only maps names to those declarations, as ``"module:attribute"`` paths imported at first use,
so that the service's options (``serving.config``) read the names without importing a transport
(standard library only here).

Adding a transport is its folder plus one line in :data:`_BUILTIN` (or one
:func:`register_transport` call, as a test's toy transport does). Selection
(``kv_transfer.choice``) and the replicas' factory (``serving.transports``) ask
:func:`get_transport`; nobody else names a transport.
"""

from __future__ import annotations

import importlib
import re
from dataclasses import dataclass
from typing import Any

from .spec import TransportSpec


@dataclass(frozen=True)
class _Entry:
    target: Any  # "module:attribute" of a TransportSpec, or the spec itself
    option: bool  # a value of the ``transfer.transport`` option (False: tests and tools only)


# The order is the option's order in the service's help and docs.
_BUILTIN: dict[str, _Entry] = {
    "object_store": _Entry("kv_transfer.object_store.spec:OBJECT_STORE", True),
    "nccl": _Entry("kv_transfer.channel.spec:NCCL", True),
    "cuda_ipc": _Entry("kv_transfer.cuda_ipc.spec:CUDA_IPC", True),
    "gloo": _Entry("kv_transfer.channel.spec:GLOO", True),
    "local": _Entry("kv_transfer.local:LOCAL", False),
}
_registry: dict[str, _Entry] = dict(_BUILTIN)
_NAME = re.compile(r"[a-z][a-z0-9_]{0,31}")
RESERVED = ("auto",)  # a policy of kv_transfer.choice, not a transport


def register_transport(name: str, spec: TransportSpec | str, *, option: bool = True) -> None:
    """Make ``spec`` (a :class:`TransportSpec` or its ``"module:attribute"`` path) the
    transport called ``name``. ``option``: a value ``transfer.transport`` accepts (the service's
    options list the transports registered when ``serving.config`` is first imported)."""
    if not isinstance(name, str) or not _NAME.fullmatch(name) or name in RESERVED:
        raise ValueError(f"name: expected a lower-case identifier of at most 32 characters other than "
                         f"{RESERVED}, got {name!r}")
    if name in _registry:
        raise ValueError(f"name: a transport {name!r} is already registered")
    if isinstance(spec, TransportSpec):
        if spec.name != name:
            raise ValueError(f"spec: its name is {spec.name!r}, registered as {name!r}")
    elif not isinstance(spec, str) or spec.count(":") != 1:
        raise ValueError(f"spec: expected a TransportSpec or 'module:attribute', got {spec!r}")
    _registry[name] = _Entry(spec, bool(option))


def unregister_transport(name: str) -> None:
    """Forget a transport :func:`register_transport` added (tests); the built-in ones stay."""
    if name in _BUILTIN or name not in _registry:
        raise ValueError(f"name: expected a transport added by register_transport, got {name!r}")
    del _registry[name]


def transport_names(*, options_only: bool = False) -> tuple[str, ...]:
    """The registered names (``options_only``: those ``transfer.transport`` accepts)."""
    return tuple(n for n, e in _registry.items() if e.option or not options_only)


def get_transport(name: str) -> TransportSpec:
    """The spec of the transport ``name`` (``ValueError`` naming ``transfer.transport`` and
    listing the registered names when there is none)."""
    entry = _registry.get(name) if isinstance(name, str) else None
    if entry is None:
        raise ValueError(f"transfer.transport: expected one of {transport_names()} (or 'auto'), got {name!r}")
    spec = entry.target
    if isinstance(spec, str):
        module, _, attr = spec.partition(":")
        spec = getattr(importlib.import_module(module), attr)
        if not isinstance(spec, TransportSpec) or spec.name != name:
            raise TypeError(f"{entry.target}: expected the TransportSpec of {name!r}, got {spec!r}")
    return spec


__all__ = ["RESERVED", "get_transport", "register_transport", "transport_names", "unregister_transport"]
