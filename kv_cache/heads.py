"""Which tensor-parallel rank holds which attention heads: how a model's KV pool is sliced by KV
head over the ranks of a TP group.

Megatron-style head split over ``tp_size`` ranks (the layout ``model_executor.parallel`` shards
the projections by, and the KV pool of each rank holds):
- query heads: rank ``r`` holds the contiguous ``num_q_heads / tp_size`` heads starting at
  ``r * num_q_heads / tp_size``;
- KV heads, ``tp_size <= num_kv_heads``: rank ``r`` holds ``num_kv_heads / tp_size`` contiguous heads;
  ``tp_size > num_kv_heads``: each KV head is *replicated* on ``tp_size / num_kv_heads`` consecutive
  ranks (rank ``r`` holds head ``r // (tp_size / num_kv_heads)``), as vLLM does. Either way a rank's
  query heads all read its own KV heads: attention needs no communication.

Which heads a transfer between two TP groups moves where is ``kv_transfer.routes``.
"""

from __future__ import annotations

from dataclasses import dataclass


def check_tp_size(tp_size: object, num_q_heads: int, num_kv_heads: int, *,
                  name: str = "tensor_parallel_size", sizes: list[int] | None = None) -> int:
    """``tp_size`` as an int, or ValueError naming ``name``: it must divide the query heads, and
    divide the KV heads or be a multiple of them (replicated KV heads). ``sizes``: the sizes the
    message suggests (default :func:`divisors`; a caller that knows more limits, e.g. the MLP
    width, passes fewer)."""
    if sizes is None:
        sizes = divisors(num_q_heads, num_kv_heads)
    if isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size < 1:
        raise ValueError(f"{name}: expected an int >= 1, got {tp_size!r}")
    if num_q_heads % tp_size:
        raise ValueError(f"{name}: {tp_size} ranks must divide the model's {num_q_heads} query heads; "
                         f"use one of {sizes}")
    if num_kv_heads % tp_size and tp_size % num_kv_heads:
        raise ValueError(f"{name}: {tp_size} ranks must divide the model's {num_kv_heads} KV heads or be a "
                         f"multiple of them (KV heads replicated); use one of {sizes}")
    return tp_size


def divisors(num_q_heads: int, num_kv_heads: int) -> list[int]:
    """The TP sizes a model with these head counts supports."""
    return [n for n in range(1, num_q_heads + 1)
            if num_q_heads % n == 0 and (num_kv_heads % n == 0 or n % num_kv_heads == 0)]


@dataclass(frozen=True)
class HeadLayout:
    """The heads of a model over ``tp_size`` ranks (validated: see :func:`check_tp_size`)."""

    num_q_heads: int
    num_kv_heads: int
    tp_size: int = 1

    def __post_init__(self) -> None:
        for name in ("num_q_heads", "num_kv_heads"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name}: expected an int >= 1, got {v!r}")
        if self.num_q_heads % self.num_kv_heads:
            raise ValueError(f"num_kv_heads: expected a divisor of num_q_heads ({self.num_q_heads}), "
                             f"got {self.num_kv_heads}")
        check_tp_size(self.tp_size, self.num_q_heads, self.num_kv_heads)

    @property
    def kv_replicas(self) -> int:
        """Ranks holding each KV head (1 unless ``tp_size > num_kv_heads``)."""
        return max(1, self.tp_size // self.num_kv_heads)

    @property
    def local_q_heads(self) -> int:
        return self.num_q_heads // self.tp_size

    @property
    def local_kv_heads(self) -> int:
        return max(1, self.num_kv_heads // self.tp_size)

    def _check_rank(self, rank: object) -> int:
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.tp_size:
            raise ValueError(f"rank: expected an int in [0, {self.tp_size}), got {rank!r}")
        return rank

    def q_heads(self, rank: int) -> range:
        """Global query heads of ``rank``."""
        n = self.local_q_heads
        return range(self._check_rank(rank) * n, (rank + 1) * n)

    def kv_heads(self, rank: int) -> range:
        """Global KV heads of ``rank`` (one, shared with other ranks, when replicated)."""
        self._check_rank(rank)
        if self.kv_replicas > 1:
            h = rank // self.kv_replicas
            return range(h, h + 1)
        n = self.local_kv_heads
        return range(rank * n, (rank + 1) * n)

    def holders(self, kv_head: int) -> list[int]:
        """Ranks whose pools hold ``kv_head``."""
        if isinstance(kv_head, bool) or not isinstance(kv_head, int) or not 0 <= kv_head < self.num_kv_heads:
            raise ValueError(f"kv_head: expected an int in [0, {self.num_kv_heads}), got {kv_head!r}")
        return [r for r in range(self.tp_size) if kv_head in self.kv_heads(r)]
