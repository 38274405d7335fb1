"""Per-choice accounting at the request driver: what each choice of a request reports.

A :class:`Choice` is one choice as the driver runs it (the tokens its client has been sent, its
text stream, its outcome); :class:`ChoiceReporter` turns what the workers return into each
choice's :class:`~router.accounting.Delta` (text, token ids, logprobs, the echo), decides a
choice's finish reason, stamps its last delta with ``timing`` and ``routing``, and records the
request's metrics once it ends (``serving/metrics.py``). The front ends consume the deltas
through ``router/accounting.py``.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

from model_executor.sampling_params import SamplingParams
from serving.config import ServiceConfig
from serving.errors import RequestError
from serving.messages import Prefilled
from serving.metrics import Metrics

from .accounting import Delta, Logprob
from .detokenize import TextStream
from .generation import GenerationRequest
from .state import RequestLifecycle, RequestPhase

logger = logging.getLogger("ray.serve")


@dataclass
class Choice:
    """One choice of a request in the driver: what its client has been sent so far."""

    req: GenerationRequest
    params: SamplingParams
    text: TextStream
    generated: list[int] = field(default_factory=list)  # every token the client has been sent
    outcome: str | None = None  # the finish reason once its last delta is decided


class Measured(Protocol):
    """What an attempt measured: its steps' timings and the replicas it was routed to."""

    timing: dict
    routing: dict


class ChoiceReporter:
    """The deltas, finish reasons, timing and metrics of a request's choices."""

    def __init__(self, tokenizer: Any, config: ServiceConfig | None = None, metrics: Metrics | None = None) -> None:
        self.tokenizer = tokenizer
        self.config = config
        self.metrics = metrics if metrics is not None else Metrics()

    def choice(self, req: GenerationRequest) -> Choice:
        return Choice(req, req.sampling_params(), TextStream(self.tokenizer, req.stop))

    # -- deltas ------------------------------------------------------------------------
    def first_deltas(self, choices: list[Choice], event: Prefilled, life: RequestLifecycle, attempt: Measured,
                     resumes: int) -> list[tuple[int, Delta]]:
        """Each choice's first delta from the prefill's first tokens (a choice with max_tokens 0
        echoes the prompt alone: its token is not output)."""
        base, n = choices[0].req, len(choices)
        if n == 1:
            firsts, lps = [event.first_token], [event.first_logprob]
        else:
            firsts = list(event.first_tokens) or [event.first_token]
            lps = list(event.first_logprobs) if len(event.first_logprobs) == n else [None] * n
            if len(firsts) != n:
                raise RequestError(f"the prefill sampled {len(firsts)} first tokens for {n} choices",
                                   status=502, code="prefill_failed")
        prompt_text = self.prompt_text(base) if base.echo else None
        prompt_lps = self.prompt_logprobs(base, event.prompt_logprobs) if base.echo else None
        out = []
        for k, c in enumerate(choices):
            if c.req.max_tokens == 0:
                delta = Delta("", [], first=True, logprobs=[] if c.req.logprobs is not None else None)
                reason = "length"
            else:
                c.generated.append(firsts[k])
                delta = Delta(c.text.push([firsts[k]]), [firsts[k]], first=True, logprobs=self.logprobs(c.req, [lps[k]]))
                reason = self._finish_after_first(c.req, firsts[k], c.text)
            if c.req.echo:
                delta.prompt_text, delta.prompt_logprobs = prompt_text, prompt_lps
            if reason is not None:
                delta.text += c.text.finish()
                self.finish(choices, k, delta, reason, life, attempt, resumes)
            out.append((k, delta))
        return out

    def decode_delta(self, c: Choice, event: Any) -> Delta:
        """A decode event's tokens as the choice's next delta (its client is sent them)."""
        tokens = list(event.tokens)
        c.generated.extend(tokens)
        return Delta(c.text.push(tokens), tokens, logprobs=self.logprobs(c.req, event.logprobs))

    @staticmethod
    def decode_reason(c: Choice, delta: Delta, event: Any) -> str | None:
        """The finish reason a decode event gives its choice (None: it goes on): a stop string
        found here, else the decode replica's own end (its text flushed into ``delta``)."""
        if c.text.stopped:
            return "stop"
        if event.finished:
            # "abort" (as vLLM): the decode pool ran out of pages before max_tokens
            delta.text += c.text.finish()
            return {"stop": "stop", "length": "length"}.get(event.finish_reason, "abort")
        return None

    def finish(self, choices: list[Choice], k: int, delta: Delta, reason: str, life: RequestLifecycle,
               attempt: Measured, resumes: int) -> None:
        """Choice ``k`` ends with ``delta``: its finish reason, timing and routing (the request
        is finished with its last choice)."""
        choices[k].outcome = delta.finish_reason = reason
        if all(c.outcome is not None for c in choices):
            life.to(RequestPhase.FINISHED)
        delta.timing, delta.routing = self.timing(life, attempt, resumes), self.routing(attempt)

    @staticmethod
    def _finish_after_first(req: GenerationRequest, first_token: int, text: TextStream) -> str | None:
        if text.stopped or first_token in req.stop_token_ids:
            return "stop"
        if req.max_tokens <= 1:
            return "length"
        return None

    # -- logprobs and the echo ---------------------------------------------------------
    def prompt_text(self, req: GenerationRequest) -> str:
        """The echoed prompt: the tokens the client sent (not a BOS the tokenizer added)."""
        return self.tokenizer.decode(list(req.prompt_token_ids[req.echo_skip:]))

    def prompt_logprobs(self, req: GenerationRequest, entries: Any) -> list | None:
        """The echo's logprobs, one per token the client sent: where the tokenizer added a BOS
        (``req.echo_skip``), the client's first token has a logprob (given the BOS) and the BOS
        is not echoed; otherwise the first token has none."""
        if req.logprobs is None:
            return None
        if entries is None or len(entries) != req.prompt_len:
            raise RequestError("echo: the prefill returned no prompt logprobs", status=502, code="prefill_failed")
        if req.echo_skip:
            return self.logprobs(req, entries[req.echo_skip:])
        first = req.prompt_token_ids[0]
        return [Logprob(first, self._token_str(first), None, token_bytes=self._token_bytes(first)),
                *self.logprobs(req, entries[1:])]

    def logprobs(self, req: GenerationRequest, entries: Any) -> list | None:
        """model_executor.sampling.TokenLogprob entries -> :class:`Logprob`; None without logprobs."""
        if req.logprobs is None:
            return None
        return [Logprob(e.token, self._token_str(e.token), e.logprob,
                        tuple((t, self._token_str(t), lp) for t, lp in e.top),
                        self._token_bytes(e.token), tuple(self._token_bytes(t) for t, _ in e.top))
                for e in entries or () if e is not None]

    def _token_str(self, token_id: int) -> str:
        return self.tokenizer.decode([int(token_id)], skip_special_tokens=False)

    def _token_bytes(self, token_id: int) -> bytes:
        of = getattr(self.tokenizer, "token_bytes", None)
        return of(int(token_id)) if of is not None else self._token_str(token_id).encode("utf-8")

    # -- timing, routing, metrics ------------------------------------------------------
    def timing(self, life: RequestLifecycle, attempt: Measured, resumes: int = 0) -> dict:
        """The ``timing`` of the last chunk. Before the first token (TTFT): ``queue_s`` and
        ``prefill_s`` (prefill replica: queued, then the forward(s) and first-token sampling)
        and ``export_s`` (the KV pages packed for the transport; the first token leaves with the
        ticket). After it: ``transfer_s`` (decode replica: room, fetch, checks, adopt) and
        ``first_decode_s`` (decode replica: submitted to the loop -> its first decode step's
        token). Per-step values are of the last prefill attempt; None where a step did not run."""
        now = time.monotonic()
        return {
            "ttft_s": life.ttft_s,
            "queue_s": attempt.timing.get("queue_s"),
            "prefill_s": attempt.timing.get("prefill_s"),
            "export_s": attempt.timing.get("export_s"),
            "transfer_s": attempt.timing.get("transfer_s"),
            "first_decode_s": attempt.timing.get("first_decode_s"),
            "total_s": now - life.received_at,
            "prefill_attempts": life.prefill_attempts,
            "decode_resumes": resumes,
            "cached_tokens": attempt.timing.get("cached_tokens"),
            "sparse_attention": attempt.timing.get("sparse_attention"),
        }

    def routing(self, attempt: Measured) -> dict | None:
        return dict(attempt.routing) if self.config.ingress.debug_routing else None

    def cancelled(self, life: RequestLifecycle, prefilled: bool) -> None:
        """The client left before the request finished: counted by stage once its prompt was
        prefilled (while a prefill replica has it, that replica counts it: queued or
        prefilling, only it knows which; once prefilled, its pages were on their way to decode,
        or decoding)."""
        if life.phase is RequestPhase.DECODING or life.phase is RequestPhase.TRANSFERRING or prefilled:
            stage = "decoding" if life.phase is RequestPhase.DECODING else "transferring"
            self.metrics.inc("requests_cancelled_total", stage=stage)

    def record_all(self, choices: list[Choice], life: RequestLifecycle, failure: str, resumes: int,
                   handed: list[int]) -> None:
        """The metrics of every choice but those ``handed`` on as groups of their own (they
        record their own); a prompt is counted once, as OpenAI's usage."""
        counted = False
        for k, c in enumerate(choices):
            if k not in handed:
                self._record(c.req, life, c.outcome or failure, len(c.generated), resumes, count_prompt=not counted)
                counted = True

    def _record(self, req: GenerationRequest, life: RequestLifecycle, outcome: str, output_tokens: int,
                resumes: int, *, count_prompt: bool = True) -> None:
        """The request's metrics (``serving/metrics.py``); never raises. ``count_prompt``: False
        for the choices of a group after the first (a prompt is counted once, as OpenAI's usage)."""
        try:
            end = life.finished_at if life.finished_at is not None else time.monotonic()
            tpot = None
            if life.first_token_at is not None and output_tokens > 1:
                tpot = (end - life.first_token_at) / (output_tokens - 1)
            self.metrics.request_ended(
                finish_reason=outcome,
                prompt_tokens=req.prompt_len if life.first_token_at is not None and count_prompt else None,
                output_tokens=output_tokens, ttft_s=life.ttft_s, latency_s=end - life.received_at, tpot_s=tpot,
                prefill_retries=max(life.prefill_attempts - 1 - resumes, 0), resumes=resumes)
        except Exception:  # noqa: BLE001 - metrics never fail a request
            logger.warning("request metrics of %s not recorded", req.request_id, exc_info=True)
