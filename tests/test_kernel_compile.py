"""Every Mega MoE kernel variant the heuristics can pick compiles for sm_90a (DESIGN.md §5: CI
compiles every kernel variant it ships), on a machine without a GPU.

Variants: 3 formats x BLOCK_M {64, 128} (stage counts from the heuristics for an H100/H200) x
fast/exact SwiGLU, with 128-wide L2 tasks and, at BLOCK_M 64, also 256-wide ones and (FP8, BF16)
512-wide ones (kernels of their own), plus the two input-staging kernels. The SASS, where cuobjdump
is available, must hold the tensor-core instructions the format needs (QGMMA for FP8 operands,
HGMMA for BF16) and TMA loads (UTMALDG). scripts/prebuild_kernels.py compiles the same list.
"""
import concurrent.futures
import json
import os
import re
import subprocess
import sys

import pytest

from deep_gemm import _C
from deep_gemm.mega.buffer import mma_type_to_int
from deep_gemm.testing import MMA_TYPES as FORMATS

from conftest import cuobjdump_path, nvcc_path

H200_SMEM = 232448
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def l2_widths(fmt, block_m):
    # the L2 task widths the heuristic picks with every tile and signals variant (FP8 x FP4's 512-wide
    # kernels: _variants adds the one-wave rows' kernel, _tuning_variants the others; prefill: FP8 x
    # FP8 and BF16 also 256, one K loop over a 256-row B tile)
    if block_m != 64:
        return (128,) if fmt == 'fp8xfp4' else (128, 256)
    return (128, 256) if fmt == 'fp8xfp4' else (128, 256, 512)


def _variants():
    seen = []
    for fmt in FORMATS:
        for n in (1, 1 << 16):       # decode picks BLOCK_M 64, prefill 128
            c = _C.get_mega_moe_config(mma_type_to_int(fmt), 1, 256, 8, 7168, 2048, n, 132, H200_SMEM)
            for fast in (True, False):
                for block_n_l2 in l2_widths(fmt, c['block_m']):
                    # FP8 x FP4 decode: with and without the N = 16 / 32 transposed tiles, each with and
                    # without the signals thread
                    fp4_decode = fmt == 'fp8xfp4' and c['block_m'] == 64
                    for signals in ((False, True) if fp4_decode else (False,)):
                        for wide_n_min in ((64, 16) if fp4_decode else (64,)):
                            v = (fmt, c['block_m'], c['num_stages'], fast, block_n_l2, wide_n_min, signals, False)
                            if v not in seen:
                                seen.append(v)
    # FP8 x FP4 decode's 512-wide kernel that the heuristic launches (one-wave rows: N = 64 tiles, no
    # signals thread), both maths
    seen += [(*v[:4], 512, 64, False, False) for v in list(seen)
             if v[0] == 'fp8xfp4' and v[1] == 64 and v[4] == 256 and v[5:] == (64, False, False)]
    # FP8 x FP4 CTA pairs (half an SM's stages): token passes of 8 (N = 64 kernels) or of 32 with N = 16 /
    # 32 tiles (wide_n_min 16), 128 / 256-wide L2 tasks, either signals choice
    pair = _C.get_mega_moe_config(mma_type_to_int('fp8xfp4'), 1, 256, 8, 7168, 2048, 1, 132, H200_SMEM, cta_pair=1)
    seen += [('fp8xfp4', 64, pair['num_stages'], fast, width, wide, sig, True)
             for wide in (64, 16) for width in (128, 256) for sig in (False, True) for fast in (True, False)]
    return seen


# Kernels only a tuning aid launches (compiled on first use, not prebuilt): FP8 x FP4's 512-wide L2
# tasks (DG_MEGA_MOE_L2_BLOCK_N=512) with N = 16 / 32 tiles and the signals thread
def _tuning_variants():
    out = []
    for v in _variants():
        if v[0] == 'fp8xfp4' and v[1] == 64 and v[3] and v[4] == 256 and v[5:] == (16, True, False):
            out.append((*v[:4], 512, *v[5:]))
    return out


@pytest.fixture(scope='module')
def variants_compiled_in_parallel():
    """Every variant of the test below compiled before its first case, several at a time (nvcc runs
    without the GIL: about half the time on two cores); each case then finds its kernel compiled. A
    variant that fails here is compiled again by its own case, which reports the error."""
    nvcc = nvcc_path()
    if not nvcc or not os.path.isfile(nvcc):
        return
    with concurrent.futures.ThreadPoolExecutor(max_workers=min(4, os.cpu_count() or 1)) as pool:
        futures = [pool.submit(_C.compile_mega_moe, mma_type_to_int(v[0]), *v[1:]) for v in _variants() + _tuning_variants()]
        for future in futures:
            try:
                future.result()
            except RuntimeError:
                pass


def _sass_of(kernel_dir):
    """The SASS of a compiled kernel's cubin (an sm_90a ELF), or skip where cuobjdump is missing."""
    cubin = os.path.join(kernel_dir, 'kernel.cubin')
    with open(cubin, 'rb') as f:
        assert f.read(4) == b'\x7fELF'
    tool = cuobjdump_path()
    if tool is None:
        pytest.skip('cuobjdump not available: compiled, SASS not inspected')
    sass = subprocess.run([tool, '-sass', cubin], capture_output=True, text=True, check=True).stdout
    assert 'sm_90a' in subprocess.run([tool, '-elf', cubin], capture_output=True, text=True).stdout or 'SM90' in sass
    return sass


@pytest.mark.parametrize('variant', _variants() + _tuning_variants(),
                         ids=lambda v: f'{v[0]}-m{v[1]}-n{v[4]}-s{v[2]}-{"fast" if v[3] else "exact"}-w{v[5]}'
                                       f'{"-sig" if v[6] else ""}{"-pair" if v[7] else ""}')
def test_mega_moe_variant_compiles_for_sm90a(variant, requires_nvcc, variants_compiled_in_parallel):
    fmt, block_m, stages, fast, block_n_l2, wide_n_min, signals, pair = variant
    kernel_dir = _C.compile_mega_moe(mma_type_to_int(fmt), block_m, stages, fast, block_n_l2, wide_n_min, signals, pair)
    sass = _sass_of(kernel_dir)
    mma = 'HGMMA' if fmt == 'bf16xbf16' else 'QGMMA'
    assert mma in sass, f'{fmt}: no {mma} in the SASS'
    assert 'UTMALDG' in sass, 'no TMA loads in the SASS'
    # A programmatic dependent (griddepcontrol.wait: ACQBULK) that never lets its own dependents start
    # early (griddepcontrol.launch_dependents: PREEXIT), docs/KERNEL.md
    assert 'ACQBULK' in sass and 'PREEXIT' not in sass, 'the dependent-launch wait, and no early trigger'
    # No accumulator through local memory in a K-loop: every loop (a backward branch) that issues a
    # wgmma holds at most a few local-memory instructions (spilled scalars: 0-4 in every kernel of
    # session 37), not the 64-256 of an accumulator moved out and back each K-block (the BF16 256-wide
    # prefill L2 task's first form, docs/PERF.md session 37)
    for start, end, local in _wgmma_loops(sass):
        assert local <= _MAX_LOCAL_PER_WGMMA_LOOP, f'the wgmma loop {start:#x}-{end:#x} holds {local} LDL/STL'


_MAX_LOCAL_PER_WGMMA_LOOP = 8


def _wgmma_loops(sass):
    """(first, last address, LDL / STL count) of each loop of at most 1500 instructions that holds a wgmma."""
    ins = [(int(m.group(1), 16), m.group(2)) for m in re.finditer(r'/\*([0-9a-f]{4,})\*/\s+([^;]*);', sass)]
    loops = []
    for i, (addr, text) in enumerate(ins):
        branch = re.search(r'\bBRA\b.*?0x([0-9a-f]+)', text)
        if branch is None or int(branch.group(1), 16) >= addr:
            continue
        body = [t for a, t in ins if int(branch.group(1), 16) <= a <= addr]
        if len(body) <= 1500 and any('GMMA' in t for t in body):
            loops.append((int(branch.group(1), 16), addr, sum(bool(re.search(r'\b(LDL|STL)', t)) for t in body)))
    assert loops, 'no wgmma loop found in the SASS'
    return loops


def test_prefill_kernel_with_too_few_stages_for_the_bulk_combine_compiles(requires_nvcc):
    # FP8 prefill tiles at 2 stages (a smaller shared memory than the H100 / H200's 3): each math
    # warpgroup's half of the stages (48 KB) cannot hold the bulk combine's 4 x 16 KB buffers, so the
    # kernel keeps the register combine (kBulkCombine) instead of failing to compile. (FP8 x FP4's
    # halves also take its two expanded tiles: 64 KB at 2 stages, enough.)
    kernel_dir = _C.compile_mega_moe(mma_type_to_int('fp8xfp8'), 128, 2, True, 128)
    with open(os.path.join(kernel_dir, 'kernel.cubin'), 'rb') as f:
        assert f.read(4) == b'\x7fELF'


@pytest.mark.parametrize('fp8', [True, False])
def test_stage_kernel_compiles(fp8, requires_nvcc):
    kernel_dir = _C.compile_mega_moe_stage(fp8)
    cubin = os.path.join(kernel_dir, 'kernel.cubin')
    with open(cubin, 'rb') as f:
        assert f.read(4) == b'\x7fELF'
    tool = cuobjdump_path()
    if tool is None:
        pytest.skip('cuobjdump not available: compiled, SASS not inspected')
    sass = subprocess.run([tool, '-sass', cubin], capture_output=True, text=True, check=True).stdout
    # It lets the Mega MoE kernel that follows start its setup (PREEXIT) and itself waits for the kernel
    # before it (ACQBULK) before it reads or writes anything
    assert 'PREEXIT' in sass and 'ACQBULK' in sass
    assert sass.index('ACQBULK') < min(sass.index(op) for op in ('LDG', 'STG') if op in sass)


def test_remembered_kernel_directories_follow_the_cache_directory(requires_nvcc, tmp_path):
    # The launchers remember each variant's compiled directory per process; after set_cache_dir they
    # look it up again (a copy of each kernel in the new cache: found there, no nvcc run), instead of
    # returning paths into the old directory
    import shutil
    old = [_C.compile_mega_moe_stage(True), _C.compile_mega_moe(mma_type_to_int('fp8xfp8'), 128, 2, True, 128)]
    new_cache = tmp_path / 'moved'
    for d in old:
        shutil.copytree(d, new_cache / 'cache' / os.path.basename(d))
    invocations = _C.get_num_nvcc_invocations()
    _C.set_cache_dir(str(new_cache))
    try:
        now = [_C.compile_mega_moe_stage(True), _C.compile_mega_moe(mma_type_to_int('fp8xfp8'), 128, 2, True, 128)]
    finally:
        _C.set_cache_dir('')
    assert now == [str(new_cache / 'cache' / os.path.basename(d)) for d in old]
    assert _C.get_num_nvcc_invocations() == invocations


def test_variants_compile_concurrently(requires_nvcc, tmp_path):
    """`_C.compile_mega_moe` releases the GIL and holds no lock across nvcc (scripts/prebuild_kernels.py
    --jobs): three threads asking for two variants, one of them twice, get each variant's one cache
    directory and run nvcc once per variant. In a child with an empty cache (the variants' directories
    are remembered per process)."""
    script = (
        'import concurrent.futures, json\n'
        'from deep_gemm import _C\n'
        'keys = [(2, 64, 5, False, 128, 64, False, False), (2, 64, 5, True, 128, 64, False, False)]\n'
        'with concurrent.futures.ThreadPoolExecutor(3) as pool:\n'
        '    dirs = list(pool.map(lambda k: _C.compile_mega_moe(*k), [keys[0], keys[1], keys[0]]))\n'
        'print(json.dumps({"dirs": dirs, "nvcc": _C.get_num_nvcc_invocations()}))\n')
    env = dict(os.environ, DG_JIT_CACHE_DIR=str(tmp_path / 'jit_cache'),
               PYTHONPATH=ROOT + os.pathsep + os.environ.get('PYTHONPATH', ''))
    out = subprocess.run([sys.executable, '-c', script], capture_output=True, text=True, cwd=ROOT, env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result['dirs'][0] == result['dirs'][2] != result['dirs'][1]
    assert result['nvcc'] == 2
    for d in set(result['dirs']):
        with open(os.path.join(d, 'kernel.cubin'), 'rb') as f:
            assert f.read(4) == b'\x7fELF'


def test_prebuild_covers_every_kernel_the_launcher_picks():
    # scripts/prebuild_kernels.py's list (in a child: the script sets DG_JIT_CACHE_DIR on import)
    # is this file's, and every variant the launcher picks on an H200 (any n, a few model shapes,
    # either L2 width of DG_MEGA_MOE_L2_BLOCK_N) is in it
    script = ('import json, sys; sys.path.insert(0, "scripts"); import prebuild_kernels as p; '
              f'print(json.dumps(p.variants({FORMATS!r})))')
    out = subprocess.run([sys.executable, '-c', script], capture_output=True, text=True, check=True, cwd=ROOT,
                         env=dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get('PYTHONPATH', '')))
    prebuilt = {tuple(k) for k in json.loads(out.stdout)}
    ours = {(mma_type_to_int(f), m, s, fast, n, w, sig, pair) for f, m, s, fast, n, w, sig, pair in _variants()}
    assert prebuilt == ours
    picked, widths, wide_ns, signals, pairs = set(), set(), set(), set(), set()
    shapes = [(256, 6, 4096, 2048), (128, 8, 2048, 768), (256, 8, 7168, 2048), (64, 4, 1024, 512)]
    for fmt in FORMATS:
        for num_experts, topk, hidden, inter in shapes:
            for num_ranks in (1, 8):
                for n in [0] + [1 << i for i in range(17)]:
                    v = _C.get_mega_moe_kernel_variant(mma_type_to_int(fmt), num_ranks, num_experts, topk, hidden,
                                                       inter, n, 132, H200_SMEM, True)
                    c = _C.get_mega_moe_config(mma_type_to_int(fmt), num_ranks, num_experts, topk, hidden, inter, n,
                                               132, H200_SMEM)   # the heuristic's
                    widths.add(c['block_n_l2'])
                    wide_ns.add(c['wide_n_min'])
                    signals.add(c['signals_thread'])
                    pairs.add(c['cta_pair'])
                    assert v['signals_thread'] == c['signals_thread'] and v['cta_pair'] == c['cta_pair']
                    for fast in (True, False):   # the heuristic's own kernel
                        picked.add((v['mma_type'], c['block_m'], c['num_stages'], fast, c['block_n_l2'], c['wide_n_min'],
                                    c['signals_thread'], c['cta_pair']))
                    fp4_decode = fmt == 'fp8xfp4' and v['block_m'] == 64
                    for pair in (False, True) if fp4_decode else (False,):   # heuristic or DG_MEGA_MOE_CTA_PAIR
                        p = _C.get_mega_moe_config(mma_type_to_int(fmt), num_ranks, num_experts, topk, hidden, inter, n,
                                                   132, H200_SMEM, cta_pair=int(pair))
                        for width in l2_widths(fmt, v['block_m']):   # heuristic or override
                            for wide_n_min in (64, 16, 32) if fp4_decode else (64,):
                                for sig in (False, True) if fp4_decode else (False,):
                                    for fast in (True, False):
                                        picked.add((v['mma_type'], v['block_m'], p['num_stages'], fast, width, wide_n_min, sig,
                                                    p['cta_pair']))
    # DG_MEGA_MOE_WIDE_N=32 picks kernels no prebuild carries (a tuning aid: compiled on first use)
    assert {p for p in picked if p[5] != 32} <= prebuilt, {p for p in picked if p[5] != 32} - prebuilt
    assert widths == {128, 256, 512}, 'the sweep should meet every width'
    assert wide_ns == {64, 16}, 'the sweep should meet both FP8 x FP4 decode kernels'
    assert signals == {False, True}, 'the sweep should meet the kernels with and without the signals thread'
    assert pairs == {False, True}, 'the sweep should meet the CTA-pair kernels'


def test_virtual_ranks_prepare_every_variant_before_the_first_launch(monkeypatch, requires_nvcc):
    # test_mid_shape[4-ns3-fp8xfp8] (n = [64, 7, 0, 1024] on 4 virtual ranks of an H200): rank 1's
    # kernel is the 256-wide one, which no earlier case uses. Prepared inside rank 1's launch (its
    # JIT compile, or only its module load: CUDA's lazy loading may synchronize the device), it
    # kept rank 0's already running kernel waiting for rank 3's counts past its spin-wait bound
    # (every rank timed out "waiting for receive counts", y left NaN; seen on the H200). So
    # run_ranks prepares (compiles and, on a GPU, loads) every rank's variant first, then launches
    # (here: CPU stand-ins for the GPU, so nothing is loaded)
    import contextlib

    import torch

    from deep_gemm.mega import api, launch
    from deep_gemm.testing import moe_case, virtual_ranks
    hidden, inter, experts, topk, ns = 2048, 768, 128, 8, [64, 7, 0, 1024]
    bufs = virtual_ranks.make_virtual_ranks(4, experts, max(ns), topk, hidden, inter, 'fp8xfp8', device='cpu')
    for b in bufs:
        b.num_sms = 132 // 4
    inputs = moe_case.make_inputs('fp8xfp8', ns, hidden, experts, topk, seed=7, device='cpu')
    events = []
    prepare_mega_moe = _C.prepare_mega_moe

    class Recorder:   # pybind functions cannot be wrapped in place: stand in for the module
        def __getattr__(self, name):
            return getattr(_C, name)

        @staticmethod
        def prepare_mega_moe(*args, **kwargs):
            events.append(('prepare', args, kwargs))
            return prepare_mega_moe(*args, **kwargs)
    monkeypatch.setattr(launch, '_C', Recorder())
    monkeypatch.setattr(launch, '_max_smem', lambda device: H200_SMEM)
    monkeypatch.setattr(launch, '_compiled_calls', set())
    monkeypatch.setattr(api, 'mega_moe_function', lambda t: lambda y, *a, **k: events.append(('launch', y.shape[0])))

    class Streams:
        def __init__(self, n):
            pass

        def fork(self):
            pass
        join = fork

        def __getitem__(self, r):
            return None
    monkeypatch.setattr(torch.cuda, 'stream', lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, 'synchronize', lambda *a: None)
    moe_case.run_ranks(_FakeWeights('fp8xfp8', 4), inputs, bufs, streams=Streams(4))
    kinds = [e[0] for e in events]
    assert kinds == ['prepare'] * 4 + ['launch'] * 4
    args = [e[1] for e in events[:4]]
    assert [a[-1] for a in args] == [False] * 4, 'CPU buffers: compiled, not loaded'
    # The kernels the launcher picks per rank (mma_type, ..., num_tokens, num_sms, max_smem, fast_math)
    # virtual ranks share the GPU; CPU buffers: no device, bandwidth unknown (0)
    assert [e[2] for e in events[:4]] == [{'ranks_share_gpu': True, 'hbm_gbps': 0}] * 4
    variants = [_C.get_mega_moe_kernel_variant(*a[:-1], ranks_share_gpu=True, hbm_gbps=0) for a in args]
    assert [v['block_m'] for v in variants] == [64, 64, 64, 128]
    assert [v['block_n_l2'] for v in variants] == [512, 256, 128, 256]   # rank 3: 1024 tokens on 33 SMs, 256-wide prefill L2 tasks
    assert [a[6] for a in args] == ns
    assert [e[1] for e in events[4:]] == ns


def test_virtual_ranks_leave_out_the_cta_pair():
    # test_mid_shape[4-ns3-fp8xfp4] (n = [64, 7, 0, 1024] on 4 virtual ranks of an H200): rank 1 alone
    # would take the CTA pair (1.75 expected tokens per expert, 44 tasks per SM), ranks 0 / 3 the
    # one-CTA-an-SM kernels; launched side by side on one GPU, the pair's 66 CTAs spread over 66 SMs
    # and left ranks 2-3 without SMs: every rank timed out, y left NaN (seen on the H200). Ranks that
    # share the GPU (a slice of its SMs each) never get the pair from the heuristic
    from deep_gemm.mega import launch
    from deep_gemm.testing import virtual_ranks
    args = lambda n: (mma_type_to_int('fp8xfp4'), 4, 128, 8, 2048, 768, n, 33, H200_SMEM, True)
    assert _C.get_mega_moe_kernel_variant(*args(7))['cta_pair'], 'rank 1 on a GPU of its own: the pair'
    assert not any(_C.get_mega_moe_kernel_variant(*args(n), ranks_share_gpu=True)['cta_pair'] for n in (64, 7, 0, 1024))
    bufs = virtual_ranks.make_virtual_ranks(4, 128, 1024, 8, 2048, 768, 'fp8xfp4', device='cpu')
    assert not any(launch.ranks_share_gpu(b) for b in bufs), 'no SM slice given (CPU buffers): not virtual'
    for b in bufs:
        b.num_sms = 33
    assert all(launch.ranks_share_gpu(b) for b in bufs)
    one = virtual_ranks.make_virtual_ranks(1, 128, 16, 8, 2048, 768, 'fp8xfp4', device='cpu')[0]
    one.num_sms = 8
    assert not launch.ranks_share_gpu(one), 'one rank: the GPU is its own'


def test_prepare_mega_moe_compiles_the_launched_variant(requires_nvcc):
    # prepare_mega_moe compiles exactly the kernel get_mega_moe_kernel_variant names (load=False:
    # no GPU needed); the cache directory is that variant's
    args = (mma_type_to_int('fp8xfp8'), 4, 128, 8, 2048, 768, 7, 33, H200_SMEM, True)
    path = _C.prepare_mega_moe(*args, False)
    v = _C.get_mega_moe_kernel_variant(*args)
    assert v['name'] in path and v['block_n_l2'] == 256
    with pytest.raises(ValueError, match='mma_type'):
        _C.prepare_mega_moe(7, *args[1:], False)


class _FakeWeights:
    def __init__(self, mma_type, ranks):
        self.mma_type = mma_type
        self.per_rank = [(None, None)] * ranks


def test_task_log_variant_compiles_apart(requires_nvcc):
    """DG_MEGA_MOE_TASK_LOG=1 (scripts/trace.py --tasks) and =2 (--tasks-light: per-task stamps only)
    build kernels of their own (name suffixes `_tasklog`, `_tasklight`, cache entries apart), so the
    task log's stamps stay out of every other variant's SASS; any other value than 0 / 1 / 2 is
    refused by name. In a child: the variable is read once per process."""
    code = ("import os; from deep_gemm import _C; from deep_gemm.mega.buffer import mma_type_to_int; "
            "print(_C.compile_mega_moe(mma_type_to_int('fp8xfp8'), 64, 5, True, 128, 64))")
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get('PYTHONPATH', ''))
    dirs = {}
    for level, suffix in (('1', 'tasklog'), ('2', 'tasklight')):
        env['DG_MEGA_MOE_TASK_LOG'] = level
        run = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, env=env, timeout=600)
        assert run.returncode == 0, run.stderr[-3000:]
        dirs[level] = kernel_dir = run.stdout.strip().splitlines()[-1]
        assert os.path.basename(kernel_dir).split('_')[-2] == suffix, kernel_dir
        with open(os.path.join(kernel_dir, 'kernel.cubin'), 'rb') as f:
            assert f.read(4) == b'\x7fELF'
        with open(os.path.join(kernel_dir, 'kernel.cu')) as f:
            assert f'#define DG_MEGA_MOE_TASK_LOG {level}' in f.read()
    plain = _C.compile_mega_moe(mma_type_to_int('fp8xfp8'), 64, 5, True, 128, 64)
    assert '_task' not in os.path.basename(plain) and plain not in dirs.values() and dirs['1'] != dirs['2']
    env['DG_MEGA_MOE_TASK_LOG'] = 'yes'
    run = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, env=env, timeout=600)
    assert run.returncode != 0 and 'DG_MEGA_MOE_TASK_LOG' in run.stderr, run.stderr[-2000:]


def _stage_reads_after_release(source):
    """(line of the release, name, line of the read) for every read of a ring stage after a math
    loop's `release_stage(...)` and before the end of the block it sits in (its K-block's body)."""
    import re
    code = re.sub(r'//[^\n]*', lambda m: ' ' * len(m.group(0)), source)   # comments out, offsets kept
    reads = re.compile(r'\b(token_sf|weight_sf|stage_sf|stage_deltas|stage_a|stage_b|mma_b|wide_token_sf|narrow_fp4_load|'
                       r'narrow_fp4_k_block|wide_fp4_k_block_pair|fma_k_block|narrow_l2_fma)\s*\(')
    found = []
    for call in re.finditer(r'(?<![\w:])release_stage\(', code):
        if re.match(r'\s*uint32_t', code[call.end():]):   # the definition
            continue
        depth, i = 0, call.end()
        while i < len(code) and not (code[i] == '}' and depth == 0):
            depth += {'{': 1, '}': -1}.get(code[i], 0)
            i += 1
        line = code.count('\n', 0, call.start()) + 1
        found += [(line, r.group(1), code.count('\n', 0, call.end() + r.start()) + 1) for r in reads.finditer(code, call.end(), i)]
    return found


def test_no_stage_read_after_its_release():
    # A math loop releases its stage (the empty mbarrier) once every read of it is done: the producer
    # may refill it at once. Session 33: the CTA pair's narrow L2 loop read the stage's scales after
    # the release; with its 2 stages the producer could win (calc_diff 6.7e-03 under racecheck's
    # timing, right natively, so the GPU suite passed). Source-level: every release in the kernel
    # is the last stage access of its K-block's body
    path = os.path.join(ROOT, 'deep_gemm', 'include', 'deep_gemm', 'impls', 'sm90_fp8_mega_moe.cuh')
    with open(path) as f:
        source = f.read()
    assert source.count('release_stage(') >= 10, 'the kernel releases its stages through release_stage'
    assert _stage_reads_after_release(source) == []
    # the check itself: the session-33 form of the pair's L2 loop is caught
    bad = source.replace('''            release_stage(stage_iter, mt);
            #pragma unroll
            for (int h = 0; h < kHalves; ++h)
                #pragma unroll
                for (int i = 0; i < 4 * kL2Tiles; ++i) acc[4 * kL2Tiles * h + i] += part[h][i] * ((i & 1) ? s1[h] : s0[h]);''',
                         '''            release_stage(stage_iter, mt);
            for (int h = 0; h < kHalves; ++h) {
                const float sb = sm.weight_sf(s, kL2Tiles == 2 ? h : 0);
                const float s0 = sm.token_sf(s, o + nt.c0) * sb;
            }''')
    assert bad != source, 'the pair L2 loop changed: update this check'
    assert [name for _, name, _ in _stage_reads_after_release(bad)] == ['weight_sf', 'token_sf']


# The weights-first kernel (impls/sm90_mega_moe_ws.cuh): every variant the launcher picks with the
# default fast math at the benchmark's and the GPU tests' shapes (FP8 x FP8 at 6 stages, BF16 at 6,
# or 5 where the intermediate side is 2048, FP8 x FP4 at 8; test_weights_first_picks_are_compiled_here
# keeps this list complete; a wider intermediate side takes fewer stages, compiled on first use), and
# each format with exact math at one of its stage counts (nvcc time in CI)
WS_COMPILED = [('fp8xfp8', 6, True), ('fp8xfp8', 6, False), ('bf16xbf16', 5, True), ('bf16xbf16', 6, True),
               ('bf16xbf16', 6, False), ('fp8xfp4', 8, True), ('fp8xfp4', 8, False)]


def test_weights_first_picks_are_compiled_here():
    # The launcher's weights-first picks (forced on, H200 and H100 shared memory alike: 232448 bytes)
    # at the benchmark's shapes and the GPU tests' small one, all among the variants the next test compiles
    old = _C.set_mega_moe_weights_first(1)
    try:
        picks = set()
        for fmt in ('fp8xfp8', 'bf16xbf16', 'fp8xfp4'):
            for e, k, h, i in ((128, 8, 2048, 768), (256, 6, 4096, 2048), (256, 8, 7168, 2048), (16, 4, 512, 256)):
                v = _C.get_mega_moe_kernel_variant(mma_type_to_int(fmt), 1, e, k, h, i, 1, 132, 232448)
                if v['weights_first']:
                    picks.add((fmt, v['num_stages'], True))
    finally:
        _C.set_mega_moe_weights_first(old)
    assert {f for f, _, _ in picks} == {'fp8xfp8', 'bf16xbf16', 'fp8xfp4'}, picks
    assert picks <= set(WS_COMPILED), sorted(picks - set(WS_COMPILED))


@pytest.mark.parametrize('fmt, stages, fast', WS_COMPILED)
def test_weights_first_kernel_compiles_for_sm90a(fmt, stages, fast, requires_nvcc):
    kernel_dir = _C.compile_mega_moe(mma_type_to_int(fmt), 64, stages, fast, 128, 64, False, False, True)
    assert os.path.basename(kernel_dir).startswith(f'sm90_mega_moe_ws_{fmt}_s{stages}_{"fast" if fast else "exact"}')
    sass = _sass_of(kernel_dir)
    assert ('HGMMA' if fmt == 'bf16xbf16' else 'QGMMA') in sass
    assert 'UTMALDG' in sass and 'ACQBULK' in sass and 'PREEXIT' not in sass
    assert not re.search(r'\b(LDL|STL)\b', sass), 'the weights-first kernel keeps everything in registers'
    if fmt == 'fp8xfp4':
        # A from registers: the E4M3 fragments expanded by the math threads (PRMT), no E4M3 tile in
        # shared memory; the deltas by bulk copy (UBLKCP) beside the codes' tensor copy
        assert 'PRMT' in sass and 'UBLKCP' in sass


# DG_MEGA_MOE_TASK_LOG=1 (read once per process: a child) builds the weights-first kernel's `_tasklog`
# variant with its stage log (scripts/trace.py --tasks); the stamps stay out of every other variant
def test_weights_first_tasklog_variant_compiles(requires_nvcc):
    script = r'''
import json
from deep_gemm import _C
print(json.dumps([_C.compile_mega_moe(fmt, 64, stages, True, 128, 64, False, False, True) for fmt, stages in ((0, 8), (1, 6))]))
'''
    env = dict(os.environ, DG_MEGA_MOE_TASK_LOG='1', PYTHONPATH=ROOT + os.pathsep + os.environ.get('PYTHONPATH', ''))
    out = subprocess.run([sys.executable, '-c', script], capture_output=True, text=True, check=True, cwd=ROOT, env=env)
    for kernel_dir, fmt in zip(json.loads(out.stdout.strip().splitlines()[-1]), ('fp8xfp4', 'fp8xfp8')):
        assert os.path.basename(kernel_dir).startswith(f'sm90_mega_moe_ws_{fmt}_s')
        assert '_fast_tasklog_' in os.path.basename(kernel_dir)
        sass = _sass_of(kernel_dir)
        assert 'QGMMA' in sass and not re.search(r'\b(LDL|STL)\b', sass)
        # the stage log's stamps: more %globaltimer reads than the untraced kernel's
        plain = _C.compile_mega_moe(mma_type_to_int(fmt), 64, 8 if fmt == 'fp8xfp4' else 6, True, 128, 64, False, False, True)
        assert '_tasklog' not in plain
        assert sass.count('GLOBALTIMER') > _sass_of(plain).count('GLOBALTIMER')


def test_weights_first_variant_is_picked_only_where_it_can_run():
    # DG_MEGA_MOE_WEIGHTS_FIRST is read once per process: a child process with it set
    script = r'''
import json
from deep_gemm import _C
out = []
for fmt in (0, 1, 2):
    for ranks in (1, 2):
        for (e, k, h, i) in ((128, 8, 2048, 768), (256, 6, 4096, 2048), (256, 8, 7168, 2048), (16, 4, 512, 256), (16, 4, 384, 256)):
            for n in (0, 1, 2, 3):
                v = _C.get_mega_moe_kernel_variant(fmt, ranks, e, k, h, i, n, 132, 232448)
                out.append([fmt, ranks, e, k, h, i, n, v['weights_first'], v['name'], v['num_stages']])
print(json.dumps(out))
'''
    for setting in ('1', '0', None):   # None: unset, the default (on)
        env = {key: v for key, v in os.environ.items() if key != 'DG_MEGA_MOE_WEIGHTS_FIRST'}
        if setting is not None:
            env['DG_MEGA_MOE_WEIGHTS_FIRST'] = setting
        out = subprocess.run([sys.executable, '-c', script], capture_output=True, text=True, check=True, cwd=ROOT,
                             env=dict(env, PYTHONPATH=ROOT + os.pathsep + os.environ.get('PYTHONPATH', '')))
        for fmt, ranks, e, k, h, i, n, ws, name, stages in json.loads(out.stdout):
            # FP8 x FP4 (fmt 0) only when asked: its weights-first kernel is faster at the mid shape only
            asked = setting == '1' or (setting is None and fmt in (1, 2))
            expected = asked and ranks == 1 and 1 <= n and n * k <= 8 and h % 256 == 0
            assert ws == expected, (setting, fmt, ranks, e, k, h, i, n)
            assert name.startswith('sm90_mega_moe_ws_') == ws
            if ws:   # the most stages whose shared memory fits an H200's 227 KB (at most 8: FP8 x FP4's 17 KB stages)
                assert stages == (8 if fmt == 0 else 5 if fmt == 2 and i == 2048 else 6), (fmt, h, i, stages)
