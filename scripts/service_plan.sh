#!/usr/bin/env bash
# Run bench_service cells on a GPU host as one detached plan that outlives the shell that started
# it (a session of its own), merging every cell into one results file, and poll it.
#
#   bash scripts/service_plan.sh start DIR "sparse_fp8:1,16,4" "sparse_bf16_chunk8k:1,16,4" ...
#   bash scripts/service_plan.sh poll DIR [SECONDS]   # wait up to SECONDS (default 540) or until done
#
# Each "config:rates" item is one `bench_service.py --configs config --rates rates --merge` run
# into DIR/service_h200.json, in order (the log gets "[plan] item K exit STATUS" after each); an item whose configurations are ';'-separated groups
# ("sparse_fp8;sparse_bf16_chunk8k:1,16,4") is one `--parallel` run instead, group k on GPU k,
# and an item led by '@' ("@sparse_bf16_chunk16k:4,16") a one-group `--parallel` run: with
# CUDA_VISIBLE_DEVICES=1 in the plan's environment it runs on GPU 1 with a Ray of its own, so two
# plans (two DIRs) can share a host; `bench_service.py --plot-only --merge-from` joins their files.
# 100 requests a cell, drained (cells end when their
# last request finishes; a request is cut only 450 s after the 150 s sending window: $CELL_OPTS
# replaces those four options). Extra bench_service options go in $SERVICE_OPTS (e.g. "--gpus 2"). DIR/log has every run's output;
# `poll` prints the progress lines and, where $OUT is set, copies the JSON files and log there.
# Needs Ray importable (`../shared/device/stage-wheels.sh "ray[serve]==2.60.0" grpcio-reflection==1.84.0
# grpcio-health-checking==1.84.0`: the proxies load our gRPC health service) and, for the CUTLASS attention
# stage, FLASHPREFILL_CUTLASS_LIB; GIT_COMMIT names the commit in the records; $PYTHON the
# interpreter (default python3).
set -uo pipefail
cd "$(dirname "$0")/.."
cmd=${1:-}; dir=${2:-}
[ -n "$cmd" ] && [ -n "$dir" ] || { echo "usage: $0 start DIR config:rates... | poll DIR [SECONDS]" >&2; exit 2; }
case $cmd in
  start)
    shift 2
    [ $# -gt 0 ] || { echo "start: name at least one config:rates item" >&2; exit 2; }
    mkdir -p "$dir"
    common="--gpus 1 ${CELL_OPTS:---requests 100 --cell-seconds 150 --drain-seconds 450 --request-timeout 600} ${SERVICE_OPTS:-}"
    plan=""
    for item in "$@"; do
      configs=${item%%:*}; rates=${item#*:}
      [[ $item == *:* && -n ${configs#@} && -n $rates ]] || { echo "start: expected config:rates, got '$item'" >&2; exit 2; }
      case $configs in
        @*) select="--parallel $(printf %q "${configs#@}")" ;;
        *\;*) select="--parallel $(printf %q "$configs")" ;;
        *) select="--configs $configs" ;;
      esac
      n=$(( ${n:-0} + 1 ))
      plan+="${PYTHON:-python3} benchmarks/bench_service.py $common --out $dir/service_h200.json --merge"
      plan+=" $select --rates $rates; echo \"[plan] item $n exit \$?\"; "
    done
    echo "plan: $plan" > "$dir/log"
    PYTHONPATH=${PYTHONPATH:-}:$PWD PYTHONUNBUFFERED=1 setsid nohup bash -c "$plan echo PLAN-DONE" >> "$dir/log" 2>&1 < /dev/null &
    echo "started plan (session $!): $dir/log"
    ;;
  poll)
    limit=${3:-540}; t0=$(date +%s)
    while ! grep -q PLAN-DONE "$dir/log" 2>/dev/null && [ $(( $(date +%s) - t0 )) -lt "$limit" ]; do sleep 5; done
    grep -E '^(\[g[0-9]+\] )?(\[[a-z0-9_]+\] (rate|deployed|prefill attention|error|skipped)|wrote)|^\[g[0-9]+\] (ok|error|killed)|^\[plan\] item|Traceback|Error' "$dir/log" | tail -n 40
    grep -q PLAN-DONE "$dir/log" && echo "PLAN-DONE" || echo "still running after ${limit}s"
    # with the --parallel groups' partial results (written after every cell; the merged file
    # gets a group's cells only when the group ends), so a machine lost mid-run loses no cell;
    # no plots (`--plot-only` redraws them): the device tool brings back at most 8 files a call
    if [ -n "${OUT:-}" ]; then mkdir -p "$OUT" && cp "$dir"/service_h200*.json "$dir"/*_parallel/group*.json "$dir/log" "$OUT"/ 2>/dev/null; fi
    ;;
  *) echo "usage: $0 start DIR config:rates... | poll DIR [SECONDS]" >&2; exit 2 ;;
esac
