"""Operator configuration: one frozen dataclass, validated on construction.

The semantics of every field are those of SPEC.md (shared with the reference and
every kernel): see ``docs/SEMANTICS.md`` for the project's copy and the places
where we refined it.
"""

from __future__ import annotations

from dataclasses import dataclass

from ._checks import check_int as _check_int
from ._checks import softmax_scale as _softmax_scale

# Physical K/V tile (CSR granularity) and PackGQA query tile, fixed by the format.
KV_TILE = 64
Q_TILE = 128


@dataclass(frozen=True)
class SparseConfig:
    """FlashPrefill V2 block-sparse attention options.

    alpha: energy threshold relative to the tile's strongest block, in [0, 1].
        ``alpha=0`` keeps every visible block (dense attention).
    block_size: logical key block ``Bs`` in tokens, a positive multiple of 64.
    sink_tokens: blocks starting before this key position are always kept.
    window_tokens: blocks overlapping the last ``window_tokens`` keys before each
        query tile (and the diagonal) are always kept.
    mean_correction: add the pruned fully-visible blocks' mean term (eq. 6).
    scale: softmax scale; ``None`` means ``1/sqrt(head_dim)``.
    num_splits: split-KV parts per query tile; 0 picks automatically, 1 disables.
    """

    alpha: float = 0.1
    block_size: int = 128
    sink_tokens: int = 256
    window_tokens: int = 512
    mean_correction: bool = True
    scale: float | None = None
    num_splits: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.alpha, bool) or not isinstance(self.alpha, (int, float)):
            raise ValueError(f"alpha: expected a float in [0, 1], got {self.alpha!r}")
        if not (0.0 <= float(self.alpha) <= 1.0):
            raise ValueError(f"alpha: expected a value in [0, 1], got {self.alpha!r}")
        _check_int("block_size", self.block_size, minimum=KV_TILE)
        if self.block_size % KV_TILE:
            raise ValueError(
                f"block_size: expected a positive multiple of {KV_TILE}, got {self.block_size}"
            )
        _check_int("sink_tokens", self.sink_tokens, minimum=0)
        _check_int("window_tokens", self.window_tokens, minimum=0)
        if not isinstance(self.mean_correction, bool):
            raise ValueError(
                f"mean_correction: expected a bool, got {type(self.mean_correction).__name__}"
            )
        _softmax_scale(self.scale, 1)
        _check_int("num_splits", self.num_splits, minimum=0)

    @property
    def tiles_per_block(self) -> int:
        return self.block_size // KV_TILE

    def softmax_scale(self, head_dim: int) -> float:
        return _softmax_scale(self.scale, head_dim)

