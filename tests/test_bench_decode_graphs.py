"""benchmarks/bench_decode_graphs.py: the CPU smoke run (the padded static-buffer step against
eager, no graphs), case parsing and argument errors."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_decode_graphs as bench  # noqa: E402


def test_cpu_smoke_run(tmp_path):
    out = tmp_path / "dg.json"
    bench.main(["--cpu-smoke", "--steps", "2", "--repeats", "1", "--cases", "1:40,3:70", "--out", str(out)])
    result = json.loads(out.read_text())
    assert [(r["batch"], r["length"]) for r in result["rows"]] == [(1, 40), (3, 70)]
    for r in result["rows"]:
        assert r["ok"] and r["ran_in_graph"] and r["tokens_agree"] and r["max_rel_diff"] <= bench.CHECK_RTOL
        assert r["eager_ms"] > 0 and r["graph_ms"] > 0
    assert result["capture"] is False and result["graph_batch_sizes"] == [1, 3]
    assert result["graph_max_seqlen"] >= 70 + 2 + 2


def test_parse_cases():
    assert bench.parse_cases("1:4096,64:128") == ((1, 4096), (64, 128))
    for bad in ("1", "a:4", "0:10", "1:1", "1:2:3"):
        with pytest.raises(ValueError, match="--cases"):
            bench.parse_cases(bad)


@pytest.mark.parametrize("argv,match", [
    (["--steps", "0"], "--steps"),
    (["--cases", "2"], "--cases"),
])
def test_bad_arguments(argv, match, capsys):
    with pytest.raises(SystemExit):
        bench.main(["--cpu-smoke", *argv])
    assert match in capsys.readouterr().err
