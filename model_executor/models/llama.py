"""Llama (3.x included): the built-in tiny and structured models, and SmolLM2 (a Llama-arch GGUF).

Its attention is the plain one (projections, rotate-half RoPE, attention, ``o_proj``), so every
fused op fits; its chat templates teach Llama 3's bare-JSON tool calls.
"""

from .spec import ArchitectureSpec, LayerClasses

SPEC = ArchitectureSpec(
    model_type="llama",
    config_class="transformers:LlamaConfig",
    model_class="transformers:LlamaForCausalLM",
    layer=LayerClasses(attention="LlamaAttention", mlp="LlamaMLP", norm="LlamaRMSNorm"),
    fused_ops=frozenset({"rms_norm", "silu_mul", "rotary"}),
    fp8_attention=True,
    tool_call_format="llama3_json",
    gguf_architecture="llama",
)
