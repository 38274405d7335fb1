"""CPU smoke runs of the host-side benchmarks benchmarks/bench_grammar.py and bench_scheduler.py
(small sizes, JSON to a temporary path: an absolute ``--out`` is written there)."""

from __future__ import annotations

import json

from benchmarks import bench_grammar, bench_scheduler


def test_grammar_cpu_smoke(tmp_path, capsys):
    out = tmp_path / "grammar.json"
    bench_grammar.main(["--hf", "--bpe-vocab", "0", "--max-tokens", "8", "--out", str(out)])
    data = json.loads(out.read_text())
    assert data["config"]["max_tokens"] == 8 and data["config"]["hf"] == []
    res = data["results"]
    assert {r["spec"] for r in res} == set(bench_grammar.SPECS)
    for r in res:
        assert r["tokenizer"].startswith("byte") and r["vocab"] == 264
        assert 1 <= r["tokens"] <= 8 and r["compile_ms"] > 0
    assert "wrote" in capsys.readouterr().out


def test_scheduler_cpu_smoke(tmp_path):
    out = tmp_path / "scheduler.json"
    rc = bench_scheduler.main(["--long-tokens", "128", "--short-tokens", "16", "--longs", "1", "--shorts", "2",
                               "--chunk", "64", "--defaults-long-tokens", "200", "--defaults-longs", "1",
                               "--out", str(out)])
    data = json.loads(out.read_text())
    cells = data["policies"]["cells"]
    assert [(c["discipline"], c["policy"]) for c in cells] == list(bench_scheduler.CELLS)
    # the same greedy first tokens whatever the order of the forwards: the script's exit code says so
    assert rc == 0 and all(c["first_tokens_equal_first_cell"] for c in cells)
    assert all(len(c["first_tokens"]) == 3 for c in cells)
    # the service's defaults against the old ones (whole prompts, fcfs)
    from serving.config import ServiceConfig

    p = ServiceConfig().prefill
    defaults = data["defaults"]["cells"]
    assert [(c["policy"], c["chunk_tokens"]) for c in defaults] == [
        ("fcfs", None), ("fcfs", p.chunk_size), (p.schedule, p.chunk_size), (p.schedule, 2 * p.chunk_size)]
    assert all(len(c["first_tokens"]) == 3 and c["short_forwards_waited_max"] >= 0 for c in defaults)
