"""Run metadata and JSON output shared by the eval benchmarks."""

from __future__ import annotations

import datetime
import json
import platform
import subprocess
from dataclasses import asdict, is_dataclass
from pathlib import Path

import torch

RESULTS_DIR = Path(__file__).resolve().parent.parent / "benchmarks" / "results"


def environment() -> dict:
    """GPU, library versions, UTC date and git commit of the working tree."""
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    import transformers

    try:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True,
            cwd=Path(__file__).resolve().parent,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit = None
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
