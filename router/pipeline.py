"""DisaggregatedPipeline: one request's trip prefill -> KV transfer -> decode, seen from the
ingress. Protocol-free: the HTTP and gRPC front ends consume :meth:`stream_choices` (or
:meth:`complete` / :meth:`complete_choices`). One state machine drives every request
(:meth:`DisaggregatedPipeline._drive`): a single choice is a group of one.

Page ownership along the way (see docs/ARCHITECTURE.md):
- prefill replica: reserves pages, prefills, returns the first token and a ticket. Where the
  transport reads the pages later (a channel, CUDA IPC) it keeps them under a lease (state
  with a deadline, not a call held open); the object store's frame is a copy, so its pages are
  free at once;
- decode replica: fetches once (a channel send it asks the holder for, an IPC copy, or the
  frame), verifies, adopts, answers ``adopted``; the lease ends with the send, or by the decode
  replica's ``release_pages`` to the holder after its IPC copy. Nothing comes back through here;
- the ingress releases a lease only for an attempt it abandons before a decode replica took
  the ticket (decode replica died, client gone, error): fire and forget, on a handle of its own;
  a lease nobody releases ends at its deadline;
- the decode stream stays open until the last token; closing it early (client gone, stop
  string) makes the decode replica cancel the request and free its pages.
Every exit path (success, error, cancellation) closes the decode stream if it is still open.

Retries: a retryable transfer failure (checksum, truncation, lost object, failed channel, no
room on the decode replica) or a prefill or decode replica dying before the pages were adopted
re-runs the prefill, up to ``transfer.retries`` times; after a failed channel transfer the
retries of that request ship their pages through the object store. Tokens already sent to the client are kept: the
decode side continues from the first token that was emitted. A refusal from a replica (a
``RequestError``: overload, bad input, a prefill forward out of GPU memory, 503
``prefill_out_of_memory``) is never retried: it goes to the client as it is, on the first attempt.

Resume: a decode replica dying mid-stream (Ray Serve retries nothing in flight) is answered by
prefilling prompt + generated[:-1] on a healthy pair and decoding on from generated[-1], up to
``decode_resumes`` times: the client sees neither a gap nor a repeated token. With greedy
sampling the continuation is the one the dead replica would have produced (up to float
rounding between prefill and decode attention; with sparse prefill, up to the sparse
approximation of the re-prefilled tokens); a seeded sampler restarts its per-step stream.
"""

from __future__ import annotations

import asyncio
import logging
import time
import dataclasses
import uuid
from contextlib import aclosing
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from model_executor.sampling import SamplingParams

from serving.config import ServiceConfig
from .detokenize import TextStream
from serving.metrics import Metrics
from serving.prefill_client import RELEASE_TIMEOUT_S
from serving.errors import RequestError
from serving.costs import prefix_reuse_granule
from serving.messages import Adopted, CancelChoice, DecodeCall, FinishReason, PrefillCall, Prefilled, TransferFailed

from .accounting import ChoiceAccount, Completion, Delta, Logprob
from .generation import GenerationRequest
from serving.costs import PrefillCostModel, prefix_hint, routing_hint
from .state import RequestLifecycle, RequestPhase

PREEMPTED = FinishReason.KV_EXHAUSTED.value  # a decode replica's preemption (decode_worker/scheduler.py)

logger = logging.getLogger("ray.serve")


@dataclass
class _Attempt:
    """The streams and timings of the current prefill/transfer attempt."""

    worker_request_id: str
    lease: Prefilled | None = None  # prefilled, its ticket not yet taken by a decode replica
    decode_stream: Any = None
    timing: dict = field(default_factory=dict)
    routing: dict = field(default_factory=dict)


@dataclass
class _Choice:
    """One choice of a request in the driver: what its client has been sent so far."""

    req: GenerationRequest
    params: SamplingParams
    text: TextStream
    generated: list[int] = field(default_factory=list)  # every token the client has been sent
    outcome: str | None = None  # the finish reason once its last delta is decided


@dataclass
class _Connection:
    """The connect-and-retry state of one driver, across its attempts and resumes."""

    request_id: str
    nonce: str
    first_sent: bool = False  # the first tokens went out: a retry prefills for the pages only
    attempt: _Attempt | None = None  # the current attempt (its lease, its decode stream)
    attempts: int = 0
    transport: str | None = None  # "object_store" once a channel transfer of this request failed
    live: list[int] = field(default_factory=list)  # the choices the adopted decode stream runs


def _own_serve_request(suffix: str) -> None:
    """In this task (its own copy of the context), calls go out as their own Serve request:
    Serve and our request routers track in-flight calls by the internal request id, which
    the choices of one HTTP request would otherwise share (their ledgers would count the
    choices' calls as one and drift)."""
    try:
        from ray.serve import context as serve_context
    except ImportError:  # the pipeline outside Serve (tests with fake handles)
        return
    ctx = serve_context._get_serve_request_context()
    serve_context._serve_request_context.set(dataclasses.replace(
        ctx, _internal_request_id=f"{ctx._internal_request_id or uuid.uuid4().hex}:{suffix}"))


async def _merge(streams: dict, serve_ids: dict) -> AsyncIterator[tuple[Any, Any]]:
    """``(key, item)`` of several async iterators as they come, each pumped by its own task (its
    calls go out as their own Serve request, ``serve_ids[key]``). The first failure is raised;
    closing this iterator cancels every pump (their streams close)."""
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(key: Any, it: Any) -> None:
        _own_serve_request(serve_ids[key])
        try:
            async for item in it:
                await queue.put((key, item))
        except Exception as exc:  # noqa: BLE001 - handed to the consumer
            await queue.put((key, exc))
        else:
            await queue.put((key, done))

    tasks = [asyncio.create_task(pump(key, it)) for key, it in streams.items()]
    try:
        running = len(tasks)
        while running:
            key, item = await queue.get()
            if item is done:
                running -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield key, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _is_replica_failure(exc: BaseException) -> bool:
    import ray.exceptions
    from ray.serve.exceptions import ReplicaUnavailableError

    return isinstance(exc, (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError, ReplicaUnavailableError))


def _replica_of(exc: BaseException) -> str:
    """Which replica a failure names: the actor id of Ray's actor errors, the replica id of
    Serve's ``ReplicaUnavailableError``, else the error's type (one dead replica, one key)."""
    for attr in ("actor_id", "_replica_id"):
        value = getattr(exc, attr, None)
        if value:
            return str(value)
    return type(exc).__name__


class ReplicaDeaths:
    """Logs a dead replica once: the first request that meets its death logs one WARNING, the
    others (every request it held retries or resumes) one INFO line each. Bounded: the most
    recent :attr:`MAX_REMEMBERED` replicas are remembered."""

    MAX_REMEMBERED = 256

    def __init__(self) -> None:
        self._seen: dict[str, None] = {}  # insertion-ordered: the oldest is forgotten first

    def log(self, role: str, exc: BaseException, what: str, *args: Any) -> None:
        """``what % args``: the request's line (its id, what happens to it next)."""
        key = f"{role}:{_replica_of(exc)}"
        if key in self._seen:
            logger.info(what, *args)
            return
        self._seen[key] = None
        while len(self._seen) > self.MAX_REMEMBERED:
            self._seen.pop(next(iter(self._seen)))
        logger.warning(f"{role} replica %s died (%s); its requests are retried or resumed elsewhere "
                       f"(one INFO line each). First: {what}", _replica_of(exc), type(exc).__name__, *args)


class RouterDeathNotice(logging.Filter):
    """Serve's request router logs a WARNING for each request that meets a dead replica ("...
    will not be considered for future requests because it has died"); :class:`ReplicaDeaths`
    logs the one WARNING per death, so these become INFO lines (installed on Serve's logger in
    the ingress process by :meth:`install`)."""

    NEEDLE = "will not be considered for future requests because it has died"

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno == logging.WARNING and self.NEEDLE in record.getMessage():
            record.levelno, record.levelname = logging.INFO, "INFO"
        return True

    @classmethod
    def install(cls, target: logging.Logger = logger) -> None:
        if not any(isinstance(f, cls) for f in target.filters):
            target.addFilter(cls())


class DisaggregatedPipeline:
    def __init__(self, prefill_handle: Any, decode_handle: Any, config: ServiceConfig, tokenizer: Any,
                 page_size: int | None = None, metrics: Metrics | None = None,
                 release_lease: Callable[[Prefilled], None] | None = None) -> None:
        self.config = config
        self.metrics = metrics if metrics is not None else Metrics()
        self.tokenizer = tokenizer
        self.page_size = page_size or config.kv.page_size
        self._prefill = prefill_handle
        # ends the lease of an attempt abandoned before a decode replica took its ticket
        self._release_lease = release_lease
        self._decode = decode_handle.options(stream=True)
        self._decode_calls = decode_handle  # unary calls pinned to a replica (cancel_choice)
        self._background: set[asyncio.Task] = set()
        self.deaths = ReplicaDeaths()
        RouterDeathNotice.install()
        self.cost_model = PrefillCostModel.for_config(config)
        self._reuse_granule = prefix_reuse_granule(self.page_size, sparse=config.sparse.alpha > 0)

    def _pages(self, tokens: int) -> int:
        return -(-tokens // self.page_size)

    async def complete(self, req: GenerationRequest) -> Completion:
        """A single-choice request's answer."""
        return (await self._collect([req]))[0]

    # -- several choices: n, best_of, a list of prompts ---------------------------------
    async def complete_choices(self, req: GenerationRequest) -> tuple[list, int]:
        """Every choice of ``req`` at once: ``([(index, prompt_token_ids, Completion)], tokens
        generated)``. The choices of one prompt are one group (:meth:`stream_group`: one
        prefill, one transfer, forks of the pages on one decode replica); a list of prompts
        runs a group per prompt. ``best_of``: per prompt the ``n`` of highest summed logprob,
        best first. One group failing cancels the others (their streams close, their pages
        are freed)."""
        groups = req.choices()
        try:
            async with asyncio.TaskGroup() as tg:
                tasks = [tg.create_task(self._complete_group(row)) for row in groups]
        except BaseExceptionGroup as group:  # the first failure, as a single request would raise it
            raise group.exceptions[0] from None
        out, generated = [], 0
        for i, (task, subs) in enumerate(zip(tasks, groups)):
            results = task.result()
            generated += sum(len(r.token_ids) for r in results)
            if req.best_of is not None:
                results = sorted(results, key=lambda r: -sum(e.logprob for e in r.logprobs or ()))[: req.n]
                if req.logprobs is None:
                    results = [dataclasses.replace(r, logprobs=None) for r in results]
            out.extend((i * req.n + j, subs[0].prompt_token_ids, r) for j, r in enumerate(results))
        return out, generated

    async def _complete_group(self, subs: list[GenerationRequest]) -> list[Completion]:
        _own_serve_request(subs[0].request_id)
        return await self._collect(subs)

    async def _collect(self, subs: list[GenerationRequest]) -> list[Completion]:
        accounts = [ChoiceAccount.of(sub) for sub in subs]
        async with aclosing(self.stream_group(subs)) as stream:
            async for k, d in stream:
                accounts[k].add(d)
        return [a.completion() for a in accounts]

    async def stream_choices(self, req: GenerationRequest) -> AsyncIterator[tuple[int, Delta]]:
        """``(choice index, Delta)`` of every choice as they come (no ``best_of`` > n: the
        parser refuses to stream it); each choice's last delta has its ``finish_reason``. One
        group per prompt (:meth:`stream_group`; a single-choice request is its own group of
        one, under its own request id). Closing this iterator (or one choice failing) cancels
        every choice still running."""
        groups = [[req]] if req.single else req.choices()
        if len(groups) == 1:
            async with aclosing(self.stream_group(groups[0])) as stream:
                async for item in stream:
                    yield item
            return
        width = len(groups[0])
        streams = {i: self.stream_group(row) for i, row in enumerate(groups)}
        async for i, (k, delta) in _merge(streams, {i: row[0].request_id for i, row in enumerate(groups)}):
            yield i * width + k, delta

    async def stream(self, req: GenerationRequest) -> AsyncIterator[Delta]:
        """One request's deltas: a group of one (:meth:`stream_group`)."""
        async with aclosing(self._drive([self._choice(req)])) as stream:
            async for _, delta in stream:
                yield delta

    async def stream_group(self, subs: list[GenerationRequest]) -> AsyncIterator[tuple[int, Delta]]:
        """The choices of one prompt (``req.choices()``'s row: each choice's own seed, logprobs
        and request id), as ``(choice, Delta)`` (:meth:`_drive`). Closing this iterator closes
        the driver at once (its streams close, its lease is released)."""
        async with aclosing(self._drive([self._choice(sub) for sub in subs])) as stream:
            async for item in stream:
                yield item

    def _choice(self, req: GenerationRequest) -> _Choice:
        return _Choice(req, req.sampling_params(), TextStream(self.tokenizer, req.stop))

    async def _drive(self, choices: list[_Choice], resumes: int = 0) -> AsyncIterator[tuple[int, Delta]]:
        """THE request state machine, for the choices of one prompt (a single request is a
        group of one), as ``(choice, Delta)``.

        Connect: ONE prefill samples every choice's first token from the same logits (their
        deltas go out at once), ONE transfer ships the pages, and a decode replica adopts them;
        a retryable failure before adoption prefills again (:meth:`_connect`). Several choices:
        the decode replica forks the pages (shared full pages, a copy of the partial last one
        per choice) and decodes the choices as separate sequences of its batch, its events
        naming the choice; a stop string found here ends that choice alone (``cancel_choice``
        frees its own pages; the shared ones go with the last choice). Closing this iterator
        cancels them all.

        A decode replica dying mid-stream: a group of one connects again with prompt +
        generated[:-1] and decodes on from generated[-1] (``resumes`` counts these); each
        unfinished choice of a larger group resumes as a group of one of its own (it records
        its own metrics). ``choices`` that already have tokens (a resume) send no first delta."""
        base, n = choices[0].req, len(choices)
        life = RequestLifecycle(base.request_id)
        conn = _Connection(base.request_id, uuid.uuid4().hex[:8], first_sent=bool(choices[0].generated))
        handed: list[int] = []  # choices resumed as groups of their own (they record their own metrics)
        failure = "cancelled"
        try:
            while True:
                async for item in self._connect(conn, choices, life, resumes):
                    yield item
                live = conn.live
                if not live:
                    return
                # -- decode: one stream, the choices' events interleaved (decode choice j = live[j])
                attempt = conn.attempt
                ended_there = 0  # choices the decode replica ended itself (the rest: cancelled from here)
                preempted = False
                try:
                    async for event in attempt.decode_stream:
                        if not 0 <= event.choice < len(live):
                            raise RequestError(f"decode event for choice {event.choice} of {len(live)}",
                                               status=502, code="decode_failed")
                        k = live[event.choice]
                        c = choices[k]
                        if c.outcome is not None:  # ended here before (stop string): its cancellation's echo
                            continue
                        if event.first_step_s is not None:
                            attempt.timing["first_decode_s"] = event.first_step_s
                        tokens = list(event.tokens)
                        c.generated.extend(tokens)
                        delta = Delta(c.text.push(tokens), tokens, logprobs=self._logprobs(c.req, event.logprobs))
                        if (event.finished and event.finish_reason == PREEMPTED and n == 1 and not c.text.stopped
                                and resumes < self.config.ingress.decode_resumes):
                            # preempted (the decode pool had no page for its next token): recompute,
                            # as a resume (prefill of prompt + output, decode on), not an "abort"
                            if tokens:
                                yield k, delta
                            attempt.decode_stream = None  # it ended on its own: nothing to cancel
                            preempted = True
                            break
                        if c.text.stopped:
                            reason = "stop"
                        elif event.finished:
                            # "abort" (as vLLM): the decode pool ran out of pages before max_tokens
                            reason = {"stop": "stop", "length": "length"}.get(event.finish_reason, "abort")
                            delta.text += c.text.finish()
                        else:
                            reason = None
                        if reason is None:
                            yield k, delta
                            continue
                        if event.finished:
                            ended_there += 1
                        elif n > 1:
                            self._cancel_choice(attempt, event.choice)
                        if ended_there == len(live):
                            attempt.decode_stream = None  # ended on its own: nothing to cancel
                        self._finish(choices, k, delta, reason, life, attempt, resumes)
                        yield k, delta
                        if life.done:
                            return
                    if not preempted:
                        raise RequestError("decode stream ended without a finished event", status=502,
                                           code="decode_failed")
                    self._close(attempt)
                    logger.info("%s preempted by its decode replica after %d tokens; recomputing",
                                base.request_id, len(choices[0].generated))
                except RequestError:
                    raise
                except Exception as exc:
                    self._close(attempt)
                    if not (_is_replica_failure(exc) and resumes < self.config.ingress.decode_resumes):
                        raise RequestError(
                            f"decode replica failed mid-stream ({type(exc).__name__}) after "
                            f"{sum(len(c.generated) for c in choices)} tokens", status=502,
                            code="decode_failed") from exc
                    self.deaths.log("decode", exc, "%s: decode replica failed mid-stream (%s); resuming %d choices "
                                    "after %d tokens", base.request_id, type(exc).__name__,
                                    sum(c.outcome is None for c in choices), sum(len(c.generated) for c in choices))
                if n == 1:
                    resumes += 1
                    conn.attempt = None
                    continue
                # -- resume: every unfinished choice as a group of one
                handed = [k for k in range(n) if choices[k].outcome is None]
                streams = {k: self._drive([choices[k]], resumes + 1) for k in handed}
                async for k, (_, delta) in _merge(streams, {k: choices[k].req.request_id for k in handed}):
                    yield k, delta
                life.to(RequestPhase.FINISHED)
                return
        except (asyncio.CancelledError, GeneratorExit):
            if not life.done:
                # while a prefill replica has it, that replica counts it (queued or prefilling: only it
                # knows which); once prefilled, its pages were on their way to decode, or decoding
                prefilled = conn.attempt is not None and conn.attempt.lease is not None
                if life.phase is RequestPhase.DECODING or life.phase is RequestPhase.TRANSFERRING or prefilled:
                    stage = "decoding" if life.phase is RequestPhase.DECODING else "transferring"
                    self.metrics.inc("requests_cancelled_total", stage=stage)
                life.to(RequestPhase.CANCELLED)
            raise
        except Exception:
            failure = "failed"
            if not life.done:
                life.to(RequestPhase.FAILED)
            raise
        finally:
            if conn.attempt is not None:
                self._close(conn.attempt)
            counted = False  # a prompt is counted once, as OpenAI's usage
            for k, c in enumerate(choices):
                if k not in handed:
                    self._record(c.req, life, c.outcome or failure, len(c.generated), resumes, count_prompt=not counted)
                    counted = True

    def _retry_or_raise(self, role: str, attempt: _Attempt, exc: Exception, r: int, request_id: str) -> None:
        """An attempt whose ``role`` replica failed before the pages reached decode: closed, and
        prefilled again (the caller continues) while ``transfer.retries`` allows; else raised
        (a replica failure as 503 ``<role>_unavailable``). Anything but a replica's death is
        raised at once: an OOM would fail the same prompt on a replica of the same size."""
        self._close(attempt)
        if _is_replica_failure(exc) and r < self.config.transfer.retries:
            self.deaths.log(role, exc, "%s: %s replica failed before the pages reached decode (%s); prefilling again",
                            request_id, role, type(exc).__name__)
            return
        if _is_replica_failure(exc):
            raise self._unavailable(role, exc) from exc
        raise exc

    async def _connect(self, conn: _Connection, choices: list[_Choice], life: RequestLifecycle,
                       resumes: int) -> AsyncIterator[tuple[int, Delta]]:
        """Prefill (+ transfer) until a decode replica has adopted the pages (``conn.attempt``,
        its stream open, ``conn.live`` the choices it decodes) or every choice has finished
        (``conn.live`` empty). The first prefill's first tokens go out as each choice's first
        delta. The context is prompt + generated[:-1] and the decode side continues from
        generated[-1] (a choice of a larger group has at most its first token here): nothing is
        sent twice, nothing is skipped."""
        base, n = choices[0].req, len(choices)
        head = choices[0]
        done = max(len(head.generated) - 1, 0)  # decoded tokens already sent (a resume)
        context = list(base.prompt_token_ids) + head.generated[:-1]
        params = dataclasses.replace(head.params, max_new_tokens=max(base.max_tokens - done, 1),
                                     prompt_logprobs=None if conn.first_sent else head.params.prompt_logprobs,
                                     min_tokens=max(head.params.min_tokens - done, 0))
        cost = self.cost_model.cost(len(context), alpha=base.sparse_alpha)
        for r in range(self.config.transfer.retries + 1):
            attempt = conn.attempt = _Attempt(f"{base.request_id}:{conn.nonce}:{conn.attempts}")
            conn.attempts += 1
            life.to(RequestPhase.PREFILLING)
            try:
                # a retry (first tokens sent) prefills the prompt again for its pages only
                event = await self._start_prefill(
                    attempt, base, context, params, cost, skip_transfer=not conn.first_sent and base.max_tokens <= 1,
                    transport=conn.transport,
                    choices=tuple(c.params for c in choices) if n > 1 and not conn.first_sent else ())
            except Exception as exc:
                self._retry_or_raise("prefill", attempt, exc, r, base.request_id)
                continue
            if not conn.first_sent:
                conn.first_sent = True
                life.mark_first_token()
                for item in self._first_deltas(choices, event, life, attempt, resumes):
                    yield item
            conn.live = [k for k in range(n) if choices[k].outcome is None]
            if not conn.live:
                return
            life.to(RequestPhase.TRANSFERRING)
            lead = choices[conn.live[0]]
            try:
                # the decode side continues the whole output: penalties, the guide, min/max
                # tokens and seeded draws see what was generated before a resume too
                event = await self._start_decode(
                    attempt, base, dataclasses.replace(lead.params, prompt_logprobs=None), lead.generated[-1], event,
                    choices=tuple((choices[k].generated[-1], choices[k].params) for k in conn.live) if n > 1 else (),
                    history=tuple(lead.generated[:-1]))
            except Exception as exc:
                self._retry_or_raise("decode", attempt, exc, r, base.request_id)
                continue
            if isinstance(event, Adopted):
                attempt.lease = None  # the decode replica has the pages; the lease has ended there
                life.to(RequestPhase.DECODING)
                return
            self._close(attempt)
            if event.fallback == "object_store":  # the channel failed: this request's retries avoid it
                conn.transport = "object_store"
            if not (event.retryable and r < self.config.transfer.retries):
                raise self._transfer_error(event)
            logger.warning("KV transfer of %s failed (%s); prefilling again", base.request_id, event.reason)
        raise RequestError("prefill failed on every attempt", status=503, code="prefill_unavailable",
                           retry_after_s=self.config.ingress.retry_after_s or 1)

    def _first_deltas(self, choices: list[_Choice], event: Prefilled, life: RequestLifecycle, attempt: _Attempt,
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
        prompt_text = self._prompt_text(base) if base.echo else None
        prompt_lps = self._prompt_logprobs(base, event.prompt_logprobs) if base.echo else None
        out = []
        for k, c in enumerate(choices):
            if c.req.max_tokens == 0:
                delta = Delta("", [], first=True, logprobs=[] if c.req.logprobs is not None else None)
                reason = "length"
            else:
                c.generated.append(firsts[k])
                delta = Delta(c.text.push([firsts[k]]), [firsts[k]], first=True, logprobs=self._logprobs(c.req, [lps[k]]))
                reason = self._finish_after_first(c.req, firsts[k], c.text)
            if c.req.echo:
                delta.prompt_text, delta.prompt_logprobs = prompt_text, prompt_lps
            if reason is not None:
                delta.text += c.text.finish()
                self._finish(choices, k, delta, reason, life, attempt, resumes)
            out.append((k, delta))
        return out

    def _finish(self, choices: list[_Choice], k: int, delta: Delta, reason: str, life: RequestLifecycle,
                attempt: _Attempt, resumes: int) -> None:
        """Choice ``k`` ends with ``delta``: its finish reason, timing and routing (the request
        is finished with its last choice)."""
        choices[k].outcome = delta.finish_reason = reason
        if all(c.outcome is not None for c in choices):
            life.to(RequestPhase.FINISHED)
        delta.timing, delta.routing = self._timing(life, attempt, resumes), self._routing(attempt)

    def _cancel_choice(self, attempt: _Attempt, choice: int) -> None:
        """Ask the decode replica of ``attempt`` to stop one choice (fire and forget: if it is lost
        the choice decodes on to its end and its pages go then)."""
        replica = attempt.routing.get("decode_replica")
        request_id = attempt.worker_request_id

        async def call() -> None:
            _own_serve_request(f"cancel-{choice}")  # its own Serve request: the stream's ledger entry stays
            try:
                await asyncio.wait_for(self._decode_calls.cancel_choice.remote(
                    CancelChoice(request_id, choice), routing=routing_hint(replica=replica)),
                    RELEASE_TIMEOUT_S)
            except Exception as exc:  # noqa: BLE001 - the choice then ends on the decode replica by itself
                logger.info("cancelling choice %d of %s failed: %r", choice, request_id, exc)

        task = asyncio.get_running_loop().create_task(call())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def _prompt_text(self, req: GenerationRequest) -> str:
        """The echoed prompt: the tokens the client sent (not a BOS the tokenizer added)."""
        return self.tokenizer.decode(list(req.prompt_token_ids[req.echo_skip:]))

    def _prompt_logprobs(self, req: GenerationRequest, entries: Any) -> list | None:
        """The echo's logprobs, one per token the client sent: where the tokenizer added a BOS
        (``req.echo_skip``), the client's first token has a logprob (given the BOS) and the BOS
        is not echoed; otherwise the first token has none."""
        if req.logprobs is None:
            return None
        if entries is None or len(entries) != req.prompt_len:
            raise RequestError("echo: the prefill returned no prompt logprobs", status=502, code="prefill_failed")
        if req.echo_skip:
            return self._logprobs(req, entries[req.echo_skip:])
        first = req.prompt_token_ids[0]
        return [Logprob(first, self._token_str(first), None, token_bytes=self._token_bytes(first)),
                *self._logprobs(req, entries[1:])]

    def _token_str(self, token_id: int) -> str:
        return self.tokenizer.decode([int(token_id)], skip_special_tokens=False)

    def _token_bytes(self, token_id: int) -> bytes:
        of = getattr(self.tokenizer, "token_bytes", None)
        return of(int(token_id)) if of is not None else self._token_str(token_id).encode("utf-8")

    def _logprobs(self, req: GenerationRequest, entries: Any) -> list | None:
        """model_executor.sampling.TokenLogprob entries -> :class:`Logprob`; None without logprobs."""
        if req.logprobs is None:
            return None
        return [Logprob(e.token, self._token_str(e.token), e.logprob,
                        tuple((t, self._token_str(t), lp) for t, lp in e.top),
                        self._token_bytes(e.token), tuple(self._token_bytes(t) for t, _ in e.top))
                for e in entries or () if e is not None]

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

    def _unavailable(self, role: str, exc: BaseException) -> RequestError:
        return RequestError(f"{role} replicas failed on every attempt ({type(exc).__name__}); retry later",
                            status=503, code=f"{role}_unavailable", retry_after_s=self.config.ingress.retry_after_s or 1)

    def _transfer_error(self, event: TransferFailed) -> RequestError:
        if event.reason == "pool_exhausted":
            # every decode replica stayed full for decode.adopt_wait_s: overload, not a fault
            return RequestError("decode KV capacity exhausted; retry later", status=429, code="kv_capacity_exhausted",
                                retry_after_s=self.config.ingress.retry_after_s or 1)
        return RequestError(f"KV transfer failed: {event.message}", status=502, code="kv_transfer_failed")

    # -- steps -------------------------------------------------------------------------
    async def _start_prefill(self, attempt: _Attempt, req: GenerationRequest, context: list[int], params: SamplingParams,
                             cost: float, *, skip_transfer: bool, transport: str | None = None,
                             choices: tuple = ()) -> Prefilled:
        payload = PrefillCall(request_id=attempt.worker_request_id, prompt_token_ids=context, params=params,
                              skip_transfer=skip_transfer, transport=transport, sparse_alpha=req.sparse_alpha,
                              choices=choices, sparse_options=req.sparse_options)
        alpha = self.config.sparse.alpha if req.sparse_alpha is None else req.sparse_alpha
        service = self.config.sparse_config
        own = dict(req.sparse_options)
        if req.sparse_alpha is not None:
            own["alpha"] = float(req.sparse_alpha)
        own_alpha = service.with_request(own) != service  # such a prompt uses no cached prefix
        # how this prefill runs (usage.sparse_attention): dense below sparse.dense_below or at alpha 0
        attempt.timing["sparse_attention"] = {"alpha": alpha, "dense": alpha == 0 or len(context) < self.config.sparse.dense_below,
                                              **{k: v for k, v in req.sparse_options}}
        # prefix affinity: where this prompt's prefix went before, it may be cached
        prefix = (prefix_hint(context, self.page_size, self.cost_model, granule=self._reuse_granule)
                  if self.config.prefill.prefix_caching and not own_alpha else None)
        event = await self._prefill.prefill.remote(
            payload, routing=routing_hint(cost=cost, pages=self._pages(len(context)), prefix=prefix)
        )
        if event.ticket is not None:
            attempt.lease = event
        attempt.timing.update(queue_s=event.queue_s, prefill_s=event.prefill_s, export_s=event.export_s,
                              cached_tokens=event.cached_tokens)
        # what the prefill measured: the fraction of causal (query tile, key tile) pairs attended
        sparse = attempt.timing["sparse_attention"]
        sparse["density"] = 1.0 if sparse["dense"] else (
            None if event.block_density is None else round(float(event.block_density), 6))
        attempt.routing["prefill_replica"] = event.replica_id
        return event

    async def _start_decode(self, attempt: _Attempt, req: GenerationRequest, params: SamplingParams,
                            first_token: int, prefilled: Prefilled, choices: tuple = (),
                            history: tuple[int, ...] = ()) -> Adopted | TransferFailed:
        payload = DecodeCall(request_id=attempt.worker_request_id, ticket=prefilled.ticket, kv_len=prefilled.kv_len,
                             first_token=first_token, params=params, choices=choices, history=history)
        # a group: its shared pages once plus each choice's own (DecodeCall.footprint)
        pages = payload.footprint(self.page_size) if choices else self._pages(req.prompt_len + req.max_tokens)
        attempt.decode_stream = self._decode.generate.remote(payload, routing=routing_hint(pages=pages))
        event = await attempt.decode_stream.__anext__()
        # the decode replica took the ticket: it ends the lease (adopted or not)
        attempt.lease = None
        attempt.routing["decode_replica"] = event.replica_id
        if isinstance(event, Adopted):
            attempt.timing["transfer_s"] = event.transfer_s
        return event

    def _finish_after_first(self, req: GenerationRequest, first_token: int, text: TextStream) -> str | None:
        if text.stopped or first_token in req.stop_token_ids:
            return "stop"
        if req.max_tokens <= 1:
            return "length"
        return None

    def _close(self, attempt: _Attempt) -> None:
        if attempt.decode_stream is not None:
            attempt.decode_stream.cancel()
            attempt.decode_stream = None
        if attempt.lease is not None:
            lease, attempt.lease = attempt.lease, None
            if self._release_lease is not None:
                try:
                    self._release_lease(lease)
                except Exception:  # noqa: BLE001 - the lease's deadline ends it anyway
                    logger.info("releasing the lease of %s failed", lease.request_id, exc_info=True)

    def _timing(self, life: RequestLifecycle, attempt: _Attempt, resumes: int = 0) -> dict:
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

    def _routing(self, attempt: _Attempt) -> dict | None:
        return dict(attempt.routing) if self.config.ingress.debug_routing else None
