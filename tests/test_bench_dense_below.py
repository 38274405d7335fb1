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
