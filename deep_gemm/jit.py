"""JIT compilation of the Mega MoE kernels (nvcc, sm_90a) and its settings.

Kernels are generated from the device headers under `deep_gemm/include/deep_gemm/` with their
config as template arguments, compiled by nvcc on first use into an on-disk cache, and loaded
through the CUDA driver API opened at run time (never linked): the package imports, and kernels
compile, on machines with no GPU.

A cache entry is `<cache dir>/cache/<name>_<key>/kernel.cubin`, where `key` hashes the generated
source, the nvcc flags, `nvcc --version` and every header under `deep_gemm/include` (so editing a
header invalidates it). Entries are written to a temporary directory and renamed into place, so
several processes may compile at once. Deleting the cache directory is always safe.

Settings (environment variables, read by `init()` or at each compilation as noted):

`DG_JIT_CACHE_DIR`
    Cache root (default `~/.deep_gemm`). Read by `init()`; `deep_gemm._C.set_cache_dir` overrides it.
`DG_JIT_DEBUG`
    `1`: print each cache hit/miss with its path, the nvcc command line and the compile time to
    stderr, and keep the generated source of a failed compilation. Read at each compilation.
`DG_JIT_PTXAS_VERBOSE`
    `1`: compile with `-Xptxas -v` and print ptxas's register/shared-memory/spill report to stderr
    (a different cache key, so already cached kernels are rebuilt once). Read at each compilation.
`DG_NVCC`
    Path of the nvcc to use instead of `<CUDA home>/bin/nvcc`. Read by `init()`.
`DG_CUTLASS_INCLUDE`
    CUTLASS/CuTe include directory; default: the `nvidia-cutlass` wheel's (module
    `cutlass_library`), else `$CUTLASS_HOME/include`, else none. Read by `init()`.

The CUDA toolkit is found by `deep_gemm.cuda_home.find_cuda_home()` (`CUDA_HOME`, `CUDA_PATH`,
the nvcc on `PATH`, `/usr/local/cuda*`).
"""
import importlib.util
import os
import threading
from typing import List, Optional

from . import _C
from .cuda_home import find_cuda_home

__all__ = ['init', 'compile_kernel', 'include_dir', 'find_cutlass_include']

_init_lock = threading.Lock()
_initialized = False


def include_dir() -> str:
    """Directory holding the `deep_gemm/...` device headers (passed to nvcc with `-I`)."""
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), 'include')


def find_cutlass_include() -> str:
    """CUTLASS/CuTe include directory, or '' if none is installed (the kernels do not need it).

    Order: `DG_CUTLASS_INCLUDE`, the `nvidia-cutlass` wheel (`cutlass_library/source/include`),
    `$CUTLASS_HOME/include`.
    """
    override = os.environ.get('DG_CUTLASS_INCLUDE')
    if override:
        return override
    spec = importlib.util.find_spec('cutlass_library')  # no import: the module pulls in a lot
    if spec is not None and spec.origin:
        candidate = os.path.join(os.path.dirname(spec.origin), 'source', 'include')
        if os.path.isdir(candidate):
            return candidate
    home = os.environ.get('CUTLASS_HOME')
    if home and os.path.isdir(os.path.join(home, 'include')):
        return os.path.join(home, 'include')
    return ''


def init(force: bool = False) -> None:
    """Hand the JIT its paths (device headers, CUDA toolkit, CUTLASS). Idempotent and cheap after
    the first call; `force=True` re-reads the environment (`DG_NVCC`, `DG_JIT_CACHE_DIR`, ...).

    A missing toolkit is not an error here (the package must import without one): compiling then
    raises a RuntimeError that says how to point the JIT at nvcc.
    """
    global _initialized
    with _init_lock:
        if _initialized and not force:
            return
        _C.init(include_dir(), find_cuda_home() or '', find_cutlass_include())
        _initialized = True


def compile_kernel(name: str, source: str, extra_flags: Optional[List[str]] = None) -> str:
    """Compile CUDA C++ `source` for sm_90a (or find it in the cache) and return the cache
    directory holding `kernel.cubin`.

    `name`: letters, digits and '_' (it names the cache directory). `extra_flags`: appended to the
    nvcc command line (part of the cache key). Raises RuntimeError with nvcc's output on failure.
    """
    init()
    return _C.compile(name, source, list(extra_flags or []))
