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
