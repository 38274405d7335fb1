"""Qwen3 (dense), full-attention layers: a per-head RMSNorm on q and k before RoPE, so ``fused``
keeps its attention forward (the FP8 q-amax forward runs the norms itself). Hermes tool calls."""

from .spec import ArchitectureSpec, LayerClasses

SPEC = ArchitectureSpec(
    model_type="qwen3",
    config_class="transformers:Qwen3Config",
    model_class="transformers:Qwen3ForCausalLM",
    layer=LayerClasses(attention="Qwen3Attention", mlp="Qwen3MLP", norm="Qwen3RMSNorm"),
    fused_ops=frozenset({"rms_norm", "silu_mul"}),
    fp8_attention=True,
    tool_call_format="hermes",
    gguf_architecture="qwen3",
)
