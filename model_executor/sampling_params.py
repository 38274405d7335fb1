"""A request's sampling options (:class:`SamplingParams`) and a token's reported logprob
(:class:`TokenLogprob`): typed values that cross from the ingress to the workers and back. No
torch here: the ingress builds and reads them and never imports torch
(tests/test_ingress_imports.py); ``model_executor.sampling`` samples with them."""

from __future__ import annotations

import math
from dataclasses import dataclass

from kernels._scalars import check_int as _check_int


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
