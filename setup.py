"""Build `deep_gemm._C` (C++20, pybind11, no link to libcuda/libnvrtc) and ship the device headers.

The CUDA driver is opened with dlopen at run time and kernels are compiled by nvcc on first use
(JIT), so the package installs and imports on a machine with no GPU.
"""
import importlib.util
import os

from pybind11.setup_helpers import Pybind11Extension, build_ext
from setuptools import find_packages, setup


def find_cuda_home() -> str:
    spec = importlib.util.spec_from_file_location('_dg_cuda_home', os.path.join('deep_gemm', 'cuda_home.py'))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    home = module.find_cuda_home()
    assert home, 'CUDA toolkit not found (nvcc and cuda.h): set CUDA_HOME to a CUDA 12.8+ toolkit'
    return home


def package_headers() -> list:
    root = os.path.join('deep_gemm', 'include')
    return [os.path.relpath(os.path.join(d, f), 'deep_gemm')
            for d, _, files in os.walk(root) for f in files if f.endswith(('.cuh', '.hpp', '.h'))]


def csrc_headers() -> list:
    # Header-only C++: list them so that `build_ext` rebuilds when any of them changes
    return [os.path.join(d, f) for root in ('csrc', os.path.join('deep_gemm', 'include'))
            for d, _, files in os.walk(root) for f in files if f.endswith(('.hpp', '.cuh', '.h'))]


cuda_home = find_cuda_home()
ext = Pybind11Extension(
    'deep_gemm._C',
    ['csrc/python_api.cpp'],
    include_dirs=['csrc', 'deep_gemm/include', os.path.join(cuda_home, 'include')],
    cxx_std=20,
    extra_compile_args=['-O2', '-Wno-unused-function'],
    # A compiler newer than the process's libstdc++ inlines stream code that the older runtime's
    # locale facets do not match (seen as a crash in `ostream << int`): link libstdc++ statically
    # then (DG_STATIC_LIBSTDCXX=1), or build with the system compiler.
    extra_link_args=['-static-libstdc++', '-static-libgcc'] if os.environ.get('DG_STATIC_LIBSTDCXX') == '1' else [],
    libraries=['dl'],
    depends=csrc_headers(),
)

setup(
    name='deep_gemm',
    version='0.1.0',
    description='Fused expert-parallel Mixture-of-Experts kernels for NVIDIA Hopper (SM90)',
    packages=find_packages(include=['deep_gemm', 'deep_gemm.*']),
    package_data={'deep_gemm': package_headers()},
    ext_modules=[ext],
    cmdclass={'build_ext': build_ext},
    python_requires='>=3.10',
    install_requires=['numpy'],
    zip_safe=False,
)
