# Sourced by the scripts/device_pair*.sh and device_prefill_probe.sh calls: `pair_ab_rounds "SETTINGS" CASE...` times the fused
# kernel (scripts/time_fused.py) for CASE... under each DG_MEGA_MOE_CTA_PAIR setting of SETTINGS
# ("heuristic" leaves it unset), two rounds interleaved (A B A B: variants compare on one GPU only
# within one call), appending to $OUT/ab.log.
pair_ab_rounds() {
    local settings=$1; shift
    local round pair
    for round in 1 2; do
        for pair in $settings; do
            echo "[round $round DG_MEGA_MOE_CTA_PAIR=$pair]" | tee -a "$OUT/ab.log"
            if [ "$pair" = heuristic ]; then (unset DG_MEGA_MOE_CTA_PAIR; timeout 100 python3 scripts/time_fused.py "$@")
            else DG_MEGA_MOE_CTA_PAIR=$pair timeout 100 python3 scripts/time_fused.py "$@"; fi 2>&1 | tee -a "$OUT/ab.log"
        done
    done
}

# `pair_racecheck_w16 RUNS`: racecheck of the forced CTA pair with N = 16 / 32 tiles at --sms 2
# --tokens 48 (small shape), RUNS times: session 35 saw two hazards beyond the known four there once;
# each run's log appended to $OUT/racecheck.log, its summary and calc_diff printed
pair_racecheck_w16() {
    local i rc
    for i in $(seq "$1"); do
        DG_MEGA_MOE_CTA_PAIR=1 timeout 120 compute-sanitizer --tool racecheck python3 scripts/one_launch.py --format fp8xfp4 --sms 2 --tokens 48 > /tmp/san.log 2>&1
        rc=$?
        { echo "=== racecheck pair_w16 run $i: exit $rc"; cat /tmp/san.log; } >> "$OUT/racecheck.log"
        echo "racecheck pair_w16 run $i: exit $rc $(grep -E 'RACECHECK SUMMARY|calc_diff' /tmp/san.log | tr '\n' ' ')"
    done
}
