"""Why a KV transfer failed: :class:`TransferFailure` (the reason, and whether a new attempt
can help) and :class:`TransferError` (what every transport raises; it survives Ray's exception
shipping with its typed fields)."""

from __future__ import annotations

import enum


class TransferFailure(str, enum.Enum):
    """Why a transfer failed; ``retryable`` says whether shipping the same pages again can help."""

    MALFORMED = "malformed"  # not a frame, bad header, unknown keys, limits exceeded
    TRUNCATED = "truncated"  # frame shorter or longer than the header says
    CHECKSUM = "checksum"  # payload bytes do not match the header's CRC-32
    SHAPE = "shape"  # geometry or dtype differs from the receiving pool
    REQUEST_MISMATCH = "request_mismatch"  # the frame belongs to another request
    POOL_EXHAUSTED = "pool_exhausted"  # the receiving pool has no room
    LOST = "lost"  # the transport lost the data (sender died, object evicted, channel failed or hung)
    UNAVAILABLE = "unavailable"  # this transport cannot be used for this pair (backend, peer gone)

    @property
    def retryable(self) -> bool:
        """Whether a new attempt can succeed (for LOST/UNAVAILABLE channel transfers: over the
        object store); SHAPE, MALFORMED and REQUEST_MISMATCH are bugs or misconfiguration."""
        return self in (
            TransferFailure.TRUNCATED,
            TransferFailure.CHECKSUM,
            TransferFailure.POOL_EXHAUSTED,
            TransferFailure.LOST,
            TransferFailure.UNAVAILABLE,
        )


class TransferError(RuntimeError):
    """A KV transfer failed; nothing stays allocated on the receiving side."""

    def __init__(self, reason: TransferFailure | str, message: str, request_id: str | None = None) -> None:
        self.reason = TransferFailure(reason)
        self.request_id = request_id
        self.detail = message
        who = f" (request {request_id!r})" if request_id is not None else ""
        super().__init__(f"KV transfer failed [{self.reason.value}]{who}: {message}")

    @property
    def retryable(self) -> bool:
        return self.reason.retryable

    def __reduce__(self):  # typed fields survive Ray's exception shipping
        return (type(self), (self.reason.value, self.detail, self.request_id))

