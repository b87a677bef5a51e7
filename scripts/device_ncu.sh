#!/usr/bin/env bash
# Nsight Compute on the H200 (one `device` call): per-SASS-instruction warp-stall samples and the
# kernel's warp-state breakdown for each case, clocks left alone (METHOD.md).
#
#   run(command="bash scripts/device_ncu.sh fp8xfp4 4096 2048 256 6 8 [fmt h i e k n ...]",
#       carry=[".whl", ".jit_cache"])
#
# Per case one file $OUT/<fmt>_<hidden>_<n>.txt (the device returns few files): ncu's log, the
# details page (speed of light, warp state, scheduler, memory) and, after a line "=== source", the
# source page as CSV (every SASS instruction with its stall samples). Each ncu run is bounded by
# DG_NCU_TIMEOUT_S (default 240 s); DG_NCU_SAMPLING sets the sampling interval (2^(5 + v) cycles).
set -uo pipefail
source scripts/device_setup.sh
NCU=${NCU:-ncu}
command -v "$NCU" > /dev/null || NCU=$(ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
echo "ncu: $NCU ($($NCU --version | tail -1))"
while [ $# -ge 6 ]; do
    fmt=$1; shape="$2 $3 $4 $5 $6"; tag=${fmt}_$2_$6; shift 6
    rep=/tmp/$tag
    timeout -k 10 "${DG_NCU_TIMEOUT_S:-240}" "$NCU" --clock-control none --target-processes all \
        -k sm90_mega_moe --launch-skip 2 --launch-count 1 \
        --section SpeedOfLight --section WarpStateStats --section SchedulerStats --section SourceCounters \
        --section MemoryWorkloadAnalysis --section LaunchStats --warp-sampling-interval ${DG_NCU_SAMPLING:-4} \
        -f -o "$rep" python3 scripts/ncu_case.py --calls 3 $fmt $shape > "$OUT/$tag.txt" 2>&1
    echo "$tag: ncu exit $? $(tail -2 "$OUT/$tag.txt" | tr '\n' ' ')"
    [ -f "$rep.ncu-rep" ] || continue
    "$NCU" -i "$rep.ncu-rep" --page details >> "$OUT/$tag.txt" 2>&1
    echo "=== source" >> "$OUT/$tag.txt"
    "$NCU" -i "$rep.ncu-rep" --page source --print-source sass --csv >> "$OUT/$tag.txt" 2>&1
    grep -E "Duration|Warp Cycles Per Issued|Issued Warp|Stall|Memory Throughput|DRAM Throughput" "$OUT/$tag.txt" | head -30
done
