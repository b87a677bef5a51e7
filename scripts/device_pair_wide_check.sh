#!/usr/bin/env bash
# Second device call for the CTA pair with N = 16 / 32 tiles (after scripts/device_pair_wide.sh,
# session 35): is the racecheck report of its --tokens 48 case (two hazards more than the known
# four: token-scale reads of the narrow loop followed by the producer's bulk write of the stage's
# scales, the form of session 33's real race) the pair-wide kernel's own, and where does its win
# on the large shapes end?
#
#   run(command="bash scripts/device_pair_wide_check.sh", carry=[".whl", ".jit_cache"])
#
# 1. racecheck, same case (--sms 2 --tokens 48, small shape): the landed pair (DG_MEGA_MOE_WIDE_N=64,
#    passes of 8) and the two-warpgroup kernel; the pair-wide kernel again at --sms 1 and 4
# 2. natively, forced pair-wide, 300 calls on one buffer (--calls: fresh inputs, 1..n tokens, masks),
#    small shape at --sms 2 (the stages turn over fastest) and mid at every SM: every call checked
# 3. DG_MEGA_MOE_CTA_PAIR=0 / 1 at v4-flash n = 1536 / 2048 / 2600 (36-61 tokens per expert) and
#    deepseek-v3 n = 768 / 1024 / 2048 (24-64), two rounds
# Logs in $OUT: racecheck.log (the tool's full output), check.log, ab.log.
set -uo pipefail
source scripts/device_setup.sh
source scripts/pair_ab_rounds.sh
export DG_JIT_CACHE_DIR=$PWD/.jit_cache PYTHONPATH=/tmp/site:$PWD
start=$(date +%s)
rc_run() {   # label, env assignments..., -- one_launch args...
    local label=$1; shift
    local envs=(); while [ "$1" != "--" ]; do envs+=("$1"); shift; done; shift
    env "${envs[@]}" timeout 200 compute-sanitizer --tool racecheck python3 scripts/one_launch.py --format fp8xfp4 "$@" > /tmp/san.log 2>&1
    local rc=$?
    { echo "=== racecheck $label [$*]: exit $rc"; cat /tmp/san.log; } >> "$OUT/racecheck.log"
    echo "racecheck $label [$*]: exit $rc $(grep -E 'RACECHECK SUMMARY|calc_diff' /tmp/san.log | tr '\n' ' ')"
    grep -E 'Race reported between Read' /tmp/san.log | sed 's/^=*//' | cut -c1-160
}
rc_run pair_w64 DG_MEGA_MOE_CTA_PAIR=1 DG_MEGA_MOE_WIDE_N=64 -- --sms 2 --tokens 48
rc_run two_wg_w16 DG_MEGA_MOE_CTA_PAIR=0 DG_MEGA_MOE_WIDE_N=16 -- --sms 2 --tokens 48
rc_run pair_w16 DG_MEGA_MOE_CTA_PAIR=1 -- --sms 1 --tokens 48
rc_run pair_w16 DG_MEGA_MOE_CTA_PAIR=1 -- --sms 4 --tokens 48
echo "racecheck took $(( $(date +%s) - start )) s"
for args in "--sms 2 --tokens 48 --calls 300" "--sms 1 --tokens 48 --calls 300" "--shape mid --sms 132 --tokens 256 --calls 100"; do
    DG_MEGA_MOE_CTA_PAIR=1 timeout 120 python3 scripts/one_launch.py --format fp8xfp4 $args 2>&1 | tail -1 | tee -a "$OUT/check.log"
done
echo "checks took $(( $(date +%s) - start )) s"
CASES="fp8xfp4 4096 2048 256 6 1536 fp8xfp4 4096 2048 256 6 2048 fp8xfp4 4096 2048 256 6 2600
       fp8xfp4 7168 2048 256 8 768 fp8xfp4 7168 2048 256 8 1024 fp8xfp4 7168 2048 256 8 2048"
pair_ab_rounds "0 1" $CASES
echo "all took $(( $(date +%s) - start )) s"
