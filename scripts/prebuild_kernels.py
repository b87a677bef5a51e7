"""Compile Mega MoE kernel variants for sm_90a into the JIT cache, on a machine without a GPU.

Run on the CPU machine before a device call and carry DG_JIT_CACHE_DIR (default ./.jit_cache):
the cache key holds no machine-specific path, so the device finds these cubins (as long as its
nvcc reports the same version: the key hashes `nvcc --version`; a miss there compiles on the
device, a few seconds per variant).

    DG_JIT_CACHE_DIR=.jit_cache python scripts/prebuild_kernels.py [FORMAT ...]
        every variant the heuristics can pick on an H100/H200 (both BLOCK_M, fast and exact math,
        at BLOCK_M 64 the L2 task widths, FP8 x FP8 / BF16 prefill's 256-wide L2 tasks), the input-staging kernels and the helper kernels of
        tests/test_faults_gpu.py
    python scripts/prebuild_kernels.py --ep 2 fp8xfp8 fp8xfp4 bf16xbf16
        exactly what scripts/device_ep.sh runs on 2 GPUs: the variants the launcher picks with 2
        ranks for every token count of tests/test_multi_gpu.py (EP check shapes, n = 0..n_max) and
        of `python -m deep_gemm.bench --ep 2` (its default shapes and tokens), fast math, and the
        staging kernels
    --list: print the variants, compile nothing
    --jobs N: compile N variants at a time (threads: nvcc runs without the GIL; default: the CPU count,
        at most 4; on a 2-core machine the 60 variants of all three formats take ~4.5 minutes with 2
        against ~8 with 1)

FORMAT: fp8xfp8, fp8xfp4, bf16xbf16 (default: fp8xfp8 bf16xbf16). Each kernel prints one line
`<key>: <seconds> s (cached|compiled) -> <cache dir>`.
"""
import argparse
import concurrent.futures
import os
import sys
import time

os.environ.setdefault('DG_JIT_CACHE_DIR', os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                                       '.jit_cache'))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import deep_gemm  # noqa: E402,F401
from deep_gemm import _C  # noqa: E402
from deep_gemm.mega.buffer import MMA_TYPES  # noqa: E402
from deep_gemm.mega.launch import SM90_HBM_GBPS, SM90_MAX_SMEM, SM90_NUM_SMS, kernel_variant  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_FORMATS = ('fp8xfp8', 'bf16xbf16')


def _key(fmt, n, num_ranks, experts, topk, hidden, inter, fast):
    """The persistent kernel the launcher picks (with the weights-first kernel off: one-token EP1 calls
    would otherwise name that kernel, which carry_cache.py --all builds on its own)."""
    old = _C.set_mega_moe_weights_first(0)
    try:
        return kernel_variant(fmt, num_ranks, experts, topk, hidden, inter, n, SM90_NUM_SMS, SM90_MAX_SMEM, fast,
                              hbm_gbps=SM90_HBM_GBPS['H200'])   # the bandwidth-dependent picks (the CTA pair's N = 16 / 32 tiles) as on the H200
    finally:
        _C.set_mega_moe_weights_first(old)


def variants(formats=DEFAULT_FORMATS):
    """(mma_type, block_m, num_stages, fast_math, block_n_l2, wide_n_min, signals_thread, cta_pair) of every kernel: per format,
    BLOCK_M 64 (decode) and 128 (prefill) with their stage counts, fast and exact SwiGLU, at BLOCK_M 64
    the L2 task widths the heuristic picks (128 or 256 by shape and n, FP8 and BF16 also 512;
    DG_MEGA_MOE_L2_BLOCK_N forces one; FP8 x FP4 512-wide only with N = 64 tiles and no signals thread,
    what its one-wave rows launch: its other 512-wide kernels, a tuning aid, compile on first use), and
    FP8 x FP4 decode with and without the N = 16 / 32 transposed tiles (wide_n_min 16 or
    64: by the expected tokens per expert; DG_MEGA_MOE_WIDE_N forces either), each of those also with the
    signals thread (by the expected tasks per SM; DG_MEGA_MOE_SIGNALS_THREAD forces either), and FP8 x FP4's
    CTA-pair kernels (128- or 256-wide L2 tasks, with and without the signals thread, at the stages of
    half an SM; token passes of 8 narrow tiles, wide_n_min 64, where the heuristic picks the pair by the
    expected tasks per SM and tokens per expert, and passes of 32 with N = 16 / 32 tiles, wide_n_min 16,
    where DG_MEGA_MOE_CTA_PAIR=1 forces it at 6 or more tokens per expert). The 128-wide, N = 64 kernels
    without the signals thread come first."""
    keys = []
    for fmt in formats:
        for n in (1, 1 << 16):   # decode picks BLOCK_M 64, prefill 128
            for fast in (True, False):
                t, m, s, f = _key(fmt, n, 1, 256, 8, 7168, 2048, fast)[:4]
                keys.append((t, m, s, f, 128, 64, False))
    decode = [k for k in keys if k[1] == 64]
    keys += [(t, m, s, fast, 256, 64, False) for t, m, s, fast, *_ in decode]
    keys += [(t, m, s, fast, 512, 64, False) for t, m, s, fast, *_ in decode if t != MMA_TYPES['fp8xfp4']]
    # FP8 x FP8 and BF16 prefill: 256-wide L2 tasks (one K loop over a 256-row B tile)
    keys += [(t, m, s, fast, 256, 64, False) for t, m, s, fast, *_ in keys if m == 128 and t != MMA_TYPES['fp8xfp4']]
    fp4_decode = [k for k in keys if k[1] == 64 and k[0] == MMA_TYPES['fp8xfp4']]
    fp4_decode += [(*k[:5], 16, False) for k in fp4_decode]
    keys += fp4_decode[len(fp4_decode) // 2:] + [(*k[:6], True) for k in fp4_decode]
    # FP8 x FP4 512-wide: N = 64 tiles, no signals thread (what its one-wave rows launch)
    keys += [(t, m, s, fast, 512, 64, False) for t, m, s, fast, *_ in decode if t == MMA_TYPES['fp8xfp4']]
    keys = [(*k, False) for k in keys]
    # FP8 x FP4 CTA pairs: the stages of the pair's config (half an SM's shared memory)
    if 'fp8xfp4' in formats:
        t = MMA_TYPES['fp8xfp4']
        pair = _C.get_mega_moe_config(t, 1, 256, 8, 7168, 2048, 1, SM90_NUM_SMS, SM90_MAX_SMEM, cta_pair=1)
        keys += [(t, 64, pair['num_stages'], fast, width, wide, sig, True)
                 for wide in (64, 16) for width in (128, 256) for sig in (False, True) for fast in (True, False)]
    return list(dict.fromkeys(keys))


def ep_cases(num_ranks):
    """(shape name, hidden, intermediate, experts, topk, token counts) of the EP check and EP bench."""
    from deep_gemm import bench
    from deep_gemm.testing import ep_check, ep_bench
    for name, (hidden, inter, experts, topk) in ep_check.CHECK_SHAPES.items():
        yield f'check {name}', hidden, inter, experts, topk, range(0, ep_check.CHECK_MAX_TOKENS[name] + 1)
    for name in ep_bench.EP_SHAPES:
        s = bench.SHAPES[name]
        yield f'bench {name}', s.hidden, s.intermediate, s.num_experts, s.num_topk, ep_bench.EP_TOKENS
    if num_ranks == 2:   # tests/test_multi_gpu.py::test_ep_bench_two_processes
        s = bench.SHAPES['mid']
        yield 'bench-test mid', s.hidden, s.intermediate, s.num_experts, s.num_topk, (1, 64)


def ep_variants(num_ranks, formats):
    """The variants the launcher picks with `num_ranks` ranks (default fast math) for `ep_cases`."""
    seen = {}
    for fmt in formats:
        for label, hidden, inter, experts, topk, tokens in ep_cases(num_ranks):
            if experts % num_ranks:
                continue
            for n in tokens:
                key = _key(fmt, n, num_ranks, experts, topk, hidden, inter, True)
                seen.setdefault(key, f'{fmt} {label} n={n}')
    return seen


def compile_one(key):
    t = time.time()
    path = _C.compile_mega_moe(*key)
    # (not the nvcc count, which other threads' compiles also raise: a cubin this call wrote is new)
    how = 'compiled' if os.path.getmtime(os.path.join(path, 'kernel.cubin')) >= t - 1 else 'cached'
    print(f'{key}: {time.time() - t:.1f} s ({how}) -> {path}', flush=True)


def compile_stage(fp8):
    before = _C.get_num_nvcc_invocations()
    path = _C.compile_mega_moe_stage(fp8)
    how = 'compiled' if _C.get_num_nvcc_invocations() > before else 'cached'
    print(f'stage fp8={fp8} ({how}): {path}', flush=True)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('formats', nargs='*', metavar='FORMAT',
                        help=f'{", ".join(MMA_TYPES)} (default: {" ".join(DEFAULT_FORMATS)})')
    parser.add_argument('--ep', type=int, metavar='N',
                        help='only what scripts/device_ep.sh needs on N GPUs (one process each)')
    parser.add_argument('--list', action='store_true', help='print the variants, compile nothing')
    parser.add_argument('--jobs', type=int, default=min(4, os.cpu_count() or 1),
                        help='variants compiled at a time (default: the CPU count, at most 4)')
    args = parser.parse_args(argv)
    formats = tuple(args.formats) or DEFAULT_FORMATS
    for fmt in formats:
        if fmt not in MMA_TYPES:
            parser.error(f'format {fmt!r}: expected one of {", ".join(MMA_TYPES)}')
    if args.ep is not None and args.ep < 2:
        parser.error(f'--ep {args.ep}: expected at least 2 ranks')
    if args.jobs < 1:
        parser.error(f'--jobs {args.jobs}: expected at least 1')
    start = time.time()
    if args.ep is not None:
        needed = ep_variants(args.ep, formats)
        for key, why in sorted(needed.items()):
            print(f'# {key}: first needed by {why}')
        keys = sorted(needed)
    else:
        keys = list(variants(formats))
    stages = sorted({fmt != 'bf16xbf16' for fmt in formats}, reverse=True) if args.ep else (True, False)
    if args.list:
        for key in keys:
            print(key)
        return 0
    with concurrent.futures.ThreadPoolExecutor(max_workers=args.jobs) as pool:
        for future in [pool.submit(compile_one, key) for key in keys]:
            future.result()   # re-raises a failed compile (nvcc's output in the message)
    for fp8 in stages:
        compile_stage(fp8)
    # (absent where scripts/ab_prebuild.sh runs a copy of this script for a kernel variant)
    if args.ep is None and os.path.isfile(os.path.join(ROOT, 'tests', 'test_faults_gpu.py')):
        sys.path.insert(0, os.path.join(ROOT, 'tests'))
        import test_faults_gpu  # noqa: E402
        for name in test_faults_gpu.HELPER_KERNELS:
            print(f'{name}: {test_faults_gpu.compile_helper(name)}')
    print(f'# {len(keys)} kernel variants + {len(stages)} staging kernels in {time.time() - start:.1f} s '
          f'(cache {_C.get_cache_dir()}, nvcc runs {_C.get_num_nvcc_invocations()})', flush=True)
    return 0


if __name__ == '__main__':
    sys.exit(main())
