"""The one client of a prefill replica's side calls, used by the decode replicas (send, stage,
release) and by the ingress (release).

Every call is pinned to the replica holding a request's pages (``routing_hint(replica=...)``,
honoured by ``PrefillRequestRouter``). The client gets deployment handles of its own, so their
routers see only pinned calls: sharing the prefill calls' router delayed a pinned call behind
the queued unpinned ones. A replica is addressed by its Serve identity, the ``sender`` of a
transfer ticket: ``{"app", "deployment", "replica_id", ...}``.

``release`` is fire and forget, bounded by ``timeout_s``: a lost release only leaves the lease
to its deadline (``transfer.lease_timeout_s``), so nothing waits on it.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
from collections.abc import Callable, Mapping
from typing import Any

from serving.costs import routing_hint
from serving.messages import PagesReleased, ReleasePages, SendPages, SendReply, StagePages, StageReply

logger = logging.getLogger("ray.serve")

RELEASE_TIMEOUT_S = 30.0  # a release_pages call to a prefill replica that does not answer


def _address(sender: Any) -> tuple[str, str, str]:
    """(app, deployment, replica id) of a ticket's ``sender`` (ValueError naming it)."""
    key = tuple(sender.get(k) for k in ("app", "deployment", "replica_id")) if isinstance(sender, Mapping) else ()
    if len(key) != 3 or not all(isinstance(k, str) and k for k in key):
        raise ValueError(f"sender: expected its Serve app, deployment and replica_id, got {sender!r:.200}")
    return key  # type: ignore[return-value]


class PrefillClient:
    """Pinned calls to prefill replicas: :meth:`send_pages` and :meth:`stage_pages` (the
    transports' ``call_sender``: ``async (sender, request) -> reply``) and :meth:`release`.

    ``timeout_s``: how long a release may take. ``get_handle(deployment, app)``: how a handle
    is made (Serve's ``get_deployment_handle``; a test passes its own)."""

    def __init__(self, *, timeout_s: float = RELEASE_TIMEOUT_S, get_handle: Any = None) -> None:
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not timeout_s > 0:
            raise ValueError(f"timeout_s: expected a number > 0, got {timeout_s!r}")
        if get_handle is not None and not callable(get_handle):
            raise ValueError(f"get_handle: expected a callable (deployment, app) -> handle, got {get_handle!r}")
        self.timeout_s = float(timeout_s)
        self._get_handle = get_handle
        self._handles: dict[tuple[str, str], Any] = {}
        self._background: set[asyncio.Task] = set()

    async def _call(self, method: str, sender: Any, request: Any) -> Any:
        app, deployment, replica = _address(sender)
        handle = self._handles.get((app, deployment))
        if handle is None:  # asks the controller once: off the event loop
            get = self._get_handle
            if get is None:
                from ray import serve

                get = serve.get_deployment_handle
            handle = self._handles[(app, deployment)] = await asyncio.to_thread(get, deployment, app)
        return await getattr(handle, method).remote(request, routing=routing_hint(replica=replica))

    async def send_pages(self, sender: Mapping, request: SendPages) -> SendReply:
        """Ask ``sender`` to send a request's pages over a channel (``PrefillServer.send_pages``)."""
        return await self._call("send_pages", sender, request)

    async def stage_pages(self, sender: Mapping, request: StagePages) -> StageReply:
        """Ask ``sender`` to stage a leased request's pages on its channel (``PrefillServer.stage_pages``)."""
        return await self._call("stage_pages", sender, request)

    async def release_pages(self, sender: Mapping, request_id: str) -> PagesReleased:
        """End the lease on ``request_id``'s pages at ``sender``; waits at most ``timeout_s``."""
        return await asyncio.wait_for(self._call("release_pages", sender, ReleasePages(request_id)), self.timeout_s)

    def release(self, sender: Mapping, request_id: str) -> asyncio.Task:
        """:meth:`release_pages`, fire and forget (needs a running event loop): a failure is
        logged, the lease's deadline ends it anyway. Returns the task (held here until done).

        The task runs in a context of its own, not the caller's: Serve counts a handle call
        made in a request's context as that request's child and cancels it with the request,
        and a release is made exactly when a request ends or is being cancelled (the ingress
        closed a decode stream after a failed transfer, a client went away)."""
        task = asyncio.get_running_loop().create_task(self._release(sender, request_id), context=contextvars.Context())
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    def lease_releaser(self, prefill_handle: Any) -> Callable[[Any], None]:
        """The ingress's way to end the lease of an abandoned attempt: ``release(prefilled)``
        (a ``Prefilled``: its replica and request ids) on ``prefill_handle``'s deployment. A
        handle without Serve names (tests' fakes) releases nothing."""
        app = getattr(prefill_handle, "app_name", None)
        deployment = getattr(prefill_handle, "deployment_name", None)

        def release(lease: Any) -> None:
            if isinstance(app, str) and isinstance(deployment, str):
                self.release({"app": app, "deployment": deployment, "replica_id": lease.replica_id}, lease.request_id)

        return release

    async def _release(self, sender: Mapping, request_id: str) -> None:
        try:
            await self.release_pages(sender, request_id)
        except Exception as exc:  # noqa: BLE001 - the lease's deadline ends it anyway
            replica = sender.get("replica_id") if isinstance(sender, Mapping) else None
            logger.info("releasing the lease of %s on %s failed: %r", request_id, replica, exc)
            try:  # the next call makes its handle anew (this one may never have reached a router)
                self._handles.pop(_address(sender)[:2], None)
            except ValueError:
                pass


def send_caller() -> Any:
    """A new client's :meth:`PrefillClient.send_pages` (TP decode ranks make their own, once:
    picklable by reference)."""
    return PrefillClient().send_pages


__all__ = ["PrefillClient", "RELEASE_TIMEOUT_S", "send_caller"]
