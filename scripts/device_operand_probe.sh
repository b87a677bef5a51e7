#!/usr/bin/env bash
# Session 47: is the FP8 prefill K-block bound by its operands' stream from L2, and what would 2-CTA
# clusters multicasting the weight tile give? (scripts/prefill_operand_probe.cu), one `device` call:
#
#   run(command="bash scripts/device_operand_probe.sh", carry=[".whl"])
#
# Needs only nvcc and the carried nvidia-cutlass wheel (CuTe's wgmma atoms); ~1 minute. Logs in
# $OUT: gpu.txt, operand_probe.txt.
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    > /tmp/pip.log 2>&1 || { cat /tmp/pip.log; exit 1; }
timeout -k 5 60 nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv | tee "$OUT/gpu.txt"
nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -I deep_gemm/include -I /tmp/site/cutlass_library/source/include \
    -o /tmp/operand_probe scripts/prefill_operand_probe.cu || exit 1
timeout -k 5 150 /tmp/operand_probe 2>&1 | tee "$OUT/operand_probe.txt"
exit "${PIPESTATUS[0]}"
