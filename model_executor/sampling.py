"""Sampling parameters and a vectorized sampler (greedy, temperature, top-k, top-p, seeds,
penalties, logit bias, min_tokens, logprobs, and the hook for guided decoding).

The order a row's logits go through (``Sampler.sample``):
1. ``guide.fill_mask`` (guided requests only: disallowed tokens to -inf);
2. ``min_tokens``: the stop tokens to -inf while fewer than ``min_tokens`` tokens are out;
3. ``logit_bias`` added;
4. ``repetition_penalty`` (over the tokens generated so far: a positive logit divided by
   it, a negative one multiplied);
5. ``frequency_penalty * count + presence_penalty * (count > 0)`` subtracted (OpenAI's);
6. divided by ``temperature`` (greedy: not);
7. logprobs are taken here: ``log_softmax`` of these logits, the distribution sampled from
   before top-k / top-p truncation;
8. top-k, top-p and min-p (each a mask over the same temperature-scaled distribution, so their
   order does not matter), then the draw (greedy: argmax of step 6).
Rows with none of 1-5 and no logprobs take the plain path: no per-row work for them.

Randomness is stateless per token: the draw for token ``i`` of a seeded request comes from a
``torch.Generator`` seeded with ``(seed, i)``. The first token is sampled on a prefill worker
and the rest on a decode worker, so no generator state has to travel between them, and a
seeded request gives the same tokens whatever batch it runs in.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .sampling_params import SamplingParams, TokenLogprob  # noqa: F401 - sampling's public names

_SEED_MIX = 0x9E3779B97F4A7C15  # spreads (seed, step) over the generator's 64-bit seed space
_MASK64 = (1 << 64) - 1


@dataclass(frozen=True, slots=True)
class SampleOutput:
    tokens: torch.Tensor  # int64 [B]
    logprobs: list[TokenLogprob | None]  # per row; None where the row asked for none


def prompt_logprobs(logits: torch.Tensor, targets: Sequence[int], top: int) -> list[TokenLogprob]:
    """``logits [n, V]`` of consecutive prompt positions; ``targets``: the token that follows
    each (``len(targets) <= n``: the last position of a prompt predicts no prompt token).
    The logprob of each target under ``log_softmax`` of its row, with the ``top`` best."""
    m = len(targets)
    if m == 0:
        return []
    lp = torch.log_softmax(logits[:m].float(), dim=-1)
    tgt = torch.as_tensor(list(targets), dtype=torch.int64, device=lp.device)
    chosen = lp.gather(-1, tgt[:, None]).squeeze(-1).tolist()
    k = min(top, lp.shape[-1])
    if k:
        top_v, top_i = lp.topk(k, dim=-1)
        tops = [tuple(zip(i, v)) for i, v in zip(top_i.tolist(), top_v.tolist())]
    else:
        tops = [()] * m
    return [TokenLogprob(int(t), float(c), tp) for t, c, tp in zip(targets, chosen, tops)]


def make_guide(params: SamplingParams, tokenizer: object) -> object | None:
    """The structured-output guide of a request (None when ``params.guided`` is None): built
    once per request by the engine that samples it, stepped with ``fill_mask`` / ``accept``."""
    if params.guided is None:
        return None
    try:
        from model_executor.grammar import compile_guide
    except ImportError as exc:
        raise ValueError("guided: structured output needs model_executor.grammar, which this build lacks") from exc
    if tokenizer is None:
        raise ValueError("guided: structured output needs the model's tokenizer; this engine has none")
    return compile_guide(params.guided, tokenizer)


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
        histories: Sequence[Sequence[int]] | None = None,
    ) -> torch.Tensor:
        """The tokens of :meth:`sample`, int64 ``[B]``."""
        return self.sample(logits, params, steps, histories).tokens

    def sample(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        steps: Sequence[int],
        histories: Sequence[Sequence[int]] | None = None,
        guides: Sequence[object | None] | None = None,
    ) -> SampleOutput:
        """``logits [B, V]``; ``params`` and ``steps`` (index of the token being sampled in its
        request's output, 0 for the first) per row; ``histories``: the tokens each row's request
        generated so far (penalties; None: none yet); ``guides``: each row's structured-output
        guide or None. ``logits`` is not modified."""
        if logits.dim() != 2:
            raise ValueError(f"logits: expected a 2-D tensor [B, V], got shape {tuple(logits.shape)}")
        bsz, vocab = logits.shape
        if len(params) != bsz or len(steps) != bsz:
            raise ValueError(
                f"params: expected {bsz} SamplingParams and steps (one per row), "
                f"got {len(params)} and {len(steps)}"
            )
        for name, seq in (("histories", histories), ("guides", guides)):
            if seq is not None and len(seq) != bsz:
                raise ValueError(f"{name}: expected one entry per row ({bsz}), got {len(seq)}")
        if bsz == 0:
            return SampleOutput(torch.empty(0, dtype=torch.int64, device=logits.device), [])
        special = [i for i, p in enumerate(params) if not p.plain]
        logits = logits.float()
        if special:
            logits = logits.clone()  # processed in place, row by row
            for i in special:
                self._process(logits[i], params[i], steps[i], histories[i] if histories is not None else (),
                              guides[i] if guides is not None else None)
        tokens = self._draw(logits, params, steps)
        logprobs: list[TokenLogprob | None] = [None] * bsz
        want = [i for i in special if params[i].logprobs is not None]
        if want:
            temps = torch.tensor([params[i].temperature if not params[i].greedy else 1.0 for i in want],
                                 dtype=torch.float32, device=logits.device)
            lp = torch.log_softmax(logits[want] / temps[:, None], dim=-1)
            chosen = lp.gather(-1, tokens[want][:, None]).squeeze(-1).tolist()
            k_max = min(max(params[i].logprobs for i in want), vocab)
            top_v, top_i = lp.topk(k_max, dim=-1) if k_max else (lp[:, :0], lp[:, :0].long())
            top_v, top_i = top_v.tolist(), top_i.tolist()
            picked = tokens[want].tolist()
            for r, i in enumerate(want):
                k = min(params[i].logprobs, vocab)
                logprobs[i] = TokenLogprob(int(picked[r]), float(chosen[r]),
                                           tuple(zip(top_i[r][:k], top_v[r][:k])))
        return SampleOutput(tokens, logprobs)

    @staticmethod
    def _process(row: torch.Tensor, p: SamplingParams, step: int, history: Sequence[int], guide: object | None) -> None:
        """Steps 1-5 of the module docstring, in place on one row ``[V]``."""
        vocab = row.shape[0]
        if guide is not None:
            guide.fill_mask(row)
        if step < p.min_tokens and p.stop_token_ids:
            row[[t for t in p.stop_token_ids if t < vocab]] = float("-inf")
        if p.logit_bias:
            ids = [t for t, _ in p.logit_bias]
            if max(ids) >= vocab:
                raise ValueError(f"logit_bias: token id {max(ids)} is outside the vocabulary [0, {vocab})")
            row[ids] += torch.tensor([b for _, b in p.logit_bias], dtype=row.dtype, device=row.device)
        if p.penalized and len(history):
            counts = torch.bincount(torch.as_tensor(list(history), dtype=torch.int64, device=row.device),
                                    minlength=vocab)[:vocab].to(row.dtype)
            seen = counts > 0
            if p.repetition_penalty != 1:
                penalized = torch.where(row > 0, row / p.repetition_penalty, row * p.repetition_penalty)
                row.copy_(torch.where(seen, penalized, row))
            row -= p.frequency_penalty * counts + p.presence_penalty * seen.to(row.dtype)

    @staticmethod
    def filtered_probs(logits: torch.Tensor, params: Sequence[SamplingParams]) -> tuple[torch.Tensor, torch.Tensor]:
        """``(probs, order)``: per row, the temperature-scaled distribution sorted most likely
        first (``order``: the token ids), with the tokens top-k, top-p and min-p drop set to 0
        (not renormalized). Greedy rows are scaled by 1."""
        bsz, vocab = logits.shape
        device = logits.device
        temps = torch.tensor(
            [p.temperature if not p.greedy else 1.0 for p in params], dtype=torch.float32, device=device
        )
        top_k = torch.tensor([p.top_k or vocab for p in params], dtype=torch.int64, device=device)
        top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device)
        min_p = torch.tensor([p.min_p for p in params], dtype=torch.float32, device=device)

        sorted_logits, order = torch.sort(logits.float() / temps[:, None], dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        rank = torch.arange(vocab, device=device)[None, :]
        # top-p keeps a token if the mass strictly before it is below top_p (the top one always)
        mass_before = probs.cumsum(-1) - probs
        keep = (rank < top_k[:, None]) & (mass_before < top_p[:, None])
        keep &= probs >= min_p[:, None] * probs[:, :1]  # the top token always passes (min_p <= 1)
        return torch.where(keep, probs, torch.zeros_like(probs)), order

    def _draw(self, logits: torch.Tensor, params: Sequence[SamplingParams], steps: Sequence[int]) -> torch.Tensor:
        bsz, vocab = logits.shape
        greedy_ids = logits.argmax(-1)
        if all(p.greedy for p in params):
            return greedy_ids
        device = logits.device
        probs, order = self.filtered_probs(logits, params)
        cdf = probs.cumsum(-1)
        # u in (0, 1] so the leftmost cdf >= u * total is a token with non-zero probability
        u = (1.0 - self._uniforms(params, steps)).to(device=device, dtype=torch.float32)
        target = (u * cdf[:, -1]).unsqueeze(-1)
        pick = torch.searchsorted(cdf, target).clamp_(max=vocab - 1)
        sampled = order.gather(-1, pick).squeeze(-1)
        greedy_rows = torch.tensor([p.greedy for p in params], device=device)
        return torch.where(greedy_rows, greedy_ids, sampled)
