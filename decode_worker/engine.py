"""DecodeEngine: the decode worker's continuous-batching loop, without Ray.

A request arrives with its prompt's K/V already in this engine's pool (shipped by a prefill
worker, or written by a PrefillEngine sharing the pool) and its first token. Every ``step()``
admits waiting requests, decodes one token for every running request in one forward, and
finishes requests on a stop token or ``max_new_tokens``, releasing their pages.

Request life (explicit, see ``RequestState``):
WAITING -> RUNNING -> FINISHED; WAITING or RUNNING -> CANCELLED (``cancel``).
A request whose first token already ends it goes straight to FINISHED.

Which requests run, the pages they grow into and who is preempted when the pool runs out are
the :class:`~decode_worker.scheduler.DecodeScheduler`'s (``self.scheduler``) to decide; the
engine registers requests, runs the forward, samples and ends requests.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Sequence

from decode_worker.scheduler import DecodeScheduler
from serving.messages import FinishReason  # noqa: F401 (re-exported: the engine's results carry it)
from model_executor.runner import ModelRunner
from model_executor.sampling import Sampler, SamplingParams, TokenLogprob, make_guide


class RequestState(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"
    CANCELLED = "cancelled"


_TERMINAL = (RequestState.FINISHED, RequestState.CANCELLED)


@dataclass
class DecodeRequest:
    """One request's decode state. ``output_ids`` starts with the prefill's first token."""

    request_id: str
    prompt_len: int
    params: SamplingParams
    output_ids: list[int] = field(default_factory=list)
    state: RequestState = RequestState.WAITING
    finish_reason: FinishReason | None = None
    guide: Any = None  # structured output (params.guided): fed every sampled token

    @property
    def is_done(self) -> bool:
        return self.state in _TERMINAL


@dataclass(frozen=True)
class StepOutput:
    """A token produced by ``step()`` (``token`` None when the request ended without one)."""

    request_id: str
    token: int | None
    finished: bool
    finish_reason: FinishReason | None
    logprob: TokenLogprob | None = None  # with params.logprobs


class DecodeEngine:
    """max_running: requests decoded per step; the rest wait (WAITING) in arrival order.
    watermark_pages: free pages the scheduler keeps for running requests' growth (default
    ``decode_worker.scheduler.default_watermark``).
    tokenizer: for structured output (requests with ``params.guided``) only."""

    def __init__(self, runner: ModelRunner, *, max_running: int = 256, sampler: Sampler | None = None,
                 tokenizer: Any = None, watermark_pages: int | None = None) -> None:
        self.runner = runner
        self.pool = runner.pool
        self.scheduler = DecodeScheduler(self.pool, max_running=max_running, watermark_pages=watermark_pages,
                                         ensure_capacity=runner.ensure_capacity)
        self.sampler = sampler or Sampler()
        self.tokenizer = tokenizer
        self._requests: dict[str, DecodeRequest] = {}

    # -- request life -------------------------------------------------------------------
    def add_request(
        self, request_id: str, prompt_len: int, first_token: int, params: SamplingParams,
        history: Sequence[int] = (),
    ) -> DecodeRequest:
        """Register a request whose ``prompt_len`` tokens of K/V are in the pool already.
        ``history``: tokens it generated before ``first_token`` (a resumed request; their K/V
        are part of the ``prompt_len``): they count as output for penalties, the guide, the
        seeded draw's token index, ``min_tokens`` and ``max_new_tokens``, and are not emitted."""
        if request_id in self._requests:
            raise ValueError(f"request_id: {request_id!r} is already known to this engine")
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params: expected SamplingParams, got {type(params).__name__}")
        if not self.pool.has(request_id):
            raise ValueError(f"request_id: {request_id!r} holds no pages in this engine's pool")
        if self.pool.seq_len(request_id) != prompt_len:
            raise ValueError(
                f"prompt_len: expected {self.pool.seq_len(request_id)} (the KV length of "
                f"{request_id!r} in the pool), got {prompt_len}"
            )
        if not (0 <= int(first_token) < self.runner.vocab_size):
            raise ValueError(f"first_token: expected an id in [0, {self.runner.vocab_size}), got {first_token}")
        if isinstance(history, (str, bytes)) or not all(
                isinstance(t, int) and not isinstance(t, bool) and 0 <= t < self.runner.vocab_size for t in history):
            raise ValueError(f"history: expected token ids in [0, {self.runner.vocab_size}), got {list(history)[:8]!r}")
        if len(history) >= prompt_len:
            raise ValueError(f"history: {len(history)} tokens cannot follow a prompt_len of {prompt_len} "
                             "(their K/V are part of it)")
        output = [*history, int(first_token)]
        guide = make_guide(params, self.tokenizer)
        if guide is not None:
            for tok in output:  # the history, then the first token (sampled under the prefill's own guide)
                guide.accept(tok)
        req = DecodeRequest(request_id, prompt_len, params, output, guide=guide)
        self._requests[request_id] = req
        reason = self._finish_reason(req)
        if reason is not None:
            self._finish(req, reason)
        else:
            self.scheduler.add(request_id)
        return req

    def add_group(self, request_id: str, prompt_len: int,
                  choices: "list[tuple[str, int, SamplingParams]]") -> list[DecodeRequest]:
        """Register the choices of one prompt (``n`` / ``best_of``) as separate requests over one
        copy of its K/V: ``request_id`` holds the ``prompt_len`` adopted tokens; each choice
        ``(choice_id, first_token, params)`` becomes a request of its own that shares the full
        pages and owns a copy of the last partial one (``KVPool.fork``); the first choice takes
        ``request_id``'s pages over (no copy), so ``request_id`` holds nothing afterwards.
        Everything is checked before anything changes; ``PoolExhausted`` (no page for the
        copies) leaves ``request_id`` holding its pages and registers nothing."""
        if not choices:
            raise ValueError("choices: expected at least one (choice_id, first_token, params)")
        ids = [c[0] for c in choices]
        if len(set(ids)) != len(ids) or request_id in ids[1:]:
            raise ValueError(f"choices: expected distinct choice ids, got {ids!r}")
        if not self.pool.has(request_id):
            raise ValueError(f"request_id: {request_id!r} holds no pages in this engine's pool")
        if self.pool.seq_len(request_id) != prompt_len:
            raise ValueError(f"prompt_len: expected {self.pool.seq_len(request_id)} (the KV length of "
                             f"{request_id!r} in the pool), got {prompt_len}")
        for cid, first_token, params in choices:
            if cid in self._requests or (cid != request_id and self.pool.has(cid)):
                raise ValueError(f"choices: choice id {cid!r} is already in use")
            if not isinstance(params, SamplingParams):
                raise ValueError(f"choices: expected SamplingParams for {cid!r}, got {type(params).__name__}")
            if not (0 <= int(first_token) < self.runner.vocab_size):
                raise ValueError(f"choices: first token of {cid!r} not in [0, {self.runner.vocab_size}): {first_token}")
        self.pool.fork(request_id, ids[1:])  # all or nothing
        if ids[0] != request_id:
            self.pool.rename(request_id, ids[0])
        return [self.add_request(cid, prompt_len, first_token, params) for cid, first_token, params in choices]

    def cancel(self, request_id: str) -> bool:
        """Cancel a waiting or running request and release its pages; False if it had ended."""
        req = self._requests.get(request_id)
        if req is None:
            raise ValueError(f"request_id: {request_id!r} is not known to this engine")
        if req.is_done:
            return False
        self._finish(req, FinishReason.CANCELLED)
        return True

    def get(self, request_id: str) -> DecodeRequest:
        if request_id not in self._requests:
            raise ValueError(f"request_id: {request_id!r} is not known to this engine")
        return self._requests[request_id]

    def pop_finished(self, request_id: str) -> DecodeRequest:
        """Forget an ended request (FINISHED or CANCELLED) and return its final state."""
        req = self.get(request_id)
        if not req.is_done:
            raise ValueError(f"request_id: {request_id!r} is still {req.state.value}")
        return self._requests.pop(request_id)

    @property
    def max_running(self) -> int:
        return self.scheduler.max_running

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def _finish_reason(self, req: DecodeRequest) -> FinishReason | None:
        if req.output_ids and req.output_ids[-1] in req.params.stop_token_ids:
            return FinishReason.STOP
        if req.guide is not None and req.guide.is_terminated():
            return FinishReason.STOP
        if len(req.output_ids) >= req.params.max_new_tokens:
            return FinishReason.LENGTH
        return None

    def _finish(self, req: DecodeRequest, reason: FinishReason) -> None:
        req.state = RequestState.CANCELLED if reason is FinishReason.CANCELLED else RequestState.FINISHED
        req.finish_reason = reason
        self.scheduler.finish(req.request_id)  # out of the queues, pages back

    # -- the loop -----------------------------------------------------------------------
    def step(self) -> list[StepOutput]:
        """Decode one token for every running request; returns what each produced."""
        running, preempted = self.scheduler.schedule()
        outputs: list[StepOutput] = []
        for rid in preempted:  # the scheduler released their pages
            self._finish(self._requests[rid], FinishReason.KV_EXHAUSTED)
            outputs.append(StepOutput(rid, None, True, FinishReason.KV_EXHAUSTED))
        batch = [self._requests[rid] for rid in running]
        for req in batch:
            req.state = RequestState.RUNNING
        if not batch:
            return outputs
        logits = self.runner.decode([r.request_id for r in batch], [r.output_ids[-1] for r in batch])
        guides = [r.guide for r in batch]
        sampled = self.sampler.sample(
            logits, [r.params for r in batch], [len(r.output_ids) for r in batch],
            histories=[r.output_ids for r in batch], guides=guides if any(g is not None for g in guides) else None,
        )
        for req, tok, lp in zip(batch, sampled.tokens.tolist(), sampled.logprobs):
            req.output_ids.append(int(tok))
            if req.guide is not None:
                req.guide.accept(int(tok))
            reason = self._finish_reason(req)
            if reason is not None:
                self._finish(req, reason)
            outputs.append(StepOutput(req.request_id, int(tok), reason is not None, reason, lp))
        return outputs

    def run_until_done(self, max_steps: int | None = None) -> None:
        steps = 0
        while self.has_unfinished() and (max_steps is None or steps < max_steps):
            self.step()
            steps += 1
