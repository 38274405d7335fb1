"""The built-in structured models' shapes and head bands (``model_executor/structured_model.py``
builds their weights): plain data, no torch, so the ingress resolves a structured model's
context and type without loading torch."""

from __future__ import annotations

from dataclasses import dataclass, field

LLAMA3_BOS = 128000


@dataclass(frozen=True)
class HeadBand:
    """A head type: RoPE pairs whose wavelength (tokens) is in ``[lo, hi]`` carry locality."""

    name: str
    lo: float
    hi: float
    retrieval: bool = False


DEFAULT_BANDS = (
    HeadBand("local", 1900.0, 81_000.0),
    HeadBand("retrieval", 2800.0, 100_000.0, retrieval=True),
    HeadBand("broad", 4500.0, 122_000.0),
)


@dataclass(frozen=True)
class StructuredModelSpec:
    num_layers: int = 32
    hidden_size: int = 4096
    num_attention_heads: int = 32
    num_key_value_heads: int = 8
    head_dim: int = 128
    intermediate_size: int = 14336
    vocab_size: int = 128256
    rope_theta: float = 500000.0
    rope_scaling: dict = field(default_factory=lambda: {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    })
    max_position_embeddings: int = 131072
    bos_token_id: int = LLAMA3_BOS
    bands: tuple[HeadBand, ...] = DEFAULT_BANDS
    band_scale: float = 1.0  # multiplies every band's wavelengths
    locality_logit: float = 4.0
    sink_logit: float = 10.0
    match_logit: float = 6.0
    content_noise: float = 0.5
    content_pairs: int = 11
    residual_scale: float = 0.05
    seed: int = 0


def llama31_8b_spec(num_layers: int = 32, **overrides) -> StructuredModelSpec:
    return StructuredModelSpec(num_layers=num_layers, **overrides)


QWEN_ENDOFTEXT = 151643


def qwen25_32b_spec(num_layers: int = 64, **overrides) -> StructuredModelSpec:
    """Qwen2.5-32B's shape on the Llama architecture (no q/k/v bias): 64 layers, hidden 5120,
    40/8 heads, d 128, MLP 27648, vocab 152064, RoPE theta 1e6 without scaling, 128K positions
    (Qwen's YaRN range); ``<|endoftext|>`` plays BOS."""
    base = dict(num_layers=num_layers, hidden_size=5120, num_attention_heads=40, num_key_value_heads=8,
                head_dim=128, intermediate_size=27648, vocab_size=152064, rope_theta=1_000_000.0,
                rope_scaling={}, max_position_embeddings=131072, bos_token_id=QWEN_ENDOFTEXT)
    base.update(overrides)
    return StructuredModelSpec(**base)


def llama31_70b_spec(num_layers: int = 80, **overrides) -> StructuredModelSpec:
    """Llama-3.1-70B's shape: 80 layers, hidden 8192, 64/8 heads, d 128, MLP 28672, vocab 128256,
    RoPE theta 500000 with llama3 scaling (as the 8B)."""
    base = dict(num_layers=num_layers, hidden_size=8192, num_attention_heads=64, num_key_value_heads=8,
                head_dim=128, intermediate_size=28672)
    base.update(overrides)
    return StructuredModelSpec(**base)


def tiny_spec(**overrides) -> StructuredModelSpec:
    """2 layers, hidden 512, 8/2 heads, d 64, bands / 4 (for block 64 at 1K..4K on CPU)."""
    base = dict(num_layers=2, hidden_size=512, num_attention_heads=8, num_key_value_heads=2,
                head_dim=64, intermediate_size=1024, vocab_size=4096, bos_token_id=1,
                band_scale=1 / 4, content_pairs=5, max_position_embeddings=16384)
    base.update(overrides)
    return StructuredModelSpec(**base)


def llama_config(spec: StructuredModelSpec):
    from transformers import LlamaConfig

    rope = dict(spec.rope_scaling)
    rope["rope_theta"] = spec.rope_theta
    rope.setdefault("rope_type", "default")
    return LlamaConfig(
        vocab_size=spec.vocab_size, hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size, num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_attention_heads, num_key_value_heads=spec.num_key_value_heads,
        head_dim=spec.head_dim, max_position_embeddings=spec.max_position_embeddings,
        rms_norm_eps=1e-5, rope_parameters=rope, bos_token_id=spec.bos_token_id,
        eos_token_id=None, pad_token_id=None, tie_word_embeddings=False,
    )


def head_type(spec: StructuredModelSpec, layer: int, kv_head: int) -> HeadBand:
    return spec.bands[(kv_head + layer) % len(spec.bands)]
