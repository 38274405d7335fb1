"""kv_transfer: the paged KV pool and page shipping between actors (see docs/ARCHITECTURE.md).

Never imports Ray at module import time (the object-store transport imports it when used).
"""

from .channel import ChannelConfig, ChannelTransport, payload_checksum
from .ipc import CudaIpcTransport
from .pool import KVPool, KVPoolConfig, PoolExhausted
from .transfer import (
    KVFrameHeader,
    KVTransport,
    LocalTransport,
    ObjectStoreTransport,
    TransferError,
    TransferFailure,
    TransferTicket,
    adopt_frame,
    pack_pages,
    read_frame,
    select_transport,
)

__all__ = [
    "ChannelConfig",
    "ChannelTransport",
    "CudaIpcTransport",
    "KVPool",
    "KVPoolConfig",
    "PoolExhausted",
    "KVFrameHeader",
    "KVTransport",
    "LocalTransport",
    "ObjectStoreTransport",
    "TransferError",
    "TransferFailure",
    "TransferTicket",
    "adopt_frame",
    "pack_pages",
    "payload_checksum",
    "read_frame",
    "select_transport",
]
