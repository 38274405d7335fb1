"""``python -m router serve``: a local Ray on 127.0.0.1, the application deployed, URLs printed.

For a cluster, use the Serve config file instead (``serve deploy serve_config.yaml`` against
a cluster started from ``cluster.yaml``); this launcher is the one-command local path.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from serving.config import ServiceConfig

APP_NAME = "flashprefill"
GRPC_MAX_MESSAGE_BYTES = 4 << 20
REPO_ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class LocalServeOptions:
    host: str = "127.0.0.1"
    http_port: int = 8000
    grpc_port: int = 9000
    prefill_replicas: int = 1
    decode_replicas: int = 1
    num_cpus: int | None = None
    app_name: str = APP_NAME
    dashboard_port: int | None = None  # None: Ray's 8265, or the next free port
    metrics_port: int | None = None  # None: a free port (`router serve` passes 8080); printed at start
    ray_auth: bool = True  # Ray's token authentication (RAY_AUTH_MODE=token) unless RAY_AUTH_MODE says otherwise
    # Ray's dashboard (``serve status``, ``ray list``, the scaling REST API): off only for tools
    # that need none of it, as the CPU smoke benchmarks (its head and its nine module processes
    # are most of a local Ray's start-up on 2 cores)
    include_dashboard: bool = True
    # Serve's logs (its LoggingConfig): access_log, one line per request from Serve's proxy (the
    # replicas' lines, several per request, stay off); log_level, every component's
    access_log: bool = False
    log_level: str = "INFO"

    def logging_config(self, *, proxy: bool) -> dict:
        """Serve's ``logging_config``: the proxy's (``serve.start``: proxies and controller) or the
        applications' (``serve.run``: every replica; their access lines would repeat the proxy's
        for each call between deployments)."""
        return {"log_level": self.log_level, "enable_access_log": self.access_log and proxy}


# Ray reads this once, when ``ray`` is first imported (ray._private.ray_constants), to decide
# whether an explicit 127.0.0.1 node address means loopback ("0") or "this machine's routable
# address" (the default on Linux); with "0" the GCS, raylet, workers and metrics agent all
# bind to 127.0.0.1 (Ray's C++ servers listen on loopback only when the node IP is 127.0.0.1).
LOOPBACK_ONLY_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
LOOPBACK = ("127.0.0.1", "::1", "::ffff:127.0.0.1", "localhost")
AUTH_MODE_ENV = "RAY_AUTH_MODE"



def sparse_summary(config) -> str:
    """One line for the banner: how prompts are prefilled (the profile, the safeguards and where
    sparse attention starts), saying so plainly when it never does within the model's context."""
    from serving.config import resolve_max_model_len

    sp = config.sparse
    try:
        limit = resolve_max_model_len(config)
    except ValueError:
        limit = None
    profile = {None: "no profile", "none": "no profile", "auto": "the shipped profile"}.get(sp.profile, sp.profile)
    if sp.profile == "auto":
        from model_executor.sparse_profile import shipped_profile_path

        path = shipped_profile_path(config.model.model)
        profile = f"profile {path.name}" if path is not None and path.exists() else "no profile"
    if sp.alpha == 0 and not sp.layer_alpha:
        return f"dense (sparse.alpha 0; {profile})"
    if limit is not None and sp.dense_below > limit:
        return (f"dense up to the model's context ({limit} tokens): sparse prefill starts at {sp.dense_below} "
                f"(sparse.dense_below), where it pays on this model ({profile})")
    layers = f", layer_alpha x{len(sp.layer_alpha)}" if sp.layer_alpha else ""
    dense_layers = f", first {sp.dense_layers} layers dense" if sp.dense_layers else ""
    return (f"FlashPrefill V2 sparse from {sp.dense_below} tokens (alpha {sp.alpha}{layers}, last "
            f"{sp.last_dense_tiles} query tiles dense, energy rule {sp.energy_rule}{dense_layers}; {profile})")

def local_gpus() -> tuple[int, int] | None:
    """``(count, total bytes of the first)`` of this machine's NVIDIA GPUs, from ``nvidia-smi``
    (no CUDA context in the launcher: it would hold memory the replicas plan for); None without."""
    import shutil
    import subprocess

    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        out = subprocess.run([exe, "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=10, check=True).stdout.split()
        return (len(out), int(out[0]) << 20) if out else None
    except (OSError, subprocess.SubprocessError, ValueError):
        return None


def memory_plan(config: ServiceConfig, gpus: tuple[int, int] | None) -> tuple[list[str], list[str]]:
    """The banner's memory lines (one per role: weights, workspace, KV pages = tokens) and why
    the service does not fit (empty: it does), for ``gpus`` = ``(count, bytes each)`` of the GPUs
    the local replicas get (:func:`local_gpus`; None: none here). The replicas compute the same
    plan at start (``serving.runtime.pool_pages``) from their own device."""
    from serving.runtime import CPU_AUTO_PAGES, check_plan, placement_share, replica_memory_plan

    share = placement_share(config, gpus[0] if gpus else 0)
    if not gpus or share == 0:
        pools = {side: getattr(config.kv, f"{side}_pages") for side in ("prefill", "decode")}
        shown = ", ".join(f"{side} {CPU_AUTO_PAGES if p == 'auto' else p} pages" for side, p in pools.items())
        return [f"no GPU for the replicas: KV pools {shown} of {config.kv.page_size} tokens (not planned)"], []
    lines, problems = [], []
    for side in ("prefill", "decode"):
        try:
            plan = replica_memory_plan(config, side, device_total_bytes=gpus[1], share=share)
        except ValueError as exc:
            lines.append(f"{side}: not planned ({exc})")
            continue
        lines.append(plan.summary())
        try:
            check_plan(config, plan)
        except ValueError as exc:
            problems.extend(str(exc).splitlines())
    return lines, problems


def keep_ray_on_loopback() -> None:
    """Make a Ray started by this process (and the processes it starts) loopback-only."""
    os.environ[LOOPBACK_ONLY_ENV] = "0"
    constants = sys.modules.get("ray._private.ray_constants")
    if constants is not None and getattr(constants, "ENABLE_RAY_CLUSTER", False):
        # Ray was imported before the variable was set (test fixtures import ray at module
        # level): ray.init reads the node address rule from this attribute, so a late
        # caller still gets a loopback node instead of one on every interface.
        constants.ENABLE_RAY_CLUSTER = False


QUEUE_LENGTH_DEADLINE_S = 0.5


def prepare_environment(host: str = "127.0.0.1", *, auth: bool = False) -> None:
    """What Ray reads from the environment, set before Ray is imported and started: workers
    import this repository's packages; a loopback ``host`` keeps every Ray process on loopback;
    ``auth``: Ray's token authentication (the token in ``~/.ray/auth_token``, created on first
    use, or ``RAY_AUTH_TOKEN`` / ``RAY_AUTH_TOKEN_PATH``); without it ``RAY_AUTH_MODE``
    defaults to ``disabled`` (the test fixtures, whose clusters all run in one process). An
    explicit ``RAY_AUTH_MODE`` always wins."""
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if str(REPO_ROOT) not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), *paths])
    if host in LOOPBACK:
        keep_ray_on_loopback()
    os.environ.setdefault(AUTH_MODE_ENV, "token" if auth else "disabled")
    # the gRPC proxy's own message limit (Ray's default is 2 GiB); the ingress then applies
    # ingress.max_request_bytes. Proxies inherit this from the process that starts the local Ray.
    os.environ.setdefault("RAY_SERVE_GRPC_MAX_MESSAGE_SIZE", str(GRPC_MAX_MESSAGE_BYTES))
    # Serve's routers ask a replica for its queue length when their cache has no answer, and
    # log a WARNING for each answer later than this (0.1 s by default, doubling per retry): on a
    # busy CPU host a burst of requests made that tens of lines of noise
    os.environ.setdefault("RAY_SERVE_QUEUE_LENGTH_RESPONSE_DEADLINE_S", str(QUEUE_LENGTH_DEADLINE_S))


def ray_init_kwargs(host: str = "127.0.0.1", *, dashboard_port: int | None = None,
                    metrics_port: int | None = None) -> dict[str, Any]:
    """``ray.init`` options for a local service: a loopback node (every Ray process listens on
    127.0.0.1 only, see LOOPBACK_ONLY_ENV), the dashboard on loopback (so ``serve status`` and
    ``ray list actors`` work), Prometheus metrics on ``metrics_port`` (None: a free port), and
    the worker setup hook that makes Serve's gRPC proxy listen on ``host``."""
    from .security import GRPC_HOST_ENV, SETUP_HOOK

    os.environ.setdefault(GRPC_HOST_ENV, host)
    if host in LOOPBACK:
        keep_ray_on_loopback()
    # address "local": a new Ray even where `ray start` left its address behind (ray.init()
    # would connect to that cluster instead, and refuse num_cpus)
    kwargs: dict[str, Any] = {"address": "local", "include_dashboard": True, "dashboard_host": "127.0.0.1",
                              "_node_ip_address": "127.0.0.1",
                              "runtime_env": {"worker_process_setup_hook": SETUP_HOOK}}
    if dashboard_port is not None:
        kwargs["dashboard_port"] = dashboard_port
    if metrics_port is not None:
        kwargs["_metrics_export_port"] = metrics_port
    return kwargs


def check_port_free(port: int, name: str, host: str = "127.0.0.1") -> None:
    """ValueError naming ``name`` when ``host:port`` cannot be bound (Ray's metrics agent would
    otherwise fail inside the cluster, far from the flag that caused it)."""
    if not 0 <= port <= 65535:
        raise ValueError(f"{name}: expected a port in 0..65535, got {port}")
    if port == 0:
        return
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError as exc:
            raise ValueError(f"{name}: {host}:{port} is not free ({exc.strerror or exc})") from None


def _ray_imported() -> bool:
    return "ray" in sys.modules


def start_local_ray(options: LocalServeOptions) -> str | None:
    """Starts the local Ray unless one runs; the dashboard's URL (None: Ray was running)."""
    auth = options.ray_auth
    if auth and _ray_imported() and AUTH_MODE_ENV not in os.environ:
        # Ray reads RAY_AUTH_MODE once, at import: turned on now, the GCS would check tokens that
        # this process's own client never sends (a benchmark that imported Ray first)
        logging.getLogger(__name__).warning("Ray auth: off (Ray was imported before %s could be set)", AUTH_MODE_ENV)
        auth = False
    prepare_environment(options.host, auth=auth)
    import ray  # after prepare_environment: Ray reads LOOPBACK_ONLY_ENV at import

    if ray.is_initialized():
        return None
    metrics_port = options.metrics_port or None  # 0: a free port, as None
    kwargs: dict[str, Any] = {**ray_init_kwargs(options.host, dashboard_port=options.dashboard_port,
                                                metrics_port=metrics_port),
                              "configure_logging": True, "logging_level": "WARNING"}
    if not options.include_dashboard:
        kwargs["include_dashboard"] = False
    # Ray's CPU counts are scheduling tokens: one prefill and one decode replica (1 CPU
    # each) plus the ingress (0.5) must fit even on a 2-core machine.
    kwargs["num_cpus"] = options.num_cpus if options.num_cpus is not None else max(4, os.cpu_count() or 1)
    context = _init_ray_retrying_slow_starts(ray, kwargs)
    url = getattr(context, "dashboard_url", None)
    return f"http://{url}" if url and "://" not in url else url


# Ray's own error when the raylet has not registered with the GCS within Ray's fixed 30 s
# (ray/_private/node.py): a loaded machine, seen on 2 cores with two local clusters starting
RAY_NODE_START_TIMEOUT = "timed out during startup"


RAY_START_ATTEMPTS = 3  # on a 2-core machine under load one retry was seen not to be enough


def _init_ray_retrying_slow_starts(ray, kwargs: dict) -> Any:
    """``ray.init(**kwargs)``; when it fails on Ray's fixed node start-up timeout, the
    processes that attempt started are stopped and Ray is started again, up to
    ``RAY_START_ATTEMPTS`` attempts in all. Any other error, or the last timeout, is raised."""
    import psutil  # a dependency of Ray's own process management

    me = psutil.Process()
    for attempt in range(1, RAY_START_ATTEMPTS + 1):
        # direct children only: Ray's node processes are the driver's children (their own workers
        # end with the raylet), and nothing else this process runs is touched
        before = {child.pid for child in me.children()}
        try:
            return ray.init(**kwargs)
        except Exception as exc:
            if RAY_NODE_START_TIMEOUT not in str(exc) or attempt == RAY_START_ATTEMPTS:
                raise
            started = [child for child in me.children() if child.pid not in before]
            logging.getLogger(__name__).warning(
                "Ray's node did not start within Ray's fixed 30 s (a loaded machine?): stopping the %d "
                "processes it started and starting Ray once more", len(started))
            for child in started:
                try:
                    child.kill()
                except psutil.Error:
                    pass
            psutil.wait_procs(started, timeout=10)
    raise AssertionError("unreachable")


def metrics_url() -> str | None:
    """The Prometheus endpoint of this (local) node's metrics agent, from Ray's node table."""
    import ray

    for node in ray.nodes():
        if node.get("Alive") and node.get("MetricsExportPort"):
            return f"http://{node['NodeManagerAddress']}:{node['MetricsExportPort']}/metrics"
    return None


class _DropReattachNotice(logging.Filter):
    """``serve.run`` always calls Serve's start-up again; finding the Serve instance that
    ``start_serve`` has just started with our HTTP and gRPC options (``serve.run`` takes no gRPC
    options), it logs that it connects to it and that new options "will not be applied": true,
    but none were passed, so on every start it only misleads."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Connecting to existing Serve app")


def start_serve(options: LocalServeOptions) -> None:
    from ray import serve
    from ray.serve.config import gRPCOptions

    from .app import GRPC_SERVICER

    serve.start(
        http_options={"host": options.host, "port": options.http_port},
        grpc_options=gRPCOptions(port=options.grpc_port, grpc_servicer_functions=[GRPC_SERVICER]),
        logging_config=options.logging_config(proxy=True),
    )


def route_prefix(options: LocalServeOptions) -> str:
    return "/" if options.app_name == APP_NAME else f"/{options.app_name}"


def health_app_name(options: LocalServeOptions) -> str:
    from .health_app import HEALTH_APP_SUFFIX

    return options.app_name + HEALTH_APP_SUFFIX


def deploy_startup_health(config: ServiceConfig, options: LocalServeOptions) -> None:
    """The start-up health application (router/health_app.py) at ``<route>/health``, waited
    for until its replica runs: from then on the health paths answer (503 "starting") while
    the main application's replicas start, instead of being held by Serve's proxy."""
    from ray import serve

    from .health_app import HEALTH_ROUTE, health_application

    app = health_application(options.app_name, timeout_s=config.ingress.startup_health_timeout_s,
                             retry_after_s=config.ingress.retry_after_s)
    serve.run(app, name=health_app_name(options), route_prefix=route_prefix(options).rstrip("/") + HEALTH_ROUTE,
              logging_config=options.logging_config(proxy=False))


def deploy(config: ServiceConfig, options: LocalServeOptions, *, prefill: dict | None = None,
           decode: dict | None = None, ingress: dict | None = None, blocking: bool = False):
    from ray import serve

    from .app import build_application

    # a role with max_replicas in its config section autoscales (serving/autoscaling.py)
    prefill_opts = {**({} if config.prefill.max_replicas else {"num_replicas": options.prefill_replicas}), **(prefill or {})}
    decode_opts = {**({} if config.decode.max_replicas else {"num_replicas": options.decode_replicas}), **(decode or {})}
    app = build_application(config, prefill=prefill_opts, decode=decode_opts, ingress=ingress)
    # Fixed replica counts: Serve's external scaling API sets one role's count at a time
    # (POST <dashboard>/api/v1/applications/<app>/deployments/PrefillServer/scale), starting or
    # stopping only that role's replicas; a redeploy would restart every replica. Serve refuses it
    # next to autoscaling.
    return serve.run(app, name=options.app_name, route_prefix=route_prefix(options), blocking=blocking,
                     external_scaler_enabled=not autoscales(config, prefill_opts, decode_opts, ingress or {}),
                     logging_config=options.logging_config(proxy=False))


def autoscales(config: ServiceConfig, *deployment_options: dict) -> bool:
    """Whether Serve autoscales any deployment: a role with ``max_replicas`` in its config section
    (serving/autoscaling.py), or options with an ``autoscaling_config`` or ``num_replicas="auto"``."""
    return bool(config.prefill.max_replicas or config.decode.max_replicas) or any(
        o.get("autoscaling_config") is not None or o.get("num_replicas") == "auto" for o in deployment_options)


def replica_stats(app: str, deployment: str, timeout_s: float = 10.0) -> list[dict]:
    """``record_routing_stats()`` of every live replica of ``deployment`` in application
    ``app`` (tests, drills, benchmarks); a replica stopping right now is left out."""
    import ray

    prefix = f"SERVE_REPLICA::{app}#{deployment}#"
    out = []
    for info in ray.util.list_named_actors(all_namespaces=True):
        if not info["name"].startswith(prefix):
            continue
        try:
            actor = ray.get_actor(info["name"], namespace="serve")
            out.append(ray.get(actor.record_routing_stats.remote(), timeout=timeout_s))
        except (ValueError, ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            pass
    return out


def wait_for_stop_signal() -> None:
    stop = threading.Event()
    # explicit handlers: a launcher started in the background inherits an ignored SIGINT
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    while not stop.wait(1.0):
        pass


def serve_forever(config: ServiceConfig, options: LocalServeOptions,
                  wait: Callable[[], None] = wait_for_stop_signal) -> int:
    """Starts the local Ray and Serve, deploys, prints the URLs, serves until ``wait`` returns
    (Ctrl-C or SIGTERM), then stops everything it started."""
    plan_lines, problems = memory_plan(config, local_gpus())
    if problems:  # before Ray starts: a replica would refuse the same plan, or run out of memory
        print("FlashPrefill Serve: not starting, the service does not fit its GPU memory:", file=sys.stderr)
        for line in plan_lines + problems:
            print(f"  {line}", file=sys.stderr)
        return 2
    # the environment first: Ray reads part of it when it is imported
    prepare_environment(options.host, auth=options.ray_auth)
    import ray
    from ray import serve

    dashboard = start_local_ray(options)
    start_serve(options)
    notice = _DropReattachNotice()
    serve_logger = logging.getLogger("ray.serve")
    serve_logger.addFilter(notice)
    try:
        # health first: until the main ingress replica runs, the proxy holds requests to its route
        deploy_startup_health(config, options)
        try:
            deploy(config, options)
        finally:
            # the ingress answers the health paths itself from now on; and with one application
            # left, gRPC clients need no `application` metadata
            serve.delete(health_app_name(options))
    finally:
        serve_logger.removeFilter(notice)
    metrics = metrics_url()
    base = f"http://{options.host}:{options.http_port}"
    print(f"FlashPrefill Serve is up: model {config.model_id!r} "
          f"({options.prefill_replicas} prefill, {options.decode_replicas} decode replica(s))")
    print(f"  HTTP (OpenAI): {base}/v1/completions  {base}/v1/chat/completions  {base}/v1/models  {base}/health")
    print(f"  gRPC:          {options.host}:{options.grpc_port}  flashprefill.v1.FlashPrefill/Generate, GenerateStream")
    print(f"  metrics:       {metrics or 'n/a'}   (Prometheus text: ray_serve_* and ray_flashprefill_*)")
    if dashboard:
        print(f"  dashboard:     {dashboard}   (serve status -a {dashboard}; ray list actors --address {dashboard})")
        if os.environ.get(AUTH_MODE_ENV) == "token":  # Ray's CLIs send the token only in token mode
            where = "RAY_AUTH_TOKEN" if os.environ.get("RAY_AUTH_TOKEN") else \
                os.environ.get("RAY_AUTH_TOKEN_PATH") or "~/.ray/auth_token"
            print(f"  Ray auth:      token (in {where}); for those CLIs: export RAY_AUTH_MODE=token")
    print(f"  health:        {base}/health/live (liveness)  {base}/health/ready (readiness)  grpc.health.v1.Health")
    print(f"  prefill:       {sparse_summary(config)}")
    for line in plan_lines:
        print(f"  memory:        {line}")
    print("  try:           python -m router client \"Hello\" --stream   (Ctrl-C to stop)")
    sys.stdout.flush()
    wait()
    print("shutting down")
    # The application is deleted (its replicas drain, as serve.shutdown would do), then Ray
    # stops with Serve's controller and proxies. serve.shutdown() would end with the
    # controller killing itself while its graceful_shutdown call is in flight, a call Ray
    # retries forever on that actor, hence "graceful_shutdown failed ... infinite retries
    # remaining" on every stop.
    serve.delete(options.app_name)
    ray.shutdown()
    return 0
