#!/usr/bin/env bash
# One planned GPU session on the lent H200: GPU tests, then the benchmarks named as arguments
# (default: all). Logs and JSON go to $OUT/h200.tar.gz (the device tool brings back $OUT).
# Usage on the device: bash scripts/h200_run.sh [tests] [index] [operator] [decode] [...]
# (CUTLASS steps need FLASHPREFILL_CUTLASS_LIB pointing at a library built here and carried:
#  python -m kernels.cutlass_build --out build/cutlass)
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=${PYTHONPATH:-}:$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT" logs
steps=("$@"); [ ${#steps[@]} -gt 0 ] || steps=(tests index operator decode)
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"; } | tee logs/env.txt
run() {  # name, timeout seconds, command...
  local name=$1 limit=$2; shift 2
  echo "=== $name"; local t0=$(date +%s)
  timeout "$limit" "$@" > "logs/$name.log" 2>&1; local rc=$?
  echo "=== $name rc=$rc $(( $(date +%s) - t0 ))s"; tail -n 25 "logs/$name.log"
}
for s in "${steps[@]}"; do
  case $s in
    tests) run gpu_tests 330 python3 -m pytest -m gpu tests/ -q -p no:cacheprovider ;;
    index) run bench_index 60 python3 benchmarks/bench_index.py ;;
    operator) run bench_operator 330 python3 benchmarks/bench_operator.py ;;
    operator_quick) run bench_operator_quick 300 python3 benchmarks/bench_operator.py --quick ;;
    index_sweep) run bench_index_sweep 240 python3 benchmarks/bench_index.py --sweep ;;
    ttft_quick) run bench_ttft_quick 200 python3 benchmarks/bench_ttft.py --quick ;;
    ttft) run bench_ttft 520 python3 benchmarks/bench_ttft.py ;;
    # fused RMSNorm / SiLU MLP off, then on (the default), structured 8B at 32K and 128K, same machine
    ttft_fused) run bench_ttft_unfused 200 python3 benchmarks/bench_ttft.py --quick --models structured --decode-models structured --skip-sdpa \
                  --fused-ops off --out benchmarks/results/ttft_fused_off_h200.json
                run bench_ttft_fused 200 python3 benchmarks/bench_ttft.py --quick --models structured --decode-models structured --skip-sdpa \
                  --fused-ops on --out benchmarks/results/ttft_fused_on_h200.json ;;
    fidelity_quick) run bench_fidelity_quick 90 python3 benchmarks/bench_fidelity.py --quick ;;
    retrieval_quick) run bench_retrieval_quick 110 python3 benchmarks/bench_retrieval.py --trials 12 ;;
    decode) run bench_decode 180 python3 benchmarks/bench_decode.py ;;
    # decode CUDA graphs: their GPU tests, then eager vs graph steps of the structured 8B model
    decode_graphs) run gpu_tests_graphs 200 python3 -m pytest -m gpu tests/test_cuda_graphs.py tests/test_model_runner.py -q -p no:cacheprovider -rfE
                   run bench_decode_graphs 300 python3 benchmarks/bench_decode_graphs.py ;;
    fp8_tests) run gpu_tests_fp8 150 python3 -m pytest -m gpu tests/test_fp8.py tests/test_triton_attention.py -q -p no:cacheprovider -rfE ;;
    cutlass_tests) run gpu_tests_cutlass 300 python3 -m pytest -m gpu tests/test_cutlass_attention.py -q -s -p no:cacheprovider -rfE ;;
    # SANITIZE_K narrows the sanitizer cases (pytest -k), e.g. "sanitizer and persistent"
    cutlass_memcheck) run cutlass_memcheck 200 compute-sanitizer --tool memcheck --error-exitcode 9 python3 -m pytest tests/test_cutlass_attention.py -m gpu -k "${SANITIZE_K:-sanitizer}" -q -p no:cacheprovider ;;
    cutlass_racecheck) run cutlass_racecheck 200 compute-sanitizer --tool racecheck --error-exitcode 9 python3 -m pytest tests/test_cutlass_attention.py -m gpu -k "${SANITIZE_K:-sanitizer}" -q -p no:cacheprovider ;;
    cutlass_synccheck) run cutlass_synccheck 200 compute-sanitizer --tool synccheck --error-exitcode 9 python3 -m pytest tests/test_cutlass_attention.py -m gpu -k "${SANITIZE_K:-sanitizer}" -q -p no:cacheprovider ;;
    cutlass_bench) run bench_cutlass 300 python3 benchmarks/bench_cutlass.py ;;
    # the whole operator with the CUTLASS attention stage beside SDPA, Flex and (staged) FA4
    operator_cutlass) run bench_operator_cutlass 240 python3 benchmarks/bench_operator.py --quick --attention cutlass --cutlass-kernel "${CUTLASS_KERNEL:-ws128}" --merge ;;
    operator_fp8) run bench_operator_fp8 330 python3 benchmarks/bench_operator.py --fp8 --merge --lengths 8192,32768,131072 --batch 1 --no-sweep ;;
    # FP8 rows with the CUTLASS attention stage (token-major V) beside Triton's, bf16 CUTLASS, SDPA
    operator_fp8_cutlass) run bench_operator_fp8_cutlass 400 python3 benchmarks/bench_operator.py --fp8 --quick --attention cutlass --cutlass-kernel "${CUTLASS_KERNEL:-ws128_persistent}" --merge ;;
    fidelity) run bench_fidelity 240 python3 benchmarks/bench_fidelity.py ;;
    structured_density) run bench_structured_density 120 python3 benchmarks/bench_structured_density.py ;;
    *) run "$s" 300 python3 "benchmarks/bench_$s.py" ;;
  esac
done
tar czf "$OUT/h200.tar.gz" logs benchmarks/results
