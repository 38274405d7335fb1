"""Qwen2 (Qwen2.5 included), full-attention layers: q/k/v carry a bias (the column split cuts it
with the rows). Its attention keeps transformers' forward under ``fused`` (a Qwen2 layer may have a
sliding window); the FP8 q-amax forward skips such layers at install. Hermes tool calls."""

from .spec import ArchitectureSpec, LayerClasses

SPEC = ArchitectureSpec(
    model_type="qwen2",
    config_class="transformers:Qwen2Config",
    model_class="transformers:Qwen2ForCausalLM",
    layer=LayerClasses(attention="Qwen2Attention", mlp="Qwen2MLP", norm="Qwen2RMSNorm"),
    fused_ops=frozenset({"rms_norm", "silu_mul"}),
    fp8_attention=True,
    tool_call_format="hermes",
    gguf_architecture="qwen2",
)
