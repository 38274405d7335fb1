"""benchmarks/peers/build_peer_ext.py, the wrapper that runs the peer's setup.py under the CPU
torch wheel: its stub libraries and what it hands the peer's CUDAExtension (a stand-in setup.py;
the real build takes ~25 minutes of nvcc)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "benchmarks" / "peers")]

import build_peer_ext  # noqa: E402


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
