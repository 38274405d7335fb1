"""A local run (``python -m router serve``) listens on loopback only, every process Ray started
included (GCS, raylet, workers, dashboard, agents, metrics export), with Ray's token
authentication on; it prints the metrics and dashboard URLs, both answer (``serve status``
through the dashboard, with the token), and Ctrl-C stops it without Serve's noise.

The launcher runs in a fresh process whose environment has no ``RAY_*`` variable from this
one, so nothing an earlier test set can make it pass."""

from __future__ import annotations

import os
import re
import secrets
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

psutil = pytest.importorskip("psutil")
httpx = pytest.importorskip("httpx")
ray = pytest.importorskip("ray")
pytest.importorskip("ray.serve")

from router.launcher import LOOPBACK, LOOPBACK_ONLY_ENV, check_port_free, ray_init_kwargs  # noqa: E402
from tests.service_helpers import free_port, prompt_of  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def test_init_kwargs_keep_ray_on_loopback(monkeypatch):
    # a copy of the environment and of Ray's import-time constant: nothing leaks to later tests
    monkeypatch.setattr(os, "environ", {k: v for k, v in os.environ.items() if k != LOOPBACK_ONLY_ENV})
    from ray._private import ray_constants

    monkeypatch.setattr(ray_constants, "ENABLE_RAY_CLUSTER", True)  # as when ray was imported first
    kw = ray_init_kwargs("127.0.0.1", dashboard_port=8311, metrics_port=8312)
    assert (kw["dashboard_host"], kw["_node_ip_address"], kw["include_dashboard"]) == ("127.0.0.1", "127.0.0.1", True)
    assert kw["address"] == "local"  # never a cluster `ray start` left behind
    assert (kw["dashboard_port"], kw["_metrics_export_port"]) == (8311, 8312)
    assert os.environ[LOOPBACK_ONLY_ENV] == "0"
    assert ray_constants.ENABLE_RAY_CLUSTER is False  # ray.init now keeps 127.0.0.1
    assert "dashboard_port" not in ray_init_kwargs("127.0.0.1")


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_") and k != "FLASHPREFILL_GRPC_HOST"}
    return {**env, "PYTHONPATH": str(ROOT), **extra}


def test_cli_imports_no_ray_before_it_prepares_the_environment():
    # Ray reads RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER once, at import: the command line, its option
    # parsing and the service config must not import it before serve_forever has set it
    code = ("import sys\n"
            "import router.__main__ as m\n"
            "rc = m.main(['serve', '--option', 'prefill.chunk_tokens=256', '--metrics-port', '-1'])\n"
            "print(rc, 'ray' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=clean_env(), capture_output=True, text=True,
                         timeout=120)
    assert out.stdout.strip() == "2 False", out.stdout + out.stderr
    assert "--metrics-port" in out.stderr


def test_metrics_port_in_use_or_out_of_range_is_refused_before_ray_starts():
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ValueError, match="--metrics-port"):
            check_port_free(port, "--metrics-port")
        out = subprocess.run([sys.executable, "-m", "router", "serve", "--metrics-port", str(port)], cwd=ROOT,
                             env=clean_env(), capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "--metrics-port" in out.stderr and str(port) in out.stderr, out.stderr
    with pytest.raises(ValueError, match="--metrics-port"):
        check_port_free(70000, "--metrics-port")
    check_port_free(0, "--metrics-port")  # 0: Ray picks a free one


def listening(root: psutil.Process) -> list[tuple[str, int, str]]:
    out = []
    for proc in [root, *root.children(recursive=True)]:
        try:
            name = " ".join(proc.cmdline())[:80]
            conns = proc.net_connections(kind="inet")
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        out += [(c.laddr.ip, c.laddr.port, name) for c in conns if c.status == psutil.CONN_LISTEN]
    return out


def wait_for(proc: subprocess.Popen, log: Path, marker: str, timeout_s: float = 300.0) -> str:
    deadline = time.monotonic() + timeout_s
    text = log.read_text()
    while marker not in text:
        assert proc.poll() is None, f"launcher exited {proc.returncode}:\n{text}"
        assert time.monotonic() < deadline, f"no {marker!r} in the launcher's output:\n{text}"
        time.sleep(0.5)
        text = log.read_text()
    return text


def poll_readiness(url: str, answers: list, stop: threading.Event) -> None:
    """(status, body's "status") of ``url`` until ``stop``, each change once; a request not
    answered within 5 s (held by Serve's proxy) as ("timeout", None)."""
    while not stop.is_set():
        try:
            r = httpx.get(url, timeout=5.0)
            try:
                answer = (r.status_code, r.json().get("status"))
            except ValueError:  # the proxy's own plain-text 404 before any route exists
                answer = (r.status_code, None)
        except httpx.TimeoutException:
            answer = ("timeout", None)
        except httpx.TransportError:  # the proxy not listening yet
            answer = ("refused", None)
        if not answers or answers[-1] != answer:
            answers.append(answer)
        time.sleep(0.1)


def test_local_run_listens_on_loopback_only_and_prints_its_urls(tmp_path):
    http_port, grpc_port, metrics_port = free_port(), free_port(), free_port()
    token_file = tmp_path / "ray_token"  # not ~/.ray/auth_token: the test leaves the home alone
    token_file.write_text(secrets.token_hex(16))
    env = clean_env(RAY_SERVE_LOG_TO_STDERR="0", RAY_AUTH_TOKEN_PATH=str(token_file))
    log_path = tmp_path / "serve.log"
    with log_path.open("w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "router", "serve", "--model", "builtin:tiny", "--device", "cpu",
                                 "--num-cpus", "4", "--http-port", str(http_port), "--grpc-port", str(grpc_port),
                                 "--metrics-port", str(metrics_port), "--prefill-kv-pages", "64",
                                 "--decode-kv-pages", "64"],
                                cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
    answers, started = [], threading.Event()
    poller = threading.Thread(target=poll_readiness, args=(f"http://127.0.0.1:{http_port}/health/ready", answers, started),
                              daemon=True)
    poller.start()
    try:
        text = wait_for(proc, log_path, "try:")
        started.set()
        poller.join(timeout=30)
        # from the start-up health application's first answer on, /health/ready answers (503
        # "starting", then the ingress's own answer); before it, the proxy had no such route or
        # held the request while that small application's replica started
        first = next((i for i, a in enumerate(answers) if a == (503, "starting")), None)
        assert first is not None, answers
        assert all(a in ((503, "starting"), (503, "unavailable"), (200, "ready")) for a in answers[first:]), answers
        metrics = re.search(r"metrics:\s+(http://\S+)", text)
        dashboard = re.search(r"dashboard:\s+(http://\S+)", text)
        assert metrics and dashboard, text
        assert metrics.group(1) == f"http://127.0.0.1:{metrics_port}/metrics"
        assert "Connecting to existing Serve app" not in text  # launcher noise, see router/launcher.py
        base = f"http://127.0.0.1:{http_port}"
        # readiness asks Serve's controller at most once per ingress.health_refresh_s and a probe
        # may get the answer cached a moment before the last replica ran: ok within a few refreshes
        deadline, health = time.monotonic() + 60, None
        while health != {"status": "ok"} and time.monotonic() < deadline:
            health = httpx.get(f"{base}/health", timeout=30).json()
            if health != {"status": "ok"}:
                assert health["status"] in ("unavailable", "starting"), health
                time.sleep(0.5)
        assert health == {"status": "ok"}
        r = httpx.post(f"{base}/v1/completions", timeout=120, json={
            "model": "builtin:tiny", "prompt": prompt_of(12, seed=int.from_bytes(os.urandom(2), "little")),
            "max_tokens": 2, "temperature": 0})
        assert r.status_code == 200, r.text
        # the replicas' own metrics reach the banner's URL (Ray exports them every few seconds)
        deadline, body = time.monotonic() + 120, ""
        while "ray_flashprefill_requests_total" not in body and time.monotonic() < deadline:
            body = httpx.get(metrics.group(1), timeout=30).text
            time.sleep(1.0)
        assert "ray_flashprefill_requests_total" in body and "# TYPE" in body, body[-2000:]

        socks = listening(psutil.Process(proc.pid))
        ports = {port for _, port, _ in socks}
        d_port = int(dashboard.group(1).rsplit(":", 1)[1])
        assert {http_port, grpc_port, metrics_port, d_port} <= ports, socks
        assert len(socks) >= 8  # GCS, raylet, agents, workers: not just the four above
        outside = [s for s in socks if s[0] not in LOOPBACK]
        assert not outside, outside

        # token auth is on: the dashboard refuses a request without the token, and the CLIs,
        # told to use it (RAY_AUTH_MODE, as the banner says) and given it (RAY_AUTH_TOKEN_PATH), work
        assert "export RAY_AUTH_MODE=token" in text
        assert httpx.get(f"{dashboard.group(1)}/api/serve/applications/", timeout=30).status_code in (401, 403)
        env = {**env, "RAY_AUTH_MODE": "token"}
        bin_dir = Path(sys.executable).parent
        status = subprocess.run([str(bin_dir / "serve"), "status", "-a", dashboard.group(1)],
                                capture_output=True, text=True, env=env, timeout=120)
        assert status.returncode == 0 and "flashprefill" in status.stdout, status.stdout + status.stderr
        assert "flashprefill-health" not in status.stdout  # the start-up health application is gone
        assert "PrefillServer" in status.stdout and "DecodeServer" in status.stdout
        actors = subprocess.run([str(bin_dir / "ray"), "list", "actors", "--address", dashboard.group(1)],
                                capture_output=True, text=True, env=env, timeout=120)
        assert actors.returncode == 0 and "ServeController" in actors.stdout, actors.stdout + actors.stderr
    finally:
        proc.send_signal(signal.SIGINT)  # Ctrl-C
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    text = log_path.read_text()
    assert proc.returncode == 0, text
    assert "shutting down" in text and "graceful_shutdown failed" not in text, text
