"""benchmarks/lmeval_scores.py: the sparse-vs-dense comparison, the table, its arguments, and a
CPU smoke run (the tiny model, two items, dense only) through a real service and lm-eval."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parent.parent / "benchmarks" / "lmeval_scores.py"
_spec = importlib.util.spec_from_file_location("lmeval_scores", _PATH)
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


def _sample(doc: int, loglik: float, greedy: bool) -> dict:
    return {"doc_id": doc, "filtered_resps": [[str(loglik), str(greedy)]]}  # as lm-eval writes them


def test_compare_pairs_items_by_doc_id():
    sparse = [_sample(0, -1.0, True), _sample(1, -2.5, False), _sample(2, -0.25, True)]
    dense = [_sample(2, -0.5, True), _sample(0, -1.0, True), _sample(1, -2.0, True)]
    c = bench.compare(sparse, dense)
    assert c == {"items": 3, "mean_abs_loglik_diff": pytest.approx(0.25), "max_abs_loglik_diff": 0.5,
                 "greedy_agreement": pytest.approx(2 / 3)}


def test_table_has_one_row_per_mode():
    runs = {m: {"results": {"acc,none": a, "acc_stderr,none": 0.1, "perplexity,none": 12.5}, "wall_s": 3.0,
                "samples": [{}] * 4} for m, a in (("sparse", 0.25), ("dense", 0.5))}
    rows = bench.table(runs).splitlines()
    assert len(rows) == 4 and rows[2].startswith("| sparse | 4 | 0.2500 |") and rows[3].startswith("| dense | 4 | 0.5000 |")


@pytest.mark.parametrize("argv, name", [(["--modes", "fast"], "--modes"), (["--modes", ""], "--modes"),
                                        (["--limit", "0"], "--limit")])
def test_bad_arguments_exit_2_naming_them(argv, name, capsys):
    with pytest.raises(SystemExit) as info:
        bench.main(argv)
    assert info.value.code == 2 and name in capsys.readouterr().err


@pytest.mark.slow
def test_smoke_run_on_the_tiny_model(tmp_path):
    out = tmp_path / "scores.json"  # absolute: benchmarks/results/ is left alone
    assert bench.main(["--task", "fp_lastword_tiny", "--limit", "2", "--modes", "dense", "--model", "builtin:tiny",
                       "--out", str(out)]) == 0
    payload = json.loads(out.read_text())
    dense = payload["modes"]["dense"]
    assert payload["task"] == "fp_lastword_tiny" and dense["items"] == 2
    assert 0.0 <= dense["results"]["acc,none"] <= 1.0 and dense["results"]["perplexity,none"] > 1.0
    assert "--alpha 0.0" in dense["command"] and "sparse_vs_dense" not in payload


def _lm_eval_output(folder: Path, task: str, acc: float, samples: list[dict]) -> Path:
    """A folder laid out as lm-eval's --output_path writes it (one model subfolder)."""
    sub = folder / "builtin__tiny"
    sub.mkdir(parents=True)
    results = {"results": {task: {"acc,none": acc, "acc_stderr,none": 0.1, "perplexity,none": 9.0}},
               "config": {"model_args": "model=builtin:tiny"}}
    (sub / "results_2026.json").write_text(json.dumps(results))
    (sub / f"samples_{task}_2026.jsonl").write_text("".join(json.dumps(s) + "\n" for s in samples))
    return folder


def test_combine_builds_the_report_from_earlier_runs(tmp_path, capsys):
    sparse = _lm_eval_output(tmp_path / "s", "t", 0.5, [_sample(0, -1.0, True), _sample(1, -3.0, False)])
    dense = _lm_eval_output(tmp_path / "d", "t", 1.0, [_sample(1, -2.0, True), _sample(0, -1.5, True)])
    out = tmp_path / "report.json"
    assert bench.main(["--task", "t", "--combine", f"sparse={sparse}", f"dense={dense}", "--out", str(out)]) == 0
    payload = json.loads(out.read_text())
    assert payload["modes"]["sparse"]["results"]["acc,none"] == 0.5 and payload["modes"]["dense"]["items"] == 2
    assert payload["sparse_vs_dense"] == {"items": 2, "mean_abs_loglik_diff": 0.75, "max_abs_loglik_diff": 1.0,
                                          "greedy_agreement": 0.5}
    assert "| dense | 2 | 1.0000 |" in capsys.readouterr().out
    for bad in (["sparse"], [f"fast={sparse}"], [f"dense={tmp_path / 'missing'}"]):
        with pytest.raises(SystemExit) as info:
            bench.main(["--task", "t", "--combine", *bad, "--out", str(out)])
        assert info.value.code == 2 and "--combine" in capsys.readouterr().err
