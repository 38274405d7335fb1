"""kv_cache: the paged KV cache of one replica (see docs/ARCHITECTURE.md). Never imports Ray.

- ``manager``: ``PageManager``, who holds which page: the request table and forks' bookkeeping
  over its ``BlockPool`` (the free list, holder counts, the prefix cache's digest -> page map
  and its eviction); ``PoolExhausted``.
- ``tensors``: ``KVTensors``, the K/V tensors, FP8 descales and quantized writes.
- ``pool``: ``KVPool``, the two together plus the addressing (page tables, slot mappings): what
  the engines, the model runner and the transports hold. ``config``: ``KVPoolConfig``.
- ``prefix``: ``prefix_digests``, the prefix cache's keys (no torch: the ingress computes them).
- ``heads``: ``HeadLayout``, which KV heads each tensor-parallel rank's pool holds.
"""

from kernels._lazy import lazy_names

# Each name loads its module on first use: the ingress imports ``kv_cache.prefix`` (torch-free)
# and never loads torch (tests/test_ingress_imports.py).
_LAZY = {
    **dict.fromkeys(("POOL_DTYPES", "KVPoolConfig"), ".config"),
    **dict.fromkeys(("HeadLayout", "check_tp_size"), ".heads"),
    **dict.fromkeys(("PageManager", "PoolExhausted"), ".manager"),
    "KVPool": ".pool",
    "prefix_digests": ".prefix",
    **dict.fromkeys(("KVTensors", "fp8_scale_from_amax"), ".tensors"),
}

__all__ = [
    "POOL_DTYPES",
    "HeadLayout",
    "KVPool",
    "KVPoolConfig",
    "KVTensors",
    "PageManager",
    "PoolExhausted",
    "check_tp_size",
    "fp8_scale_from_amax",
    "prefix_digests",
]

__getattr__, __dir__ = lazy_names(__name__, _LAZY)
