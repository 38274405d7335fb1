"""The request the ingress drives: one validated generation request, protocol-independent
(token ids and sampling options, everything the workers need, nothing they do not). The parser
(``router/parsing.py``) makes it from an HTTP body or a gRPC message.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, fields, replace

from model_executor.sampling_params import SamplingParams

from .openai_models import MAX_SEED


@dataclass(frozen=True)
class GenerationRequest:
    """One validated generation request, protocol-independent."""

    request_id: str
    kind: str  # "completion" or "chat"
    model: str
    prompt_token_ids: tuple[int, ...]
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    stream: bool = False
    include_usage: bool = False
    continuous_usage: bool = False  # stream_options.continuous_usage_stats: usage in every chunk (vLLM's)
    return_token_ids: bool = False
    return_tokens_as_token_ids: bool = False  # logprobs name tokens "token_id:<id>" (vLLM's)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0
    logprobs: int | None = None  # top alternatives per token; None: no logprobs
    n: int = 1  # choices per prompt
    best_of: int | None = None  # generate this many per prompt, return the n of highest logprob
    batch: tuple[tuple[int, ...], ...] = ()  # every prompt of a list of prompts (() : just this one)
    echo: bool = False  # completions: the prompt (and with logprobs its logprobs) before the output
    # leading prompt tokens the tokenizer added (a BOS the client did not send): not echoed; of
    # this prompt (echo_skip) or of each prompt of ``batch`` (batch_skip)
    echo_skip: int = 0
    batch_skip: tuple[int, ...] = ()
    sparse_alpha: float | None = None  # per-request sparsity: the prefill's alpha (0: dense); None: the service's
    # the request's other sparse options: (name, value) pairs (last_dense_tiles, energy_rule, dense_layers)
    sparse_options: tuple[tuple[str, object], ...] = ()
    guided: dict | None = None  # structured output (response_format or forced tool calls): model_executor.grammar's spec
    tool_format: str | None = None  # chat with tools: the reply is parsed for calls in this format (tools.FORMATS)
    parallel_tool_calls: bool = True  # False: at most one call is returned
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def prompt_len(self) -> int:
        """Prompt tokens of the request (of all its prompts, each counted once, as OpenAI)."""
        return sum(len(p) for p in self.batch) if self.batch else len(self.prompt_token_ids)

    @property
    def response_id(self) -> str:
        """The ``id`` of the response objects: OpenAI's ``cmpl-`` / ``chatcmpl-`` prefix on the
        request id (which may come from ``x-request-id`` or the ``request_id`` field)."""
        prefix = "cmpl-" if self.kind == "completion" else "chatcmpl-"
        return self.request_id if self.request_id.startswith(prefix) else prefix + self.request_id

    @property
    def single(self) -> bool:
        return not self.batch and self.n == 1 and self.best_of is None

    def choices(self) -> list[list["GenerationRequest"]]:
        """Per prompt, the single requests its choices come from (``best_of`` or ``n`` of them):
        each its own request id, and with a seed, seeds ``seed, seed + 1, ...`` (choice 0 is the
        n=1 answer). With ``best_of`` they keep logprobs, the ranking's score."""
        per_prompt = self.best_of or self.n
        logprobs = self.logprobs if self.best_of is None else (self.logprobs or 0)
        out = []
        for i, ids in enumerate(self.batch or (self.prompt_token_ids,)):
            row = []
            for j in range(per_prompt):
                k = i * per_prompt + j
                row.append(replace(self, request_id=f"{self.request_id}-{k}", prompt_token_ids=tuple(ids), batch=(),
                                   echo_skip=self.batch_skip[i] if self.batch_skip else self.echo_skip,
                                   batch_skip=(), n=1, best_of=None, logprobs=logprobs,
                                   seed=None if self.seed is None else (self.seed + j) % (MAX_SEED + 1)))
            out.append(row)
        return out

    def sampling_params(self) -> SamplingParams:
        """The workers' sampling parameters: every field named as one of ``SamplingParams``'
        (``shared_fields``), plus the two this request words differently."""
        return SamplingParams(**{name: getattr(self, name) for name in shared_fields(type(self), SamplingParams)},
                              max_new_tokens=max(self.max_tokens, 1),
                              prompt_logprobs=self.logprobs if self.echo else None)


def shared_fields(*classes: type) -> tuple[str, ...]:
    """The field names every one of these dataclasses or pydantic models has, in the first's
    order. A sampling parameter that the request model (``router/openai_models.py``), the gRPC
    message (``router/proto/flashprefill.proto``), ``GenerationRequest`` and ``SamplingParams``
    (``model_executor/sampling.py``) name alike flows from either protocol to the sampler through
    this and ``router/parsing.PLAIN_SAMPLING``, with no code of its own elsewhere."""
    def names(cls: type) -> list[str]:
        model_fields = getattr(cls, "model_fields", None)  # pydantic
        return list(model_fields) if model_fields is not None else [f.name for f in fields(cls)]

    first, *rest = (names(c) for c in classes)
    return tuple(n for n in first if all(n in r for r in rest))
