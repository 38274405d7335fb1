"""The prefill deployment: prefill-only replicas that ship their KV pages to decode replicas.

One replica = one :class:`PrefillServer` = one model copy, one KV pool, one
:class:`PrefillBatcher` (an asyncio loop that groups waiting prompts into forward batches by
a token budget and runs ``PrefillEngine.prefill`` off the event loop).

``prefill(request)`` is a *streaming* method and doubles as the page lease:
1. it queues the prompt, and once prefilled (first token sampled) exports the pages through
   the KV transport and yields one ``prefilled`` event (first token + transfer ticket);
2. it then keeps the pages until the caller closes the stream, which the ingress does once
   the decode replica has acknowledged (adopted) them, or until ``lease_timeout_s``;
3. its ``finally`` releases the pages, whatever happened (client gone, decode failure,
   ingress crash).
With channel transports (``nccl``/``gloo``) the export copies nothing: the decode replica that
adopts the pages calls ``send_pages`` on this very replica (a call pinned by the router) while
the lease is open, and the pages are read from the pool as they are sent. A send still under
way when the lease ends is answered as failed (the pages may be reused by then).
With ``cuda_ipc`` (``auto`` on CUDA) a decode replica on the same GPU copies the pages straight
out of this replica's pool during the lease; one on another GPU first calls ``stage_pages``
(pinned too) to have them exported over the NCCL channel, then ``send_pages``.
Because the lease is an ongoing request, a replica being scaled down drains it before it
stops: pages a decode replica is still fetching are never pulled away.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from ray import serve

from kernels.ops import attention_kernel_calls
from kv_transfer.channel import ChannelTransport
from kv_transfer.ipc import CudaIpcTransport
from kv_transfer.transfer import IPC_OR_NCCL, KVTransport, ObjectStoreTransport, TransferFailure, select_transport
from prefill_worker.engine import PrefillEngine, PrefillRequest, PrefillResult
from router.config import PREFILL_SCHEDULES, ServiceConfig
from router.metrics import Metrics
from router.protocol import RequestError, params_from_dict
from router.runtime import WorkerRuntime, node_ip, replica_id, replica_identity, rss_bytes
from router.scheduling import PrefillCostModel

logger = logging.getLogger("ray.serve")


@dataclass
class _Queued:
    request: PrefillRequest
    cost: float
    future: asyncio.Future
    enqueued_at: float = field(default_factory=time.monotonic)
    started_at: float | None = None


class PrefillBatcher:
    """Groups waiting prompts into prefill batches bounded by ``max_batch_tokens`` and by the
    pool's free pages; runs one batch at a time in a worker thread.

    ``schedule``: the order in which waiting prompts enter batches. ``"fcfs"``: arrival order,
    and a prompt waiting for free pages holds back the ones behind it (no overtaking, no
    starvation). ``"shortest_first"``: least causal work first (the router's cost of each prompt;
    ties in arrival order), which cuts the median TTFT of an overloaded replica at the expense
    of its long prompts; a prompt that has waited ``max_wait_s`` or more goes ahead of every
    younger one (arrival order among them), which bounds how long a long prompt can be passed over."""

    def __init__(self, engine: PrefillEngine, *, max_batch_tokens: int, batch_wait_s: float,
                 max_queued_tokens: int, retry_after_s: int, schedule: str = "fcfs",
                 max_wait_s: float = 30.0, metrics: Metrics | None = None) -> None:
        if schedule not in PREFILL_SCHEDULES:
            raise ValueError(f"schedule: expected one of {PREFILL_SCHEDULES}, got {schedule!r}")
        self.engine = engine
        self.pool = engine.pool
        self.max_batch_tokens = max_batch_tokens
        self.batch_wait_s = batch_wait_s
        self.max_queued_tokens = max_queued_tokens
        self.retry_after_s = retry_after_s
        self.schedule = schedule
        self.max_wait_s = max_wait_s
        self._queue: collections.deque[_Queued] = collections.deque()
        self._running: list[_Queued] = []
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self.batches = 0
        self.metrics = metrics if metrics is not None else Metrics()

    # -- accounting (routing stats) ----------------------------------------------------
    @property
    def queued_tokens(self) -> int:
        return sum(len(q.request.prompt_token_ids) for q in self._queue)

    @property
    def outstanding_cost(self) -> float:
        return sum(q.cost for q in self._queue) + sum(q.cost for q in self._running)

    @property
    def num_queued(self) -> int:
        return len(self._queue)

    def pages_freed(self) -> None:
        """Pages came back: a batch that waited for room may fit now."""
        self._wake.set()

    # -- submission --------------------------------------------------------------------
    async def submit(self, request: PrefillRequest, cost: float) -> tuple[PrefillResult, float, float]:
        """Returns (result, seconds queued, seconds in the forward)."""
        n = len(request.prompt_token_ids)
        need = self.pool.pages_for(n)
        if need > self.pool.num_pages:
            raise RequestError(
                f"prompt: {n} tokens need {need} KV pages; a prefill replica holds {self.pool.num_pages} "
                "(raise prefill_kv_pages or shorten the prompt)", param="prompt", status=400, code="prompt_too_long",
            )
        if self._queue and self.queued_tokens + n > self.max_queued_tokens:
            raise RequestError(
                f"prefill replica overloaded: {self.queued_tokens} prompt tokens queued "
                f"(limit {self.max_queued_tokens}); retry later",
                status=429, code="overloaded", retry_after_s=self.retry_after_s,
            )
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run())
        item = _Queued(request, cost, asyncio.get_running_loop().create_future())
        self._queue.append(item)
        self._wake.set()
        try:
            result = await asyncio.shield(item.future)
        except asyncio.CancelledError:
            if item in self._queue:
                self._queue.remove(item)
            else:  # in the running batch: its pages are released when the batch completes
                item.future.add_done_callback(self._release_orphan)
            raise
        started = item.started_at or item.enqueued_at
        return result, started - item.enqueued_at, time.monotonic() - started

    def _release_orphan(self, future: asyncio.Future) -> None:
        if not future.cancelled() and future.exception() is None:
            self.pool.release(future.result().request_id)

    def _in_order(self) -> list[_Queued]:
        """The queue in the order of ``schedule``."""
        if self.schedule == "fcfs":
            return list(self._queue)
        now = time.monotonic()
        overdue = [q for q in self._queue if now - q.enqueued_at >= self.max_wait_s]
        younger = [q for q in self._queue if now - q.enqueued_at < self.max_wait_s]
        return overdue + sorted(younger, key=lambda q: q.cost)  # stable: ties stay in arrival order

    def _next_batch(self) -> list[_Queued]:
        budget, free = self.max_batch_tokens, self.pool.free_pages
        batch: list[_Queued] = []
        for item in self._in_order():
            n = len(item.request.prompt_token_ids)
            need = self.pool.pages_for(n)
            if batch and n > budget:
                break
            if need > free:
                break  # wait for released pages: nothing behind it overtakes (no starvation)
            batch.append(item)
            budget -= n
            free -= need
        for item in batch:
            self._queue.remove(item)
        return batch

    async def _run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            if self._queue and self.batch_wait_s > 0 and self.queued_tokens < self.max_batch_tokens:
                await asyncio.sleep(self.batch_wait_s)  # let a batch form
            while self._queue:
                batch = self._next_batch()
                if not batch:
                    break  # no room in the pool: pages_freed() wakes us
                now = time.monotonic()
                for item in batch:
                    item.started_at = now
                self._running = batch
                try:
                    results = await asyncio.to_thread(self.engine.prefill, [b.request for b in batch])
                except Exception as exc:  # the engine released the batch's pages
                    logger.exception("prefill batch failed")
                    for item in batch:
                        if not item.future.done():
                            item.future.set_exception(exc)
                    continue
                finally:
                    self._running = []
                    self.batches += 1
                for item, result in zip(batch, results):
                    if item.future.done():  # cancelled by the caller meanwhile
                        self.pool.release(result.request_id)
                    else:
                        item.future.set_result(result)
                self._record(batch, results, time.monotonic() - now)

    def _record(self, batch: list, results: list, seconds: float) -> None:
        m = self.metrics
        prompt = sum(len(item.request.prompt_token_ids) for item in batch)
        cached = sum(r.cached_tokens for r in results)
        m.inc("prefill_tokens_total", prompt - cached)
        m.inc("prefix_cache_queries_total", prompt)
        m.inc("prefix_cache_hits_total", cached)
        m.observe("prefill_batch_seconds", seconds)
        m.set("prefill_queued_requests", self.num_queued)
        m.set("prefill_queued_tokens", self.queued_tokens)
        m.pool("prefill", self.pool)


class PrefillServer:
    """A prefill replica (see the module docstring)."""

    def __init__(self, config: dict | None = None) -> None:
        self.config = ServiceConfig.from_dict(config)
        self.runtime = WorkerRuntime.build(self.config, num_pages=self.config.prefill_kv_pages)
        self.pool = self.runtime.pool
        self.engine = PrefillEngine(self.runtime.runner, max_batch_tokens=self.config.max_batch_tokens,
                                    chunk_size=self.config.prefill_chunk_size,
                                    prefix_cache=self.config.prefix_caching)
        self.cost_model = PrefillCostModel(dense_below=self.config.dense_below,
                                           expected_density=self.config.expected_density)
        self.batcher = PrefillBatcher(
            self.engine, max_batch_tokens=self.config.max_batch_tokens,
            batch_wait_s=self.config.batch_wait_ms / 1000.0,
            max_queued_tokens=self.config.max_queued_prefill_tokens, retry_after_s=self.config.retry_after_s,
            schedule=self.config.prefill_schedule, max_wait_s=self.config.prefill_max_wait_s,
        )
        self.object_store = ObjectStoreTransport()
        self.transport = self._make_transport()
        self.replica_id = replica_id()
        self._faults_left = self.config.fault_injection.corrupt_transfers
        self._leases: dict[str, float] = {}  # request id -> lease deadline (monotonic)
        self.active = 0  # prefill() calls in progress (queued, prefilling or holding a lease)
        self.completed = 0

    def _make_transport(self) -> KVTransport:
        kind = select_transport(self.config.transport, device=self.pool.device)
        if kind == "object_store":
            return self.object_store
        if kind in ("cuda_ipc", IPC_OR_NCCL):
            fallback = ChannelTransport(self.pool.device, host=node_ip(), identity=replica_identity()) \
                if kind == IPC_OR_NCCL else None
            return CudaIpcTransport(identity=replica_identity(), fallback=fallback,
                                    lease_timeout_s=self.config.lease_timeout_s)
        return ChannelTransport(self.pool.device, host=node_ip(), identity=replica_identity())

    def _channel(self) -> ChannelTransport | None:
        """The channel this replica sends over: its transport, or the fallback of cuda_ipc."""
        transport = self.transport
        if isinstance(transport, CudaIpcTransport):
            transport = transport.fallback
        return transport if isinstance(transport, ChannelTransport) else None

    # -- the request path ----------------------------------------------------------------
    async def prefill(self, request: dict, routing: dict | None = None):
        """Streaming: yields one ``prefilled`` event, then holds the pages until closed."""
        rid = str(request["request_id"])
        ids = [int(t) for t in request["prompt_token_ids"]]
        params = params_from_dict(request["params"])
        cost = self.cost_model.cost(len(ids))
        self.active += 1
        try:
            if self.config.fault_injection.prefill_delay_ms:  # drills: a window to kill us mid-prefill
                await asyncio.sleep(self.config.fault_injection.prefill_delay_ms / 1000.0)
            result, queue_s, prefill_s = await self.batcher.submit(PrefillRequest(rid, ids, params), cost)
        except BaseException:
            self.active -= 1
            self.completed += 1
            raise
        # a retry after a failed channel transfer asks for the object store
        exporter = self.object_store if request.get("transport") == "object_store" else self.transport
        ticket = None
        try:
            fault = None
            if self._faults_left > 0 and self.config.fault_injection.mode in exporter.fault_modes:
                self._faults_left -= 1
                fault = self.config.fault_injection.mode
            t_export = time.monotonic()
            if not request.get("skip_transfer"):
                ticket = await asyncio.to_thread(exporter.export, self.pool, rid, fault=fault)
            export_s = time.monotonic() - t_export
            self._leases[rid] = time.monotonic() + self.config.lease_timeout_s
            yield {
                "type": "prefilled",
                "request_id": rid,
                "first_token": int(result.first_token),
                "kv_len": int(result.kv_len),
                "cached_tokens": int(result.cached_tokens),
                "ticket": ticket,
                "replica_id": self.replica_id,
                "queue_s": queue_s,
                "prefill_s": prefill_s,
                "export_s": export_s,
            }
            if ticket is not None:
                # The lease: the caller closes this stream once the decode side has the pages.
                await asyncio.sleep(self.config.lease_timeout_s)
                logger.warning("prefill lease of %s expired after %.0fs; releasing its pages", rid, self.config.lease_timeout_s)
        finally:
            self._leases.pop(rid, None)
            if ticket is not None:
                exporter.discard(ticket)  # a channel's export record; a send under way then fails
            if self.pool.has(rid):
                self.engine.release(rid)
                self.batcher.pages_freed()
            self.active -= 1
            self.completed += 1

    async def send_pages(self, request: dict, routing: dict | None = None) -> dict:
        """Channel transports: a decode replica that reserved room for a request's pages asks
        this replica (which holds them, under a lease) to send them over their channel."""
        channel = self._channel()
        if channel is None:
            return {"ok": False, "reason": TransferFailure.UNAVAILABLE.value,
                    "message": f"this replica ships KV pages with {self.transport.name!r}, not over channels"}
        return await channel.serve_send(request)

    async def stage_pages(self, request: dict, routing: dict | None = None) -> dict:
        """cuda_ipc with a fallback: a decode replica on another GPU asks this replica to export
        a leased request's pages over the fallback channel; the reply carries that ticket."""
        if not isinstance(self.transport, CudaIpcTransport):
            return {"ok": False, "reason": TransferFailure.UNAVAILABLE.value, "ticket": None,
                    "message": f"this replica ships KV pages with {self.transport.name!r}, not cuda_ipc"}
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
            "outstanding_cost": self.batcher.outstanding_cost,
            "queued": self.batcher.num_queued,
            "queued_tokens": self.batcher.queued_tokens,
            "free_pages": self.pool.free_pages,
            "num_pages": self.pool.num_pages,
            "leased": len(self._leases),
            "active": self.active,
            "pool_requests": self.pool.stats()["requests"],
            "completed": self.completed,
            "batches": self.batcher.batches,
            "rss_bytes": rss_bytes(),
            "replica_id": self.replica_id,
            "attention_kernels": attention_kernel_calls(),  # which kernel "auto" ran, per layer call
            "metrics": self.batcher.metrics.status(),
            **self.transport.counters(),
        }

    def record_replica_metadata(self) -> dict:
        return {"role": "prefill", "device": str(self.pool.device), "page_size": self.pool.page_size}

    async def stats(self) -> dict:
        """Routing stats, pool counters and this process's resident memory (tests, drills)."""
        return {**self.record_routing_stats(), **{f"pool_{k}": v for k, v in self.pool.stats().items()}}

    def check_health(self) -> None:
        task = self.batcher._task
        if task is not None and task.done() and not task.cancelled() and task.exception() is not None:
            raise RuntimeError(f"prefill batching loop died: {task.exception()!r}")

    def __del__(self) -> None:  # Serve calls it when the replica stops: close channels
        transport = getattr(self, "transport", None)
        if transport is not None:
            transport.close()



def make_prefill_deployment(config: ServiceConfig, **options: Any):
    """The Serve deployment with this project's router and defaults; ``options`` override."""
    from ray.serve.config import RequestRouterConfig

    from router.scheduling import PrefillRequestRouter

    defaults: dict[str, Any] = {
        "name": "PrefillServer",
        "max_ongoing_requests": 256,  # includes page leases, which are cheap
        "request_router_config": RequestRouterConfig(
            request_router_class=PrefillRequestRouter,
            request_routing_stats_period_s=0.5,
            request_routing_stats_timeout_s=5.0,
        ),
        "graceful_shutdown_timeout_s": max(30.0, config.lease_timeout_s / 2),
        "health_check_period_s": 5.0,
    }
    defaults.update(options)
    return serve.deployment(PrefillServer).options(**defaults)
