"""benchmarks/startup_health.py's classification, summary and table, on answers written out by
hand (the measurement itself starts the whole service: run the script)."""

from __future__ import annotations

import importlib.util
import random
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("startup_health", ROOT / "benchmarks" / "startup_health.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_each_answer_falls_in_its_phase(bench):
    assert bench.phase_of(None, "refused") == "refused"
    assert bench.phase_of(None, "held") == "held"
    assert bench.phase_of(404, None) == "no route"
    assert bench.phase_of(503, {"status": "starting", "reason": "x"}) == "starting"
    assert bench.phase_of(503, {"status": "unavailable", "replicas": {}}) == "unavailable"
    assert bench.phase_of(200, {"status": "ready", "replicas": {}}) == "ready"
    assert bench.phase_of(404, {"error": {"code": "not_found"}}) == "other"  # an application's own 404
    assert bench.phase_of(500, None) == "other"


def test_summary_rows_and_table(bench, capsys):
    rng = random.Random(0)
    held = [round(rng.uniform(0.5, 4.0), 3) for _ in range(2)]
    samples = [(0.1, "refused", 0.001), (1.0, "no route", 0.01), (2.0, "held", held[0]), (3.0, "held", held[1]),
               (5.0, "starting", 0.6), (6.0, "starting", 0.7), (7.0, "starting", 0.5), (9.0, "ready", 0.2)]
    rows = bench.summarize(samples)
    assert [r["phase"] for r in rows] == ["refused", "no route", "held", "starting", "ready"]
    starting = rows[3]
    assert (starting["answers"], starting["first_s"], starting["last_s"]) == (3, 5.0, 7.0)
    assert (starting["p50_latency_s"], starting["max_latency_s"]) == (0.6, 0.7)
    assert rows[2]["max_latency_s"] == max(held)
    assert (rows[2]["first_latency_s"], rows[2]["max_latency_after_first_s"]) == (held[0], held[1])
    assert (starting["first_latency_s"], starting["max_latency_after_first_s"]) == (0.6, 0.7)
    assert rows[0]["max_latency_after_first_s"] is None  # one answer: nothing after it
    text = bench.table(rows)
    assert text.splitlines()[0].split()[:2] == ["phase", "answers"] and len(text.splitlines()) == 2 + len(rows)
    assert "starting" in text and "0.700" in text
