"""Liveness and readiness of the service, as the ingress reports them.

- liveness (``GET /health/live``): the ingress replica answers; nothing else is asked;
- readiness (``GET /health/ready``, ``GET /health``, gRPC ``grpc.health.v1.Health/Check``):
  every role (prefill, decode) has at least one running replica, as Serve's controller sees
  it (``serve.status()``: a killed or crashed replica leaves RUNNING at once, its replacement
  enters it once its constructor returned and its first health check passed).

The controller is asked at most once per ``ingress.health_refresh_s``; concurrent probes share
the answer. A probe waits at most ``STATUS_TIMEOUT_S`` for it (the replica's first question,
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
import time
from collections.abc import Callable
from dataclasses import dataclass, field

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


def readiness_from_status(status, app: str, deployments: dict[str, str]) -> Readiness:
    """``status``: a ``ray.serve.schema.ServeStatus``; ``deployments``: role -> deployment name."""
    application = status.applications.get(app)
    if application is None:
        return Readiness(False, {role: 0 for role in deployments}, f"application {app!r} is not deployed")
    counts = {}
    for role, name in deployments.items():
        dep = application.deployments.get(name)
        states = dep.replica_states if dep is not None else {}
        counts[role] = sum(int(states.get(s, 0)) for s in SERVING_STATES)
    missing = [role for role, n in counts.items() if n == 0]
    reason = f"no running {' or '.join(missing)} replica" if missing else ""
    return Readiness(not missing, counts, reason)


class ReadinessProbe:
    """Cached readiness of one application's worker roles (one per ingress replica)."""

    def __init__(self, app: str, deployments: dict[str, str], *, refresh_s: float,
                 fetch_status: Callable[[], object] | None = None, timeout_s: float = STATUS_TIMEOUT_S,
                 first_timeout_s: float = FIRST_STATUS_TIMEOUT_S, max_stale_s: float = MAX_STALE_S) -> None:
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
        self._fetch = fetch_status or _serve_status
        self._last: Readiness | None = None
        self._at = float("-inf")
        self._pending: asyncio.Future | None = None  # the one controller question in flight

    async def check(self) -> Readiness:
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
            status = await asyncio.to_thread(self._fetch)  # a blocking controller call
            result = readiness_from_status(status, self.app, self.deployments)
        except Exception as exc:
            result = Readiness(False, {}, f"Serve controller unreachable ({type(exc).__name__})")
        self._last, self._at = result, time.monotonic()
        return result


def _serve_status():
    from ray import serve

    return serve.status()
