# Sourced by the scripts run on the lent GPU machine (gpu_bench_peer.sh, gpu_ttft.sh): $OUT, the
# import path, our CUTLASS library from the carried .carry/c/libfp_cutlass.so.xz (built here:
# `.venv/bin/python -m kernels.cutlass_build --out build/cutlass`, then
# `xz -c build/cutlass/libfp_cutlass.so > .carry/c/libfp_cutlass.so.xz`), and the machine and
# versions into $OUT/env.txt.
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
if [ -f .carry/c/libfp_cutlass.so.xz ] && [ -z "${FLASHPREFILL_CUTLASS_LIB:-}" ]; then
  xz -d -c .carry/c/libfp_cutlass.so.xz > /tmp/libfp_cutlass.so && chmod +x /tmp/libfp_cutlass.so
  export FLASHPREFILL_CUTLASS_LIB=/tmp/libfp_cutlass.so
fi
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
  git log -1 --format='commit %h' 2>/dev/null; } | tee "$OUT/env.txt"

# one step of a GPU script: its log in $OUT/NAME.log, cut at its own timeout so the others still run
step() {  # name, timeout seconds, command...
  local name=$1 limit=$2; shift 2
  echo "=== $name"; local t0=$(date +%s)
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1; local rc=$?
  echo "=== $name rc=$rc $(( $(date +%s) - t0 ))s"; tail -n 25 "$OUT/$name.log"
}
# the card's tag for result names (h100, h200; "gpu" otherwise)
GPU_TAG=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 | grep -o -i -m1 'h100\|h200' | tr 'A-Z' 'a-z')
GPU_TAG=${GPU_TAG:-gpu}
