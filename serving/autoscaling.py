"""Serve autoscaling policies, one per role, each on its own signal.

Serve 2.60 runs a deployment's ``autoscaling_config.policy`` on its controller every control
loop with an ``AutoscalingContext``: ``aggregated_metrics`` holds, per metric and replica, the
window average of what the replicas' ``record_autoscaling_stats()`` return (the deployments
report ``PREFILL_METRICS`` / ``DECODE_METRICS``). A policy returns the replica count it wants;
Serve then applies ``min_replicas`` / ``max_replicas``, ``upscale_delay_s`` /
``downscale_delay_s`` and the scaling factors, as for its default policy.

- prefill: work waiting for a forward, in prompt tokens and in prompts (whichever asks for
  more replicas): ``ceil(total / target per replica)``;
- decode: streams running and KV pages in use or reserved by admitted requests, as a fraction
  of the pool: ``ceil(total / target per replica)``.
A role with no report yet (replicas starting) keeps its current count.

Scaling down drains: Serve stops routing to the replica it picks and waits for its ongoing
requests (``graceful_shutdown_timeout_s``) before stopping it: a decode replica's streams are
ongoing requests, and a stopping prefill replica lets its open page leases (state, not calls)
be fetched before it frees them (``PrefillServer.__del__``), so no request, lease or page is
dropped.

In a Serve config file::

    autoscaling_config:
      min_replicas: 1
      max_replicas: 16
      policy:
        policy_function: serving.autoscaling:PrefillPolicy
        policy_kwargs: {target_queued_tokens: 8192, target_queued_requests: 8}
"""

from __future__ import annotations

import math
from typing import Any

PREFILL_METRICS = ("queued_tokens", "queued_requests")
DECODE_METRICS = ("running_streams", "kv_pages_busy", "kv_pages")

PREFILL_POLICY = "serving.autoscaling:PrefillPolicy"
DECODE_POLICY = "serving.autoscaling:DecodePolicy"


def _total(metrics: dict | None, name: str) -> float | None:
    per_replica = (metrics or {}).get(name)
    if not per_replica:
        return None
    return float(sum(per_replica.values()))


def _need(total: float, per_replica: float) -> int:
    return math.ceil(total / per_replica - 1e-9) if total > 0 else 0


class PrefillPolicy:
    """Prefill replicas for the queued prompt tokens and prompts."""

    def __init__(self, target_queued_tokens: int = 8192, target_queued_requests: int = 8) -> None:
        for name, value in (("target_queued_tokens", target_queued_tokens),
                            ("target_queued_requests", target_queued_requests)):
            if not isinstance(value, (int, float)) or value <= 0:
                raise ValueError(f"{name}: expected a positive number, got {value!r}")
        self.target_queued_tokens = target_queued_tokens
        self.target_queued_requests = target_queued_requests

    def desired(self, metrics: dict | None, current: int) -> int:
        tokens, requests = _total(metrics, "queued_tokens"), _total(metrics, "queued_requests")
        if tokens is None or requests is None:
            return current
        return max(_need(tokens, self.target_queued_tokens), _need(requests, self.target_queued_requests))

    def __call__(self, ctx: Any) -> tuple[int, dict]:
        return self.desired(ctx.aggregated_metrics, ctx.current_num_replicas), {}


class DecodePolicy:
    """Decode replicas for the running streams and the KV pages in use."""

    def __init__(self, target_running: int = 32, target_kv_fraction: float = 0.7) -> None:
        if not isinstance(target_running, (int, float)) or target_running <= 0:
            raise ValueError(f"target_running: expected a positive number, got {target_running!r}")
        if not isinstance(target_kv_fraction, (int, float)) or not 0 < target_kv_fraction <= 1:
            raise ValueError(f"target_kv_fraction: expected a number in (0, 1], got {target_kv_fraction!r}")
        self.target_running = target_running
        self.target_kv_fraction = target_kv_fraction

    def desired(self, metrics: dict | None, current: int) -> int:
        streams, busy = _total(metrics, "running_streams"), _total(metrics, "kv_pages_busy")
        pages = _total(metrics, "kv_pages")
        if streams is None or busy is None or not pages:
            return current
        per_replica_pages = pages / len(metrics["kv_pages"])
        return max(_need(streams, self.target_running), _need(busy, self.target_kv_fraction * per_replica_pages))

    def __call__(self, ctx: Any) -> tuple[int, dict]:
        return self.desired(ctx.aggregated_metrics, ctx.current_num_replicas), {}


def autoscaling_config(role: str, options: Any, *, max_running: int | None = None,
                       upscale_delay_s: float = 10.0, downscale_delay_s: float = 120.0) -> dict | None:
    """Serve ``autoscaling_config`` for a role from its ServiceConfig section (``prefill`` /
    ``decode``); None when the section sets no ``max_replicas`` (a fixed replica count)."""
    if options.max_replicas is None:
        return None
    if role == "prefill":
        policy = {"policy_function": PREFILL_POLICY,
                  "policy_kwargs": {"target_queued_tokens": options.target_queued_tokens,
                                    "target_queued_requests": options.target_queued_requests}}
    elif role == "decode":
        target = options.target_running or max(1, (max_running or options.max_running) // 2)
        policy = {"policy_function": DECODE_POLICY,
                  "policy_kwargs": {"target_running": target, "target_kv_fraction": options.target_kv_fraction}}
    else:
        raise ValueError(f"role: expected 'prefill' or 'decode', got {role!r}")
    return {"min_replicas": options.min_replicas, "max_replicas": options.max_replicas,
            "upscale_delay_s": upscale_delay_s, "downscale_delay_s": downscale_delay_s, "policy": policy}
