"""The calibration grid: which sparse settings are measured against dense.

A grid point fixes ``alpha``, ``last_dense_tiles``, ``energy_rule``, ``dense_layers`` and a
per-layer alpha *schedule*:

- ``uniform``: every sparse layer at ``alpha`` (``layer_alpha = None``);
- ``sensitivity``: layers ranked by their single-layer sensitivity, the KL against dense (mean
  over the last 256 positions) when only that layer runs sparse, measured once per calibration
  (:func:`sensitivity_schedule`): the most sensitive third at ``alpha / 4``, the least sensitive
  third at ``min(1, 2 alpha)``, the rest at ``alpha``. The first ``dense_layers`` stay dense.

The other options (block size, sink, window, mean correction) come from the calibration's base
config and are the same for every point.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

from kernels.config import ENERGY_RULES, SparseConfig

SCHEDULES = ("uniform", "sensitivity")


@dataclass(frozen=True)
class Axes:
    """The values of each grid axis; the grid is their product."""

    alphas: tuple[float, ...]
    last_dense_tiles: tuple[int, ...]
    energy_rules: tuple[str, ...]
    dense_layers: tuple[int, ...]
    schedules: tuple[str, ...]

    def __post_init__(self) -> None:
        for name in ("alphas", "last_dense_tiles", "energy_rules", "dense_layers", "schedules"):
            values = getattr(self, name)
            if not values:
                raise ValueError(f"{name}: expected at least one value")
            if len(set(values)) != len(values):
                raise ValueError(f"{name}: expected distinct values, got {list(values)}")
        for a in self.alphas:
            if isinstance(a, bool) or not isinstance(a, (int, float)) or not 0.0 < a <= 1.0:
                raise ValueError(f"alphas: expected values in (0, 1], got {a!r}")
        for name in ("last_dense_tiles", "dense_layers"):
            for n in getattr(self, name):
                if isinstance(n, bool) or not isinstance(n, int) or n < 0:
                    raise ValueError(f"{name}: expected ints >= 0, got {n!r}")
        for r in self.energy_rules:
            if r not in ENERGY_RULES:
                raise ValueError(f"energy_rules: expected values among {list(ENERGY_RULES)}, got {r!r}")
        for s in self.schedules:
            if s not in SCHEDULES:
                raise ValueError(f"schedules: expected values among {list(SCHEDULES)}, got {s!r}")

    def points(self) -> list["GridPoint"]:
        return [GridPoint(float(a), n, r, d, s) for a, n, r, d, s in itertools.product(
            self.alphas, self.last_dense_tiles, self.energy_rules, self.dense_layers, self.schedules)]


# ``--grid quick`` is sized for CI on builtin:tiny; ``full`` is every axis of issue 46.
GRIDS = {
    "quick": Axes(alphas=(0.1,), last_dense_tiles=(0, 2), energy_rules=("first_key", "visible"), dense_layers=(0,),
                  schedules=("uniform", "sensitivity")),
    "full": Axes(alphas=(0.05, 0.1, 0.2), last_dense_tiles=(0, 2, 4, 8), energy_rules=("first_key", "visible"),
                 dense_layers=(0, 2, 4), schedules=("uniform", "sensitivity")),
}


@dataclass(frozen=True)
class GridPoint:
    alpha: float
    last_dense_tiles: int
    energy_rule: str
    dense_layers: int
    schedule: str

    @property
    def name(self) -> str:
        return (f"a{self.alpha:g} last{self.last_dense_tiles} {self.energy_rule} dense{self.dense_layers}"
                + (" sens" if self.schedule == "sensitivity" else ""))

    def config(self, base: SparseConfig, sensitivity: Sequence[float] | None = None) -> SparseConfig:
        """The operator config of this point over ``base`` (``sensitivity``: per-layer KL, needed
        by the ``sensitivity`` schedule)."""
        layer_alpha = None
        if self.schedule == "sensitivity":
            if sensitivity is None:
                raise ValueError("sensitivity: the 'sensitivity' schedule needs the per-layer sensitivities")
            layer_alpha = sensitivity_schedule(self.alpha, sensitivity)
        return dataclasses.replace(base, alpha=self.alpha, last_dense_tiles=self.last_dense_tiles,
                                   energy_rule=self.energy_rule, dense_layers=self.dense_layers,
                                   layer_alpha=layer_alpha)


def sensitivity_schedule(alpha: float, sensitivity: Sequence[float]) -> tuple[float, ...]:
    """Per-layer alpha from per-layer sensitivity (module docstring): thirds by rank, ties broken
    by layer order (the earlier layer counts as the more sensitive)."""
    n = len(sensitivity)
    if n == 0:
        raise ValueError("sensitivity: expected one value per layer, got none")
    for i, s in enumerate(sensitivity):
        if not isinstance(s, (int, float)) or not math.isfinite(s) or s < 0:
            raise ValueError(f"sensitivity[{i}]: expected a finite value >= 0, got {s!r}")
    order = sorted(range(n), key=lambda i: (-sensitivity[i], i))
    top, bottom = math.ceil(n / 3), n // 3
    out = [float(alpha)] * n
    for i in order[:top]:
        out[i] = alpha / 4
    for i in order[n - bottom:] if bottom else ():
        out[i] = min(1.0, 2 * alpha)
    return tuple(out)
