"""scripts/service_plan.sh: a detached bench_service plan merged into one file, and its poll
(usage errors; a plan of two items run by a stand-in for bench_service whose arguments must parse with
bench_service's own parser; bench_service's real runs are tests/test_bench_service.py's)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "service_plan.sh"


def _run(*args, env=None, timeout=60):
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})


@pytest.mark.parametrize("args,match", [
    ((), "usage"),
    (("start",), "usage"),
    (("start", "DIR"), "at least one"),
    (("start", "DIR", "dense"), "config:rates"),
    (("start", "DIR", "dense:"), "config:rates"),
    (("start", "DIR", ":1,4"), "config:rates"),
    (("start", "DIR", "@:1,4"), "config:rates"),
    (("stop", "DIR"), "usage"),
])
def test_usage_errors(args, match, tmp_path):
    args = tuple(str(tmp_path / a) if a == "DIR" else a for a in args)
    proc = _run(*args)
    assert proc.returncode == 2 and match in proc.stderr
    assert not (tmp_path / "DIR" / "log").exists()


FAKE_BENCH = """
import json, os, pathlib, sys, time
argv = sys.argv[1:]
with open(os.environ["ARGV_LOG"], "a") as f:
    f.write(json.dumps(argv) + "\\n")
flag = pathlib.Path(os.environ["GO_FLAG"])
while not flag.exists():  # held until the test lets it go: the plan must be running detached
    time.sleep(0.05)
name, rate = argv[argv.index("--configs") + 1], argv[argv.index("--rates") + 1]
print(f"[{name}] rate {rate}/s: sent 2 of 2, completed 2", flush=True)
out = pathlib.Path(argv[argv.index("--out") + 1])
cells = json.loads(out.read_text())["cells"] if out.exists() else []
out.write_text(json.dumps({"cells": cells + [name]}))
sys.exit(3 if name == "dense" else 0)
"""


def test_plan_runs_detached_and_polls(tmp_path):
    """The plan outlives ``start`` (a session of its own), runs its items in order, logs each
    one's exit status (a failed item does not stop the next), and ``poll`` shows the cells and
    the exits and copies the results to $OUT. The interpreter is a stand-in that holds until
    the test lets it go; the arguments it got must parse with bench_service's own parser.
    bench_service's real runs are tests/test_bench_service.py's."""
    from benchmarks import bench_service as bench

    script = tmp_path / "fake_bench.py"
    script.write_text(FAKE_BENCH)
    fake = tmp_path / "fake_python.sh"
    fake.write_text(f"#!/usr/bin/env bash\nshift\nexec {sys.executable} {script} \"$@\"\n")  # drop the script path
    fake.chmod(0o755)
    go, argv_log, out, plan = tmp_path / "go", tmp_path / "argv.jsonl", tmp_path / "out", tmp_path / "plan"
    env = {"PYTHON": str(fake), "GO_FLAG": str(go), "ARGV_LOG": str(argv_log), "OUT": str(out),
           "SERVICE_OPTS": "--cpu-smoke", "CELL_OPTS": "--requests 2 --cell-seconds 2 --drain-seconds 60"}
    started = _run("start", str(plan), "dense:16", "sparse_bf16:4,8", env=env)
    assert started.returncode == 0, started.stderr
    session = int(re.search(r"session (\d+)", started.stdout).group(1))
    try:
        os.kill(session, 0)  # start has returned; the plan still runs, held by the stand-in
        assert "PLAN-DONE" not in (plan / "log").read_text()
        go.touch()
        polled = _run("poll", str(plan), "60", env=env, timeout=90)
    finally:
        try:
            os.killpg(session, signal.SIGTERM)  # nothing left when it finished; a stuck plan must not outlive us
        except ProcessLookupError:
            pass
    log = (plan / "log").read_text()
    assert polled.stdout.splitlines() == ["[dense] rate 16/s: sent 2 of 2, completed 2", "[plan] item 1 exit 3",
                                          "[sparse_bf16] rate 4,8/s: sent 2 of 2, completed 2", "[plan] item 2 exit 0",
                                          "PLAN-DONE"], log
    # both items wrote the one results file, in order
    assert json.loads((plan / "service_h200.json").read_text()) == {"cells": ["dense", "sparse_bf16"]}
    assert sorted(p.name for p in out.iterdir()) == ["log", "service_h200.json"]  # copied for the device tool
    for argv, (name, rates) in zip((json.loads(line) for line in argv_log.read_text().splitlines()),
                                   [("dense", (16.0,)), ("sparse_bf16", (4.0, 8.0))], strict=True):
        cfg, args = bench.parse_args(argv)
        assert cfg.run_configs == (name,) and tuple(cfg.rates) == rates and cfg.smoke and args.merge
        assert cfg.requests == 2 and args.out == str(plan / "service_h200.json")


def test_group_item_becomes_one_parallel_run(tmp_path):
    """An item of ';'-separated groups is one ``--parallel`` run (the groups one argument), the
    others ``--configs`` runs, in the plan's order; the interpreter here records its arguments."""
    argv_log = tmp_path / "argv.jsonl"
    fake = tmp_path / "fake_python.sh"
    fake.write_text(f"#!/usr/bin/env bash\n{sys.executable} -c 'import json, sys; print(json.dumps(sys.argv[1:]))' "
                    f"\"$@\" >> {argv_log}\n")
    fake.chmod(0o755)
    plan = tmp_path / "plan"
    started = _run("start", str(plan), "sparse_fp8;sparse_bf16_chunk8k:1,16,4", "sparse_bf16_chunk16k:4",
                   "@dense_sjf,dense:1", env={"PYTHON": str(fake), "CELL_OPTS": "--requests 3"})
    assert started.returncode == 0, started.stderr
    polled = _run("poll", str(plan), "30")
    assert "PLAN-DONE" in polled.stdout
    first, second, third = (json.loads(line) for line in argv_log.read_text().splitlines())
    # '@': one group, as --parallel (the plan's CUDA_VISIBLE_DEVICES picks its GPU)
    assert third[third.index("--parallel") + 1] == "dense_sjf,dense" and "--configs" not in third
    assert first[first.index("--parallel") + 1] == "sparse_fp8;sparse_bf16_chunk8k" and "--configs" not in first
    assert first[first.index("--rates") + 1] == "1,16,4" and "--merge" in first
    assert second[second.index("--configs") + 1] == "sparse_bf16_chunk16k" and "--parallel" not in second
    for argv in (first, second):
        assert argv[argv.index("--out") + 1] == str(plan / "service_h200.json")
        assert argv[argv.index("--requests") + 1] == "3" and argv[argv.index("--gpus") + 1] == "1"


def test_poll_reports_group_lines(tmp_path):
    """poll shows a --parallel run's progress: cells and group outcomes behind their [gK] prefix."""
    plan = tmp_path / "plan"
    plan.mkdir()
    (plan / "log").write_text("plan: x\n[g0] [sparse_fp8] rate 1/s: 100 sent\n[g1] noise\n"
                              "[g1] [sparse_bf16_chunk8k] rate 16/s: 100 sent\n[g1] error: exit status 1\n"
                              "[g0] ok\n[dense] error: RuntimeError: boom\nnoise\n[plan] item 1 exit 1\n"
                              "PLAN-DONE\n")
    (plan / "service_h200_parallel").mkdir()
    (plan / "service_h200_parallel" / "group1.json").write_text("{}")
    (plan / "service_h200_ttft_throughput.png").write_bytes(b"png")
    out = tmp_path / "out" / "b1"  # made if missing (one subfolder per plan polled in a call)
    polled = _run("poll", str(plan), "5", env={"OUT": str(out)})
    # a group's partial cells come back; plots do not (the device tool returns at most 8 files)
    assert sorted(p.name for p in out.iterdir()) == ["group1.json", "log"]
    lines = polled.stdout.splitlines()
    assert lines == ["[g0] [sparse_fp8] rate 1/s: 100 sent", "[g1] [sparse_bf16_chunk8k] rate 16/s: 100 sent",
                     "[g1] error: exit status 1", "[g0] ok", "[dense] error: RuntimeError: boom",
                     "[plan] item 1 exit 1", "PLAN-DONE"]
