"""RoPE of q and k fused with the paged K/V write: what a prefill or decode layer does between the
QKV projections and the attention, in one pass.

``rope_kv_write(q, k, v, cos, sin, slots, k_pages, v_pages)`` computes exactly
``kernels.elementwise.rotary`` of ``q`` and of ``k`` (tokens-major ``[T, H, d]``, the rotate-half
form, each product and the sum rounded to q's dtype) and then the pool's write of the rotated
``k`` and of ``v`` at flat ``slots`` (``page * page_size + offset``): into ``k_pages, v_pages``
``[P, page_size, Hkv, d]`` (V's may be a token-major view, as FP8 pools keep it) in the pages'
dtype, or, for ``float8_e4m3fn`` pages, ``x / descale`` saturated and rounded as
``kernels.fp8.quantize`` with the per-KV-head ``k_descale, v_descale [Hkv]``. It returns the
rotated q (a new contiguous ``[T, Hq, d]``) and, with ``q_amax=True``, ``max |q_rot|`` as a
float32 ``[1]`` device tensor (the FP8 attention's per-tensor q descale, as
``kernels.fp8_gemm.rotary_amax``). The unfused sequence writes the rotated k once and reads it
back for the pool write; here it is written once, into its page.

Supported: fp16/bf16/fp32 q, k, v of one dtype; pages of that dtype or e4m3; head_dim twice a
power of two; any page size. Not supported: a pool dtype other than q's or e4m3 (cast first),
autograd. ``slots`` are not range-checked (no host sync; the pool built them). ``backend``:
``"auto"`` (Triton on CUDA, the reference elsewhere), ``"triton"``, ``"reference"``.
"""

from __future__ import annotations

import torch

from ._checks import FLOAT_DTYPES, check_tensor
from .elementwise import _resolve, rotary_reference, rotary_supports
from .fp8 import FP8_DTYPE, quantize


def write_pages_reference(k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor, k_pages: torch.Tensor,
                          v_pages: torch.Tensor, k_descale: torch.Tensor | None,
                          v_descale: torch.Tensor | None) -> None:
    """``k, v [T, Hkv, d]`` into the pages at ``slots`` (quantized for e4m3 pages): the pool's write."""
    index = slots.long()
    page, off = index // k_pages.shape[1], index % k_pages.shape[1]
    for pages, x, descale in ((k_pages, k, k_descale), (v_pages, v, v_descale)):
        if descale is None:
            pages[page, off] = x.to(pages.dtype)
        else:  # e4m3 has no index_put on every device: through bytes
            pages.view(torch.uint8)[page, off] = quantize(x, descale.view(1, -1, 1)).view(torch.uint8)


def rope_kv_write_reference(q, k, v, cos, sin, slots, k_pages, v_pages, k_descale=None, v_descale=None,
                            q_amax: bool = False):
    """RoPE, then the write: the unfused sequence the kernel replaces."""
    q_rot, k_rot = rotary_reference(q, cos, sin), rotary_reference(k, cos, sin)
    write_pages_reference(k_rot, v, slots, k_pages, v_pages, k_descale, v_descale)
    if not q_amax:
        return q_rot
    amax = q_rot.abs().amax().float().reshape(1) if q_rot.numel() else torch.zeros(1, device=q.device)
    return q_rot, amax


def rope_kv_write(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  slots: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, *,
                  k_descale: torch.Tensor | None = None, v_descale: torch.Tensor | None = None,
                  q_amax: bool = False, backend: str = "auto"):
    """See the module doc. Returns ``q_rot``, or ``(q_rot, amax)`` with ``q_amax=True``."""
    q = check_tensor("q", q, ndim=3, dtypes=FLOAT_DTYPES)
    t, _, d = q.shape
    k = check_tensor("k", k, ndim=3, dtypes=(q.dtype,), device=q.device)
    hkv = k.shape[1]
    v = check_tensor("v", v, ndim=3, dtypes=(q.dtype,), device=q.device)
    for name, x in (("k", k), ("v", v)):
        if x.shape[0] != t or x.shape[2] != d:
            raise ValueError(f"{name}: expected shape [{t}, Hkv, {d}] (q's tokens and head_dim), got {tuple(x.shape)}")
    if tuple(v.shape) != tuple(k.shape):
        raise ValueError(f"v: expected k's shape {tuple(k.shape)}, got {tuple(v.shape)}")
    for name, c in (("cos", cos), ("sin", sin)):
        c = check_tensor(name, c, ndim=2, dtypes=(q.dtype,), device=q.device)
        if tuple(c.shape) != (t, d):
            raise ValueError(f"{name}: expected shape [{t}, {d}] (q's tokens and head_dim), got {tuple(c.shape)}")
    if not rotary_supports(d):
        raise ValueError(f"q: expected a head_dim of twice a power of two (64, 128, 256, ...), got {d}")
    slots = check_tensor("slots", slots, ndim=1, dtypes=(torch.int32, torch.int64), device=q.device)
    if slots.shape[0] != t:
        raise ValueError(f"slots: expected {t} slots (one per token of q), got {slots.shape[0]}")
    k_pages = check_tensor("k_pages", k_pages, ndim=4, dtypes=(q.dtype, FP8_DTYPE), device=q.device)
    if tuple(k_pages.shape[2:]) != (hkv, d):
        raise ValueError(f"k_pages: expected shape [P, page_size, {hkv}, {d}] (k's heads and head_dim), "
                         f"got {tuple(k_pages.shape)}")
    v_pages = check_tensor("v_pages", v_pages, ndim=4, dtypes=(k_pages.dtype,), device=q.device)
    if tuple(v_pages.shape) != tuple(k_pages.shape):
        raise ValueError(f"v_pages: expected k_pages' shape {tuple(k_pages.shape)}, got {tuple(v_pages.shape)}")
    if k_pages.stride(-1) != 1:
        raise ValueError(f"k_pages: expected a unit stride along head_dim, got strides {k_pages.stride()}")
    fp8_pages = k_pages.dtype == FP8_DTYPE
    for name, s in (("k_descale", k_descale), ("v_descale", v_descale)):
        if not fp8_pages:
            if s is not None:
                raise ValueError(f"{name}: descales are only for float8_e4m3fn pages, these are {k_pages.dtype}")
            continue
        if s is None:
            raise ValueError(f"{name}: float8_e4m3fn pages need per-KV-head descales, got None")
        s = check_tensor(name, s, ndim=1, dtypes=(torch.float32,), device=q.device)
        if s.shape[0] != hkv:
            raise ValueError(f"{name}: expected shape [{hkv}] (one per KV head), got {tuple(s.shape)}")
    if not isinstance(q_amax, bool):
        raise ValueError(f"q_amax: expected a bool, got {q_amax!r}")
    if _resolve(backend, q.device) == "reference":
        return rope_kv_write_reference(q, k, v, cos, sin, slots, k_pages, v_pages, k_descale, v_descale, q_amax)
    from . import triton_rope_kv

    def unit(x):
        return x if x.stride(-1) == 1 else x.contiguous()

    q_rot, amax = triton_rope_kv.rope_kv_write(
        unit(q), unit(k), unit(v), unit(cos), unit(sin), slots.contiguous(), k_pages, v_pages,
        None if k_descale is None else k_descale.contiguous(), None if v_descale is None else v_descale.contiguous(),
        q_amax)
    return (q_rot, amax) if q_amax else q_rot


__all__ = ["rope_kv_write", "rope_kv_write_reference", "write_pages_reference"]
