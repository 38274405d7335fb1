"""The local launcher's Ray start-up: the default service must fit on a 2-core machine."""

import pytest

ray = pytest.importorskip("ray")

from router import launcher  # noqa: E402
from router.app import build_application  # noqa: E402,F401  (the app must import)


def test_default_local_ray_fits_one_prefill_one_decode_and_ingress(monkeypatch):
    seen = {}
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kw: seen.update(kw))
    monkeypatch.setattr(launcher.os, "cpu_count", lambda: 2)
    launcher.start_local_ray(launcher.LocalServeOptions())
    # prefill (1 CPU) + decode (1 CPU) + ingress (0.5 CPU) replicas by default
    assert seen["num_cpus"] >= 2.5
    assert seen["_node_ip_address"] == "127.0.0.1"


def test_explicit_num_cpus_is_kept(monkeypatch):
    seen = {}
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kw: seen.update(kw))
    launcher.start_local_ray(launcher.LocalServeOptions(num_cpus=3))
    assert seen["num_cpus"] == 3
