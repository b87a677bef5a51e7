"""Shared pytest fixtures.

CPU tests always run; tests that need nvcc or a Hopper GPU ask for the `requires_nvcc` /
`requires_sm90` fixtures and skip with a reason when those are missing.
"""
import os
import shutil
import sys

import pytest
import torch

# `python -m pytest` from the repo root already finds the in-place build; plain `pytest` may not
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)

from deep_gemm import _C  # noqa: E402
from deep_gemm.cuda_home import find_cuda_home  # noqa: E402


def nvcc_path():
    """The nvcc the JIT would use (DG_NVCC, else the CUDA toolkit's), or None."""
    if os.environ.get('DG_NVCC'):
        return os.environ['DG_NVCC']
    home = find_cuda_home()
    return os.path.join(home, 'bin', 'nvcc') if home else None


def cuobjdump_path():
    """A cuobjdump: the CUDA toolkit's, one on PATH, or the nvidia-cuda-cuobjdump wheel's; or None."""
    candidates = [shutil.which('cuobjdump')]
    home = find_cuda_home()
    if home:
        candidates.append(os.path.join(home, 'bin', 'cuobjdump'))
    try:
        import nvidia.cu13
        candidates += [os.path.join(d, 'bin', 'cuobjdump') for d in nvidia.cu13.__path__]
    except ImportError:
        pass
    return next((c for c in candidates if c and os.path.isfile(c)), None)


requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
# CPU always; the GPU too where there is one (helpers that run on either device)
DEVICES = ["cpu", pytest.param("cuda", marks=requires_cuda)]


def sm90_gpu_available() -> bool:
    """A Hopper GPU that torch can use (tests allocate their tensors with torch)."""
    if not _C.has_cuda_driver():
        return False
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


@pytest.fixture
def requires_nvcc():
    """Skip unless a CUDA toolkit (nvcc) is available for JIT compilation."""
    path = nvcc_path()
    if not path or not os.path.isfile(path):
        pytest.skip('nvcc not found (set CUDA_HOME or DG_NVCC)')
    return path


@pytest.fixture
def requires_sm90():
    """Skip unless an SM90 (Hopper) GPU, its driver and CUDA-enabled torch are present."""
    if not sm90_gpu_available():
        pytest.skip('needs an SM90 (Hopper) GPU with a CUDA driver and CUDA-enabled torch')


@pytest.fixture
def persistent_kernel():
    """The persistent kernel for every call of a test (suites of that kernel: their one-token EP1
    FP8 / BF16 calls would otherwise run the weights-first kernel, on by default; its own suite is
    tests/test_weights_first_gpu.py)."""
    old = _C.set_mega_moe_weights_first(0)
    yield
    _C.set_mega_moe_weights_first(old)


@pytest.fixture
def jit_cache_dir(tmp_path):
    """A private, empty JIT cache for one test; the process-wide setting is restored after it."""
    import deep_gemm.jit
    deep_gemm.jit.init()
    cache = tmp_path / 'jit_cache'
    _C.set_cache_dir(str(cache))
    yield cache
    _C.set_cache_dir('')


# Worst calc_diff per format seen by the GPU tests, printed at the end of the run (the note and
# docs/PERF.md quote it)
WORST_DIFF = {}


def record_diff(mma_type: str, diff: float) -> None:
    WORST_DIFF[mma_type] = max(WORST_DIFF.get(mma_type, 0.0), diff)


def pytest_configure(config):
    # `-k <format>` selects that format's GPU tests (a device call that runs one format's tests relies
    # on it): a test whose id does not name its format carries it as a marker, `@pytest.mark.fp8xfp4`
    # (tests/test_scripts_cpu.py checks that every GPU test is selected so)
    from deep_gemm.testing import MMA_TYPES
    for mma_type in MMA_TYPES:
        config.addinivalue_line('markers', f'{mma_type}: a GPU test of the {mma_type} format whose id does not name it')


def pytest_terminal_summary(terminalreporter):
    if WORST_DIFF:
        terminalreporter.write_line('worst calc_diff per format: ' +
                                    ', '.join(f'{k} {v:.3e}' for k, v in sorted(WORST_DIFF.items())))
