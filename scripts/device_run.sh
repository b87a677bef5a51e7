#!/usr/bin/env bash
# One `device` call on the H200: install the carried wheels, build deep_gemm._C for the device's
# Python, run the GPU tests and a short benchmark, leave logs under $OUT.
#
#   run(command="bash scripts/device_run.sh [pytest args...]", carry=[".whl", ".jit_cache"])
#   DG_TESTS_TIMEOUT_S: the tests' hard limit (default 420 s; exit 124 when it hits)
#   DG_RUN_BENCH=1: then `python -m deep_gemm.bench --quick`; =full: the benchmark of record (every
#   shape, format and token count, 30 replays: ~45 s on a warm H100, so it fits the call after the
#   ~230 s suite); json, png and log under $OUT
#   DG_RUN_OPERAND_PROBE=1: then scripts/device_operand_probe.sh (~1 minute; $OUT/operand_probe.txt)
#   DG_RUN_HOST_OVERHEAD=1: then scripts/host_overhead.py (host us per eager call; $OUT/host_overhead.txt)
#   DG_RUN_WS_AB=1: then the weights-first kernel against the persistent one at n = 1 (scripts/time_fused.py,
#   two rounds interleaved: FP8 x FP4 forms 7 and 6, FP8 x FP8 forms 7 and 6, the persistent kernel;
#   $OUT/ws_ab.txt), and memcheck on the weights-first kernels (FP8 x FP4 and FP8 x FP8, one token)
#   DG_RUN_WS_STAGE=1: then the FP8 x FP4 weights-first kernel's stage count (6 against 8: a CTA's bytes in
#   flight) and plan forms 7 / 6 against the persistent kernel at n = 1 of the three shapes (two rounds),
#   deepseek-v3 / mid n = 1 under each flush, the weights-first traces (--cold) at 6 and 8 stages,
#   memcheck ($OUT/ws_stage.txt; docs/PERF.md sessions 52-53)
#   DG_RUN_WS_FORMS=1: then the weights-first plan forms 7 / 5 / 3 / 1 against the persistent kernel at v4-flash and
#   deepseek-v3 n = 1, FP8 x FP4 and FP8 x FP8, two rounds, and a form-5 trace ($OUT/ws_forms.txt; PERF.md session 53)
#   DG_RUN_WS_STAGE_LOG=1: then the weights-first stage log (trace.py --tasks) at deepseek-v3 n = 1, both FP8
#   formats, and mid FP8 x FP8 n = 1: per unit of a CTA's first L1 / L2 chunk, issue, arrival, release
#   ($OUT/ws_stage_log.txt)
#   DG_RUN_WS_LEAD=1: then the weights-first kernel's L2 lead (DG_MEGA_MOE_WS_L2_LEAD: L2 weight loads once
#   every L1 chunk has at most that many units left to issue) 0 / 4 / 8 / 16 against the persistent kernel,
#   mid FP8 x FP8 / BF16 and v4-flash FP8 x FP8 n = 1, two rounds (DG_WS_LEADS / DG_WS_LEAD_CASES: others),
#   then the stage log of mid FP8 x FP8 at the first lead after 0 ($OUT/ws_lead.txt)
#
# .whl holds nvidia-cutlass (CuTe headers); .jit_cache holds kernels compiled on the CPU machine
# (`python scripts/prebuild_kernels.py`), so nvcc time is not spent on device time.
set -uo pipefail
source scripts/device_setup.sh
start=$(date +%s)
# A hard limit around pytest: `--timeout` cannot end a test whose kernel hangs (its Python thread sits
# in a CUDA synchronize), which would spend the whole device call (docs/PERF.md, session 13)
timeout -k 10 "${DG_TESTS_TIMEOUT_S:-420}" python3 -m pytest -q -x -p no:cacheprovider --timeout=300 "${@:-tests}" 2>&1 \
    | tee "$OUT/tests.log" | tail -40
status=${PIPESTATUS[0]}
echo "tests took $(( $(date +%s) - start )) s, exit $status"
if [ "${DG_RUN_SANITIZER:-0}" = "1" ]; then
    # memcheck: a normal call and one with out-of-range expert ids; racecheck: shared memory races
    # (one log file: the device returns at most 8 files)
    # (--tokens 8: narrow decode tiles; the default 48 tokens: wide ones; --tokens 1024: prefill
    # tiles, the count in slices and the bulk combine)
    for args in "" "--bad-ids" "--ranks 2" "--format fp8xfp4" "--tokens 8" "--tokens 8 --format bf16xbf16 --ranks 2" \
                "--tokens 1024 --bad-ids" "--tokens 1024 --format bf16xbf16 --ranks 2"; do
        timeout 240 compute-sanitizer --tool memcheck --error-exitcode 9 python3 scripts/one_launch.py $args > /tmp/san.log 2>&1
        rc=$?
        { echo "=== memcheck [$args]: exit $rc"; cat /tmp/san.log; } >> "$OUT/sanitizer.log"
        echo "memcheck [$args]: exit $rc $(grep -E 'ERROR SUMMARY|calc_diff' /tmp/san.log | tr '\n' ' ')"
        [ $rc = 0 ] || grep -m 40 -E '=========' /tmp/san.log
    done
    # narrow tiles (8 tokens) of both FP8 formats; wide FP8 x FP4 tiles (48 tokens: the stmatrix expansion)
    for args in "--tokens 8 --format fp8xfp8" "--tokens 8 --format fp8xfp4" "--tokens 48 --format fp8xfp4"; do
        timeout 300 compute-sanitizer --tool racecheck --error-exitcode 9 python3 scripts/one_launch.py --sms 2 $args > /tmp/san.log 2>&1
        rc=$?
        { echo "=== racecheck [$args]: exit $rc"; cat /tmp/san.log; } >> "$OUT/sanitizer.log"
        echo "racecheck [$args]: exit $rc $(grep -E 'RACECHECK SUMMARY|ERROR SUMMARY|calc_diff' /tmp/san.log | tr '\n' ' ')"
        [ $rc = 0 ] || grep -m 12 -E '=========' /tmp/san.log
    done
    # The CTA pair (FP8 x FP4 decode, 2 stages: a stage is refilled soon after its release), forced:
    # memcheck with M-blocks of 64 and 36 tokens (8 and 5 token passes); racecheck without
    # --error-exitcode, so that the exit is one_launch's own: the result checked under the tool's
    # timing (session 33: scales read after a stage's release gave calc_diff 6.7e-03 there, right
    # natively), the hazards listed as above
    DG_MEGA_MOE_CTA_PAIR=1 timeout 240 compute-sanitizer --tool memcheck --error-exitcode 9 python3 scripts/one_launch.py \
        --format fp8xfp4 --tokens 100 --experts-allowed 2 > /tmp/san.log 2>&1
    rc=$?
    { echo "=== memcheck pair [--tokens 100 --experts-allowed 2]: exit $rc"; cat /tmp/san.log; } >> "$OUT/sanitizer.log"
    echo "memcheck pair: exit $rc $(grep -E 'ERROR SUMMARY|calc_diff' /tmp/san.log | tr '\n' ' ')"
    for args in "--tokens 8" "--tokens 20"; do
        DG_MEGA_MOE_CTA_PAIR=1 timeout 300 compute-sanitizer --tool racecheck python3 scripts/one_launch.py --sms 2 --format fp8xfp4 $args > /tmp/san.log 2>&1
        rc=$?
        { echo "=== racecheck pair [$args]: exit $rc"; cat /tmp/san.log; } >> "$OUT/sanitizer.log"
        echo "racecheck pair [$args]: exit $rc (one_launch's) $(grep -E 'RACECHECK SUMMARY|calc_diff' /tmp/san.log | tr '\n' ' ')"
    done
    # The tool's own model of two correct patterns the kernel uses (scripts/racecheck_probe.cu)
    if nvcc -arch=sm_90a -o /tmp/racecheck_probe scripts/racecheck_probe.cu > /dev/null 2>&1; then
        for probe in exchange bulk cpasync; do
            echo "racecheck probe $probe: $(compute-sanitizer --tool racecheck /tmp/racecheck_probe $probe 2>&1 | grep -E 'RACECHECK SUMMARY|probe' | tr '\n' ' ')"
        done
    fi
fi
case "${DG_RUN_BENCH:-0}" in
    1) python3 -m deep_gemm.bench --quick --json "$OUT/bench.json" --plot "$OUT/bench.png" 2>&1 | tee "$OUT/bench.log" | tail -40 ;;
    full) python3 -m deep_gemm.bench --reps 30 --json "$OUT/bench.json" --plot "$OUT/bench.png" 2>&1 | tee "$OUT/bench.log" | tail -75 ;;
    0) ;;
    *) echo "DG_RUN_BENCH=${DG_RUN_BENCH}: expected 0, 1 (quick) or full" ;;
esac
if [ "${DG_RUN_HOST_OVERHEAD:-0}" = "1" ]; then
    timeout -k 5 120 python3 scripts/host_overhead.py 2>&1 | tee "$OUT/host_overhead.txt" | tail -8
fi
# Two rounds, interleaved: each configuration (VAR=value settings joined by commas) times the cases
# (scripts/time_fused.py: fmt hidden inter experts topk n ...)
ab_rounds() {   # ab_rounds "<cases>" config...
    local cases=$1 round cfg
    shift
    for round in 1 2; do
        for cfg in "$@"; do
            echo "=== round $round: ${cfg//,/ }"
            env ${cfg//,/ } timeout -k 5 120 python3 scripts/time_fused.py $cases 2>&1 | grep " us$"
        done
    done
}
# memcheck on the weights-first kernel of a format, mid shape, one token, 16 CTAs
ws_memcheck() {   # ws_memcheck fmt
    DG_MEGA_MOE_WEIGHTS_FIRST=1 timeout 240 compute-sanitizer --tool memcheck --error-exitcode 9 python3 scripts/one_launch.py \
        --format "$1" --tokens 1 --shape mid --sms 16 > /tmp/san.log 2>&1
    echo "memcheck weights-first [$1, one token, mid]: exit $? $(grep -E 'ERROR SUMMARY|calc_diff' /tmp/san.log | tr '\n' ' ')"
}
if [ "${DG_RUN_WS_AB:-0}" = "1" ]; then
    {
        ab_rounds "fp8xfp4 2048 768 128 8 1 fp8xfp4 4096 2048 256 6 1 fp8xfp4 7168 2048 256 8 1 fp8xfp8 2048 768 128 8 1 fp8xfp8 4096 2048 256 6 1" \
            DG_MEGA_MOE_WEIGHTS_FIRST=1,DG_MEGA_MOE_WS_PLAN=7 DG_MEGA_MOE_WEIGHTS_FIRST=1,DG_MEGA_MOE_WS_PLAN=6 DG_MEGA_MOE_WEIGHTS_FIRST=0
        ws_memcheck fp8xfp4
        ws_memcheck fp8xfp8
    } 2>&1 | tee "$OUT/ws_ab.txt"
fi
if [ "${DG_RUN_WS_STAGE:-0}" = "1" ]; then
    {
        # FP8 x FP4 weights-first at 6 and 8 stages (its bytes in flight a CTA; session 53 ran 8 and 11 while
        # the cap was 12), plan forms 7 and 6, against the persistent kernel, n = 1 of the three shapes
        ab_rounds "fp8xfp4 2048 768 128 8 1 fp8xfp4 4096 2048 256 6 1 fp8xfp4 7168 2048 256 8 1" \
            $(for v in 7,6 7,8 6,6 6,8; do echo "DG_MEGA_MOE_WEIGHTS_FIRST=1,DG_MEGA_MOE_WS_PLAN=${v%,*},DG_MEGA_MOE_WS_STAGES=${v#*,}"; done) \
            DG_MEGA_MOE_WEIGHTS_FIRST=0
        # Does the write flush's writeback set the pace? deepseek-v3 and mid n = 1 under each flush
        for flush in write read none; do
            for ws in 1 0; do
                echo "=== flush $flush, DG_MEGA_MOE_WEIGHTS_FIRST=$ws"
                DG_MEGA_MOE_WEIGHTS_FIRST=$ws timeout -k 5 90 python3 scripts/time_fused.py --floor --flush $flush \
                    fp8xfp4 7168 2048 256 8 1 fp8xfp8 7168 2048 256 8 1 fp8xfp8 2048 768 128 8 1 2>&1 | tail -4
            done
        done
        for st in 6 8; do
            echo "=== trace, weights-first, fp8xfp4 deepseek-v3 n = 1, $st stages"
            DG_MEGA_MOE_WEIGHTS_FIRST=1 DG_MEGA_MOE_WS_STAGES=$st timeout -k 5 90 python3 scripts/trace.py --cold fp8xfp4 7168 2048 256 8 1 2>&1 | tail -30
        done
        ws_memcheck fp8xfp4
    } 2>&1 | tee "$OUT/ws_stage.txt"
fi
if [ "${DG_RUN_WS_FORMS:-0}" = "1" ]; then
    {
        # The weights-first plan forms at v4-flash / deepseek-v3 n = 1 (FP8 x FP4 and FP8 x FP8): 7 (the
        # default), 5 (L2 split into equal chunks over every CTA: no second wave of whole L2 chunks), 3 and 1,
        # against the persistent kernel; then the trace of FP8 x FP4 deepseek-v3 in form 5
        # (DG_WS_FORMS_CASES / DG_WS_FORMS: other cases / forms, e.g. the mid shape's BF16 row)
        ab_rounds "${DG_WS_FORMS_CASES:-fp8xfp4 4096 2048 256 6 1 fp8xfp4 7168 2048 256 8 1 fp8xfp8 4096 2048 256 6 1 fp8xfp8 7168 2048 256 8 1}" \
            $(for f in ${DG_WS_FORMS:-7 5 3 1}; do echo "DG_MEGA_MOE_WEIGHTS_FIRST=1,DG_MEGA_MOE_WS_PLAN=$f"; done) DG_MEGA_MOE_WEIGHTS_FIRST=0
        if [ -z "${DG_WS_FORMS_CASES:-}" ]; then
            echo "=== trace, weights-first form 5, fp8xfp4 deepseek-v3 n = 1"
            DG_MEGA_MOE_WEIGHTS_FIRST=1 DG_MEGA_MOE_WS_PLAN=5 timeout -k 5 90 python3 scripts/trace.py --cold fp8xfp4 7168 2048 256 8 1 2>&1 | tail -14
        fi
    } 2>&1 | tee "$OUT/ws_forms.txt"
fi
if [ "${DG_RUN_WS_STAGE_LOG:-0}" = "1" ]; then
    {
        # The weights-first kernel's stage log (its `_tasklog` variants, compiled here in seconds): the first
        # 16 units of each CTA's first L1 and L2 chunks, deepseek-v3 n = 1, both FP8 formats, and mid FP8 x
        # FP8 n = 1 (when its L2 weights arrive against when its math wants them), cold
        for c in "fp8xfp4 7168 2048 256 8 1" "fp8xfp8 7168 2048 256 8 1" "fp8xfp8 2048 768 128 8 1"; do
            echo "=== stage log, weights-first, $c"
            DG_MEGA_MOE_WEIGHTS_FIRST=1 timeout -k 5 120 python3 scripts/trace.py --tasks --cold $c 2>&1 | tail -40
        done
    } 2>&1 | tee "$OUT/ws_stage_log.txt"
fi
if [ "${DG_RUN_WS_LEAD:-0}" = "1" ]; then
    {
        # Form 7's L2 weights are requested once every L1 load is issued and arrive ~6 us after the pair
        # rows at mid FP8 n = 1 (docs/PERF.md session 51): a lead starts them earlier
        leads=(${DG_WS_LEADS:-0 4 8 16})
        ab_rounds "${DG_WS_LEAD_CASES:-fp8xfp8 2048 768 128 8 1 bf16xbf16 2048 768 128 8 1 fp8xfp8 4096 2048 256 6 1}" \
            $(for l in "${leads[@]}"; do echo "DG_MEGA_MOE_WEIGHTS_FIRST=1,DG_MEGA_MOE_WS_L2_LEAD=$l"; done) DG_MEGA_MOE_WEIGHTS_FIRST=0
        echo "=== stage log, weights-first, lead ${leads[1]:-0}, fp8xfp8 2048 768 128 8 1"
        DG_MEGA_MOE_WEIGHTS_FIRST=1 DG_MEGA_MOE_WS_L2_LEAD=${leads[1]:-0} timeout -k 5 120 python3 scripts/trace.py --tasks --cold \
            fp8xfp8 2048 768 128 8 1 2>&1 | tail -40
    } 2>&1 | tee "$OUT/ws_lead.txt"
fi
if [ "${DG_RUN_OPERAND_PROBE:-0}" = "1" ]; then
    bash scripts/device_operand_probe.sh 2>&1 | tail -30
fi
exit $status
