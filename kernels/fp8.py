"""FP8 (e4m3) inputs of the operator: descale factors, quantization helpers, dequantization.

The FP8 path of SPEC.md: ``q``, ``k_pages``, ``v_pages`` are ``torch.float8_e4m3fn`` holding
``x / c`` (``c`` the *descale* factor, ``x ~= stored * c``). Descales are float32 tensors of
one of these shapes (the granularity):

- ``()`` or ``[1]``: per tensor;
- ``[Hkv]``: per KV head (a paged pool's per-layer scales: they cannot depend on the sequence,
  pages outlive requests);
- ``[B, Hkv]``: per (sequence, KV head), FlashAttention-3's ``descale_q/k/v`` layout. For
  ``q`` the KV head ``h`` covers the query heads ``h*g .. h*g+g-1`` of its group.

Inside the kernels (paper eq. 15): ``S = c_q c_k (q~ k~^T)``, ``P~ = round_e4m3(256 exp(S - m))``,
``O = c_v (sum P~ V~) / (256 sum exp(S - m))``. The 256 offset puts the probabilities in
e4m3's normal range; it cancels in the ratio and ``lse`` never sees it. Block means are
computed in fp32 from descaled values; their scoring and correction operands are re-quantized
with the same (sequence, KV head) descale (``round_e4m3(kbar / c_k)``). Output is bfloat16.

The PyTorch reference runs the exact math on the dequantized inputs (``dequantize_*``):
tests measure the FP8 kernels' error against it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max  # 448.0, the largest finite e4m3fn
P_OFFSET = 256.0  # probabilities are quantized as round_e4m3(P_OFFSET * exp(s - m))
OUT_DTYPE = torch.bfloat16  # what the FP8 operator returns
_TINY = torch.finfo(torch.float32).tiny


def is_fp8(t: object) -> bool:
    return isinstance(t, torch.Tensor) and t.dtype == FP8_DTYPE


@dataclass(frozen=True)
class Fp8Descales:
    """Validated descales of one batch, each a ``[B, Hkv]`` float32 view (stride 0 along a
    broadcast dimension, so per-tensor and per-head factors cost no copy)."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor

    def strides(self) -> tuple[int, int, int, int, int, int]:
        """``(q_b, q_h, k_b, k_h, v_b, v_h)`` element strides for kernels."""
        return (*self.q.stride(), *self.k.stride(), *self.v.stride())


def descale_view(name: str, t: object, batch: int, num_kv_heads: int, device: torch.device) -> torch.Tensor:
    """One descale argument as a ``[batch, num_kv_heads]`` float32 view (no copy, no sync);
    ``ValueError`` naming ``name`` for None, a non-tensor, another dtype, device or shape."""
    if t is None:
        raise ValueError(f"{name}: FP8 inputs need descale factors, got None")
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name}: expected a float32 torch.Tensor of descale factors, got {type(t).__name__}")
    if t.dtype != torch.float32:
        raise ValueError(f"{name}: expected dtype float32, got {str(t.dtype).replace('torch.', '')}")
    if t.device != device:
        raise ValueError(f"{name}: expected a tensor on {device}, got one on {t.device}")
    shape = tuple(t.shape)
    if shape in ((), (1,)):
        return t.reshape(1, 1).expand(batch, num_kv_heads)
    if shape == (num_kv_heads,):
        return t.reshape(1, num_kv_heads).expand(batch, num_kv_heads)
    if shape == (batch, num_kv_heads):
        return t
    raise ValueError(
        f"{name}: expected shape () or [1] (per tensor), [{num_kv_heads}] (per KV head) or "
        f"[{batch}, {num_kv_heads}] (per sequence and KV head), got {list(shape)}"
    )


def check_descales(
    q_descale: object,
    k_descale: object,
    v_descale: object,
    *,
    batch: int,
    num_kv_heads: int,
    device: torch.device,
    check_values: bool = True,
) -> Fp8Descales:
    """Validate the three descales (type, dtype, device, shape and, with ``check_values``,
    positive and finite: one device->host read). Raises ``ValueError`` naming the argument."""
    named = [(name, descale_view(name, t, batch, num_kv_heads, device))
             for name, t in (("q_descale", q_descale), ("k_descale", k_descale), ("v_descale", v_descale))]
    if check_values:
        check_descale_values(named)
    return Fp8Descales(q=named[0][1], k=named[1][1], v=named[2][1])


def check_descale_values(named: list[tuple[str, torch.Tensor]]) -> None:
    """``ValueError`` naming the first descale with a zero, negative or non-finite factor (one
    device->host read for all of them)."""
    named = [(name, x) for name, x in named if x.numel()]
    if not named:
        return
    bad = torch.stack([~(torch.isfinite(x) & (x > 0)).all() for _, x in named]).tolist()
    for (name, x), is_bad in zip(named, bad):
        if is_bad:
            vals = x.flatten().tolist()
            shown = vals[:8] + (["..."] if len(vals) > 8 else [])
            raise ValueError(f"{name}: expected positive finite descale factors, got {shown}")


def reject_descales(q_descale: object, k_descale: object, v_descale: object, dtype: torch.dtype) -> None:
    for name, t in (("q_descale", q_descale), ("k_descale", k_descale), ("v_descale", v_descale)):
        if t is not None:
            raise ValueError(
                f"{name}: descale factors are only for float8_e4m3fn inputs, q is "
                f"{str(dtype).replace('torch.', '')}"
            )


# ---------------------------------------------------------------------------------------
# quantization helpers (amax based)
# ---------------------------------------------------------------------------------------
def descale_from_amax(amax: torch.Tensor, *, margin: float = 1.0) -> torch.Tensor:
    """Descale ``amax * margin / 448`` (float32, never zero: an all-zero slice gets the
    smallest normal float, so dividing by it stays finite)."""
    if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not (math.isfinite(margin) and margin > 0):
        raise ValueError(f"margin: expected a positive finite float, got {margin!r}")
    return torch.clamp(amax.float() * float(margin) / FP8_MAX, min=_TINY)


def pow2_descale(x: torch.Tensor, margin: float = 2.0) -> torch.Tensor:
    """Per-head descale ``[H]`` of ``x [T, H, d]``: ``amax * margin / 448`` rounded *up* to a
    power of two, so replicas that calibrate on the same data agree bit for bit even when their
    amax differs in the last ulp, and dequantization is an exact exponent shift."""
    amax = x.detach().float().abs().amax(dim=(0, 2)) if x.shape[0] else x.new_zeros(x.shape[1]).float()
    raw = descale_from_amax(amax, margin=margin)
    return torch.exp2(torch.ceil(torch.log2(raw)))


def quantize(x: torch.Tensor, descale: torch.Tensor) -> torch.Tensor:
    """``x / descale`` saturated to +-448 and rounded (nearest even) to e4m3. ``descale``
    broadcasts against ``x``."""
    return (x.float() / descale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def quantize_per_tensor(
    x: torch.Tensor, *, margin: float = 1.0, backend: str = "reference"
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x8, descale [1])``; no host synchronisation. ``backend``: ``"reference"`` (eager
    PyTorch), ``"triton"`` (one max-abs reduction, then one fused pass: ``kernels/triton_fp8.py``,
    the same bits), ``"auto"`` (Triton on CUDA)."""
    if not isinstance(x, torch.Tensor) or not x.is_floating_point() or is_fp8(x):
        raise ValueError(f"x: expected a floating-point (non-FP8) tensor, got {_describe(x)}")
    from .backend import resolve_backend

    fused = resolve_backend(backend, x.device) in ("triton", "cutlass")
    if not x.numel():
        amax = torch.zeros((), device=x.device)
    elif fused:  # max |x| in one pass, no |x| temporary (the same value: it is one of x's)
        amax = torch.linalg.vector_norm(x.detach(), ord=math.inf)
    else:
        amax = x.detach().abs().amax()
    descale = descale_from_amax(amax.reshape(1), margin=margin)
    if fused:
        from . import triton_fp8

        return triton_fp8.quantize_per_tensor(x.contiguous(), descale), descale
    return quantize(x, descale), descale


def quantize_bshd(
    x: torch.Tensor, *, per: str = "head", margin: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Contiguous K or V ``[B, L, H, d]`` -> ``(x8, descale)``; ``per="head"``: descale
    ``[B, H]`` (per sequence and head), ``per="tensor"``: ``[1]``."""
    if not isinstance(x, torch.Tensor) or x.dim() != 4 or not x.is_floating_point() or is_fp8(x):
        raise ValueError(f"x: expected a floating-point [B, L, H, d] tensor, got {_describe(x)}")
    if per == "tensor":
        return quantize_per_tensor(x, margin=margin)
    if per != "head":
        raise ValueError(f"per: expected 'head' or 'tensor', got {per!r}")
    amax = x.detach().abs().amax(dim=(1, 3)) if x.shape[1] else x.new_zeros(x.shape[0], x.shape[2])
    descale = descale_from_amax(amax, margin=margin)
    return quantize(x, descale[:, None, :, None]), descale


def quantize_per_head_pages(pages: torch.Tensor, *, margin: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Paged K or V ``[num_pages, page_size, Hkv, d]`` -> ``(pages8, descale [Hkv])``, one
    factor per KV head over every page (a pool's granularity). Non-finite slots (poisoned
    padding) are ignored for the amax and stay non-finite."""
    if not isinstance(pages, torch.Tensor) or pages.dim() != 4 or not pages.is_floating_point() or is_fp8(pages):
        raise ValueError(f"pages: expected a floating-point [num_pages, page_size, Hkv, d] tensor, got {_describe(pages)}")
    x = pages.detach().float().abs()
    amax = torch.where(torch.isfinite(x), x, torch.zeros((), device=x.device)).amax(dim=(0, 1, 3))
    descale = descale_from_amax(amax, margin=margin)
    return quantize(pages, descale[None, None, :, None]), descale


def quantize_queries(
    q: torch.Tensor, cu_seqlens_q: torch.Tensor, num_kv_heads: int, *, margin: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Varlen queries ``q [Tq, Hq, d]`` -> ``(q8, descale [B, Hkv])``: one factor per
    sequence and KV-head group (the ``g`` query heads sharing KV head ``h``)."""
    if not isinstance(q, torch.Tensor) or q.dim() != 3 or not q.is_floating_point() or is_fp8(q):
        raise ValueError(f"q: expected a floating-point [Tq, Hq, d] tensor, got {_describe(q)}")
    if isinstance(num_kv_heads, bool) or not isinstance(num_kv_heads, int) or num_kv_heads < 1 or q.shape[1] % num_kv_heads:
        raise ValueError(f"num_kv_heads: expected a positive divisor of Hq={q.shape[1]}, got {num_kv_heads!r}")
    cu = cu_seqlens_q.long().cpu()
    lengths = (cu[1:] - cu[:-1]).to(q.device)
    seq_of_token = torch.repeat_interleave(torch.arange(len(lengths), device=q.device), lengths)
    g = q.shape[1] // num_kv_heads
    tok_amax = q.detach().abs().reshape(q.shape[0], num_kv_heads, g * q.shape[2]).amax(-1).float()
    amax = torch.zeros(len(lengths), num_kv_heads, dtype=torch.float32, device=q.device)
    amax.scatter_reduce_(0, seq_of_token[:, None].expand(-1, num_kv_heads), tok_amax, "amax")
    descale = descale_from_amax(amax, margin=margin)
    per_token = descale[seq_of_token].repeat_interleave(g, dim=1)[:, :, None]
    return quantize(q, per_token), descale


# ---------------------------------------------------------------------------------------
# dequantization (the reference's view of FP8 inputs)
# ---------------------------------------------------------------------------------------
def dequantize_queries(q8: torch.Tensor, descale: torch.Tensor, cu_seqlens_host, num_kv_heads: int) -> torch.Tensor:
    """``q8 [Tq, Hq, d]`` and a ``[B, Hkv]`` descale view -> float32."""
    g = q8.shape[1] // num_kv_heads
    out = q8.float()
    for b in range(len(cu_seqlens_host) - 1):
        lo, hi = cu_seqlens_host[b], cu_seqlens_host[b + 1]
        if hi > lo:
            out[lo:hi] *= descale[b].repeat_interleave(g)[None, :, None]
    return out


def dequantize_sequence(x8: torch.Tensor, descale_row: torch.Tensor) -> torch.Tensor:
    """One sequence's gathered ``[L, Hkv, d]`` keys or values and its ``[Hkv]`` descales."""
    return x8.float() * descale_row[None, :, None]


def block_descales(descale: torch.Tensor, cu_blocks: torch.Tensor, total_blocks: int,
                   *, block_seq: torch.Tensor | None = None) -> torch.Tensor:
    """``[total_blocks, Hkv]``: the ``[B, Hkv]`` descale of each block row's sequence
    (``cu_blocks`` the plan's device offsets; no host synchronisation). ``block_seq``: that
    sequence per block when the caller has it (``PrefillPlan.block_seq``, built once per plan),
    else derived from ``cu_blocks`` here."""
    if block_seq is None:
        blocks = torch.arange(total_blocks, dtype=cu_blocks.dtype, device=cu_blocks.device)
        block_seq = torch.searchsorted(cu_blocks[1:].contiguous(), blocks, right=True)
    return descale[block_seq]


def requantize_means(
    means: torch.Tensor, descale: torch.Tensor, cu_blocks: torch.Tensor, *, block_seq: torch.Tensor | None = None
) -> torch.Tensor:
    """fp32 block means ``[total_blocks, Hkv, d]`` -> e4m3 ``round(mean / c[b, h])`` with the
    descale of each block's sequence: the operands the FP8 kernels score and correct with.
    ``block_seq`` as in :func:`block_descales`."""
    return quantize(means, block_descales(descale, cu_blocks, means.shape[0], block_seq=block_seq)[:, :, None])


def _describe(x: object) -> str:
    if isinstance(x, torch.Tensor):
        return f"a {str(x.dtype).replace('torch.', '')} tensor of shape {tuple(x.shape)}"
    return type(x).__name__


__all__ = [
    "FP8_DTYPE", "FP8_MAX", "P_OFFSET", "OUT_DTYPE", "Fp8Descales", "is_fp8", "check_descales",
    "descale_view", "check_descale_values",
    "reject_descales", "descale_from_amax", "quantize", "quantize_per_tensor", "quantize_bshd",
    "quantize_queries", "quantize_per_head_pages", "dequantize_queries", "dequantize_sequence", "requantize_means",
    "block_descales",
]
