"""Which implementation runs: the ``backend`` option of every entry point.

``reference`` (PyTorch, any device), ``triton`` (CUDA, or CPU tensors under
``TRITON_INTERPRET=1``), ``cutlass`` (the CUTLASS attention stage on CUDA; its index stage is
Triton's) and ``auto``. Imports nothing of the operator's own, so that every module that
dispatches (``ops``, ``fp8``, ``decode``, ``elementwise``) can import it without a cycle.
"""

from __future__ import annotations

import os
from typing import Literal

import torch

Backend = Literal["auto", "reference", "triton", "cutlass"]
BACKENDS = ("auto", "reference", "triton", "cutlass")


def triton_available(device: torch.device) -> bool:
    """Triton runs on CUDA devices, or on CPU tensors under ``TRITON_INTERPRET=1``."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    if device.type == "cuda":
        return True
    return os.environ.get("TRITON_INTERPRET") == "1"


def cutlass_available(device: torch.device) -> bool:
    """The CUTLASS attention library is prebuilt (``FLASHPREFILL_CUTLASS_LIB``) or buildable
    (nvcc and the CUTLASS headers), and the tensors are on a CUDA device."""
    if device.type != "cuda":
        return False
    from . import cutlass_build

    return cutlass_build.unavailable_reason() is None


def resolve_backend(backend: str, device: torch.device) -> str:
    """``auto`` -> triton on CUDA, else reference (the attention stage then prefers cutlass:
    ``ops.attention_planned``); ``cutlass`` runs the index stage with Triton."""
    if backend not in BACKENDS:
        raise ValueError(f"backend: expected one of {BACKENDS}, got {backend!r}")
    if backend == "cutlass":
        if not cutlass_available(device):
            from .cutlass_build import unavailable_reason

            why = f"a CUDA tensor, got tensors on {device}" if device.type != "cuda" else (
                f"its library: {unavailable_reason()}")
            raise ValueError(f"backend: 'cutlass' needs {why}")
        return backend
    if backend == "auto":
        return "triton" if device.type == "cuda" and triton_available(device) else "reference"
    if backend == "triton" and not triton_available(device):
        raise ValueError(
            f"backend: 'triton' needs a CUDA tensor or TRITON_INTERPRET=1, got tensors on {device}"
        )
    return backend


__all__ = ["Backend", "BACKENDS", "triton_available", "cutlass_available", "resolve_backend"]
