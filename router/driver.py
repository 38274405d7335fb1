"""RequestDriver: the state machine of one request's trip prefill -> KV transfer -> decode
stream, per attempt, seen from the ingress. It asks the retry/resume policy
(``router/retry.py``) what a failure means and the per-choice accounting
(``router/reporting.py``) what each choice reports; ``router/pipeline.py`` runs the choices
of a request through it.

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
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from model_executor.sampling_params import SamplingParams
from serving.config import ServiceConfig
from serving.costs import PrefillCostModel, prefix_hint, prefix_reuse_granule, routing_hint
from serving.errors import RequestError
from serving.messages import Adopted, CancelChoice, DecodeCall, PrefillCall, Prefilled, TransferFailed
from serving.prefill_client import RELEASE_TIMEOUT_S

from .accounting import Delta
from .generation import GenerationRequest
from .reporting import Choice, ChoiceReporter
from .retry import RetryPolicy
from .state import RequestLifecycle, RequestPhase

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
class _Connection:
    """The connect-and-retry state of one driver, across its attempts and resumes."""

    request_id: str
    nonce: str
    first_sent: bool = False  # the first tokens went out: a retry prefills for the pages only
    attempt: _Attempt | None = None  # the current attempt (its lease, its decode stream)
    attempts: int = 0
    transport: str | None = None  # "object_store" once a channel transfer of this request failed
    live: list[int] = field(default_factory=list)  # the choices the adopted decode stream runs


def own_serve_request(suffix: str) -> None:
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


async def merge(streams: dict, serve_ids: dict) -> AsyncIterator[tuple[Any, Any]]:
    """``(key, item)`` of several async iterators as they come, each pumped by its own task (its
    calls go out as their own Serve request, ``serve_ids[key]``). The first failure is raised;
    closing this iterator cancels every pump (their streams close)."""
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(key: Any, it: Any) -> None:
        own_serve_request(serve_ids[key])
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


class RequestDriver:
    """Drives the choices of one prompt through prefill, transfer and decode (:meth:`drive`)."""

    def __init__(self, prefill_handle: Any, decode_handle: Any, config: ServiceConfig, page_size: int,
                 policy: RetryPolicy, reporter: ChoiceReporter,
                 release_lease: Callable[[Prefilled], None] | None = None) -> None:
        self.config = config
        self.page_size = page_size
        self.policy = policy
        self.reporter = reporter
        self.prefill = prefill_handle
        # ends the lease of an attempt abandoned before a decode replica took its ticket
        self._release_lease = release_lease
        self.decode = decode_handle.options(stream=True)
        self.decode_calls = decode_handle  # unary calls pinned to a replica (cancel_choice)
        self._background: set[asyncio.Task] = set()
        self.cost_model = PrefillCostModel.for_config(config)
        self._reuse_granule = prefix_reuse_granule(self.page_size, sparse=config.sparse.alpha > 0)

    def _pages(self, tokens: int) -> int:
        return -(-tokens // self.page_size)

    async def drive(self, choices: list[Choice], resumes: int = 0) -> AsyncIterator[tuple[int, Delta]]:
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
        report = self.reporter
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
                        delta = report.decode_delta(c, event)
                        if n == 1 and not c.text.stopped and self.policy.recomputes_preempted(event, resumes):
                            # preempted (the decode pool had no page for its next token): recompute,
                            # as a resume (prefill of prompt + output, decode on), not an "abort"
                            if delta.token_ids:
                                yield k, delta
                            attempt.decode_stream = None  # it ended on its own: nothing to cancel
                            preempted = True
                            break
                        reason = report.decode_reason(c, delta, event)
                        if reason is None:
                            yield k, delta
                            continue
                        if event.finished:
                            ended_there += 1
                        elif n > 1:
                            self._cancel_choice(attempt, event.choice)
                        if ended_there == len(live):
                            attempt.decode_stream = None  # ended on its own: nothing to cancel
                        report.finish(choices, k, delta, reason, life, attempt, resumes)
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
                    self.policy.after_decode_failure(exc, resumes, base.request_id,
                                                     sum(c.outcome is None for c in choices),
                                                     sum(len(c.generated) for c in choices))
                if n == 1:
                    resumes += 1
                    conn.attempt = None
                    continue
                # -- resume: every unfinished choice as a group of one
                handed = [k for k in range(n) if choices[k].outcome is None]
                streams = {k: self.drive([choices[k]], resumes + 1) for k in handed}
                async for k, (_, delta) in merge(streams, {k: choices[k].req.request_id for k in handed}):
                    yield k, delta
                life.to(RequestPhase.FINISHED)
                return
        except (asyncio.CancelledError, GeneratorExit):
            if not life.done:
                report.cancelled(life, prefilled=conn.attempt is not None and conn.attempt.lease is not None)
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
            report.record_all(choices, life, failure, resumes, handed)

    async def _connect(self, conn: _Connection, choices: list[Choice], life: RequestLifecycle,
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
        for r in self.policy.attempts():
            attempt = conn.attempt = _Attempt(f"{base.request_id}:{conn.nonce}:{conn.attempts}")
            conn.attempts += 1
            life.to(RequestPhase.PREFILLING)
            try:
                # a retry (first tokens sent) prefills the prompt again for its pages only
                # a first attempt's first tokens are the answer's: the prefill replica exports
                # nothing when they end it (ends_at_stop), as the reporter ends it here
                event = await self._start_prefill(
                    attempt, base, context, params, cost, skip_transfer=not conn.first_sent and base.max_tokens <= 1,
                    ends_at_stop=not conn.first_sent,
                    transport=conn.transport,
                    choices=tuple(c.params for c in choices) if n > 1 and not conn.first_sent else ())
            except Exception as exc:
                self._close(attempt)
                self.policy.after_replica_failure("prefill", exc, r, base.request_id)
                continue
            if not conn.first_sent:
                conn.first_sent = True
                life.mark_first_token()
                for item in self.reporter.first_deltas(choices, event, life, attempt, resumes):
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
                self._close(attempt)
                self.policy.after_replica_failure("decode", exc, r, base.request_id)
                continue
            if isinstance(event, Adopted):
                attempt.lease = None  # the decode replica has the pages; the lease has ended there
                life.to(RequestPhase.DECODING)
                return
            self._close(attempt)
            conn.transport = self.policy.transport_after(event, conn.transport)  # its retries avoid a failed channel
            self.policy.after_transfer_failure(event, r, base.request_id)
        raise self.policy.exhausted()

    # -- steps -------------------------------------------------------------------------
    async def _start_prefill(self, attempt: _Attempt, req: GenerationRequest, context: list[int], params: SamplingParams,
                             cost: float, *, skip_transfer: bool, transport: str | None = None,
                             choices: tuple = (), ends_at_stop: bool = False) -> Prefilled:
        payload = PrefillCall(request_id=attempt.worker_request_id, prompt_token_ids=context, params=params,
                              skip_transfer=skip_transfer, ends_at_stop=ends_at_stop, transport=transport,
                              sparse_alpha=req.sparse_alpha,
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
        event = await self.prefill.prefill.remote(
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
        attempt.decode_stream = self.decode.generate.remote(payload, routing=routing_hint(pages=pages))
        event = await attempt.decode_stream.__anext__()
        # the decode replica took the ticket: it ends the lease (adopted or not)
        attempt.lease = None
        attempt.routing["decode_replica"] = event.replica_id
        if isinstance(event, Adopted):
            attempt.timing["transfer_s"] = event.transfer_s
        return event

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

    def _cancel_choice(self, attempt: _Attempt, choice: int) -> None:
        """Ask the decode replica of ``attempt`` to stop one choice (fire and forget: if it is lost
        the choice decodes on to its end and its pages go then)."""
        replica = attempt.routing.get("decode_replica")
        request_id = attempt.worker_request_id

        async def call() -> None:
            own_serve_request(f"cancel-{choice}")  # its own Serve request: the stream's ledger entry stays
            try:
                await asyncio.wait_for(self.decode_calls.cancel_choice.remote(
                    CancelChoice(request_id, choice), routing=routing_hint(replica=replica)),
                    RELEASE_TIMEOUT_S)
            except Exception as exc:  # noqa: BLE001 - the choice then ends on the decode replica by itself
                logger.info("cancelling choice %d of %s failed: %r", choice, request_id, exc)

        task = asyncio.get_running_loop().create_task(call())
        self._background.add(task)
        task.add_done_callback(self._background.discard)
