"""The calibration's forwards: one prefill keeping the last positions' logits and its block
density, prompts grouped into batches of a token budget, the time guard, and a setting's tail
metrics."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch

from kernels.config import SparseConfig

from .metrics import Comparison, summarize
from .settings import LAST


class OutOfTime(Exception):
    """``--max-seconds`` reached: the run stops measuring and selects from what it has."""


def density_counts(runner, rids: Sequence[str], num_layers: int) -> tuple[int, int]:
    """Selected and causal tile pairs of the latest prefill over *all* layers: layers that built
    no index (dense on the reference backend) count as fully selected."""
    from ..attention import causal_tile_pairs

    plans = runner.last_state.plans
    plan = next(iter(plans.values()))[0]
    per_layer = [plan.num_kv_heads * n for n in causal_tile_pairs(plan)]
    counts = runner.index_tile_counts()
    sel = tot = 0
    for b, rid in enumerate(rids):
        s, c = counts.get(rid, (0, 0))
        counted = c // per_layer[b] if per_layer[b] else num_layers
        sel += s + per_layer[b] * (num_layers - counted)
        tot += per_layer[b] * num_layers
    return sel, tot


def tail_logits(runner, windows: Sequence[Sequence[int]], config: SparseConfig, num_layers: int,
                 tail: int) -> tuple[list[torch.Tensor], tuple[int, int]]:
    """One forward over ``windows``: each window's logits of its last ``tail`` positions, and the
    forward's density counts."""
    from ..runner import PrefillItem

    rids = [f"calib-{i}" for i in range(len(windows))]
    held: list[str] = []
    try:
        for rid, w in zip(rids, windows):
            runner.pool.reserve(rid, len(w))
            held.append(rid)
        _, kept = runner.prefill_keeping([PrefillItem(r, list(w)) for r, w in zip(rids, windows)],
                                         keep_all=[True] * len(windows), sparse_config=config)
        tails = [kept[i][-tail:].clone() for i in range(len(windows))]
        del kept
        counts = density_counts(runner, rids, num_layers)
    finally:
        for rid in held:
            runner.pool.release(rid)
    return tails, counts


def token_batches(sizes: Sequence[int], batch_tokens: int) -> list[list[int]]:
    """Indices of items of ``sizes`` tokens in consecutive groups of at most ``batch_tokens``
    tokens (one item per group at least)."""
    out, cur, used = [], [], 0
    for i, n in enumerate(sizes):
        if cur and used + n > batch_tokens:
            out.append(cur)
            cur, used = [], 0
        cur.append(i)
        used += n
    if cur:
        out.append(cur)
    return out


class Clock:
    def __init__(self, max_seconds: float | None, log: Callable[[str], None]) -> None:
        self.t0 = time.perf_counter()
        self.max_seconds = max_seconds
        self.log = log
        self.forwards = 0

    @property
    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def tick(self, n: int = 1) -> None:
        self.forwards += n
        if self.max_seconds is not None and self.elapsed > self.max_seconds:
            raise OutOfTime(f"--max-seconds {self.max_seconds:g} reached after {self.elapsed:.0f} s")


def tail_summary(comps: Sequence[Comparison], tiles: Sequence[int]) -> dict:
    """One setting's tail comparisons with dense and its selected / causal tile pairs, as a row's metrics."""
    full = summarize(comps)
    last = summarize([c.tail(LAST) for c in comps])
    return {"density": tiles[0] / tiles[1] if tiles[1] else 1.0,
            "kl_last256": full["kl_mean"], "kl_last256_max": full["kl_max"],
            "kl_last8": last["kl_mean"], "kl_last8_max": last["kl_max"],
            "top1_last256": full["top1_agreement"], "ppl_dense_last256": full["ppl_dense"],
            "ppl_last256": full["ppl"]}


__all__ = ["Clock", "OutOfTime", "token_batches", "density_counts", "tail_logits", "tail_summary"]
