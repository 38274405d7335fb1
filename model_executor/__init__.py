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

from kernels._lazy import lazy_names

# Each name loads its module (and torch) on first use (PEP 562): the ingress imports the
# torch-free modules (``model_info``, ``sampling_params``) and never loads torch
# (tests/test_ingress_imports.py).
_LAZY = {
    **dict.fromkeys(("ATTENTION_NAME", "BATCH_KWARG", "ForwardBatch", "ForwardMode", "register_attention"), ".attention"),
    **dict.fromkeys(("BUILTIN_MODELS", "BUILTIN_SMOLLM2", "DEFAULT_MODEL", "BUILTIN_STRUCTURED_8B",
                     "BUILTIN_STRUCTURED_TINY", "BUILTIN_TINY", "load_tokenizer"), ".model_info"),
    **dict.fromkeys(("LoadedModel", "build_structured_model", "build_tiny_model", "load_model", "load_model_dir"),
                    ".loading"),
    "WEIGHT_DTYPES": ".model_info",
    **dict.fromkeys(("Fp8Linear", "quantize_model"), ".fp8_linear"),
    **dict.fromkeys(("ModelRunner", "PrefillItem"), ".runner"),
    "Sampler": ".sampling",
    "SamplingParams": ".sampling_params",
    **dict.fromkeys(("ByteTokenizer", "HFTokenizer", "IdTokenizer"), ".tokenizer"),
}

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

__getattr__, __dir__ = lazy_names(__name__, _LAZY)
