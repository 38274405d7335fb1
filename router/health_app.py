"""The start-up health application: ``/health``, ``/health/live`` and ``/health/ready`` while the
main application's ingress replica is not running yet.

Until the ingress replica runs (seconds to tens of seconds on a loaded machine: its process
imports FastAPI and the service config and loads the tokenizer), Ray Serve's HTTP proxy holds every request to the main application's route; none of
our code runs to answer 503. This application, torch-free and so quick to start, is deployed
first at route prefix ``/health``; the proxy sends the longest matching route prefix there, so
the three health paths reach it and everything else the main application at ``/``.

- ``/health/live``: 200 (this replica answers);
- ``/health/ready`` and ``/health``: the main ingress's own answer (``health_answer``), asked
  with a short deadline; main application not deployed, its ingress not running, or no answer in
  time: 503 ``{"status": "starting"}`` with Retry-After.

``python -m router serve`` deletes this application once the main one runs (router/launcher.py),
so the ingress then answers the health paths itself and gRPC clients need no ``application``
metadata (the gRPC proxy asks for it as soon as two applications exist).

Nothing here imports torch (the ingress does not either) or the service config, so the replica starts in seconds:
its settings arrive as plain values.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from ray import serve
from starlette.requests import Request
from starlette.responses import JSONResponse

HEALTH_APP_SUFFIX = "-health"  # the application's name: the main one's plus this
HEALTH_ROUTE = "/health"
DEFAULT_TIMEOUT_S = 0.5  # a load balancer's probe times out at 1-2 s; this answers well before
PROBES = {"": "health", "/": "health", "/ready": "ready"}  # path under the route -> the ingress's probe

logger = logging.getLogger("ray.serve")

Answer = tuple[int, dict, dict]  # status code, JSON body, headers


def starting(reason: str, retry_after_s: int) -> Answer:
    return 503, {"status": "starting", "reason": reason}, {"Retry-After": str(retry_after_s)}


async def answer_within(ask: Callable[[], Awaitable[Answer]], timeout_s: float, retry_after_s: int) -> Answer:
    """``ask()``'s answer, or 503 "starting" when it raises or takes longer than ``timeout_s``
    (it is then cancelled)."""
    try:
        return await asyncio.wait_for(ask(), timeout_s)
    except asyncio.TimeoutError:
        return starting(f"the ingress did not answer within {timeout_s:g} s", retry_after_s)
    except Exception as exc:  # no application yet, a replica that died: not ready, not a 500
        return starting(f"the ingress is not running ({type(exc).__name__}: {exc})"[:300], retry_after_s)


class StartupHealth:
    """Answers the health paths of application ``app`` (see the module doc)."""

    def __init__(self, app: str, timeout_s: float = DEFAULT_TIMEOUT_S, retry_after_s: int = 1) -> None:
        if not app:
            raise ValueError("app: expected the main application's name")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s: expected > 0, got {timeout_s}")
        if retry_after_s < 0:
            raise ValueError(f"retry_after_s: expected >= 0, got {retry_after_s}")
        self.app = app
        self.timeout_s = timeout_s
        self.retry_after_s = retry_after_s or 1
        self._handle = None

    async def ask_ingress(self, probe: str) -> Answer:
        if self._handle is None:
            # a blocking controller call; raises RayServeException while the app is not deployed
            self._handle = await asyncio.to_thread(serve.get_app_handle, self.app)
        response = self._handle.health_answer.remote(probe)
        try:
            return await response
        except asyncio.CancelledError:  # the deadline passed: the queued call goes too
            response.cancel()
            raise

    async def __call__(self, request: Request) -> JSONResponse:
        path = request.scope["path"]
        root = request.scope.get("root_path", "")
        sub = path[len(root):] if root and path.startswith(root) else path
        if sub == "/live":
            status, body, headers = 200, {"status": "alive"}, {}
        elif sub in PROBES:
            status, body, headers = await answer_within(lambda: self.ask_ingress(PROBES[sub]), self.timeout_s,
                                                        self.retry_after_s)
        else:
            status, headers = 404, {}
            # the main ingress's unknown-path answer (router.generation pulls torch in, hence a copy)
            body = {"error": {"message": "Not Found", "type": "not_found_error", "param": None, "code": "not_found"}}
        return JSONResponse(body, status_code=status, headers=headers or None)


def health_application(app: str, *, timeout_s: float = DEFAULT_TIMEOUT_S, retry_after_s: int = 1):
    """The bound start-up health application of main application ``app``: one replica holding
    no CPU (it must start next to replicas that hold them all)."""
    dep = serve.deployment(StartupHealth).options(
        name="StartupHealth", num_replicas=1, ray_actor_options={"num_cpus": 0},
        # deleted once the main application runs: its probes take well under a second to drain
        max_ongoing_requests=256, graceful_shutdown_wait_loop_s=0.5, graceful_shutdown_timeout_s=5.0)
    return dep.bind(app, timeout_s, retry_after_s)
