#!/usr/bin/env bash
# Run the test suite on CPU: Triton kernels run under the interpreter (TRITON_INTERPRET=1).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export TRITON_INTERPRET=1 PYTHONHASHSEED=0
exec .venv/bin/python -m pytest -q --durations=30 "$@"
