#!/usr/bin/env bash
# bench_peer (issue #38) on the lent GPU machine: the peer built here by
# benchmarks/peers/stage_flashprefillv2.sh (.peer/build) and our CUTLASS library built here
# (`.venv/bin/python -m kernels.cutlass_build --out build/cutlass`, then
# `xz -c build/cutlass/libfp_cutlass.so > .carry/c/libfp_cutlass.so.xz`) travel with the run:
#   run(carry=[".peer/build", ".carry/c"]): bash scripts/gpu_bench_peer.sh [bench_peer args...]
# Results (JSON, full log) land in $OUT; commit them under benchmarks/results/.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
if [ -f .carry/c/libfp_cutlass.so.xz ] && [ -z "${FLASHPREFILL_CUTLASS_LIB:-}" ]; then
  xz -d -c .carry/c/libfp_cutlass.so.xz > /tmp/libfp_cutlass.so && chmod +x /tmp/libfp_cutlass.so
  export FLASHPREFILL_CUTLASS_LIB=/tmp/libfp_cutlass.so
fi
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  git log -1 --format='commit %h' 2>/dev/null; head -3 .peer/build/BUILD_INFO.txt; } | tee "$OUT/env.txt"
python3 benchmarks/bench_peer.py --out "$OUT/peer_h200.json" "$@" 2>&1 | tee "$OUT/peer_h200.log"
exit "${PIPESTATUS[0]}"
