"""Fused RMSNorm, SiLU-and-multiply and rotary embedding: the memory-bound steps of a
Llama-style layer outside attention and the linear layers.

At long context these steps are a large share of a prefill forward that sparse attention has
already made cheap: at 128K tokens each eager RMSNorm of transformers moves ~18 GB (an fp32 copy
of the ``[T, 4096]`` hidden states, its square, the scaling, the casts) and each eager
``act_fn(gate) * up`` ~19 GB; the fused kernels move 2 GB and 11 GB (one read of each input, one
write). Same contract as the eager modules, step for step and dtype for dtype:

- ``rms_norm(x, weight, eps)`` = ``weight * (x.float() * rsqrt(mean(x.float()**2, -1) + eps)).to(x.dtype)``
  (transformers' ``LlamaRMSNorm``: the normalized row is rounded to ``x``'s dtype before the weight
  multiply; the result's dtype follows torch's promotion of ``weight`` and ``x``);
- ``silu_mul(gate, up)`` = ``silu(gate) * up`` (silu rounded to the input dtype first, as eager);
- ``rotary(x, cos, sin)`` = ``x * cos + rotate_half(x) * sin`` on tokens-major ``[T, H, d]`` (each
  product and the sum rounded to ``x``'s dtype, as eager; bit for bit), written contiguous, so
  the paged attention needs no transposed copy of q and k.

Results match the reference to rounding (the sum of squares is reduced in another order).
``backend``: ``"auto"`` (Triton on CUDA, the PyTorch reference elsewhere), ``"triton"`` (CUDA, or
CPU under ``TRITON_INTERPRET=1``), ``"reference"``. No autograd: inference only.
"""

from __future__ import annotations

import torch

from ._checks import FLOAT_DTYPES, check_tensor
from .backend import resolve_backend

_BACKENDS = ("auto", "triton", "reference")


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def silu_mul_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.silu(gate) * up


def rotary_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """transformers' ``apply_rotary_pos_emb`` on tokens-major ``x [T, H, d]`` with ``cos``/``sin [T, d]``."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def max_ulps(a: torch.Tensor, b: torch.Tensor) -> float:
    """The largest difference of ``a`` and ``b`` in units of the last place of ``a``'s dtype at the
    larger of the two magnitudes: the measure of the "within 2 ulps" above."""
    if not a.numel():
        return 0.0
    eps = torch.finfo(a.dtype).eps
    scale = torch.maximum(a.float().abs(), b.float().abs()).clamp_min(torch.finfo(a.dtype).tiny)
    return ((a.float() - b.float()).abs() / (scale * eps)).max().item()


def _resolve(backend: object, device: torch.device) -> str:
    """``ops.resolve_backend`` without ``cutlass`` (these steps have no CUTLASS kernel)."""
    if backend not in _BACKENDS:
        raise ValueError(f"backend: expected one of {_BACKENDS}, got {backend!r}")
    return resolve_backend(backend, device)


def rotary_supports(head_dim: object) -> bool:
    """The rotary kernel's head dims: twice a power of two (64, 128, 256, ...)."""
    return isinstance(head_dim, int) and head_dim >= 2 and head_dim % 2 == 0 and (head_dim // 2) & (head_dim // 2 - 1) == 0


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, *, backend: str = "auto") -> torch.Tensor:
    """RMSNorm over the last dimension of ``x [..., n]`` with ``weight [n]`` (see the module doc)."""
    x = check_tensor("x", x, dtypes=FLOAT_DTYPES)
    weight = check_tensor("weight", weight, ndim=1, dtypes=FLOAT_DTYPES, device=x.device)
    if x.dim() == 0 or weight.shape[0] != x.shape[-1]:
        raise ValueError(f"weight: expected shape [{x.shape[-1] if x.dim() else '?'}] (x's last dimension), "
                         f"got {tuple(weight.shape)} for x of shape {tuple(x.shape)}")
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps >= 0:
        raise ValueError(f"eps: expected a float >= 0, got {eps!r}")
    if _resolve(backend, x.device) == "reference":
        return rms_norm_reference(x, weight, eps)
    from . import triton_elementwise

    n = x.shape[-1]
    x2d = x.reshape(-1, n)
    if n and x2d.stride(-1) != 1:
        x2d = x2d.contiguous()
    out = triton_elementwise.rms_norm(x2d, weight.contiguous(), float(eps), torch.promote_types(weight.dtype, x.dtype))
    return out.view(x.shape)


def silu_mul(gate: torch.Tensor, up: torch.Tensor, *, backend: str = "auto") -> torch.Tensor:
    """``silu(gate) * up`` for ``gate`` and ``up`` of one shape and dtype (see the module doc)."""
    gate = check_tensor("gate", gate, dtypes=FLOAT_DTYPES)
    up = check_tensor("up", up, dtypes=(gate.dtype,), device=gate.device)
    if up.shape != gate.shape:
        raise ValueError(f"up: expected gate's shape {tuple(gate.shape)}, got {tuple(up.shape)}")
    if _resolve(backend, gate.device) == "reference":
        return silu_mul_reference(gate, up)
    from . import triton_elementwise

    return triton_elementwise.silu_mul(gate.contiguous(), up.contiguous())


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, backend: str = "auto") -> torch.Tensor:
    """Rotary position embedding (the rotate-half form of Llama and transformers) of tokens-major
    ``x [T, H, d]`` with ``cos``/``sin [T, d]`` in ``x``'s dtype: ``x * cos + rotate_half(x) * sin``,
    each product and the sum rounded to ``x``'s dtype as eager does; returns a new contiguous
    ``[T, H, d]`` (no transposed copy for the attention that follows)."""
    x = check_tensor("x", x, ndim=3, dtypes=FLOAT_DTYPES)
    cos = check_tensor("cos", cos, ndim=2, dtypes=(x.dtype,), device=x.device)
    sin = check_tensor("sin", sin, ndim=2, dtypes=(x.dtype,), device=x.device)
    t, _, d = x.shape
    for name, c in (("cos", cos), ("sin", sin)):
        if tuple(c.shape) != (t, d):
            raise ValueError(f"{name}: expected shape [{t}, {d}] (x's tokens and head_dim), got {tuple(c.shape)}")
    if not rotary_supports(d):
        raise ValueError(f"x: expected a head_dim of twice a power of two (64, 128, 256, ...), got {d}")
    if _resolve(backend, x.device) == "reference":
        return rotary_reference(x, cos, sin)
    from . import triton_elementwise

    x = x if x.stride(-1) == 1 else x.contiguous()
    return triton_elementwise.rotary(x, cos if cos.stride(-1) == 1 else cos.contiguous(),
                                     sin if sin.stride(-1) == 1 else sin.contiguous())
