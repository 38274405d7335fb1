"""The structured benchmark model (model_executor/structured_model.py), tiny configuration on CPU."""

import math

import pytest
import torch

from evals.structured_model import (
    build_structured_llama, haystack_ids, head_type, llama31_8b_spec, llama_config,
    measure_density, tiny_spec,
)
from kernels.config import SparseConfig

SMALL = SparseConfig(block_size=64, sink_tokens=64, window_tokens=128)


@pytest.fixture(scope="module")
def structured_tiny():
    spec = tiny_spec()
    return spec, build_structured_llama(spec, device="cpu", dtype=torch.float32)


def test_8b_config_has_llama31_shape():
    cfg = llama_config(llama31_8b_spec())
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads) == (32, 4096, 32, 8)
    assert (cfg.head_dim, cfg.intermediate_size, cfg.vocab_size) == (128, 14336, 128256)
    rope = cfg.rope_parameters
    assert rope["rope_theta"] == 500000.0 and rope["rope_type"] == "llama3"
    assert llama_config(llama31_8b_spec(num_layers=2)).num_hidden_layers == 2


def _qk(model, ids, layer=0):
    """Post-RoPE q/k of one layer, computed from the model's own modules."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    inner = model.model
    x = inner.embed_tokens(ids)
    pos = torch.arange(ids.shape[1])[None]
    cos, sin = inner.rotary_emb(x, pos)
    attn = inner.layers[layer].self_attn
    h = inner.layers[layer].input_layernorm(x)
    d = attn.head_dim
    q = attn.q_proj(h).view(1, -1, model.config.num_attention_heads, d).transpose(1, 2)
    k = attn.k_proj(h).view(1, -1, model.config.num_key_value_heads, d).transpose(1, 2)
    return apply_rotary_pos_emb(q, k, cos, sin)


def test_heads_show_sink_locality_and_retrieval(structured_tiny):
    spec, model = structured_tiny
    ids = haystack_ids(spec, 1024, seed=1)
    ids[0, 700] = ids[0, 1023]  # an earlier copy of the last token, far outside the bands
    with torch.no_grad():
        q, k = _qk(model, ids)
    g = spec.num_attention_heads // spec.num_key_value_heads
    scale = 1 / math.sqrt(spec.head_dim)
    for kv in range(spec.num_key_value_heads):
        s = scale * q[0, kv * g] @ k[0, kv].T  # [L, L] logits of one query head
        last = s[1023]
        recent = last[1000:1023].mean()
        far = last[200:600].mean()
        assert last[0] > recent + 5  # sink: BOS stands out for every head
        assert recent > far + 2  # locality: near keys score higher than far ones
        if head_type(spec, 0, kv).retrieval:
            assert last[700] > far + 4  # retrieval: the same token matches far away
        else:
            assert last[700] < far + 3


def test_density_below_one_and_decreasing(structured_tiny):
    spec, model = structured_tiny
    per_len = {}
    for length in (1024, 2048, 4096):
        recs = measure_density(model, haystack_ids(spec, length, seed=0), SMALL)
        assert [r.layer for r in recs] == [0, 1]
        per_len[length] = sum(r.density for r in recs) / len(recs)
        print(f"tiny model, block 64: L={length} density {per_len[length]:.3f}",
              [round(x, 3) for r in recs for x in r.per_kv_head])
    assert per_len[1024] < 0.9
    assert per_len[1024] > per_len[2048] > per_len[4096] > 0.0
    # more than the forced sink + window alone would keep at 4K (~0.107)
    assert per_len[4096] > 0.12


def test_measure_density_leaves_model_unchanged(structured_tiny):
    spec, model = structured_tiny
    ids = haystack_ids(spec, 256, seed=3)
    before = model.config._attn_implementation
    with torch.no_grad():
        ref = model.model(input_ids=ids, use_cache=False).last_hidden_state
    recs = measure_density(model, ids, SparseConfig(alpha=0.0, **{k: getattr(SMALL, k) for k in ("block_size", "sink_tokens", "window_tokens")}), layers=1)
    assert len(recs) == 1 and recs[0].density == 1.0
    assert model.config._attn_implementation == before
    assert len(model.model.layers) == spec.num_layers
    with torch.no_grad():
        again = model.model(input_ids=ids, use_cache=False).last_hidden_state
    torch.testing.assert_close(ref, again)
