"""The layer contracts of pyproject.toml ([tool.importlinter]) hold, and they catch a wrong import.

Imports go one way: router > prefill_worker | decode_worker > serving > kv_transfer >
model_executor > kv_cache > kernels; the product never imports evals; kv_cache, model_executor
and kernels never import Ray; no package's modules import each other in a cycle.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("importlinter")

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("router", "prefill_worker", "decode_worker", "serving", "kv_transfer", "model_executor", "kv_cache", "kernels",
            "evals")
LINT = "import sys; from importlinter.cli import lint_imports_command; sys.argv[0] = 'lint-imports'; lint_imports_command()"


def _lint(root: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(root)}
    return subprocess.run([sys.executable, "-c", LINT, "--no-cache", "--no-logo", str(root / "pyproject.toml")],
                          cwd=root, env=env, capture_output=True, text=True, timeout=300)


def _copy_tree(dst: Path) -> None:
    shutil.copy(ROOT / "pyproject.toml", dst / "pyproject.toml")
    for pkg in PACKAGES:
        shutil.copytree(ROOT / pkg, dst / pkg, ignore=shutil.ignore_patterns("__pycache__", "*.so", "csrc"))


def test_the_tree_keeps_every_contract():
    out = _lint(ROOT)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "Contracts: 5 kept, 0 broken." in out.stdout


@pytest.mark.parametrize(
    "module, line, contract",
    [
        ("kv_transfer/registry.py", "import serving.config", "Product layers"),  # upward
        ("model_executor/runner.py", "import kv_transfer.transfer", "Product layers"),  # the KV seam, upward
        ("kv_cache/pool.py", "import model_executor.runner", "Product layers"),
        ("prefill_worker/engine.py", "import decode_worker.engine", "Product layers"),  # sideways
        ("model_executor/sampling.py", "import evals.density", "never imports the evaluations"),
        ("kernels/config.py", "import ray", "nothing imports Ray"),
        ("kv_cache/manager.py", "import ray", "nothing imports Ray"),
        ("serving/costs.py", "import serving.config", "No import cycles"),
        ("router/pipeline.py", "import prefill_worker.engine", "ingress does not import the worker engines"),
        ("router/render.py", "from decode_worker.engine import DecodeEngine", "ingress does not import the worker engines"),
    ],
)
def test_a_wrong_import_breaks_its_contract(tmp_path, module, line, contract):
    _copy_tree(tmp_path)
    target = tmp_path / module
    if contract == "No import cycles":  # close a circle: config -> costs, costs -> config
        cfg = tmp_path / "serving/config.py"
        cfg.write_text(cfg.read_text() + "\nimport serving.costs  # noqa\n")
    target.write_text(target.read_text() + f"\n{line}  # noqa\n")
    out = _lint(tmp_path)
    assert out.returncode != 0
    broken = out.stdout.split("Broken contracts", 1)[-1]
    assert contract in broken, out.stdout
    if contract == "No import cycles":
        assert "No cycles are allowed in serving." in broken and ".costs -> .config" in broken, out.stdout
    else:
        assert module.replace("/", ".")[:-3] in broken, out.stdout
