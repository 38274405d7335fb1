"""Named profiler ranges around the steps of a forward (``benchmarks/profile_prefill.py`` reads them).

``op_range(name)`` is ``torch.profiler.record_function("op::" + name)`` while a torch profiler is
recording and a shared no-op context otherwise: one C call (~0.3 us on the dev CPU) per step when
nobody profiles, so the ranges stay in the serving path. A GPU kernel belongs to the innermost range
whose host code launched it; the profile harness subtracts nested ranges, so an ``act_quant``
inside a ``qkv_gemm`` is counted once, as activation quantization.

``OPS`` lists the names in use (a test checks that every call site names one of them).
"""

from __future__ import annotations

import contextlib

import torch

PREFIX = "op::"
OPS = (
    "embed", "norm", "act_quant", "qkv_gemm", "rope", "kv_write", "rope_kv", "q_quant", "index", "attention",
    "correction", "o_gemm", "gate_up_gemm", "silu_mul", "down_gemm", "lm_head", "sampling",
)
_NULL = contextlib.nullcontext()


def op_range(name: str):
    """A profiler range ``op::<name>`` while profiling, else a no-op context."""
    if torch._C._autograd._profiler_enabled():
        return torch.profiler.record_function(PREFIX + name)
    return _NULL


__all__ = ["OPS", "PREFIX", "op_range"]
