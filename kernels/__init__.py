"""FlashPrefill V2 block-sparse prefill attention: config, plan, index stage, attention.

Public API (see README and docs/SEMANTICS.md):
- ``SparseConfig``: the operator's options.
- ``plan_prefill``: validate batch metadata once per batch (one host sync).
- ``build_index`` / ``sparse_prefill``: the paged varlen operator.
- ``sparse_attention``: the contiguous ``[B, L, H, d]`` convenience call.
- ``paged_decode``: dense paged decode (one new token per sequence), PackGQA + split-KV.
This package never imports Ray.
"""

from ._lazy import lazy_names
from .config import KV_TILE, Q_TILE, SparseConfig

# The operator's names load their modules (and torch) on first use (PEP 562): the ingress
# imports ``kernels.config`` for SparseConfig and never loads torch (tests/test_ingress_imports.py).
_LAZY = {
    "paged_decode": ".decode",
    "BlockMeans": ".index",
    "SparseIndex": ".index",
    "build_index": ".ops",
    "plan_prefill": ".ops",
    "sparse_attention": ".ops",
    "sparse_prefill": ".ops",
    "PrefillPlan": ".plan",
}

__all__ = [
    "KV_TILE",
    "Q_TILE",
    "SparseConfig",
    "BlockMeans",
    "SparseIndex",
    "PrefillPlan",
    "plan_prefill",
    "build_index",
    "sparse_prefill",
    "sparse_attention",
    "paged_decode",
]

__getattr__, __dir__ = lazy_names(__name__, _LAZY)
