"""CUDA IPC as the registry knows it: CUDA pools only, never between TP groups (a group's ranks
sit on several GPUs), and with a fallback (``auto``: the NCCL channel's end) for pools on
another GPU. The ends' imports wait for the first build."""

from __future__ import annotations

from ..spec import BuildContext, TransportSpec
from .config import IpcConfig


def _sender(context: BuildContext):
    from .send import CudaIpcSender

    return CudaIpcSender(identity=dict(context.identity), fallback=context.fallback,
                         lease_timeout_s=context.options.get("lease_timeout_s"))


def _receiver(context: BuildContext):
    from .recv import CudaIpcReceiver

    cfg = IpcConfig(**context.section("ipc"))
    # the fallback is also the way to pages on another GPU: the sender stages them on it
    stage = context.peers.stage_pages if context.fallback is not None and context.peers is not None else None
    return CudaIpcReceiver(identity=dict(context.identity), fallback=context.fallback, call_sender=stage,
                           copy_chunk_bytes=cfg.copy_chunk_bytes, idle_close_s=cfg.idle_close_s,
                           stage_timeout_s=cfg.stage_timeout_s, max_workers=cfg.max_workers)


CUDA_IPC = TransportSpec(
    name="cuda_ipc", family="cuda_ipc", devices=("cuda",), in_groups=False,
    summary="the decode replica copies the pages out of the prefill replica's pool on the same GPU",
    sender=_sender, receiver=_receiver,
)
