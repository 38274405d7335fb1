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
    (("stop", "DIR"), "usage"),
])
def test_usage_errors(args, match, tmp_path):
    args = tuple(str(tmp_path / a) if a == "DIR" else a for a in args)
    proc = _run(*args)
    assert proc.returncode == 2 and match in proc.stderr
    assert not (tmp_path / "DIR" / "log").exists()


def test_plan_runs_detached_and_merges_cells(tmp_path):
    pytest.importorskip("ray.serve")
    out = tmp_path / "out"
    out.mkdir()
    env = {"SERVICE_OPTS": "--cpu-smoke", "CELL_OPTS": "--requests 2 --cell-seconds 2 --drain-seconds 60",
           "GIT_COMMIT": "feed123", "TRITON_INTERPRET": "1", "OUT": str(out), "PYTHON": sys.executable}
    plan = tmp_path / "plan"
    started = _run("start", str(plan), "sparse_bf16:4", "sparse_bf16:16", env=env)
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
    result = json.loads((plan / "service_h200.json").read_text())
    (conf,) = result["configurations"]
    # two runs of one configuration, one rate each: the second merged its cell beside the first's
    assert conf["name"] == "sparse_bf16" and [c["rate"] for c in conf["cells"]] == [4.0, 16.0]
    assert all(c["summary"]["completed"] == c["summary"]["sent"] == 2 and c["commit"] == "feed123"
               for c in conf["cells"])
    assert "[sparse_bf16] rate 16/s" in polled.stdout
    assert (out / "service_h200.json").exists() and (out / "log").exists()  # copied for the device tool
