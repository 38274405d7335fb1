"""The option names from before ``ServiceConfig``'s sections, and options that moved section.

Both are accepted wherever options enter (``serving.option_tree.OptionTree`` resolves them) and
listed in docs/OPTIONS.md; a name here that no longer names an option fails at import.
"""

OPTION_ALIASES: dict[str, str] = {
    # the flat ServiceConfig field names before the sections -> their dotted paths
    "model": "model.model",  # a string; a mapping under "model" is the section
    "served_model_name": "model.served_model_name",
    "device": "model.device",
    "dtype": "model.dtype",
    "weight_dtype": "model.weight_dtype",
    "seed": "model.seed",
    "page_size": "kv.page_size",
    "kv_cache_dtype": "kv.cache_dtype",
    "kv_scale_margin": "kv.scale_margin",
    "prefill_kv_pages": "kv.prefill_pages",
    "decode_kv_pages": "kv.decode_pages",
    "alpha": "sparse.alpha",
    "block_size": "sparse.block_size",
    "sink_tokens": "sparse.sink_tokens",
    "window_tokens": "sparse.window_tokens",
    "dense_below": "sparse.dense_below",
    "expected_density": "sparse.expected_density",
    "max_batch_tokens": "prefill.max_batch_tokens",
    "prefill_chunk_tokens": "prefill.chunk_tokens",
    "batch_wait_ms": "prefill.batch_wait_ms",
    "max_queued_prefill_tokens": "prefill.max_queued_tokens",
    "prefill_schedule": "prefill.schedule",
    "prefill_max_wait_s": "prefill.max_wait_s",
    "prefix_caching": "prefill.prefix_caching",
    "max_running": "decode.max_running",
    "cuda_graphs": "decode.cuda_graphs",
    "adopt_wait_s": "decode.adopt_wait_s",
    "prefill_tensor_parallel_size": "prefill.tensor_parallel_size",
    "decode_tensor_parallel_size": "decode.tensor_parallel_size",
    "transport": "transfer.transport",
    "transfer_retries": "transfer.retries",
    "lease_timeout_s": "transfer.lease_timeout_s",
    "max_model_len": "model.max_model_len",
    "default_max_tokens": "ingress.default_max_tokens",
    "max_request_bytes": "ingress.max_request_bytes",
    "retry_after_s": "ingress.retry_after_s",
    "decode_resumes": "ingress.decode_resumes",
    "debug_routing": "ingress.debug_routing",
    "auth_token": "ingress.auth_token",
    "auth_token_env": "ingress.auth_token_env",
    "fused_ops": "runtime.fused_ops",
    "torch_threads": "runtime.torch_threads",
}

MOVED_OPTIONS: dict[str, str] = {
    # dotted paths of options that moved to another section -> where they are now
    "ingress.max_model_len": "model.max_model_len",  # a property of the model (its context), not of the ingress
}

__all__ = ["MOVED_OPTIONS", "OPTION_ALIASES"]
