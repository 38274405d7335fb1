"""``IpcConfig``: the receiver side's options of CUDA IPC transfers (``transfer.ipc``)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class IpcConfig:
    """copy_chunk_bytes: the most temporary device memory one copy step takes.
    idle_close_s: mappings unused this long are closed.
    stage_timeout_s: how long the sender may take to stage pages over the fallback channel.
    max_workers: threads that run the copies.

    The receiver (``CudaIpcReceiver``) checks the values."""

    copy_chunk_bytes: int = 256 << 20
    idle_close_s: float = 60.0
    stage_timeout_s: float = 30.0
    max_workers: int = 4
