"""scripts/service_plan.sh: a detached bench_service plan merged into one file, and its poll
(usage errors; one tiny CPU cell end to end with a real local Ray)."""

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


def test_plan_runs_detached_and_polls(tmp_path):
    """One real item (two rates: two cells of one deployment) end to end: detached, logged with
    its exit status, polled, copied to $OUT. That every item merges into one file is the items'
    argv (test_group_item_becomes_one_parallel_run) and bench_service's --merge (its tests)."""
    pytest.importorskip("ray.serve")
    out = tmp_path / "out"
    out.mkdir()
    env = {"SERVICE_OPTS": "--cpu-smoke", "CELL_OPTS": "--requests 2 --cell-seconds 2 --drain-seconds 60",
           "GIT_COMMIT": "feed123", "TRITON_INTERPRET": "1", "OUT": str(out), "PYTHON": sys.executable}
    plan = tmp_path / "plan"
    started = _run("start", str(plan), "sparse_bf16:4,16", env=env)
    assert started.returncode == 0, started.stderr
    session = int(re.search(r"session (\d+)", started.stdout).group(1))
    try:
        polled = _run("poll", str(plan), "240", env=env, timeout=300)
        assert "PLAN-DONE" in polled.stdout, polled.stdout + (plan / "log").read_text()[-3000:]
    finally:
        try:
            os.killpg(session, signal.SIGTERM)  # nothing left when it finished; a stuck plan must not outlive us
        except ProcessLookupError:
            pass
    log = (plan / "log").read_text()
    # each item's exit status is logged and shown by poll, in the plan's order
    assert re.findall(r"^\[plan\] item \d+ exit \d+$", log, re.M) == ["[plan] item 1 exit 0"], log[-6000:]
    assert "[plan] item 1 exit 0" in polled.stdout
    result = json.loads((plan / "service_h200.json").read_text())
    (conf,) = result["configurations"]
    # one configuration, a cell a rate in the order given
    assert conf["name"] == "sparse_bf16" and [c["rate"] for c in conf["cells"]] == [4.0, 16.0], log[-6000:]
    assert all(c["summary"]["completed"] == c["summary"]["sent"] == 2 and c["commit"] == "feed123"
               for c in conf["cells"])
    assert "[sparse_bf16] rate 16/s" in polled.stdout
    assert (out / "service_h200.json").exists() and (out / "log").exists()  # copied for the device tool


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
