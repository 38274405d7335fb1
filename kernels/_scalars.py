"""Host-side validation of scalar options (ints, the softmax scale): a ValueError naming the
argument. No torch here: the configs that use these checks (``kernels.config``,
``kv_cache.config``) are imported by the ingress, whose process never loads torch."""

from __future__ import annotations

import math


def check_int(name: str, value: object, *, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name}: expected an int >= {minimum}, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name}: expected an int >= {minimum}, got {value}")
    return value


def softmax_scale(scale: object, head_dim: int) -> float:
    """A validated softmax scale; ``None`` means ``1/sqrt(head_dim)``."""
    if scale is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise ValueError(f"scale: expected a positive float or None, got {scale!r}")
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale: expected a positive finite float, got {scale!r}")
    return float(scale)
