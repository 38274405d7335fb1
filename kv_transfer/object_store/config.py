"""``ObjectStoreConfig``: the object-store transport's options (``transfer.object_store``)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ObjectStoreConfig:
    """fetch_timeout_s: receiver side: how long fetching a frame may take."""

    fetch_timeout_s: float = 60.0

    def __post_init__(self) -> None:
        value = self.fetch_timeout_s
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise ValueError(f"fetch_timeout_s: expected a positive number, got {value!r}")
