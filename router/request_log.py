"""Requests that end in an error, in the logs: one line each, never a traceback.

A request the ingress refuses or fails on purpose (a :class:`~serving.errors.RequestError`:
a bad field, a prompt past the context, overload) is an expected outcome, not a bug: the
ingress logs one line naming the request id, the status and the field (INFO for client errors,
4xx; WARNING for the service's own, 5xx). Serve would log such a request again, as ERROR with
the traceback, in the ingress replica ("Request failed.") and in the gRPC proxy ("Request
failed with user-set gRPC status code ...") wherever the method raises, which a gRPC stream
must do to end with its status. :class:`QuietRequestErrors`, installed on Serve's logger in
both processes, drops those records when the exception is a RequestError; other exceptions
keep their tracebacks.
"""

from __future__ import annotations

import logging

from serving.errors import RequestError

SERVE_LOGGER = "ray.serve"  # Serve's replicas and proxies log on it (ray.serve._private.constants)
logger = logging.getLogger(SERVE_LOGGER)


def serve_request_id() -> str | None:
    """The id Serve gave the request being handled (its log lines carry it too); None outside one."""
    try:
        from ray.serve.context import _get_serve_request_context

        return _get_serve_request_context().request_id or None
    except Exception:  # noqa: BLE001 - outside Serve (unit tests), or an older Serve
        return None


def log_request_error(err: RequestError, via: str, request_id: str | None = None) -> None:
    """One line for a request that ends with ``err``: ``via`` ("HTTP", "gRPC"), the request id
    (``request_id``, else Serve's), the status, the code and the field. Not the message: it may
    quote what the client sent (a prompt, a stop string), which no log holds."""
    level = logging.INFO if err.status < 500 else logging.WARNING
    logger.log(level, "%s request %s: %d %s, field %s", via, request_id or serve_request_id() or "-",
               err.status, err.code or "error", err.param or "-")


def _is_request_error(exc: BaseException | None) -> bool:
    # the proxy sees the replica's exception wrapped in Serve's gRPCStatusError (original_exception)
    return isinstance(exc, RequestError) or isinstance(getattr(exc, "original_exception", None), RequestError)


class QuietRequestErrors(logging.Filter):
    """Drops a log record whose exception is a RequestError (logged once already, in one line)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.exc_info and _is_request_error(record.exc_info[1]))


_FILTER = QuietRequestErrors()


def install_quiet_request_errors() -> None:
    """On Serve's logger in this process (an ingress replica, a gRPC proxy); idempotent."""
    serve_logger = logging.getLogger(SERVE_LOGGER)
    if _FILTER not in serve_logger.filters:
        serve_logger.addFilter(_FILTER)
