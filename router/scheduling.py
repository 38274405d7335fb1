"""Causal-workload scheduling: the two Serve request routers.

They rank replicas by the prefill cost model of ``serving/costs.py`` (per-token work plus the
causal query-key pairs the new tokens attend to, scaled by the expected density; only ratios
matter), which the ingress and the prefill replicas use too.

Replica choice (:class:`PrefillRequestRouter`, Serve's custom-router API):
- outstanding work per replica = max(what the replica reports in its routing stats
  (queued + running causal cost, refreshed every ``request_routing_stats_period_s``),
  what this router routed there and has not seen complete). The max keeps a burst routed
  between two stats refreshes from piling onto one replica, without double counting.
- replicas whose free KV pages cannot hold the prompt go last; the rest are ranked by
  outstanding work plus this prompt's cost there, and replicas within 10% (or one small
  request) of the best form the first tier, where Serve picks by queue length.
- prefix affinity: the ingress sends digests of the prompt's prefix (its first
  ``PREFIX_STRIDE`` pages, then every ``PREFIX_STRIDE``-th), each with the prompt's cost if that
  much of it is cached
  (``kv_cache.prefix``). The router remembers which replicas it sent each digest to (an LRU
  index of ``PREFIX_INDEX_ENTRIES`` digests); on a replica that was sent the longest matching
  prefix the prompt costs only its uncached part, which ranks that replica first unless it is
  busier by more than the saving. The index is this router's view (each ingress replica has its
  own) and a replica may have evicted the pages since: a wrong guess costs a cache miss, never
  a wrong result.
- a call whose hint names a ``replica`` (a decode replica asking the holder of a request's
  KV pages to send them over a channel) goes to that replica only.

:class:`DecodeRequestRouter` ranks decode replicas by free KV pages (they must hold the
prompt plus ``max_tokens``; a group of ``n`` choices: its shared pages once plus each choice's
own) and running + waiting requests relative to ``max_running``; a call whose hint names a
``replica`` (the ingress stopping one choice of a group) goes to that replica only.
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Sequence
from typing import Any

try:  # the cost model is usable without Ray (tests, benchmarks)
    from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica
except ImportError:  # pragma: no cover - Ray absent
    PendingRequest = RunningReplica = Any  # type: ignore[misc,assignment]
    RequestRouter = object  # type: ignore[misc,assignment]

from serving.costs import PIN_GRACE_S, PREFIX_INDEX_ENTRIES, PREFIX_STRIDE, ROUTING_KWARG, PrefillCostModel, prefix_hint, routing_hint  # noqa: F401

logger = logging.getLogger("ray.serve")

class _PrefixIndex:
    """Which replicas this router sent each prefix digest to (LRU over digests)."""

    def __init__(self, max_entries: int = PREFIX_INDEX_ENTRIES) -> None:
        self.max_entries = max_entries
        self._where: collections.OrderedDict[str, set] = collections.OrderedDict()

    def add(self, digests: Sequence[str], replica_id: Any) -> None:
        for d in digests:
            holders = self._where.get(d)
            if holders is None:
                holders = self._where[d] = set()
            else:
                self._where.move_to_end(d)
            holders.add(replica_id)
        while len(self._where) > self.max_entries:
            self._where.popitem(last=False)

    def cost_on(self, replica_id: Any, prefix: Sequence[Sequence], default: float) -> float:
        """The prompt's cost on ``replica_id``: that of its longest prefix sent there, else ``default``."""
        for digest, cost in reversed(prefix):
            if replica_id in self._where.get(digest, ()):
                return float(cost)
        return default

    def forget_replica(self, replica_id: Any) -> None:
        for holders in self._where.values():
            holders.discard(replica_id)

    def __len__(self) -> int:
        return len(self._where)


def _replica_key(replica: Any) -> str:
    rid = replica.replica_id
    return str(getattr(rid, "unique_id", rid))


def _back_off(pending: Any) -> None:
    """Let Serve sleep between routing attempts of this request (25 ms doubling to 0.5 s) when
    no replica took it. Serve's own locality ranking sets this flag; a router that ranks by
    itself must, or Serve retries at once, in a hot loop (21,550 attempts in 52 s once every
    decode replica was at ``max_ongoing_requests``)."""
    context = getattr(pending, "routing_context", None)
    if context is not None:
        context.should_backoff = True


def _hint(pending: Any) -> dict:
    if pending is None:
        return {}
    hint = pending.kwargs.get(ROUTING_KWARG) if isinstance(pending.kwargs, dict) else None
    return hint if isinstance(hint, dict) else {}


def _stat(replica: Any, key: str, default: float) -> float:
    stats = replica.routing_stats or {}
    value = stats.get(key, default)
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else default


def _tiers(scored: list[tuple[float, Any]], slack: float) -> list[list[Any]]:
    """Best tier = everything within ``slack`` of the minimum; then the rest one by one."""
    if not scored:
        return []
    scored.sort(key=lambda x: x[0])
    best = scored[0][0]
    first = [r for s, r in scored if s <= best + slack]
    rest = [[r] for s, r in scored if s > best + slack]
    return [first, *rest]


class _InflightLedger:
    """What this router has routed per replica and not yet seen complete."""

    def __init__(self) -> None:
        self._by_request: dict[str, tuple[Any, float, int]] = {}
        self._cost: dict[Any, float] = {}
        self._pages: dict[Any, int] = {}
        self._count: dict[Any, int] = {}

    def add(self, request_key: str, replica_id: Any, cost: float, pages: int) -> None:
        self._by_request[request_key] = (replica_id, cost, pages)
        self._cost[replica_id] = self._cost.get(replica_id, 0.0) + cost
        self._pages[replica_id] = self._pages.get(replica_id, 0) + pages
        self._count[replica_id] = self._count.get(replica_id, 0) + 1

    def done(self, request_key: str) -> None:
        entry = self._by_request.pop(request_key, None)
        if entry is None:
            return
        replica_id, cost, pages = entry
        self._cost[replica_id] = max(self._cost.get(replica_id, 0.0) - cost, 0.0)
        self._pages[replica_id] = max(self._pages.get(replica_id, 0) - pages, 0)
        self._count[replica_id] = max(self._count.get(replica_id, 0) - 1, 0)

    def forget_replica(self, replica_id: Any) -> None:
        for key in [k for k, v in self._by_request.items() if v[0] == replica_id]:
            self.done(key)

    def cost(self, replica_id: Any) -> float:
        return self._cost.get(replica_id, 0.0)

    def pages(self, replica_id: Any) -> int:
        return self._pages.get(replica_id, 0)

    def count(self, replica_id: Any) -> int:
        return self._count.get(replica_id, 0)


class PrefillRequestRouter(RequestRouter):
    """Ranks prefill replicas by outstanding causal work (see the module docstring)."""

    def initialize_state(self, min_slack: float = 0.0, relative_slack: float = 0.1,
                         prefix_index_entries: int = PREFIX_INDEX_ENTRIES, **_: Any) -> None:
        self._ledger = _InflightLedger()
        self._prefixes = _PrefixIndex(prefix_index_entries)
        self._min_slack = float(min_slack)
        self._relative_slack = float(relative_slack)

    def outstanding(self, replica: Any) -> float:
        return max(_stat(replica, "outstanding_cost", 0.0), self._ledger.cost(replica.replica_id))

    async def choose_replicas(self, candidate_replicas: list, pending_request: Any = None) -> list[list]:
        _back_off(pending_request)
        hint = _hint(pending_request)
        if hint.get("replica") is not None:
            return self._pinned(candidate_replicas, str(hint["replica"]), pending_request)
        need = int(hint.get("pages", 0))
        cost = float(hint.get("cost", 0.0))
        prefix = hint.get("prefix") or []
        fits, tight = [], []
        cheapest = cost
        for r in candidate_replicas:
            free = _stat(r, "free_pages", float("inf"))
            # outstanding work plus what this prompt costs there (less where its prefix is cached)
            here = self._prefixes.cost_on(r.replica_id, prefix, cost) if prefix else cost
            cheapest = min(cheapest, here)
            (fits if free >= need else tight).append((self.outstanding(r) + here, r))
        # half of the prompt's cheapest cost: a replica that would save more than that ranks alone
        slack = max(self._min_slack, self._relative_slack * min((s for s, _ in fits), default=0.0), cheapest * 0.5)
        ranked = _tiers(fits, slack)
        if tight:
            ranked.extend([r] for _, r in sorted(tight, key=lambda x: x[0]))
        return ranked

    @staticmethod
    def _pinned(candidate_replicas: list, pin: str, pending_request: Any) -> list[list]:
        """A call for one replica (a decode replica asking the holder of a request's pages to
        send them). Replicas that are stopping or dead are not candidates: after a short grace
        (a replica this router has not heard of yet) every replica may take the call, and any
        other than ``pin`` refuses it at once, so the transfer fails over instead of waiting
        out its timeout."""
        match = [r for r in candidate_replicas if _replica_key(r) == pin]
        if match:
            return [match]
        created = getattr(pending_request, "created_at", None)
        if isinstance(created, (int, float)) and time.time() - created < PIN_GRACE_S:
            return []
        return [list(candidate_replicas)] if candidate_replicas else []

    def on_request_routed(self, pending_request: Any, replica_id: Any, result: Any) -> None:
        hint = _hint(pending_request)
        cost, prefix = float(hint.get("cost", 0.0)), hint.get("prefix") or []
        # outstanding work there: the prompt's cost on that replica (less what it has cached)
        here = self._prefixes.cost_on(replica_id, prefix, cost) if prefix else cost
        self._ledger.add(pending_request.metadata.internal_request_id, replica_id, here, int(hint.get("pages", 0)))
        if prefix:
            self._prefixes.add([d for d, _ in prefix], replica_id)

    def on_request_completed(self, replica_id: Any, internal_request_id: str) -> None:
        self._ledger.done(internal_request_id)

    def on_replica_actor_died(self, replica_id: Any) -> None:
        self._ledger.forget_replica(replica_id)
        self._prefixes.forget_replica(replica_id)
        super().on_replica_actor_died(replica_id)


class DecodeRequestRouter(RequestRouter):
    """Ranks decode replicas by room: free KV pages first, then load."""

    def initialize_state(self, **_: Any) -> None:
        self._ledger = _InflightLedger()

    def load(self, replica: Any) -> float:
        running = _stat(replica, "running", 0.0) + _stat(replica, "waiting", 0.0)
        capacity = max(_stat(replica, "max_running", float(replica.max_ongoing_requests)), 1.0)
        return max(running, float(self._ledger.count(replica.replica_id))) / capacity

    def free_pages(self, replica: Any) -> float:
        # room_pages: free pages minus what admitted requests may still grow into
        reported = min(_stat(replica, "free_pages", float("inf")), _stat(replica, "room_pages", float("inf")))
        total = _stat(replica, "num_pages", float("inf"))
        return min(reported, total - self._ledger.pages(replica.replica_id))

    async def choose_replicas(self, candidate_replicas: list, pending_request: Any = None) -> list[list]:
        _back_off(pending_request)
        hint = _hint(pending_request)
        if hint.get("replica") is not None:  # a call for one replica (cancel_choice of a group it decodes)
            return PrefillRequestRouter._pinned(candidate_replicas, str(hint["replica"]), pending_request)
        need = int(hint.get("pages", 0))
        fits, tight = [], []
        for r in candidate_replicas:
            (fits if self.free_pages(r) >= need else tight).append((self.load(r), r))
        ranked = _tiers(fits, slack=0.05)
        if tight:  # may still work once running requests finish: last resort, most room first
            ranked.extend([r] for _, r in sorted(tight, key=lambda x: -self.free_pages(x[1])))
        return ranked

    def on_request_routed(self, pending_request: Any, replica_id: Any, result: Any) -> None:
        self._ledger.add(pending_request.metadata.internal_request_id, replica_id, 0.0,
                         int(_hint(pending_request).get("pages", 0)))

    def on_request_completed(self, replica_id: Any, internal_request_id: str) -> None:
        self._ledger.done(internal_request_id)

    def on_replica_actor_died(self, replica_id: Any) -> None:
        self._ledger.forget_replica(replica_id)
        super().on_replica_actor_died(replica_id)
