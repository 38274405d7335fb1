#!/usr/bin/env bash
# Create .venv with the project's dependencies (CPU build of torch where there is no GPU).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
# torch first and pinned: an unpinned torch would pull a multi-GB CUDA build on a CPU machine.
python -c "import torch" 2>/dev/null || python -m pip install -q torch==2.13.0
python -m pip install -q "triton==3.6.0" "transformers==5.17.0" safetensors "msgpack>=1.0" numpy "pytest>=8" "llguidance==1.9.1" \
  "ray[serve]==2.60.0" "grpcio>=1.85.1" "grpcio-health-checking>=1.85.1" "protobuf>=7.35.1" httpx jsonschema pyyaml hypothesis matplotlib psutil "import-linter==2.17" openai "lm-eval[api]" \
  "nvidia-cutlass==4.2.0"  # CUTLASS/CuTe headers: CI compiles the CUDA kernel where nvcc exists
python -m pip install -q --no-deps -e .
python -c "import torch, triton, transformers; print('setup ok: torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
