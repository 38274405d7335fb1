"""The local launcher (``python -m router serve``) without starting Ray: the default service
fits a 2-core machine; Ray's environment (loopback-only, token auth) is set before ray.init;
the banner names the loopback metrics URL; a stop deletes the application and stops Ray
without Serve's graceful_shutdown call (whose retry Ray logs as a failure)."""

import logging
import os
import random
import subprocess
import sys

import pytest

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")

from ray._private import ray_constants  # noqa: E402

from router import launcher  # noqa: E402
from router.app import build_application  # noqa: E402,F401  (the app must import)
from serving.config import ServiceConfig  # noqa: E402


@pytest.fixture
def env(monkeypatch):
    """A private copy of the environment and of Ray's import-time loopback constant."""
    copy = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    monkeypatch.setattr(os, "environ", copy)
    monkeypatch.setattr(ray_constants, "ENABLE_RAY_CLUSTER", True)
    return copy


def fake_init(monkeypatch, seen: dict):
    def init(**kw):
        # what Ray's processes will inherit, as it stands when ray.init runs
        seen.update(kw, env={k: os.environ.get(k) for k in (launcher.LOOPBACK_ONLY_ENV, launcher.AUTH_MODE_ENV)},
                    enable_cluster=ray_constants.ENABLE_RAY_CLUSTER)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", init)


def test_default_local_ray_fits_one_prefill_one_decode_and_ingress(monkeypatch, env):
    seen = {}
    fake_init(monkeypatch, seen)
    monkeypatch.setattr(launcher.os, "cpu_count", lambda: 2)
    monkeypatch.setattr(launcher, "_ray_imported", lambda: False)  # as in `router serve`
    launcher.start_local_ray(launcher.LocalServeOptions())
    # prefill (1 CPU) + decode (1 CPU) + ingress (0.5 CPU) replicas by default
    assert seen["num_cpus"] >= 2.5
    assert seen["_node_ip_address"] == "127.0.0.1" and seen["dashboard_host"] == "127.0.0.1"
    # loopback-only and token auth, set before ray.init
    assert seen["env"] == {launcher.LOOPBACK_ONLY_ENV: "0", launcher.AUTH_MODE_ENV: "token"}
    assert seen["enable_cluster"] is False
    assert "_metrics_export_port" not in seen  # library callers: a free port


def test_explicit_num_cpus_metrics_port_and_auth_are_kept(monkeypatch, env):
    seen = {}
    fake_init(monkeypatch, seen)
    port = random.Random(os.urandom(4)).randint(20000, 60000)
    launcher.start_local_ray(launcher.LocalServeOptions(num_cpus=3, metrics_port=port, ray_auth=False))
    assert seen["num_cpus"] == 3 and seen["_metrics_export_port"] == port
    assert seen["env"][launcher.AUTH_MODE_ENV] == "disabled"


def test_the_dashboard_is_on_unless_a_tool_turns_it_off(monkeypatch, env):
    seen = {}
    fake_init(monkeypatch, seen)
    launcher.start_local_ray(launcher.LocalServeOptions(ray_auth=False))
    assert seen["include_dashboard"] is True and seen["dashboard_host"] == "127.0.0.1"
    launcher.start_local_ray(launcher.LocalServeOptions(ray_auth=False, include_dashboard=False))
    assert seen["include_dashboard"] is False


def test_an_explicit_ray_auth_mode_wins(monkeypatch, env):
    seen = {}
    fake_init(monkeypatch, seen)
    env[launcher.AUTH_MODE_ENV] = "disabled"
    launcher.start_local_ray(launcher.LocalServeOptions(ray_auth=True))
    assert seen["env"][launcher.AUTH_MODE_ENV] == "disabled"


def _sleeper() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])


def test_a_ray_start_that_timed_out_is_cleaned_up_and_tried_once_more(monkeypatch, env):
    """Ray's fixed 30 s node start-up timeout (a loaded machine): the processes the failed
    attempt started are stopped, other children are left alone, and the same ray.init runs
    again, up to RAY_START_ATTEMPTS in all; the last timeout is raised."""
    calls, spawned = [], []
    outcomes = ["timeout", "ok"]

    def init(**kw):
        calls.append(kw)
        if outcomes.pop(0) == "timeout":
            spawned.append(_sleeper())  # a GCS / raylet the attempt left behind
            raise Exception("The current node timed out during startup. This could happen because ...")
        return None

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", init)
    bystander = _sleeper()
    try:
        launcher.start_local_ray(launcher.LocalServeOptions(num_cpus=3, ray_auth=False))
        assert len(calls) == 2 and calls[0] == calls[1] and calls[0]["num_cpus"] == 3
        assert spawned[0].wait(timeout=10) is not None  # stopped (reaped by the launcher: no signal to read)
        assert bystander.poll() is None
        calls.clear()
        outcomes[:] = ["timeout", "timeout", "ok"]
        launcher.start_local_ray(launcher.LocalServeOptions(ray_auth=False))
        assert len(calls) == 3 and launcher.RAY_START_ATTEMPTS == 3
        calls.clear()
        outcomes[:] = ["timeout"] * launcher.RAY_START_ATTEMPTS
        with pytest.raises(Exception, match="timed out during startup"):
            launcher.start_local_ray(launcher.LocalServeOptions(ray_auth=False))
        assert len(calls) == launcher.RAY_START_ATTEMPTS
    finally:
        for proc in [bystander, *spawned]:
            proc.kill()
            proc.wait()


def test_a_ray_start_that_failed_otherwise_is_not_retried(monkeypatch, env):
    calls = []

    def init(**kw):
        calls.append(kw)
        raise ValueError("num_cpus: bad")

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", init)
    with pytest.raises(ValueError, match="num_cpus"):
        launcher.start_local_ray(launcher.LocalServeOptions(ray_auth=False))
    assert len(calls) == 1


def test_reattach_notice_is_dropped_and_nothing_else():
    drop = launcher._DropReattachNotice()

    def record(msg: str) -> logging.LogRecord:
        return logging.LogRecord("ray.serve", logging.INFO, __file__, 1, msg, None, None)
    assert not drop.filter(record('Connecting to existing Serve app in namespace "serve". New http_options/'
                                  'controller_options will not be applied.'))
    assert drop.filter(record("Application 'flashprefill' is ready at http://127.0.0.1:8000/."))


def test_serve_forever_prints_the_loopback_urls_and_stops_without_serve_shutdown(monkeypatch, env, capsys):
    calls = []
    port = random.Random(os.urandom(4)).randint(20000, 60000)
    monkeypatch.setattr(launcher, "start_local_ray", lambda o: calls.append("ray") or "http://127.0.0.1:8265")
    monkeypatch.setattr(launcher, "start_serve", lambda o: calls.append("serve"))

    def deploy(config, options):
        calls.append("deploy")
        # the notice Serve logs while deploying is filtered; other Serve lines are not
        assert any(isinstance(f, launcher._DropReattachNotice) for f in logging.getLogger("ray.serve").filters)
    monkeypatch.setattr(launcher, "deploy", deploy)
    # the start-up health app (router/health_app.py) goes first; its own behaviour: tests/test_health_app.py
    monkeypatch.setattr(launcher, "deploy_startup_health", lambda config, options: calls.append("health"))
    monkeypatch.setattr(launcher, "metrics_url", lambda: f"http://127.0.0.1:{port}/metrics")
    monkeypatch.setattr(serve, "delete", lambda name: calls.append(("delete", name)))
    monkeypatch.setattr(serve, "shutdown", lambda: calls.append("serve.shutdown"))
    monkeypatch.setattr(ray, "shutdown", lambda: calls.append("ray.shutdown"))
    config = ServiceConfig.from_dict({"model": "builtin:tiny"})
    rc = launcher.serve_forever(config, launcher.LocalServeOptions(metrics_port=port), wait=lambda: calls.append("wait"))
    out = capsys.readouterr().out
    assert rc == 0
    assert calls == ["ray", "serve", "health", "deploy", ("delete", launcher.APP_NAME + "-health"), "wait",
                     ("delete", launcher.APP_NAME), "ray.shutdown"]
    assert f"metrics:       http://127.0.0.1:{port}/metrics" in out
    assert "export RAY_AUTH_MODE=token" in out and "~/.ray/auth_token" in out
    assert not any(isinstance(f, launcher._DropReattachNotice) for f in logging.getLogger("ray.serve").filters)


def test_ray_auth_is_left_off_when_ray_was_imported_first(monkeypatch, env):
    """Ray reads RAY_AUTH_MODE at import: a caller that imported Ray before start_local_ray
    (bench_service) must not get a token-checking GCS its own client cannot talk to."""
    seen = {}
    fake_init(monkeypatch, seen)
    monkeypatch.setattr(launcher, "_ray_imported", lambda: True)
    launcher.start_local_ray(launcher.LocalServeOptions())
    assert seen["env"][launcher.AUTH_MODE_ENV] == "disabled"
    env[launcher.AUTH_MODE_ENV] = "token"  # an explicit mode still wins
    launcher.start_local_ray(launcher.LocalServeOptions())
    assert seen["env"][launcher.AUTH_MODE_ENV] == "token"


@pytest.mark.parametrize("config, prefill, want", [
    ({}, None, True),  # fixed counts: Serve's external scaling API sets one role's replicas
    ({"prefill": {"max_replicas": 3}}, None, False),  # the prefill role autoscales
    ({"decode": {"max_replicas": 2}}, None, False),
    ({}, {"num_replicas": "auto"}, False),
    ({}, {"autoscaling_config": {"min_replicas": 1, "max_replicas": 2}}, False),
])
def test_deploy_enables_external_scaling_only_without_autoscaling(monkeypatch, config, prefill, want):
    """Serve refuses external scaling next to an autoscaling deployment; with fixed counts the
    launcher turns it on, so `.../deployments/PrefillServer/scale` changes prefill alone."""
    seen: dict = {}
    monkeypatch.setattr(serve, "run", lambda app, **kw: seen.update(kw))
    import router.app

    monkeypatch.setattr(router.app, "build_application", lambda *a, **k: object())  # deploy imports it
    launcher.deploy(ServiceConfig.from_dict(config), launcher.LocalServeOptions(), prefill=prefill)
    assert seen["external_scaler_enabled"] is want and seen["name"] == launcher.LocalServeOptions().app_name
