"""benchmarks/load_test.py's ``--start`` service, autoscale_scenario.py's entry point and
benchmarks/peers/build_peer_ext.py (the peer's build wrapper), on the CPU.

load_test's response checks live in tests/test_reliability.py (its ``run_load`` against the
shared service) and tests/test_open_loop.py (its HTTP client); here the script itself runs end to
end (slow-marked: a local Ray + Serve). autoscale_scenario's scenario runs in
tests/test_autoscaling.py; here its ``main``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks"), str(ROOT / "benchmarks" / "peers")]

from benchmarks import autoscale_scenario, load_test  # noqa: E402
from service_helpers import free_port  # noqa: E402

import build_peer_ext  # noqa: E402


def test_load_test_serves_the_oracles_model():
    """The oracle decodes with the tiny byte model; ``--start`` must serve that model, not the
    service's default (a real checkpoint), or every response reads as garbled."""
    cfg = load_test.local_config()
    assert cfg.model.model == "builtin:tiny" == load_test.LoadSpec().model
    assert cfg.sparse.alpha == 0.0  # dense, as the oracle


@pytest.mark.slow
def test_load_test_start_end_to_end(tmp_path):
    pytest.importorskip("ray.serve")
    out = tmp_path / "load.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "load_test.py"), "--start",
                           "--requests", "8", "--concurrency", "4", "--http-port", str(free_port()),
                           "--grpc-port", str(free_port()), "--out", str(out)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=540)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rep = json.loads(out.read_text())
    assert rep["sent"] == 8 and rep["ok"] == 8 and rep["lost"] == rep["duplicated"] == rep["garbled"] == 0
    assert set(rep["by_mode"]) == set(load_test.MODES)
    assert "requests sent" in proc.stdout


def test_autoscale_main_runs_the_short_scenario_to_out(tmp_path, monkeypatch, capsys):
    seen = {}

    def fake_run(cfg, *, out):
        seen["cfg"], seen["out"] = cfg, out
        res = autoscale_scenario.Result(config={}, min_replicas={"prefill": 1, "decode": 1},
                                        max_replicas={"prefill": 2, "decode": 2})
        res.phases = [{"name": "idle", "start": 0, "end": 1}]
        res.samples = [{"t": 0, "phase": "idle", "replicas": {"prefill": 1, "decode": 1},
                        "nodes": dict.fromkeys(autoscale_scenario.NODE_TYPES, 1)}]
        res.requests = {"idle": {"sent": 3, "completed": 3 - lost, "lost": lost, "lost_reasons": {}}}
        return res

    monkeypatch.setattr(autoscale_scenario, "run", fake_run)
    lost = 0
    assert autoscale_scenario.main(["--short", "--out", str(tmp_path / "as")]) == 0
    assert seen == {"cfg": autoscale_scenario.SHORT, "out": tmp_path / "as"}
    assert "idle" in capsys.readouterr().out
    lost = 1
    assert autoscale_scenario.main(["--short", "--out", str(tmp_path / "as")]) == 1  # a lost request fails


def test_build_peer_ext_stubs_and_setup_hooks(tmp_path, monkeypatch):
    """The stub libraries carry the sonames the peer's extension links against, and the peer's
    setup.py (a stand-in here) runs with CUDAExtension given the stub directory and link flags."""
    import torch.utils.cpp_extension as ce

    calls = []
    monkeypatch.setattr(ce, "CUDAExtension", lambda name, sources, *a, **kw: calls.append((name, kw)) or kw)
    monkeypatch.setattr(ce, "CUDA_HOME", ce.CUDA_HOME)  # restored after main sets it
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setenv("CUDA_HOME", "/opt/cuda-test")
    monkeypatch.chdir(tmp_path)  # main changes into the ops folder
    ops = tmp_path / "ops"
    ops.mkdir()
    (ops / "setup.py").write_text(
        "import os, sys\n"
        "import torch.utils.cpp_extension as ce\n"
        "ce.CUDAExtension('flashprefill._C', ['x.cu'], library_dirs=['/base'])\n"
        "open('ran.txt', 'w').write(' '.join(sys.argv) + '\\n' + ce.CUDA_HOME)\n")
    build_peer_ext.main([str(ops), str(tmp_path / "lib"), str(tmp_path / "temp")])
    stubs = tmp_path / "temp" / "stubs"
    ((name, kw),) = calls
    assert name == "flashprefill._C" and kw["library_dirs"] == ["/base", str(stubs)]
    assert kw["extra_link_args"] == ["-Wl,--no-as-needed", "-Wl,--strip-all"]
    argv, cuda_home = (ops / "ran.txt").read_text().split("\n")
    words = argv.split()
    assert Path(words[0]) == ops / "setup.py" and words[1] == "build_ext" and str(tmp_path / "lib") in words
    assert cuda_home == "/opt/cuda-test"
    for lib in ("libtorch_cuda.so", "libc10_cuda.so"):
        dyn = subprocess.run(["readelf", "-d", str(stubs / lib)], capture_output=True, text=True, check=True).stdout
        assert f"[{lib}]" in dyn  # the SONAME the extension's DT_NEEDED will name
    syms = subprocess.run(["readelf", "-W", "--dyn-syms", str(stubs / "libtorch_cuda.so")],
                          capture_output=True, text=True, check=True).stdout
    assert "aoti_torch_get_current_cuda_stream" in syms


def test_build_peer_ext_needs_three_paths():
    with pytest.raises(SystemExit, match="usage"):
        build_peer_ext.main(["only-one"])
