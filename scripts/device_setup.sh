# Sourced by scripts/device_run.sh and scripts/device_ep.sh at the start of a `device` call:
# environment (JIT cache, NVLink multicast off), the carried wheels (.whl: nvidia-cutlass, CuTe
# headers) into /tmp/site, nvidia-smi into $OUT/gpu.txt, deep_gemm._C built for the device's
# Python into $OUT/build.log. Exits the calling script on failure. DG_SETUP_TIMEOUT_S bounds each
# step (default 300 s).
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
export DG_JIT_CACHE_DIR=$PWD/.jit_cache
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
_setup_timeout=${DG_SETUP_TIMEOUT_S:-300}
timeout -k 10 "$_setup_timeout" python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl > /tmp/pip.log 2>&1 || { cat /tmp/pip.log; exit 1; }
export PYTHONPATH=/tmp/site:$PWD
timeout -k 5 60 nvidia-smi --query-gpu=index,name,driver_version,clocks.sm,clocks.mem --format=csv > "$OUT/gpu.txt" 2>&1
source scripts/device_compiler.sh
timeout -k 10 "$_setup_timeout" python3 setup.py build_ext --inplace -q --force > "$OUT/build.log" 2>&1 \
    || { tail -30 "$OUT/build.log"; exit 1; }
