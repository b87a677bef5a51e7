#!/usr/bin/env bash
# Session 35: the landed CTA pair (token passes of 8, picked below 6 tokens per expert) on an H100,
# where the pair with N = 16 / 32 tiles measured slower than on the H200 (+1.9 to +3.5 % against
# -2.2 to -4.8 %): the heuristic's picks against DG_MEGA_MOE_CTA_PAIR=0, two rounds, interleaved.
#
#   run(command="bash scripts/device_pair_h100.sh", kind="nvidia-h100-x1", carry=[".whl", ".jit_cache"])
set -uo pipefail
source scripts/device_setup.sh
source scripts/pair_ab_rounds.sh
export DG_JIT_CACHE_DIR=$PWD/.jit_cache PYTHONPATH=/tmp/site:$PWD
cat "$OUT/gpu.txt"
CASES="fp8xfp4 4096 2048 256 6 8 fp8xfp4 4096 2048 256 6 32 fp8xfp4 4096 2048 256 6 128 fp8xfp4 4096 2048 256 6 192
       fp8xfp4 7168 2048 256 8 8 fp8xfp4 7168 2048 256 8 32 fp8xfp4 7168 2048 256 8 128
       fp8xfp4 2048 768 128 8 16 fp8xfp4 2048 768 128 8 32 fp8xfp4 2048 768 128 8 64"
pair_ab_rounds "heuristic 0" $CASES
