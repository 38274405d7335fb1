"""FP8 (e4m3) linear layers: weight and activation quantization, the scaled GEMM, and the fused
steps around it (RMSNorm + activation quantization, RoPE + amax of q), each with its PyTorch
reference beside the dispatch.

Weights ``w [N, K]`` (out, in) are stored as ``w8`` (``float8_e4m3fn``) with a float32 *descale*
(``w ~= w8 * scale``, the convention of ``kernels.fp8``) in one of three layouts, the ``scheme``:

- ``"tensor"``:  scale ``[]`` (one factor);
- ``"channel"``: scale ``[N]`` (one per output channel);
- ``"block"``:   scale ``[ceil(N / 128), K / 128]`` (one per 128 x 128 tile; DeepSeek-V3's layout;
  ``K`` must be a multiple of 128, ``N`` need not be: the last row of tiles is partial).

Activations ``x [M, K]`` are quantized dynamically (amax of this call, on the device, no host
sync) to match: per token (scale ``[M, 1]``) for the tensor and channel schemes, per token and
128-wide group (scale ``[M, K / 128]``) for the block scheme (:func:`activation_group`). Every
quantization is ``kernels.fp8``'s: descale ``max(amax / 448, tiny)``, ``x / descale`` rounded
(nearest even) and saturated to +-448.

The GEMM (:func:`fp8_mm`) returns ``x @ w.T`` (+ bias) in ``out_dtype``:

- ``reference`` (any device; the CPU's emulation): dequantize both operands to float32, matmul,
  add the bias, round once to ``out_dtype``;
- ``triton`` (``kernels/triton_fp8_gemm.py``): a tiled e4m3 ``tl.dot`` with float32 accumulation,
  scaled per 128-wide K step for the block scheme, once at the end for the others;
- ``auto``: on CUDA ``torch._scaled_mm`` with row-wise scales (per-token ``[M, 1]`` times
  per-channel ``[1, N]``; a per-tensor weight scale is broadcast to a row) for the tensor and
  channel schemes when its shape rules hold (bf16 output, ``K`` and ``N`` multiples of 16); for
  the block scheme ``torch._scaled_mm``'s blockwise mode (cuBLASLt's 1x128 activation by 128x128
  weight scaling, CUDA 12.9+; torch's ``_meta_registrations.py`` states the layout: ``scale_a
  [M, K/128]`` outer-dim-major, strides ``(1, M)``; ``scale_b [K/128, N/128]`` for ``B = w8.T``,
  i.e. our ``[N/128, K/128]`` tile scale transposed) where :func:`blockwise_scaled_mm_works`
  found it at load on this device (a run at a small shape against the reference: some torch
  builds and GPUs refuse the mode) and the shape rules hold (:func:`blockwise_supports`), else
  the Triton kernel; the reference elsewhere.

The fused steps: :func:`rms_norm_quant` (transformers' RMSNorm, the result also quantized in the
same pass: what the q/k/v and gate/up projections read), :func:`silu_mul_quant` (the MLP's
``silu(gate) * up`` quantized without storing the product: what the down projection reads) and
:func:`rotary_amax` (RoPE of q with
the max ``|q|`` reduced in the same pass: the FP8 attention's per-tensor q descale without a
separate amax pass). Inputs are validated here (``ValueError`` naming the argument); the Triton
module trusts its callers.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from .fp8 import FP8_DTYPE, FP8_MAX, descale_from_amax, quantize

SCHEMES = ("tensor", "channel", "block")
BLOCK = 128  # the block scheme's tile edge, and the activation group width that matches it
_BACKENDS = ("auto", "triton", "reference")
_FLOAT = (torch.float16, torch.bfloat16, torch.float32)


@dataclass(frozen=True)
class Fp8Activation:
    """A quantized activation ``x8 [M, K]`` (e4m3) with its float32 descale ``scale [M, G]``:
    ``G = 1`` per token (``group=None``) or ``K / 128`` per 128-wide group (``group=128``)."""

    x8: torch.Tensor
    scale: torch.Tensor
    group: int | None


# ---------------------------------------------------------------------------------------------
# validation and layouts
# ---------------------------------------------------------------------------------------------


def check_scheme(scheme: object) -> str:
    if scheme not in SCHEMES:
        raise ValueError(f"scheme: expected one of {SCHEMES}, got {scheme!r}")
    return scheme


def activation_group(scheme: str) -> int | None:
    """The activation granularity that matches ``scheme``'s weights: ``128`` (per token and
    128-wide group) for ``block``, ``None`` (per token) otherwise."""
    return BLOCK if check_scheme(scheme) == "block" else None


def weight_scale_shape(scheme: str, out_features: int, in_features: int) -> tuple[int, ...]:
    check_scheme(scheme)
    if scheme == "tensor":
        return ()
    if scheme == "channel":
        return (out_features,)
    return (-(-out_features // BLOCK), -(-in_features // BLOCK))


def check_block_in_features(name: str, in_features: int) -> None:
    if in_features % BLOCK:
        raise ValueError(f"{name}: the block scheme needs in_features divisible by {BLOCK}, got {in_features} "
                         "(use the channel scheme for this layer)")


def _resolve(backend: object, device: torch.device) -> str:
    if backend not in _BACKENDS:
        raise ValueError(f"backend: expected one of {_BACKENDS}, got {backend!r}")
    from .ops import resolve_backend

    return resolve_backend(backend, device)


def _check_float(name: str, x: object, ndim: int | None = None) -> torch.Tensor:
    if not isinstance(x, torch.Tensor) or x.dtype not in _FLOAT or (ndim is not None and x.dim() != ndim):
        want = f"a {ndim}-D " if ndim is not None else "a "
        got = f"{str(x.dtype).replace('torch.', '')} tensor of shape {tuple(x.shape)}" if isinstance(x, torch.Tensor) \
            else type(x).__name__
        raise ValueError(f"{name}: expected {want}float16, bfloat16 or float32 tensor, got {got}")
    return x


def _check_group(group: object, k: int, name: str = "x") -> int | None:
    if group is None:
        return None
    if group != BLOCK:
        raise ValueError(f"group: expected None (per token) or {BLOCK} (per 128-wide group), got {group!r}")
    if k % BLOCK:
        raise ValueError(f"{name}: per-group quantization needs a last dimension divisible by {BLOCK}, got {k}")
    return BLOCK


# ---------------------------------------------------------------------------------------------
# weights (load time: PyTorch only)
# ---------------------------------------------------------------------------------------------


def _blocks(w: torch.Tensor) -> torch.Tensor:
    """``[N, K]`` -> ``[ceil(N/128), 128, K/128, 128]`` (rows padded with zeros)."""
    n, k = w.shape
    pad = -n % BLOCK
    if pad:
        w = torch.cat([w, w.new_zeros(pad, k)])
    return w.reshape(-1, BLOCK, k // BLOCK, BLOCK)


def quantize_weight(weight: torch.Tensor, scheme: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight [N, K]`` (float) -> ``(w8 [N, K] e4m3, scale)`` in ``scheme``'s layout."""
    check_scheme(scheme)
    w = _check_float("weight", weight, ndim=2).detach()
    n, k = w.shape
    if scheme == "tensor":
        scale = descale_from_amax(w.abs().amax() if w.numel() else w.new_zeros(()))
        return quantize(w, scale), scale
    if scheme == "channel":
        scale = descale_from_amax(w.abs().amax(dim=1) if k else w.new_zeros(n))
        return quantize(w, scale[:, None]), scale
    check_block_in_features("weight", k)
    scale = descale_from_amax(_blocks(w).abs().amax(dim=(1, 3)))
    return quantize(w, expand_block_scale(scale, n, k)), scale


def expand_block_scale(scale: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """A ``[ceil(N/128), K/128]`` tile scale repeated over each tile's elements: ``[N, K]``."""
    return scale.repeat_interleave(BLOCK, 0)[:n].repeat_interleave(BLOCK, 1)[:, :k]


def dequantize_weight(w8: torch.Tensor, scale: torch.Tensor, scheme: str) -> torch.Tensor:
    """float32 ``w8 * scale`` (``scale`` in ``scheme``'s layout)."""
    check_scheme(scheme)
    w = w8.float()
    if scheme == "tensor":
        return w * scale
    if scheme == "channel":
        return w * scale[:, None]
    return w * expand_block_scale(scale, *w8.shape)


# ---------------------------------------------------------------------------------------------
# activations
# ---------------------------------------------------------------------------------------------


def quantize_activation_reference(x: torch.Tensor, group: int | None) -> Fp8Activation:
    m, k = x.shape
    g = k if group is None else group
    if m == 0 or k == 0:
        scale = descale_from_amax(x.new_zeros(m, 1 if group is None else k // BLOCK).float())
        return Fp8Activation(quantize(x, 1.0), scale, group)
    xg = x.float().reshape(m, k // g, g)
    scale = descale_from_amax(xg.abs().amax(dim=2))
    return Fp8Activation(quantize(xg, scale[:, :, None]).reshape(m, k), scale, group)


def quantize_activation(x: torch.Tensor, group: int | None = None, *, backend: str = "auto") -> Fp8Activation:
    """Dynamic quantization of ``x [M, K]``: per token (``group=None``, scale ``[M, 1]``) or per
    token and 128-wide group (``group=128``, scale ``[M, K/128]``)."""
    x = _check_float("x", x, ndim=2)
    group = _check_group(group, x.shape[1])
    if _resolve(backend, x.device) == "reference":
        return quantize_activation_reference(x, group)
    from . import triton_fp8_gemm

    x8, scale = triton_fp8_gemm.quantize_rows(x if x.stride(-1) == 1 else x.contiguous(), group)
    return Fp8Activation(x8, scale, group)


def dequantize_activation(act: Fp8Activation) -> torch.Tensor:
    m, k = act.x8.shape
    g = k if act.group is None else act.group
    if m == 0 or k == 0:
        return act.x8.float()
    return (act.x8.float().reshape(m, k // g, g) * act.scale[:, :, None]).reshape(m, k)


def rms_norm_quant_reference(x: torch.Tensor, weight: torch.Tensor, eps: float, group: int | None):
    from .elementwise import rms_norm_reference

    y = rms_norm_reference(x, weight, eps)
    return y, quantize_activation_reference(y.reshape(-1, y.shape[-1]), group)


def rms_norm_quant(x: torch.Tensor, weight: torch.Tensor, eps: float, group: int | None = None, *,
                   backend: str = "auto") -> tuple[torch.Tensor, Fp8Activation]:
    """transformers' RMSNorm of ``x [..., n]`` (``kernels.elementwise.rms_norm``'s contract) and,
    from the same pass, that result quantized as :func:`quantize_activation` would (rows
    ``[prod(...), n]``). Returns ``(y, act)``."""
    x = _check_float("x", x)
    weight = _check_float("weight", weight, ndim=1)
    if x.dim() == 0 or weight.shape[0] != x.shape[-1]:
        raise ValueError(f"weight: expected shape [{x.shape[-1] if x.dim() else '?'}] (x's last dimension), "
                         f"got {tuple(weight.shape)} for x of shape {tuple(x.shape)}")
    if weight.device != x.device:
        raise ValueError(f"weight: expected a tensor on {x.device}, got one on {weight.device}")
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps >= 0:
        raise ValueError(f"eps: expected a float >= 0, got {eps!r}")
    n = x.shape[-1]
    group = _check_group(group, n)
    from . import triton_fp8_gemm

    if _resolve(backend, x.device) == "reference" or n > triton_fp8_gemm.MAX_ROW:
        return rms_norm_quant_reference(x, weight, float(eps), group)
    x2d = x.reshape(-1, n)
    if x2d.stride(-1) != 1:
        x2d = x2d.contiguous()
    y, x8, scale = triton_fp8_gemm.rms_norm_quant(x2d, weight.contiguous(), float(eps),
                                                  torch.promote_types(weight.dtype, x.dtype), group)
    return y.view(x.shape), Fp8Activation(x8, scale, group)


def silu_mul_quant_reference(gate: torch.Tensor, up: torch.Tensor, group: int | None) -> Fp8Activation:
    from .elementwise import silu_mul_reference

    y = silu_mul_reference(gate, up)
    return quantize_activation_reference(y.reshape(-1, y.shape[-1]), group)


def silu_mul_quant(gate: torch.Tensor, up: torch.Tensor, group: int | None = None, *,
                   backend: str = "auto") -> Fp8Activation:
    """``kernels.elementwise.silu_mul(gate, up)`` (``[..., n]`` each, one shape and dtype)
    quantized as :func:`quantize_activation` would (rows ``[prod(...), n]``), in one pass that
    never stores the product: what the down projection of an FP8 MLP reads."""
    gate = _check_float("gate", gate)
    up = _check_float("up", up)
    if up.dtype != gate.dtype or up.shape != gate.shape:
        raise ValueError(f"up: expected gate's shape {tuple(gate.shape)} and dtype "
                         f"{str(gate.dtype).replace('torch.', '')}, got {tuple(up.shape)} {str(up.dtype).replace('torch.', '')}")
    if up.device != gate.device:
        raise ValueError(f"up: expected a tensor on {gate.device}, got one on {up.device}")
    if gate.dim() == 0:
        raise ValueError("gate: expected at least one dimension, got a 0-D tensor")
    n = gate.shape[-1]
    group = _check_group(group, n, "gate")
    resolved = _resolve(backend, gate.device)
    if resolved == "reference":
        return silu_mul_quant_reference(gate, up, group)
    g2d, u2d = gate.reshape(-1, n), up.reshape(-1, n)
    if n > 0 and g2d.stride(-1) != 1:
        g2d = g2d.contiguous()
    if n > 0 and u2d.stride(-1) != 1:
        u2d = u2d.contiguous()
    from . import triton_fp8_gemm

    if n > triton_fp8_gemm.MAX_ROW:  # wider than one program holds: the two kernels, the same bits
        from .elementwise import silu_mul

        return quantize_activation(silu_mul(g2d, u2d, backend="triton"), group, backend="triton")
    x8, scale = triton_fp8_gemm.silu_mul_quant(g2d, u2d, group)
    return Fp8Activation(x8, scale, group)


# ---------------------------------------------------------------------------------------------
# the GEMM
# ---------------------------------------------------------------------------------------------


def fp8_mm_reference(act: Fp8Activation, w8: torch.Tensor, w_scale: torch.Tensor, scheme: str, *,
                     out_dtype: torch.dtype, bias: torch.Tensor | None = None) -> torch.Tensor:
    out = dequantize_activation(act) @ dequantize_weight(w8, w_scale, scheme).t()
    if bias is not None:
        out = out + bias.float()
    return out.to(out_dtype)


def check_weight(w8: object, w_scale: object, scheme: str, *, name: str = "weight") -> tuple[int, int]:
    """``w8 [N, K]`` e4m3 and its float32 scale in ``scheme``'s layout; returns ``(N, K)``."""
    check_scheme(scheme)
    if not isinstance(w8, torch.Tensor) or w8.dtype != FP8_DTYPE or w8.dim() != 2:
        got = f"{str(w8.dtype).replace('torch.', '')} tensor of shape {tuple(w8.shape)}" \
            if isinstance(w8, torch.Tensor) else type(w8).__name__
        raise ValueError(f"{name}: expected a 2-D float8_e4m3fn tensor [out_features, in_features], got {got}")
    n, k = w8.shape
    if scheme == "block":
        check_block_in_features(name, k)
    want = weight_scale_shape(scheme, n, k)
    if not isinstance(w_scale, torch.Tensor) or w_scale.dtype != torch.float32 or tuple(w_scale.shape) != want:
        got = f"{str(w_scale.dtype).replace('torch.', '')} tensor of shape {list(w_scale.shape)}" \
            if isinstance(w_scale, torch.Tensor) else type(w_scale).__name__
        raise ValueError(f"{name}_scale: expected a float32 tensor of shape {list(want)} ({scheme} scheme of a "
                         f"[{n}, {k}] weight), got {got}")
    if w_scale.device != w8.device:
        raise ValueError(f"{name}_scale: expected a tensor on {w8.device}, got one on {w_scale.device}")
    return n, k


def _row_scale(w_scale: torch.Tensor, scheme: str, n: int) -> torch.Tensor:
    """The per-channel ``[1, N]`` view ``_scaled_mm``'s row-wise mode takes."""
    if scheme == "tensor":
        return w_scale.reshape(1, 1).expand(1, n).contiguous()
    return w_scale.reshape(1, n)


def scaled_mm_supports(act: Fp8Activation, n: int, k: int, scheme: str, out_dtype: torch.dtype) -> bool:
    """Whether ``torch._scaled_mm``'s row-wise mode takes this product (CUDA)."""
    return (scheme in ("tensor", "channel") and act.group is None and out_dtype == torch.bfloat16
            and k % 16 == 0 and n % 16 == 0 and act.x8.is_cuda)


def blockwise_supports(act: Fp8Activation, n: int, k: int, out_dtype: torch.dtype) -> bool:
    """The shapes the blockwise ``_scaled_mm`` path takes: bf16 output, whole 128-wide weight tiles,
    ``K / 128`` a multiple of 4 (cuBLASLt's scale padding rule, ``L4``) and a token count that is a
    multiple of 4 (its activation-scale alignment); other shapes take the Triton kernel."""
    return (act.group == BLOCK and out_dtype == torch.bfloat16 and n % BLOCK == 0 and k % (4 * BLOCK) == 0
            and act.x8.shape[0] % 4 == 0 and act.x8.shape[0] > 0 and act.x8.is_cuda)


def _blockwise_scaled_mm(act: Fp8Activation, w8: torch.Tensor, w_scale: torch.Tensor,
                         out_dtype: torch.dtype) -> torch.Tensor:
    # outer-dim-major activation scales (one copy of [M, K/128] floats); the weight's tile scale
    # transposed is already the [K/128, N/128] K-major layout B = w8.T takes
    a_scale = act.scale.t().contiguous().t()
    return torch._scaled_mm(act.x8, w8.t(), scale_a=a_scale, scale_b=w_scale.t(), out_dtype=out_dtype)


@functools.lru_cache(maxsize=None)
def _blockwise_probe(device: str) -> str | None:
    gen = torch.Generator().manual_seed(0)
    try:
        w = torch.randn(256, 512, generator=gen)
        x = torch.randn(64, 512, generator=gen)
        w8, ws = quantize_weight(w.to(device), "block")
        act = quantize_activation_reference(x.to(torch.bfloat16).to(device), BLOCK)
        got = _blockwise_scaled_mm(act, w8, ws, torch.bfloat16).float()
        want = fp8_mm_reference(act, w8, ws, "block", out_dtype=torch.float32)
        err = float((got - want).abs().max())
        tol = 2 * 2.0**-8 * (float(want.abs().max()) + 1.0)  # bf16 output rounding, accumulation order
        return None if err <= tol else f"max |_scaled_mm - reference| = {err:.3g} > {tol:.3g}"
    except Exception as exc:  # noqa: BLE001 - a torch build or GPU without the mode: the Triton kernel
        return f"{type(exc).__name__}: {exc}"[:300]


def blockwise_scaled_mm_works(device: torch.device | str) -> bool:
    """Whether ``torch._scaled_mm`` computes the block scheme's product (1x128 activation, 128x128
    weight scales) right on ``device``: run once per device at a small shape against
    :func:`fp8_mm_reference`, then cached. CUDA only; :func:`blockwise_probe_failure` says why not."""
    device = torch.device(device)
    if device.type != "cuda":
        return False
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return _blockwise_probe(str(device)) is None


def blockwise_probe_failure(device: torch.device | str) -> str | None:
    """Why :func:`blockwise_scaled_mm_works` said no on ``device`` (None when it works)."""
    device = torch.device(device)
    if device.type != "cuda":
        return f"not CUDA ({device})"
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return _blockwise_probe(str(device))


def fp8_mm(act: Fp8Activation, w8: torch.Tensor, w_scale: torch.Tensor, scheme: str, *,
           out_dtype: torch.dtype = torch.bfloat16, bias: torch.Tensor | None = None,
           backend: str = "auto", check: bool = True) -> torch.Tensor:
    """``dequant(act) @ dequant(w8).T + bias`` in ``out_dtype`` (see the module doc).
    ``check=False`` skips the per-call validation (``Fp8Linear`` validated at construction)."""
    if check:
        n, k = check_weight(w8, w_scale, scheme)
        if not isinstance(act, Fp8Activation):
            raise ValueError(f"act: expected an Fp8Activation, got {type(act).__name__}")
        if act.x8.dim() != 2 or act.x8.shape[1] != k:
            raise ValueError(f"act: expected activations [M, {k}] (the weight's in_features), got "
                             f"{list(act.x8.shape)}")
        if act.group != activation_group(scheme):
            raise ValueError(f"act: the {scheme} scheme takes activations quantized with group="
                             f"{activation_group(scheme)}, got group={act.group}")
        if bias is not None and (not isinstance(bias, torch.Tensor) or tuple(bias.shape) != (n,)):
            raise ValueError(f"bias: expected a tensor of shape [{n}], got "
                             f"{list(bias.shape) if isinstance(bias, torch.Tensor) else type(bias).__name__}")
        if out_dtype not in _FLOAT:
            raise ValueError(f"out_dtype: expected float16, bfloat16 or float32, got {out_dtype}")
    n, k = w8.shape
    resolved = _resolve(backend, act.x8.device)
    if resolved == "reference":
        return fp8_mm_reference(act, w8, w_scale, scheme, out_dtype=out_dtype, bias=bias)
    if backend == "auto" and scaled_mm_supports(act, n, k, scheme, out_dtype):
        out = torch._scaled_mm(act.x8, w8.t(), scale_a=act.scale, scale_b=_row_scale(w_scale, scheme, n),
                               out_dtype=out_dtype)
        return out if bias is None else out.add_(bias.to(out_dtype))
    if (backend == "auto" and scheme == "block" and blockwise_supports(act, n, k, out_dtype)
            and blockwise_scaled_mm_works(act.x8.device)):
        out = _blockwise_scaled_mm(act, w8, w_scale, out_dtype)
        return out if bias is None else out.add_(bias.to(out_dtype))
    from . import triton_fp8_gemm

    if scheme == "block":
        b_scale, scale_n = w_scale, BLOCK
    else:  # one factor per output channel; per token on the activation side
        b_scale, scale_n = _row_scale(w_scale, scheme, n).reshape(n, 1), 1
    return triton_fp8_gemm.scaled_mm(act.x8, act.scale, w8, b_scale, scale_n=scale_n,
                                     k_scaled=act.group is not None, out_dtype=out_dtype, bias=bias)


# ---------------------------------------------------------------------------------------------
# the q epilogue of the QKV path: RoPE with the amax in the same pass
# ---------------------------------------------------------------------------------------------


def rotary_amax_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    from .elementwise import rotary_reference

    y = rotary_reference(x, cos, sin)
    amax = y.abs().amax().float().reshape(1) if y.numel() else torch.zeros(1, device=y.device)
    return y, amax


def rotary_amax(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *,
                backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """``kernels.elementwise.rotary(x, cos, sin)`` (tokens-major ``x [T, H, d]``, the same bits)
    and ``max |result|`` as a float32 ``[1]`` device tensor, from one pass over ``x``."""
    from .elementwise import rotary_supports

    x = _check_float("x", x, ndim=3)
    t, _, d = x.shape
    for name, c in (("cos", cos), ("sin", sin)):
        if not isinstance(c, torch.Tensor) or c.dtype != x.dtype or tuple(c.shape) != (t, d) or c.device != x.device:
            raise ValueError(f"{name}: expected a {str(x.dtype).replace('torch.', '')} tensor [{t}, {d}] on {x.device} "
                             f"(x's tokens and head_dim), got "
                             f"{(str(c.dtype), tuple(c.shape)) if isinstance(c, torch.Tensor) else type(c).__name__}")
    if not rotary_supports(d):
        raise ValueError(f"x: expected a head_dim of twice a power of two (64, 128, 256, ...), got {d}")
    if _resolve(backend, x.device) == "reference":
        return rotary_amax_reference(x, cos, sin)
    from . import triton_fp8_gemm

    x = x if x.stride(-1) == 1 else x.contiguous()
    return triton_fp8_gemm.rotary_amax(x, cos.contiguous(), sin.contiguous())


def quantize_with_amax(x: torch.Tensor, amax: torch.Tensor, *, backend: str = "auto",
                       margin: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """``kernels.fp8.quantize_per_tensor(x)`` with the amax already known (:func:`rotary_amax`):
    the same ``(x8, descale [1])`` bits, one pass over ``x``."""
    descale = descale_from_amax(amax.reshape(1), margin=margin)
    if _resolve(backend, x.device) == "reference":
        return quantize(x, descale), descale
    from . import triton_fp8

    return triton_fp8.quantize_per_tensor(x.contiguous(), descale), descale


__all__ = [
    "SCHEMES", "BLOCK", "FP8_MAX", "Fp8Activation", "check_scheme", "activation_group", "weight_scale_shape",
    "quantize_weight", "dequantize_weight", "expand_block_scale", "quantize_activation",
    "quantize_activation_reference", "dequantize_activation", "rms_norm_quant", "rms_norm_quant_reference",
    "silu_mul_quant", "silu_mul_quant_reference",
    "fp8_mm", "fp8_mm_reference", "check_weight", "scaled_mm_supports", "blockwise_supports",
    "blockwise_scaled_mm_works", "blockwise_probe_failure", "rotary_amax", "rotary_amax_reference",
    "quantize_with_amax",
]
