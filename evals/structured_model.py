"""Index-stage density of the structured benchmark model (``model_executor.structured_model``).

Measuring: :func:`measure_density` registers an attention function with transformers'
``AttentionInterface`` that receives each layer's post-RoPE q/k/v, runs our index stage
(``kernels.ops.plan_prefill`` + ``build_index_planned``) on them and records the density, then
returns dense attention (``torch`` SDPA) so later layers see the model's exact hidden states.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kernels import ops
from kernels.config import KV_TILE, SparseConfig
from kernels.paged import contiguous_to_paged
from model_executor.structured_model import (  # noqa: F401  (the model's names, for callers of evals)
    HeadBand,
    StructuredModelSpec,
    build_structured_llama,
    haystack_ids,
    head_type,
    llama31_8b_spec,
    llama_config,
    tiny_spec,
)

from .density import density as index_density

ATTENTION_NAME = "fpv2_density_probe"  # no "flash", no "/": see shared/notes/TRANSFORMERS.md


@dataclass
class LayerDensity:
    layer: int
    density: float
    per_kv_head: list[float]


class _DensityProbe:
    """The attention function: index-stage density on the real q/k, then dense SDPA."""

    def __init__(self, config: SparseConfig, layers: int, backend: str):
        self.config, self.layers, self.backend = config, layers, backend
        self.records: list[LayerDensity] = []

    def __call__(self, module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        bsz, hq, length, d = query.shape
        hkv = key.shape[1]
        layer = int(getattr(module, "layer_idx", len(self.records)))
        if layer < self.layers:
            cfg = self.config
            if scaling is not None and not math.isclose(scaling, cfg.softmax_scale(d)):
                from dataclasses import replace

                cfg = replace(cfg, scale=float(scaling))
            q = query.transpose(1, 2).reshape(bsz * length, hq, d).contiguous()
            k_pages, page_table = contiguous_to_paged(key.transpose(1, 2).contiguous(), KV_TILE)
            v_pages, _ = contiguous_to_paged(value.transpose(1, 2).contiguous(), KV_TILE)
            cu = torch.arange(0, (bsz + 1) * length, length, dtype=torch.int32, device=q.device)
            seqlens = torch.full((bsz,), length, dtype=torch.int32, device=q.device)
            plan = ops.plan_prefill(q, k_pages, v_pages, page_table, cu, seqlens, cfg)
            index = ops.build_index_planned(q, k_pages, v_pages, plan, backend=self.backend)
            total, per_head = index_density(index, plan, per_kv_head=True)
            self.records.append(LayerDensity(layer, total, per_head))
            del q, k_pages, v_pages, index
        g = hq // hkv
        k = key.repeat_interleave(g, dim=1)
        v = value.repeat_interleave(g, dim=1)
        out = torch.nn.functional.scaled_dot_product_attention(query, k, v, is_causal=True, scale=scaling)
        return out.transpose(1, 2).contiguous(), None


@torch.no_grad()
def measure_density(
    model, input_ids: torch.Tensor, config: SparseConfig | None = None, *,
    layers: int | None = None, backend: str = "auto",
) -> list[LayerDensity]:
    """Index-stage density of each of the first ``layers`` layers on ``input_ids``' real q/k."""
    from transformers import AttentionInterface

    config = SparseConfig() if config is None else config
    n = model.config.num_hidden_layers if layers is None else layers
    probe = _DensityProbe(config, n, backend)
    AttentionInterface.register(ATTENTION_NAME, probe)
    previous = model.config._attn_implementation
    model.set_attn_implementation(ATTENTION_NAME)
    try:
        inner = model.model
        keep = inner.layers
        inner.layers = keep[:n]  # later layers cannot change what was measured
        try:
            inner(input_ids=input_ids.to(model.device), use_cache=False)
        finally:
            inner.layers = keep
    finally:
        model.set_attn_implementation(previous)
    return probe.records


__all__ = [
    "HeadBand", "StructuredModelSpec", "LayerDensity", "llama31_8b_spec", "tiny_spec",
    "llama_config", "build_structured_llama", "haystack_ids", "measure_density", "head_type",
    "ATTENTION_NAME",
]
