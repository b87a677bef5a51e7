"""Copy the JIT cache entries one `device` call needs into a fresh cache directory, to carry.

The device call carries at most 64 MiB; one tree's 52 prebuilt variants take ~35 MB (~0.6 MB a
cubin with line info), so a call that times a working tree against ab/ variants cannot carry the
whole cache. Prebuild first (scripts/prebuild_kernels.py, scripts/ab_prebuild.sh), then:

    python scripts/carry_cache.py SRC DST [--all FORMAT ...] [--case fmt hidden inter experts topk n ...]

DST gets, from SRC: for the working tree, every variant scripts/prebuild_kernels.py builds for the
`--all` formats (what the GPU tests launch), its staging kernels, the tests' helper kernels and the
weights-first kernels of tests/test_weights_first_gpu.py; for
the working tree and every ab/ variant (ab/<name>.cuh as prepared in /tmp/ab_<name> by
scripts/ab_prebuild.sh, ab/<name>/ trees as they are), the kernel each `--case` launches at EP1 on
an H200 and on an H100 (the heuristics read the GPU's HBM bandwidth). A kernel missing from SRC is
an error (its tree was not prebuilt; the lookup compiles it into SRC on the way, so a second run
finds it), unless --compile: then it is compiled into SRC and copied in the same run (with --all,
the working tree's variants first by scripts/prebuild_kernels.py --jobs N, in parallel; an A/B of
a few cases needs only their kernels per variant: `bash scripts/ab_prebuild.sh --trees-only`
prepares the variants' trees without prebuilding every variant of every format). Then move DST to
.jit_cache and carry it.
"""
import argparse
import glob
import json
import os
import shutil
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from deep_gemm.mega.launch import SM90_HBM_GBPS, SM90_MAX_SMEM, SM90_NUM_SMS  # noqa: E402

GPUS = tuple((SM90_NUM_SMS, SM90_MAX_SMEM, gbps) for gbps in SM90_HBM_GBPS.values())   # (SMs, max shared memory, HBM GB/s): H200, H100

# Runs inside a tree (its own deep_gemm): prints a JSON list of the cache directories of the kernels
# asked for, from the cache in DG_JIT_CACHE_DIR, and fails if any of them had to be compiled.
_LOOKUP = r'''
import json, os, sys
sys.path.insert(0, os.getcwd())
from deep_gemm import _C
from deep_gemm.mega.launch import kernel_variant
req = json.loads(sys.argv[1])
before = _C.get_num_nvcc_invocations()
dirs = []
keys = [tuple(k) for k in req['keys']]
_C.set_mega_moe_weights_first(0)   # the persistent kernels of the cases (the weights-first ones below)
for fmt, h, i, e, k, n in req['cases']:
    for sms, smem, gbps in req['gpus']:
        keys.append(kernel_variant(fmt, 1, e, k, h, i, n, sms, smem, True, hbm_gbps=gbps))
for key in dict.fromkeys(keys):
    dirs.append(_C.compile_mega_moe(*key))
for fp8 in req['stages']:
    dirs.append(_C.compile_mega_moe_stage(fp8))
if req['helpers'] and os.path.isfile(os.path.join('tests', 'test_faults_gpu.py')):
    sys.path.insert(0, 'tests')
    import test_faults_gpu
    dirs += [test_faults_gpu.compile_helper(name) for name in test_faults_gpu.HELPER_KERNELS]
# The weights-first kernels (on by default for one-token EP1 FP8 x FP8 / BF16 calls, FP8 x FP4 when asked;
# tests/test_weights_first_gpu.py: FP8 x FP8 / BF16 at 5 or 6 stages, FP8 x FP4 at 8; not among prebuild_kernels.py's
# persistent variants)
if req['helpers'] and hasattr(_C, 'get_mega_moe_ws_plan'):
    ws = [(fmt, stages) for fmt in (1, 2) for stages in (5, 6)] + [(0, 8)]
    dirs += [_C.compile_mega_moe(fmt, 64, stages, True, 128, 64, False, False, True) for fmt, stages in ws]
if _C.get_num_nvcc_invocations() != before and not req['compile']:
    sys.exit('kernels missing from the cache (compiled now): prebuild this tree first')
print(json.dumps(dirs))
'''


def trees(ab_dir):
    """(label, directory) of the working tree and every variant in ab_dir (the repository's ab/)."""
    out = [('working tree', ROOT)]
    for v in sorted(glob.glob(os.path.join(ab_dir, '*.cuh'))):
        d = os.path.join('/tmp', 'ab_' + os.path.basename(v)[:-len('.cuh')])
        if not os.path.isdir(d):
            sys.exit(f'{v}: {d} is missing (run scripts/ab_prebuild.sh first)')
        out.append((v, d))
    for v in sorted(glob.glob(os.path.join(ab_dir, '*', 'setup.py'))):
        out.append((os.path.dirname(v), os.path.dirname(v)))
    return out


def lookup(tree, src, request):
    env = dict(os.environ, DG_JIT_CACHE_DIR=os.path.abspath(src), PYTHONPATH=tree)
    result = subprocess.run([sys.executable, '-c', _LOOKUP, json.dumps(request)], cwd=tree, env=env,
                            capture_output=True, text=True)
    if result.returncode != 0:
        sys.exit(f'{tree}: {result.stderr.strip().splitlines()[-1] if result.stderr.strip() else result.returncode}')
    return json.loads(result.stdout.strip().splitlines()[-1])


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('src', help='the full cache (DG_JIT_CACHE_DIR the prebuilds used)')
    parser.add_argument('dst', help='a new directory: gets cache/<entry> for each kernel needed')
    parser.add_argument('--all', nargs='*', default=[], metavar='FORMAT',
                        help="the working tree's prebuilt variants of these formats (the GPU tests)")
    parser.add_argument('--case', nargs=6, action='append', default=[], metavar=('FMT', 'H', 'I', 'E', 'K', 'N'),
                        help='a timed case: its kernels in every tree')
    parser.add_argument('--compile', action='store_true',
                        help='compile kernels missing from SRC into it (else missing ones are an error)')
    parser.add_argument('--jobs', type=int, default=min(4, os.cpu_count() or 1),
                        help="with --compile and --all: the working tree's variants are first compiled this many "
                             'at a time (scripts/prebuild_kernels.py --jobs)')
    parser.add_argument('--ab-dir', default=os.path.join(ROOT, 'ab'),
                        help="where the A/B variants are (default: the repository's ab/; an empty or missing "
                             'directory: the working tree only)')
    args = parser.parse_args(argv)
    if os.path.exists(args.dst):
        parser.error(f'{args.dst} exists')
    cases = [[c[0], *map(int, c[1:])] for c in args.case]
    keys = []
    if args.all:
        sys.path.insert(0, os.path.join(ROOT, 'scripts'))
        import prebuild_kernels   # noqa: E402 (the working tree's variant list)
        keys = [list(k) for k in prebuild_kernels.variants(tuple(args.all))]
    if args.compile and args.all:
        # The bulk of a fresh cache, in parallel (the lookups below compile one kernel at a time)
        env = dict(os.environ, DG_JIT_CACHE_DIR=os.path.abspath(args.src))
        subprocess.run([sys.executable, os.path.join(ROOT, 'scripts', 'prebuild_kernels.py'), '--jobs', str(args.jobs),
                        *args.all], env=env, check=True, stdout=subprocess.DEVNULL)
    entries = {}
    for label, tree in trees(args.ab_dir):
        main_tree = tree == ROOT
        request = {'keys': keys if main_tree else [], 'cases': cases, 'gpus': GPUS,
                   'stages': [True, False] if main_tree else [], 'helpers': main_tree and bool(args.all),
                   'compile': args.compile}
        dirs = lookup(tree, args.src, request)
        print(f'{label}: {len(dirs)} kernels')
        for d in dirs:
            entries[os.path.basename(os.path.normpath(d))] = d
    os.makedirs(os.path.join(args.dst, 'cache'))
    total = 0
    for name, d in sorted(entries.items()):
        shutil.copytree(d, os.path.join(args.dst, 'cache', name))
        total += sum(os.path.getsize(f) for f in glob.glob(os.path.join(d, '*')))
    print(f'# {len(entries)} cache entries, {total / 2**20:.1f} MiB -> {args.dst}')
    return 0


if __name__ == '__main__':
    sys.exit(main())
