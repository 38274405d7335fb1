"""The prefill deployment: prefill-only replicas that ship their KV pages to decode replicas.

One replica = one :class:`PrefillServer` = one model copy, one KV pool, one
:class:`PrefillEngine` with the replica's one scheduler, and one :class:`PrefillLoop` (an
asyncio task that runs the engine a forward at a time off the event loop, so an arrival joins
at the next chunk boundary).

``prefill(call)`` is a plain (unary) call: it queues the prompt, and once prefilled (first
token sampled) exports the pages through the KV transport and returns one :class:`Prefilled`
(first token + transfer ticket). What happens to the pages then depends on the transport:
- the object store copies them into a frame at export: they are freed before ``prefill``
  returns;
- a channel (``nccl``/``gloo``) or CUDA IPC reads them out of this pool later, so they stay
  under a *lease* (``prefill_worker/leases.py``): state with a deadline
  (``transfer.lease_timeout_s``), swept by a timer, not a call held open. It ends when the
  channel send of the pages finishes (``send_pages``: the decode replica asked for them), when
  the decode replica (after its IPC copy, or giving up) or the ingress (abandoning the attempt)
  calls ``release_pages``, or at the deadline. A send still under way when a lease ends is
  answered as failed (the pages may be reused by then).
With ``cuda_ipc`` (``auto`` on CUDA) a decode replica on another GPU first calls
``stage_pages`` (pinned to this replica) to have the pages exported over the NCCL channel, then
``send_pages``. A TP replica (``prefill.tensor_parallel_size > 1``) ships over channels from every rank
(``kv_transfer.channel.group.TPChannelTransport``: ``send_pages`` names the rank, the leader
relays to it) or the object store (one merged frame). Into a TP decode group every decode rank
pulls its own heads; the lease ends once every send the receiver announced (``pulls``) has
succeeded, or at the first failure (``LeaseTable.sent``). CUDA IPC never joins a TP group
(``kv_transfer.choice.group_transport``). Which transport the replica holds is decided
once, at start (``serving.transports``: the placement and ``transfer.transport``); the side
calls go to it whatever it is (``KVSender.serves_sends`` / ``serves_stages``).
Leases take no ``max_ongoing_requests`` slot; a replica being scaled down ends
its leases only when it stops (``graceful_shutdown_timeout_s`` covers a lease's fetch).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from ray import serve

from kernels.ops import attention_kernel_calls
from kv_transfer.transfer import TransferFailure
from kv_transfer.wire import send_pulls
from prefill_worker.engine import PrefillEngine, PrefillRequest, PrefillResult, PrefillState
from prefill_worker.leases import Lease, LeaseTable
from serving.autoscaling import autoscaling_config
from serving.config import ServiceConfig
from serving.metrics import Metrics
from serving.errors import PrefillOutOfMemory, RequestError
from serving.messages import (
    PagesReleased,
    PrefillCall,
    Prefilled,
    ReleasePages,
    SendPages,
    SendReply,
    StagePages,
    StageReply,
    checked,
)
from serving.runtime import WorkerRuntime, node_ip, pool_pages, replica_id, replica_identity, rss_bytes
from serving.transports import TPGroup, make_prefill_transports, placement_of
from serving.costs import PrefillCostModel

logger = logging.getLogger("ray.serve")

# How long a stopping replica waits for its open leases to be fetched before freeing them: a
# transfer under way takes well under this; one that never comes ends at its deadline anyway.
LEASE_DRAIN_S = 20.0


@dataclass
class _Pending:
    request: PrefillRequest
    future: asyncio.Future
    enqueued_at: float = field(default_factory=time.monotonic)
    started_at: float | None = None  # its first forward began


class PrefillLoop:
    """The replica's step loop: an asyncio task that runs the engine one forward at a time in
    a worker thread, so that prompts arriving meanwhile join at the next forward (the engine's
    scheduler decides which: ``prefill_worker/scheduler.py``), and hands each finished
    prompt's result to the ``submit`` call waiting for it.

    ``max_queued_tokens``: a prompt that would take the waiting prompts' tokens past it is
    refused with 429 (retry later). ``batch_wait_s``: how long an idle loop waits after a first
    arrival for more to join its first forward, while they would not fill it."""

    def __init__(self, engine: PrefillEngine, *, max_batch_tokens: int, batch_wait_s: float,
                 max_queued_tokens: int, retry_after_s: int, metrics: Metrics | None = None,
                 step_delay_s: float = 0.0) -> None:
        self.engine = engine
        self.step_delay_s = step_delay_s  # fault-injection drills only
        self.pool = engine.pool
        self.max_batch_tokens = max_batch_tokens
        self.batch_wait_s = batch_wait_s
        self.max_queued_tokens = max_queued_tokens
        self.retry_after_s = retry_after_s
        self._pending: dict[str, _Pending] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self.batches = 0  # forwards run
        self.cancelled = dict.fromkeys(("queued", "prefilling"), 0)  # prompts dropped, by where they were
        self.metrics = metrics if metrics is not None else Metrics()

    # -- accounting (routing stats) ----------------------------------------------------
    @property
    def queued_tokens(self) -> int:
        return self.engine.waiting_tokens()

    @property
    def outstanding_cost(self) -> float:
        return self.engine.outstanding_cost()

    @property
    def num_queued(self) -> int:
        return self.engine.num_waiting()

    def pages_freed(self) -> None:
        """Pages came back: a prompt that waited for room may fit now."""
        self._wake.set()

    # -- submission --------------------------------------------------------------------
    async def submit(self, request: PrefillRequest) -> tuple[PrefillResult, float, float]:
        """Returns (result, seconds queued, seconds from its first forward to its first token)."""
        n = len(request.prompt_token_ids)
        need = self.pool.pages_for(n)
        if need > self.pool.num_pages:
            raise RequestError(
                f"prompt: {n} tokens need {need} KV pages; a prefill replica holds {self.pool.num_pages} "
                "(raise kv.prefill_pages or shorten the prompt)", param="prompt", status=400, code="prompt_too_long",
            )
        queued = self.queued_tokens
        if queued and queued + n > self.max_queued_tokens:
            raise RequestError(
                f"prefill replica overloaded: {queued} prompt tokens queued "
                f"(limit {self.max_queued_tokens}); retry later",
                status=429, code="overloaded", retry_after_s=self.retry_after_s,
            )
        loop = asyncio.get_running_loop()
        if self._task is None or self._task.done():
            self._task = loop.create_task(self._run())
        rid = request.request_id
        item = _Pending(request, loop.create_future())
        self.engine.add_request(request)
        self._pending[rid] = item
        self._wake.set()
        try:
            result = await asyncio.shield(item.future)
        except asyncio.CancelledError:
            self._drop(rid, item)
            raise
        finally:
            self._pending.pop(rid, None)
        started = item.started_at or item.enqueued_at
        return result, started - item.enqueued_at, time.monotonic() - started

    def _drop(self, rid: str, item: _Pending) -> None:
        """``rid``'s caller is gone (client disconnect, HTTP timeout, gRPC deadline or cancel:
        Serve cancels the call). A waiting prompt leaves the queue now; a prompt being prefilled
        stops at the end of the forward it is in (its pages go back then) or now, between two
        of its chunks; a result that came in the same turn has its pages freed here. Counted
        in ``requests_cancelled_total{stage}``."""
        state = self.engine.state(rid)
        fut = item.future
        failed = fut.done() and not fut.cancelled() and fut.exception() is not None
        if not self.engine.abort_request(rid) and fut.done() and not fut.cancelled() and not failed:
            if self.pool.has(rid):  # finished as the cancel came: nobody else will free its pages
                self.engine.release(rid)
        # (finished in the forward that is ending: the loop frees its pages, finding no caller)
        fut.cancel()
        if not failed:
            self.count_cancelled("queued" if state is PrefillState.WAITING else "prefilling")
        self._wake.set()  # pages may be back: a prompt that waited for room may fit

    def count_cancelled(self, stage: str) -> None:
        self.metrics.inc("requests_cancelled_total", stage=stage)
        self.cancelled[stage] += 1

    async def _run(self) -> None:
        while True:
            if not self.engine.has_unfinished():
                self._wake.clear()
                await self._wake.wait()
                if self.batch_wait_s > 0 and self.queued_tokens < self.max_batch_tokens:
                    await asyncio.sleep(self.batch_wait_s)  # let a first forward fill
                continue
            self._wake.clear()
            if self.step_delay_s:
                await asyncio.sleep(self.step_delay_s)  # a cancel that comes meanwhile drops its prompt first
            t0 = time.monotonic()
            try:
                out = await asyncio.to_thread(self.engine.step)
            except Exception:  # the engine fails a forward's prompts itself; this is a bug
                logger.exception("prefill step failed")
                await asyncio.sleep(0.1)
                continue
            if not out.chunks:  # no room for what waits: pages_freed() or a new arrival wakes us
                await self._wake.wait()
                continue
            self.batches += 1
            for c in out.chunks:
                item = self._pending.get(c.request_id)
                if item is not None and item.started_at is None:
                    # t0 can precede the arrival: a prompt added while the step's thread was
                    # starting still makes that step's schedule
                    item.started_at = max(t0, item.enqueued_at)
            for rid, exc in out.failed:
                if isinstance(exc, PrefillOutOfMemory):  # the engine logged the batch's one line
                    exc.retry_after_s = self.retry_after_s or 1
                else:
                    logger.error("prefill of %s failed: %r", rid, exc)
                item = self._pending.get(rid)
                if item is not None and not item.future.done():
                    item.future.set_exception(exc)
            for result in out.finished:
                item = self._pending.get(result.request_id)
                if item is None or item.future.done():  # its caller is gone
                    self.pool.release(result.request_id)
                    self._wake.set()
                else:
                    item.future.set_result(result)
            self._record(out, time.monotonic() - t0)

    def _record(self, out, seconds: float) -> None:
        m = self.metrics
        m.inc("prefill_tokens_total", out.num_tokens)
        prompt = sum(r.kv_len for r in out.finished)
        if prompt:
            m.inc("prefix_cache_queries_total", prompt)
            m.inc("prefix_cache_hits_total", sum(r.cached_tokens for r in out.finished))
        m.observe("prefill_batch_seconds", seconds)
        m.set("prefill_queued_requests", self.num_queued)
        m.set("prefill_queued_tokens", self.queued_tokens)
        m.pool("prefill", self.pool)


class PrefillServer:
    """A prefill replica (see the module docstring)."""

    def __init__(self, config: dict | None = None) -> None:
        self.config = ServiceConfig.from_dict(config)
        self._tp_actors: list = []
        if self.config.prefill.tensor_parallel_size > 1:  # serving/tp_group.py: rank 0 here, the rest actors
            from serving.runtime import resolve_device
            from serving.tp_group import end_replica, start_group

            lock, self._tp_actors = start_group(self.config, "prefill", num_pages=pool_pages(self.config, "prefill"),
                                                host=node_ip(), on_failure=end_replica,
                                                name_prefix=f"fptp_rank:{replica_id()}")
            self.runtime = WorkerRuntime(self.config, None, lock.pool, lock, resolve_device(self.config))
        else:
            self.runtime = WorkerRuntime.build(self.config, num_pages=pool_pages(self.config, "prefill"))
        self.pool = self.runtime.pool
        self.cost_model = PrefillCostModel.for_config(self.config)
        self.engine = PrefillEngine(self.runtime.runner, max_batch_tokens=self.config.prefill.max_batch_tokens,
                                    chunk_size=self.config.prefill.chunk_size,
                                    prefix_cache=self.config.prefill.prefix_caching,
                                    policy=self.config.prefill.schedule, max_wait_s=self.config.prefill.max_wait_s,
                                    cost=self.cost_model.cost, tokenizer=self._tokenizer())
        self.engine.oom_above_tokens = self.config.fault_injection.prefill_out_of_memory_tokens
        self.loop = PrefillLoop(
            self.engine, max_batch_tokens=self.config.prefill.max_batch_tokens,
            batch_wait_s=self.config.prefill.batch_wait_ms / 1000.0,
            max_queued_tokens=self.config.prefill.max_queued_tokens, retry_after_s=self.config.ingress.retry_after_s,
            step_delay_s=self.config.fault_injection.prefill_step_delay_ms / 1000.0,
        )
        self.identity = replica_identity()  # how tickets name this replica (release_pages)
        transports = make_prefill_transports(
            self.config, placement_of(self.config, "prefill", self.pool.device), identity=self.identity,
            host=node_ip(), group=TPGroup(self.runtime.runner, self._tp_actors) if self._tp_actors else None)
        self.transport, self.object_store = transports.sender, transports.object_store
        self.replica_id = replica_id()
        self._faults_left = self.config.fault_injection.corrupt_transfers
        self.leases = LeaseTable(self.config.transfer.lease_timeout_s, self._end_lease)
        self.active = 0  # prefill() calls in progress (queued or prefilling)
        self.completed = 0

    def _tokenizer(self) -> Any:
        """The model's tokenizer (guided decoding of the first token): the loaded model's, or
        on a TP replica (whose rank 0 holds no whole model) loaded on its own."""
        loaded = self.runtime.loaded
        if loaded is not None:
            return loaded.tokenizer
        from model_executor.loading import load_tokenizer

        return load_tokenizer(self.config.model.model)

    # -- the request path ----------------------------------------------------------------
    async def prefill(self, call: PrefillCall, routing: dict | None = None) -> Prefilled:
        """Prefill ``call``'s prompt; returns its first token and transfer ticket (see the
        module docstring for what becomes of the pages)."""
        rid = call.request_id
        self.active += 1
        try:
            if self.config.fault_injection.prefill_delay_ms:  # drills: a window to kill us mid-prefill
                await asyncio.sleep(self.config.fault_injection.prefill_delay_ms / 1000.0)
            result, queue_s, prefill_s = await self.loop.submit(PrefillRequest(rid, call.prompt_token_ids, call.params,
                                                                               sparse_alpha=call.sparse_alpha,
                                                                               choices=tuple(call.choices),
                                                                               sparse_options=tuple(call.sparse_options)))
            # a retry after a failed channel transfer asks for the object store
            exporter = self.object_store if call.transport == "object_store" else self.transport
            ticket, leased, exporting = None, False, False
            try:
                fault = None
                if self._faults_left > 0 and self.config.fault_injection.mode in exporter.fault_modes:
                    self._faults_left -= 1
                    fault = self.config.fault_injection.mode
                t_export = time.monotonic()
                if not call.ended_by(result.first_tokens or (result.first_token,)):
                    export = asyncio.ensure_future(asyncio.to_thread(exporter.export, self.pool, rid, fault=fault))
                    try:
                        ticket = await asyncio.shield(export)
                    except asyncio.CancelledError:
                        # the export's thread still reads the pages: they go back when it is done
                        export.add_done_callback(lambda done: self._drop_export(rid, exporter, done))
                        exporting = True  # what it holds is the callback's to free, not the finally's
                        self.loop.count_cancelled("prefilling")
                        raise
                export_s = time.monotonic() - t_export
                if ticket is not None and (exporter.reads_pages_after_export or exporter.keeps_frame_until_released):
                    ticket = dataclasses.replace(ticket, sender=self.identity)  # where release_pages goes
                    if rid in self.leases and not self.leases.holds_pages(rid):
                        # a new attempt of the request (its transfer failed) while the old frame is still held
                        self.leases.end(rid, "released")
                    self.leases.grant(rid, ticket, exporter, holds_pages=exporter.reads_pages_after_export)
                    self.leases.start()
                    leased = True
                return Prefilled(request_id=rid, first_token=int(result.first_token), kv_len=int(result.kv_len),
                                 cached_tokens=int(result.cached_tokens), ticket=ticket, replica_id=self.replica_id,
                                 queue_s=queue_s, prefill_s=prefill_s, export_s=export_s,
                                 first_logprob=result.first_logprob, prompt_logprobs=result.prompt_logprobs,
                                 first_tokens=tuple(int(t) for t in result.first_tokens),
                                 first_logprobs=tuple(result.first_logprobs),
                                 block_density=result.block_density)
            finally:
                if not leased and not exporting:  # nothing was shipped or held, or the export failed
                    if ticket is not None and exporter.reads_pages_after_export:
                        exporter.discard(ticket)
                    self._free(rid)
                elif leased and not exporter.reads_pages_after_export:  # a frame: its lease holds the copy, not the pages
                    self._free(rid)
        finally:
            self.active -= 1
            self.completed += 1

    def _free(self, rid: str) -> None:
        if self.pool.has(rid):
            self.engine.release(rid)
            self.loop.pages_freed()

    def _drop_export(self, rid: str, exporter: Any, export: asyncio.Future) -> None:
        """An export whose caller was cancelled has ended: what it made is discarded and the
        request's pages go back."""
        if not export.cancelled() and export.exception() is None and exporter.reads_pages_after_export:
            exporter.discard(export.result())
        self._free(rid)

    def _end_lease(self, lease: Lease, reason: str) -> None:
        lease.exporter.discard(lease.ticket)  # a channel's export record; a send under way then fails
        if lease.holds_pages:  # a frame's lease drops its reference only (with the ticket)
            self._free(lease.request_id)

    async def release_pages(self, request: ReleasePages, routing: dict | None = None) -> PagesReleased:
        """End a lease: the decode replica is done with the pages (its IPC copy finished or
        failed, or it gave up before fetching), or the ingress abandoned the attempt. Idempotent;
        called pinned to this replica. ``ended``: False when no lease was held."""
        bad = checked(request, ReleasePages)
        if bad is not None:
            return PagesReleased(False, bad)
        return PagesReleased(self.leases.end(request.request_id, "released"))

    async def send_pages(self, request: SendPages, routing: dict | None = None) -> SendReply:
        """Channel transports: a decode replica (or one rank of a TP decode group) that
        reserved room for a request's pages asks this replica (which holds them, under a lease)
        to send them, or some of their KV heads, over their channel. A TP replica's rank named
        in the request sends its own heads (the leader relays). The lease ends at the first
        failed send (a failed transfer is retried with a new prefill, never by sending these
        pages again) or once every send the receiver announced (``pulls``: one per (prefill
        rank, decode rank) route) has succeeded (``LeaseTable.sent``)."""
        if not self.transport.serves_sends:  # refused before it could end a lease
            return SendReply(False, TransferFailure.UNAVAILABLE.value,
                             f"this replica ships KV pages with {self.transport.name!r}, not over channels")
        reply = await self.transport.serve_send(request)
        if isinstance(request, SendPages) and isinstance(request.request_id, str):
            self.leases.sent(request.request_id, isinstance(reply, SendReply) and reply.ok is True,
                             send_pulls(request))
        return reply

    async def stage_pages(self, request: StagePages, routing: dict | None = None) -> StageReply:
        """cuda_ipc with a fallback: a decode replica on another GPU asks this replica to export
        a leased request's pages over the fallback channel; the reply carries that ticket."""
        if not self.transport.serves_stages:
            return StageReply(False, TransferFailure.UNAVAILABLE.value,
                              f"this replica ships KV pages with {self.transport.name!r}, not cuda_ipc")
        # a device gather and checksum: off the event loop
        return await asyncio.to_thread(self.transport.serve_stage, self.pool, request)

    async def clear_prefix_cache(self, routing: dict | None = None) -> dict:
        """Drop this replica's cached prefixes (pages that requests hold stay theirs), e.g. so
        that a benchmark's load cell starts cold; call it pinned (``routing_hint(replica=...)``)
        to reach a given replica. Returns how many pages were dropped and this replica's id."""
        return {"cleared": self.pool.clear_prefix_cache(), "replica_id": self.replica_id}

    # -- Serve hooks -------------------------------------------------------------------
    def record_routing_stats(self) -> dict:
        return {
            "outstanding_cost": self.loop.outstanding_cost,
            "queued": self.loop.num_queued,
            "queued_tokens": self.loop.queued_tokens,
            "free_pages": self.pool.free_pages,
            "num_pages": self.pool.num_pages,
            "tp_ranks": 1 + len(self._tp_actors),
            "kv_heads": int(self.pool.num_kv_heads),
            "leased": len(self.leases),
            "leases_ended": dict(self.leases.ended),
            "active": self.active,
            "pool_requests": self.pool.stats()["requests"],
            "completed": self.completed,
            "batches": self.loop.batches,
            "cancelled": dict(self.loop.cancelled),
            "rss_bytes": rss_bytes(),
            "replica_id": self.replica_id,
            "attention_kernels": attention_kernel_calls(),  # which kernel "auto" ran, per layer call
            "metrics": self.loop.metrics.status(),
            **self.transport.counters(),
        }

    def record_autoscaling_stats(self) -> dict:
        """Serve's custom autoscaling metrics: what ``serving.autoscaling.PrefillPolicy`` scales on."""
        return {"queued_tokens": float(self.loop.queued_tokens), "queued_requests": float(self.loop.num_queued)}

    def record_replica_metadata(self) -> dict:
        return {"role": "prefill", "device": str(self.pool.device), "page_size": self.pool.page_size}

    async def stats(self) -> dict:
        """Routing stats, pool counters and this process's resident memory (tests, drills)."""
        return {**self.record_routing_stats(), **{f"pool_{k}": v for k, v in self.pool.stats().items()}}

    def check_health(self) -> None:
        task = self.loop._task
        if task is not None and task.done() and not task.cancelled() and task.exception() is not None:
            raise RuntimeError(f"prefill batching loop died: {task.exception()!r}")
        if self._tp_actors:
            from serving.tp_group import check_ranks

            check_ranks(self._tp_actors)

    def __del__(self):
        """Serve calls it when the replica stops, after its ongoing calls have drained, and
        awaits what it returns: with leases still open (their decode replicas may be mid-fetch)
        that is :meth:`_drain`. Called by the garbage collector outside an event loop, it just
        closes."""
        leases = getattr(self, "leases", None)
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            leases = None
        if leases is not None and len(leases):
            return self._drain()
        self.close()
        return None

    async def _drain(self) -> None:
        """Let the open leases be fetched for up to ``LEASE_DRAIN_S``, then end them and close."""
        deadline = time.monotonic() + LEASE_DRAIN_S
        while len(self.leases) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
            self.leases.sweep()
        self.close()

    def close(self) -> None:
        """End every lease and close the transport (idempotent)."""
        leases = getattr(self, "leases", None)
        if leases is not None:
            leases.stop()
            leases.end_all("stopped")
        transport = getattr(self, "transport", None)
        if transport is not None:
            transport.close()


def make_prefill_deployment(config: ServiceConfig, **options: Any):
    """The Serve deployment with this replica's defaults; ``options`` override (the ingress
    adds its request router: ``router.app.build_application``)."""
    defaults: dict[str, Any] = {
        "name": "PrefillServer",
        "max_ongoing_requests": 256,  # prefill calls only: leases are state, not calls
        "graceful_shutdown_timeout_s": max(30.0, LEASE_DRAIN_S + 10.0),
        "health_check_period_s": 5.0,
    }
    autoscaling = autoscaling_config("prefill", config.prefill)
    if autoscaling is not None and "num_replicas" not in options:
        defaults["autoscaling_config"] = autoscaling
    defaults.update(options)
    if config.prefill.tensor_parallel_size > 1 and "placement_group_bundles" not in defaults:
        from serving.tp_group import placement_options

        defaults.update(placement_options(config, "prefill", defaults.get("ray_actor_options")))
    return serve.deployment(PrefillServer).options(**defaults)
