"""Model execution: transformers models running our attention over our paged KV pool.

The one place model execution lives; the prefill and decode workers both import it.
- ``attention``: the attention function registered with transformers (``fpv2_paged``).
- ``runner.ModelRunner``: packed varlen prefill (chunks welcome) and batched decode.
- ``cuda_graphs``: decode steps replayed from CUDA graphs (``ModelRunner.enable_decode_graphs``).
- ``sampling``: ``SamplingParams`` and the vectorized ``Sampler``.
- ``models``: the model registry, ``model_type`` -> ``ArchitectureSpec`` (one module per family).
- ``loading``: local Hugging Face directories and the built-in models (tiny, structured);
  ``checkpoint``: the safetensors readers (whole, FP8, one TP rank's shard).
- ``tokenizer``: the byte-level tokenizer, the id tokenizer and the HF adapter.
- ``structured_model``: the structured benchmark models (built-in ``builtin:structured-*``).
- ``loading.make_pool``: a KV pool shaped for a loaded model.
- ``fp8_linear``: FP8 (e4m3) weights in the projections (``Fp8Linear``, ``quantize_model``, FP8
  checkpoints through ``load_model``/``load_model_dir``, ``weight_dtype=``).
Prefill and decode in one process (the oracle) is ``router.offline.generate``, above the workers.
This package never imports Ray.
"""

from .attention import ATTENTION_NAME, BATCH_KWARG, ForwardBatch, ForwardMode, register_attention
from .loading import (
    BUILTIN_MODELS,
    BUILTIN_SMOLLM2,
    DEFAULT_MODEL,
    BUILTIN_STRUCTURED_8B,
    BUILTIN_STRUCTURED_TINY,
    BUILTIN_TINY,
    LoadedModel,
    build_structured_model,
    build_tiny_model,
    load_model,
    load_model_dir,
    load_tokenizer,
)
from .fp8_linear import WEIGHT_DTYPES, Fp8Linear, quantize_model
from .runner import ModelRunner, PrefillItem
from .sampling import Sampler, SamplingParams
from .tokenizer import ByteTokenizer, HFTokenizer, IdTokenizer

__all__ = [
    "ATTENTION_NAME",
    "BATCH_KWARG",
    "ForwardBatch",
    "ForwardMode",
    "register_attention",
    "BUILTIN_MODELS",
    "BUILTIN_SMOLLM2",
    "DEFAULT_MODEL",
    "BUILTIN_STRUCTURED_8B",
    "BUILTIN_STRUCTURED_TINY",
    "BUILTIN_TINY",
    "LoadedModel",
    "build_structured_model",
    "build_tiny_model",
    "load_model",
    "load_model_dir",
    "load_tokenizer",
    "WEIGHT_DTYPES",
    "Fp8Linear",
    "quantize_model",
    "ModelRunner",
    "PrefillItem",
    "Sampler",
    "SamplingParams",
    "ByteTokenizer",
    "HFTokenizer",
    "IdTokenizer",
]
