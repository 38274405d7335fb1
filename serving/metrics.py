"""The service's Prometheus metrics, exported through Ray's metrics system.

Each replica records into ``ray.serve.metrics`` (Ray's ``Counter`` / ``Gauge`` / ``Histogram``
with the ``deployment``, ``replica`` and ``application`` tags added), which every Ray node serves
in Prometheus' text format on its metrics export port (``ray start --metrics-export-port``;
``cluster.yaml`` sets 8080; ``python -m router serve`` serves ``http://127.0.0.1:8080/metrics``,
``--metrics-port``), beside Ray Serve's own ``ray_serve_*`` request metrics. Names follow
vLLM's where one exists, under ``flashprefill_``; Ray exports them with its ``ray_`` prefix
(``ray_flashprefill_requests_total``):

ingress (one request's trip, ``router/pipeline.py``)
  ``requests_total{finish_reason}``: stop, length, abort, failed, cancelled;
  ``prompt_tokens_total``, ``generation_tokens_total`` (tokens sent to clients);
  ``time_to_first_token_seconds``, ``time_per_output_token_seconds`` (a request's mean after
  its first token), ``e2e_request_latency_seconds`` (histograms);
  ``request_retries_total{kind}``: ``prefill`` (a prefill or transfer attempt again), ``resume``
  (decoding resumed on another replica);
  ``ingress_running_requests``, ``ingress_queued_requests`` (gauges: admitted, and waiting in
  the ingress's queue, ``router/admission.py``), ``ingress_rejected_requests_total`` (429s of a
  full queue).
  ``requests_cancelled_total{stage}``: ``transferring``, ``decoding`` (the client went away after
  its first token: the decode stream is closed, the decode replica frees the pages).
prefill replicas
  ``prefill_queued_requests``, ``prefill_queued_tokens`` (gauges, after every batch),
  ``prefill_tokens_total`` (computed), ``prefix_cache_queries_total`` (prompt tokens looked up),
  ``prefix_cache_hits_total`` (prompt tokens reused from the prefix cache),
  ``prefill_batch_seconds`` (a forward batch, histogram),
  ``requests_cancelled_total{stage}``: ``queued`` (left the queue at once), ``prefilling``
  (stopped at the end of its forward or between its chunks, or cancelled during its export).
decode replicas
  ``decode_running_requests``, ``decode_waiting_requests`` (gauges, after every step),
  ``decode_steps_total{mode}``: ``graph`` or ``eager`` (``model_executor/cuda_graphs.py``),
  ``kv_transfers_total{transport, outcome}``: ``adopted`` or the failure's reason,
  ``kv_transfer_seconds`` (call to pages adopted, histogram).
both
  ``kv_pages_used{role}``, ``kv_pages_total{role}`` (gauges).

Where Ray is not initialized (unit tests, the engines used on their own) every call is a no-op.
"""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger(__name__)

PREFIX = "flashprefill_"
# seconds; TTFT spans a 4K prompt alone to a 128K prompt behind a long queue
TTFT_BUCKETS = (0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)
TPOT_BUCKETS = (0.002, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0)
BATCH_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0)
TRANSFER_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)

# name: (kind, description, tag keys, histogram boundaries)
SPECS: dict[str, tuple[str, str, tuple[str, ...], tuple[float, ...] | None]] = {
    "requests_total": ("counter", "Requests ended, by finish reason (stop, length, abort, failed, cancelled).",
                       ("finish_reason",), None),
    "prompt_tokens_total": ("counter", "Prompt tokens of the requests that reached a prefill replica.", (), None),
    "generation_tokens_total": ("counter", "Output tokens sent to clients.", (), None),
    "time_to_first_token_seconds": ("histogram", "Time from request arrival to its first token.", (), TTFT_BUCKETS),
    "time_per_output_token_seconds": ("histogram", "A request's mean time per output token after the first.", (),
                                      TPOT_BUCKETS),
    "e2e_request_latency_seconds": ("histogram", "Time from request arrival to its end.", (), E2E_BUCKETS),
    "requests_cancelled_total": ("counter", "Requests cancelled (client gone, HTTP timeout, gRPC deadline or "
                                 "cancel) by the stage their work was dropped at: queued, prefilling (a prefill "
                                 "replica's count), transferring, decoding (the ingress's).", ("stage",), None),
    "request_retries_total": ("counter", "Prefill/transfer attempts made again (prefill) and decodes resumed "
                              "on another replica (resume).", ("kind",), None),
    "ingress_running_requests": ("gauge", "Generation requests an ingress replica runs (ingress.max_inflight bounds them).",
                                 (), None),
    "ingress_queued_requests": ("gauge", "Generation requests waiting in an ingress replica's queue "
                                "(ingress.max_queued bounds them).", (), None),
    "ingress_rejected_requests_total": ("counter", "Generation requests refused with 429 by a full ingress queue.",
                                        (), None),
    "prefill_queued_requests": ("gauge", "Requests waiting in a prefill replica's queue.", (), None),
    "prefill_queued_tokens": ("gauge", "Prompt tokens waiting in a prefill replica's queue.", (), None),
    "prefill_tokens_total": ("counter", "Prompt tokens computed (not reused from the prefix cache).", (), None),
    "prefix_cache_queries_total": ("counter", "Prompt tokens looked up in the prefix cache.", (), None),
    "prefix_cache_hits_total": ("counter", "Prompt tokens whose KV pages came from the prefix cache.", (), None),
    "prefill_batch_seconds": ("histogram", "Time of one prefill forward batch.", (), BATCH_BUCKETS),
    "decode_running_requests": ("gauge", "Requests in a decode replica's running batch.", (), None),
    "decode_waiting_requests": ("gauge", "Requests waiting for a decode replica's batch.", (), None),
    "decode_steps_total": ("counter", "Decode steps, by how they ran (graph: a CUDA graph replay; eager).",
                           ("mode",), None),
    "kv_transfers_total": ("counter", "KV transfers into a decode replica, by transport and outcome.",
                           ("transport", "outcome"), None),
    "kv_transfer_seconds": ("histogram", "Time from a decode replica's adopt call to the pages adopted.", (),
                            TRANSFER_BUCKETS),
    "kv_pages_used": ("gauge", "KV pool pages held by requests.", ("role",), None),
    "kv_pages_total": ("gauge", "KV pool pages.", ("role",), None),
}
_KINDS = {"counter": "Counter", "gauge": "Gauge", "histogram": "Histogram"}


def _ray_backend() -> Any | None:
    """``ray.serve.metrics`` where Ray is initialized in this process, else None."""
    try:
        import ray

        if not ray.is_initialized():
            return None
        from ray.serve import metrics

        return metrics
    except Exception:  # noqa: BLE001 - no Ray here: metrics are off
        return None


class Metrics:
    """The metrics of :data:`SPECS`, created on first use in ``backend`` (a module with Ray's
    ``Counter`` / ``Gauge`` / ``Histogram`` classes; default ``ray.serve.metrics`` when Ray is
    initialized, else nothing is recorded). A metric that fails to record is logged once and
    then skipped: metrics never fail a request."""

    def __init__(self, backend: Any | None = None) -> None:
        self._backend = backend if backend is not None else _ray_backend()
        self._made: dict[str, Any] = {}
        self._broken: set[str] = set()

    @property
    def enabled(self) -> bool:
        return self._backend is not None

    def status(self) -> dict:
        """For a replica's stats: whether metrics record, and any that stopped (failed)."""
        return {"enabled": self.enabled, "recording": sorted(self._made), "broken": sorted(self._broken)}

    def _get(self, name: str) -> Any | None:
        if self._backend is None or name in self._broken:
            return None
        metric = self._made.get(name)
        if metric is None:
            kind, description, tags, buckets = SPECS[name]  # KeyError: a name not in SPECS is a bug
            cls = getattr(self._backend, _KINDS[kind])
            kwargs: dict[str, Any] = {"description": description, "tag_keys": tags or None}
            if buckets is not None:
                kwargs["boundaries"] = list(buckets)
            metric = self._made[name] = cls(PREFIX + name, **kwargs)
        return metric

    def _record(self, name: str, method: str, value: float, tags: dict[str, str] | None) -> None:
        try:
            metric = self._get(name)
            if metric is not None:
                getattr(metric, method)(value, tags=tags)
        except Exception:  # noqa: BLE001 - metrics never fail a request
            logger.warning("metric %s: recording failed; not recorded from now on", name, exc_info=True)
            self._broken.add(name)

    def inc(self, name: str, value: float = 1.0, **tags: str) -> None:
        if value:
            self._record(name, "inc", value, tags or None)

    def set(self, name: str, value: float, **tags: str) -> None:
        self._record(name, "set", value, tags or None)

    def observe(self, name: str, value: float | None, **tags: str) -> None:
        if value is not None:
            self._record(name, "observe", value, tags or None)

    # -- what the deployments record ---------------------------------------------------------
    def request_ended(self, *, finish_reason: str, prompt_tokens: int | None, output_tokens: int,
                      ttft_s: float | None, latency_s: float, tpot_s: float | None,
                      prefill_retries: int, resumes: int) -> None:
        """One request's end at the ingress (finished, failed or cancelled)."""
        self.inc("requests_total", finish_reason=finish_reason)
        if prompt_tokens is not None:
            self.inc("prompt_tokens_total", prompt_tokens)
        self.inc("generation_tokens_total", output_tokens)
        self.observe("time_to_first_token_seconds", ttft_s)
        self.observe("time_per_output_token_seconds", tpot_s)
        self.observe("e2e_request_latency_seconds", latency_s)
        self.inc("request_retries_total", prefill_retries, kind="prefill")
        self.inc("request_retries_total", resumes, kind="resume")

    def pool(self, role: str, pool: Any) -> None:
        """A KV pool's occupancy (gauges)."""
        self.set("kv_pages_used", pool.num_pages - pool.free_pages, role=role)
        self.set("kv_pages_total", pool.num_pages, role=role)
