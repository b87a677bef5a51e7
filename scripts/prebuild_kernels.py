"""Compile every Mega MoE kernel variant the heuristics can pick on an H100/H200, for sm_90a
(per format: BLOCK_M 64 and 128, fast and exact SwiGLU, and at BLOCK_M 64 both L2 task widths).

Run on the CPU machine before a device call and carry DG_JIT_CACHE_DIR (default ./.jit_cache):
the cache key holds no machine-specific path, so the device finds these cubins. Also compiles the
input-staging kernels and the helper kernels of tests/test_faults_gpu.py.

    DG_JIT_CACHE_DIR=.jit_cache python scripts/prebuild_kernels.py
"""
import os
import sys
import time

os.environ.setdefault('DG_JIT_CACHE_DIR', os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                                       '.jit_cache'))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import deep_gemm  # noqa: E402,F401
from deep_gemm import _C  # noqa: E402
from deep_gemm.mega.buffer import mma_type_to_int  # noqa: E402

H200_SMEM = 232448
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def variants(formats=('fp8xfp8', 'bf16xbf16')):
    """(mma_type, block_m, num_stages, fast_math, block_n_l2) of every kernel: per format, BLOCK_M 64
    (decode) and 128 (prefill) with their stage counts, fast and exact SwiGLU, and at BLOCK_M 64 both
    L2 task widths (the heuristic picks 128 or 256 by shape and n; DG_MEGA_MOE_L2_BLOCK_N forces
    either). The 128-wide kernels come first."""
    keys = []
    for fmt in formats:
        for n in (1, 1 << 16):   # decode picks BLOCK_M 64, prefill 128
            c = _C.get_mega_moe_config(mma_type_to_int(fmt), 1, 256, 8, 7168, 2048, n, 132, H200_SMEM)
            for fast in (True, False):
                keys.append((mma_type_to_int(fmt), c['block_m'], c['num_stages'], fast, 128))
    keys += [(t, m, s, fast, 256) for t, m, s, fast, _ in keys if m == 64]
    return list(dict.fromkeys(keys))


if __name__ == '__main__':
    for key in variants(sys.argv[1:] or ('fp8xfp8', 'bf16xbf16')):
        t = time.time()
        path = _C.compile_mega_moe(*key)
        print(f'{key}: {time.time() - t:.1f} s -> {path}')
    for fp8 in (True, False):
        print(f'stage fp8={fp8}: {_C.compile_mega_moe_stage(fp8)}')
    # (absent where scripts/ab_prebuild.sh runs a copy of this script for a kernel variant)
    if os.path.isfile(os.path.join(ROOT, 'tests', 'test_faults_gpu.py')):
        sys.path.insert(0, os.path.join(ROOT, 'tests'))
        import test_faults_gpu  # noqa: E402
        for name in test_faults_gpu.HELPER_KERNELS:
            print(f'{name}: {test_faults_gpu.compile_helper(name)}')
