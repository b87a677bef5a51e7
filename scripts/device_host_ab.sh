#!/usr/bin/env bash
# Host time of an eager call, A/B in one device call: the working tree against a source tree in
# ab/<name> (`git archive <commit> deep_gemm csrc setup.py | tar -x -C ab/<name>`), each with its own
# _C, scripts/host_overhead.py twice each, interleaved; then pytest on the arguments, if any, under
# DG_TESTS_TIMEOUT_S (default 400 s), as scripts/device_run.sh runs them (log in $OUT/tests.log).
#   run(command="AB_TREE=ab/old bash scripts/device_host_ab.sh tests/test_mega_moe_gpu.py",
#       carry=[".whl", ".jit_cache", "ab"])
# Both trees' kernels come from .jit_cache (the same headers give the same cache keys).
set -uo pipefail
source scripts/device_setup.sh
tree=${AB_TREE:-ab/old}
( cd "$tree" && source ../../scripts/device_compiler.sh && timeout -k 10 300 python3 setup.py build_ext --inplace -q ) \
    > "$OUT/ab_build.log" 2>&1 || { tail -20 "$OUT/ab_build.log"; exit 1; }
for round in 1 2; do
    for t in "$tree" .; do
        echo "== $t round $round"
        PYTHONPATH=/tmp/site:$PWD/$t timeout -k 5 120 python3 scripts/host_overhead.py 2>&1 | tail -4
    done
done | tee "$OUT/host_overhead_ab.txt"
[ $# -eq 0 ] && exit 0
start=$(date +%s)
timeout -k 10 "${DG_TESTS_TIMEOUT_S:-400}" python3 -m pytest -q -x -p no:cacheprovider --timeout=300 "$@" 2>&1 \
    | tee "$OUT/tests.log" | tail -30
status=${PIPESTATUS[0]}
echo "tests took $(( $(date +%s) - start )) s, exit $status"
exit $status
