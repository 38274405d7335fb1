"""What a receiver and a sender of a channel transfer say to each other through Ray (the pages
travel over the channel): the send request (strictly parsed: it comes from another replica), the
reply, and how a receiver reads a reply.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from .pages import _U64
from .transfer import MAX_REQUEST_ID_LEN, TransferFailure

_PREFIX_ROOT = "fpkv/"
_MAX_NAME_LEN = 256
_SEND_REQUEST_KEYS = frozenset(
    {"request_id", "sender_id", "receiver_id", "host", "port", "prefix", "generation", "backend", "timeout_s",
     "layers_per_chunk"}
)
# A TP prefill group's send request also names the rank holding the pages and the rank's
# local KV heads the receiver needs (kv_transfer.tp_transfer.TPChannelTransport); a per-head
# pull (``receive_heads``) adds ``pulls``: how many sends the receiving replica makes for the
# request in all (one per (prefill rank, decode rank) route), so the sender's lease ends only
# after the last of them (prefill_worker/leases.py ``LeaseTable.sent``).
_TP_SEND_KEYS = frozenset({"rank", "heads"})
_PULLS_KEY = "pulls"
MAX_PULLS = 1 << 16
_REPLY_REASONS = (TransferFailure.LOST, TransferFailure.UNAVAILABLE)


@dataclass(frozen=True)
class _SendRequest:
    """What a receiver asks a sender: send ``request_id``'s pages over this channel, in
    chunks of ``layers_per_chunk`` whole layers."""

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
    rank: int | None = None  # TP prefill groups: the rank holding the pages
    heads: tuple[int, ...] | None = None  # ... and which of its local KV heads to send, in order
    pulls: int | None = None  # per-head pulls: the sends the receiving replica makes for the request in all

    @classmethod
    def parse(cls, obj: Any) -> "_SendRequest":
        """Strict: exact key set (optionally with both ``rank`` and ``heads``, and then
        optionally ``pulls``), typed and bounded fields (``ValueError`` naming the field)."""
        tp = _SEND_REQUEST_KEYS | _TP_SEND_KEYS
        if not isinstance(obj, dict) or set(obj) not in (_SEND_REQUEST_KEYS, tp, tp | {_PULLS_KEY}):
            got = sorted(map(str, obj)) if isinstance(obj, dict) else type(obj).__name__
            raise ValueError(f"request: expected the keys {sorted(_SEND_REQUEST_KEYS)} (and, per head, "
                             f"{sorted(_TP_SEND_KEYS)}, optionally {_PULLS_KEY!r}), got {got}")
        extra = {}
        if _PULLS_KEY in obj:
            extra["pulls"] = parse_pulls(obj[_PULLS_KEY])
            obj = {k: v for k, v in obj.items() if k != _PULLS_KEY}
        if "rank" in obj:
            rank, heads = obj["rank"], obj["heads"]
            if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < 1 << 16:
                raise ValueError(f"rank: expected an int in [0, 65536), got {rank!r}")
            if (not isinstance(heads, (list, tuple)) or not 0 < len(heads) <= 1 << 12 or len(set(heads)) != len(heads)
                    or any(isinstance(h, bool) or not isinstance(h, int) or not 0 <= h < 1 << 12 for h in heads)):
                raise ValueError(f"heads: expected distinct local KV head indices, got {heads!r:.80}")
            extra.update(rank=rank, heads=tuple(heads))
            obj = {k: v for k, v in obj.items() if k not in _TP_SEND_KEYS}
        for key in ("request_id", "sender_id", "receiver_id", "host", "prefix", "backend"):
            value = obj[key]
            if not isinstance(value, str) or not value or len(value) > max(MAX_REQUEST_ID_LEN, _MAX_NAME_LEN) * 2:
                raise ValueError(f"{key}: expected a short non-empty str, got {value!r:.80}")
        if not obj["prefix"].startswith(_PREFIX_ROOT) or not obj["prefix"].endswith("/"):
            raise ValueError(f"prefix: expected '{_PREFIX_ROOT}.../', got {obj['prefix']!r}")
        for key, lo, hi in (("port", 1, 65535), ("generation", 1, 1 << 62), ("layers_per_chunk", 1, 1 << 20)):
            value = obj[key]
            if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
                raise ValueError(f"{key}: expected an int in [{lo}, {hi}], got {value!r}")
        timeout = obj["timeout_s"]
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout <= 86400:
            raise ValueError(f"timeout_s: expected a number in (0, 86400], got {timeout!r}")
        return cls(**obj, **extra)


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
        return parse_pulls(request[_PULLS_KEY]) if isinstance(request, dict) and _PULLS_KEY in request else 1
    except ValueError:
        return 1


def _reply(ok: bool, reason: TransferFailure | None = None, message: str = "",
           checksums: list[int] | None = None) -> dict:
    return {"ok": ok, "reason": reason.value if reason is not None else None, "message": message,
            "checksums": checksums}


def _reply_failure(reply: asyncio.Future) -> tuple[TransferFailure | None, str]:
    """(reason, message) of a failed ``serve_send`` reply, (None, "") for success."""
    if reply.cancelled():
        return TransferFailure.LOST, "the call was cancelled"
    exc = reply.exception()
    if exc is not None:  # the sender replica died, could not be reached, ...
        return TransferFailure.LOST, f"{type(exc).__name__}: {exc}"
    obj = reply.result()
    if not isinstance(obj, dict) or not isinstance(obj.get("ok"), bool):
        return TransferFailure.LOST, f"unexpected reply {type(obj).__name__}"
    if obj["ok"]:
        return None, ""
    try:
        reason = TransferFailure(obj.get("reason"))
    except ValueError:
        reason = TransferFailure.LOST
    if reason not in _REPLY_REASONS:
        reason = TransferFailure.LOST
    return reason, str(obj.get("message"))[:500]


def _sender_checksums(reply: dict, n: int) -> list[int] | None:
    """The per-chunk checksums of a successful ``serve_send`` reply, or None if it has not ``n``."""
    sums = reply.get("checksums")
    if (isinstance(sums, list) and len(sums) == n
            and all(isinstance(x, int) and not isinstance(x, bool) and 0 <= x <= _U64 for x in sums)):
        return sums
    return None
