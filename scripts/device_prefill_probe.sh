#!/usr/bin/env bash
# Session 36: where a prefill call's time goes (FP8 x FP8, BLOCK_M = 128), one `device` call.
#
#   run(command="bash scripts/device_prefill_probe.sh", carry=[".whl", ".jit_cache"])
#
# 1. task-light traces (DG_MEGA_MOE_TASK_LOG=2 kernels, prebuilt: `DG_MEGA_MOE_TASK_LOG=2 python
#    scripts/prebuild_kernels.py fp8xfp8`) of v4-flash n = 8192 and mid n = 4096: per task, K-loop
#    and epilogue spans, gaps between tasks, a CTA's budget
# 2. Nsight Compute (scripts/device_ncu.sh) of v4-flash FP8 n = 4096: stall samples per SASS
#    instruction of the 128-row L1 / L2 loops
# 3. on an H200 only: the H200 checks session 35 left (the CTA pair rule's own pick in the GPU
#    tests, racecheck of the pair-wide case three times)
# Logs in $OUT: trace.txt, fp8xfp8_4096_4096.txt, racecheck.log.
set -uo pipefail
source scripts/device_setup.sh
source scripts/pair_ab_rounds.sh
cat "$OUT/gpu.txt"
start=$(date +%s)
DG_MEGA_MOE_TASK_LOG=2 timeout 200 python3 scripts/trace.py --tasks-light fp8xfp8 4096 2048 256 6 8192 fp8xfp8 2048 768 128 8 4096 \
    > "$OUT/trace.txt" 2>&1
echo "trace exit $? after $(( $(date +%s) - start )) s"
grep -E "L1 |L2 |per CTA|gap" "$OUT/trace.txt" | grep -E "loop end|epilogue|1st stage|task |per CTA|gap" | head -40
DG_NCU_TIMEOUT_S=200 bash scripts/device_ncu.sh fp8xfp8 4096 2048 256 6 4096 2>&1 | tail -25
echo "ncu done after $(( $(date +%s) - start )) s"
if grep -q H200 "$OUT/gpu.txt"; then
    timeout -k 10 150 python3 -m pytest -q -x -p no:cacheprovider tests/test_mega_moe_gpu.py -k "cta_pair" 2>&1 | tee "$OUT/tests.log" | tail -3
    pair_racecheck_w16 3
fi
echo "all took $(( $(date +%s) - start )) s"
