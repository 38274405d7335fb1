#!/usr/bin/env bash
# bench_peer (issue #38) on the lent GPU machine: the peer built here by
# benchmarks/peers/stage_flashprefillv2.sh (.peer/build) and our CUTLASS library built here
# (`.venv/bin/python -m kernels.cutlass_build --out build/cutlass`, then
# `xz -c build/cutlass/libfp_cutlass.so > .carry/c/libfp_cutlass.so.xz`) travel with the run:
#   run(carry=[".peer/build", ".carry/c"]): bash scripts/gpu_bench_peer.sh [bench_peer args...]
# Results (JSON, full log) land in $OUT; commit them under benchmarks/results/.
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/gpu_env.sh
head -3 .peer/build/BUILD_INFO.txt | tee -a "$OUT/env.txt"
python3 benchmarks/bench_peer.py --out "$OUT/peer_h200.json" "$@" 2>&1 | tee "$OUT/peer_h200.log"
exit "${PIPESTATUS[0]}"
