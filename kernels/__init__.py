"""FlashPrefill V2 block-sparse prefill attention: config, plan, index stage, attention.

Public API (see README and docs/SEMANTICS.md):
- ``SparseConfig``: the operator's options.
- ``plan_prefill``: validate batch metadata once per batch (one host sync).
- ``build_index`` / ``sparse_prefill``: the paged varlen operator.
- ``sparse_attention``: the contiguous ``[B, L, H, d]`` convenience call.
- ``paged_decode``: dense paged decode (one new token per sequence), PackGQA + split-KV.
This package never imports Ray.
"""

from .config import KV_TILE, Q_TILE, SparseConfig
from .decode import paged_decode
from .index import BlockMeans, SparseIndex
from .ops import build_index, plan_prefill, sparse_attention, sparse_prefill
from .plan import PrefillPlan

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
