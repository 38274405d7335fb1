"""benchmarks/bench_dense_below.py: the implied dense_below rule by hand, and its CPU smoke run."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import bench_dense_below as bench  # noqa: E402


@pytest.mark.parametrize("speedups,want", [
    ({1024: 0.8, 2048: 1.05, 4096: 1.2, 8192: 1.5}, 4096),
    ({1024: 1.2, 2048: 1.3}, 1024),
    ({1024: 1.2, 2048: 1.0, 4096: 1.3}, 4096),  # pays only from where it keeps paying
    ({1024: 0.5, 8192: 1.05}, 8193),  # never: dense everywhere measured
    ({}, 0),
])
def test_implied_dense_below(speedups, want):
    rows = [{"length": n, "speedup": x} for n, x in speedups.items()]
    assert bench.implied_dense_below(rows, 1.1) == want


def test_cpu_smoke_writes_json_and_a_profile(tmp_path):
    from model_executor.sparse_profile import PROFILE_FORMAT, SparseProfile

    profile = tmp_path / "p.json"
    profile.write_text(json.dumps({"format": PROFILE_FORMAT, "model": "builtin:tiny", "num_layers": 4,
                                   "sparse": {"alpha": 0.2, "block_size": 64, "sink_tokens": 64,
                                              "window_tokens": 64, "last_dense_tiles": 1}}))
    out = tmp_path / "d.json"
    assert bench.main(["--cpu-smoke", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert [r["length"] for r in result["rows"]] == [256, 512]
    assert all(r["dense_ms"] > 0 and r["sparse_ms"] > 0 for r in result["rows"])
    assert result["dense_below"] == bench.implied_dense_below(result["rows"], 1.1)
    written = tmp_path / "w.json"
    assert bench.main(["--model", "builtin:tiny", "--device", "cpu", "--dtype", "fp32", "--reps", "1",
                       "--lengths", "384", "--profile", str(profile), "--out", str(out),
                       "--write-profile", str(written)]) == 0
    got = SparseProfile.load(written)
    assert got.dense_below == json.loads(out.read_text())["dense_below"]
    assert got.sparse["last_dense_tiles"] == 1 and "dense_below" in got.provenance
    with pytest.raises(SystemExit):
        bench.main(["--cpu-smoke", "--out", str(out), "--write-profile", str(written)])  # no profile under test


def test_results_of_an_earlier_run_write_the_profile_without_timing(tmp_path, monkeypatch):
    from model_executor.sparse_profile import PROFILE_FORMAT, SparseProfile

    profile = tmp_path / "p.json"
    profile.write_text(json.dumps({"format": PROFILE_FORMAT, "model": "builtin:tiny", "num_layers": 4,
                                   "sparse": {"alpha": 0.2, "last_dense_tiles": 3}}))
    measured = tmp_path / "gpu.json"
    rows = [{"length": 1024, "speedup": 0.99}, {"length": 2048, "speedup": 1.3}, {"length": 4096, "speedup": 2.0}]
    measured.write_text(json.dumps({"model": "builtin:tiny", "rows": rows, "min_speedup": 1.1, "command": "c",
                                    "date": "d", "env": {"device": "H100"}}))
    monkeypatch.setattr(bench, "run", lambda args: pytest.fail("--results must not time anything"))
    written = tmp_path / "w.json"
    assert bench.main(["--model", "builtin:tiny", "--results", str(measured), "--profile", str(profile),
                       "--write-profile", str(written)]) == 0
    got = SparseProfile.load(written)
    assert got.dense_below == 2048 and got.sparse["last_dense_tiles"] == 3
    assert got.provenance["dense_below"]["env"] == {"device": "H100"}
    assert got.provenance["dense_below"]["speedups"] == {"1024": 0.99, "2048": 1.3, "4096": 2.0} or \
        got.provenance["dense_below"]["speedups"] == {1024: 0.99, 2048: 1.3, 4096: 2.0}
    # a stricter bar given here wins over the run's
    assert bench.main(["--model", "builtin:tiny", "--results", str(measured), "--profile", str(profile),
                       "--min-speedup", "1.5", "--write-profile", str(written)]) == 0
    assert SparseProfile.load(written).dense_below == 4096
    # another model's results, or a file that is not one, are refused naming --results
    for bad in (json.dumps({"model": "builtin:other", "rows": rows}), "{}", "not json"):
        measured.write_text(bad)
        with pytest.raises(SystemExit):
            bench.main(["--model", "builtin:tiny", "--results", str(measured), "--profile", str(profile)])
