"""benchmarks/bench_service.py: its options, skip paths, table/targets/plots, and the CPU
smoke mode end to end (a real local Ray + Serve with the tiny structured model)."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import bench_service as bench

ROOT = Path(__file__).resolve().parents[1]
BASE = "http://127.0.0.1:1"


# ----------------------------------------------------------------------------- bench_service options
def test_bench_config_and_service_options():
    cfg = bench.BenchConfig()
    assert cfg.run_configs == ("dense", "sparse_bf16", "sparse_bf16_chunk8k", "sparse_bf16_chunk16k")
    assert dataclasses.replace(cfg, fp8=True).run_configs[2] == "sparse_fp8"
    assert (cfg.requests, cfg.rates, cfg.max_tokens) == (100, (1.0, 4.0, 16.0), 64)
    dense, chunk8 = bench.service_options(cfg, "dense"), bench.service_options(cfg, "sparse_bf16_chunk8k")
    assert dense["alpha"] == 0.0 and chunk8["alpha"] == 0.1 and chunk8["prefill_chunk_tokens"] == 8192
    assert dense["max_model_len"] == 131072 + 64 and dense["max_batch_tokens"] == 131072
    assert dense["model"] == "builtin:structured-8b" and dense["device"] == "cuda"
    # one GPU: the pools are the memory plan's ("auto", left unset); two: fixed
    assert "prefill_kv_pages" not in dense and "decode_kv_pages" not in dense
    two = dataclasses.replace(cfg, gpus=2, prefill_kv_pages=3000)
    assert (bench.service_options(two, "dense")["prefill_kv_pages"], bench.service_options(two, "dense")["decode_kv_pages"]) \
        == (3000, bench.POOL_PAGES[2][1])
    assert bench.replica_options(cfg)["ray_actor_options"]["num_gpus"] == 0.5
    assert bench.replica_options(two)["ray_actor_options"]["num_gpus"] == 1
    for name in ("dense", "sparse_bf16", "sparse_bf16_chunk8k", "sparse_bf16_chunk16k"):
        service, why = bench.resolve_service_config(bench.service_options(cfg, name))
        assert why is None and service.model.max_model_len == 131072 + 64
        assert service.kv.prefill_pages == "auto" and service.kv.decode_pages == "auto"
    for name in ("dense", "sparse_bf16"):  # two GPUs: the longest prompt fits the fixed prefill pool
        service, why = bench.resolve_service_config(bench.service_options(dataclasses.replace(cfg, gpus=2), name))
        assert why is None and 131072 // service.kv.page_size <= service.kv.prefill_pages
    smoke = bench.BenchConfig(**bench.SMOKE)
    assert bench.service_options(smoke, "sparse_bf16_chunk8k")["prefill_chunk_tokens"] == 8192 // bench.SMOKE_CHUNK_DIVISOR
    assert bench.warmup_lengths(smoke, bench.service_options(smoke, "sparse_bf16_chunk8k")) == [256, 256]
    assert bench.warmup_lengths(cfg, dense) == [4096]
    service, why = bench.resolve_service_config({"bogus_option": 1})
    assert service is None and "bogus_option" in why
    with pytest.raises(ValueError, match="name"):
        bench.service_options(cfg, "sparse_int4")


@pytest.mark.parametrize("changes, match", [
    ({"configs": ("dense", "fast")}, "configs"), ({"configs": ("dense", "dense")}, "configs"), ({"configs": ()}, "configs"),
    ({"gpus": 3}, "gpus"), ({"rates": (1.0, 0.0)}, "rates"), ({"rates": ()}, "rates"), ({"lengths": (1,)}, "lengths"),
    ({"max_tokens": 1}, "max_tokens"), ({"time_budget_s": 0}, "time_budget_s"), ({"requests": 0}, "requests"),
    ({"cell_seconds": 0}, "cell_seconds"),
])
def test_bench_config_rejects(changes, match):
    with pytest.raises(ValueError, match=match):
        bench.BenchConfig(**changes)


def test_bench_arguments():
    cfg, _ = bench.parse_args(["--gpus", "2", "--configs", "dense,sparse_bf16", "--rates", "1,4", "--requests", "12",
                               "--cell-seconds", "15", "--drain-seconds", "10", "--lengths", "4096,8192", "--fp8"])
    assert (cfg.gpus, cfg.configs, cfg.rates, cfg.requests, cfg.cell_seconds, cfg.drain_seconds, cfg.lengths) == \
        (2, ("dense", "sparse_bf16"), (1.0, 4.0), 12, 15.0, 10.0, (4096, 8192))
    assert cfg.run_configs == ("dense", "sparse_bf16", "sparse_fp8")
    assert cfg.fused_ops is True and bench.service_options(cfg, "dense")["fused_ops"] is True
    named, _ = bench.parse_args(["--configs", "sparse_fp8"])  # naming sparse_fp8 runs it, no --fp8 needed
    assert named.fp8 and named.run_configs == ("sparse_fp8",)
    assert not bench.parse_args(["--configs", "sparse_bf16"])[0].fp8
    off, _ = bench.parse_args(["--fused-ops", "off", "--configs", "sparse_bf16_sjf"])
    assert bench.service_options(off, "sparse_bf16_sjf")["fused_ops"] is False
    assert bench.resolve_service_config(bench.service_options(off, "sparse_bf16_sjf"))[0].prefill.schedule == "shortest_first"
    assert "--fused-ops off" in " ".join(bench.child_argv(off, bench.Group(0, ("sparse_bf16",)), out=Path("x"),
                                                          http_port=1, grpc_port=2, time_budget_s=None))
    assert cfg.cuda_graphs is True and bench.service_options(cfg, "dense")["cuda_graphs"] is True
    eager, _ = bench.parse_args(["--cuda-graphs", "off"])
    assert bench.service_options(eager, "sparse_bf16")["cuda_graphs"] is False
    argv = " ".join(bench.child_argv(eager, bench.Group(0, ("sparse_bf16",)), out=Path("x"), http_port=1,
                                     grpc_port=2, time_budget_s=None))
    assert "--cuda-graphs off" in argv and "--fused-ops on" in argv
    smoke, _ = bench.parse_args(["--cpu-smoke"])
    assert smoke.smoke and smoke.model == "builtin:structured-tiny" and smoke.http_port != 8000
    for bad in (["--configs", "nope"], ["--gpus", "4"], ["--requests", "0"], ["--fused-ops", "maybe"],
                ["--cuda-graphs", "yes"]):
        with pytest.raises(SystemExit):
            bench.parse_args(bad)


def test_fp8_weight_cell_is_the_sjf_cell_with_fp8_weights():
    """sparse_fp8w_sjf (issue #39's service cell) differs from sparse_bf16_sjf only in the weights."""
    cfg, _ = bench.parse_args(["--configs", "sparse_fp8w_sjf,sparse_bf16_sjf,dense_sjf", "--rates", "1,2"])
    assert cfg.run_configs == ("sparse_bf16_sjf", "dense_sjf", "sparse_fp8w_sjf") and not cfg.fp8
    fp8w, why = bench.resolve_service_config(bench.service_options(cfg, "sparse_fp8w_sjf"))
    bf16, _ = bench.resolve_service_config(bench.service_options(cfg, "sparse_bf16_sjf"))
    assert why is None and fp8w.model.weight_dtype == "fp8_channel" and bf16.model.weight_dtype == "auto"
    assert fp8w.prefill.schedule == bf16.prefill.schedule == "shortest_first"
    a, b = fp8w.model_dump(), bf16.model_dump()
    a["model"].pop("weight_dtype"), b["model"].pop("weight_dtype")
    assert a == b


def test_configurations_that_cannot_run_are_recorded_without_a_deploy():
    """No Ray here: each of these returns before anything is deployed."""
    cfg = bench.BenchConfig(configs=("sparse_bf16",))
    conf = bench.run_configuration("sparse_fp8", cfg, None, bench.Budget(None), None, BASE)
    assert conf["status"] == "skipped" and "--fp8" in conf["reason"]
    tight = dataclasses.replace(cfg, time_budget_s=10.0)
    conf = bench.run_configuration("sparse_bf16", tight, None, bench.Budget(10.0), None, BASE)
    assert conf["status"] == "skipped" and "time budget" in conf["reason"]


def _service_config_knows(name: str) -> bool:
    from serving.config import OPTION_ALIASES

    return name in OPTION_ALIASES


@pytest.mark.skipif(_service_config_knows("kv_cache_dtype"), reason="this checkout's ServiceConfig knows kv_cache_dtype")
def test_fp8_is_skipped_when_service_config_does_not_know_the_option():
    cfg = bench.BenchConfig(configs=("sparse_bf16",), fp8=True)
    conf = bench.run_configuration("sparse_fp8", cfg, None, bench.Budget(None), None, BASE)
    assert conf["status"] == "skipped" and "kv_cache_dtype" in conf["reason"]
    assert conf["service_options"] == {"alpha": 0.1, "kv_cache_dtype": "fp8_e4m3"}


def _summary(rate, ttft, tok_s, lost=0):
    return {"rate": rate, "sent": 10, "completed": 10 - lost, "lost": lost, "not_sent": 0, "ttft_p50_s": ttft,
            "ttft_p99_s": 2 * ttft, "ttft_p50_sent_s": 1.5 * ttft, "ttft_p99_sent_s": 3 * ttft,
            "ttft_sent_lower_bound": {"p50": False, "p99": lost > 0}, "tpot_p50_s": 0.02, "tpot_p99_s": 0.05, "output_tokens_per_s": tok_s,
            "requests_per_s": tok_s / 64, "server_median_s": {"ttft_s": ttft, "queue_s": ttft / 2, "prefill_s": ttft / 4,
                                                              "export_s": 0.1, "other_s": 0.01, "transfer_s": 0.2,
                                                              "first_decode_s": 0.03}}


FAKE = [
    {"name": "dense", "status": "ok", "cells": [{"rate": 1.0, "summary": _summary(1.0, 9.0, 100.0)},
                                               {"rate": 16.0, "summary": _summary(16.0, 30.0, 150.0, lost=2)}]},
    {"name": "sparse_bf16", "status": "ok", "cells": [{"rate": 1.0, "summary": _summary(1.0, 2.0, 120.0)},
                                                     {"rate": 16.0, "summary": _summary(16.0, 8.0, 330.0)}]},
    {"name": "sparse_fp8", "status": "skipped", "reason": "not requested (--fp8)", "cells": []},
    {"name": "sparse_bf16_chunk8k", "status": "ok", "cells": [{"rate": 1.0, "status": "skipped: time budget"}]},
]


def test_targets_table_and_plots(tmp_path):
    t = bench.targets(FAKE)
    assert t["ttft_p50_ratio_at_lowest_rate"] == {"rate": 1.0, "dense_over_sparse": pytest.approx(4.5), "target": 3.0}
    assert t["throughput_ratio_at_highest_rate"] == {"rate": 16.0, "sparse_over_dense": pytest.approx(2.2), "target": 1.8}
    assert t["ttft_p50_sent_ratio_at_lowest_rate"] == {"rate": 1.0, "dense_over_sparse": pytest.approx(4.5), "target": 3.0,
                                                       "dense_is_lower_bound": False, "sparse_is_lower_bound": False}
    assert (t["lost_total"], t["sent_total"], t["zero_lost"]) == (2, 40, False)
    rows = bench.table_rows(FAKE)
    assert len(rows) == 6 and rows[0]["tpot_p50_ms"] == 20.0 and rows[0]["prefill_s"] == 9.0 / 4
    assert (rows[0]["ttft_p50_sent"], rows[1]["ttft_p99_sent"]) == ("13.50", ">=90.00")
    assert rows[4] == {"config": "sparse_fp8", "note": "skipped: not requested (--fp8)"}
    text = bench.format_table(rows)
    assert "sparse_bf16" in text and "skipped: time budget" in text and "not requested" in text
    assert bench.targets([]) == {"lost_total": 0, "sent_total": 0, "zero_lost": None}
    assert "ttft_p50_ratio_shortest_first" not in t
    sjf = FAKE + [{"name": "dense_sjf", "status": "ok", "cells": [{"rate": 4.0, "summary": _summary(4.0, 6.0, 90.0)},
                                                                 {"rate": 1.0, "summary": _summary(1.0, 5.0, 90.0)}]},
                  {"name": "sparse_bf16_sjf", "status": "ok", "cells": [{"rate": 16.0, "summary": _summary(16.0, 1.0, 90.0)},
                                                                       {"rate": 4.0, "summary": _summary(4.0, 0.5, 90.0)}]}]
    # the lowest rate both shortest-first configurations ran: 4/s (dense_sjf's 1/s has no partner)
    assert bench.targets(sjf)["ttft_p50_ratio_shortest_first"] == {"rate": 4.0, "dense_over_sparse": pytest.approx(12.0),
                                                                   "target": 3.0}
    pytest.importorskip("matplotlib")
    paths = bench.plot(FAKE, tmp_path / "service.json")
    assert [Path(p).name for p in paths] == ["service_ttft_throughput.png", "service_breakdown.png"]
    assert all(Path(p).stat().st_size > 1000 for p in paths)


def _rec(n, prefill_s, status="ok"):
    return {"prompt_len": n, "status": status, "timing": None if status != "ok" else {"prefill_s": prefill_s}}


def test_prefill_by_length_and_its_ratio():
    confs = [
        {"name": "dense", "status": "ok", "cells": [
            {"rate": 1.0, "summary": _summary(1.0, 9.0, 100.0),
             "records": [_rec(4096, 0.5), _rec(4096, 0.3), _rec(131072, 12.0), _rec(131072, 0.1, "lost")]},
            {"rate": 16.0, "summary": _summary(16.0, 30.0, 150.0), "records": [_rec(4096, 0.2), _rec(131072, 13.0)]}]},
        {"name": "sparse_bf16", "status": "ok", "cells": [
            {"rate": 1.0, "summary": _summary(1.0, 2.0, 120.0),
             "records": [_rec(4096, 0.25), _rec(131072, 5.0), _rec(131072, 6.0)]}]},
        {"name": "sparse_fp8", "status": "skipped", "cells": []},
    ]
    by = bench.prefill_by_length(confs)
    assert set(by) == {"dense", "sparse_bf16"}  # a configuration without records is left out
    assert by["dense"]["lengths"] == {4096: {"n": 3, "min_s": 0.2, "median_s": 0.3},
                                      131072: {"n": 2, "min_s": 12.0, "median_s": 13.0}}  # the lost one is not counted
    assert by["dense"]["mix_mean_min_s"] == pytest.approx((3 * 0.2 + 2 * 12.0) / 5)
    assert by["sparse_bf16"]["mix_mean_min_s"] == pytest.approx((0.25 + 2 * 5.0) / 3)
    t = bench.targets(confs)
    assert t["prefill_alone_ratio_over_mix"] == pytest.approx(((0.6 + 24.0) / 5) / (10.25 / 3))
    text = bench.format_prefill_by_length(by)
    assert "0.20 / 0.30 | 0.25 / 0.25" in text and "mix mean of the minima: 4.92 | 3.42" in text
    # read back from a results file the lengths are string keys: still in numeric order
    again = bench.format_prefill_by_length(json.loads(json.dumps(by)))
    assert [line.split()[0] for line in again.splitlines()[1:3]] == ["4096", "131072"]
    assert bench.prefill_by_length(FAKE) == {} and "prefill_alone_ratio_over_mix" not in bench.targets(FAKE)
    assert bench.format_prefill_by_length({}) == ""


def _cell(rate, commit, status="ok"):
    return {"rate": rate, "status": status, "commit": commit, "summary": {"sent": 1}} if status == "ok" else \
        {"rate": rate, "status": status}


def test_merge_keeps_earlier_cells_at_rates_not_measured_again():
    previous = [
        {"name": "sparse_bf16", "status": "ok", "deploy_s": 1.0, "cells": [_cell(1.0, "aaa"), _cell(16.0, "aaa")]},
        {"name": "dense", "status": "ok", "cells": [_cell(1.0, "aaa"), _cell(4.0, "aaa", "skipped: time budget")]},
        {"name": "sparse_bf16_chunk8k", "status": "ok", "cells": [_cell(1.0, "aaa")]},
    ]
    done = [
        # rate 4 new; rate 16 skipped here: the earlier measurement stays
        {"name": "sparse_bf16", "status": "ok", "deploy_s": 2.0,
         "cells": [_cell(4.0, "bbb"), _cell(16.0, "bbb", "skipped: time budget")]},
        # rate 1 measured again: replaces; rate 4 measured now where it was skipped before
        {"name": "dense", "status": "ok", "cells": [_cell(1.0, "bbb"), _cell(4.0, "bbb")]},
        {"name": "sparse_fp8", "status": "skipped", "reason": "not requested (--fp8)", "cells": []},
    ]
    merged = bench.merge_configurations(previous, done)
    assert [c["name"] for c in merged] == ["dense", "sparse_bf16", "sparse_fp8", "sparse_bf16_chunk8k"]
    by = {c["name"]: c for c in merged}
    assert [(c["rate"], c["commit"]) for c in by["sparse_bf16"]["cells"]] == [(1.0, "aaa"), (4.0, "bbb"), (16.0, "aaa")]
    assert by["sparse_bf16"]["deploy_s"] == 2.0  # the configuration's own fields: this run's
    assert [(c["rate"], c["commit"]) for c in by["dense"]["cells"]] == [(1.0, "bbb"), (4.0, "bbb")]
    assert by["sparse_bf16_chunk8k"] is previous[2] and by["sparse_fp8"]["cells"] == []
    assert bench.merge_configurations([], done) == [done[1], done[0], done[2]]  # nothing to keep: order only
    rows = bench.table_rows(merged)
    assert [(r["config"], r.get("commit")) for r in rows[:2]] == [("dense", "bbb"), ("dense", "bbb")]
    unordered = [{"name": "dense", "status": "ok", "cells": [{"rate": 16.0, "summary": _summary(16.0, 3.0, 1.0)},
                                                           {"rate": 1.0, "summary": _summary(1.0, 2.0, 1.0)}]}]
    assert [r["rate"] for r in bench.table_rows(unordered)] == [1.0, 16.0]  # by rate, whatever the run order


def test_plot_only_needs_a_results_file(tmp_path):
    with pytest.raises(SystemExit, match="missing"):
        bench.main(["--plot-only", "--out", str(tmp_path / "none.json")])
    out = tmp_path / "r.json"
    out.write_text(json.dumps({"configurations": FAKE, "targets": {"stale": True}}))
    result = bench.main(["--plot-only", "--out", str(out)])
    assert len(result["configurations"]) == 4
    assert result["targets"] == bench.targets(FAKE) and result["table"] == bench.table_rows(FAKE)  # recomputed
    assert json.loads(out.read_text())["targets"] == result["targets"]


def test_plot_only_merges_files_of_the_same_workload(tmp_path):
    """--merge-from adds another file's cells (a plan run on another GPU) to --out before the
    recompute; a file of another workload or layout is refused and --out is left as it was."""
    workload = {"model": "builtin:structured-8b", "gpus": 1, "requests": 100, "lengths": [4096, 131072],
                "max_tokens": 64, "seed": 0, "smoke": False}
    out, other, alien = tmp_path / "r.json", tmp_path / "gpu1.json", tmp_path / "alien.json"
    base = [{"name": "dense", "status": "ok", "cells": [{"rate": 1.0, "status": "ok", "summary": _summary(1.0, 9.0, 100.0)}]},
            {"name": "sparse_bf16", "status": "ok", "cells": [{"rate": 1.0, "status": "ok", "summary": _summary(1.0, 2.0, 120.0)}]}]
    extra = [{"name": "sparse_bf16", "status": "ok", "cells": [{"rate": 16.0, "status": "ok", "summary": _summary(16.0, 5.0, 260.0)}]},
             {"name": "dense", "status": "ok", "cells": [{"rate": 16.0, "status": "ok", "summary": _summary(16.0, 30.0, 100.0)}]}]
    out.write_text(json.dumps({"config": workload, "configurations": base}))
    other.write_text(json.dumps({"config": workload, "configurations": extra, "placement": "GPU 1"}))
    alien.write_text(json.dumps({"config": {**workload, "gpus": 2, "requests": 24}, "configurations": extra}))
    before = out.read_text()
    with pytest.raises(SystemExit, match=r"another workload or layout \(gpus: 2 vs 1, requests: 24 vs 100\)"):
        bench.main(["--plot-only", "--out", str(out), "--merge-from", str(alien)])
    with pytest.raises(SystemExit, match="missing"):
        bench.main(["--plot-only", "--out", str(out), "--merge-from", str(tmp_path / "none.json")])
    assert out.read_text() == before
    result = bench.main(["--plot-only", "--out", str(out), "--merge-from", str(other)])
    assert [(c["name"], [x["rate"] for x in c["cells"]]) for c in result["configurations"]] == [
        ("dense", [1.0, 16.0]), ("sparse_bf16", [1.0, 16.0])]
    assert result["targets"]["throughput_ratio_at_highest_rate"]["sparse_over_dense"] == pytest.approx(2.6)
    assert result["merged_from"] == [{"file": str(other), "env": None, "placement": "GPU 1"}]
    assert json.loads(out.read_text())["configurations"] == result["configurations"]


def test_merge_from_needs_plot_only(capsys):
    with pytest.raises(SystemExit):
        bench.parse_args(["--merge-from", "x.json"])
    assert "--merge-from: only with --plot-only" in capsys.readouterr().err


# ----------------------------------------------------------------------------- --parallel
def test_parse_groups():
    spec = "dense,sparse_bf16;sparse_fp8,sparse_bf16_chunk8k,sparse_bf16_chunk16k"
    assert bench.parse_groups(spec) == [("dense", "sparse_bf16"),
                                        ("sparse_fp8", "sparse_bf16_chunk8k", "sparse_bf16_chunk16k")]
    assert bench.parse_groups(" sparse_bf16 , dense ") == [("dense", "sparse_bf16")]  # the usual run order


@pytest.mark.parametrize("spec, match", [
    ("", "separated by ';'"), ("  ", "separated by ';'"), ("dense;", "group 1 .* empty"), (";dense", "group 0 .* empty"),
    ("dense,,sparse_bf16", "empty name"), ("dense;fast", "unknown configuration 'fast' in group 1"),
    ("dense;sparse_bf16,dense", "'dense' is in group 0 and group 1"), ("dense,dense", "group 0 twice"),
])
def test_parse_groups_rejects(spec, match):
    with pytest.raises(ValueError, match=f"--parallel: .*{match}"):
        bench.parse_groups(spec)


def test_assign_devices_and_visible_gpus(monkeypatch):
    cfg = bench.BenchConfig()
    groups = [("dense",), ("sparse_bf16",)]
    assert [g.devices for g in bench.assign_devices(groups, cfg, ["0", "1"])] == [("0",), ("1",)]
    two = dataclasses.replace(cfg, gpus=2)
    got = bench.assign_devices(groups, two, ["2", "3", "4", "5", "6"])
    assert [(g.index, g.configs, g.devices) for g in got] == [(0, ("dense",), ("2", "3")), (1, ("sparse_bf16",), ("4", "5"))]
    with pytest.raises(ValueError, match=r"2 group\(s\) with --gpus 2 need 4 GPU\(s\), this host has 3 \(0,1,2\)"):
        bench.assign_devices(groups, two, ["0", "1", "2"])
    with pytest.raises(ValueError, match="need 2 GPU.*has 0 .none visible"):
        bench.assign_devices(groups, cfg, [])
    smoke = bench.BenchConfig(**bench.SMOKE)
    assert [g.devices for g in bench.assign_devices(groups * 3, smoke, [])] == [()] * 6  # CPU: no GPU needed
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3, 5")
    assert bench.visible_gpus() == ["3", "5"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert bench.visible_gpus() == []
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    monkeypatch.setattr(bench, "_gpus", lambda: ["NVIDIA H200, 143771 MiB, 580"] * 2)
    assert bench.visible_gpus() == ["0", "1"]


def test_parallel_arguments(monkeypatch):
    monkeypatch.setattr(bench, "visible_gpus", lambda: ["0", "1"])
    cfg, args = bench.parse_args(["--parallel", "dense,sparse_bf16;sparse_fp8,sparse_bf16_chunk8k", "--requests", "8"])
    assert cfg.configs == ("dense", "sparse_bf16", "sparse_fp8", "sparse_bf16_chunk8k") and cfg.fp8
    assert cfg.run_configs == cfg.configs and cfg.requests == 8
    assert [(g.configs, g.devices) for g in args.groups] == [(("dense", "sparse_bf16"), ("0",)),
                                                             (("sparse_fp8", "sparse_bf16_chunk8k"), ("1",))]
    cfg, args = bench.parse_args(["--parallel", "dense;sparse_bf16", "--seed", "3"])
    assert not cfg.fp8 and cfg.seed == 3
    _, args = bench.parse_args(["--gpus", "2"])
    assert args.groups is None  # no --parallel: the single-process run
    _, args = bench.parse_args(["--cpu-smoke", "--parallel", "dense;sparse_bf16;sparse_fp8"])  # CPU: any number
    assert [g.devices for g in args.groups] == [(), (), ()]


@pytest.mark.parametrize("argv, match", [
    (["--parallel", "dense;nope"], "--parallel: unknown configuration 'nope'"),
    (["--parallel", "dense;dense"], "--parallel: 'dense' is in group 0 and group 1"),
    (["--parallel", "dense;"], "--parallel: group 1"),
    (["--parallel", "dense;sparse_bf16;sparse_bf16_chunk8k"], r"--parallel: 3 group\(s\) with --gpus 1 need 3 GPU"),
    (["--parallel", "dense;sparse_bf16", "--gpus", "2"], r"--parallel: 2 group\(s\) with --gpus 2 need 4 GPU"),
    (["--parallel", "dense", "--configs", "dense"], "--parallel: not with --configs"),
    (["--parallel", "dense", "--plot-only"], "--parallel: not with --plot-only"),
    (["--parallel", "dense", "--http-port", "8000"], "--parallel: not with --http-port"),
    (["--parallel", "dense", "--grpc-port", "9000"], "--parallel: not with --grpc-port"),
    (["--parallel", "dense;sparse_bf16", "--fp8"], "--fp8: with --parallel, name sparse_fp8 in a group"),
    (["--parallel", "dense;sparse_bf16", "--time-budget-s", "60"], "--time-budget-s: with --parallel it must exceed 60"),
    (["--parallel", "dense", "--requests", "0"], "requests"),
])
def test_parallel_arguments_rejected(monkeypatch, capsys, argv, match):
    monkeypatch.setattr(bench, "visible_gpus", lambda: ["0", "1"])
    with pytest.raises(SystemExit):
        bench.parse_args(argv)
    assert re.search(match, capsys.readouterr().err)


@pytest.mark.parametrize("base", [
    [], ["--gpus", "2", "--rates", "0.5,2", "--requests", "7", "--cell-seconds", "9.5", "--drain-seconds", "0",
         "--request-timeout", "33", "--lengths", "4096,65536", "--max-tokens", "16", "--seed", "5", "--transport",
         "object_store", "--prefill-kv-pages", "3000", "--decode-kv-pages", "9000", "--time-budget-s", "500"],
    ["--cpu-smoke", "--requests", "3"],
])
def test_child_argv_replays_the_parents_workload(monkeypatch, tmp_path, base):
    monkeypatch.setattr(bench, "visible_gpus", lambda: ["0", "1", "2", "3"])
    cfg, args = bench.parse_args(base + ["--parallel", "dense,sparse_bf16;sparse_fp8"])
    for group in args.groups:
        argv = bench.child_argv(cfg, group, out=tmp_path / "g.json", http_port=8123, grpc_port=9123, time_budget_s=321.5)
        child, child_args = bench.parse_args(argv)
        assert child_args.groups is None and child_args.out == str(tmp_path / "g.json")
        assert (child.configs, child.fp8) == (group.configs, "sparse_fp8" in group.configs)
        assert (child.http_port, child.grpc_port, child.time_budget_s) == (8123, 9123, 321.5)
        same = {"configs": child.configs, "fp8": child.fp8, "http_port": child.http_port, "grpc_port": child.grpc_port,
                "time_budget_s": child.time_budget_s}
        assert dataclasses.replace(cfg, **same) == child  # the same seed, prompts, cells, pools, transport
    assert "--time-budget-s" not in bench.child_argv(cfg, args.groups[0], out=tmp_path / "g.json", http_port=1,
                                                     grpc_port=2, time_budget_s=None)


def test_child_env(tmp_path):
    base = {"PATH": "/bin", "PYTHONPATH": f"/x{os.pathsep}{ROOT}", "RAY_ADDRESS": "127.0.0.1:6379",
            "CUDA_VISIBLE_DEVICES": "0,1,2,3"}
    env = bench.child_env(bench.Group(1, ("dense",), ("2", "3")), groups=2, ray_tmpdir="/tmp/r1", metrics_port=4711,
                          commit="abc1234", base=base)
    assert "RAY_ADDRESS" not in env and env["CUDA_VISIBLE_DEVICES"] == "2,3" and env["RAY_TMPDIR"] == "/tmp/r1"
    assert env["PYTHONPATH"] == f"{ROOT}{os.pathsep}/x" and env["GIT_COMMIT"] == "abc1234" and env["PATH"] == "/bin"
    assert (env["DASHBOARD_METRIC_PORT"], env["RAY_DEFAULT_OBJECT_STORE_MEMORY_PROPORTION"]) == ("4711", "0.1500")
    assert base["RAY_ADDRESS"] == "127.0.0.1:6379"  # the parent's own environment is untouched
    cpu = bench.child_env(bench.Group(0, ("dense",)), groups=3, ray_tmpdir="/tmp/r0", metrics_port=1, commit="c",
                          base={"CUDA_VISIBLE_DEVICES": "7"})
    assert cpu["CUDA_VISIBLE_DEVICES"] == "7" and cpu["RAY_DEFAULT_OBJECT_STORE_MEMORY_PROPORTION"] == "0.1000"
    ports = bench._free_ports(6)
    assert len(set(ports)) == 6


def _conf(name, status="ok", rates=(1.0, 16.0)):
    return {"name": name, "status": status, "service_options": dict(bench.CONFIGURATIONS[name]),
            "cells": [{"rate": r, "status": "ok", "summary": _summary(r, 2.0 if "sparse" in name else 9.0, 100.0)}
                      for r in rates]}


def test_merge_groups_records_failed_and_cut_groups(tmp_path):
    cfg = bench.BenchConfig(configs=("dense", "sparse_bf16", "sparse_fp8", "sparse_bf16_chunk8k", "sparse_bf16_chunk16k"),
                            fp8=True)
    groups = [bench.Group(0, ("dense", "sparse_bf16"), ("0",)), bench.Group(1, ("sparse_fp8",), ("1",)),
              bench.Group(2, ("sparse_bf16_chunk8k", "sparse_bf16_chunk16k"), ("2",))]
    bench.write_json(tmp_path / "g0.json", {"env": {"ray_cluster": {"gcs_address": "127.0.0.1:1"}},
                                            "configurations": [_conf("sparse_bf16"), _conf("dense")]})
    assert not list(tmp_path.glob("*.tmp"))
    (tmp_path / "g1.log").write_text("starting\nTraceback (most recent call last):\nRuntimeError: boom\n")
    bench.write_json(tmp_path / "g2.json", {"configurations": [_conf("sparse_bf16_chunk8k", "running", rates=(1.0,))]})
    (tmp_path / "g3.json").write_text('{"configurations": [')  # cut mid-write
    records = [
        bench.group_record(groups[0], {"returncode": 0, "wall_s": 50.0}, tmp_path / "g0.json", tmp_path / "g0.log"),
        bench.group_record(groups[1], {"returncode": 1, "wall_s": 9.0}, tmp_path / "g1.json", tmp_path / "g1.log"),
        bench.group_record(groups[2], {"returncode": -15, "killed": "time budget: SIGTERM at 80 s"}, tmp_path / "g2.json",
                           tmp_path / "g2.log", http_port=8123),
    ]
    assert [r["status"] for r in records] == ["ok", "error", "killed"]
    assert records[0]["ray_cluster"] == {"gcs_address": "127.0.0.1:1"} and records[2]["http_port"] == 8123
    assert records[1]["error"] == "exit status 1, no partial results file; last log line: RuntimeError: boom"
    assert records[1]["log_tail"].startswith("starting\nTraceback") and records[0]["log_tail"] is None
    confs = bench.merge_groups(cfg, groups, records)
    assert [c["name"] for c in confs] == list(bench.CONFIG_ORDER[:5])  # the five the groups named
    by = {c["name"]: c for c in confs}
    assert by["dense"]["status"] == by["sparse_bf16"]["status"] == "ok"
    assert by["dense"]["placement"] == {"group": 0, "gpus": ["0"], "layout": bench.layout_text(cfg)}
    assert by["sparse_fp8"]["status"] == "error" and by["sparse_fp8"]["cells"] == []
    assert by["sparse_fp8"]["reason"] == ("not run: group 1 error: exit status 1, no partial results file; last log "
                                          "line: RuntimeError: boom")
    assert by["sparse_fp8"]["placement"]["gpus"] == ["1"]
    cut = by["sparse_bf16_chunk8k"]
    assert cut["status"] == "error" and cut["reason"].startswith("cut: group 2 killed during this configuration")
    assert len(cut["cells"]) == 1 and cut["placement"]["group"] == 2  # its completed cell is kept
    assert by["sparse_bf16_chunk16k"]["reason"] == "not run: group 2 killed: time budget: SIGTERM at 80 s"
    rows = bench.table_rows(confs)
    assert [r["config"] for r in rows] == ["dense", "dense", "sparse_bf16", "sparse_bf16", "sparse_fp8",
                                           "sparse_bf16_chunk8k", "sparse_bf16_chunk16k"]
    assert bench.targets(confs)["ttft_p50_ratio_at_lowest_rate"]["dense_over_sparse"] == pytest.approx(4.5)
    running = bench.group_record(groups[2], {"returncode": None}, tmp_path / "g2.json", tmp_path / "g2.log")
    confs = bench.merge_groups(cfg, groups[2:], [running])  # an intermediate save while group 2 still runs
    assert [(c["status"], c.get("reason")) for c in confs] == [("running", None),
                                                               ("pending", "group 2 is still running")]
    unreadable = bench.group_record(groups[1], {"returncode": 0}, tmp_path / "g3.json", tmp_path / "g3.log")
    assert unreadable["status"] == "error" and "exit status 0, unreadable partial results" in unreadable["error"]
    assert unreadable["error"].endswith("last log line: (empty log)")


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


# a child that starts a grandchild in a process group of its own (as Ray's workers do), then waits
FAMILY = ("import os, subprocess, sys, time\n"
          "g = subprocess.Popen([sys.executable, '-c', 'import os, time; os.setpgrp(); time.sleep(120)'])\n"
          "print('grandchild', g.pid, flush=True)\n"
          "if sys.argv[1] == 'stubborn':\n"
          "    import signal; signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
          "time.sleep(120)\n")
# waits until the file argv[1] names holds FAMILY's 'grandchild' line (run_children flushes a log
# line by line): an exit ordered after the other child's start-up, at any machine load
WAIT_FOR_GRANDCHILD = ("import pathlib, sys, time\n"
                       "p = pathlib.Path(sys.argv[1])\n"
                       "while not (p.exists() and 'grandchild' in p.read_text()):\n"
                       "    time.sleep(0.05)\n")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc sessions")
def test_run_children_logs_prefixes_and_stops_sessions(tmp_path):
    import io
    import time

    out, ended = io.StringIO(), []
    cmds = [[sys.executable, "-c", "import sys; print('one'); print('two'); sys.exit(3)"],
            [sys.executable, "-c", FAMILY, "polite"], [sys.executable, "-c", FAMILY, "stubborn"]]
    logs = [tmp_path / f"g{k}.log" for k in range(3)]
    t0 = time.monotonic()
    # the deadline leaves every child ample time to start (and the stubborn one to ignore SIGTERM)
    # on a loaded machine; the bound on the whole run only catches a hang
    outcomes = bench.run_children(cmds, [dict(os.environ)] * 3, logs, deadline=time.monotonic() + 10.0, out=out,
                                  on_exit=lambda k, o: ended.append((k, o["returncode"])), grace_s=1.0)
    assert time.monotonic() - t0 < 120
    assert (outcomes[0]["returncode"], outcomes[0]["killed"]) == (3, None)
    assert outcomes[1]["killed"].startswith("time budget: SIGTERM at ") and outcomes[1]["returncode"] == -15
    assert outcomes[2]["killed"].startswith("time budget: SIGTERM, SIGKILL after 1 s")
    assert [k for k, _ in ended] == [0, 1, 2] and ended[0][1] == 3
    assert logs[0].read_text() == "one\ntwo\n"
    text = out.getvalue()
    # groups print concurrently: each group's lines, prefixed and in order, whatever came between
    assert [ln for ln in text.splitlines() if ln.startswith("[g0] ")] == ["[g0] one", "[g0] two"]
    assert "[g1] time budget: stopping group 1" in text
    for k in (1, 2):
        assert not bench.session_members(outcomes[k]["pid"])
        grandchild = int(logs[k].read_text().split()[1])
        for _ in range(50):  # SIGKILLed grandchildren are reaped by init
            if not _alive(grandchild):
                break
            time.sleep(0.1)
        assert not _alive(grandchild), f"group {k}'s grandchild {grandchild} (own process group) survived"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc sessions")
def test_run_children_stops_every_group_when_interrupted(tmp_path):
    import time

    ended = []

    def on_exit(k, outcome):
        ended.append((k, outcome))
        if k == 0:
            raise RuntimeError("parent interrupted")

    # group 0 ends (and so interrupts the parent) only once group 1 has started its grandchild
    cmds = [[sys.executable, "-c", WAIT_FOR_GRANDCHILD, str(tmp_path / "b.log")], [sys.executable, "-c", FAMILY, "polite"]]
    with pytest.raises(RuntimeError, match="parent interrupted"):
        bench.run_children(cmds, [dict(os.environ)] * 2, [tmp_path / "a.log", tmp_path / "b.log"],
                           on_exit=on_exit, grace_s=2.0, out=open(os.devnull, "w"))
    assert [k for k, _ in ended] == [0, 1]
    assert ended[1][1]["killed"].startswith("interrupted (RuntimeError: parent interrupted): SIGTERM")
    grandchild = int((tmp_path / "b.log").read_text().split()[1])
    assert ended[1][1]["pid"] > 0 and not bench.session_members(ended[1][1]["pid"])  # nothing left in that session
    for _ in range(50):
        if not _alive(grandchild):
            break
        time.sleep(0.1)
    assert not _alive(grandchild)


# a stand-in for a group's bench_service.py: argv[1] says what it does, the rest are the child's arguments
STUB = """import json, os, sys, time
what, args = sys.argv[1], sys.argv[2:]
print('stub', what, ' '.join(args), flush=True)
if what == 'fail':
    sys.exit('RuntimeError: boom')
if what == 'hang':
    time.sleep(120)
result = json.load(open(what))
result['env'] = {'ray_cluster': {k: os.environ.get(k) for k in ('RAY_TMPDIR', 'CUDA_VISIBLE_DEVICES', 'GIT_COMMIT')},
                 'argv': args}
json.dump(result, open(args[args.index('--out') + 1], 'w'))
"""


def test_run_parallel_merges_groups_and_keeps_a_failed_groups_error(monkeypatch, tmp_path, capsys):
    """Three stub groups on GPUs 0, 1, 2: one finishes, one fails, one is stopped at the time
    budget; --merge keeps a configuration of the existing file."""
    monkeypatch.setattr(bench, "CHILD_MARGIN_S", {"gpu": 1.0, "cpu": 1.0})
    monkeypatch.setattr(bench, "KILL_MARGIN_S", 14.0)  # budget 20 s: the hanging group is stopped after 6 s
    monkeypatch.setenv("GIT_COMMIT", "abc1234")
    monkeypatch.setattr(bench, "visible_gpus", lambda: ["0", "1", "2"])
    argv = ["--parallel", "dense,sparse_bf16;sparse_fp8;sparse_bf16_chunk8k", "--requests", "5", "--time-budget-s", "20",
            "--out", str(tmp_path / "service.json"), "--merge"]
    cfg, args = bench.parse_args(argv)
    (tmp_path / "g0.json").write_text(json.dumps({"configurations": [_conf("dense"), _conf("sparse_bf16")]}))
    out = tmp_path / "service.json"
    out.write_text(json.dumps({"configurations": [_conf("sparse_bf16_chunk16k"), _conf("dense", "error")]}))
    stale = tmp_path / "service_parallel" / "group1.json"  # an earlier run's partial must not be merged
    stale.parent.mkdir()
    stale.write_text(json.dumps({"configurations": [_conf("sparse_fp8")]}))
    what = {0: str(tmp_path / "g0.json"), 1: "fail", 2: "hang"}
    result = bench.run_parallel(cfg, args.groups, argv, out, True, bench.Budget(cfg.time_budget_s),
                                child_command=lambda k, a: [sys.executable, "-c", STUB, what[k], *a])
    result = json.loads(json.dumps(result))
    assert json.loads(out.read_text()) == result
    assert result["env"]["command"].endswith("--parallel 'dense,sparse_bf16;sparse_fp8;sparse_bf16_chunk8k' "
                                             f"--requests 5 --time-budget-s 20 --out {out} --merge")
    groups = result["parallel"]["groups"]
    assert [g["status"] for g in groups] == ["ok", "error", "killed"]
    assert [g["gpus"] for g in groups] == [["0"], ["1"], ["2"]]
    assert groups[0]["ray_cluster"] == {"RAY_TMPDIR": groups[0]["RAY_TMPDIR"], "CUDA_VISIBLE_DEVICES": "0",
                                        "GIT_COMMIT": "abc1234"}
    assert not Path(groups[0]["RAY_TMPDIR"]).exists() and Path(groups[1]["RAY_TMPDIR"]).is_dir()  # kept: it failed
    assert len({g["RAY_TMPDIR"] for g in groups}) == 3
    assert len({p for g in groups for p in (g["http_port"], g["grpc_port"])}) == 6
    assert groups[1]["error"].endswith("last log line: RuntimeError: boom") and "stub fail" in groups[1]["log_tail"]
    assert groups[2]["error"].startswith("time budget: SIGTERM at ")
    assert 0 < groups[0]["time_budget_s"] <= 19.0 and "--fp8" in groups[1]["command"]
    assert "--configs dense,sparse_bf16 --rates 1.0,4.0,16.0 --requests 5" in groups[0]["command"]
    by = {c["name"]: c for c in result["configurations"]}
    assert [c["name"] for c in result["configurations"]] == ["dense", "sparse_bf16", "sparse_fp8",
                                                              "sparse_bf16_chunk8k", "sparse_bf16_chunk16k"]
    assert by["dense"]["status"] == "ok" and by["dense"]["placement"]["gpus"] == ["0"]  # this run's, not the file's
    assert "placement" not in by["sparse_bf16_chunk16k"]  # kept from the existing file
    assert by["sparse_fp8"]["status"] == "error" and "boom" in by["sparse_fp8"]["reason"]
    assert by["sparse_bf16_chunk8k"]["reason"].startswith("not run: group 2 killed: time budget")
    assert result["targets"]["ttft_p50_ratio_at_lowest_rate"]["dense_over_sparse"] == pytest.approx(4.5)
    assert result["placement"].startswith("parallel groups, each its own process and local Ray: group 0 (dense, "
                                          "sparse_bf16) on GPU 0; group 1 (sparse_fp8) on GPU 1")
    assert result["config"]["configs"] == ["dense", "sparse_bf16", "sparse_fp8", "sparse_bf16_chunk8k"]
    printed = capsys.readouterr().out
    assert "[g1] stub fail" in printed and "[g2] time budget: stopping group 2" in printed
    assert "sparse_bf16_chunk16k" in printed and "targets:" in printed
    assert (tmp_path / "service_parallel" / "group2.log").read_text().startswith("stub hang --gpus 1")
    for g in groups[1:]:
        __import__("shutil").rmtree(g["RAY_TMPDIR"], ignore_errors=True)


def check_smoke_configuration(conf: dict) -> None:
    """The checks of one --cpu-smoke configuration's record: the default smoke run's chunked
    sparse configuration, two cells, every request completed, its timing breakdown consistent."""
    assert conf["status"] == "ok" and conf["service_options"] == {"alpha": 0.1, "prefill_chunk_tokens": 128}
    assert [w["status"] for w in conf["warmup"]] == [200, 200]
    # one prefill replica; on CPU its prompts (< dense_below) take the runner's exact dense path,
    # which does not go through ops.attention_planned: nothing counted, but the field is there
    assert len(conf["attention_kernels"]) == 1 and isinstance(conf["attention_kernels"][0], dict)
    assert [c["rate"] for c in conf["cells"]] == [4.0, 16.0]
    assert conf["cells"][1]["prefix_cache_cleared"] > 0  # the pages the first cell's prompts cached
    slack = 0.05
    for cell in conf["cells"]:
        s = cell["summary"]
        assert s["sent"] == s["completed"] == 4 and s["lost"] == s["not_sent"] == 0 and cell["idle_before"]["idle"]
        # each cell starts cold and its prompts are distinct: no prompt token comes from the cache,
        # except for a request prefilled again (a failed KV transfer is retried with a new
        # prefill, seen once in a loaded run), which finds the chunks its first attempt cached
        assert cell["prefix_cache_cleared"] >= 0
        assert s["cached_prompt_tokens"] == sum(rec["timing"]["cached_tokens"] for rec in cell["records"])
        assert all(rec["timing"]["cached_tokens"] == 0 for rec in cell["records"] if rec["timing"]["prefill_attempts"] == 1)
        assert all(rec["timing"]["cached_tokens"] < rec["prompt_len"] for rec in cell["records"])
        assert s["ttft_p50_s"] > 0 and s["tpot_p50_s"] > 0 and s["output_tokens_per_s"] > 0
        for rec in cell["records"]:
            t = rec["timing"]
            assert rec["output_tokens"] == 4 and rec["prompt_len"] in (256, 512)
            for key in ("ttft_s", "queue_s", "prefill_s", "export_s", "transfer_s", "first_decode_s", "total_s"):
                assert t[key] is not None and t[key] >= 0, (key, t)
            assert t["queue_s"] + t["prefill_s"] + t["export_s"] <= t["ttft_s"] + slack
            assert t["ttft_s"] <= rec["ttft_s"] + slack  # the service's TTFT within the client's
            assert t["ttft_s"] + t["transfer_s"] + t["first_decode_s"] <= t["total_s"] + slack


def test_cpu_smoke_parallel_groups_end_to_end(tmp_path):
    """Two --cpu-smoke groups at once, each its own process and local Ray (two clusters on this
    host at the same time, neither joining the other), merged into one file. Each group's child
    is a plain (not --parallel) run; group 1 runs the default smoke configuration, so its record
    is also what a single ``--cpu-smoke`` run writes (:func:`check_smoke_configuration`)."""
    pytest.importorskip("ray.serve")
    out = tmp_path / "par.json"
    env = {**os.environ, "GIT_COMMIT": "abc1234", "PYTHONPATH": str(ROOT), "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_service.py"), "--cpu-smoke", "--parallel",
                           "sparse_bf16;sparse_bf16_chunk8k", "--out", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    groups = result["parallel"]["groups"]
    assert [(g["status"], g["configs"]) for g in groups] == [("ok", ["sparse_bf16"]), ("ok", ["sparse_bf16_chunk8k"])]
    clusters = [g["ray_cluster"] for g in groups]
    assert clusters[0]["gcs_address"] != clusters[1]["gcs_address"] and clusters[0]["session"] != clusters[1]["session"]
    assert [c["RAY_TMPDIR"] for c in clusters] == [g["RAY_TMPDIR"] for g in groups]
    assert not any(Path(g["RAY_TMPDIR"]).exists() for g in groups)  # removed after a successful group
    assert result["wall_s"] < 0.9 * sum(g["wall_s"] for g in groups)  # they ran at the same time
    assert result["env"]["commit"] == "abc1234" and "--parallel 'sparse_bf16;sparse_bf16_chunk8k'" in result["env"]["command"]
    assert result["targets"]["zero_lost"] is True
    for k, conf in enumerate(result["configurations"]):
        assert conf["status"] == "ok" and conf["placement"] == {"group": k, "gpus": [], "layout": "CPU (smoke)"}
        assert [(c["rate"], c["summary"]["sent"], c["summary"]["completed"]) for c in conf["cells"]] == [(4.0, 4, 4),
                                                                                                          (16.0, 4, 4)]
    check_smoke_configuration(result["configurations"][1])
    assert "[g0] [sparse_bf16] rate 4/s" in proc.stdout and "[g1] [sparse_bf16_chunk8k] rate 16/s" in proc.stdout
    assert "[g0] ok" in proc.stdout and "TTFT p50" in proc.stdout
    log1 = (tmp_path / "par_parallel" / "group1.log").read_text()
    assert log1.count("[sparse_bf16_chunk8k] rate 4/s") == 1 and "prefill attention calls by kernel" in log1
    group1 = json.loads((tmp_path / "par_parallel" / "group1.json").read_text())  # the child's own file
    assert group1["env"]["commit"] == "abc1234" and group1["targets"]["zero_lost"] is True
    (single,) = group1["configurations"]
    check_smoke_configuration(single)


def test_shared_prefix_workload_and_merge_guard(tmp_path):
    """--shared-prefix-tokens: every prompt starts with one document, then its own tokens; a run
    refuses to --merge into a file of another workload (a file from before the key existed ran
    with none)."""
    cfg, _ = bench.parse_args(["--cpu-smoke", "--shared-prefix-tokens", "200", "--requests", "6",
                               "--configs", "sparse_bf16,sparse_bf16_nocache"])
    assert cfg.shared_prefix_tokens == 200 and cfg.run_configs == ("sparse_bf16", "sparse_bf16_nocache")
    assert bench.resolve_service_config(bench.service_options(cfg, "sparse_bf16_nocache"))[0].prefill.prefix_caching is False
    prompts = bench.build_prompts(cfg, "m")
    ids = [json.loads(body)["prompt"] for _, body in prompts]
    assert [len(x) for x in ids] == [n for n, _ in prompts] and all(n > 200 for n, _ in prompts)
    assert all(x[:200] == ids[0][:200] for x in ids)  # one document
    assert len({tuple(x[200:210]) for x in ids}) == len(ids)  # each its own continuation
    with pytest.raises(SystemExit):
        bench.parse_args(["--cpu-smoke", "--shared-prefix-tokens", str(10**6)])
    old = tmp_path / "old.json"
    config = json.loads(json.dumps(dataclasses.asdict(cfg)))
    old.write_text(json.dumps({"config": {k: v for k, v in config.items() if k != "shared_prefix_tokens"},
                               "configurations": [{"name": "dense"}]}))
    with pytest.raises(SystemExit, match=r"--merge: .* another workload or layout \(shared_prefix_tokens: None vs 200\)"):
        bench.previous_configurations(old, cfg, merge=True)
    plain = dataclasses.replace(cfg, shared_prefix_tokens=0)
    assert bench.previous_configurations(old, plain, merge=True) == [{"name": "dense"}]
    assert bench.previous_configurations(old, cfg, merge=False) == []


def test_served_cells_run_the_services_scheduling_and_sparse_defaults():
    """Issue 50's cells: chunks of 2048 tokens shortest first, the last 2 tiles dense, the
    first-key rule, pools from the memory plan; they differ only in sparsity and weights."""
    cfg, _ = bench.parse_args(["--configs", "dense_served,sparse_bf16_served,sparse_fp8w_served", "--rates", "1,2"])
    got = {}
    for name in ("dense_served", "sparse_bf16_served", "sparse_fp8w_served"):
        service, why = bench.resolve_service_config(bench.service_options(cfg, name))
        assert why is None, why
        got[name] = service
        assert service.prefill.chunk_tokens == 2048 and service.prefill.schedule == "shortest_first"
        assert service.sparse.last_dense_tiles == 2 and service.sparse.energy_rule == "first_key"
        assert service.kv.prefill_pages == "auto"
    assert got["dense_served"].sparse.alpha == 0.0 and got["sparse_bf16_served"].sparse.alpha == 0.1
    assert got["sparse_fp8w_served"].model.weight_dtype == "fp8_channel"
    assert got["sparse_bf16_served"].model.weight_dtype != "fp8_channel"
