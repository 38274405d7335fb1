"""``ChannelConfig``: the time bounds and chunking of pairwise KV channels (``transfer.channel``).

Apart from the channel's ends so that the service's options (``serving.config``) build it
without importing the transport: only the standard library here.
"""

from __future__ import annotations

from dataclasses import dataclass

_MAX_RING_DEPTH = 8


@dataclass(frozen=True)
class ChannelConfig:
    """Time bounds and chunking of channel transfers.

    connect_timeout_s: opening a channel (store connection, rendezvous, NCCL unique-id
        exchange), and waiting behind other transfers of the same pair.
    transfer_timeout_s, min_bytes_per_s: a transfer that has not completed within
        ``transfer_timeout_s + payload_bytes / min_bytes_per_s`` counts as hung.
    idle_reopen_s: a receiver opens a new generation instead of reusing a channel idle
        longer than this; senders drop channels idle for twice as long (dead receivers).
    chunk_bytes: the target size of one chunk: K and V of as many whole layers of the
        request as fit, at least one layer. The receiver's value decides a transfer.
    ring_depth: chunk buffers at each end. 2 keeps one chunk on the wire while the next is
        gathered (or the last scattered); 3 absorbs jitter between the two; 1 runs the steps
        one after the other. A transfer stages at most ``ring_depth x max(chunk_bytes, one
        layer's K+V of the request)`` bytes at each end.
    """

    connect_timeout_s: float = 30.0
    transfer_timeout_s: float = 10.0
    min_bytes_per_s: float = 1e9
    idle_reopen_s: float = 300.0
    chunk_bytes: int = 256 << 20
    ring_depth: int = 3

    def __post_init__(self) -> None:
        for name in ("connect_timeout_s", "transfer_timeout_s", "min_bytes_per_s", "idle_reopen_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"{name}: expected a positive number, got {value!r}")
        for name, lo, hi in (("chunk_bytes", 1, 1 << 50), ("ring_depth", 1, _MAX_RING_DEPTH)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
                raise ValueError(f"{name}: expected an int in [{lo}, {hi}], got {value!r}")

    def transfer_budget_s(self, payload_bytes: int) -> float:
        return self.transfer_timeout_s + payload_bytes / self.min_bytes_per_s

    def layers_per_chunk(self, num_layers: int, layer_bytes: int) -> int:
        """Whole layers per chunk of a request whose K+V of one layer take ``layer_bytes``."""
        if layer_bytes <= 0:  # no pages: one empty chunk
            return num_layers
        return max(1, min(num_layers, self.chunk_bytes // layer_bytes))
