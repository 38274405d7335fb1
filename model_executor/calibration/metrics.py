"""Dense-vs-sparse metrics on next-token distributions: KL, top-1 agreement, perplexity."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

KL_CHUNK = 256  # rows of float64 log-softmax at a time: 256 x 49152 x 8 B = 100 MB


@dataclass
class Comparison:
    """Per scored position: ``kl`` (float64 nats), ``agree`` (argmax equal), ``nll_ref`` and
    ``nll`` (float64, of the target token under the reference and under the compared run)."""

    kl: torch.Tensor
    agree: torch.Tensor
    nll_ref: torch.Tensor
    nll: torch.Tensor

    def tail(self, n: int) -> "Comparison":
        """The last ``n`` positions."""
        return Comparison(self.kl[-n:], self.agree[-n:], self.nll_ref[-n:], self.nll[-n:])


def compare_logits(ref: torch.Tensor, other: torch.Tensor, targets: torch.Tensor,
                   chunk: int = KL_CHUNK) -> Comparison:
    """``KL(softmax(ref) || softmax(other))`` row by row, argmax agreement, and the negative
    log-likelihood of ``targets`` under each; ``ref``/``other`` ``[n, V]``, ``targets`` ``[n]``."""
    if ref.ndim != 2 or ref.shape != other.shape:
        raise ValueError(f"other: expected the shape of ref {tuple(ref.shape)} (2-D), got {tuple(other.shape)}")
    if targets.shape != (ref.shape[0],):
        raise ValueError(f"targets: expected shape ({ref.shape[0]},), got {tuple(targets.shape)}")
    kl, agree, nll_ref, nll = [], [], [], []
    t_all = targets.to(ref.device, torch.int64)
    for r0 in range(0, ref.shape[0], chunk):
        a = torch.log_softmax(ref[r0:r0 + chunk].double(), -1)
        b = torch.log_softmax(other[r0:r0 + chunk].double(), -1)
        t = t_all[r0:r0 + chunk, None]
        kl.append((a.exp() * (a - b)).sum(-1).clamp_min(0.0).cpu())
        agree.append((a.argmax(-1) == b.argmax(-1)).cpu())
        nll_ref.append(-a.gather(-1, t)[:, 0].cpu())
        nll.append(-b.gather(-1, t)[:, 0].cpu())
    cat = lambda xs, dt: torch.cat(xs) if xs else torch.empty(0, dtype=dt)  # noqa: E731
    return Comparison(cat(kl, torch.float64), cat(agree, torch.bool), cat(nll_ref, torch.float64),
                      cat(nll, torch.float64))


def summarize(parts: Sequence[Comparison]) -> dict:
    """Mean / max KL, top-1 agreement and both perplexities over every position of ``parts``."""
    kl = torch.cat([p.kl for p in parts]) if parts else torch.empty(0)
    if kl.numel() == 0:
        raise ValueError("parts: expected at least one scored position")
    agree = torch.cat([p.agree for p in parts])
    nll_ref = torch.cat([p.nll_ref for p in parts])
    nll = torch.cat([p.nll for p in parts])
    return {
        "scored_positions": int(kl.numel()),
        "kl_mean": float(kl.mean()), "kl_max": float(kl.max()),
        "kl_p99": float(torch.quantile(kl, 0.99)) if kl.numel() <= 1 << 24 else None,
        "top1_agreement": float(agree.double().mean()),
        "ppl_dense": math.exp(float(nll_ref.mean())), "ppl": math.exp(float(nll.mean())),
    }
