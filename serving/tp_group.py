"""A tensor-parallel replica's ranks on Ray: the replica process is rank 0 (the leader), ranks
``1..N-1`` are :class:`RankActor` actors in the replica's placement group (one bundle each,
``placement_group_strategy="STRICT_PACK"``: :func:`placement_options`), joined with the leader by
a gloo (CPU) / NCCL (GPU) process group built on a TCP store the leader hosts (no default
group: the replica's KV channels build their own groups next to it). The leader's engine drives
them through ``model_executor.parallel.LockstepRunner`` with one :class:`RayRankLink` per
follower; a dead follower is ``RankFailed``: the replica must be replaced (:func:`end_replica`).

Used by both deployments (docs/ARCHITECTURE.md "Tensor parallelism"):
- prefill (``prefill.tensor_parallel_size > 1``): every rank sends its own KV heads over its own
  channels (:func:`make_tp_channel_exporter`), or one object-store frame merged from every
  rank's KV heads (:func:`make_tp_exporter`), so decode replicas of any TP receive it;
- decode (``decode.tensor_parallel_size > 1``): the replica's ``DecodeEngine`` (one scheduler,
  sampling on the leader only: the followers' logits, equal by construction, are dropped) drives
  the ranks through the ``LockstepRunner``; over channels every rank pulls its own KV heads at
  once (:func:`make_tp_channel_receiver`), an object-store frame is verified once, split by KV
  head (``kv_transfer.tp_transfer.split_frame``) and adopted by every rank
  (:func:`make_tp_receiver`); all or nothing either way. Decode CUDA graphs stay off under TP
  (:data:`TP_DECODE_GRAPHS`).
"""

from __future__ import annotations

import dataclasses
import datetime
import threading
from typing import Any

import torch

from model_executor.parallel import shard_of

from .config import ServiceConfig
from .runtime import resolve_device, resolve_dtype

RANK_TIMEOUT_S = 300.0  # a follower's step (a long prefill) before the leader calls it dead


def placement_options(config: ServiceConfig, side: str, ray_actor_options: dict | None = None) -> dict:
    """Serve deployment options for one replica per TP group: ``placement_group_bundles`` (the
    replica's own resources, then one bundle per follower rank) packed on one node."""
    size = getattr(config, side).tensor_parallel_size
    if size == 1:
        return {}
    opts = dict(ray_actor_options or {})
    first = {"CPU": float(opts.get("num_cpus", 1))}
    if opts.get("num_gpus"):
        first["GPU"] = float(opts["num_gpus"])
    first.update({k: float(v) for k, v in (opts.get("resources") or {}).items()})
    rank = {"CPU": 1.0, **({"GPU": first["GPU"]} if "GPU" in first else {}),
            **{k: v for k, v in first.items() if k not in ("CPU", "GPU")}}
    return {"placement_group_bundles": [first] + [dict(rank) for _ in range(size - 1)],
            "placement_group_strategy": "STRICT_PACK"}


def _process_group(host: str, port: int, rank: int, size: int, *, is_master: bool, device: torch.device,
                   timeout_s: float, store: Any = None):
    from torch.distributed import PrefixStore, TCPStore

    timeout = datetime.timedelta(seconds=timeout_s)
    if store is None:
        store = TCPStore(host, port, None, is_master, timeout)
    store = PrefixStore("fptp/", store)
    if device.type == "cuda":
        from torch.distributed import ProcessGroupNCCL

        opts = ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return ProcessGroupNCCL(store, rank, size, opts)
    from torch.distributed import ProcessGroupGloo

    opts = ProcessGroupGloo._Options()
    opts._timeout = timeout
    opts._devices = [ProcessGroupGloo.create_device(hostname=host)]
    return ProcessGroupGloo(store, rank, size, opts)


def build_rank_runner(config: ServiceConfig, side: str, tp: Any, num_pages: int):
    """One rank's ``ModelRunner``: its shard of the model and a pool of its KV heads."""
    from model_executor.loading import load_model, make_pool
    from model_executor.runner import ModelRunner

    device = resolve_device(config)
    dtype = resolve_dtype(config, device)
    loaded = load_model(config.model.model, dtype=dtype, device=device, seed=config.model.seed,
                        weight_dtype=config.model.weight_dtype, tp=tp, rope_scaling=config.model.rope_scaling)
    kv_dtype = torch.float8_e4m3fn if config.kv.cache_dtype == "fp8_e4m3" else dtype
    pool = make_pool(loaded, num_pages=num_pages, page_size=config.kv.page_size, dtype=kv_dtype, device=device)
    return ModelRunner(loaded.model, pool, config.sparse_config, dense_below=config.sparse.dense_below, device=device,
                       fused_ops=None if config.runtime.fused_ops else False)


class RankActor:
    """A follower rank (wrapped with ``ray.remote`` by :func:`start_group`)."""

    def __init__(self, config: dict, side: str, rank: int, size: int, host: str, port: int, num_pages: int) -> None:
        from model_executor.parallel import TensorParallel

        cfg = ServiceConfig.from_dict(config)
        if cfg.runtime.torch_threads:
            torch.set_num_threads(cfg.runtime.torch_threads)
        device = resolve_device(cfg)
        self.group = _process_group(host, port, rank, size, is_master=False, device=device, timeout_s=RANK_TIMEOUT_S)
        self.runner = build_rank_runner(cfg, side, TensorParallel.from_group(self.group), num_pages)
        self._tp_channel: Any = None  # TP prefill: this rank's sending channel (RankChannel)
        self._tp_receiver: tuple | None = None  # TP decode: (ChannelReceiver, its event loop)
        self._rx_lock = threading.Lock()

    def ready(self) -> int:
        return int(self.runner.pool.num_kv_heads)

    def run(self, command: tuple) -> None:
        from model_executor.parallel import run_command

        run_command(self.runner, command)

    def used_pages(self) -> int:
        return int(self.runner.pool.used_pages)

    def adopt_frame(self, request_id: str, frame: Any) -> Any:
        """TP decode: verify and adopt this rank's split of a request's frame; returns the
        ``TransferError`` (the leader tallies every rank's outcome) or None. Nothing stays
        allocated here on a failure."""
        from kv_transfer.tp_transfer import adopt_rank_frame

        shard = shard_of(self.runner.model)
        return adopt_rank_frame(self.runner.pool, frame, shard.layout, shard.tp.rank, request_id)

    # -- KV transfers: this rank's side (the leader drives them: make_tp_exporter,
    # make_tp_channel_exporter, make_tp_channel_receiver) ---------------------------------
    def export_frame(self, request_id: str) -> Any:
        """TP prefill over the object store: this rank's frame of a request, for merging."""
        shard = shard_of(self.runner.model)
        return _rank_frame(self.runner.pool, request_id, shard.layout, shard.tp.rank)

    def channel_export(self, request_id: str, fault: str | None, setup: dict) -> bytes:
        """TP prefill over channels: record a request's pages for a send; its header."""
        return self._channel(setup).export(request_id, fault)

    def channel_send(self, request: Any) -> Any:
        """A receiver's ``SendPages`` for this rank (relayed by the leader); the ``SendReply``."""
        from kv_transfer.transfer import TransferFailure
        from kv_transfer.wire import SendReply

        if self._tp_channel is None:
            return SendReply(False, TransferFailure.LOST.value, "this rank exported nothing")
        return self._tp_channel.send_blocking(request)

    def channel_discard(self, request_id: str) -> None:
        if self._tp_channel is not None:
            self._tp_channel.discard(request_id)

    def channel_receive(self, ticket: Any, setup: dict) -> Any:
        """TP decode: pull this rank's KV heads of ``ticket``'s request from the prefill ranks
        holding them; returns the ``TransferError`` (the leader settles every rank's outcome) or
        None. On a failure nothing stays allocated here (the channel receive frees its pages)."""
        import asyncio

        from kv_cache.heads import HeadLayout
        from kv_transfer.transfer import TransferError

        transport, loop = self._receiver(setup)
        layout = HeadLayout(*setup["layout"])
        rank = shard_of(self.runner.model).tp.rank
        future = asyncio.run_coroutine_threadsafe(
            transport.receive_heads(ticket, self.runner.pool, dst_layout=layout, dst_rank=rank), loop)
        try:
            future.result()
        except TransferError as exc:
            return exc
        return None

    def receiver_counters(self) -> dict:
        return self._tp_receiver[0].counters() if self._tp_receiver is not None else {}

    def _channel(self, setup: dict) -> Any:
        """This rank's sending channel (``RankChannel``), made at its first export."""
        from kv_transfer.channel_send import ChannelSender
        from kv_transfer.config import ChannelConfig
        from kv_transfer.tp_transfer import RankChannel

        if self._tp_channel is None:
            transport = ChannelSender(self.runner.pool.device, host=setup["host"], identity=setup["identity"],
                                      config=ChannelConfig(**setup["config"]), max_workers=setup["max_workers"])
            self._tp_channel = RankChannel(transport, self.runner.pool)
        return self._tp_channel

    def _receiver(self, setup: dict) -> tuple[Any, Any]:
        """This decode rank's channel receiver and the event loop it runs on (a thread of its
        own: the actor's methods are threaded and blocking)."""
        import asyncio

        from kv_transfer.channel_recv import ChannelReceiver
        from kv_transfer.config import ChannelConfig

        with self._rx_lock:
            if self._tp_receiver is None:
                loop = asyncio.new_event_loop()
                threading.Thread(target=loop.run_forever, name="kv-rank-receive", daemon=True).start()
                transport = ChannelReceiver(self.runner.pool.device, host=setup["host"], identity=setup["identity"],
                                            call_sender=setup["make_caller"](), config=ChannelConfig(**setup["config"]),
                                            max_workers=setup["max_workers"])
                self._tp_receiver = (transport, loop)
        return self._tp_receiver


class RayRankLink:
    """``model_executor.parallel.RankLink`` over a follower actor."""

    def __init__(self, actor: Any, rank: int, timeout_s: float = RANK_TIMEOUT_S) -> None:
        self.actor, self.rank, self.timeout_s = actor, rank, timeout_s

    def submit(self, command: tuple) -> Any:
        return self.actor.run.remote(command)

    def wait(self, handle: Any) -> None:
        import ray

        from model_executor.parallel import RankFailed

        try:
            ray.get(handle, timeout=self.timeout_s)
        except Exception as exc:  # noqa: BLE001 - a dead actor, a timeout or the step's own error
            raise RankFailed(f"TP rank {self.rank}: {type(exc).__name__}: {str(exc)[:300]}") from None


def start_group(config: ServiceConfig, side: str, *, num_pages: int, host: str = "127.0.0.1",
                actor_options: dict | None = None, on_failure: Any = None,
                name_prefix: str | None = None) -> tuple[Any, list[Any]]:
    """Rank 0 here, ranks ``1..N-1`` as actors (in the caller's placement group when it has
    one, named ``<name_prefix>:<rank>`` when given): returns the leader's ``LockstepRunner``
    (``on_failure``: see it) and the actors."""
    import ray
    from torch.distributed import TCPStore
    from ray.util.placement_group import get_current_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from model_executor.parallel import LockstepRunner, TensorParallel

    size = getattr(config, side).tensor_parallel_size
    device = resolve_device(config)
    store = TCPStore(host, 0, None, True, datetime.timedelta(seconds=RANK_TIMEOUT_S), wait_for_workers=False)
    pg = get_current_placement_group()
    remote = ray.remote(RankActor)
    actors = []
    for rank in range(1, size):
        opts = dict(actor_options or {"num_cpus": 1})
        if pg is not None:
            opts["scheduling_strategy"] = PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=rank)
        if name_prefix is not None:
            opts["name"] = f"{name_prefix}:{rank}"
        opts.setdefault("max_concurrency", CHANNEL_ACTOR_CONCURRENCY)  # channel sends next to steps
        actors.append(remote.options(**opts).remote(config.worker_dict(), side, rank, size, host, store.port, num_pages))
    group = _process_group(host, store.port, 0, size, is_master=True, device=device, timeout_s=RANK_TIMEOUT_S,
                           store=store)
    runner = build_rank_runner(config, side, TensorParallel.from_group(group), num_pages)
    ray.get([a.ready.remote() for a in actors], timeout=RANK_TIMEOUT_S)
    lock = LockstepRunner(runner, [RayRankLink(a, r) for r, a in enumerate(actors, start=1)], on_failure=on_failure)
    lock.keep_alive(store, group)  # the rendezvous lives as long as the runner
    if runner.pool.k_scale is not None:
        lock.calibrate_kv_scales(margin=config.kv.scale_margin)
    return lock, actors


def _rank_frame(pool: Any, request_id: str, layout: Any, rank: int):
    """Rank ``rank``'s frame of ``request_id`` for a single decode rank."""
    from kv_cache.heads import HeadLayout
    from kv_transfer.tp_transfer import export_rank

    dst = HeadLayout(layout.num_q_heads, layout.num_kv_heads, 1)
    return export_rank(pool, request_id, layout, dst, rank)[0]


def make_tp_exporter(lock: Any, actors: list, fetch_timeout_s: float):
    """An object-store transport whose frames hold every rank's heads (``merge_frames``): a TP
    prefill replica feeds TP=1 decode replicas unchanged (they receive ordinary frames)."""
    import ray

    from kv_transfer.transfer import ObjectStoreTransport, _maybe_corrupt, _ticket
    from kv_transfer.tp_transfer import merge_frames
    from model_executor.parallel import RankFailed

    leader = lock.leader
    shard = shard_of(leader.model)

    class TPObjectStoreTransport(ObjectStoreTransport):
        def export(self, pool, request_id, *, fault=None):
            refs = [a.export_frame.remote(request_id) for a in actors]
            frames = {0: _rank_frame(leader.pool, request_id, shard.layout, 0)}
            try:
                frames.update({r: f for r, f in enumerate(ray.get(refs, timeout=RANK_TIMEOUT_S), start=1)})
            except Exception as exc:  # noqa: BLE001 - a dead rank: the replica is broken
                raise RankFailed(f"TP export of {request_id!r}: {type(exc).__name__}: {str(exc)[:300]}") from None
            frame = _maybe_corrupt(merge_frames(frames, shard.layout), fault)
            return _ticket(self.name, leader.pool, request_id, frame, [ray.put(frame)])

    return TPObjectStoreTransport(fetch_timeout_s=fetch_timeout_s)


# Why a TP decode replica runs its steps eagerly (its routing stats' ``decode_graphs``). Capture
# would have to happen on every rank at once (the NCCL all-reduces inside the graphs pair up
# across ranks), and the runner's per-batch-size capture, its eager check and its fallback to
# eager decide per rank: a rank that fell back while another replays would still pair its
# all-reduces, but one whose capture failed midway would leave the others blocked inside a
# captured collective. Untested without GPUs, so not done: the GPU-run issue measures it.
TP_DECODE_GRAPHS = ("off: tensor-parallel decode runs eager (capture and replay would have to run in lockstep "
                    "on every rank; not validated on GPUs yet)")


def make_tp_receiver(lock: Any, actors: list, fetch_timeout_s: float, *, fault_mode: str | None = None,
                     faults: int = 0):
    """The object-store receiver of a TP decode replica: fetch the ordinary frame (as TP=1),
    verify it and split it by KV head over the ranks (``split_frame``), adopt on every rank at
    once (the leader here, each follower its ``adopt_frame``), then settle all or nothing: a
    failure on any rank releases the request on every rank and raises that rank's
    ``TransferError`` (the ingress prefills again when it is retryable). A follower that does not
    answer is ``RankFailed`` (the replica's ``on_failure`` ends it). ``fault_mode``/``faults``:
    damage the last rank's split frame of the first ``faults`` transfers (drills)."""
    import asyncio

    import ray

    from kv_transfer.transfer import ObjectStoreTransport, corrupt_frame
    from kv_transfer.tp_transfer import adopt_rank_frame, settle, split_frame
    from model_executor.parallel import RankFailed

    leader = lock.leader
    layout = shard_of(leader.model).layout

    class TPObjectStoreReceiver(ObjectStoreTransport):
        faults_left = faults if fault_mode in ObjectStoreTransport.fault_modes else 0

        async def receive(self, ticket, pool):
            frame = await self.fetch(ticket)
            return await asyncio.to_thread(self.adopt, ticket.request_id, frame)

        def adopt(self, request_id: str, frame: Any) -> list[int]:
            frames = split_frame(frame, layout, request_id=request_id)
            if self.faults_left > 0:
                self.faults_left -= 1
                last = layout.tp_size - 1
                frames[last] = corrupt_frame(frames[last], fault_mode)
            refs = [a.adopt_frame.remote(request_id, frames[r]) for r, a in enumerate(actors, start=1)]
            try:
                outcomes = [adopt_rank_frame(leader.pool, frames[0], layout, 0, request_id)]
            except BaseException:  # not a transfer failure (a bug): nothing may stay on any rank
                ray.wait(refs, num_returns=len(refs), timeout=RANK_TIMEOUT_S)
                lock.pool.release(request_id)
                raise
            try:
                outcomes += ray.get(refs, timeout=RANK_TIMEOUT_S)
            except Exception as exc:  # noqa: BLE001 - a dead rank: the replica is broken
                failed = RankFailed(f"TP receive of {request_id!r}: {type(exc).__name__}: {str(exc)[:300]}")
                lock.report_failure(failed)
                raise failed from None
            settle(outcomes, lambda: lock.pool.release(request_id))  # release: every rank, in lockstep
            return leader.pool.pages(request_id)

    return TPObjectStoreReceiver(fetch_timeout_s=fetch_timeout_s)


def end_replica(exc: BaseException) -> None:
    """A TP replica whose rank failed is out of step for good: end its process, so its in-flight
    calls fail as a dead replica's (the ingress retries them elsewhere) and Serve replaces it."""
    import logging
    import os

    logging.getLogger(__name__).error("TP rank failure, ending this replica: %s", exc)
    os._exit(70)


def check_ranks(actors: list, timeout_s: float = 10.0) -> None:
    """Serve's health check of a TP replica: every follower answers (else RuntimeError: Serve
    replaces the replica, its in-flight requests are retried as for any dead replica)."""
    import ray

    try:
        ray.get([a.ready.remote() for a in actors], timeout=timeout_s)
    except Exception as exc:  # noqa: BLE001
        raise RuntimeError(f"a TP rank of this replica is gone: {type(exc).__name__}: {str(exc)[:300]}") from None


# -- channel transfers from a TP group (kv_transfer.tp_transfer.TPChannelTransport) ----------
# Follower ranks send their own KV heads over their own channels. The methods below run in a
# rank actor's worker threads (the actor is threaded: ``CHANNEL_ACTOR_CONCURRENCY``), next to
# its lockstep steps: a send reads leased pages that no step writes.
# A step, the health check, and channel work next to them: a prefill rank's sends (one per
# decode rank pulling its heads) and discards, a decode rank's receives (one per request in
# flight; each waits in its thread while the rank's receive loop moves the pages).
CHANNEL_ACTOR_CONCURRENCY = 8
RANK_CALL_TIMEOUT_S = 30.0  # a follower's export or discard (no data moves: bookkeeping only)


class RayRankChannel:
    """The leader's handle on a follower's channel (``TPChannelTransport``'s follower)."""

    def __init__(self, actor: Any, rank: int, setup: dict) -> None:
        self.actor, self.rank, self.setup = actor, rank, setup

    def export(self, request_id: str, fault: str | None = None) -> bytes:
        import ray

        from model_executor.parallel import RankFailed

        try:
            return ray.get(self.actor.channel_export.remote(request_id, fault, self.setup), timeout=RANK_CALL_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001 - a dead rank: the replica is broken
            raise RankFailed(f"TP rank {self.rank}: channel export of {request_id!r}: {type(exc).__name__}: "
                             f"{str(exc)[:300]}") from None

    async def send(self, request: Any) -> Any:  # kv_transfer.wire.SendPages -> SendReply
        return await self.actor.channel_send.remote(request)

    def discard(self, request_id: str) -> None:
        import ray

        ray.get(self.actor.channel_discard.remote(request_id), timeout=RANK_CALL_TIMEOUT_S)


def make_tp_channel_exporter(lock: Any, actors: list, config: ServiceConfig, *, identity: dict, host: str):
    """The channel transport (``nccl`` on CUDA, ``gloo`` on CPU) of a TP prefill replica: every
    rank sends its own heads over its own channel (``kv_transfer.tp_transfer.TPChannelTransport``).
    ``identity``: the leader's Serve identity (where receivers send their requests)."""
    from kv_transfer.channel_send import ChannelSender
    from kv_transfer.tp_transfer import TPChannelTransport
    leader = lock.leader
    layout = shard_of(leader.model).layout
    channel = config.transfer.channel
    cfg = channel.channel_config()
    rid = identity["replica_id"]
    transport = ChannelSender(leader.pool.device, host=host, identity=TPChannelTransport.rank_identity(rid, 0),
                              config=cfg, max_workers=channel.max_workers)
    followers = []
    for rank, actor in enumerate(actors, start=1):
        setup = {"host": host, "identity": TPChannelTransport.rank_identity(rid, rank),
                 "config": {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)},
                 "max_workers": channel.max_workers}
        followers.append(RayRankChannel(actor, rank, setup))
    return TPChannelTransport(transport, layout, followers, identity=identity, host=host)


# -- channel transfers into a TP decode group -------------------------------------------------
# Each decode rank pulls its own KV heads from the prefill ranks holding them
# (``ChannelReceiver.receive_heads(..., dst_rank=r)``) over its own channels: rank r is the
# receiver ``<replica>:tp<r>`` and hosts its own store, so every (prefill rank, decode rank)
# pair has its own channel, store prefix and generations. The leader runs rank 0's receive on
# the replica's event loop and each follower's through ``RankActor.channel_receive``; it waits
# for all of them and settles all or nothing (``kv_transfer.tp_transfer.receive_group``).


def make_tp_channel_receiver(lock: Any, actors: list, config: ServiceConfig, *, identity: dict, host: str,
                             make_caller: Any):
    """The channel receiver (``gloo`` on CPU, ``nccl`` on CUDA) of a TP decode replica: every
    rank pulls its own heads at once (rank 0 here, the followers through
    ``RankActor.channel_receive``), then the group settles all or nothing: any rank failing
    releases the request on every rank and raises that rank's retryable ``TransferError`` (the
    replica answers ``TransferFailed`` with ``fallback: object_store``). A follower that does not
    answer is ``RankFailed`` (the replica's ``on_failure`` ends it). ``identity``: the replica's
    (rank r receives as ``<replica_id>:tp<r>``); ``make_caller()``: how a rank reaches the
    prefill replica holding the pages (returns an ``async (sender, request) -> reply``; picklable
    by reference: each follower makes its own, once)."""
    import asyncio

    from kv_transfer.channel_recv import ChannelReceiver
    from kv_transfer.transfer import KVReceiver
    from kv_transfer.tp_transfer import TPChannelTransport, receive_group
    from model_executor.parallel import RankFailed

    leader = lock.leader
    layout = shard_of(leader.model).layout
    channel = config.transfer.channel
    cfg = channel.channel_config()
    rid = identity["replica_id"]
    transport = ChannelReceiver(leader.pool.device, host=host, identity=TPChannelTransport.rank_identity(rid, 0),
                                call_sender=make_caller(), config=cfg, max_workers=channel.max_workers)
    setups = [{"host": host, "identity": TPChannelTransport.rank_identity(rid, rank), "make_caller": make_caller,
               "config": {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)},
               "max_workers": channel.max_workers,
               "layout": (layout.num_q_heads, layout.num_kv_heads, layout.tp_size)}
              for rank in range(1, layout.tp_size)]

    class TPChannelReceiver(KVReceiver):
        name = transport.name

        async def receive(self, ticket, pool):
            rid = getattr(ticket, "request_id", None)
            refs = [a.channel_receive.remote(ticket, setup) for a, setup in zip(actors, setups)]

            async def follower(rank: int, ref: Any) -> Any:
                try:
                    return await asyncio.wait_for(asyncio.wrap_future(ref.future()), RANK_TIMEOUT_S)
                except Exception as exc:  # noqa: BLE001 - a dead rank: the replica is broken
                    failed = RankFailed(f"TP rank {rank}: channel receive of {rid!r}: {type(exc).__name__}: "
                                        f"{str(exc)[:300]}")
                    lock.report_failure(failed)
                    raise failed from None

            receives = [transport.receive_heads(ticket, leader.pool, dst_layout=layout, dst_rank=0)]
            receives += [follower(r, ref) for r, ref in enumerate(refs, start=1)]
            # release: every rank, in lockstep (blocking Ray calls: off the event loop)
            await receive_group(receives, lambda: asyncio.to_thread(lock.pool.release, rid))
            return leader.pool.pages(rid)

        def counters(self) -> dict[str, int]:
            return transport.counters()

        def close(self) -> None:
            transport.close()

    return TPChannelReceiver()
