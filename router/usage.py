"""The ``usage`` of a request, one definition for every front end (HTTP's unary answers and
streams, gRPC): prompt tokens once per prompt, every generated token, ``cached_tokens`` of one
prefill per prompt.
"""

from __future__ import annotations

from .generation import GenerationRequest


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None,
          sparse_attention: dict | None = None) -> dict:
    """OpenAI's usage object; ``cached_tokens``: prompt tokens reused from the prefix cache;
    ``sparse_attention`` (extension): how the prefill ran (``{"alpha", "dense", "density"}``:
    ``density`` is the measured fraction of causal (query tile, 64-key tile) pairs attended,
    1.0 when dense)."""
    out = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
           "total_tokens": prompt_tokens + completion_tokens}
    if sparse_attention is not None:
        out["sparse_attention"] = sparse_attention
    if cached_tokens is not None:  # after a resume the re-prefilled context is longer than the prompt
        out["prompt_tokens_details"] = {"cached_tokens": min(int(cached_tokens), prompt_tokens)}
    return out


class UsageAccount:
    """The ``usage`` of one request, fed each choice's generated tokens and timing (every delta
    of a stream, or each finished choice of a unary answer), in any order. One definition for
    every front end:

    - ``completion_tokens``: every token generated (best_of's discarded choices too: the caller
      sets the total);
    - ``cached_tokens``: OpenAI's ``prompt_tokens_details.cached_tokens`` is a part of
      ``prompt_tokens``, which counts each prompt once however many choices it has; so each
      prompt counts the cached tokens of ONE prefill: those reported by its lowest-index choice
      (the choices of a prompt share their prefill). None while no choice reported any;
    - ``sparse_attention``: how the prefill of the lowest-index reporting choice ran (only for
      a request that set its own)."""

    def __init__(self, req: GenerationRequest) -> None:
        self.req = req
        self.completion_tokens = 0
        self._cached: dict[int, int] = {}  # choice index -> the cached tokens its prefill reported
        self._sparse: dict[int, dict] = {}

    def add(self, index: int, tokens: int, timing: dict | None = None) -> None:
        self.completion_tokens += tokens
        if not timing:
            return
        if timing.get("cached_tokens") is not None:
            self._cached[index] = int(timing["cached_tokens"])
        if timing.get("sparse_attention"):
            self._sparse[index] = timing["sparse_attention"]

    def cached_tokens(self) -> int | None:
        if not self._cached:
            return None
        per_prompt: dict[int, int] = {}
        for index in sorted(self._cached):  # the lowest index of a prompt names its count
            per_prompt.setdefault(index // self.req.n, self._cached[index])
        return sum(per_prompt.values())

    def sparse_attention(self) -> dict | None:
        return self._sparse[min(self._sparse)] if self._sparse else None

    def usage(self) -> dict:
        return usage(self.req.prompt_len, self.completion_tokens, self.cached_tokens(),
                     self.sparse_attention() if self.req.sparse_alpha is not None or self.req.sparse_options
                     else None)

    def running(self) -> dict:
        """The tokens so far, without prompt details (vLLM's ``continuous_usage_stats``)."""
        return usage(self.req.prompt_len, self.completion_tokens)


def choices_usage(req: GenerationRequest, choices: list, completion_tokens: int | None = None) -> dict:
    """The usage of a unary answer: ``choices`` as :func:`completion_response` takes them."""
    account = UsageAccount(req)
    for index, _, res in choices:
        account.add(index, len(res.token_ids), res.timing)
    if completion_tokens is not None:
        account.completion_tokens = completion_tokens
    return account.usage()
