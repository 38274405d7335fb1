"""A toy architecture family, added as a product family is: this one file (its transformers
classes and its ``ArchitectureSpec``) plus one registry line (``models.register(SPEC)``, which
tests/test_model_registry.py runs where a product family has its entry in
``model_executor/models/__init__.py``'s ``ARCHITECTURES``). No other file knows it.

It is Llama's math under classes of its own (``ToyAttention``, ``ToyMLP``, ``ToyRMSNorm``: what
the fused and FP8 forwards recognise modules by) and a ``model_type`` transformers has never
heard of, and it declares less than Llama: only its norms fuse, only its attention projections
take FP8 weights, no GGUF; Hermes tool calls.
"""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.models.llama import modeling_llama as llama

from model_executor.models import ArchitectureSpec, LayerClasses

MODEL_TYPE = "toy_llama"


class ToyConfig(LlamaConfig):
    model_type = MODEL_TYPE


class ToyRMSNorm(llama.LlamaRMSNorm):
    pass


class ToyMLP(llama.LlamaMLP):
    pass


class ToyAttention(llama.LlamaAttention):
    pass


class ToyDecoderLayer(llama.LlamaDecoderLayer):
    def __init__(self, config: ToyConfig, layer_idx: int) -> None:
        super().__init__(config, layer_idx)
        self.self_attn = ToyAttention(config, layer_idx)
        self.mlp = ToyMLP(config)
        self.input_layernorm = ToyRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = ToyRMSNorm(config.hidden_size, eps=config.rms_norm_eps)


class ToyForCausalLM(LlamaForCausalLM):
    config_class = ToyConfig

    def __init__(self, config: ToyConfig) -> None:
        super().__init__(config)
        inner = self.model
        inner.layers = torch.nn.ModuleList(ToyDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        inner.norm = ToyRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_init()


SPEC = ArchitectureSpec(
    model_type=MODEL_TYPE,
    config_class="toy_architecture:ToyConfig",
    model_class="toy_architecture:ToyForCausalLM",
    layer=LayerClasses(attention="ToyAttention", mlp="ToyMLP", norm="ToyRMSNorm"),
    fused_ops=frozenset({"rms_norm"}),
    fp8_attention=True,
    tool_call_format="hermes",
    gguf_architecture=None,
    fp8_targets=("q_proj", "k_proj", "v_proj", "o_proj"),
)


def toy_config(**overrides) -> ToyConfig:
    """A CPU-sized config: 2 layers, hidden 128, MLP 256, 4 query and 2 KV heads of head_dim 32."""
    args = dict(vocab_size=300, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=32, max_position_embeddings=4096, initializer_range=0.1,
                tie_word_embeddings=False)
    return ToyConfig(**{**args, **overrides})
