"""Every Mega MoE kernel variant the heuristics can pick compiles for sm_90a (DESIGN.md §5: CI
compiles every kernel variant it ships), on a machine without a GPU.

Variants: 3 formats x BLOCK_M {64, 128} (stage counts from the heuristics for an H100/H200) x
fast/exact SwiGLU, plus the two input-staging kernels. The SASS, where cuobjdump is available,
must hold the tensor-core instructions the format needs (QGMMA for FP8 operands, HGMMA for BF16)
and TMA loads (UTMALDG).
"""
import os
import subprocess

import pytest

from deep_gemm import _C
from deep_gemm.mega.buffer import mma_type_to_int

from conftest import cuobjdump_path

H200_SMEM = 232448


def _variants():
    seen = []
    for fmt in ('fp8xfp8', 'fp8xfp4', 'bf16xbf16'):
        for n in (1, 1 << 16):       # decode picks BLOCK_M 64, prefill 128
            c = _C.get_mega_moe_config(mma_type_to_int(fmt), 1, 256, 8, 7168, 2048, n, 132, H200_SMEM)
            for fast in (True, False):
                v = (fmt, c['block_m'], c['num_stages'], fast)
                if v not in seen:
                    seen.append(v)
    return seen


@pytest.mark.parametrize('variant', _variants(), ids=lambda v: f'{v[0]}-m{v[1]}-s{v[2]}-{"fast" if v[3] else "exact"}')
def test_mega_moe_variant_compiles_for_sm90a(variant, requires_nvcc):
    fmt, block_m, stages, fast = variant
    kernel_dir = _C.compile_mega_moe(mma_type_to_int(fmt), block_m, stages, fast)
    cubin = os.path.join(kernel_dir, 'kernel.cubin')
    with open(cubin, 'rb') as f:
        assert f.read(4) == b'\x7fELF'
    tool = cuobjdump_path()
    if tool is None:
        pytest.skip('cuobjdump not available: compiled, SASS not inspected')
    sass = subprocess.run([tool, '-sass', cubin], capture_output=True, text=True, check=True).stdout
    assert 'sm_90a' in subprocess.run([tool, '-elf', cubin], capture_output=True, text=True).stdout or 'SM90' in sass
    mma = 'HGMMA' if fmt == 'bf16xbf16' else 'QGMMA'
    assert mma in sass, f'{fmt}: no {mma} in the SASS'
    assert 'UTMALDG' in sass, 'no TMA loads in the SASS'


@pytest.mark.parametrize('fp8', [True, False])
def test_stage_kernel_compiles(fp8, requires_nvcc):
    kernel_dir = _C.compile_mega_moe_stage(fp8)
    with open(os.path.join(kernel_dir, 'kernel.cubin'), 'rb') as f:
        assert f.read(4) == b'\x7fELF'


class _FakeWeights:
    def __init__(self, mma_type, ranks):
        self.mma_type = mma_type
        self.per_rank = [(None, None)] * ranks


def test_virtual_ranks_compile_every_variant_before_the_first_launch(monkeypatch, requires_nvcc):
    # Ranks of one call pick kernels by their own n (here BLOCK_M 64 for n = 64, 7, 0 and 128 for
    # 1024 on 4 virtual ranks of an H200). A rank whose kernel is compiled inside its own launch keeps
    # the ranks launched before it waiting past their spin-wait bound (they time out, y stays
    # unwritten), so run_ranks compiles every rank's variant first, then launches (CPU stand-ins here)
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
    compile_mega_moe = _C.compile_mega_moe

    class Recorder:   # pybind functions cannot be wrapped in place: stand in for the module
        def __getattr__(self, name):
            return getattr(_C, name)

        @staticmethod
        def compile_mega_moe(*key):
            events.append(('compile', key))
            return compile_mega_moe(*key)
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
    assert kinds == ['compile'] * 4 + ['launch'] * 4
    # (mma_type, block_m, num_stages, fast_math) per rank: the kernels the launcher picks
    assert [e[1][1] for e in events[:4]] == [64, 64, 64, 128]
    assert [e[1] for e in events[4:]] == ns
