"""CPU smoke runs of benchmarks/bench_retrieval.py and bench_structured_density.py (the hand-built
models of evals/): tiny lengths, the reference backend, JSON to a temporary path."""

from __future__ import annotations

import json

from benchmarks import bench_retrieval, bench_structured_density


def test_retrieval_cpu_smoke(tmp_path, capsys):
    out = tmp_path / "retrieval.json"
    bench_retrieval.main(["--lengths", "512", "--trials", "2", "--repeats", "1", "--backend", "reference",
                          "--out", str(out)])
    data = json.loads(out.read_text())
    assert data["backend"] == "reference" and data["device"] == "cpu"
    rows = data["rows"]
    assert sorted(r["variant"] for r in rows) == ["dense", "sparse", "sparse_nocorr"]
    for r in rows:
        assert (r["length"], r["needle_repeats"], r["trials"]) == (512, 1, 2)
        assert 0.0 <= r["accuracy"] <= 1.0 and 0.0 <= r["needle_selected"] <= 1.0
    dense = next(r for r in rows if r["variant"] == "dense")
    assert dense["density_layer2"] == 1.0  # alpha 0: every visible block
    assert str(out) in capsys.readouterr().out


def test_structured_density_cpu_smoke(tmp_path):
    out = tmp_path / "structured.json"
    bench_structured_density.main(["--tiny", "--layers", "1", "--lengths", "1024", "--backend", "reference",
                                   "--out", str(out)])
    data = json.loads(out.read_text())
    assert data["shape"] == "tiny" and data["spec"]["hidden_size"] == 512 and data["layers_measured"] == [0]
    (row,) = data["rows"]
    assert row["length"] == 1024 and row["paper"] is None and row["ratio_to_paper"] is None
    assert 0.0 < row["density"] <= 1.0 and len(row["per_kv_head"][0]) == data["spec"]["num_key_value_heads"]
    assert len(row["per_layer"]) == 1
