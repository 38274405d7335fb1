"""Liveness and readiness of the service, as the ingress reports them.

- liveness (``GET /health/live``): the ingress replica answers; nothing else is asked;
- readiness (``GET /health/ready``, ``GET /health``, gRPC ``grpc.health.v1.Health/Check``):
  every role (prefill, decode) has at least one running replica: one Serve's controller lists
  as RUNNING (its replacement enters RUNNING once its constructor returned and its first health
  check passed) and whose actor Ray has not reported dead.

Deaths come from Ray itself (:class:`DeathWatch`): the GCS publishes every actor's state
changes, and the ingress subscribes to them, so a killed or crashed replica leaves the count
as soon as Ray knows (milliseconds), not when the controller's next health check of it fails
(seconds: ``/health/ready`` said 200 for 4.4 s after a prefill replica was killed). Where the
subscription cannot be made, readiness follows the controller alone.

The controller is asked at most once per ``ingress.health_refresh_s`` (for each replica's
actor id and state); concurrent probes share the answer. A probe waits at most ``STATUS_TIMEOUT_S`` for it (the replica's first question,
which also connects to the controller, ``FIRST_STATUS_TIMEOUT_S``): a controller that does not
answer in time, or at all, makes the service not ready (the ingress could not route to a
replacement either), and the question stays asked, so a later probe gets its answer without
asking again.

While the service starts, the ingress replica is not there to answer: until it runs, Ray Serve's
HTTP proxy holds every request to the application (it has a route, not yet a replica to send it
to). ``python -m router serve`` answers the HTTP health paths meanwhile with a small application
of its own (router/health_app.py).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger("ray.serve")

# replica states (ray.serve's ReplicaState values) of a replica that takes requests; a replica
# on a draining node (PENDING_MIGRATION) still serves until its replacement runs
SERVING_STATES = ("RUNNING", "PENDING_MIGRATION")
# a probe's wait for the controller: load balancers time out at 1-2 s, and a controller busy
# deploying (the start-up case) can take far longer to answer serve.status()
STATUS_TIMEOUT_S = 0.5
FIRST_STATUS_TIMEOUT_S = 5.0
# a controller slow to answer (a loaded machine) keeps the last answer this long, so a busy
# service is not reported down; past it, or before any answer (start-up), the probe says 503
MAX_STALE_S = 30.0
# dead actor ids remembered (a replica's id is never reused; the oldest are forgotten first)
MAX_DEAD_REMEMBERED = 4096


@dataclass(frozen=True)
class Readiness:
    ready: bool
    replicas: dict[str, int] = field(default_factory=dict)  # role -> serving replicas
    reason: str = ""

    def to_dict(self) -> dict:
        out: dict = {"status": "ready" if self.ready else "unavailable", "replicas": dict(self.replicas)}
        if self.reason:
            out["reason"] = self.reason
        return out


@dataclass(frozen=True)
class ReplicaView:
    """What the controller said: role -> {replica actor id: state}; ``None``: the application
    is not deployed."""
    replicas: dict[str, dict[str, str]] | None


def _state(value: Any) -> str:
    return str(getattr(value, "value", value))


def view_from_status(status, app: str, deployments: dict[str, str]) -> ReplicaView:
    """A view from a ``ray.serve.schema.ServeStatus`` (state counts only: the replicas get
    made-up ids, which no death notification names)."""
    application = status.applications.get(app)
    if application is None:
        return ReplicaView(None)
    out: dict[str, dict[str, str]] = {}
    for role, name in deployments.items():
        dep = application.deployments.get(name)
        states = dep.replica_states if dep is not None else {}
        out[role] = {f"{name}/{_state(st)}/{i}": _state(st) for st, n in states.items() for i in range(int(n))}
    return ReplicaView(out)


def view_from_details(details: Mapping, app: str, deployments: dict[str, str]) -> ReplicaView:
    """A view from the controller's ``ServeInstanceDetails`` dict (each replica's actor id)."""
    application = (details.get("applications") or {}).get(app)
    if application is None:
        return ReplicaView(None)
    deps = application.get("deployments") or {}
    return ReplicaView({role: {str(r.get("actor_id")): _state(r.get("state"))
                               for r in (deps.get(name) or {}).get("replicas") or ()}
                        for role, name in deployments.items()})


def readiness_from_view(view: ReplicaView, app: str, roles, dead: Mapping[str, Any] = {}) -> Readiness:  # noqa: B006
    """Serving replicas per role: a serving state, and not in ``dead`` (actor ids Ray reported
    dead, which the controller may not have noticed yet)."""
    if view.replicas is None:
        return Readiness(False, {role: 0 for role in roles}, f"application {app!r} is not deployed")
    counts, died = {}, []
    for role in roles:
        replicas = view.replicas.get(role, {})
        serving = [rid for rid, st in replicas.items() if st in SERVING_STATES]
        counts[role] = sum(rid not in dead for rid in serving)
        died += [f"{role} replica {rid} died" for rid in serving if rid in dead]
    missing = [role for role, n in counts.items() if n == 0]
    reason = f"no running {' or '.join(missing)} replica" if missing else ""
    if missing and died:
        reason += f" ({'; '.join(died)}: Ray's actor death notification)"
    return Readiness(not missing, counts, reason)


def readiness_from_status(status, app: str, deployments: dict[str, str]) -> Readiness:
    """``status``: a ``ray.serve.schema.ServeStatus``; ``deployments``: role -> deployment name."""
    return readiness_from_view(view_from_status(status, app, deployments), app, deployments)


class DeathWatch:
    """Ray's actor-death notifications: a subscriber to the GCS actor channel (every actor's
    state changes, pushed by the GCS), calling ``on_death(actor id hex)`` for each actor that
    turned DEAD. ``subscriber``: a factory of an object with ``subscribe()`` and
    ``poll(batch_size, timeout)`` coroutines (default Ray's ``GcsAioActorSubscriber`` on this
    cluster's GCS). :meth:`start` in the event loop; ``state`` says how it goes."""

    def __init__(self, on_death: Callable[[str], None], subscriber: Callable[[], Any] | None = None) -> None:
        self._on_death = on_death
        self._factory = subscriber or _gcs_actor_subscriber
        self._task: asyncio.Task | None = None
        self.state = "not started"  # -> "watching", or "unavailable (<why>)"
        self.deaths = 0  # DEAD notifications received

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.ensure_future(self._run())

    async def _run(self) -> None:
        from ray.core.generated import gcs_pb2

        dead = gcs_pb2.ActorTableData.DEAD
        try:
            sub = self._factory()
            await sub.subscribe()
        except Exception as exc:  # noqa: BLE001 - readiness then follows the controller alone
            self.state = f"unavailable ({type(exc).__name__})"
            logger.info("replica death notifications unavailable (%r); readiness follows Serve's controller", exc)
            return
        self.state = "watching"
        failures = 0
        while True:
            try:
                batch = await sub.poll(batch_size=256, timeout=30.0)
                failures = 0
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - a GCS hiccup: ask again, a little later each time
                failures += 1
                if failures == 1:
                    logger.info("replica death notifications: polling failed (%r); retrying", exc)
                await asyncio.sleep(min(0.1 * 2 ** failures, 5.0))
                continue
            for actor_id, data in batch:
                if actor_id is not None and data.state == dead:
                    self.deaths += 1
                    self._on_death(actor_id.hex())


def _gcs_actor_subscriber() -> Any:
    import ray
    from ray._private.gcs_pubsub import GcsAioActorSubscriber

    if not ray.is_initialized():  # never start a Ray here (unit tests, a probe built outside a replica)
        raise RuntimeError("Ray is not initialized in this process")
    return GcsAioActorSubscriber(address=ray.get_runtime_context().gcs_address)


class ReadinessProbe:
    """Cached readiness of one application's worker roles (one per ingress replica)."""

    def __init__(self, app: str, deployments: dict[str, str], *, refresh_s: float,
                 fetch_status: Callable[[], object] | None = None, timeout_s: float = STATUS_TIMEOUT_S,
                 first_timeout_s: float = FIRST_STATUS_TIMEOUT_S, max_stale_s: float = MAX_STALE_S,
                 deaths: Callable[[], Any] | None | bool = None) -> None:
        """``fetch_status``: a blocking call answering a ``ServeStatus`` or the controller's
        details dict (default: the details). ``deaths``: the :class:`DeathWatch` subscriber
        factory (None: Ray's; False: no death notifications)."""
        if refresh_s < 0:
            raise ValueError(f"refresh_s: expected >= 0, got {refresh_s}")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s: expected > 0, got {timeout_s}")
        if not first_timeout_s > 0:
            raise ValueError(f"first_timeout_s: expected > 0, got {first_timeout_s}")
        if not max_stale_s >= 0:
            raise ValueError(f"max_stale_s: expected >= 0, got {max_stale_s}")
        self.max_stale_s = max_stale_s
        self.app = app
        self.deployments = dict(deployments)
        self.refresh_s = refresh_s
        self.timeout_s = timeout_s
        self.first_timeout_s = first_timeout_s
        self._fetch = fetch_status or _serve_details
        self._view: ReplicaView | None = None
        self._dead: collections.OrderedDict[str, None] = collections.OrderedDict()
        self.watch = None if deaths is False else DeathWatch(self.notice_death, deaths or None)
        self.noticed = 0  # deaths that changed the answer before the controller did
        self._last: Readiness | None = None
        self._at = float("-inf")
        self._pending: asyncio.Future | None = None  # the one controller question in flight

    def notice_death(self, actor_id: str) -> None:
        """Ray reported ``actor_id`` dead: if it is one of the replicas counted, the answer
        changes now (the controller's view follows at its next refresh)."""
        self._dead[actor_id] = None
        while len(self._dead) > MAX_DEAD_REMEMBERED:
            self._dead.popitem(last=False)
        view = self._view
        if view is None or view.replicas is None:
            return
        if any(st in SERVING_STATES and rid == actor_id for reps in view.replicas.values() for rid, st in reps.items()):
            self.noticed += 1
            self._last = readiness_from_view(view, self.app, self.deployments, self._dead)

    async def check(self) -> Readiness:
        if self.watch is not None:
            self.watch.start()
        if self._last is not None and time.monotonic() - self._at < self.refresh_s:
            return self._last
        if self._pending is None or self._pending.done():
            self._pending = asyncio.ensure_future(self._refresh())
        timeout = self.timeout_s if self._last is not None else self.first_timeout_s
        try:
            # shield: a probe that gives up leaves the question running for the next one
            return await asyncio.wait_for(asyncio.shield(self._pending), timeout)
        except asyncio.TimeoutError:
            if self._last is not None and time.monotonic() - self._at <= self.max_stale_s:
                return self._last  # the question keeps running; its answer replaces this one
            return Readiness(False, {}, f"Serve controller did not answer within {timeout:g} s")

    async def _refresh(self) -> Readiness:
        try:
            answer = await asyncio.to_thread(self._fetch)  # a blocking controller call
            if isinstance(answer, Mapping):
                view = view_from_details(answer, self.app, self.deployments)
            else:
                view = view_from_status(answer, self.app, self.deployments)
            self._view = view
            result = readiness_from_view(view, self.app, self.deployments, self._dead)
        except Exception as exc:
            result = Readiness(False, {}, f"Serve controller unreachable ({type(exc).__name__})")
        self._last, self._at = result, time.monotonic()
        return result


def _serve_details() -> dict:
    """The controller's ``ServeInstanceDetails`` (every replica's state and actor id)."""
    from ray.serve.context import _get_global_client

    return _get_global_client().get_serve_details()
