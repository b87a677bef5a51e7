#!/usr/bin/env bash
# Session 36: the benchmark rows of the prefill kernels (BLOCK_M = 128) on the landed tree, one
# `device` call: `run(command="bash scripts/device_prefill_bench.sh", carry=[".whl", ".jit_cache"])`.
# mid and v4-flash at 2048 / 4096 / 8192 tokens, every format; deepseek-v3 at 4096, FP8 and FP8 x FP4
# (its BF16 weights and their torch baseline do not fit an H100 next to the others). Logs in $OUT.
set -uo pipefail
source scripts/device_setup.sh
cat "$OUT/gpu.txt"
timeout -k 10 330 python3 -m deep_gemm.bench --shapes mid v4-flash --tokens 2048 4096 8192 \
    --json "$OUT/bench_prefill.json" --plot "$OUT/bench_prefill.png" 2>&1 | tee "$OUT/bench_prefill.log" | tail -22
timeout -k 10 150 python3 -m deep_gemm.bench --shapes deepseek-v3 --formats fp8xfp8 fp8xfp4 --tokens 4096 \
    --json "$OUT/bench_ds.json" 2>&1 | tee "$OUT/bench_ds.log" | tail -4
