#!/usr/bin/env bash
# Run the test suite on CPU: Triton kernels run under the interpreter (TRITON_INTERPRET=1).
# The serving environment (scripts/setup.sh) plus the test and benchmark tools (the `test` and
# `bench` extras of pyproject.toml), which the service itself does not need.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
export VENV
bash scripts/setup.sh
# pinned as before: import-linter (the layer contracts), grpcio-tools (exactly the stubs'
# generator), nvidia-cutlass (CUTLASS/CuTe headers: CI compiles the CUDA kernel where nvcc exists),
# guidellm (tests/test_lmeval_service.py runs it unmodified; it pins click~=8.4)
# Two pytest-xdist workers (TEST_WORKERS), whole files each (--dist loadfile: a module's apps are
# deployed once, on one worker): most of a service test's wall time is Ray/Serve waiting (replica
# start-up, health checks, drains), which the other worker fills. Files are handed out in the
# collection's order, longest first (tests/module_order.py; --no-loadscope-reorder: xdist would
# order them by their number of tests). TEST_WORKERS=0: one process. After changing the tests,
# `bash scripts/test.sh --record-module-seconds` refreshes the seconds per file (tests/module_seconds.json).
"$VENV/bin/python" -m pip install -q -e ".[test,bench]" "import-linter==2.17" "grpcio-tools==1.85.1" "nvidia-cutlass==4.2.0" "guidellm==0.8.1"
export TRITON_INTERPRET=1 PYTHONHASHSEED=0
workers=${TEST_WORKERS:-2}
parallel=()
[ "$workers" != 0 ] && parallel=(-n "$workers" --dist loadfile --no-loadscope-reorder)
exec "$VENV/bin/python" -m pytest -q --durations=30 "${parallel[@]}" "$@"
