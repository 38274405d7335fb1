"""The built-in structured models in Qwen2.5-32B and Llama-3.1-70B shapes: configs, bands, and
the memory of a TP=8 shard (the models themselves are built on GPUs only)."""

from __future__ import annotations

import pytest
import torch

from model_executor import parallel
from model_executor.loading import BUILTIN_MODELS, BUILTIN_STRUCTURED_32B, BUILTIN_STRUCTURED_70B, model_shape, structured_spec
from model_executor.structured_model import check_bands, llama_config
from serving.config import ConfigError, ServiceConfig

H200_BYTES = 139 * 2**30  # what the device reports


@pytest.mark.parametrize("name, shape", [
    (BUILTIN_STRUCTURED_32B, dict(num_hidden_layers=64, hidden_size=5120, num_attention_heads=40, num_key_value_heads=8,
                                  head_dim=128, intermediate_size=27648, vocab_size=152064)),
    (BUILTIN_STRUCTURED_70B, dict(num_hidden_layers=80, hidden_size=8192, num_attention_heads=64, num_key_value_heads=8,
                                  head_dim=128, intermediate_size=28672, vocab_size=128256)),
])
def test_configs_have_the_published_shapes_and_usable_bands(name, shape):
    assert name in BUILTIN_MODELS
    cfg = model_shape(name)
    assert {k: getattr(cfg, k) for k in shape} == shape
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    inv_freq = LlamaRotaryEmbedding(llama_config(structured_spec(name))).inv_freq
    bands = check_bands(structured_spec(name), inv_freq)
    assert all(p.numel() >= 2 for p in bands.values())


def test_tp8_shard_of_the_70b_fits_an_h200_and_matches_the_computed_bytes():
    from transformers import LlamaForCausalLM

    cfg = llama_config(structured_spec(BUILTIN_STRUCTURED_70B))
    full = parallel.shard_param_bytes(cfg, 1)
    shard = parallel.shard_param_bytes(cfg, 8)
    assert full > 140e9  # why the 70B needs TP: bf16 weights alone exceed an H200 with room for KV
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    assert sum(p.numel() * 2 for p in model.parameters()) == full
    parallel.shard_model(model, parallel.TensorParallel(3, 8, group=object()))  # meta: no memory, no forward
    held = sum(p.numel() * p.element_size() for p in model.parameters())
    assert held == shard
    # one rank's KV for a 128K prompt: 80 layers x 1 KV head x 128 x (K and V) x 2 bytes per token
    kv = 131072 * 80 * 1 * 128 * 2 * 2
    assert shard + kv < 0.5 * H200_BYTES
    assert model.model.layers[0].self_attn.k_proj.weight.shape == (128, 8192)
    assert model.model.layers[0].mlp.down_proj.weight.shape == (8192, 28672 // 8)


def test_tp_sizes_of_the_big_models():
    ok = ServiceConfig(model={"model": BUILTIN_STRUCTURED_32B}, prefill={"tensor_parallel_size": 8},
                       decode={"tensor_parallel_size": 4})
    assert ok.prefill.tensor_parallel_size == 8
    with pytest.raises(ConfigError, match="prefill.tensor_parallel_size: 16 ranks must divide the model's 40 query heads"):
        ServiceConfig(model={"model": BUILTIN_STRUCTURED_32B}, prefill={"tensor_parallel_size": 16})
    with pytest.raises(ConfigError, match="decode.tensor_parallel_size: 5 ranks must divide the model's 8 KV heads"):
        ServiceConfig(model={"model": BUILTIN_STRUCTURED_32B}, decode={"tensor_parallel_size": 5})
