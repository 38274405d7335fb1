"""Liveness and readiness (router/health.py): the readiness rule on Serve's own status objects,
the probe's cache and failure path, and a live service whose only prefill replica is killed:
``/health``, ``/health/ready`` and ``grpc.health.v1.Health/Check`` go unavailable, then back
once Serve replaced the replica; ``/health/live`` stays up throughout."""

from __future__ import annotations

import asyncio
import random
import threading
import time

import pytest

ray = pytest.importorskip("ray")
pytest.importorskip("ray.serve")
httpx = pytest.importorskip("httpx")
grpc = pytest.importorskip("grpc")
health_pb2 = pytest.importorskip("grpc_health.v1.health_pb2")
from grpc_health.v1 import health_pb2_grpc  # noqa: E402

from ray.serve.schema import ApplicationStatusOverview, DeploymentStatusOverview, ServeStatus  # noqa: E402

from router.health import ReadinessProbe, readiness_from_status  # noqa: E402
from serving.config import ServiceConfig  # noqa: E402
from tests.service_helpers import prompt_of, replica_actors  # noqa: E402

ROLES = {"prefill": "PrefillServer", "decode": "DecodeServer"}


def status_of(app: str, replicas: dict[str, dict[str, int]]) -> ServeStatus:
    deps = {name: DeploymentStatusOverview(status="HEALTHY", status_trigger="CONFIG_UPDATE_COMPLETED",
                                           replica_states=states, message="") for name, states in replicas.items()}
    overview = ApplicationStatusOverview(status="RUNNING", message="", last_deployed_time_s=0.0, deployments=deps)
    return ServeStatus(applications={app: overview})


def test_ready_when_every_role_has_a_running_replica():
    rng = random.Random(0)
    p, d = rng.randint(1, 5), rng.randint(1, 5)
    st = status_of("a", {"PrefillServer": {"RUNNING": p, "STARTING": 1}, "DecodeServer": {"RUNNING": d}})
    r = readiness_from_status(st, "a", ROLES)
    assert r.ready and r.replicas == {"prefill": p, "decode": d} and r.reason == ""
    assert r.to_dict() == {"status": "ready", "replicas": {"prefill": p, "decode": d}}


@pytest.mark.parametrize("down", ["prefill", "decode"])
def test_not_ready_while_a_role_has_none_running(down):
    states = {"PrefillServer": {"RUNNING": 2}, "DecodeServer": {"RUNNING": 1}}
    states[ROLES[down]] = {"STARTING": 1, "STOPPING": 1}  # a replacement on its way, the old one going
    r = readiness_from_status(status_of("a", states), "a", ROLES)
    assert not r.ready and r.replicas[down] == 0 and down in r.reason
    assert r.to_dict()["status"] == "unavailable"


def test_draining_node_replica_still_counts():
    st = status_of("a", {"PrefillServer": {"PENDING_MIGRATION": 1}, "DecodeServer": {"RUNNING": 1}})
    assert readiness_from_status(st, "a", ROLES).ready


def test_missing_application_or_deployment_is_not_ready():
    r = readiness_from_status(ServeStatus(), "a", ROLES)
    assert not r.ready and "not deployed" in r.reason
    r = readiness_from_status(status_of("a", {"PrefillServer": {"RUNNING": 1}}), "a", ROLES)
    assert not r.ready and r.replicas == {"prefill": 1, "decode": 0}


def test_probe_caches_and_reports_an_unreachable_controller():
    calls = []

    def fetch():
        calls.append(1)
        if len(calls) == 2:
            raise ConnectionError("controller gone")
        return status_of("a", {"PrefillServer": {"RUNNING": 1}, "DecodeServer": {"RUNNING": 1}})

    async def run():
        cached = ReadinessProbe("a", ROLES, refresh_s=3600.0, fetch_status=fetch)
        assert (await cached.check()).ready and (await cached.check()).ready
        assert len(calls) == 1  # the second answer came from the cache
        fresh = ReadinessProbe("a", ROLES, refresh_s=0.0, fetch_status=fetch)
        down = await fresh.check()
        assert not down.ready and "ConnectionError" in down.reason
        assert (await fresh.check()).ready  # and back
    asyncio.run(run())


def test_after_a_first_answer_a_slow_controller_keeps_it_until_it_is_stale():
    release, calls = threading.Event(), []

    def fetch():
        calls.append(1)
        if len(calls) > 1:
            release.wait(60)
        return status_of("a", {"PrefillServer": {"RUNNING": 1}, "DecodeServer": {"RUNNING": 1}})

    async def run(max_stale_s):
        # the first question may take up to first_timeout_s (it connects to the controller)
        probe = ReadinessProbe("a", ROLES, refresh_s=0.0, fetch_status=fetch, timeout_s=0.05, first_timeout_s=60.0,
                               max_stale_s=max_stale_s)
        try:
            assert (await probe.check()).ready
            return await probe.check()  # the second question hangs: the short timeout applies
        finally:
            release.set()

    kept = asyncio.run(run(60.0))  # a busy controller does not make a running service look down
    assert kept.ready and kept.replicas == {"prefill": 1, "decode": 1}
    calls.clear()
    release.clear()
    stale = asyncio.run(run(0.0))  # an answer older than max_stale_s is not kept
    assert not stale.ready and "within 0.05 s" in stale.reason
    with pytest.raises(ValueError, match="^max_stale_s"):
        ReadinessProbe("a", ROLES, refresh_s=1.0, max_stale_s=-1.0)


def test_probe_answers_while_the_controller_is_slow_and_asks_it_once():
    # a controller busy deploying (the service starting) must not hold a readiness probe
    release, calls = threading.Event(), []

    def fetch():
        calls.append(1)
        release.wait(60)
        return status_of("a", {"PrefillServer": {"RUNNING": 1}, "DecodeServer": {"RUNNING": 1}})

    async def run():
        probe = ReadinessProbe("a", ROLES, refresh_s=0.0, fetch_status=fetch, timeout_s=0.05, first_timeout_s=0.05)
        try:
            for _ in range(3):  # each answers while the controller still has not
                r = await probe.check()
                assert not r.ready and "did not answer" in r.reason and r.to_dict()["status"] == "unavailable"
            assert len(calls) == 1  # one question in flight, shared
        finally:
            release.set()
        probe.timeout_s = 60.0
        assert (await probe.check()).ready  # the answer to that same question
        assert len(calls) == 1
    asyncio.run(run())


def test_probe_rejects_negative_refresh_and_timeout():
    with pytest.raises(ValueError, match="refresh_s"):
        ReadinessProbe("a", ROLES, refresh_s=-1.0)
    for bad in (0.0, -1.0):
        with pytest.raises(ValueError, match="^timeout_s"):
            ReadinessProbe("a", ROLES, refresh_s=1.0, timeout_s=bad)
        with pytest.raises(ValueError, match="^first_timeout_s"):
            ReadinessProbe("a", ROLES, refresh_s=1.0, first_timeout_s=bad)


def test_health_refresh_option_is_validated():
    assert ServiceConfig.from_dict({"ingress": {"health_refresh_s": 0.25}}).ingress.health_refresh_s == 0.25
    with pytest.raises(ValueError, match="health_refresh_s"):
        ServiceConfig.from_dict({"ingress": {"health_refresh_s": -1}})


# ----------------------------------------------------------------------------- live service
APP = "healthapp"
STARTING = "healthstarting"
CONFIG = ServiceConfig.from_dict({"model": "builtin:tiny", "torch_threads": 1, "batch_wait_ms": 1.0, "prefill_kv_pages": 64,
                                  "decode_kv_pages": 64, "max_model_len": 256, "ingress": {"health_refresh_s": 0.2}})
SMALL = {"num_replicas": 1, "ray_actor_options": {"num_cpus": 0.25, "num_gpus": 0}, "health_check_period_s": 1.0}


# STARTING: a service whose workers never start; its ingress answers as during a start-up (no
# replica of either role RUNNING yet), for as long as the tests need
NONE = {**{k: v for k, v in SMALL.items() if k != "num_replicas"},  # Serve refuses num_replicas=0
        "autoscaling_config": {"min_replicas": 0, "initial_replicas": 0, "max_replicas": 1}}
# The ingress's graceful shutdown bounded at 5 s, not its 60 s: deleting the applications at the
# module's end once waited out the 60 s (a loaded machine), likely for the gRPC Watch stream of
# test_health_endpoints_when_all_roles_run, which the client cancels but which sends nothing
# while the status holds, so the ingress may not learn that the client left
INGRESS = {"ray_actor_options": {"num_cpus": 0.1}, "graceful_shutdown_timeout_s": 5.0}
SERVE_APPS = {APP: {"config": CONFIG, "prefill": SMALL, "decode": SMALL, "ingress": INGRESS},
              STARTING: {"config": CONFIG, "prefill": NONE, "decode": NONE, "ingress": INGRESS}}


@pytest.fixture(scope="module")
def service(service):
    """The shared service (tests/conftest.py): an HTTP client on this module's app, the gRPC channel."""
    with httpx.Client(base_url=f"{service['base']}/{APP}", timeout=60.0) as client:
        yield client, service["channel"]


def grpc_check(channel, service: str = "", timeout: float = 10.0, app: str = APP):
    stub = health_pb2_grpc.HealthStub(channel)
    return stub.Check(health_pb2.HealthCheckRequest(service=service), metadata=(("application", app),),
                      timeout=timeout).status


def test_not_ready_answers_at_once_while_no_worker_runs(service):
    client, channel = service
    # a short client timeout: an answer that waits for the workers would fail here
    with httpx.Client(base_url=str(client.base_url).replace(f"/{APP}", f"/{STARTING}"), timeout=5.0) as starting:
        for _ in range(3):
            r = starting.get("/health/ready")
            assert r.status_code == 503 and r.headers["retry-after"], r.text
            assert r.json()["replicas"] == {"prefill": 0, "decode": 0} and "no running" in r.json()["reason"]
            assert starting.get("/health").status_code == 503
        assert starting.get("/health/live").json() == {"status": "alive"}
    assert grpc_check(channel, timeout=5.0, app=STARTING) == health_pb2.HealthCheckResponse.NOT_SERVING


def test_health_endpoints_when_all_roles_run(service):
    client, channel = service
    assert client.get("/health").json() == {"status": "ok"}
    ready = client.get("/health/ready")
    assert ready.status_code == 200 and ready.json() == {"status": "ready", "replicas": {"prefill": 1, "decode": 1}}
    assert client.get("/health/live").json() == {"status": "alive"}
    for name in ("", "flashprefill.v1.FlashPrefill"):
        assert grpc_check(channel, name) == health_pb2.HealthCheckResponse.SERVING
    watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service=""),
                                                      metadata=(("application", APP),), timeout=30)
    assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
    watch.cancel()


def test_grpc_health_unknown_service_and_bad_bytes(service):
    _, channel = service
    with pytest.raises(grpc.RpcError) as info:
        grpc_check(channel, "no.such.Service")
    assert info.value.code() == grpc.StatusCode.NOT_FOUND and "no.such.Service" in info.value.details()
    raw = channel.unary_unary("/grpc.health.v1.Health/Check", request_serializer=None, response_deserializer=None)
    with pytest.raises(grpc.RpcError) as info:
        raw(b"\xff\xff\xff", metadata=(("application", APP),), timeout=10)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "HealthCheckRequest" in info.value.details()
    with pytest.raises(grpc.RpcError) as info:  # a service name that is not UTF-8 (a lone surrogate)
        raw(b"\x0a\x04a\xed\xa0\x80", metadata=(("application", APP),), timeout=10)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and info.value.details().startswith("service:")


def test_killing_the_only_prefill_replica_makes_the_service_unready_until_replaced(service):
    client, channel = service
    (actor,) = replica_actors(APP, "PrefillServer")
    ray.kill(actor, no_restart=True)
    up, down = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
    seen_http, seen_ready, seen_grpc, live = [], [], [], set()
    deadline = time.monotonic() + 180.0
    while time.monotonic() < deadline:
        for seen, code in ((seen_http, client.get("/health").status_code),
                           (seen_ready, client.get("/health/ready").status_code),
                           (seen_grpc, grpc_check(channel))):
            if not seen or seen[-1] != code:
                seen.append(code)
        live.add(client.get("/health/live").status_code)
        if all(bad in s and s[-1] == good for s, good, bad in ((seen_http, 200, 503), (seen_ready, 200, 503),
                                                               (seen_grpc, up, down))):
            break
        time.sleep(0.1)
    # the first probe may already see the kill; what must show is down, then up again
    assert seen_http[-2:] == [503, 200], seen_http
    assert seen_ready[-2:] == [503, 200], seen_ready
    assert seen_grpc[-2:] == [down, up], seen_grpc
    assert live == {200}
    body = client.get("/health/ready").json()
    assert body == {"status": "ready", "replicas": {"prefill": 1, "decode": 1}}
    r = client.post("/v1/completions", json={"model": "builtin:tiny", "prompt": prompt_of(20, seed=5),
                                             "max_tokens": 3, "temperature": 0})
    assert r.status_code == 200, r.text


# The answers a loaded machine may give first, by design: the health app's when the ingress takes
# longer than its timeout (router/health_app.py), the ingress's when the Serve controller takes
# longer than the probe's wait (router/health.py: no replica counts then)
TRANSIENT = ("the ingress did not answer within", "Serve controller did not answer within")


def settled(http: httpx.Client, path: str, deadline_s: float = 60.0) -> httpx.Response:
    """``GET path`` again while the answer is one of the ``TRANSIENT`` ones; the first other answer
    (or the last one after ``deadline_s``)."""
    deadline = time.monotonic() + deadline_s
    while True:
        r = http.get(path)
        reason = r.json().get("reason", "") if r.status_code == 503 else ""
        if not reason.startswith(TRANSIENT) or time.monotonic() > deadline:
            return r
        assert r.headers["retry-after"] == "1", r.text
        time.sleep(0.2)


def test_startup_health_app_answers_while_the_main_ingress_is_held(service, serve_cluster, tmp_path):
    """router/health_app.py in Serve: 503 "starting" while the main application is not deployed
    and while its ingress constructor is held, the ingress's own answer once it runs (a held
    stand-in here; the real ingress through APP and STARTING), liveness throughout."""
    import os

    from ray import serve

    from router.health_app import health_application

    base = f"http://127.0.0.1:{serve_cluster.http_port}"
    gate = tmp_path / "release"
    held = "healthheld"

    @serve.deployment(ray_actor_options={"num_cpus": 0})
    class Held:  # an ingress whose constructor waits for the test, as one importing torch waits for it
        def __init__(self, gate: str) -> None:
            while not os.path.exists(gate):
                time.sleep(0.05)

        async def health_answer(self, probe: str):
            return 200, {"status": "released", "probe": probe}, {}

    startup = {held: f"/{held}/health", APP: f"/{APP}-startup", STARTING: f"/{STARTING}-startup"}
    try:
        # the held stand-in's health app gives up after 0.5 s (the proxy must not hold the probe);
        # the real ingresses' get 4 s (under the client's 5 s), so a loaded machine still passes
        # their answers through instead of "starting"
        serve.run_many([serve.RunTarget(health_application(app, timeout_s=0.5 if app == held else 4.0),
                                        name=f"{app}-health", route_prefix=route)
                        for app, route in startup.items()])
        # a short client timeout: a request the proxy holds fails here
        with httpx.Client(base_url=base, timeout=5.0) as http:
            def starting(path: str) -> dict:
                r = http.get(path)
                assert r.status_code == 503 and r.headers["retry-after"] == "1", r.text
                assert r.json()["status"] == "starting", r.text
                return r.json()

            assert "does not exist" in starting(f"/{held}/health/ready")["reason"]  # not deployed yet
            serve.run_many([serve.RunTarget(Held.bind(str(gate)), name=held, route_prefix=f"/{held}")],
                           wait_for_applications_running=False)
            for _ in range(3):
                starting(f"/{held}/health/ready")
                starting(f"/{held}/health")
                assert http.get(f"/{held}/health/live").json() == {"status": "alive"}
            # the real ingress's answers pass through unchanged
            r = settled(http, f"/{APP}-startup/ready")
            assert r.status_code == 200 and r.json() == {"status": "ready", "replicas": {"prefill": 1, "decode": 1}}
            assert settled(http, f"/{APP}-startup").json() == {"status": "ok"}
            r = settled(http, f"/{STARTING}-startup/ready")
            assert r.status_code == 503 and r.headers["retry-after"] == "1", r.text
            assert r.json()["replicas"] == {"prefill": 0, "decode": 0} and "no running" in r.json()["reason"]
            gate.touch()
            deadline, codes = time.monotonic() + 180.0, []
            while time.monotonic() < deadline:
                r = http.get(f"/{held}/health/ready")
                codes.append(r.status_code)
                if r.status_code == 200:
                    break
                assert r.json()["status"] == "starting", r.text
                time.sleep(0.2)
            assert r.status_code == 200 and r.json() == {"status": "released", "probe": "ready"}, codes
            assert http.get(f"/{held}/health").json() == {"status": "released", "probe": "health"}
    finally:
        gate.touch()
        for app in startup:
            serve.delete(f"{app}-health")
        serve.delete(held)
