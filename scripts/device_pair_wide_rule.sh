#!/usr/bin/env bash
# Third device call of session 35: the heuristic's rule for the CTA pair with N = 16 / 32 tiles
# (from 32 expected tasks per SM, 6-16 tokens per expert; csrc/jit_kernels/heuristics/mega_moe.hpp)
#
#   run(command="bash scripts/device_pair_wide_rule.sh", carry=[".whl", ".jit_cache"])
#
# 1. the GPU suite (tests/test_mega_moe_gpu.py, tests/test_faults_gpu.py) on the tree with the rule
# 2. racecheck of the pair-wide kernel's --sms 2 --tokens 48 case (small shape), three times: the
#    H200 of the first call reported two hazards there beyond the known four, once
# 3. the heuristic (the rule) against DG_MEGA_MOE_CTA_PAIR=0 at the rows it now takes (v4-flash
#    n = 256 / 512 / 682, deepseek-v3 n = 192 / 512) and two it leaves (mid n = 96, v4-flash n = 1024),
#    two rounds, interleaved
# Logs in $OUT: tests.log, racecheck.log, ab.log.
set -uo pipefail
DG_TESTS_TIMEOUT_S=${DG_TESTS_TIMEOUT_S:-330} bash scripts/device_run.sh tests/test_mega_moe_gpu.py tests/test_faults_gpu.py | tail -4
export DG_JIT_CACHE_DIR=$PWD/.jit_cache PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
source scripts/pair_ab_rounds.sh
start=$(date +%s)
pair_racecheck_w16 3
echo "racecheck took $(( $(date +%s) - start )) s"
CASES="fp8xfp4 4096 2048 256 6 256 fp8xfp4 4096 2048 256 6 512 fp8xfp4 4096 2048 256 6 682 fp8xfp4 4096 2048 256 6 1024
       fp8xfp4 7168 2048 256 8 192 fp8xfp4 7168 2048 256 8 512 fp8xfp4 2048 768 128 8 96"
pair_ab_rounds "heuristic 0" $CASES
echo "all took $(( $(date +%s) - start )) s"
