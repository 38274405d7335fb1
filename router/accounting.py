"""What a request's choices produced, kept in one place so that every front end (HTTP JSON,
HTTP SSE, gRPC unary, gRPC streaming) reports the same numbers.

- :class:`Delta`: one step of one choice's output, as the pipeline yields it;
- :class:`ChoiceAccount`: one choice's output so far (tokens, text, logprobs, finish reason,
  timing, routing); :meth:`ChoiceAccount.completion` is the unary answer's choice;
- :class:`UsageAccount`: the request's ``usage``: every prompt once, every generated token, and
  ``cached_tokens`` by a single definition (:meth:`UsageAccount.cached_tokens`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .protocol import GenerationRequest, usage


@dataclass
class Delta:
    """New output of one request: text and token ids; the last one has ``finish_reason``."""

    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    first: bool = False
    timing: dict | None = None
    routing: dict | None = None
    logprobs: list | None = None  # one Logprob per token id, when the request asked for them
    prompt_text: str | None = None  # first delta, with echo
    prompt_logprobs: list | None = None  # first delta, with echo and logprobs (None for token 0)


@dataclass(frozen=True)
class Logprob:
    """A token's logprob with the strings of it and of its top alternatives (the protocol
    renders them in the OpenAI shapes)."""

    token_id: int
    token: str
    logprob: float | None  # None: a prompt's first token (echo)
    top: tuple[tuple[int, str, float], ...] = ()  # (token id, token, logprob), most likely first
    # the bytes of the token and of each of ``top`` (tokenizer.token_bytes: a piece of a multi-byte
    # character is its raw bytes); None / () : the UTF-8 of the strings
    token_bytes: bytes | None = None
    top_bytes: tuple[bytes, ...] = ()


@dataclass
class Completion:
    text: str
    token_ids: list[int]
    finish_reason: str
    timing: dict
    routing: dict | None = None
    logprobs: list | None = None
    prompt_text: str | None = None
    prompt_logprobs: list | None = None


@dataclass
class ChoiceAccount:
    """One choice's output as its deltas arrive. ``logprobs`` is None when the request asked
    for none; ``finish_reason`` stays "length" until the last delta says otherwise (a stream
    cut short reports what it had)."""

    logprobs: list | None = None
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str = "length"
    finished: bool = False
    timing: dict = field(default_factory=dict)
    routing: dict | None = None
    prompt_text: str | None = None
    prompt_logprobs: list | None = None

    @classmethod
    def of(cls, req: GenerationRequest) -> ChoiceAccount:
        return cls(logprobs=[] if req.logprobs is not None else None)

    def add(self, delta: Delta) -> None:
        if delta.first:
            self.prompt_text, self.prompt_logprobs = delta.prompt_text, delta.prompt_logprobs
        self.text.append(delta.text)
        self.token_ids.extend(delta.token_ids)
        if self.logprobs is not None:
            self.logprobs.extend(delta.logprobs or ())
        if delta.finish_reason is not None:
            self.finish_reason, self.finished = delta.finish_reason, True
            self.timing, self.routing = delta.timing or {}, delta.routing

    @property
    def cached_tokens(self) -> int | None:
        """Prompt tokens its (last) prefill took from the prefix cache; None until it finished."""
        return self.timing.get("cached_tokens")

    @property
    def sparse_attention(self) -> dict | None:
        return self.timing.get("sparse_attention")

    def completion(self) -> Completion:
        return Completion("".join(self.text), self.token_ids, self.finish_reason, self.timing, self.routing,
                          self.logprobs, self.prompt_text, self.prompt_logprobs)


class UsageAccount:
    """The ``usage`` of one request, fed every choice's deltas (streaming) or finished choices
    (unary), in any order.

    ``cached_tokens``: OpenAI's ``prompt_tokens_details.cached_tokens`` is a part of
    ``prompt_tokens``, which counts every prompt once however many choices it has; so each prompt
    counts the cached tokens of its prefill once: those reported by its lowest-index choice
    (the choices of a prompt share one prefill). None while no choice has reported any.
    ``sparse_attention``: how the prefill of the lowest-index reporting choice ran."""

    def __init__(self, req: GenerationRequest) -> None:
        self.req = req
        self.completion_tokens = 0
        self._cached: dict[int, int] = {}  # choice index -> its prefill's cached tokens
        self._sparse: dict[int, dict] = {}

    def add(self, index: int, delta: Delta) -> None:
        self.completion_tokens += len(delta.token_ids)
        self._report(index, delta.timing)

    def add_choice(self, index: int, choice: ChoiceAccount | Completion, *, count_tokens: bool = True) -> None:
        """A finished choice; ``count_tokens`` False where the caller counts the generated
        tokens itself (best_of: the discarded choices' tokens count too)."""
        if count_tokens:
            self.completion_tokens += len(choice.token_ids)
        self._report(index, choice.timing)

    def _report(self, index: int, timing: dict | None) -> None:
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
        for index in sorted(self._cached):  # lowest index first: it names its prompt's count
            per_prompt.setdefault(index // self.req.n, self._cached[index])
        return sum(per_prompt.values())

    def sparse_attention(self) -> dict | None:
        return self._sparse[min(self._sparse)] if self._sparse else None

    def usage(self) -> dict:
        """OpenAI's usage object (``protocol.usage``); ``sparse_attention`` only for a request
        that set its own."""
        return usage(self.req.prompt_len, self.completion_tokens, self.cached_tokens(),
                     self.sparse_attention() if self.req.sparse_alpha is not None else None)

    def running(self) -> dict:
        """The usage so far without the prompt details (vLLM's ``continuous_usage_stats``)."""
        return usage(self.req.prompt_len, self.completion_tokens)
