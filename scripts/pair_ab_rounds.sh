# Sourced by the scripts/device_pair*.sh calls: `pair_ab_rounds "SETTINGS" CASE...` times the fused
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
