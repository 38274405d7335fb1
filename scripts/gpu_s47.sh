#!/usr/bin/env bash
# Every GPU step that waits (sessions 46-47: #46's calibration rows, #49, #50), one script for one
# warm machine (the device tool's `run`; it stays warm ~30 s after a call, so make the calls back
# to back). Carries (ignored folders, rebuilt on a new checkout as their headers say):
#   .carry/c  our CUTLASS library (scripts/gpu_env.sh)
#   .carry/a, .carry/b  SmolLM2-135M's GGUF in halves, the gguf wheel, the calibration text
#             (scripts/gpu_real_model.sh); a goes to /root/stash first
#   .device-wheels/a, .device-wheels/b  Ray Serve (../shared/device/stage-wheels.sh); a to the stash too
# Calls, in order (each under the 600 s limit of a call):
#   1 run(carry=[".carry/a", ".carry/c"]):  bash scripts/gpu_s47.sh stash tests memplan index
#     (session 48: after the fixes of what step 1 found, `fixes fused` re-runs those tests and the bench)
#   2 run(carry=[".carry/b", ".carry/c"]):  bash scripts/gpu_s47.sh calib
#   3 run(carry=[".carry/b", ".carry/c"]):  bash scripts/gpu_s47.sh densebelow fused ttft
#   4 run(carry=[".device-wheels/a"]):      bash scripts/gpu_s47.sh stashwheels
#   5 run(carry=[".device-wheels/b", ".carry/c"]): bash scripts/gpu_s47.sh served
#   6.. run(carry=[".device-wheels/b", ".carry/c"]): bash scripts/gpu_s47.sh poll   (until the plan's log
#       says it is done: 3 cells x 2 rates x ~250 s), then  bash scripts/gpu_s47.sh ipc
# then, where the peer is staged (benchmarks/peers/stage_flashprefillv2.sh -> .peer/build):
#   run(carry=[".peer/build", ".carry/c"]): bash scripts/gpu_bench_peer.sh --lengths 131072 --varlen '' --page1 131072
# Every step's log and JSON land in $OUT; a step is cut at its own timeout so the others still run.
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/gpu_env.sh
ray_env() {  # Ray Serve from the staged wheels (../shared/device/stage-wheels.sh's last line)
  mkdir -p /tmp/w && cp /root/stash/* .device-wheels/b/* /tmp/w/ 2>/dev/null
  (cd /tmp/w && for p in *.part.aa; do [ -e "$p" ] || continue; w=${p%.part.aa}; cat $w.part.* > $w && rm $w.part.*; done)
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site /tmp/w/*.whl > /dev/null 2>&1
  export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH GIT_COMMIT=$(git rev-parse --short HEAD 2>/dev/null)
}
served() {  # one detached service plan of issue 50's cells (bench_service, 100 requests a cell)
  ray_env
  bash scripts/service_plan.sh start /tmp/plan "sparse_fp8w_served:1,2" "dense_served:1,2" "sparse_bf16_served:1,2" \
    > "$OUT/served_start.log" 2>&1
  bash scripts/service_plan.sh poll /tmp/plan 540
}
for s in "$@"; do
  case $s in
    stash|calib|densebelow) bash scripts/gpu_s46.sh "$s" ;;
    tests) step gpu_tests 240 python3 -m pytest -q -p no:cacheprovider -rfEs -m gpu tests/test_sparse_safeguards.py \
             tests/test_triton_index.py tests/test_cutlass_attention.py tests/test_kv_ipc.py tests/test_rope_kv.py tests/test_prefill_host_sync.py \
             tests/test_fp8_linear.py tests/test_profile_prefill.py tests/test_model_runner.py ;;
    fixes) step gpu_fixes 200 python3 -m pytest -q -p no:cacheprovider -rfEs -m gpu tests/test_memory_plan.py \
             tests/test_prefill_host_sync.py "tests/test_sparse_safeguards.py::test_dense_tile_rows_equal_dense_attention" ;;
    memplan) step memplan 150 python3 -m pytest -q -p no:cacheprovider -rfEs -m gpu tests/test_memory_plan.py ;;
    index) bash scripts/gpu_s46.sh index ;;
    ttft) step ttft 240 bash scripts/gpu_ttft.sh ttft ;;
    fused) step fused 200 bash scripts/gpu_ttft.sh fused ;;
    attnrange) step attnrange 200 bash scripts/gpu_ttft.sh attnrange ;;
    stashwheels) mkdir -p /root/stash && cp .device-wheels/a/* /root/stash/ && ls /root/stash | head ;;
    served) served ;;
    poll) bash scripts/service_plan.sh poll /tmp/plan 560 ;;
    ipc) ray_env; step ipc 200 python3 -m pytest -q -p no:cacheprovider -rfEs -m gpu tests/test_ipc_service.py ;;
    *) echo "unknown step $s"; exit 2 ;;
  esac
done
