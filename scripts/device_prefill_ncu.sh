#!/usr/bin/env bash
# Session 36: Nsight Compute of the compute-bound prefill rows (FP8 v4-flash / mid n = 8192), for
# the stall reasons of the 128-row K-loops: `run(command="bash scripts/device_prefill_ncu.sh",
# carry=[".whl", ".jit_cache"])`; files $OUT/fp8xfp8_<hidden>_8192.txt (scripts/device_ncu.sh)
set -uo pipefail
DG_NCU_TIMEOUT_S=150 bash scripts/device_ncu.sh fp8xfp8 4096 2048 256 6 8192 fp8xfp8 2048 768 128 8 8192 2>&1 | grep -v "^\"" | tail -30
