#!/usr/bin/env bash
# One `device` call for the CTA pair with N = 16 / 32 transposed tiles (the `_pair_w16` kernels,
# forced by DG_MEGA_MOE_CTA_PAIR=1 where the call takes N = 16 tiles; docs/KERNEL.md): its GPU
# tests, the sanitizers on it, then an A/B of the two-warpgroup kernel against the pair at the rows
# of 6 or more tokens per expert, where the heuristic does not pick the pair yet.
#
#   python scripts/prebuild_kernels.py fp8xfp4 fp8xfp8 bf16xbf16     # on the CPU machine
#   run(command="bash scripts/device_pair_wide.sh", carry=[".whl", ".jit_cache"])
#
# Logs in $OUT: tests.log, sanitizer.log, ab.log. PAIR_WIDE_SKIP_TESTS=1 skips the tests and the
# sanitizers (the A/B alone, ~4 min), PAIR_WIDE_SKIP_AB=1 the A/B. The heuristic's rule for the pair at those rows is to be
# written from ab.log (docs/PERF.md).
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
start=$(date +%s)
if [ "${PAIR_WIDE_SKIP_TESTS:-0}" != "1" ]; then
    # the pair's cases (forced _pair_w16 / _pair_w32 and the landed _pair), the CUDA graph and the mid shape
    DG_TESTS_TIMEOUT_S=${DG_TESTS_TIMEOUT_S:-300} bash scripts/device_run.sh tests/test_mega_moe_gpu.py \
        -k "cta_pair or cuda_graph or mid_shape" | tail -5
else
    source scripts/device_setup.sh
fi
export DG_JIT_CACHE_DIR=$PWD/.jit_cache PYTHONPATH=/tmp/site:$PWD
source scripts/pair_ab_rounds.sh
if [ "${PAIR_WIDE_SKIP_TESTS:-0}" != "1" ]; then
    # memcheck: M-blocks of 64 and 36 tokens (two N = 32 passes; an N = 32 pass and a narrow one);
    # racecheck without --error-exitcode (the exit is one_launch's own: its result checked under the
    # tool's timing), M-blocks of ~12 tokens (N = 16) and the 64 / 36 ones
    DG_MEGA_MOE_CTA_PAIR=1 timeout 240 compute-sanitizer --tool memcheck --error-exitcode 9 python3 scripts/one_launch.py \
        --format fp8xfp4 --tokens 100 --experts-allowed 2 > /tmp/san.log 2>&1
    rc=$?
    { echo "=== memcheck pair_w16 [--tokens 100 --experts-allowed 2]: exit $rc"; cat /tmp/san.log; } >> "$OUT/sanitizer.log"
    echo "memcheck pair_w16: exit $rc $(grep -E 'ERROR SUMMARY|calc_diff' /tmp/san.log | tr '\n' ' ')"
    for args in "--tokens 48" "--tokens 100 --experts-allowed 2"; do
        DG_MEGA_MOE_CTA_PAIR=1 timeout 300 compute-sanitizer --tool racecheck python3 scripts/one_launch.py --sms 2 --format fp8xfp4 $args > /tmp/san.log 2>&1
        rc=$?
        { echo "=== racecheck pair_w16 [$args]: exit $rc"; cat /tmp/san.log; } >> "$OUT/sanitizer.log"
        echo "racecheck pair_w16 [$args]: exit $rc (one_launch's) $(grep -E 'RACECHECK SUMMARY|calc_diff' /tmp/san.log | tr '\n' ' ')"
    done
fi
echo "tests and sanitizers took $(( $(date +%s) - start )) s"
[ "${PAIR_WIDE_SKIP_AB:-0}" = "1" ] && exit 0
# A/B, interleaved twice on this GPU: mid n = 96-512 (6-32 tokens per expert), v4-flash n = 256-1024
# (6-24), deepseek-v3 n = 192-512 (6-16)
CASES="fp8xfp4 2048 768 128 8 96 fp8xfp4 2048 768 128 8 128 fp8xfp4 2048 768 128 8 192 fp8xfp4 2048 768 128 8 256
       fp8xfp4 2048 768 128 8 512 fp8xfp4 4096 2048 256 6 256 fp8xfp4 4096 2048 256 6 384 fp8xfp4 4096 2048 256 6 512
       fp8xfp4 4096 2048 256 6 1024 fp8xfp4 7168 2048 256 8 192 fp8xfp4 7168 2048 256 8 256 fp8xfp4 7168 2048 256 8 512"
python3 -c "from scripts.trace import warm_up_gpu; warm_up_gpu()"
pair_ab_rounds "0 1" $CASES
echo "all took $(( $(date +%s) - start )) s"
