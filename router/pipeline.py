"""DisaggregatedPipeline: one request's trip prefill -> KV transfer -> decode, seen from the
ingress. Protocol-free: the HTTP and gRPC front ends both consume :meth:`stream`.

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
decode side continues from the first token that was emitted.

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
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from model_executor.sampling import SamplingParams
from prefill_worker.engine import prefix_reuse_granule

from serving.config import ServiceConfig
from .detokenize import TextStream
from serving.metrics import Metrics
from serving.prefill_client import RELEASE_TIMEOUT_S
from serving.errors import RequestError
from serving.messages import Adopted, CancelChoice, DecodeCall, PrefillCall, Prefilled, TransferFailed

from .protocol import GenerationRequest
from serving.costs import PrefillCostModel, prefix_hint, routing_hint
from .state import RequestLifecycle, RequestPhase

logger = logging.getLogger("ray.serve")


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
class _Attempt:
    """The streams and timings of the current prefill/transfer attempt."""

    worker_request_id: str
    lease: Prefilled | None = None  # prefilled, its ticket not yet taken by a decode replica
    decode_stream: Any = None
    timing: dict = field(default_factory=dict)
    routing: dict = field(default_factory=dict)


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
        self.cost_model = PrefillCostModel.for_config(config)
        self._reuse_granule = prefix_reuse_granule(self.page_size, sparse=config.sparse.alpha > 0)

    def _pages(self, tokens: int) -> int:
        return -(-tokens // self.page_size)

    async def complete(self, req: GenerationRequest) -> Completion:
        text, ids, reason, timing, routing = [], [], "length", {}, None
        logprobs = [] if req.logprobs is not None else None
        prompt_text = prompt_logprobs = None
        async for d in self.stream(req):
            if d.first:
                prompt_text, prompt_logprobs = d.prompt_text, d.prompt_logprobs
            text.append(d.text)
            ids.extend(d.token_ids)
            if logprobs is not None:
                logprobs.extend(d.logprobs or ())
            if d.finish_reason is not None:
                reason, timing, routing = d.finish_reason, d.timing or {}, d.routing
        return Completion("".join(text), ids, reason, timing, routing, logprobs, prompt_text, prompt_logprobs)

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
        acc = [{"text": [], "ids": [], "reason": "length", "timing": {}, "routing": None, "prompt": (None, None),
                "logprobs": [] if sub.logprobs is not None else None} for sub in subs]
        async for k, d in self.stream_group(subs):
            a = acc[k]
            if d.first:
                a["prompt"] = (d.prompt_text, d.prompt_logprobs)
            a["text"].append(d.text)
            a["ids"].extend(d.token_ids)
            if a["logprobs"] is not None:
                a["logprobs"].extend(d.logprobs or ())
            if d.finish_reason is not None:
                a["reason"], a["timing"], a["routing"] = d.finish_reason, d.timing or {}, d.routing
        return [Completion("".join(a["text"]), a["ids"], a["reason"], a["timing"], a["routing"], a["logprobs"],
                           *a["prompt"]) for a in acc]

    async def stream_choices(self, req: GenerationRequest) -> AsyncIterator[tuple[int, Delta]]:
        """``(choice index, Delta)`` of every choice as they come (no ``best_of`` > n: the
        parser refuses to stream it); each choice's last delta has its ``finish_reason``. One
        group per prompt (:meth:`stream_group`). Closing this iterator (or one choice failing)
        cancels every choice still running."""
        groups = req.choices()
        if len(groups) == 1:
            async for item in self.stream_group(groups[0]):
                yield item
            return
        width = len(groups[0])
        streams = {i: self.stream_group(row) for i, row in enumerate(groups)}
        async for i, (k, delta) in _merge(streams, {i: row[0].request_id for i, row in enumerate(groups)}):
            yield i * width + k, delta

    async def stream_group(self, subs: list[GenerationRequest]) -> AsyncIterator[tuple[int, Delta]]:
        """The choices of one prompt (``req.choices()``'s row: each choice's own seed, logprobs
        and request id), as ``(choice, Delta)``: ONE prefill samples every choice's first token
        from the same logits, ONE transfer ships the pages, the decode replica forks them
        (shared full pages, a copy of the partial last one per choice) and decodes the choices
        as separate sequences of its batch; its events name the choice. A stop string found
        here ends that choice alone (``cancel_choice`` to the decode replica frees its own pages;
        the shared ones go with the last choice). Closing this iterator cancels them all.
        Retries as :meth:`stream` (tokens sent are kept; the decode side continues each choice
        from its first token). A decode replica dying mid-stream: each unfinished choice resumes
        on its own through :meth:`stream`'s per-request resume path."""
        if len(subs) == 1:
            async for d in self.stream(subs[0]):
                yield 0, d
            return
        base, n = subs[0], len(subs)
        life = RequestLifecycle(base.request_id)
        texts = [TextStream(self.tokenizer, sub.stop) for sub in subs]
        params = [sub.sampling_params() for sub in subs]
        nonce = uuid.uuid4().hex[:8]
        generated: list[list[int]] = [[] for _ in subs]
        outcomes: list[str | None] = [None] * n
        first_sent = False
        resumed: list[int] = []  # choices handed to the per-request resume path (they record their own metrics)
        attempt: _Attempt | None = None
        attempts = 0
        transport: str | None = None
        failure = "cancelled"
        try:
            context = list(base.prompt_token_ids)
            cost = self.cost_model.cost(len(context), alpha=base.sparse_alpha)
            for r in range(self.config.transfer.retries + 1):
                attempt = _Attempt(f"{base.request_id}:{nonce}:{attempts}")
                attempts += 1
                life.to(RequestPhase.PREFILLING)
                try:
                    # a retry (first tokens sent) prefills the prompt again for its pages only
                    event = await self._start_prefill(
                        attempt, base, context, params[0] if not first_sent else dataclasses.replace(params[0], prompt_logprobs=None),
                        cost, skip_transfer=base.max_tokens <= 1, transport=transport,
                        choices=tuple(params) if not first_sent else ())
                except Exception as exc:
                    self._close(attempt)
                    if _is_replica_failure(exc) and r < self.config.transfer.retries:
                        logger.warning("prefill replica failed for %s (%s); prefilling again",
                                       base.request_id, type(exc).__name__)
                        continue
                    if _is_replica_failure(exc):
                        raise self._unavailable("prefill", exc) from exc
                    raise
                if not first_sent:
                    first_sent = True
                    life.mark_first_token()
                    firsts = list(event.first_tokens) or [event.first_token]
                    lps = list(event.first_logprobs) if len(event.first_logprobs) == n else [None] * n
                    if len(firsts) != n:
                        raise RequestError(f"the prefill sampled {len(firsts)} first tokens for {n} choices",
                                           status=502, code="prefill_failed")
                    prompt_text = self._prompt_text(base) if base.echo else None
                    prompt_lps = self._prompt_logprobs(base, event.prompt_logprobs) if base.echo else None
                    for k, sub in enumerate(subs):
                        if sub.max_tokens == 0:  # echo of the prompt alone: its token is not output
                            delta = Delta("", [], first=True, logprobs=[] if sub.logprobs is not None else None)
                            reason = "length"
                        else:
                            generated[k].append(firsts[k])
                            delta = Delta(texts[k].push([firsts[k]]), [firsts[k]], first=True,
                                          logprobs=self._logprobs(sub, [lps[k]]))
                            reason = self._finish_after_first(sub, firsts[k], texts[k])
                        if sub.echo:
                            delta.prompt_text, delta.prompt_logprobs = prompt_text, prompt_lps
                        if reason is not None:
                            delta.text += texts[k].finish()
                            delta.finish_reason = outcomes[k] = reason
                            delta.timing, delta.routing = self._timing(life, attempt), self._routing(attempt)
                        yield k, delta
                live = [k for k in range(n) if outcomes[k] is None]
                if not live:
                    life.to(RequestPhase.FINISHED)
                    return
                life.to(RequestPhase.TRANSFERRING)
                try:
                    event = await self._start_decode(attempt, base, params[live[0]], generated[live[0]][-1], event,
                                                     choices=tuple((generated[k][-1], params[k]) for k in live))
                except Exception as exc:
                    self._close(attempt)
                    if _is_replica_failure(exc) and r < self.config.transfer.retries:
                        logger.warning("decode replica failed before adopting %s (%s); prefilling again",
                                       base.request_id, type(exc).__name__)
                        continue
                    if _is_replica_failure(exc):
                        raise self._unavailable("decode", exc) from exc
                    raise
                if isinstance(event, Adopted):
                    attempt.lease = None
                    life.to(RequestPhase.DECODING)
                    break
                self._close(attempt)
                if event.fallback == "object_store":
                    transport = "object_store"
                if not (event.retryable and r < self.config.transfer.retries):
                    raise self._transfer_error(event)
                logger.warning("KV transfer of %s failed (%s); prefilling again", base.request_id, event.reason)
            else:
                raise RequestError("prefill failed on every attempt", status=503, code="prefill_unavailable",
                                   retry_after_s=self.config.ingress.retry_after_s or 1)

            # -- decode: one stream, the choices' events interleaved (decode choice j = live[j])
            ended_there = 0  # choices the decode replica ended itself (the rest: cancelled from here)
            try:
                async for event in attempt.decode_stream:
                    if not 0 <= event.choice < len(live):
                        raise RequestError(f"decode event for choice {event.choice} of {len(live)}",
                                           status=502, code="decode_failed")
                    k = live[event.choice]
                    if outcomes[k] is not None:  # ended here before (stop string): its cancellation's echo
                        continue
                    if event.first_step_s is not None:
                        attempt.timing["first_decode_s"] = event.first_step_s
                    tokens = list(event.tokens)
                    generated[k].extend(tokens)
                    delta = Delta(texts[k].push(tokens), tokens, logprobs=self._logprobs(subs[k], event.logprobs))
                    if texts[k].stopped:
                        reason = "stop"
                    elif event.finished:
                        reason = {"stop": "stop", "length": "length"}.get(event.finish_reason, "abort")
                        delta.text += texts[k].finish()
                    else:
                        reason = None
                    if reason is not None:
                        outcomes[k] = delta.finish_reason = reason
                        if event.finished:
                            ended_there += 1
                        else:
                            self._cancel_choice(attempt, event.choice)
                        if all(o is not None for o in outcomes):
                            life.to(RequestPhase.FINISHED)
                            if ended_there == len(live):
                                attempt.decode_stream = None  # ended on its own: nothing to cancel
                        delta.timing, delta.routing = self._timing(life, attempt), self._routing(attempt)
                        yield k, delta
                        if all(o is not None for o in outcomes):
                            return
                        continue
                    yield k, delta
                raise RequestError("decode stream ended without a finished event", status=502, code="decode_failed")
            except RequestError:
                raise
            except Exception as exc:
                self._close(attempt)
                if not (_is_replica_failure(exc) and self.config.ingress.decode_resumes > 0):
                    raise RequestError(
                        f"decode replica failed mid-stream ({type(exc).__name__}) after "
                        f"{sum(map(len, generated))} tokens", status=502, code="decode_failed") from exc
                logger.warning("decode replica failed mid-stream for %s (%s); resuming %d choices one by one",
                               base.request_id, type(exc).__name__, sum(o is None for o in outcomes))
            # -- resume: every unfinished choice on its own (the per-request path)
            resumed = [k for k in range(n) if outcomes[k] is None]
            streams = {k: self.stream(subs[k], resume=(generated[k], texts[k])) for k in resumed}
            async for k, delta in _merge(streams, {k: subs[k].request_id for k in resumed}):
                if delta.finish_reason is not None:
                    outcomes[k] = delta.finish_reason
                yield k, delta
            life.to(RequestPhase.FINISHED)
        except (asyncio.CancelledError, GeneratorExit):
            if not life.done:
                life.to(RequestPhase.CANCELLED)
            raise
        except Exception:
            failure = "failed"
            if not life.done:
                life.to(RequestPhase.FAILED)
            raise
        finally:
            if attempt is not None:
                self._close(attempt)
            prompt_counted = False
            for k in range(n):
                if k in resumed:
                    continue
                self._record(subs[k], life, outcomes[k] or failure, len(generated[k]), 0,
                             count_prompt=not prompt_counted)
                prompt_counted = True

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

    async def stream(self, req: GenerationRequest, *,
                     resume: tuple[list[int], TextStream] | None = None) -> AsyncIterator[Delta]:
        """One request's deltas. ``resume``: (tokens already sent, their TextStream): continue a
        request whose decode replica died (a group's choice, :meth:`stream_group`), as a resume."""
        life = RequestLifecycle(req.request_id)
        text = TextStream(self.tokenizer, req.stop) if resume is None else resume[1]
        params = req.sampling_params()
        nonce = uuid.uuid4().hex[:8]
        generated: list[int] = [] if resume is None else list(resume[0])  # every token the client has been sent
        attempt: _Attempt | None = None
        attempts = 0
        resumes = 0 if resume is None else 1
        transport: str | None = None  # "object_store" once a channel transfer of this request failed
        outcome: str | None = None  # the finish reason once the last delta is decided (metrics)
        try:
            while True:
                # -- connect: prefill (+ transfer) until a decode replica has adopted the pages.
                # On a resume the context is prompt + generated[:-1] and the decode side
                # continues from generated[-1]: nothing is sent twice, nothing is skipped.
                context = list(req.prompt_token_ids) + generated[:-1]
                left = max(req.max_tokens - max(len(generated) - 1, 0), 1)
                step_params = dataclasses.replace(params, max_new_tokens=left,
                                                  prompt_logprobs=None if generated else params.prompt_logprobs,
                                                  min_tokens=max(params.min_tokens - max(len(generated) - 1, 0), 0))
                cost = self.cost_model.cost(len(context), alpha=req.sparse_alpha)
                for n in range(self.config.transfer.retries + 1):
                    attempt = _Attempt(f"{req.request_id}:{nonce}:{attempts}")
                    attempts += 1
                    life.to(RequestPhase.PREFILLING)
                    try:
                        event = await self._start_prefill(attempt, req, context, step_params, cost,
                                                          skip_transfer=not generated and req.max_tokens <= 1,
                                                          transport=transport)
                    except Exception as exc:
                        self._close(attempt)
                        if _is_replica_failure(exc) and n < self.config.transfer.retries:
                            logger.warning("prefill replica failed for %s (%s); prefilling again",
                                           req.request_id, type(exc).__name__)
                            continue
                        if _is_replica_failure(exc):
                            raise self._unavailable("prefill", exc) from exc
                        raise
                    if not generated:
                        first_token = event.first_token
                        generated.append(first_token)
                        life.mark_first_token()
                        if req.max_tokens == 0:  # echo of the prompt alone: its token is not output
                            delta = Delta("", [], first=True, logprobs=[] if req.logprobs is not None else None)
                            generated.clear()
                        else:
                            delta = Delta(text.push([first_token]), [first_token], first=True,
                                          logprobs=self._logprobs(req, [event.first_logprob]))
                        if req.echo:
                            delta.prompt_text = self._prompt_text(req)
                            delta.prompt_logprobs = self._prompt_logprobs(req, event.prompt_logprobs)
                        reason = "length" if req.max_tokens == 0 else self._finish_after_first(req, first_token, text)
                        if reason is not None:
                            life.to(RequestPhase.FINISHED)
                            delta.text += text.finish()
                            delta.finish_reason = outcome = reason
                            delta.timing, delta.routing = self._timing(life, attempt, resumes), self._routing(attempt)
                            yield delta
                            return
                        yield delta
                    life.to(RequestPhase.TRANSFERRING)
                    try:
                        # the decode side continues the whole output: penalties, the guide, min/max
                        # tokens and seeded draws see what was generated before a resume too
                        event = await self._start_decode(attempt, req, dataclasses.replace(params, prompt_logprobs=None),
                                                         generated[-1], event, history=tuple(generated[:-1]))
                    except Exception as exc:
                        self._close(attempt)
                        if _is_replica_failure(exc) and n < self.config.transfer.retries:
                            logger.warning("decode replica failed before adopting %s (%s); prefilling again",
                                           req.request_id, type(exc).__name__)
                            continue
                        if _is_replica_failure(exc):
                            raise self._unavailable("decode", exc) from exc
                        raise
                    if isinstance(event, Adopted):
                        attempt.lease = None  # the decode replica has the pages; the lease has ended there
                        life.to(RequestPhase.DECODING)
                        break
                    self._close(attempt)
                    if event.fallback == "object_store":
                        transport = "object_store"
                    if not (event.retryable and n < self.config.transfer.retries):
                        raise self._transfer_error(event)
                    logger.warning("KV transfer of %s failed (%s); prefilling again", req.request_id, event.reason)
                else:
                    raise RequestError("prefill failed on every attempt", status=503, code="prefill_unavailable",
                                       retry_after_s=self.config.ingress.retry_after_s or 1)

                # -- decode: stream tokens until the request finishes or the replica dies.
                try:
                    async for event in attempt.decode_stream:
                        if event.first_step_s is not None:
                            attempt.timing["first_decode_s"] = event.first_step_s
                        tokens = list(event.tokens)
                        generated.extend(tokens)
                        delta = Delta(text.push(tokens), tokens, logprobs=self._logprobs(req, event.logprobs))
                        if text.stopped:
                            reason = "stop"
                        elif event.finished:
                            # "abort" (as vLLM): the decode pool ran out of pages before max_tokens
                            reason = {"stop": "stop", "length": "length"}.get(event.finish_reason, "abort")
                            delta.text += text.finish()
                        else:
                            reason = None
                        if reason is not None:
                            life.to(RequestPhase.FINISHED)
                            if event.finished:
                                attempt.decode_stream = None  # ended on its own: nothing to cancel
                            delta.finish_reason = outcome = reason
                            delta.timing, delta.routing = self._timing(life, attempt, resumes), self._routing(attempt)
                            yield delta
                            return
                        yield delta
                    raise RequestError("decode stream ended without a finished event", status=502, code="decode_failed")
                except RequestError:
                    raise
                except Exception as exc:
                    self._close(attempt)
                    if not (_is_replica_failure(exc) and resumes < self.config.ingress.decode_resumes):
                        raise RequestError(
                            f"decode replica failed mid-stream ({type(exc).__name__}) after {len(generated)} tokens",
                            status=502, code="decode_failed",
                        ) from exc
                    resumes += 1
                    logger.warning("decode replica failed mid-stream for %s (%s); resuming after %d tokens",
                                   req.request_id, type(exc).__name__, len(generated))
        except (asyncio.CancelledError, GeneratorExit):
            if not life.done:
                life.to(RequestPhase.CANCELLED)
            outcome = outcome or "cancelled"
            raise
        except Exception:
            if not life.done:
                life.to(RequestPhase.FAILED)
            outcome = outcome or "failed"
            raise
        finally:
            if attempt is not None:
                self._close(attempt)
            self._record(req, life, outcome or "cancelled", len(generated), resumes)

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
                              choices=choices)
        alpha = self.config.sparse.alpha if req.sparse_alpha is None else req.sparse_alpha
        own_alpha = alpha != self.config.sparse.alpha  # such a prompt uses no cached prefix
        # how this prefill runs (usage.sparse_attention): dense below sparse.dense_below or at alpha 0
        attempt.timing["sparse_attention"] = {"alpha": alpha, "dense": alpha == 0 or len(context) < self.config.sparse.dense_below}
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
