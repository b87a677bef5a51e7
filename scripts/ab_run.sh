#!/usr/bin/env bash
# A/B timing of kernel variants in ONE device call (every call gets a fresh machine, and H200s
# differ by a few percent, so numbers from separate calls do not compare).
#
#   A = the working tree. A variant is either
#     ab/<name>.cuh  a copy of impls/sm90_fp8_mega_moe.cuh, run with the working tree's package, or
#     ab/<name>/     a whole source tree (`git archive <commit> | tar -x -C ab/<name>`): its own _C is
#                    built here, for variants that change headers or heuristics too, or
#     AB_ENVS="DG_MEGA_MOE_L2_BLOCK_N=128 ..."  the working tree under each VAR=VALUE (A=1+B=2: both; tuning aids,
#                    read once per process); AB_ENVS_ALL=1: every variant under each
#   bash scripts/ab_prebuild.sh fp8xfp8 bf16xbf16             # on the CPU machine: every variant's cubins
#   (more than 64 MiB to carry: python scripts/carry_cache.py .jit_cache /tmp/carry --all <formats the
#    tests need> --case <each timed case>, then carry /tmp/carry as .jit_cache)
#   run(command="AB_TESTS='tests/test_mega_moe_gpu.py' bash scripts/ab_run.sh fp8xfp8 2048 768 128 8 1 ...",
#       carry=[".whl", ".jit_cache", "ab"])
#
# AB_TESTS_ENV="DG_X=1+DG_Y=2" runs $AB_TESTS under those variables (the tests of an AB_ENVS variant).
# DG_TESTS_TIMEOUT_S bounds $AB_TESTS (scripts/device_run.sh; the usual GPU suite takes ~50 s, so
# ~150 keeps a hanging variant from spending the whole call on its tests).
# Builds _C, runs $AB_TESTS (default: the layout tests) on A, then scripts/time_fused.py on A and on
# every variant, interleaved twice (A V1 V2 A V1 V2); log in $OUT/ab.log. AB_TREE_TESTS="tests/x.py -k y"
# also runs those pytest args in every ab/<name>/ tree after its build (a branch checked in the same
# call it is timed in; log in $OUT/tree_tests.log).
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
# AB_TESTS and AB_TREE_TESTS are read as shell words, quotes kept: AB_TESTS="tests/x.py -k 'fp8xfp4 and
# prefill'" passes the -k expression as one argument (plain word splitting cut it at its spaces)
eval "ab_tests=(${AB_TESTS:-tests/test_layout.py})"
eval "tree_tests=(${AB_TREE_TESTS:-})"
# AB_TESTS_ENV="DG_X=1+DG_Y=2": run $AB_TESTS under those variables (an AB_ENVS variant's own tests)
env ${AB_TESTS_ENV:+${AB_TESTS_ENV//+/ }} bash scripts/device_run.sh "${ab_tests[@]}" | tail -3
export DG_JIT_CACHE_DIR=$PWD/.jit_cache
source scripts/device_compiler.sh
VARIANTS=""
for v in ab/*.cuh; do
    [ -e "$v" ] || continue
    d=/tmp/ab_$(basename "$v" .cuh)
    rm -rf "$d" && mkdir -p "$d" && cp -r deep_gemm "$d"/ && cp "$v" "$d"/deep_gemm/include/deep_gemm/impls/sm90_fp8_mega_moe.cuh
    VARIANTS="$VARIANTS $d"
done
for v in ab/*/; do
    [ -f "$v/setup.py" ] || continue
    d=/tmp/ab_$(basename "$v")
    rm -rf "$d" && cp -r "$v" "$d"
    (cd "$d" && PYTHONPATH=/tmp/site python3 setup.py build_ext --inplace -q --force > build.log 2>&1) || { echo "build of $v failed"; tail -20 "$d/build.log"; }
    if [ -n "${AB_TREE_TESTS:-}" ]; then
        echo "=== $v: pytest $AB_TREE_TESTS" | tee -a "$OUT/tree_tests.log"
        (cd "$d" && PYTHONPATH=/tmp/site:$d timeout 300 python3 -m pytest -q -x -p no:cacheprovider "${tree_tests[@]}" 2>&1) \
            | tee -a "$OUT/tree_tests.log" | tail -4
    fi
    VARIANTS="$VARIANTS $d"
done
PYTHONPATH=/tmp/site:$PWD python3 -c "from scripts.trace import warm_up_gpu; warm_up_gpu()"
for _ in 1 2; do
    PYTHONPATH=/tmp/site:$PWD python3 scripts/time_fused.py "$@" 2>&1 | tee -a "$OUT/ab.log"
    for d in $VARIANTS; do
        PYTHONPATH=/tmp/site:$d python3 scripts/time_fused.py "$@" 2>&1 | tee -a "$OUT/ab.log"
    done
    # Environment variants (AB_ENVS="DG_X=1 DG_Y=2": one variant each; "DG_X=1+DG_Y=2": both in one)
    # of the working tree and, with AB_ENVS_ALL=1, of every variant above
    for e in ${AB_ENVS:-}; do
        for d in $PWD ${AB_ENVS_ALL:+$VARIANTS}; do
            echo "[$e]" | tee -a "$OUT/ab.log"
            env ${e//+/ } PYTHONPATH=/tmp/site:$d python3 scripts/time_fused.py "$@" 2>&1 | tee -a "$OUT/ab.log"
        done
    done
done
