"""The start-up health application (router/health_app.py) without a cluster: its decision (no
main application, an ingress that does not answer in time, the ingress's answer passed through),
its paths, the ingress's shared ``health_answer``, that it imports no torch, and the launcher's
order (health application first, deleted once the main one runs)."""

from __future__ import annotations

import asyncio
import json
import os
import random
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("ray.serve")
from starlette.requests import Request  # noqa: E402

from router import health_app  # noqa: E402
from router.health import Readiness  # noqa: E402
from router.health_app import StartupHealth, answer_within, health_application  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def run(coro):
    return asyncio.run(coro)


def test_an_ingress_that_raises_or_is_late_means_starting():
    async def no_app():
        raise RuntimeError("Application 'flashprefill' does not exist.")

    status, body, headers = run(answer_within(no_app, 5.0, 7))
    assert (status, body["status"], headers) == (503, "starting", {"Retry-After": "7"})
    assert "does not exist" in body["reason"]

    cancelled = []

    async def late():
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            cancelled.append(True)
            raise
        return 200, {}, {}

    status, body, headers = run(answer_within(late, 0.05, 1))
    assert (status, body["status"], headers["Retry-After"]) == (503, "starting", "1")
    assert "within 0.05 s" in body["reason"]
    assert cancelled == [True]  # the late question does not stay queued


def test_the_ingress_answer_passes_through_unchanged():
    rng = random.Random(0)
    answers = [(200, {"status": "ready", "replicas": {"prefill": rng.randint(1, 9), "decode": rng.randint(1, 9)}}, {}),
               (503, {"status": "unavailable", "replicas": {"prefill": 0, "decode": 1}, "reason": "no running prefill replica"},
                {"Retry-After": str(rng.randint(1, 9))})]
    for answer in answers:
        async def ask(answer=answer):
            return answer
        assert run(answer_within(ask, 5.0, 1)) == answer


def request(path: str, root: str = "/health") -> Request:
    return Request({"type": "http", "method": "GET", "path": path, "root_path": root, "headers": [],
                    "query_string": b""})


def probe_with(answers: dict[str, tuple]) -> tuple[StartupHealth, list[str]]:
    asked = []
    probe = StartupHealth("flashprefill", timeout_s=5.0)

    async def ask(kind):
        asked.append(kind)
        return answers[kind]
    probe.ask_ingress = ask
    return probe, asked


def answer_of(response) -> tuple[int, dict, str | None]:
    return response.status_code, json.loads(response.body), response.headers.get("retry-after")


def test_paths_under_the_route():
    probe, asked = probe_with({"ready": (200, {"status": "ready", "replicas": {"prefill": 1, "decode": 1}}, {}),
                               "health": (503, {"status": "unavailable", "reason": "x"}, {"Retry-After": "3"})})
    assert answer_of(run(probe(request("/health/live")))) == (200, {"status": "alive"}, None)
    assert asked == []  # liveness asks nothing
    assert answer_of(run(probe(request("/health/ready")))) == (200, {"status": "ready", "replicas": {"prefill": 1, "decode": 1}}, None)
    assert answer_of(run(probe(request("/health")))) == (503, {"status": "unavailable", "reason": "x"}, "3")
    assert answer_of(run(probe(request("/health/")))) == (503, {"status": "unavailable", "reason": "x"}, "3")
    # a route prefix of its own (an application not at "/"): the same paths under it
    assert answer_of(run(probe(request("/mine/health/ready", root="/mine/health"))))[0] == 200
    assert asked == ["ready", "health", "health", "ready"]
    status, body, _ = answer_of(run(probe(request("/health/nope"))))
    assert status == 404 and body["error"]["code"] == "not_found"


def test_ask_ingress_cancels_a_call_that_outlives_the_deadline():
    cancelled = []

    class Response:
        def __await__(self):
            return asyncio.sleep(60).__await__()

        def cancel(self):
            cancelled.append(True)

    probe = StartupHealth("flashprefill", timeout_s=0.05)
    probe._handle = SimpleNamespace(health_answer=SimpleNamespace(remote=lambda kind: Response()))
    status, body, _ = answer_of(run(probe(request("/health/ready"))))
    assert (status, body["status"], cancelled) == (503, "starting", [True])


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="^app"):
        StartupHealth("")
    for bad in (0.0, -1.0):
        with pytest.raises(ValueError, match="^timeout_s"):
            StartupHealth("a", timeout_s=bad)
    with pytest.raises(ValueError, match="^retry_after_s"):
        StartupHealth("a", retry_after_s=-1)
    app = health_application("a", timeout_s=0.7)
    assert app._bound_deployment.ray_actor_options["num_cpus"] == 0  # starts beside replicas holding every CPU


def test_module_imports_no_torch():
    code = "import sys, router.health_app; print(sorted(m for m in ('torch', 'serving.config') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout + out.stderr


# ----------------------------------------------------------------------------- the ingress's side
def ingress_answer(state: Readiness, probe: str, retry_after_s: int = 2):
    from router.app import OpenAIIngress

    async def check():
        return state
    fake = SimpleNamespace(readiness=SimpleNamespace(check=check),
                           config=SimpleNamespace(ingress=SimpleNamespace(retry_after_s=retry_after_s)))
    return run(OpenAIIngress.health_answer(fake, probe))


def test_ingress_health_answer_is_what_the_routes_answered():
    up = Readiness(True, {"prefill": 2, "decode": 1})
    down = Readiness(False, {"prefill": 0, "decode": 1}, "no running prefill replica")
    assert ingress_answer(up, "ready") == (200, {"status": "ready", "replicas": {"prefill": 2, "decode": 1}}, {})
    assert ingress_answer(up, "health") == (200, {"status": "ok"}, {})
    assert ingress_answer(down, "ready") == (503, {"status": "unavailable", "replicas": {"prefill": 0, "decode": 1},
                                                   "reason": "no running prefill replica"}, {"Retry-After": "2"})
    assert ingress_answer(down, "health", 0) == (503, {"status": "unavailable", "reason": "no running prefill replica"},
                                                 {"Retry-After": "1"})
    with pytest.raises(ValueError, match="^probe"):
        ingress_answer(up, "live")


# ----------------------------------------------------------------------------- the launcher's order
def launch(monkeypatch, calls: list[str], fail_main: bool = False) -> None:
    import ray
    from ray import serve

    from router import launcher
    from serving.config import ServiceConfig

    def deploy(config, options):
        calls.append("deploy main")
        if fail_main:
            raise RuntimeError("main application failed")
    monkeypatch.setattr(launcher, "prepare_environment", lambda *a, **k: None)
    monkeypatch.setattr(launcher, "start_local_ray", lambda options: calls.append("ray") or None)
    monkeypatch.setattr(launcher, "start_serve", lambda options: calls.append("serve"))
    monkeypatch.setattr(launcher, "deploy_startup_health", lambda config, options: calls.append("deploy health"))
    monkeypatch.setattr(launcher, "deploy", deploy)
    monkeypatch.setattr(launcher, "metrics_url", lambda: None)
    monkeypatch.setattr(serve, "delete", lambda name, *a, **k: calls.append(f"delete {name}"))
    monkeypatch.setattr(ray, "shutdown", lambda: calls.append("ray down"))
    config = ServiceConfig.from_dict({"model": "builtin:tiny"})
    launcher.serve_forever(config, launcher.LocalServeOptions(), wait=lambda: calls.append("serving"))


def test_launcher_deploys_health_first_and_deletes_it_once_the_main_app_runs(monkeypatch, capsys):
    calls: list[str] = []
    launch(monkeypatch, calls)
    assert calls == ["ray", "serve", "deploy health", "deploy main", "delete flashprefill-health", "serving",
                     "delete flashprefill", "ray down"]
    assert "health:" in capsys.readouterr().out


def test_launcher_deletes_the_health_app_when_the_main_app_fails(monkeypatch):
    calls: list[str] = []
    with pytest.raises(RuntimeError, match="main application failed"):
        launch(monkeypatch, calls, fail_main=True)
    assert calls == ["ray", "serve", "deploy health", "deploy main", "delete flashprefill-health"]


def test_health_route_follows_the_application_route():
    from router.launcher import LocalServeOptions, health_app_name, route_prefix

    assert (route_prefix(LocalServeOptions()), health_app_name(LocalServeOptions())) == ("/", "flashprefill-health")
    other = LocalServeOptions(app_name="mine")
    assert (route_prefix(other), health_app_name(other)) == ("/mine", "mine-health")
    assert health_app.HEALTH_ROUTE == "/health"


def test_startup_health_timeout_option_is_validated():
    from serving.config import ServiceConfig

    value = round(random.Random(1).uniform(0.1, 2.0), 2)
    cfg = ServiceConfig.from_dict({"ingress": {"startup_health_timeout_s": value}})
    assert cfg.ingress.startup_health_timeout_s == value
    for bad in (0, -1.0, 11.0):
        with pytest.raises(ValueError, match="startup_health_timeout_s"):
            ServiceConfig.from_dict({"ingress": {"startup_health_timeout_s": bad}})
