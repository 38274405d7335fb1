"""Helpers for the service tests: a local Ray + Serve on 127.0.0.1 and applications deployed into it,
oracle runs, replica stats."""

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
from tests.worker_setup import HOOK as WORKER_SETUP_HOOK


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def restored_environment() -> Iterator[None]:
    """Undo on exit what the block set in ``os.environ`` (Ray's launch variables), so that the
    tests after it, and the subprocesses they start, see the environment they would alone."""
    saved = dict(os.environ)
    try:
        yield
    finally:
        for key in set(os.environ) - set(saved):
            del os.environ[key]
        for key, value in saved.items():
            if os.environ.get(key) != value:
                os.environ[key] = value


@contextlib.contextmanager
def local_serve(grpc_servicer: str | None = None, num_cpus: int = 8) -> Iterator[tuple[int, int | None]]:
    """A new local Ray and Serve on 127.0.0.1 with free ports, as ``router run`` starts them
    (every Ray process on loopback, the gRPC proxy too); yields ``(http_port, grpc_port or
    None)``; shuts both down on exit. The test session starts one (``serve_cluster`` in
    tests/conftest.py); a module that starts its own instead pays tens of seconds."""
    from ray import serve
    from ray.serve.config import gRPCOptions

    from router.launcher import prepare_environment, ray_init_kwargs

    with restored_environment():
        prepare_environment()
        os.environ.setdefault("RAY_SERVE_LOG_TO_STDERR", "0")
        # Ray kills a worker process that has not registered within 60 s; with two test
        # processes (scripts/test.sh runs two xdist workers) each starting replicas on 2 cores,
        # a replica's imports alone can take that long, and its actor would die in setup
        os.environ.setdefault("RAY_worker_register_timeout_seconds", "300")
        if ray.is_initialized():
            raise RuntimeError("local_serve: a Ray is already running in this process (the session's "
                               "serve_cluster?): deploy into it instead")
        # no dashboard: nothing here reads it, and it is one more process to start on 2 cores.
        # The worker setup hook: the product's, plus hiding the packages only the test extras
        # install (tests/worker_setup.py), so a replica starts with the serving environment's imports
        init = ray_init_kwargs("127.0.0.1")
        runtime_env = {**init["runtime_env"], "worker_process_setup_hook": WORKER_SETUP_HOOK}
        ray.init(**{**init, "include_dashboard": False, "runtime_env": runtime_env}, num_cpus=num_cpus,
                 logging_level="WARNING", log_to_driver=False)
        try:
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
        finally:
            ray.shutdown()


# A stopping replica sleeps this long before it first counts its ongoing requests, and again
# between counts (Serve's default: 2 s). Tests stop replicas at every module's end and while
# scaling down: check every 0.5 s (the graceful shutdown's bound, its timeout, is unchanged).
DRAIN_CHECK = {"graceful_shutdown_wait_loop_s": 0.5}


@contextlib.contextmanager
def deployed(apps: dict[str, dict], delete_timeout_s: float = 300.0) -> Iterator[None]:
    """Deploys ``apps`` (name -> ``router.app.build_application`` keyword arguments, plus an
    optional ``external_scaler_enabled``: Serve's external scaling API, see :func:`scale`) into
    the running Serve, each under its own route prefix ``/<name>`` (and gRPC ``application``
    metadata ``<name>``); deletes them on exit, so the next module finds Serve empty. Each role's
    options get :data:`DRAIN_CHECK` unless they set it."""
    from ray import serve
    from ray.serve.api import RunTarget

    from router.app import build_application

    targets = []
    for name, spec in apps.items():
        spec = dict(spec)
        for role in ("prefill", "decode", "ingress"):
            spec[role] = {**DRAIN_CHECK, **(spec.get(role) or {})}
        external = bool(spec.pop("external_scaler_enabled", False))
        targets.append(RunTarget(build_application(**spec), name=name, route_prefix=f"/{name}",
                                 external_scaler_enabled=external))
    try:
        serve.run_many(targets)
        yield
    finally:
        # Serve's blocking delete gives up after 60 s, and a replica's graceful shutdown alone
        # may take that long on a loaded machine: ask for all, then wait longer
        for name in apps:
            serve.delete(name, _blocking=False)
        deadline = time.monotonic() + delete_timeout_s
        while left := [n for n, st in serve.status().applications.items()
                       if n in apps and st.status != "NOT_STARTED"]:
            if time.monotonic() > deadline:
                raise TimeoutError(f"applications {left} not deleted after {delete_timeout_s} s")
            time.sleep(0.5)


def replica_ids(app: str, deployment: str) -> list[str]:
    """The (sorted) actor names of a deployment's replicas: a replica restarted gets a new one."""
    prefix = f"SERVE_REPLICA::{app}#{deployment}#"
    return sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith(prefix))


def replica_actors(app: str, deployment: str) -> list:
    return [ray.get_actor(n, namespace="serve") for n in replica_ids(app, deployment)]


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


def scale(app: str, deployment: str, num_replicas: int) -> None:
    """Sets one deployment's replica count through Serve's external scaling API (Ray 2.60: the
    controller's ``update_deployment_replicas``, behind the dashboard's
    ``POST /api/v1/applications/{app}/deployments/{deployment}/scale``; the test cluster runs no
    dashboard). Only that deployment's replicas start or stop, where a ``serve.run`` of the
    changed application would restart all of its replicas. The application must have been
    deployed with ``external_scaler_enabled`` (see :func:`deployed`)."""
    from ray.serve._private.common import DeploymentID
    from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE

    controller = ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)
    ray.get(controller.update_deployment_replicas.remote(DeploymentID(name=deployment, app_name=app), num_replicas),
            timeout=60)


def wait_replicas_running(app: str, deployment: str, num_replicas: int, timeout_s: float = 90.0) -> None:
    """Waits until Serve reports exactly ``num_replicas`` RUNNING replicas of the deployment and
    none starting or stopping (a replica's actor exists before its constructor has run: asking
    it for routing stats then fails); TimeoutError with the last states."""
    from ray import serve

    deadline, states = time.monotonic() + timeout_s, None
    while time.monotonic() < deadline:
        status = serve.status().applications[app].deployments[deployment]
        states = {str(getattr(k, "value", k)): v for k, v in status.replica_states.items() if v}
        if states == {"RUNNING": num_replicas}:
            return
        time.sleep(0.5)
    raise TimeoutError(f"{app}/{deployment}: expected {num_replicas} RUNNING replicas, last states {states}")
