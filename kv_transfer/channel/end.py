"""``ChannelEnd``: what a channel's sender and receiver share (checked settings, worker threads,
side streams, counters, closing). The transport itself: ``kv_transfer.channel``'s docstring."""


from __future__ import annotations

import abc
import collections
import threading
from concurrent.futures import ThreadPoolExecutor

import torch

from ..wire import _MAX_NAME_LEN
from .config import ChannelConfig
from .pages import _Lane
from .process_group import Channel, CHANNEL_BACKENDS

# Both ends report every key, so a replica's stats keep one shape whichever end it holds.
_COUNTER_KEYS = ("channel_sends", "channel_receives", "channel_failures", "channels_opened",
                 "channel_bytes_sent", "channel_bytes_received")


class ChannelEnd(abc.ABC):
    """What a sender and a receiver of channel transfers share (see the module docstring).

    device: the KV pool's device; it picks the backend (CUDA: NCCL, CPU: gloo) and the
        transport's ``name`` (what tickets say).
    host: this replica's node address: the receiver's store listens there, gloo binds to it.
    identity: how tickets name this replica as a sender (``replica_id`` plus whatever
        ``call_sender`` needs to reach it again, e.g. Serve's app and deployment names).
    """

    def __init__(self, device: str | torch.device, *, host: str = "127.0.0.1", identity: dict | None = None,
                 config: ChannelConfig | None = None, max_workers: int = 8) -> None:
        try:
            dev = torch.device(device)
        except (RuntimeError, TypeError) as exc:
            raise ValueError(f"device: expected a torch device, got {device!r}") from exc
        if dev.type not in CHANNEL_BACKENDS:
            raise ValueError(f"device: channels move CUDA (NCCL) or CPU (gloo) pools, got {device!r}")
        config = ChannelConfig() if config is None else config
        if not isinstance(config, ChannelConfig):
            raise ValueError(f"config: expected a ChannelConfig, got {type(config).__name__}")
        identity = {"replica_id": "local", **(identity or {})}
        for key, value in identity.items():
            if not isinstance(key, str) or not isinstance(value, str) or not value or len(value) > _MAX_NAME_LEN:
                raise ValueError(f"identity: expected short non-empty str values, got {key!r}: {value!r}")
        if not isinstance(host, str) or not host:
            raise ValueError(f"host: expected this node's address, got {host!r}")
        self.device = dev
        self.backend = CHANNEL_BACKENDS[dev.type]
        self.name = self.backend
        self.host = host
        self.identity = identity
        self.config = config
        self._executor = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix=f"kv-{self.backend}")
        self._lock = threading.Lock()  # the end's shared tables and _lanes (event loop and worker threads)
        # Side streams per (role, peer), kept across transfers: the caching allocator hands a
        # block freed on a stream back only to that stream, so one ring's memory serves every
        # transfer with that peer instead of piling up on fresh streams.
        self._lanes: dict[tuple[str, str], list[_Lane]] = {}
        self._counts: collections.Counter = collections.Counter()
        self._closed = False

    @property
    def replica_id(self) -> str:
        return self.identity["replica_id"]

    def _lanes_for(self, role: str, peer: str, device: torch.device, count: int) -> list[_Lane]:
        with self._lock:
            lanes = self._lanes.get((role, peer))
            if lanes is None:
                lanes = self._lanes[(role, peer)] = [_Lane(device) for _ in range(count)]
        return lanes

    @abc.abstractmethod
    def _tally(self) -> tuple[int, int]:
        """(channels open at this end, exports held)."""

    @abc.abstractmethod
    def _detach(self) -> list[Channel]:
        """Closing: forget this end's channels (and exports); returns the channels to abort."""

    def counters(self) -> dict[str, int]:
        open_channels, exported = self._tally()
        out = {k: int(self._counts[k]) for k in _COUNTER_KEYS}
        out["channels_open"] = open_channels
        out["channel_staged"] = exported  # exports not yet sent or discarded (pages only: no copies)
        return out

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        channels = self._detach()
        for ch in channels:
            ch.mark_broken()
        for ch in channels:
            ch.abort()
        self._executor.shutdown(wait=False, cancel_futures=True)


__all__ = ["ChannelEnd"]
