#!/usr/bin/env bash
# Build the paper's own operator (qhfan/FlashPrefillv2, Apache-2.0 on FA3's BSD code) on the CPU
# machine for the H200, as a baseline for benchmarks/bench_peer.py. Not part of the product.
#
# Usage, from the project root:
#   benchmarks/peers/stage_flashprefillv2.sh SRC            # SRC: the fetched repository, either
#       a bare git dir (the search tool's `fetch github:qhfan/FlashPrefillv2` gives
#       /work/.mirror/qhfan+FlashPrefillv2/repo) or an unpacked source tree. Nothing is downloaded.
# Result: .peer/build/ (ignored through .git/info/exclude), carried by a device run:
#   .peer/build/flashprefill/{__init__,prefill,flash_attn_interface,flash_attn_config,...}.py
#   .peer/build/flashprefill/_C.abi3.so      (sm_90a SASS, stable torch ABI >= 2.9, abi3)
#   .peer/build/flash_block_sparse_index_triton.py, flash_attn_config.py
#   .peer/build/BUILD_INFO.txt               (commit, flags, sizes), .peer/build.log (full log,
#                                             with nvcc --resource-usage register/spill lines)
# Flags: install_ops.sh's (forward only, no split/appendkv/local/softcap/sm80, no hdim 64/96/192)
# plus fp16, hdim 256 and the hdim-diff variants off: hdim 128 in bf16 and e4m3, each plain,
# PackGQA and paged (6 kernels) + the API (stable ABI) + the scheduler. MAX_JOBS=2 for 2 cores and
# 24 GB (one FA3 unit peaks at ~4-6 GB). Takes 30-60 minutes on 2 cores; run it detached:
#   setsid nohup benchmarks/peers/stage_flashprefillv2.sh SRC > .peer/stage.log 2>&1 &
# The local torch may be the CPU wheel: build_peer_ext.py supplies CUDA_HOME and link stubs.
set -euo pipefail
src=${1:?usage: stage_flashprefillv2.sh SRC (bare git dir or source tree)}
root=$(git rev-parse --show-toplevel); cd "$root"
py=${PYTHON:-$root/.venv/bin/python}
peer=$root/.peer; out=$peer/build; work=$peer/work; tmp=$peer/tmp
grep -qx '/.peer/' .git/info/exclude 2>/dev/null || echo '/.peer/' >> .git/info/exclude
rm -rf "$work" "$out"; mkdir -p "$work" "$out" "$tmp"
if git --git-dir="$src" rev-parse HEAD >/dev/null 2>&1; then
  commit=$(git --git-dir="$src" rev-parse HEAD); git --git-dir="$src" archive HEAD | tar -x -C "$work"
else
  commit=$(git -C "$src" rev-parse HEAD 2>/dev/null || echo unknown); cp -a "$src"/. "$work"/
fi
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}; export PATH=$CUDA_HOME/bin:$PATH
export FLASH_ATTENTION_FORCE_BUILD=TRUE FLASH_ATTENTION_OFFLINE_BUILD=TRUE
export FLASH_ATTENTION_DISABLE_BACKWARD=TRUE FLASH_ATTENTION_DISABLE_SPLIT=TRUE
export FLASH_ATTENTION_DISABLE_APPENDKV=TRUE FLASH_ATTENTION_DISABLE_LOCAL=TRUE
export FLASH_ATTENTION_DISABLE_SOFTCAP=TRUE FLASH_ATTENTION_DISABLE_SM80=TRUE
export FLASH_ATTENTION_DISABLE_HDIM64=TRUE FLASH_ATTENTION_DISABLE_HDIM96=TRUE
export FLASH_ATTENTION_DISABLE_HDIM192=TRUE
# beyond install_ops.sh: only what the comparison uses (hdim 128, bf16 + e4m3)
export FLASH_ATTENTION_DISABLE_FP16=TRUE FLASH_ATTENTION_DISABLE_HDIM256=TRUE
export FLASH_ATTENTION_DISABLE_HDIMDIFF64=TRUE FLASH_ATTENTION_DISABLE_HDIMDIFF192=TRUE
export MAX_JOBS=${MAX_JOBS:-2} NVCC_THREADS=${NVCC_THREADS:-1}
t0=$(date +%s)
"$py" "$root/benchmarks/peers/build_peer_ext.py" "$work/flashprefill_ops" "$out" "$tmp" 2>&1 | tee "$peer/build.log"
ops=$work/flashprefill_ops
so=$(ls "$out"/flashprefill/_C*.so)
cp "$ops"/flashprefill/*.py "$out/flashprefill/"
cp "$ops"/flash_attn_config.py "$ops"/flashprefill/flash_attn_config.py "$out/" 2>/dev/null || true
cp "$ops"/flash_attn_config.py "$out/flashprefill/flash_attn_config.py"  # the config this build wrote
cp "$ops"/flash_block_sparse_index_triton.py "$out/"
cp "$work/LICENSE" "$out/LICENSE.peer"
{
  echo "repository: qhfan/FlashPrefillv2 commit $commit"
  echo "built: $(date -u +%FT%TZ) in $(( $(date +%s) - t0 )) s, MAX_JOBS=$MAX_JOBS NVCC_THREADS=$NVCC_THREADS"
  echo "nvcc: $(nvcc --version | tail -1)"; echo "local torch: $("$py" -c 'import torch; print(torch.__version__)')"
  env | grep '^FLASH_ATTENTION_' | sort
  echo "sizes:"; du -b "$so"; du -sb "$out"
  echo "DT_NEEDED:"; readelf -d "$so" | grep NEEDED
  echo "SASS targets:"; cuobjdump --list-elf "$so" 2>/dev/null | sed 's/.*\.//' | sort | uniq -c || true
  echo "undefined dynamic symbols not from libc/libstdc++/cudart:"
  nm -D --undefined-only "$so" | grep -v -E '@(GLIBC|GLIBCXX|CXXABI|GCC|libcudart)' | awk '{print $2}' | sort | head -80
} > "$out/BUILD_INFO.txt"
grep -E 'registers|spill|Function properties' "$peer/build.log" > "$out/resource_usage.txt" || true
cat "$out/BUILD_INFO.txt"
echo "done: $out ($(du -sh "$out" | cut -f1)); carry .peer/build in the device run"
