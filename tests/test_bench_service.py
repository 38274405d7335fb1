"""benchmarks/bench_service.py: its options, skip paths, table/targets/plots, and the CPU
smoke mode end to end (a real local Ray + Serve with the tiny structured model)."""

from __future__ import annotations

import dataclasses
import json
import os
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
    assert (dense["prefill_kv_pages"], dense["decode_kv_pages"]) == bench.POOL_PAGES[1]
    two = dataclasses.replace(cfg, gpus=2, prefill_kv_pages=3000)
    assert (bench.service_options(two, "dense")["prefill_kv_pages"], bench.service_options(two, "dense")["decode_kv_pages"]) \
        == (3000, bench.POOL_PAGES[2][1])
    assert bench.replica_options(cfg)["ray_actor_options"]["num_gpus"] == 0.5
    assert bench.replica_options(two)["ray_actor_options"]["num_gpus"] == 1
    for name in ("dense", "sparse_bf16", "sparse_bf16_chunk8k", "sparse_bf16_chunk16k"):
        service, why = bench.resolve_service_config(bench.service_options(cfg, name))
        assert why is None and service.max_model_len == 131072 + 64
        # the longest prompt fits a prefill pool; prompt + output fits a decode pool
        assert 131072 // service.page_size <= service.prefill_kv_pages
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
    smoke, _ = bench.parse_args(["--cpu-smoke"])
    assert smoke.smoke and smoke.model == "builtin:structured-tiny" and smoke.http_port != 8000
    for bad in (["--configs", "nope"], ["--gpus", "4"], ["--requests", "0"]):
        with pytest.raises(SystemExit):
            bench.parse_args(bad)


def test_configurations_that_cannot_run_are_recorded_without_a_deploy():
    """No Ray here: each of these returns before anything is deployed."""
    cfg = bench.BenchConfig(configs=("sparse_bf16",))
    conf = bench.run_configuration("sparse_fp8", cfg, None, bench.Budget(None), None, BASE)
    assert conf["status"] == "skipped" and "--fp8" in conf["reason"]
    tight = dataclasses.replace(cfg, time_budget_s=10.0)
    conf = bench.run_configuration("sparse_bf16", tight, None, bench.Budget(10.0), None, BASE)
    assert conf["status"] == "skipped" and "time budget" in conf["reason"]


def _service_config_knows(name: str) -> bool:
    from router.config import ServiceConfig

    return name in {f.name for f in dataclasses.fields(ServiceConfig)}


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
    pytest.importorskip("matplotlib")
    paths = bench.plot(FAKE, tmp_path / "service.json")
    assert [Path(p).name for p in paths] == ["service_ttft_throughput.png", "service_breakdown.png"]
    assert all(Path(p).stat().st_size > 1000 for p in paths)


def test_plot_only_needs_a_results_file(tmp_path):
    with pytest.raises(SystemExit, match="missing"):
        bench.main(["--plot-only", "--out", str(tmp_path / "none.json")])
    out = tmp_path / "r.json"
    out.write_text(json.dumps({"configurations": FAKE}))
    assert len(bench.main(["--plot-only", "--out", str(out)])["configurations"]) == 4


# ----------------------------------------------------------------------------- the smoke run
def test_cpu_smoke_run_end_to_end(tmp_path):
    """Ray + Serve on 127.0.0.1, the tiny structured model on CPU, one chunked sparse
    configuration, two cells: every request completes and its timing breakdown is consistent."""
    pytest.importorskip("ray.serve")
    out = tmp_path / "smoke.json"
    env = {**os.environ, "GIT_COMMIT": "abc1234", "PYTHONPATH": str(ROOT), "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_service.py"), "--cpu-smoke", "--out", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "TTFT p50" in proc.stdout and "sparse_bf16_chunk8k" in proc.stdout
    result = json.loads(out.read_text())
    assert result["env"]["commit"] == "abc1234" and result["targets"]["zero_lost"] is True
    (conf,) = result["configurations"]
    assert conf["status"] == "ok" and conf["service_options"] == {"alpha": 0.1, "prefill_chunk_tokens": 128}
    assert [w["status"] for w in conf["warmup"]] == [200, 200]
    assert [c["rate"] for c in conf["cells"]] == [4.0, 16.0]
    slack = 0.05
    for cell in conf["cells"]:
        s = cell["summary"]
        assert s["sent"] == s["completed"] == 4 and s["lost"] == s["not_sent"] == 0 and cell["idle_before"]["idle"]
        assert s["ttft_p50_s"] > 0 and s["tpot_p50_s"] > 0 and s["output_tokens_per_s"] > 0
        for rec in cell["records"]:
            t = rec["timing"]
            assert rec["output_tokens"] == 4 and rec["prompt_len"] in (256, 512)
            for key in ("ttft_s", "queue_s", "prefill_s", "export_s", "transfer_s", "first_decode_s", "total_s"):
                assert t[key] is not None and t[key] >= 0, (key, t)
            assert t["queue_s"] + t["prefill_s"] + t["export_s"] <= t["ttft_s"] + slack
            assert t["ttft_s"] <= rec["ttft_s"] + slack  # the service's TTFT within the client's
            assert t["ttft_s"] + t["transfer_s"] + t["first_decode_s"] <= t["total_s"] + slack
