"""Fused elementwise steps inside a transformers model: RMSNorm, the SiLU-gated MLP's
``act_fn(gate) * up`` and the attention's rotary embedding run as one kernel each
(``kernels/elementwise.py``), as vLLM's and SGLang's model code does, instead of transformers'
eager ops.

Only modules whose eager forward is known to be exactly that math are replaced (by class name:
the registered families' ``fused_ops``, ``model_executor.models``; and only in their plain form: a weight-only RMSNorm with ``variance_epsilon``; an MLP with
``gate_proj``/``up_proj``/``down_proj`` and a SiLU ``act_fn``; ``LlamaAttention``, whose forward
is projections, rotate-half RoPE, the attention function, ``o_proj``), so Gemma's ``(1 + weight)``
norm, a GELU MLP or Qwen3's q/k norms keep transformers' code. The fused attention forward
applies RoPE straight into the tokens-major layout our paged attention reads (no transposed
copies of q, k, v), writing the rotated k and v into the pool from the same pass
(``kernels.rope_kv``, where ``attention.rope_kv_fusable``), and runs only under ``fpv2_paged``
without a transformers cache; anything
else goes to the class's own forward. The replacement is per instance (``module.forward``), never on
the class, so other models in the process are untouched; ``uninstall`` restores the eager forwards
(the baselines that time stock transformers on the same model object call it).
"""

from __future__ import annotations

import functools
import logging
import types

import torch

from kernels import elementwise
from kernels.ranges import op_range

from . import models
from .attention import ATTENTION_NAME, BATCH_KWARG, paged_attention_forward, rope_and_write_kv, rope_kv_fusable

logger = logging.getLogger(__name__)

_BACKEND_ATTR = "_flashprefill_fused_backend"
# Below this many tokens the MLP keeps eager ``act_fn(gate) * up``: measured on the H200
# (benchmarks/bench_elementwise.py, 2026-12-01), the fused call is slower up to 256 tokens (22-37
# vs 17-25 us a call: its host-side cost, the GPU work being tiny) and faster from 1024 (1.1x,
# 1.7x from 4096). RMSNorm and RoPE are faster fused at every count measured, from 1 token.
SILU_MUL_MIN_TOKENS = 1024
KINDS = models.FUSED_KINDS


def _norm_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    with op_range("norm"):
        return elementwise.rms_norm(hidden_states, self.weight, self.variance_epsilon,
                                    backend=getattr(self, _BACKEND_ATTR))


def _mlp_forward(self, x: torch.Tensor) -> torch.Tensor:
    with op_range("gate_up_gemm"):
        gate, up = self.gate_proj(x), self.up_proj(x)
    with op_range("silu_mul"):
        if gate.numel() < SILU_MUL_MIN_TOKENS * gate.shape[-1]:  # decode steps, short prompts
            h = self.act_fn(gate) * up
        else:
            h = elementwise.silu_mul(gate, up, backend=getattr(self, _BACKEND_ATTR))
    with op_range("down_gemm"):
        return self.down_proj(h)


def _attention_forward(self, hidden_states: torch.Tensor, position_embeddings=None, attention_mask=None,
                       past_key_values=None, **kwargs):
    d = self.head_dim
    if (past_key_values is not None or position_embeddings is None or hidden_states.dim() != 3
            or hidden_states.shape[0] != 1 or self.config._attn_implementation != ATTENTION_NAME
            or tuple(position_embeddings[0].shape[-2:]) != (hidden_states.shape[1], d)):
        return type(self).forward(self, hidden_states, position_embeddings=position_embeddings,
                                  attention_mask=attention_mask, past_key_values=past_key_values, **kwargs)
    n = hidden_states.shape[1]
    backend = getattr(self, _BACKEND_ATTR)
    cos, sin = (c.reshape(n, d) for c in position_embeddings)
    with op_range("qkv_gemm"):
        q = self.q_proj(hidden_states).view(n, -1, d)
        k = self.k_proj(hidden_states).view(n, -1, d)
        v = self.v_proj(hidden_states).view(n, -1, d)
    batch = kwargs.get(BATCH_KWARG)
    written = rope_kv_fusable(batch, q.dtype)
    if written:  # RoPE and the K/V write in one pass: the rotated k goes straight to its pages
        q = rope_and_write_kv(self, batch, q, k, v, cos, sin, backend=backend)
    else:
        with op_range("rope"):
            q = elementwise.rotary(q, cos, sin, backend=backend)
            k = elementwise.rotary(k, cos, sin, backend=backend)
    # [1, H, T, d] views of the tokens-major tensors: the attention's layout change is then free
    out, weights = paged_attention_forward(self, q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                           v.transpose(0, 1)[None], attention_mask, dropout=0.0,
                                           scaling=self.scaling, kv_written=written, **kwargs)
    with op_range("o_gemm"):
        return self.o_proj(out.reshape(1, n, -1)), weights


_FORWARDS = {_norm_forward: "rms_norm", _mlp_forward: "silu_mul", _attention_forward: "rotary"}


def _classes(part: str, kind: str) -> frozenset[str]:
    return models.layer_classes(part, lambda spec: kind in spec.fused_ops)


def _plain_norm(module: torch.nn.Module, classes: frozenset[str]) -> bool:
    weight = getattr(module, "weight", None)
    return (type(module).__name__ in classes and isinstance(weight, torch.Tensor) and weight.dim() == 1
            and isinstance(getattr(module, "variance_epsilon", None), (int, float)))


def silu_mlp(module: torch.nn.Module, classes: frozenset[str] | None = None) -> bool:
    """An MLP whose eager forward is ``down_proj(silu(gate_proj(x)) * up_proj(x))``: one of
    ``classes`` (default: the MLP classes of the families that fuse ``silu_mul``) in plain form."""
    act = getattr(module, "act_fn", None)
    classes = _classes("mlp", "silu_mul") if classes is None else classes
    return (type(module).__name__ in classes
            and all(isinstance(getattr(module, n, None), torch.nn.Module) for n in ("gate_proj", "up_proj", "down_proj"))
            and (isinstance(act, torch.nn.SiLU) or type(act).__name__ == "SiLUActivation"))


def _rope_attention(module: torch.nn.Module, classes: frozenset[str]) -> bool:
    return (type(module).__name__ in classes and elementwise.rotary_supports(getattr(module, "head_dim", None))
            and isinstance(getattr(module, "scaling", None), float)
            and all(isinstance(getattr(module, n, None), torch.nn.Module) for n in ("q_proj", "k_proj", "v_proj", "o_proj")))


def install(model: torch.nn.Module, *, backend: str = "auto") -> dict[str, int]:
    """Replace the plain RMSNorms, SiLU MLPs and rotate-half attentions of ``model`` (see the
    module doc); idempotent. ``backend``: ``kernels.elementwise``'s (``"auto"``: Triton on CUDA).
    Returns how many modules of each kind now run fused."""
    if backend not in ("auto", "triton", "reference"):
        raise ValueError(f"backend: expected 'auto', 'triton' or 'reference', got {backend!r}")
    counts = dict.fromkeys(KINDS, 0)
    norms, mlps = _classes("norm", "rms_norm"), _classes("mlp", "silu_mul")
    attentions = _classes("attention", "rotary")
    for module in model.modules():
        if _plain_norm(module, norms):
            kind, forward = "rms_norm", _norm_forward
        elif silu_mlp(module, mlps):
            kind, forward = "silu_mul", _mlp_forward
        elif _rope_attention(module, attentions):
            kind, forward = "rotary", _attention_forward
        else:
            continue
        setattr(module, _BACKEND_ATTR, backend)
        module.forward = types.MethodType(forward, module)
        counts[kind] += 1
    return counts


def uninstall(model: torch.nn.Module) -> int:
    """Give every module ``install`` replaced its class's (eager) forward back; returns how many."""
    n = 0
    for module in model.modules():
        forward = module.__dict__.get("forward")
        if getattr(forward, "__func__", None) in _FORWARDS:
            del module.forward
            module.__dict__.pop(_BACKEND_ATTR, None)
            n += 1
    return n


def installed(model: torch.nn.Module) -> dict[str, int]:
    """How many modules of ``model`` run fused now, by kind."""
    counts = dict.fromkeys(KINDS, 0)
    for module in model.modules():
        kind = _FORWARDS.get(getattr(module.__dict__.get("forward"), "__func__", None))
        if kind is not None:
            counts[kind] += 1
    return counts


def self_check(model: torch.nn.Module, device: torch.device, backend: str = "triton") -> str | None:
    """Run each fused kernel once at ``model``'s sizes (hidden, intermediate, head_dim, dtype) on
    ``device`` against its reference; ``None`` when all agree, else why not (a kernel that does
    not compile here, or disagrees). What the runner checks before it installs them by default."""
    c = model.config
    dtype = next(model.parameters()).dtype
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    inter = getattr(c, "intermediate_size", None) or 4 * c.hidden_size
    return _self_check(str(device), dtype, int(c.hidden_size), int(inter), int(head_dim), backend)


@functools.lru_cache(maxsize=None)
def _self_check(device: str, dtype: torch.dtype, hidden: int, inter: int, head_dim: int, backend: str) -> str | None:
    gen = torch.Generator().manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(dtype).to(device)

    try:
        x, w = rand(3, hidden), rand(hidden)
        checks = [("rms_norm", elementwise.rms_norm(x, w, 1e-5, backend=backend),
                   elementwise.rms_norm_reference(x, w, 1e-5))]
        g, u = rand(3, inter), rand(3, inter)
        checks.append(("silu_mul", elementwise.silu_mul(g, u, backend=backend), elementwise.silu_mul_reference(g, u)))
        if elementwise.rotary_supports(head_dim):
            q, cos, sin = rand(3, 2, head_dim), rand(3, head_dim), rand(3, head_dim)
            checks.append(("rotary", elementwise.rotary(q, cos, sin, backend=backend),
                           elementwise.rotary_reference(q, cos, sin)))
        for name, got, want in checks:
            # a few units of the dtype's last place at the values' magnitude (rounding order only)
            tol = 4 * torch.finfo(dtype).eps * (want.float().abs().max().item() + 1.0)
            err = (got.float() - want.float()).abs().max().item()
            if not err <= tol:
                return f"{name}: max |fused - reference| = {err:.3g} > {tol:.3g} on {device} ({dtype})"
    except Exception as exc:  # noqa: BLE001 - a kernel that does not build or run here: stay eager
        return f"{type(exc).__name__}: {exc}"[:500]
    return None
