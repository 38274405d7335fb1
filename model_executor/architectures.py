"""The model families the runner executes (transformers ``model_type`` names, which are also the
GGUF ``general.architecture`` names): their attention, RMSNorm and gated MLP are the ones
``model_executor.fused`` and the FP8/TP loaders know. A leaf module, so that every loader can
check a model's family before reading its weights."""

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3")
