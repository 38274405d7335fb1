"""Fused elementwise steps inside a transformers model: RMSNorm and the SiLU-gated MLP's
``act_fn(gate) * up`` run as one kernel each (``kernels/elementwise.py``), as vLLM's and SGLang's
model code does, instead of transformers' eager ops.

Only modules whose eager forward is known to be exactly that math are replaced (by class name,
and only in their plain form: a weight-only RMSNorm with ``variance_epsilon``; an MLP with
``gate_proj``/``up_proj``/``down_proj`` and a SiLU ``act_fn``), so Gemma's ``(1 + weight)`` norm or a
GELU MLP keep transformers' code. The replacement is per instance (``module.forward``), never on
the class, so other models in the process are untouched; ``uninstall`` restores the eager forwards
(the baselines that time stock transformers on the same model object call it).
"""

from __future__ import annotations

import types

import torch

from kernels import elementwise

NORM_CLASSES = frozenset({"LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm"})
MLP_CLASSES = frozenset({"LlamaMLP", "MistralMLP", "Qwen2MLP", "Qwen3MLP"})
_BACKEND_ATTR = "_flashprefill_fused_backend"


def _norm_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    return elementwise.rms_norm(hidden_states, self.weight, self.variance_epsilon,
                                backend=getattr(self, _BACKEND_ATTR))


def _mlp_forward(self, x: torch.Tensor) -> torch.Tensor:
    act = elementwise.silu_mul(self.gate_proj(x), self.up_proj(x), backend=getattr(self, _BACKEND_ATTR))
    return self.down_proj(act)


_FORWARDS = (_norm_forward, _mlp_forward)


def _plain_norm(module: torch.nn.Module) -> bool:
    weight = getattr(module, "weight", None)
    return (type(module).__name__ in NORM_CLASSES and isinstance(weight, torch.Tensor) and weight.dim() == 1
            and isinstance(getattr(module, "variance_epsilon", None), (int, float)))


def _silu_mlp(module: torch.nn.Module) -> bool:
    act = getattr(module, "act_fn", None)
    return (type(module).__name__ in MLP_CLASSES
            and all(isinstance(getattr(module, n, None), torch.nn.Module) for n in ("gate_proj", "up_proj", "down_proj"))
            and (isinstance(act, torch.nn.SiLU) or type(act).__name__ == "SiLUActivation"))


def install(model: torch.nn.Module, *, backend: str = "auto") -> dict[str, int]:
    """Replace the plain RMSNorms and SiLU MLPs of ``model`` (see the module doc); idempotent.
    ``backend``: ``kernels.elementwise``'s (``"auto"``: Triton on CUDA). Returns how many modules
    of each kind now run fused."""
    if backend not in ("auto", "triton", "reference"):
        raise ValueError(f"backend: expected 'auto', 'triton' or 'reference', got {backend!r}")
    counts = {"rms_norm": 0, "silu_mul": 0}
    for module in model.modules():
        if _plain_norm(module):
            kind, forward = "rms_norm", _norm_forward
        elif _silu_mlp(module):
            kind, forward = "silu_mul", _mlp_forward
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
    counts = {"rms_norm": 0, "silu_mul": 0}
    for module in model.modules():
        func = getattr(module.__dict__.get("forward"), "__func__", None)
        if func is _norm_forward:
            counts["rms_norm"] += 1
        elif func is _mlp_forward:
            counts["silu_mul"] += 1
    return counts
