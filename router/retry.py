"""The retry/resume policy of the ingress: which failures of a request's trip are tried again,
how many times, and which go to the client (the driver, ``router/driver.py``, closes the
attempt and asks here).

Retries: a retryable transfer failure (checksum, truncation, lost object, failed channel, no
room on the decode replica) or a prefill or decode replica dying before the pages were adopted
re-runs the prefill, up to ``transfer.retries`` times; after a failed channel transfer the
retries of that request ship their pages through the object store. Tokens already sent to the
client are kept: the decode side continues from the first token that was emitted. A refusal
from a replica (a ``RequestError``: overload, bad input, a prefill forward out of GPU memory,
503 ``prefill_out_of_memory``) is never retried: it goes to the client as it is, on the first
attempt.

Resume: a decode replica dying mid-stream (Ray Serve retries nothing in flight) is answered by
prefilling prompt + generated[:-1] on a healthy pair and decoding on from generated[-1], up to
``decode_resumes`` times: the client sees neither a gap nor a repeated token. With greedy
sampling the continuation is the one the dead replica would have produced (up to float
rounding between prefill and decode attention; with sparse prefill, up to the sparse
approximation of the re-prefilled tokens); a seeded sampler restarts its per-step stream. A
single choice preempted by its decode replica (``kv_exhausted``) is recomputed the same way.
"""

from __future__ import annotations

import logging
from typing import Any

from serving.config import ServiceConfig
from serving.errors import RequestError
from serving.messages import FinishReason, TransferFailed

PREEMPTED = FinishReason.KV_EXHAUSTED.value  # a decode replica's preemption (decode_worker/scheduler.py)

logger = logging.getLogger("ray.serve")


def is_replica_failure(exc: BaseException) -> bool:
    import ray.exceptions
    from ray.serve.exceptions import ReplicaUnavailableError

    return isinstance(exc, (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError, ReplicaUnavailableError))


def replica_of(exc: BaseException) -> str:
    """Which replica a failure names: the actor id of Ray's actor errors, the replica id of
    Serve's ``ReplicaUnavailableError``, else the error's type (one dead replica, one key)."""
    for attr in ("actor_id", "_replica_id"):
        value = getattr(exc, attr, None)
        if value:
            return str(value)
    return type(exc).__name__


class ReplicaDeaths:
    """Logs a dead replica once: the first request that meets its death logs one WARNING, the
    others (every request it held retries or resumes) one INFO line each. Bounded: the most
    recent :attr:`MAX_REMEMBERED` replicas are remembered."""

    MAX_REMEMBERED = 256

    def __init__(self) -> None:
        self._seen: dict[str, None] = {}  # insertion-ordered: the oldest is forgotten first

    def log(self, role: str, exc: BaseException, what: str, *args: Any) -> None:
        """``what % args``: the request's line (its id, what happens to it next)."""
        key = f"{role}:{replica_of(exc)}"
        if key in self._seen:
            logger.info(what, *args)
            return
        self._seen[key] = None
        while len(self._seen) > self.MAX_REMEMBERED:
            self._seen.pop(next(iter(self._seen)))
        logger.warning(f"{role} replica %s died (%s); its requests are retried or resumed elsewhere "
                       f"(one INFO line each). First: {what}", replica_of(exc), type(exc).__name__, *args)


class RouterDeathNotice(logging.Filter):
    """Serve's request router logs a WARNING for each request that meets a dead replica ("...
    will not be considered for future requests because it has died"); :class:`ReplicaDeaths`
    logs the one WARNING per death, so these become INFO lines (installed on Serve's logger in
    the ingress process by :meth:`install`)."""

    NEEDLE = "will not be considered for future requests because it has died"

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno == logging.WARNING and self.NEEDLE in record.getMessage():
            record.levelno, record.levelname = logging.INFO, "INFO"
        return True

    @classmethod
    def install(cls, target: logging.Logger = logger) -> None:
        if not any(isinstance(f, cls) for f in target.filters):
            target.addFilter(cls())


class RetryPolicy:
    """What happens to a request after a failure: each ``after_*`` method returns when the
    driver tries again (the line logged) and raises the client's error when it does not. The
    attempt that failed is already closed by the driver."""

    def __init__(self, config: ServiceConfig) -> None:
        self.config = config
        self.deaths = ReplicaDeaths()
        RouterDeathNotice.install()

    def attempts(self) -> range:
        """The prefill attempts of one connect: the first and ``transfer.retries`` more."""
        return range(self.config.transfer.retries + 1)

    def after_replica_failure(self, role: str, exc: Exception, r: int, request_id: str) -> None:
        """Attempt ``r``'s ``role`` replica failed before the pages reached decode: prefilled
        again while ``transfer.retries`` allows; else raised (a replica failure as 503
        ``<role>_unavailable``). Anything but a replica's death is raised at once: an OOM would
        fail the same prompt on a replica of the same size."""
        if is_replica_failure(exc) and r < self.config.transfer.retries:
            self.deaths.log(role, exc, "%s: %s replica failed before the pages reached decode (%s); prefilling again",
                            request_id, role, type(exc).__name__)
            return
        if is_replica_failure(exc):
            raise self._unavailable(role, exc) from exc
        raise exc

    @staticmethod
    def transport_after(event: TransferFailed, transport: str | None) -> str | None:
        """The transport of the request's next attempts: the object store once a channel failed."""
        return "object_store" if event.fallback == "object_store" else transport

    def after_transfer_failure(self, event: TransferFailed, r: int, request_id: str) -> None:
        """Attempt ``r``'s transfer failed: prefilled again if the failure is retryable and
        ``transfer.retries`` allows, else raised."""
        if not (event.retryable and r < self.config.transfer.retries):
            raise self._transfer_error(event)
        logger.warning("KV transfer of %s failed (%s); prefilling again", request_id, event.reason)

    def exhausted(self) -> RequestError:
        """Every attempt of a connect failed (and none raised)."""
        return RequestError("prefill failed on every attempt", status=503, code="prefill_unavailable",
                            retry_after_s=self.config.ingress.retry_after_s or 1)

    def recomputes_preempted(self, event: Any, resumes: int) -> bool:
        """A decode event that ends a choice by preemption is recomputed (as a resume) while
        ``ingress.decode_resumes`` allows (for a single choice that no stop string ended)."""
        return (event.finished and event.finish_reason == PREEMPTED
                and resumes < self.config.ingress.decode_resumes)

    def after_decode_failure(self, exc: Exception, resumes: int, request_id: str, unfinished: int,
                             tokens: int) -> None:
        """The decode stream failed mid-stream after ``tokens`` tokens: resumed if its replica
        died and ``ingress.decode_resumes`` allows, else 502 ``decode_failed``."""
        if not (is_replica_failure(exc) and resumes < self.config.ingress.decode_resumes):
            raise RequestError(
                f"decode replica failed mid-stream ({type(exc).__name__}) after "
                f"{tokens} tokens", status=502,
                code="decode_failed") from exc
        self.deaths.log("decode", exc, "%s: decode replica failed mid-stream (%s); resuming %d choices "
                        "after %d tokens", request_id, type(exc).__name__, unfinished, tokens)

    def _unavailable(self, role: str, exc: BaseException) -> RequestError:
        return RequestError(f"{role} replicas failed on every attempt ({type(exc).__name__}); retry later",
                            status=503, code=f"{role}_unavailable", retry_after_s=self.config.ingress.retry_after_s or 1)

    def _transfer_error(self, event: TransferFailed) -> RequestError:
        if event.reason == "pool_exhausted" and not event.retryable:
            # more pages than a decode replica's whole pool (an "auto" pool the ingress could not
            # check before): no wait makes room, so bad input, as the ingress's own check answers
            return RequestError(f"max_tokens: the request needs more KV pages than a decode replica holds "
                                f"({event.message}): lower max_tokens or shorten the prompt", param="max_tokens",
                                status=400, code="invalid_value")
        if event.reason == "pool_exhausted":
            # every decode replica stayed full for decode.adopt_wait_s: overload, not a fault
            return RequestError("decode KV capacity exhausted; retry later", status=429, code="kv_capacity_exhausted",
                                retry_after_s=self.config.ingress.retry_after_s or 1)
        return RequestError(f"KV transfer failed: {event.message}", status=502, code="kv_transfer_failed")
