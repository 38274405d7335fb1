"""Run metadata and JSON output shared by the eval benchmarks."""

from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
from dataclasses import asdict, is_dataclass
from pathlib import Path

import torch

RESULTS_DIR = Path(__file__).resolve().parent.parent / "benchmarks" / "results"


def git_commit() -> str:
    """The commit a benchmark or evaluation ran: ``GIT_COMMIT`` when set (whoever ships the tree
    to a GPU host sets it; the copy there has no git state of its own), else the checkout's HEAD,
    with ``-dirty`` when tracked files differ from it."""
    if os.environ.get("GIT_COMMIT"):
        return os.environ["GIT_COMMIT"]
    root = Path(__file__).resolve().parent.parent
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True,
                              timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, timeout=10, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown (no git checkout, GIT_COMMIT unset)"
    return head + ("-dirty" if dirty else "")


def environment() -> dict:
    """GPU, library versions, UTC date and git commit of the working tree."""
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    import transformers

    commit = git_commit()
    return {
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "cpu": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "triton": triton_version,
        "transformers": transformers.__version__,
        "cuda": torch.version.cuda,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "git_commit": commit,
    }


def write_json(name: str, payload: dict) -> Path:
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = RESULTS_DIR / name

    def default(obj):
        if is_dataclass(obj):
            return asdict(obj)
        raise TypeError(f"not JSON serialisable: {type(obj).__name__}")

    path.write_text(json.dumps(payload, indent=2, default=default) + "\n")
    return path
