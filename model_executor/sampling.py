"""Sampling parameters and a vectorized sampler (greedy, temperature, top-k, top-p, seeds).

Randomness is stateless per token: the draw for token ``i`` of a seeded request comes from a
``torch.Generator`` seeded with ``(seed, i)``. The first token is sampled on a prefill worker
and the rest on a decode worker, so no generator state has to travel between them, and a
seeded request gives the same tokens whatever batch it runs in.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

_SEED_MIX = 0x9E3779B97F4A7C15  # spreads (seed, step) over the generator's 64-bit seed space
_MASK64 = (1 << 64) - 1


@dataclass(frozen=True)
class SamplingParams:
    """Per-request generation options.

    temperature: 0 means greedy (argmax); otherwise logits are divided by it.
    top_k: keep the ``top_k`` most likely tokens; 0 disables.
    top_p: keep the smallest set of tokens whose probability reaches ``top_p``; 1 disables.
    max_new_tokens: tokens to generate, the first (prefill) token included.
    stop_token_ids: generation stops after emitting one of these (it is part of the output).
    seed: makes sampling reproducible; ``None`` draws from torch's default generator.
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    max_new_tokens: int = 16
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, (int, float)):
            raise ValueError(f"temperature: expected a float >= 0, got {self.temperature!r}")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature: expected a finite float >= 0, got {self.temperature!r}")
        _check_int("top_k", self.top_k, minimum=0)
        if isinstance(self.top_p, bool) or not isinstance(self.top_p, (int, float)):
            raise ValueError(f"top_p: expected a float in (0, 1], got {self.top_p!r}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p: expected a float in (0, 1], got {self.top_p!r}")
        _check_int("max_new_tokens", self.max_new_tokens, minimum=1)
        if isinstance(self.stop_token_ids, (str, bytes)) or not isinstance(
            self.stop_token_ids, (tuple, list, frozenset, set)
        ):
            raise ValueError(
                f"stop_token_ids: expected a tuple of non-negative ints, got {self.stop_token_ids!r}"
            )
        for t in self.stop_token_ids:
            if isinstance(t, bool) or not isinstance(t, int) or t < 0:
                raise ValueError(
                    f"stop_token_ids: expected non-negative ints, got {t!r} in {self.stop_token_ids!r}"
                )
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if self.seed is not None:
            _check_int("seed", self.seed, minimum=0)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def _check_int(name: str, value: object, *, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name}: expected an int >= {minimum}, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name}: expected an int >= {minimum}, got {value}")


class Sampler:
    """Samples one token per row of ``logits [B, V]`` with per-row parameters.

    Everything but the per-row uniform draw (one scalar per row, from that row's generator)
    is batched: one sort, one cumulative sum and one search for the whole batch.
    """

    def __init__(self, default_generator: torch.Generator | None = None) -> None:
        # Unseeded requests draw from this generator (torch's global one when None).
        self._default_generator = default_generator

    @staticmethod
    def _generator_for(seed: int, step: int) -> torch.Generator:
        mixed = (seed * _SEED_MIX + step * 0xBF58476D1CE4E5B9 + 1) & _MASK64
        return torch.Generator().manual_seed(mixed >> 1)

    def _uniforms(self, params: Sequence[SamplingParams], steps: Sequence[int]) -> torch.Tensor:
        draws = []
        for p, step in zip(params, steps):
            gen = self._generator_for(p.seed, step) if p.seed is not None else self._default_generator
            draws.append(torch.rand(1, generator=gen, dtype=torch.float64))
        return torch.cat(draws)

    def __call__(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        steps: Sequence[int],
    ) -> torch.Tensor:
        """``logits [B, V]``; ``params`` and ``steps`` (index of the token being sampled in its
        request's output, 0 for the first) per row. Returns int64 token ids ``[B]``."""
        if logits.dim() != 2:
            raise ValueError(f"logits: expected a 2-D tensor [B, V], got shape {tuple(logits.shape)}")
        bsz, vocab = logits.shape
        if len(params) != bsz or len(steps) != bsz:
            raise ValueError(
                f"params: expected {bsz} SamplingParams and steps (one per row), "
                f"got {len(params)} and {len(steps)}"
            )
        if bsz == 0:
            return torch.empty(0, dtype=torch.int64, device=logits.device)
        logits = logits.float()
        greedy_ids = logits.argmax(-1)
        if all(p.greedy for p in params):
            return greedy_ids
        device = logits.device
        temps = torch.tensor(
            [p.temperature if not p.greedy else 1.0 for p in params], dtype=torch.float32, device=device
        )
        top_k = torch.tensor([p.top_k or vocab for p in params], dtype=torch.int64, device=device)
        top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device)

        sorted_logits, order = torch.sort(logits / temps[:, None], dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        rank = torch.arange(vocab, device=device)[None, :]
        # top-p keeps a token if the mass strictly before it is below top_p (the top one always)
        mass_before = probs.cumsum(-1) - probs
        keep = (rank < top_k[:, None]) & (mass_before < top_p[:, None])
        probs = torch.where(keep, probs, torch.zeros_like(probs))
        cdf = probs.cumsum(-1)
        # u in (0, 1] so the leftmost cdf >= u * total is a token with non-zero probability
        u = (1.0 - self._uniforms(params, steps)).to(device=device, dtype=torch.float32)
        target = (u * cdf[:, -1]).unsqueeze(-1)
        pick = torch.searchsorted(cdf, target).clamp_(max=vocab - 1)
        sampled = order.gather(-1, pick).squeeze(-1)
        greedy_rows = torch.tensor([p.greedy for p in params], device=device)
        return torch.where(greedy_rows, greedy_ids, sampled)
