"""What a calibration run measures and the budget it must meet (the command line's options,
checked here so that every message names its flag)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from kernels.config import SparseConfig

from .grid import GridPoint
from .text import PYDOC_TOPICS, rope_for

TAIL = 256  # the positions of the "last 256" metrics
LAST = 8  # the positions of the answer KL


@dataclass(frozen=True)
class Budget:
    """What a setting must meet (see the module docstring)."""

    kl: float
    kl_last: float = 0.01
    needle_slack: int = 1
    lastword_slack: int = 1

    def __post_init__(self) -> None:
        for name, flag in (("kl", "--budget-kl"), ("kl_last", "--budget-kl-last")):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise ValueError(f"{flag}: expected a finite number >= 0 (nats), got {v!r}")
        for name, flag in (("needle_slack", "--needle-slack"), ("lastword_slack", "--lastword-slack")):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"{flag}: expected an int >= 0, got {v!r}")


def _positive_int(flag: str, value: object, minimum: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{flag}: expected an int >= {minimum}, got {value!r}")


@dataclass(frozen=True)
class Settings:
    """One calibration run (the command line's options; messages name the flag)."""

    model: str
    lengths: tuple[int, ...]
    budget: Budget
    grid: tuple[GridPoint, ...]
    base: SparseConfig = field(default_factory=SparseConfig)
    model_name: str | None = None  # recorded in the profile (default: model)
    prompts: int = 32
    prompts_beyond_trained: int | None = None  # prompts at lengths beyond the trained context (None: prompts)
    needles: int = 20
    needle_new_tokens: int = 16
    lastword_items: int = 300
    lastword_chars: int = 6000
    sensitivity_length: int | None = None
    sensitivity_prompts: int = 8
    text: str = PYDOC_TOPICS
    rope_scaling: str = "yarn"
    dense_below: int | None = None
    device: str = "cpu"
    dtype: torch.dtype | None = None
    backend: str = "auto"
    batch_tokens: int = 4096
    max_seconds: float | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.lengths:
            raise ValueError("--lengths: expected at least one length")
        for n in self.lengths:
            _positive_int("--lengths", n, TAIL + 1)
        if len(set(self.lengths)) != len(self.lengths):
            raise ValueError(f"--lengths: expected distinct lengths, got {list(self.lengths)}")
        object.__setattr__(self, "lengths", tuple(sorted(self.lengths)))
        if not self.grid:
            raise ValueError("--grid: expected at least one grid point")
        if len({p.name for p in self.grid}) != len(self.grid):
            raise ValueError("--grid: expected distinct grid points")
        _positive_int("--prompts", self.prompts)
        if self.prompts_beyond_trained is not None:
            _positive_int("--prompts-beyond-trained", self.prompts_beyond_trained)
        _positive_int("--needles", self.needles, 0)
        _positive_int("--needle-new-tokens", self.needle_new_tokens)
        _positive_int("--lastword-items", self.lastword_items, 0)
        _positive_int("--lastword-chars", self.lastword_chars, 16)
        _positive_int("--sensitivity-prompts", self.sensitivity_prompts)
        _positive_int("--batch-tokens", self.batch_tokens)
        if self.sensitivity_length is not None and self.sensitivity_length not in self.lengths:
            raise ValueError(f"--sensitivity-length: expected one of --lengths {list(self.lengths)}, "
                             f"got {self.sensitivity_length!r}")
        if self.dense_below is not None:
            _positive_int("--dense-below", self.dense_below, 0)
            if self.dense_below > max(self.lengths):
                raise ValueError(f"--dense-below: {self.dense_below} leaves no calibration length sparse "
                                 f"(longest {max(self.lengths)})")
        if self.max_seconds is not None and not (isinstance(self.max_seconds, (int, float)) and self.max_seconds > 0):
            raise ValueError(f"--max-seconds: expected a number > 0, got {self.max_seconds!r}")
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"--device: expected 'cpu' or 'cuda', got {self.device!r}")
        rope_for(1, 1, self.rope_scaling)  # ValueError naming rope_scaling

    @property
    def scored_lengths(self) -> tuple[int, ...]:
        """The lengths the budget is checked at (served sparse: at or above dense_below)."""
        return tuple(n for n in self.lengths if self.dense_below is None or n >= self.dense_below)


__all__ = ["Budget", "LAST", "Settings", "TAIL"]
