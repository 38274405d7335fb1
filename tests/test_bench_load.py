"""benchmarks/load_test.py's ``--start`` service and autoscale_scenario.py's entry point, on the CPU.

load_test's requests and checks run in tests/test_reliability.py (``run_load`` against the shared
service) and tests/test_open_loop.py (its HTTP client); here the service ``--start`` deploys.
autoscale_scenario's scenario runs in tests/test_autoscaling.py; here its ``main``."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT)]

from benchmarks import autoscale_scenario, load_test  # noqa: E402


def test_load_test_serves_the_oracles_model():
    """The oracle decodes with the tiny byte model; ``--start`` must serve that model, not the
    service's default (a real checkpoint), or every response reads as garbled."""
    cfg = load_test.local_config()
    assert cfg.model.model == "builtin:tiny" == load_test.LoadSpec().model
    assert cfg.sparse.alpha == 0.0  # dense, as the oracle


def test_autoscale_main_runs_the_short_scenario_to_out(tmp_path, monkeypatch, capsys):
    seen = {}

    def fake_run(cfg, *, out):
        seen["cfg"], seen["out"] = cfg, out
        res = autoscale_scenario.Result(config={}, min_replicas={"prefill": 1, "decode": 1},
                                        max_replicas={"prefill": 2, "decode": 2})
        res.phases = [{"name": "idle", "start": 0, "end": 1}]
        res.samples = [{"t": 0, "phase": "idle", "replicas": {"prefill": 1, "decode": 1},
                        "nodes": dict.fromkeys(autoscale_scenario.NODE_TYPES, 1)}]
        res.requests = {"idle": {"sent": 3, "completed": 3 - lost, "lost": lost, "lost_reasons": {}}}
        return res

    monkeypatch.setattr(autoscale_scenario, "run", fake_run)
    lost = 0
    assert autoscale_scenario.main(["--short", "--out", str(tmp_path / "as")]) == 0
    assert seen == {"cfg": autoscale_scenario.SHORT, "out": tmp_path / "as"}
    assert "idle" in capsys.readouterr().out
    lost = 1
    assert autoscale_scenario.main(["--short", "--out", str(tmp_path / "as")]) == 1  # a lost request fails
