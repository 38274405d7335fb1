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
    min_p: keep the tokens whose probability is at least ``min_p`` times the most likely
    token's (vLLM's); 0 disables.
    max_new_tokens: tokens to generate, the first (prefill) token included.
    stop_token_ids: generation stops after emitting one of these (it is part of the output).
    seed: makes sampling reproducible; ``None`` draws from torch's default generator.
    presence_penalty, frequency_penalty: in [-2, 2], OpenAI's, over the generated tokens.
    repetition_penalty: > 0 (1 disables), over the generated tokens (not the prompt).
    logit_bias: ``(token_id, bias)`` pairs, bias in [-100, 100], added to the logits.
    min_tokens: the stop tokens cannot be sampled before this many tokens are out.
    logprobs: None (none), or how many top alternatives to report with each token's logprob.
    prompt_logprobs: the same for the prompt's tokens (the prefill's raw distribution: the
    model's logits, no temperature, penalties or bias; no prefix-cache reuse for the prompt).
    guided: a structured-output spec (``model_executor.grammar.compile_guide``), or None.
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    max_new_tokens: int = 16
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    guided: dict | None = None
    min_p: float = 0.0

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
        if isinstance(self.min_p, bool) or not isinstance(self.min_p, (int, float)) or not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p: expected a float in [0, 1], got {self.min_p!r}")
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
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not -2.0 <= v <= 2.0:
                raise ValueError(f"{name}: expected a float in [-2, 2], got {v!r}")
        rp = self.repetition_penalty
        if isinstance(rp, bool) or not isinstance(rp, (int, float)) or not (math.isfinite(rp) and rp > 0):
            raise ValueError(f"repetition_penalty: expected a finite float > 0, got {rp!r}")
        if isinstance(self.logit_bias, dict):
            object.__setattr__(self, "logit_bias", tuple(self.logit_bias.items()))
        if not isinstance(self.logit_bias, (tuple, list)):
            raise ValueError(f"logit_bias: expected (token_id, bias) pairs, got {self.logit_bias!r}")
        pairs = []
        for item in self.logit_bias:
            if not (isinstance(item, (tuple, list)) and len(item) == 2):
                raise ValueError(f"logit_bias: expected (token_id, bias) pairs, got {item!r}")
            tok, bias = item
            if isinstance(tok, bool) or not isinstance(tok, int) or tok < 0:
                raise ValueError(f"logit_bias: expected non-negative token ids, got {tok!r}")
            if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not -100.0 <= bias <= 100.0:
                raise ValueError(f"logit_bias: expected a bias in [-100, 100] for token {tok}, got {bias!r}")
            pairs.append((tok, float(bias)))
        object.__setattr__(self, "logit_bias", tuple(pairs))
        _check_int("min_tokens", self.min_tokens, minimum=0)
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, minimum=0)
        if self.prompt_logprobs is not None:
            _check_int("prompt_logprobs", self.prompt_logprobs, minimum=0)
        if self.guided is not None and not isinstance(self.guided, dict):
            raise ValueError(f"guided: expected a dict (a structured-output spec) or None, got {self.guided!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def penalized(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    @property
    def plain(self) -> bool:
        """No logits processing, no logprobs: the sampler's fast path."""
        return not (self.penalized or self.logit_bias or self.min_tokens or self.logprobs is not None
                    or self.guided is not None)


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """A sampled token's log-probability and the ``top`` most likely ``(token_id, logprob)``
    of the distribution it was drawn from (most likely first)."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


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
