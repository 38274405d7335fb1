"""A local run (``python -m router serve``) listens on loopback only, every process Ray started
included (GCS, raylet, workers, dashboard, agents, metrics export); it prints the metrics and
dashboard URLs, and both answer (``serve status`` through the dashboard)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

psutil = pytest.importorskip("psutil")
httpx = pytest.importorskip("httpx")
pytest.importorskip("ray.serve")

from router.launcher import LOOPBACK, ray_init_kwargs  # noqa: E402
from tests.service_helpers import free_port  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def test_init_kwargs_keep_ray_on_loopback(monkeypatch):
    monkeypatch.delenv("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", raising=False)
    kw = ray_init_kwargs("127.0.0.1", dashboard_port=8311, metrics_port=8312)
    assert (kw["dashboard_host"], kw["_node_ip_address"], kw["include_dashboard"]) == ("127.0.0.1", "127.0.0.1", True)
    assert kw["address"] == "local"  # never a cluster `ray start` left behind
    assert (kw["dashboard_port"], kw["_metrics_export_port"]) == (8311, 8312)
    assert os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] == "0"
    assert "dashboard_port" not in ray_init_kwargs("127.0.0.1")


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


def test_local_run_listens_on_loopback_only_and_prints_its_urls(tmp_path):
    http_port, grpc_port = free_port(), free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "RAY_SERVE_LOG_TO_STDERR": "0", "RAY_AUTH_MODE": "disabled"}
    env.pop("RAY_ADDRESS", None)
    log = (tmp_path / "serve.log").open("w+")
    proc = subprocess.Popen([sys.executable, "-m", "router", "serve", "--device", "cpu", "--num-cpus", "4",
                             "--http-port", str(http_port), "--grpc-port", str(grpc_port),
                             "--prefill-kv-pages", "64", "--decode-kv-pages", "64"],
                            cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 300
        text = ""
        while "try:" not in text:
            assert proc.poll() is None, f"launcher exited {proc.returncode}:\n{text}"
            assert time.monotonic() < deadline, f"launcher not up:\n{text}"
            time.sleep(1.0)
            text = Path(log.name).read_text()
        metrics = re.search(r"metrics:\s+(http://\S+)", text)
        dashboard = re.search(r"dashboard:\s+(http://\S+)", text)
        assert metrics and dashboard, text
        assert httpx.get(f"http://127.0.0.1:{http_port}/health", timeout=30).json() == {"status": "ok"}
        body = httpx.get(metrics.group(1), timeout=30).text
        assert "ray_" in body  # Prometheus text from Ray's metrics agent

        socks = listening(psutil.Process(proc.pid))
        ports = {port for _, port, _ in socks}
        m_port, d_port = int(metrics.group(1).rsplit(":", 1)[1].split("/")[0]), int(dashboard.group(1).rsplit(":", 1)[1])
        assert {http_port, grpc_port, m_port, d_port} <= ports, socks
        assert len(socks) >= 8  # GCS, raylet, agents, workers: not just the four above
        outside = [s for s in socks if s[0] not in LOOPBACK]
        assert not outside, outside

        bin_dir = Path(sys.executable).parent
        status = subprocess.run([str(bin_dir / "serve"), "status", "-a", dashboard.group(1)],
                                capture_output=True, text=True, env=env, timeout=120)
        assert status.returncode == 0 and "flashprefill" in status.stdout, status.stdout + status.stderr
        assert "PrefillServer" in status.stdout and "DecodeServer" in status.stdout
        actors = subprocess.run([str(bin_dir / "ray"), "list", "actors", "--address", dashboard.group(1)],
                                capture_output=True, text=True, env=env, timeout=120)
        assert actors.returncode == 0 and "ServeController" in actors.stdout, actors.stdout + actors.stderr
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
