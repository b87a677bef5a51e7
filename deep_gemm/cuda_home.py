"""Locate the CUDA toolkit (nvcc, cuda.h). Imported by setup.py by path, so it imports nothing of ours."""
import os
import shutil
from typing import Optional


def find_cuda_home() -> Optional[str]:
    """Return the CUDA toolkit root holding `bin/nvcc` and `include/cuda.h`, or None.

    Order: `CUDA_HOME`, `CUDA_PATH`, the toolkit of the `nvcc` on PATH (wrapper scripts included),
    `/usr/local/cuda`, the newest `/usr/local/cuda-*`.
    """
    candidates = [os.environ.get('CUDA_HOME'), os.environ.get('CUDA_PATH')]
    nvcc = shutil.which('nvcc')
    if nvcc:
        candidates.append(os.path.dirname(os.path.dirname(os.path.realpath(nvcc))))
        try:  # a wrapper script such as `exec /usr/local/cuda-13.0/bin/nvcc "$@"`
            with open(nvcc, 'rb') as f:
                head = f.read(4096)
            if head.startswith(b'#!'):
                for word in head.decode(errors='ignore').split():
                    if word.endswith('/bin/nvcc'):
                        candidates.append(os.path.dirname(os.path.dirname(word)))
        except OSError:
            pass
    candidates.append('/usr/local/cuda')
    if os.path.isdir('/usr/local'):
        candidates += sorted((os.path.join('/usr/local', d) for d in os.listdir('/usr/local')
                              if d.startswith('cuda-')), reverse=True)
    for home in candidates:
        if home and os.path.isfile(os.path.join(home, 'include', 'cuda.h')) \
                and os.path.isfile(os.path.join(home, 'bin', 'nvcc')):
            return home
    return None
