"""Which KV heads a transfer between two TP groups moves from which prefill rank to which decode
rank (the head split of each group: ``kv_cache.heads.HeadLayout``).

A transfer from a prefill group of ``P`` ranks to a decode group of ``D`` ranks (any sizes) is a
list of :class:`HeadRoute`: for every decode rank and every KV head it holds, the prefill rank
that sends it (a replicated head is sent by one of its holders, spread over the decode ranks) and
the head's position in both pools. :func:`transfer_routes` groups them by (source, destination)
pair: each pair is one frame of whole pages restricted to those heads.
"""

from __future__ import annotations

from dataclasses import dataclass

from kv_cache.heads import HeadLayout


@dataclass(frozen=True)
class HeadRoute:
    """One KV head moving from ``src_rank`` (its local head ``src_local``) to ``dst_rank``
    (``dst_local``)."""

    kv_head: int
    src_rank: int
    src_local: int
    dst_rank: int
    dst_local: int


def head_routes(src: HeadLayout, dst: HeadLayout) -> list[HeadRoute]:
    """Every KV head every destination rank needs, with the source rank that sends it. A head
    held by several source ranks is sent by holder ``dst_rank % holders`` (spreading the load)."""
    if not isinstance(src, HeadLayout) or not isinstance(dst, HeadLayout):
        raise ValueError("src, dst: expected HeadLayout objects")
    if (src.num_q_heads, src.num_kv_heads) != (dst.num_q_heads, dst.num_kv_heads):
        raise ValueError(f"dst: expected the source model's heads {src.num_q_heads}/{src.num_kv_heads} "
                         f"(query/KV), got {dst.num_q_heads}/{dst.num_kv_heads}")
    routes = []
    for d in range(dst.tp_size):
        for j, h in enumerate(dst.kv_heads(d)):
            holders = src.holders(h)
            s = holders[d % len(holders)]
            routes.append(HeadRoute(h, s, src.kv_heads(s).index(h), d, j))
    return routes


def transfer_routes(src: HeadLayout, dst: HeadLayout) -> dict[tuple[int, int], list[HeadRoute]]:
    """:func:`head_routes` grouped by ``(src_rank, dst_rank)``, heads in destination order."""
    out: dict[tuple[int, int], list[HeadRoute]] = {}
    for r in head_routes(src, dst):
        out.setdefault((r.src_rank, r.dst_rank), []).append(r)
    return out
