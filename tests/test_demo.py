"""``python -m kernels demo`` at a tiny size, and its argument errors."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from kernels.__main__ import main

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--seqlen", "2048", "--heads", "4", "--kv-heads", "2", "--head-dim", "32", "--device", "cpu"]


def _run(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    return subprocess.run([sys.executable, "-m", "kernels", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)


def _field(text: str, name: str) -> str:
    match = re.search(rf"^{name}\s+(\S+)", text, flags=re.MULTILINE)
    assert match, f"no '{name}' line in:\n{text}"
    return match.group(1)


def test_demo_prints_the_fields(tmp_path):
    path = tmp_path / "demo.json"
    proc = _run("demo", *TINY, "--json", str(path))
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    density = float(_field(out, "density"))
    assert density == pytest.approx(float(_field(out, "predicted_density")), abs=1e-4)
    assert 0.0 < density <= 1.0
    assert float(_field(out, "needle_recall")) == 1.0
    assert 0.9 < float(_field(out, "retained_mass")) <= 1.0
    for name in ("rel_l2", "max_abs", "rel_l2_no_correction", "max_abs_no_correction",
                 "rel_l2_dtype_floor", "index_ms", "attention_ms", "dense_ms"):
        assert float(_field(out, name)) >= 0.0
    assert "backend reference" in out
    result = json.loads(path.read_text())
    assert result["density"] == pytest.approx(density, abs=1e-4)
    assert result["backend"] == "reference" and result["seqlen"] == 2048


def test_bad_argument_exits_nonzero_with_a_message():
    proc = _run("demo", "--seqlen", "0")
    assert proc.returncode != 0
    assert "--seqlen" in proc.stderr and "positive integer" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize(
    "argv, message",
    [
        ([], "COMMAND"),
        (["demo", "--heads", "6", "--kv-heads", "4"], "multiple of --kv-heads"),
        (["demo", "--alpha", "1.5"], "--alpha"),
        (["demo", "--alpha", "x"], "--alpha"),
        (["demo", "--head-dim", "40", *TINY[:2]], "head_dim"),
        (["demo", "--block-size", "96"], "block_size"),
        (["demo", "--density", "0"], "--density"),
        (["demo", "--backend", "cuda"], "--backend"),
    ],
)
def test_argument_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.skipif(sys.platform == "win32", reason="env handling")
def test_triton_backend_on_cpu_is_a_clear_error(capsys, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(SystemExit) as exc:
        main(["demo", *TINY, "--backend", "triton"])
    assert exc.value.code == 2
    assert "triton" in capsys.readouterr().err
