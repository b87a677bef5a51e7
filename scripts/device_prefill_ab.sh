#!/usr/bin/env bash
# Session 36: the prefill changes (the L2 epilogues' row routing loaded before the tile is staged;
# a 32-slot task ring for BLOCK_M = 128 kernels; prefill L2 task counts raised once per warpgroup)
# against main and against variants (ab/<name>.cuh: first call ab/rowinfo.cuh, the routing change
# alone; second call ab/noring.cuh, all but the ring), one `device` call:
#
#   bash scripts/ab_prebuild.sh fp8xfp4 fp8xfp8 bf16xbf16   # ab/*.cuh (CPU machine)
#   run(command="bash scripts/device_prefill_ab.sh", carry=[".whl", ".jit_cache", "ab"])
#
# 1. the GPU suite on the working tree (tests/test_mega_moe_gpu.py, tests/test_faults_gpu.py)
# 2. scripts/ab_run.sh: prefill rows (mid / deepseek-v3 n = 4096, v4-flash n = 8192 FP8, BF16,
#    FP8 x FP4) and decode rows whose L2 epilogues changed, two interleaved rounds
# 3. task-light traces of v4-flash FP8 n = 8192 and mid FP8 n = 4096 on the working tree
# Logs in $OUT: tests.log, ab.log, trace.txt.
set -uo pipefail
OUT=${OUT:-/tmp/out}
AB_TESTS="tests/test_mega_moe_gpu.py tests/test_faults_gpu.py" DG_TESTS_TIMEOUT_S=${DG_TESTS_TIMEOUT_S:-330} bash scripts/ab_run.sh \
    fp8xfp8 2048 768 128 8 4096 fp8xfp8 4096 2048 256 6 8192 bf16xbf16 2048 768 128 8 4096 fp8xfp4 4096 2048 256 6 4096 \
    fp8xfp8 7168 2048 256 8 4096 fp8xfp4 4096 2048 256 6 512 fp8xfp4 2048 768 128 8 128 fp8xfp4 4096 2048 256 6 8 \
    fp8xfp8 2048 768 128 8 1 2>&1 | grep -v "^\s*$" | tail -60
export DG_JIT_CACHE_DIR=$PWD/.jit_cache PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
DG_MEGA_MOE_TASK_LOG=2 timeout 120 python3 scripts/trace.py --tasks-light fp8xfp8 4096 2048 256 6 8192 fp8xfp8 2048 768 128 8 4096 \
    > "$OUT/trace.txt" 2>&1
grep -E "L1 end|L2 end|combine end|loop end|epilogue|gap|per CTA" "$OUT/trace.txt"
