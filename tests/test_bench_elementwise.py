"""benchmarks/bench_elementwise.py: the CPU smoke run (the real kernels under the interpreter,
checked against the references), the crossover rule, argument errors."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_elementwise as bench  # noqa: E402


def test_cpu_smoke_run(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    out = tmp_path / "ew.json"
    bench.main(["--cpu-smoke", "--calls", "1", "--repeats", "1", "--tokens", "3,5", "--out", str(out)])
    result = json.loads(out.read_text())
    assert [(r["op"], r["tokens"]) for r in result["rows"]] == [
        (op, t) for t in (3, 5) for op in ("rms_norm", "silu_mul", "rotary")]
    assert all(r["ok"] and r["eager_us"] > 0 and r["fused_us"] > 0 for r in result["rows"])
    assert set(result["crossover_tokens"]) == {"rms_norm", "silu_mul", "rotary"}


def test_crossover_is_where_fused_stays_ahead():
    def row(op, t, s):
        return {"op": op, "tokens": t, "speedup": s}
    rows = [row("a", 1, 0.5), row("a", 64, 1.2), row("a", 256, 0.9), row("a", 1024, 1.5), row("a", 4096, 3.0),
            row("b", 1, 1.1), row("b", 8, 1.0), row("c", 1, 0.2), row("c", 8, 0.8)]
    assert bench.crossover(rows) == {"a": 1024, "b": 1, "c": None}


@pytest.mark.parametrize("argv,match", [
    (["--calls", "0"], "--calls"),
    (["--tokens", "4,x"], "--tokens"),
    (["--tokens", "0"], "--tokens"),
])
def test_bad_arguments(argv, match, capsys):
    with pytest.raises(SystemExit):
        bench.main(argv)
    assert match in capsys.readouterr().err


def test_cpu_smoke_needs_the_interpreter(monkeypatch, capsys):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(SystemExit):
        bench.main(["--cpu-smoke"])
    assert "TRITON_INTERPRET=1" in capsys.readouterr().err
