#!/usr/bin/env bash
# Compile the kernels of every variant of scripts/ab_run.sh into .jit_cache, each from the package
# the device will run it with (the cache key hashes the headers, not paths):
#   ab/<name>.cuh: a copy of the working tree's package with that kernel header;
#   ab/<name>/: that source tree, its _C built here first (its heuristics pick the kernels).
#   bash scripts/ab_prebuild.sh fp8xfp8 bf16xbf16
# --trees-only: prepare the trees (and build ab/<name>/'s _C) without prebuilding; then
# `python scripts/carry_cache.py --compile ...` compiles just the kernels the timed cases launch.
set -euo pipefail
TREES_ONLY=0
if [ "${1:-}" = --trees-only ]; then TREES_ONLY=1; shift; fi
prebuild() {   # package dir, label, formats...: with that tree's own prebuild script when it has one
    # (a branch may add kernel variants the working tree's script does not know), else the working tree's
    local d=$1 label=$2; shift 2
    [ "$TREES_ONLY" = 1 ] && { echo "$label: tree prepared"; return 0; }
    local script=scripts/prebuild_kernels.py
    [ -f "$d"/scripts/prebuild_kernels.py ] && script="$d"/scripts/prebuild_kernels.py
    grep -v '^sys.path.insert' "$script" > "$d"/prebuild.py
    echo "$label: $(DG_JIT_CACHE_DIR=$PWD/.jit_cache PYTHONPATH=$d python "$d"/prebuild.py "$@" | grep -c -- '->') kernels"
}
for v in ab/*.cuh; do
    [ -e "$v" ] || continue
    d=/tmp/ab_$(basename "$v" .cuh)
    rm -rf "$d" && mkdir -p "$d" && cp -r deep_gemm "$d"/ && rm -rf "$d"/deep_gemm/__pycache__
    cp "$v" "$d"/deep_gemm/include/deep_gemm/impls/sm90_fp8_mega_moe.cuh
    prebuild "$d" "$v" "$@"
done
for v in ab/*/; do
    [ -f "$v/setup.py" ] || continue
    (cd "$v" && python setup.py build_ext --inplace -q > /dev/null)
    prebuild "$v" "$v" "$@"
done
