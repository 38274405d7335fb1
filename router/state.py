"""A request's life at the ingress, as an explicit state machine.

    RECEIVED -> PREFILLING -> TRANSFERRING -> DECODING -> FINISHED
                    ^              |           |
                    +--------------+-----------+  (retryable transfer failure, or the decode
                                                  replica died: prefill again and resume)
    any non-terminal state -> FAILED | CANCELLED

PREFILLING: a prefill replica owns the request (queue, forward, first token sampled).
TRANSFERRING: the first token is out; the prefill replica still holds the pages (its lease
stream is open) while a decode replica fetches and adopts them.
DECODING: the decode replica owns the pages; the prefill replica has released its copy.
A request whose first token ends it (stop token, ``max_tokens=1``) goes from PREFILLING
straight to FINISHED.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field


class RequestPhase(str, enum.Enum):
    RECEIVED = "received"
    PREFILLING = "prefilling"
    TRANSFERRING = "transferring"
    DECODING = "decoding"
    FINISHED = "finished"
    FAILED = "failed"
    CANCELLED = "cancelled"


TERMINAL = frozenset({RequestPhase.FINISHED, RequestPhase.FAILED, RequestPhase.CANCELLED})

_ALLOWED: dict[RequestPhase, frozenset[RequestPhase]] = {
    RequestPhase.RECEIVED: frozenset({RequestPhase.PREFILLING}),
    # PREFILLING -> PREFILLING: the prefill replica died before answering; try another
    RequestPhase.PREFILLING: frozenset({RequestPhase.PREFILLING, RequestPhase.TRANSFERRING, RequestPhase.FINISHED}),
    RequestPhase.TRANSFERRING: frozenset({RequestPhase.DECODING, RequestPhase.PREFILLING}),
    # DECODING -> PREFILLING: the decode replica died mid-stream; resume elsewhere
    RequestPhase.DECODING: frozenset({RequestPhase.FINISHED, RequestPhase.PREFILLING}),
}


class IllegalTransition(RuntimeError):
    pass


@dataclass
class RequestLifecycle:
    """Phase, timestamps and attempt count of one request (owned by the ingress)."""

    request_id: str
    phase: RequestPhase = RequestPhase.RECEIVED
    received_at: float = field(default_factory=time.monotonic)
    first_token_at: float | None = None
    finished_at: float | None = None
    prefill_attempts: int = 0
    history: list[tuple[RequestPhase, float]] = field(default_factory=list)

    def to(self, phase: RequestPhase) -> None:
        if phase in (RequestPhase.FAILED, RequestPhase.CANCELLED):
            if self.phase in TERMINAL:
                raise IllegalTransition(f"{self.request_id}: {self.phase.value} -> {phase.value}")
        elif phase not in _ALLOWED.get(self.phase, frozenset()):
            raise IllegalTransition(f"{self.request_id}: {self.phase.value} -> {phase.value}")
        now = time.monotonic()
        self.history.append((phase, now))
        self.phase = phase
        if phase is RequestPhase.PREFILLING:
            self.prefill_attempts += 1
        if phase in TERMINAL:
            self.finished_at = now

    @property
    def done(self) -> bool:
        return self.phase in TERMINAL

    def mark_first_token(self) -> None:
        if self.first_token_at is None:
            self.first_token_at = time.monotonic()

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_at is None else self.first_token_at - self.received_at
