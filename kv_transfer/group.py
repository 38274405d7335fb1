"""A TP replica's ranks as its transports see them (:class:`RankGroup`) and the address of a
follower rank's transport end (:class:`RankEnd`).

The group ends of a transport (``TransportSpec.group_sender`` / ``group_receiver``) run on the
leader (rank 0); the follower ranks' parts run as their ``TransportSpec.rank_end`` in the
follower's process. ``serving.tp_group`` implements :class:`RankGroup` over Ray actors, so the
transports never see Ray's handles and the rank actors never see a transport's methods: a
follower runs ``call_end(end, method, *args)``, building the end from the registry the first
time.
"""

from __future__ import annotations

import abc
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class RankEnd:
    """Which end a follower call goes to: the ``transport`` (its registry name), the ``role``
    (``"send"`` or ``"receive"``) and the ``setup`` the follower builds it from at first use."""

    transport: str
    role: str
    setup: Mapping[str, Any] = field(default_factory=dict)


class RankGroup(abc.ABC):
    """The leader's handle on its group: ``pool`` (rank 0's), the head ``layout``, ``timeout_s``
    (the longest a follower's transfer call may take), and calls into the followers (ranks
    ``1..size-1``)."""

    pool: Any
    layout: Any
    timeout_s: float

    @property
    def size(self) -> int:
        return self.layout.tp_size

    @abc.abstractmethod
    def submit(self, rank: int, end: RankEnd, method: str, *args: Any) -> Any:
        """Start ``method(*args)`` of follower ``rank``'s ``end``; a handle for the calls below."""

    @abc.abstractmethod
    def results(self, handles: Sequence[Any], timeout_s: float) -> list:
        """Wait for the calls (blocking); raises what one raised, or on a timeout."""

    @abc.abstractmethod
    async def result(self, handle: Any, timeout_s: float | None = None) -> Any:
        """Await one call; raises what it raised, or on a timeout."""

    @abc.abstractmethod
    def wait(self, handles: Sequence[Any], timeout_s: float) -> None:
        """Wait until the calls are done or ``timeout_s`` passed; never raises."""

    @abc.abstractmethod
    def release(self, request_id: str) -> None:
        """Every rank lets ``request_id``'s pages go (in lockstep)."""

    @abc.abstractmethod
    def report_failure(self, exc: BaseException) -> None:
        """A follower is gone: the replica must be replaced."""


def rank_failed(rank: int | None, what: str, exc: BaseException) -> BaseException:
    """The ``RankFailed`` of a follower call that did not answer (``rank`` None: one of them)."""
    from model_executor.parallel import RankFailed

    who = "TP" if rank is None else f"TP rank {rank}:"
    return RankFailed(f"{who} {what}: {type(exc).__name__}: {str(exc)[:300]}")


__all__ = ["RankEnd", "RankGroup", "rank_failed"]
