#!/usr/bin/env bash
# Compile the kernels of every ab/<name>.cuh variant into .jit_cache, each from a copy of the
# package as scripts/ab_run.sh makes on the device (the cache key hashes the headers, not paths).
#   bash scripts/ab_prebuild.sh fp8xfp8 bf16xbf16
set -euo pipefail
for v in ab/*.cuh; do
    d=/tmp/ab_$(basename "$v" .cuh)
    rm -rf "$d" && mkdir -p "$d" && cp -r deep_gemm "$d"/ && rm -rf "$d"/deep_gemm/__pycache__
    cp "$v" "$d"/deep_gemm/include/deep_gemm/impls/sm90_fp8_mega_moe.cuh
    grep -v '^sys.path.insert' scripts/prebuild_kernels.py > "$d"/prebuild.py
    echo "$v: $(DG_JIT_CACHE_DIR=$PWD/.jit_cache PYTHONPATH=$d python "$d"/prebuild.py "$@" | grep -c -- '->') kernels"
done
