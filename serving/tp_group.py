"""A tensor-parallel replica's ranks on Ray: the replica process is rank 0 (the leader), ranks
``1..N-1`` are :class:`RankActor` actors in the replica's placement group (one bundle each,
``placement_group_strategy="STRICT_PACK"``: :func:`placement_options`), joined with the leader by
a gloo (CPU) / NCCL (GPU) process group built on a TCP store the leader hosts (no default
group: the replica's KV channels build their own groups next to it). The leader's engine drives
them through ``model_executor.parallel.LockstepRunner`` with one :class:`RayRankLink` per
follower; a dead follower is ``RankFailed``: the replica must be replaced (:func:`end_replica`).

Used by both deployments (docs/ARCHITECTURE.md "Tensor parallelism"):
- prefill (``prefill.tensor_parallel_size > 1``) and decode (``decode.tensor_parallel_size >
  1``): the replica's engine drives the ranks through the ``LockstepRunner`` (decode: one
  scheduler, sampling on the leader only: the followers' logits, equal by construction, are
  dropped). Decode CUDA graphs stay off under TP (:data:`TP_DECODE_GRAPHS`).
- KV transfers: the transports' group ends (``kv_transfer.object_store.group``,
  ``kv_transfer.channel.group``) reach the followers through :class:`RayRankGroup` (a
  ``kv_transfer.group.RankGroup``); a follower runs its part with :meth:`RankActor.call_end`,
  whatever the transport. Nothing here names one.
"""

from __future__ import annotations

import datetime
import threading
from typing import Any

import torch

from kv_transfer.group import RankGroup
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
        self._ends: dict[tuple[str, str], Any] = {}  # (transport, role) -> this rank's end of it
        self._ends_lock = threading.Lock()

    def ready(self) -> int:
        return int(self.runner.pool.num_kv_heads)

    def run(self, command: tuple) -> None:
        from model_executor.parallel import run_command

        run_command(self.runner, command)

    def used_pages(self) -> int:
        return int(self.runner.pool.used_pages)

    # -- KV transfers: this rank's ends of its replica's group transports (kv_transfer.group);
    # the leader's RankGroup (RayRankGroup) calls them. They run in the actor's worker threads
    # (``CHANNEL_ACTOR_CONCURRENCY``), next to its lockstep steps: a send reads leased pages
    # that no step writes.
    def call_end(self, end: Any, method: str, *args: Any) -> Any:
        """``method(*args)`` of this rank's ``end`` (a ``kv_transfer.group.RankEnd``), built from
        its transport's spec at the first call."""
        from kv_transfer.registry import get_transport
        from kv_transfer.spec import RankContext

        key = (end.transport, end.role)
        with self._ends_lock:
            built = self._ends.get(key)
            if built is None:
                shard = shard_of(self.runner.model)
                context = RankContext(self.runner.pool, shard.layout, shard.tp.rank, end.setup)
                built = self._ends[key] = get_transport(end.transport).rank_end(end.role, context)
        return getattr(built, method)(*args)

    def end_counters(self) -> dict:
        """The counters of this rank's transport ends (for the replica's stats and tests)."""
        with self._ends_lock:
            ends = list(self._ends.values())
        return {k: v for e in ends for k, v in e.counters().items()}


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


# Why a TP decode replica runs its steps eagerly (its routing stats' ``decode_graphs``). Capture
# would have to happen on every rank at once (the NCCL all-reduces inside the graphs pair up
# across ranks), and the runner's per-batch-size capture, its eager check and its fallback to
# eager decide per rank: a rank that fell back while another replays would still pair its
# all-reduces, but one whose capture failed midway would leave the others blocked inside a
# captured collective. Untested without GPUs, so not done: the GPU-run issue measures it.
TP_DECODE_GRAPHS = ("off: tensor-parallel decode runs eager (capture and replay would have to run in lockstep "
                    "on every rank; not validated on GPUs yet)")



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



class RayRankGroup(RankGroup):
    """``kv_transfer.group.RankGroup`` over a leader's lockstep runner and its follower actors:
    what the group transports (``TransportSpec.group_sender`` / ``group_receiver``) call."""

    timeout_s = RANK_TIMEOUT_S

    def __init__(self, lock: Any, actors: list) -> None:
        self.lock, self.actors = lock, list(actors)
        self.pool = lock.leader.pool
        self.layout = shard_of(lock.leader.model).layout

    def submit(self, rank: int, end: Any, method: str, *args: Any) -> Any:
        return self.actors[rank - 1].call_end.remote(end, method, *args)

    def results(self, handles: Any, timeout_s: float) -> list:
        import ray

        return ray.get(list(handles), timeout=timeout_s)

    async def result(self, handle: Any, timeout_s: float | None = None) -> Any:
        import asyncio

        if timeout_s is None:
            return await handle
        return await asyncio.wait_for(asyncio.wrap_future(handle.future()), timeout_s)

    def wait(self, handles: Any, timeout_s: float) -> None:
        import ray

        handles = list(handles)
        if handles:
            ray.wait(handles, num_returns=len(handles), timeout=timeout_s)

    def release(self, request_id: str) -> None:
        self.lock.pool.release(request_id)

    def report_failure(self, exc: BaseException) -> None:
        self.lock.report_failure(exc)



# A step, the health check, and transfer work next to them: a prefill rank's channel sends (one
# per decode rank pulling its heads) and discards, a decode rank's receives (one per request in
# flight; each waits in its thread while the rank's receive loop moves the pages).
CHANNEL_ACTOR_CONCURRENCY = 8
