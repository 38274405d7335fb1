"""The decode deployment: dense-decode replicas with their own KV pool.

One replica = one :class:`DecodeServer` = one model copy, one pool, one :class:`DecodeLoop`.
With ``decode.tensor_parallel_size > 1`` the replica is rank 0 of a TP group (its engine drives
the other ranks in lockstep and samples alone; over channels every rank pulls its own KV heads,
an object-store frame is split by KV head over the ranks; all or nothing either way):
``serving/tp_group.py``.

``generate(request)`` (streaming) takes a request whose prompt was prefilled elsewhere:
1. fetches the shipped pages through the KV transport the ticket names (the object store; a
   channel: then it reserves the pages and asks the prefill replica holding them to send
   them, see ``kv_transfer.channel``; or CUDA IPC: it copies them out of the prefill
   replica's pool on the same GPU, or has them come over the channel from another GPU, see
   ``kv_transfer.cuda_ipc``), verifies them (checksum or device, shape) and adopts them into this
   replica's pool; on failure yields one ``transfer_error`` event (nothing stays allocated;
   after a channel or IPC failure it says ``fallback: "object_store"``) and ends;
2. yields ``adopted``. The prefill replica's lease on its copy has ended by then: with the
   send (channels), or by this replica's ``release_pages`` call to it, fire and forget, once
   its IPC copy is done or it gives up on the ticket (full pool, failure, client gone);
3. hands the request to the DecodeLoop and yields ``tokens`` events (one or more token ids
   each) until the request finishes;
4. if the stream is closed early (client gone, stop string matched at the ingress), its
   ``finally`` cancels the request in the engine, which frees its pages.

Admission, the page budget and preemption are the engine's ``DecodeScheduler``'s
(``decode_worker/scheduler.py``): a request is admitted when the pages its adoption takes fit next
to the other adoptions in flight and a watermark kept for growth; its growth to ``max_new_tokens``
is not reserved up front (only a request whose whole footprint, ``DecodeCall.footprint``, exceeds
the pool is refused at once).

A group (``DecodeCall.choices``: the ``n`` / ``best_of`` choices of one prompt) is admitted
with its shared pages once, adopted once, then forked into
one engine request per choice (``<request id>#<k>``, ``DecodeEngine.add_group``); its
``Tokens`` name their ``choice`` and the stream ends when every choice has ended.
``cancel_choice`` (a unary call pinned to this replica) stops one choice: its own pages go back,
the shared ones stay with its siblings.

Only the DecodeLoop task touches the DecodeEngine: adds and cancels are queued and applied
between steps, and each ``step()`` runs in a worker thread so the event loop keeps serving.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from dataclasses import dataclass
from typing import Any

from ray import serve

from decode_worker.engine import DecodeEngine, FinishReason, StepOutput
from kv_transfer.transfer import TransferError, TransferFailure
from serving.autoscaling import autoscaling_config
from serving.config import ServiceConfig
from serving.messages import (
    Adopted,
    CancelChoice,
    ChoiceCancelled,
    DecodeCall,
    Tokens,
    TransferFailed,
    checked,
)
from serving.metrics import Metrics
from serving.runtime import WorkerRuntime, node_ip, pool_pages, replica_id, replica_identity, rss_bytes
from serving.prefill_client import PrefillClient
from serving.transports import TPGroup, make_decode_receivers, placement_of

logger = logging.getLogger("ray.serve")


@dataclass(frozen=True)
class _Add:
    request_id: str
    prompt_len: int
    first_token: int
    params: Any
    outbox: asyncio.Queue
    history: tuple[int, ...] = ()
    choices: tuple = ()  # a group: ((choice id, first token, params), ...), forked from request_id's pages


@dataclass(frozen=True)
class _Cancel:
    request_id: str


class _LoopFailed(RuntimeError):
    pass


class DecodeLoop:
    """Continuous batching: the only code that calls the engine."""

    def __init__(self, engine: DecodeEngine, *, step_delay_s: float = 0.0, metrics: Metrics | None = None,
                 on_freed: Any = None) -> None:
        self.engine = engine
        self.on_freed = on_freed  # called when pages may have gone back (a step ran, a cancel applied)
        self.step_delay_s = step_delay_s  # fault-injection drills only
        self.metrics = metrics if metrics is not None else Metrics()
        self._graph_counts = (None, 0, 0)  # the runner's decode graphs and their (graph, eager) steps last seen
        self._inbox: collections.deque[_Add | _Cancel] = collections.deque()
        self._outboxes: dict[str, asyncio.Queue] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self.steps = 0
        self.tokens_out = 0

    @property
    def num_streams(self) -> int:
        return len(self._outboxes) + sum(isinstance(c, _Add) for c in self._inbox)

    def submit(self, request_id: str, prompt_len: int, first_token: int, params: Any,
               history: tuple[int, ...] = (), choices: tuple = ()) -> asyncio.Queue:
        """Queue a request for the engine; its StepOutputs (and a failure, as an exception) come
        through the returned queue. ``history``: tokens a resumed request generated before
        ``first_token`` (``DecodeEngine.add_request``). ``choices`` ((choice id, first token,
        params), ...): the request is a group (``DecodeEngine.add_group``); the outputs of every
        choice share the queue, told apart by their request ids."""
        outbox: asyncio.Queue = asyncio.Queue()
        self._inbox.append(_Add(request_id, prompt_len, first_token, params, outbox, tuple(history), tuple(choices)))
        self._ensure_running()
        self._wake.set()
        return outbox

    def cancel(self, request_id: str) -> None:
        self._inbox.append(_Cancel(request_id))
        self._ensure_running()
        self._wake.set()

    def _ensure_running(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run())

    def _freed(self) -> None:
        if self.on_freed is not None:
            self.on_freed()

    def _apply_inbox(self) -> None:
        if self._inbox:
            self._apply_commands()
            self._freed()

    def _apply_commands(self) -> None:
        while self._inbox:
            cmd = self._inbox.popleft()
            if isinstance(cmd, _Add):
                ids = [c[0] for c in cmd.choices] or [cmd.request_id]
                try:
                    if cmd.choices:
                        reqs = self.engine.add_group(cmd.request_id, cmd.prompt_len, list(cmd.choices))
                    else:
                        reqs = [self.engine.add_request(cmd.request_id, cmd.prompt_len, cmd.first_token, cmd.params,
                                                         history=cmd.history)]
                except Exception as exc:  # never registered (or partly): free the adopted pages here
                    for rid in dict.fromkeys([cmd.request_id, *ids]):
                        try:
                            self.engine.cancel(rid)
                            self.engine.pop_finished(rid)
                        except ValueError:  # not registered
                            pass
                        if self.engine.pool.has(rid):
                            self.engine.pool.release(rid)
                    self.engine.scheduler.settle(cmd.request_id)
                    cmd.outbox.put_nowait(exc)
                    continue
                # registered (a group: forked): the pool counts its pages, its claim ends
                self.engine.scheduler.settle(cmd.request_id)
                for req in reqs:
                    if req.is_done:  # the first token already ended it
                        self.engine.pop_finished(req.request_id)
                        cmd.outbox.put_nowait(StepOutput(req.request_id, None, True, req.finish_reason))
                    else:
                        self._outboxes[req.request_id] = cmd.outbox
            elif cmd.request_id in self._outboxes:
                # the stream learns of it (a group's stream waits for each of its choices to end)
                self._outboxes.pop(cmd.request_id).put_nowait(
                    StepOutput(cmd.request_id, None, True, FinishReason.CANCELLED))
                self.engine.cancel(cmd.request_id)
                self.engine.pop_finished(cmd.request_id)

    def _record(self) -> None:
        """A step's metrics: how it ran (a CUDA graph or eager), the batch, the pool."""
        m = self.metrics
        if not m.enabled:
            return
        graphs = self.engine.runner.decode_graphs
        if graphs is None:
            m.inc("decode_steps_total", mode="eager")
        else:
            seen, graph_steps, eager_steps = self._graph_counts
            if seen is not graphs:  # graphs captured anew: their counts start from zero
                graph_steps = eager_steps = 0
            counts = (graphs.stats["graph_steps"], graphs.stats["eager_steps"])
            m.inc("decode_steps_total", max(counts[0] - graph_steps, 0), mode="graph")
            m.inc("decode_steps_total", max(counts[1] - eager_steps, 0), mode="eager")
            self._graph_counts = (graphs, *counts)
        m.set("decode_running_requests", self.engine.num_running)
        m.set("decode_waiting_requests", self.engine.num_waiting)
        m.pool("decode", self.engine.pool)

    async def _run(self) -> None:
        while True:
            if not self._inbox and not self.engine.has_unfinished():
                self._wake.clear()
                await self._wake.wait()
            self._apply_inbox()
            if not self.engine.has_unfinished():
                continue
            if self.step_delay_s:
                await asyncio.sleep(self.step_delay_s)
                self._apply_inbox()  # cancels that came in meanwhile
                if not self.engine.has_unfinished():
                    continue
            try:
                outputs = await asyncio.to_thread(self.engine.step)
            except Exception as exc:
                logger.exception("decode step failed; failing every running request")
                for rid, outbox in list(self._outboxes.items()):
                    outbox.put_nowait(_LoopFailed(f"decode step failed: {exc!r}"))
                    self.engine.cancel(rid)
                    self.engine.pop_finished(rid)
                self._outboxes.clear()
                self._freed()
                continue
            self.steps += 1
            self._record()
            for out in outputs:
                outbox = self._outboxes.get(out.request_id)
                if outbox is None:
                    continue
                outbox.put_nowait(out)
                if out.token is not None:
                    self.tokens_out += 1
                if out.finished:
                    self._outboxes.pop(out.request_id, None)
                    self.engine.pop_finished(out.request_id)
            self._freed()
            await asyncio.sleep(0)  # let streams flush between steps


class DecodeServer:
    """A decode replica (see the module docstring)."""

    def __init__(self, config: dict | None = None) -> None:
        self.config = ServiceConfig.from_dict(config)
        self._tp_actors: list = []
        if self.config.decode.tensor_parallel_size > 1:  # serving/tp_group.py: rank 0 here, the rest actors
            self.runtime = self._start_tp_group()
        else:
            self.runtime = WorkerRuntime.build(self.config, num_pages=pool_pages(self.config, "decode"))
            self.runtime.enable_decode_graphs()  # before any request holds pages (it borrows a few)
        self.pool = self.runtime.pool
        self.engine = DecodeEngine(self.runtime.runner, max_running=self.config.decode.max_running,
                                   tokenizer=self._tokenizer())
        self.scheduler = self.engine.scheduler  # admission here and into the running batch: one place
        self.metrics = Metrics()
        self.loop = DecodeLoop(self.engine, step_delay_s=self.config.fault_injection.decode_step_delay_ms / 1000.0,
                               metrics=self.metrics, on_freed=self._room_changed)
        self.prefill = PrefillClient()  # pinned calls to the prefill replica holding a request's pages
        self.receivers = make_decode_receivers(  # ticket.transport -> what receives it
            self.config, placement_of(self.config, "decode", self.pool.device), identity=replica_identity(),
            host=node_ip(), prefill=self.prefill,
            group=TPGroup(self.runtime.runner, self._tp_actors) if self._tp_actors else None)
        self.replica_id = replica_id()
        self.transfers: collections.Counter = collections.Counter()  # adopted, by transport
        self.transfer_failures = 0
        self.refused_full = 0
        self.completed = 0
        self._room: asyncio.Event | None = None  # set (and replaced) when room may have grown
        self._background: set[asyncio.Task] = set()

    def _start_tp_group(self) -> WorkerRuntime:
        """TP decode: this process is rank 0; the engine gets the ``LockstepRunner`` (sampling on
        this rank only). A failed rank ends the replica (``end_replica``): its streams fail as a
        dead replica's and the ingress resumes them elsewhere."""
        from serving.runtime import resolve_device
        from serving.tp_group import TP_DECODE_GRAPHS, end_replica, start_group

        lock, self._tp_actors = start_group(self.config, "decode", num_pages=pool_pages(self.config, "decode"),
                                            host=node_ip(), on_failure=end_replica,
                                            name_prefix=f"fptp_decode_rank:{replica_id()}")
        runtime = WorkerRuntime(self.config, None, lock.pool, lock, resolve_device(self.config))
        runtime.decode_graphs = TP_DECODE_GRAPHS
        if self.config.decode.cuda_graphs and runtime.device.type == "cuda":
            logger.warning("decode CUDA graphs: %s", TP_DECODE_GRAPHS)
        return runtime

    def _tokenizer(self) -> Any:
        """Structured output's tokenizer: the loaded model's, or (TP: rank 0 holds no whole
        model) loaded on its own."""
        if self.runtime.loaded is not None:
            return self.runtime.loaded.tokenizer
        from model_executor.loading import load_tokenizer

        return load_tokenizer(self.config.model.model)

    @property
    def committed_pages(self) -> int:
        """Pages claimed by adoptions in flight (adopted requests' pages are the pool's to count)."""
        return self.scheduler.claimed_pages

    def _room_changed(self) -> None:
        """Wake every waiting admission (each checks again); later waiters wait on a fresh event."""
        if self._room is not None:
            room, self._room = self._room, None
            room.set()

    async def _admit(self, rid: str, pages: int) -> bool:
        """Claim ``pages`` for ``rid``'s adoption (``DecodeScheduler.claim``), waiting up to
        ``decode.adopt_wait_s`` for room; a waiter wakes when pages may have gone back (a
        request left, a step or a cancel ran), not by polling."""
        if not self.scheduler.fits_ever(pages):
            return False
        deadline = time.monotonic() + self.config.decode.adopt_wait_s
        while not self.scheduler.claim(rid, pages):
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            if self._room is None:
                self._room = asyncio.Event()
            try:
                await asyncio.wait_for(self._room.wait(), timeout=left)
            except asyncio.TimeoutError:
                return self.scheduler.claim(rid, pages)  # a last look
        return True

    async def _leave(self, rid: str) -> None:
        """``rid`` no longer needs room: its claim (if still in flight) ends; waiters wake."""
        self.scheduler.settle(rid)
        self._room_changed()

    def _release_sender(self, ticket: Any) -> None:
        """Tell the prefill replica holding something for ``ticket`` under a lease (its pages,
        or an object-store frame's reference) that this replica is done with it (its IPC copy
        or fetch finished or failed, or it gave up before fetching). Fire and forget, off the
        request's path: a lost message only leaves the lease to its deadline."""
        sender = getattr(ticket, "sender", None)  # set by the prefill replica for every leased ticket
        if not isinstance(sender, dict):
            return  # nothing held
        task = self.prefill.release(sender, ticket.request_id)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def generate(self, call: DecodeCall, routing: dict | None = None):
        """Streaming: :class:`Adopted` (or :class:`TransferFailed`), then :class:`Tokens`."""
        rid = call.request_id
        ticket = call.ticket
        t0 = time.monotonic()
        # the most it may grow to (a group: shared pages once; a resume: less its history), and
        # what its adoption takes now (its growth comes page by page, DecodeScheduler)
        footprint = call.footprint(self.pool.page_size)
        pages = self.scheduler.adoption_pages(call.kv_len, len(call.choices) or 1)
        if footprint > self.pool.num_pages or not await self._admit(rid, pages):
            self.refused_full += 1
            self.metrics.inc("kv_transfers_total", transport=str(getattr(ticket, "transport", None)),
                             outcome=TransferFailure.POOL_EXHAUSTED.value)
            self._release_sender(ticket)
            fits = footprint <= self.pool.num_pages
            yield TransferFailed(reason=TransferFailure.POOL_EXHAUSTED.value, retryable=fits,
                                 message=(f"no room for {pages} pages within {self.config.decode.adopt_wait_s}s" if fits
                                          else f"{footprint} pages exceed this replica's {self.pool.num_pages}"),
                                 replica_id=self.replica_id)
            return
        submitted = False
        finished = False
        transport = getattr(ticket, "transport", None)
        released = False  # the sender's lease has ended: released here, or by the channel send itself
        try:
            try:
                receiver = self.receivers.get(transport)
                if receiver is None:
                    raise TransferError(TransferFailure.UNAVAILABLE,
                                        f"this replica receives {sorted(self.receivers)}, not {transport!r}", rid)
                await receiver.receive(ticket, self.pool)
                if receiver.releases_after_receive:  # the copy or fetch is done: what the sender holds goes now
                    self._release_sender(ticket)
                released = True
            except TransferError as exc:
                self.transfer_failures += 1
                self.metrics.inc("kv_transfers_total", transport=str(transport), outcome=exc.reason.value)
                logger.warning("KV transfer for %s over %s failed: %s (%s)", rid, transport, exc.reason.value, exc)
                # a channel that failed (not a full pool) is avoided for this request's retry
                fallback = "object_store" if transport != "object_store" and exc.reason is not TransferFailure.POOL_EXHAUSTED else None
                yield TransferFailed(reason=exc.reason.value, retryable=exc.retryable, message=str(exc),
                                     replica_id=self.replica_id, transport=transport, fallback=fallback)
                return
            self.transfers[transport] += 1
            self.metrics.inc("kv_transfers_total", transport=str(transport), outcome="adopted")
            self.metrics.observe("kv_transfer_seconds", time.monotonic() - t0)
            yield Adopted(replica_id=self.replica_id, transfer_s=time.monotonic() - t0,
                          num_pages=len(self.pool.pages(rid)))
            # a group: choice k decodes as its own request (``rid#k``) over a fork of the pages
            ids = [f"{rid}#{k}" for k in range(len(call.choices))] or [rid]
            index = {cid: k for k, cid in enumerate(ids)}
            outbox = self.loop.submit(rid, call.kv_len, call.first_token, call.params, call.history,
                                      tuple((cid, tok, p) for cid, (tok, p) in zip(ids, call.choices)))
            submitted = True
            live = set(ids)  # choices without their finished event yet
            t_submit, first_step_s = time.monotonic(), None
            while live:
                item = await outbox.get()
                batch = [item]
                while not outbox.empty():  # coalesce what is ready into one event per choice
                    batch.append(outbox.get_nowait())
                per_choice: dict[int, tuple[list, list, list]] = {}  # choice -> tokens, logprobs, [reason]
                for out in batch:
                    if isinstance(out, Exception):
                        live.clear()
                        raise out
                    k = index.get(out.request_id)
                    if k is None or ids[k] not in live and not out.finished:
                        continue
                    tokens, logprobs, reason = per_choice.setdefault(k, ([], [], []))
                    if out.token is not None:
                        tokens.append(int(out.token))
                        logprobs.append(out.logprob)
                    if out.finished and ids[k] in live:
                        live.discard(ids[k])
                        reason.append(out.finish_reason.value if out.finish_reason is not None else None)
                step_s = None
                if first_step_s is None:
                    # admission into the running batch + the step that decoded this request's first token
                    first_step_s = step_s = time.monotonic() - t_submit
                for k, (tokens, logprobs, reason) in sorted(per_choice.items()):
                    yield Tokens(tokens=tuple(tokens), finished=bool(reason), finish_reason=reason[0] if reason else None,
                                 first_step_s=step_s, logprobs=tuple(logprobs) if call.params.logprobs is not None else None,
                                 choice=k)
            finished = True
        finally:
            if not released:
                self._release_sender(ticket)
            if submitted and not finished:
                for cid in (ids if submitted else ()):  # client gone or stop string: the engine frees the pages
                    self.loop.cancel(cid)
            elif not submitted:
                for cid in dict.fromkeys([rid, *(f"{rid}#{k}" for k in range(len(call.choices)))]):
                    if self.pool.has(cid):
                        self.pool.release(cid)
            self.completed += 1
            await self._leave(rid)

    async def cancel_choice(self, request: CancelChoice, routing: dict | None = None) -> ChoiceCancelled:
        """Stop one choice of a group this replica decodes (the ingress found a stop string in
        it): its own pages go back now, the pages its siblings share stay theirs; the group's
        stream carries on with a ``cancelled`` finish for it. Called pinned to this replica.
        Unknown or ended choices: ``cancelled`` False."""
        bad = checked(request, CancelChoice)
        if bad is not None:
            return ChoiceCancelled(False, bad)
        rid, k = request.request_id, request.choice
        cid = f"{rid}#{k}"
        inbox = list(self.loop._inbox)
        live = (cid in self.loop._outboxes or any(isinstance(c, _Add) and any(x[0] == cid for x in c.choices)
                                                  for c in inbox)) and not any(
            isinstance(c, _Cancel) and c.request_id == cid for c in inbox)  # not already being cancelled
        if live:
            self.loop.cancel(cid)
        return ChoiceCancelled(live)

    # -- Serve hooks -------------------------------------------------------------------
    def record_routing_stats(self) -> dict:
        return {
            "running": self.engine.num_running,
            "waiting": self.engine.num_waiting,
            "streams": self.loop.num_streams,
            "max_running": self.engine.max_running,
            "tp_ranks": 1 + len(self._tp_actors),
            "kv_heads": int(self.pool.num_kv_heads),  # this rank's (all of them at TP=1)
            "free_pages": self.pool.free_pages,
            "num_pages": self.pool.num_pages,
            "room_pages": max(0, self.pool.free_pages - self.committed_pages),  # free, less adoptions in flight
            "pool_requests": self.pool.stats()["requests"],
            "completed": self.completed,
            "transfer_failures": self.transfer_failures,
            "transfers": dict(self.transfers),
            "refused_full": self.refused_full,
            "preempted": self.scheduler.preempted,
            "steps": self.loop.steps,
            "decode_graphs": self.runtime.decode_graphs,
            "metrics": self.metrics.status(),
            **self._graph_steps(),
            "rss_bytes": rss_bytes(),
            "replica_id": self.replica_id,
            **{k: v for r in self.receivers.values() for k, v in r.counters().items()},
        }

    def _graph_steps(self) -> dict:
        graphs = self.runtime.runner.decode_graphs
        return {f"decode_{k}": v for k, v in graphs.stats.items()} if graphs is not None else {}

    def record_autoscaling_stats(self) -> dict:
        """Serve's custom autoscaling metrics: what ``serving.autoscaling.DecodePolicy`` scales on
        (pages busy: in use, plus those claimed by adoptions in flight)."""
        in_use = self.pool.num_pages - self.pool.free_pages
        return {"running_streams": float(self.loop.num_streams),
                "kv_pages_busy": float(min(in_use + self.committed_pages, self.pool.num_pages)),
                "kv_pages": float(self.pool.num_pages)}

    def record_replica_metadata(self) -> dict:
        return {"role": "decode", "device": str(self.pool.device), "page_size": self.pool.page_size}

    async def stats(self) -> dict:
        """Routing stats, pool counters and this process's resident memory (tests, drills)."""
        return {**self.record_routing_stats(), **{f"pool_{k}": v for k, v in self.pool.stats().items()}}

    def check_health(self) -> None:
        task = self.loop._task
        if task is not None and task.done() and not task.cancelled() and task.exception() is not None:
            raise RuntimeError(f"decode loop died: {task.exception()!r}")
        for receiver in self.receivers.values():
            error = receiver.health_error()
            if error is not None:  # a failed IPC copy left the CUDA context unusable
                raise RuntimeError(f"CUDA context broken by a KV copy: {error}")
            # Serve's health-check period is also the clock that closes mappings of prefill
            # replicas that went away (a mapping can keep a dead replica's pool allocated)
            receiver.sweep()
        if self._tp_actors:
            from serving.tp_group import check_ranks

            check_ranks(self._tp_actors)

    def __del__(self) -> None:  # Serve calls it when the replica stops: close channels
        for receiver in getattr(self, "receivers", {}).values():
            receiver.close()



def make_decode_deployment(config: ServiceConfig, **options: Any):
    """The Serve deployment with this replica's defaults; ``options`` override (the ingress
    adds its request router: ``router.app.build_application``)."""
    defaults: dict[str, Any] = {
        "name": "DecodeServer",
        "max_ongoing_requests": config.decode.max_running * 2,
        "graceful_shutdown_timeout_s": 120.0,
        "health_check_period_s": 5.0,
    }
    autoscaling = autoscaling_config("decode", config.decode)
    if autoscaling is not None and "num_replicas" not in options:
        defaults["autoscaling_config"] = autoscaling
    defaults.update(options)
    if config.decode.tensor_parallel_size > 1 and "placement_group_bundles" not in defaults:
        from serving.tp_group import placement_options

        defaults.update(placement_options(config, "decode", defaults.get("ray_actor_options")))
    return serve.deployment(DecodeServer).options(**defaults)
