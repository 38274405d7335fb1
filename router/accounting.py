"""What a request's choices produced, kept in one place so that every front end (HTTP JSON,
HTTP SSE, gRPC unary, gRPC streaming) reports the same numbers.

- :class:`Delta`: one step of one choice's output, as the pipeline yields it;
- :class:`ChoiceAccount`: one choice's output so far (tokens, text, logprobs, finish reason,
  timing, routing); :meth:`ChoiceAccount.completion` is the unary answer's choice;
- :class:`StreamAccount`: a streamed request's choices as their deltas arrive, each delta a
  :class:`StreamStep` that the SSE and gRPC streams render; its ``usage`` is a
  :class:`~router.usage.UsageAccount` (every prompt once, every generated token,
  ``cached_tokens`` by one definition), as the unary answers' (``usage.choices_usage``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .generation import GenerationRequest
from .render import ToolChoiceStream
from .usage import UsageAccount


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


@dataclass
class StreamStep:
    """One delta of one choice, as every stream renders it."""

    index: int
    delta: Delta
    text: str  # the delta's text, after the prompt on an echo's first delta
    logprobs: list | None  # the generated tokens' (None: the request asked for none)
    prompt_logprobs: list | None  # an echo's first delta: the prompt's (the first token's logprob None)
    events: list | None  # chat with tools: ``("content", text)`` / ``("call", {...})`` now final
    finish_reason: str | None  # with tools, "tool_calls" for a "stop" once a call came
    text_offset: int  # completions' logprobs: where this step's text starts in the choice's
    last: bool  # every choice has finished: the stream's last step

    @property
    def echoed_logprobs(self) -> list | None:
        """HTTP's logprobs: the prompt's (echo) then the generated tokens'."""
        if self.logprobs is None or self.prompt_logprobs is None:
            return self.logprobs
        return self.prompt_logprobs + self.logprobs


class StreamAccount:
    """A streamed request's accounts as its ``(index, Delta)`` arrive: per choice its tool-call
    parser and logprobs text offset, the request's :class:`~router.usage.UsageAccount`, and
    which step is the last. The HTTP SSE and gRPC streams render the same steps."""

    def __init__(self, req: GenerationRequest) -> None:
        self.req = req
        self.usage = UsageAccount(req)
        self.left = len(req.batch or (req.prompt_token_ids,)) * req.n  # choices still running
        self._tools: dict[int, ToolChoiceStream] = {}
        self._offset: dict[int, int] = {}

    def step(self, index: int, delta: Delta) -> StreamStep:
        req = self.req
        self.usage.add(index, len(delta.token_ids), delta.timing)
        echo = req.echo and delta.first
        text = (delta.prompt_text or "") + delta.text if echo else delta.text
        events, finish = None, delta.finish_reason
        if req.tool_format is not None:  # content as it comes, each call once complete
            if index not in self._tools:
                self._tools[index] = ToolChoiceStream(req)
            events, finish = self._tools[index].push(text, finish)
        step = StreamStep(index, delta, text, delta.logprobs,
                          (delta.prompt_logprobs or []) if echo and delta.logprobs is not None else None,
                          events, finish, self._offset.get(index, 0), False)
        self._offset[index] = step.text_offset + sum(len(e.token) for e in step.echoed_logprobs or ())
        if delta.finish_reason is not None:
            self.left -= 1
            step.last = not self.left
        return step
