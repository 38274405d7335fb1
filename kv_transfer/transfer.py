"""The public names of KV transfer, in one import for the layers above (``serving``, the worker
deployments, tests and tools); each lives in the module that does its job:

- ``errors``: ``TransferFailure``, ``TransferError``;
- ``header``: ``KVFrameHeader`` (the msgpack header of one request's pages), ``describe_pages``,
  ``check_geometry``, ``adopt_pages``;
- ``frame``: the object store's frame codec (``pack_pages``, ``read_frame``, ``adopt_frame``);
- ``faults``: ``corrupt_frame`` (fault injection);
- ``interfaces``: ``TransferTicket``, ``KVSender``, ``KVReceiver``, ``KVTransport``;
- the transports, one folder each (``object_store/``, ``channel/``, ``cuda_ipc/``; ``local``),
  by name through ``registry`` (``get_transport``, ``register_transport``);
- ``choice``: ``select_transport`` and which transports a replica builds; ``factory`` builds them.

Nothing in ``kv_transfer`` imports this module.
"""

from __future__ import annotations

from .choice import IPC_OR_NCCL, select_transport
from .errors import TransferError, TransferFailure
from .faults import corrupt_frame
from .frame import FRAME_MAGIC, MAX_HEADER_BYTES, adopt_frame, pack_pages, read_frame
from .header import CHECKSUM_KINDS, FRAME_VERSION, MAX_REQUEST_ID_LEN, KVFrameHeader, adopt_pages, check_geometry, \
    describe_pages
from .interfaces import KVReceiver, KVSender, KVTransport, TransferTicket
from .local import LocalTransport
from .object_store.transport import ObjectStoreTransport
from .registry import get_transport, register_transport, transport_names

__all__ = [
    "CHECKSUM_KINDS", "FRAME_MAGIC", "FRAME_VERSION", "IPC_OR_NCCL", "KVFrameHeader", "KVReceiver", "KVSender",
    "KVTransport", "LocalTransport", "MAX_HEADER_BYTES", "MAX_REQUEST_ID_LEN", "ObjectStoreTransport",
    "TransferError", "TransferFailure", "TransferTicket", "adopt_frame", "adopt_pages", "check_geometry",
    "corrupt_frame", "describe_pages", "get_transport", "pack_pages", "read_frame", "register_transport",
    "select_transport", "transport_names",
]
