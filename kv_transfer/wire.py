"""What a receiver and a sender of a transfer say to each other through Ray (the pages travel
over the channel): the typed control messages :class:`SendPages` / :class:`SendReply` (a
channel send) and :class:`StagePages` / :class:`StageReply` (CUDA IPC's fallback: stage the
pages on the channel), and how a receiver reads a reply.

They live here, not in ``serving.messages`` (which re-exports them), because the transports
build and answer them and ``kv_transfer`` sits below ``serving``. A request comes from another
replica: the side that acts on it checks it (:meth:`SendPages.check`, ``ValueError`` naming
the field); a pickled dataclass skips ``__init__``, so the check cannot live there.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from .errors import TransferFailure

# no torch here (nor in errors): serving.messages re-exports these messages, and the ingress,
# which never imports torch, reads them (tests/test_ingress_imports.py)
MAX_REQUEST_ID_LEN = 256
_U64 = (1 << 64) - 1  # checksums travel as unsigned 64-bit words
_PREFIX_ROOT = "fpkv/"
_MAX_NAME_LEN = 256
MAX_PULLS = 1 << 16
_REPLY_REASONS = (TransferFailure.LOST, TransferFailure.UNAVAILABLE)


def _short_str(name: str, value: Any, limit: int) -> None:
    if not isinstance(value, str) or not value or len(value) > limit:
        raise ValueError(f"{name}: expected a short non-empty str, got {value!r:.80}")


@dataclass(frozen=True, slots=True)
class SendPages:
    """What a receiver asks a sender (``PrefillServer.send_pages``): send ``request_id``'s
    pages over this channel, in chunks of ``layers_per_chunk`` whole layers.

    A TP prefill group's request also names the rank holding the pages and which of the rank's
    local KV heads the receiver needs (``kv_transfer.channel.group.TPChannelTransport``); a
    per-head pull (``receive_heads``) adds ``pulls``: how many sends the receiving replica makes
    for the request in all (one per (prefill rank, decode rank) route), so the sender's lease
    ends only after the last of them (prefill_worker/leases.py ``LeaseTable.sent``)."""

    request_id: str
    sender_id: str
    receiver_id: str
    host: str
    port: int
    prefix: str
    generation: int
    backend: str
    timeout_s: float
    layers_per_chunk: int
    rank: int | None = None
    heads: tuple[int, ...] | None = None
    pulls: int | None = None

    def check(self) -> "SendPages":
        """Typed and bounded fields, ``rank`` and ``heads`` together, ``pulls`` only with them
        (``ValueError`` naming the field); returns ``self``."""
        for key in ("request_id", "sender_id", "receiver_id", "host", "prefix", "backend"):
            _short_str(key, getattr(self, key), max(MAX_REQUEST_ID_LEN, _MAX_NAME_LEN) * 2)
        if not self.prefix.startswith(_PREFIX_ROOT) or not self.prefix.endswith("/"):
            raise ValueError(f"prefix: expected '{_PREFIX_ROOT}.../', got {self.prefix!r}")
        for key, lo, hi in (("port", 1, 65535), ("generation", 1, 1 << 62), ("layers_per_chunk", 1, 1 << 20)):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
                raise ValueError(f"{key}: expected an int in [{lo}, {hi}], got {value!r}")
        timeout = self.timeout_s
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout <= 86400:
            raise ValueError(f"timeout_s: expected a number in (0, 86400], got {timeout!r}")
        if (self.rank is None) != (self.heads is None):
            raise ValueError(f"rank, heads: expected both (a TP group's rank) or neither, got rank={self.rank!r}, "
                             f"heads={self.heads!r:.80}")
        if self.rank is None:
            if self.pulls is not None:
                raise ValueError("pulls: expected only with rank and heads (a per-head pull)")
            return self
        rank, heads = self.rank, self.heads
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < 1 << 16:
            raise ValueError(f"rank: expected an int in [0, 65536), got {rank!r}")
        if (not isinstance(heads, tuple) or not 0 < len(heads) <= 1 << 12 or len(set(heads)) != len(heads)
                or any(isinstance(h, bool) or not isinstance(h, int) or not 0 <= h < 1 << 12 for h in heads)):
            raise ValueError(f"heads: expected a tuple of distinct local KV head indices, got {heads!r:.80}")
        if self.pulls is not None:
            parse_pulls(self.pulls)
        return self

    @classmethod
    def parse(cls, obj: Any) -> "SendPages":
        """``obj`` checked (:meth:`check`), or ``ValueError`` naming what is wrong."""
        if not isinstance(obj, cls):
            raise ValueError(f"request: expected a {cls.__name__}, got {type(obj).__name__}")
        return obj.check()


@dataclass(frozen=True, slots=True)
class SendReply:
    """A sender's answer to :class:`SendPages`: ``ok``, or the failure's ``reason`` (a
    ``TransferFailure`` value) and ``message``; ``checksums``: one per chunk when ``ok``."""

    ok: bool
    reason: str | None = None
    message: str = ""
    checksums: tuple[int, ...] | None = None


@dataclass(frozen=True, slots=True)
class StagePages:
    """CUDA IPC with a fallback (``PrefillServer.stage_pages``): a receiver on another GPU asks
    the sender to export ``request_id``'s leased pages over its ``transport`` channel."""

    request_id: str
    sender_id: str
    transport: str

    def check(self) -> "StagePages":
        """Every field a short non-empty str (``ValueError`` naming it); returns ``self``."""
        for key in ("request_id", "sender_id", "transport"):
            _short_str(key, getattr(self, key), max(MAX_REQUEST_ID_LEN, _MAX_NAME_LEN))
        return self

    @classmethod
    def parse(cls, obj: Any) -> "StagePages":
        if not isinstance(obj, cls):
            raise ValueError(f"request: expected a {cls.__name__}, got {type(obj).__name__}")
        return obj.check()


@dataclass(frozen=True, slots=True)
class StageReply:
    """A sender's answer to :class:`StagePages`: ``ok`` with the fallback channel's ``ticket``,
    or the failure's ``reason`` (a ``TransferFailure`` value) and ``message``."""

    ok: bool
    reason: str | None = None
    message: str = ""
    ticket: Any = None


def parse_pulls(value: Any) -> int:
    """A send request's ``pulls`` (ValueError naming it unless an int in [1, MAX_PULLS])."""
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_PULLS:
        raise ValueError(f"pulls: expected an int in [1, {MAX_PULLS}], got {value!r:.80}")
    return value


def send_pulls(request: Any) -> int:
    """How many sends the receiver of ``request`` (a send request, possibly malformed) makes
    for its request in all: its ``pulls``, 1 when it names none (a whole-replica pull) or a bad
    value (the send itself is refused then)."""
    try:
        pulls = request.pulls if isinstance(request, SendPages) else None
        return parse_pulls(pulls) if pulls is not None else 1
    except ValueError:
        return 1


def _reply(ok: bool, reason: TransferFailure | None = None, message: str = "",
           checksums: list[int] | None = None) -> SendReply:
    return SendReply(ok, reason.value if reason is not None else None, message,
                     tuple(checksums) if checksums is not None else None)


def reply_reason(reply: Any, kind: type) -> tuple[TransferFailure | None, str]:
    """(reason, message) of a failed reply of type ``kind``, (None, "") for success; anything
    but a ``kind`` is LOST, and a reason a sender may not give (only LOST, UNAVAILABLE) too."""
    if not isinstance(reply, kind) or not isinstance(reply.ok, bool):
        return TransferFailure.LOST, f"unexpected reply {type(reply).__name__}"
    if reply.ok:
        return None, ""
    try:
        reason = TransferFailure(reply.reason)
    except ValueError:
        reason = TransferFailure.LOST
    if reason not in _REPLY_REASONS:
        reason = TransferFailure.LOST
    return reason, str(reply.message)[:500]


def _reply_failure(reply: asyncio.Future) -> tuple[TransferFailure | None, str]:
    """(reason, message) of a failed ``serve_send`` reply, (None, "") for success."""
    if reply.cancelled():
        return TransferFailure.LOST, "the call was cancelled"
    exc = reply.exception()
    if exc is not None:  # the sender replica died, could not be reached, ...
        return TransferFailure.LOST, f"{type(exc).__name__}: {exc}"
    return reply_reason(reply.result(), SendReply)


def _sender_checksums(reply: Any, n: int) -> list[int] | None:
    """The per-chunk checksums of a successful ``serve_send`` reply, or None if it has not ``n``."""
    sums = reply.checksums if isinstance(reply, SendReply) else None
    if (isinstance(sums, (list, tuple)) and len(sums) == n
            and all(isinstance(x, int) and not isinstance(x, bool) and 0 <= x <= _U64 for x in sums)):
        return list(sums)
    return None
