#!/usr/bin/env bash
# Issue #39 on the lent GPU machine: the FP8 GPU tests, the per-op profile of one 128K prefill
# and the TTFT rows, with our CUTLASS library carried prebuilt (see scripts/gpu_bench_peer.sh):
#   run(carry=[".carry/c"]): bash scripts/gpu_ttft.sh [tests] [profile] [profile32k] [attnrange] [ttft] [fused]
# (issue #50: "fused" times the fused ops against their unfused sequences, fraction of roofline;
# "tests" also runs the fused ops' and the prefill host-sync GPU tests)
# Results (JSON, logs) land in $OUT; commit them under benchmarks/results/.
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/gpu_env.sh
steps=("$@"); [ ${#steps[@]} -eq 0 ] && steps=(tests profile ttft)
for step in "${steps[@]}"; do
  case $step in
    tests) python3 -m pytest -q -m gpu tests/test_fp8_linear.py tests/test_profile_prefill.py tests/test_rope_kv.py \
             tests/test_prefill_host_sync.py 2>&1 | tail -15 | tee "$OUT/gpu_tests.log" ;;
    fused) python3 benchmarks/bench_fused_ops.py --tokens 32768 --out "$OUT/fused_ops.json" 2>&1 | tee "$OUT/fused_ops.log" ;;
    profile) python3 benchmarks/profile_prefill.py --length 131072 --weight-dtype bf16,fp8_channel,fp8_block \
               --out "$OUT/profile_prefill_${GPU_TAG}.json" 2>&1 | tee "$OUT/profile_prefill_${GPU_TAG}.log" ;;
    profile32k) python3 benchmarks/profile_prefill.py --length 32768 --weight-dtype bf16,fp8_channel,fp8_block \
               --out "$OUT/profile_prefill_32k_${GPU_TAG}.json" 2>&1 | tee "$OUT/profile_prefill_32k_${GPU_TAG}.log" ;;
    # docs/notes/attention_range_128k.md: what runs inside the index / attention / correction
    # ranges (kernel by kernel), bf16 weights and an FP8 KV pool beside the model-dtype pool
    attnrange) for kv in model fp8_e4m3; do
                 python3 benchmarks/profile_prefill.py --length 131072 --weight-dtype bf16 --kv-dtype $kv \
                   --detail index,attention,correction,q_quant,unannotated --out "$OUT/profile_attnrange_kv_$kv.json" 2>&1 \
                   | tee "$OUT/profile_attnrange_kv_$kv.log"
               done ;;
    ttft) python3 benchmarks/bench_ttft.py --lengths 32768,131072 --batch 1 --models structured --skip-decode \
            --skip-sdpa --weight-dtype bf16,fp8_channel,fp8_block --out "$OUT/ttft_fp8w2_${GPU_TAG}.json" 2>&1 | tee "$OUT/ttft_fp8w2_${GPU_TAG}.log" ;;
    *) echo "unknown step $step"; exit 2 ;;
  esac
done
