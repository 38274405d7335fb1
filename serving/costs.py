"""What the ingress, the routers and the prefill replicas agree on about a call's cost.

Prefill cost of a prompt of ``L`` tokens of which ``c`` are already cached:

    cost = token_weight * (L - c)  +  (L - c) * (c + L) / 2 * density(L)

The first term is the per-token work (projections, MLP); the second counts the causal
query-key pairs the new tokens attend to (exactly ``(L-c)(L+c+1)/2``, rounded), scaled by
the expected fraction FlashPrefill V2 computes (``1`` below ``dense_below``, where the
service runs dense attention). The unit is "token-equivalents": only ratios matter.

A routing hint is the plain dict every routed call carries as its ``routing`` keyword: the
call's cost, the KV pages it needs, an optional pinned replica and prefix digests
(:func:`prefix_hint`). The request routers that read it are ``router.scheduling``'s.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kernels.config import Q_TILE

ROUTING_KWARG = "routing"  # keyword argument every routed call carries: a RoutingHint dict
PREFIX_STRIDE = 8  # pages between two prefix digests in a routing hint (512 tokens at page 64)
PREFIX_INDEX_ENTRIES = 200_000  # digests a prefill router remembers (LRU)


def prefix_reuse_granule(page_size: int, *, sparse: bool) -> int:
    """Tokens a prefix-cache hit reuses at a time: whole pages; with sparse prefill whole query
    tiles too (prefill_worker/engine.py's module doc says why). The router estimates a hit's
    saving with it, the prefill engine reuses that much."""
    return math.lcm(page_size, Q_TILE) if sparse else page_size


@dataclass(frozen=True)
class PrefillCostModel:
    token_weight: float = 256.0
    dense_below: int = 1024
    expected_density: float = 0.3
    tensor_parallel_size: int = 1
    allreduce_weight: float = 16.0

    def __post_init__(self) -> None:
        if self.token_weight < 0 or not 0.0 <= self.expected_density <= 1.0 or self.dense_below < 0:
            raise ValueError(
                "PrefillCostModel: expected token_weight >= 0, expected_density in [0, 1], dense_below >= 0; "
                f"got {self.token_weight}, {self.expected_density}, {self.dense_below}"
            )
        if isinstance(self.tensor_parallel_size, bool) or not isinstance(self.tensor_parallel_size, int) \
                or self.tensor_parallel_size < 1 or self.allreduce_weight < 0:
            raise ValueError("tensor_parallel_size, allreduce_weight: expected an int >= 1 and a weight >= 0, got "
                             f"{self.tensor_parallel_size!r}, {self.allreduce_weight!r}")

    @classmethod
    def for_config(cls, config: Any) -> "PrefillCostModel":
        """The cost model of a ``ServiceConfig``'s prefill replicas."""
        return cls(dense_below=config.sparse.dense_below, expected_density=config.sparse.expected_density,
                   tensor_parallel_size=config.prefill.tensor_parallel_size)

    def density(self, prompt_len: int, alpha: float | None = None) -> float:
        """``alpha``: a request's own sparsity (0: dense, so density 1); None: the service's."""
        if alpha == 0 or prompt_len < self.dense_below:
            return 1.0
        return self.expected_density

    def cost(self, prompt_len: int, cached_prefix: int = 0, *, alpha: float | None = None) -> float:
        if prompt_len < 0 or not 0 <= cached_prefix <= prompt_len:
            raise ValueError(f"cached_prefix: expected 0 <= cached_prefix <= prompt_len ({prompt_len}), got {cached_prefix}")
        new = prompt_len - cached_prefix
        pairs = new * (cached_prefix + prompt_len + 1) / 2.0
        work = self.token_weight * new + pairs * self.density(prompt_len, alpha)
        n = self.tensor_parallel_size
        if n == 1:
            return work
        return work / n + self.allreduce_weight * new * (n - 1) / n


# How long a call pinned to a replica this router does not (yet) list waits for it, before any
# replica may take the call (to refuse it at once: see PrefillRequestRouter).
PIN_GRACE_S = 2.0


def routing_hint(*, cost: float = 0.0, pages: int = 0, replica: str | None = None,
                 prefix: Sequence[tuple[str, float]] | None = None) -> dict:
    """What the ingress tells the routers about a call (a plain dict: it travels to the replica
    as a keyword argument, which ignores it). ``replica``: pin the call to that replica id.
    ``prefix``: ``(digest, cost if cached up to there)`` pairs, shortest prefix first
    (:func:`prefix_hint`)."""
    hint: dict[str, Any] = {"cost": float(cost), "pages": int(pages)}
    if replica is not None:
        hint["replica"] = str(replica)
    if prefix:
        hint["prefix"] = [[str(d), float(c)] for d, c in prefix]
    return hint


def prefix_hint(token_ids: Sequence[int], page_size: int, cost_model: "PrefillCostModel",
                stride: int = PREFIX_STRIDE, granule: int | None = None) -> list[tuple[str, float]]:
    """The prefix part of a prefill call's routing hint: the digests (``kv_cache.prefix``, 8
    bytes in hex) of full pages 1..``stride``, then of every ``stride``-th page, each with the
    prompt's cost when the prefix up to there is cached: what the prefill engine would reuse,
    whole ``granule``s (default: pages; ``PrefillEngine.reuse_granule``) of all but the last
    token, which it always computes."""
    from kv_cache.prefix import prefix_digests

    n = len(token_ids)
    g = granule or page_size
    digests = prefix_digests(token_ids, page_size)
    pages = [i for i in range(1, len(digests) + 1) if i <= stride or i % stride == 0]
    return [(digests[i - 1][:8].hex(), cost_model.cost(n, min(i * page_size, n - 1) // g * g)) for i in pages]
