"""Helpers for the service tests: a local Ray + Serve on 127.0.0.1, oracle runs, replica stats."""

from __future__ import annotations

import contextlib
import os
import socket
import time
from collections.abc import Iterator
from functools import lru_cache

import ray

from serving.config import ServiceConfig
from router.launcher import replica_stats  # noqa: F401 - re-exported for the tests


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def local_serve(grpc_servicer: str | None = None) -> Iterator[tuple[int, int | None]]:
    """Ray (started here unless one runs already) and Serve on 127.0.0.1 with free ports; yields
    ``(http_port, grpc_port or None)``; shuts Serve, and a Ray it started, down on exit."""
    from ray import serve
    from ray.serve.config import gRPCOptions

    from router.launcher import prepare_environment

    prepare_environment()
    os.environ.setdefault("RAY_SERVE_LOG_TO_STDERR", "0")
    started_here = not ray.is_initialized()
    if started_here:
        ray.init(num_cpus=8, include_dashboard=False, _node_ip_address="127.0.0.1",
                 logging_level="WARNING", log_to_driver=False)
    http_port = free_port()
    grpc_port = free_port() if grpc_servicer else None
    kwargs = {}
    if grpc_servicer:
        kwargs["grpc_options"] = gRPCOptions(port=grpc_port, grpc_servicer_functions=[grpc_servicer])
    serve.start(http_options={"host": "127.0.0.1", "port": http_port}, **kwargs)
    try:
        yield http_port, grpc_port
    finally:
        serve.shutdown()
        if started_here:
            ray.shutdown()


def replica_actors(app: str, deployment: str) -> list:
    prefix = f"SERVE_REPLICA::{app}#{deployment}#"
    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith(prefix)]
    return [ray.get_actor(n, namespace="serve") for n in names]


def pools_idle(app: str) -> tuple[bool, list[dict], list[dict]]:
    pre, dec = replica_stats(app, "PrefillServer"), replica_stats(app, "DecodeServer")
    ok = all(s["free_pages"] == s["num_pages"] and s["leased"] == 0 and s["queued"] == 0 for s in pre) and all(
        s["free_pages"] == s["num_pages"] and s["streams"] == 0 and s["running"] == 0 for s in dec
    )
    return ok, pre, dec


def wait_pools_idle(app: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        ok, pre, dec = pools_idle(app)
        if ok:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"pools of {app!r} not idle: prefill {pre}, decode {dec}")
        time.sleep(0.2)


@lru_cache(maxsize=None)
def _oracle_model():
    from model_executor.loading import load_model

    return load_model(None)


def oracle_tokens(config: ServiceConfig, prompt_ids: list[int], max_tokens: int) -> list[int]:
    """Greedy tokens from the single-process engines, one prompt at a time (as the service
    runs them when requests arrive one by one)."""
    from router.offline import generate
    from model_executor.sampling import SamplingParams
    from model_executor.tokenizer import ByteTokenizer

    params = SamplingParams(temperature=0.0, max_new_tokens=max_tokens, stop_token_ids=ByteTokenizer().stop_token_ids)
    res = generate([prompt_ids], params, model=_oracle_model(), sparse_config=config.sparse_config,
                   dense_below=config.sparse.dense_below, page_size=config.kv.page_size)
    return list(res[0].output_token_ids)


def prompt_of(n: int, seed: int) -> list[int]:
    """A deterministic token-id prompt of length ``n`` (bytes, starting with BOS)."""
    return [256] + [(seed * 31 + i * 17 + (i * i) % 13) % 256 for i in range(n - 1)]
