"""deep_gemm: the whole Mixture-of-Experts layer in one persistent kernel on NVIDIA Hopper (SM90).

Public surface (DeepGEMM's Mega MoE API):

    get_symm_buffer_for_mega_moe, get_symm_buffer_size_for_mega_moe, SymmBuffer
    transform_weights_for_mega_moe, inverse_transform_weights_for_mega_moe
    fp8_fp4_mega_moe, fp8_mega_moe, bf16_mega_moe, prepare_mega_moe_kernels
    set_num_sms, get_num_sms, set_timeout, get_timeout, MegaMoEError
    utils (quantization helpers), testing (reference MoE, calc_diff, virtual ranks)

Kernels are compiled on first use (nvcc, sm_90a) into DG_JIT_CACHE_DIR; importing needs no GPU.
"""
from . import jit as _jit

_jit.init()

from . import _C  # noqa: E402
from .mega import (MMA_TYPES, SymmBuffer, bf16_mega_moe, fp8_fp4_mega_moe, fp8_mega_moe,  # noqa: E402
                   get_symm_buffer_for_mega_moe, get_symm_buffer_size_for_mega_moe,
                   inverse_transform_weights_for_mega_moe, prepare_mega_moe_kernels,
                   transform_weights_for_mega_moe)
from .mega.status import MegaMoEError, get_timeout, set_timeout  # noqa: E402
from . import testing, utils  # noqa: E402

__version__ = '0.1.0'


def set_num_sms(num_sms: int) -> None:
    """Use at most `num_sms` SMs for the persistent grid (0 = all of the device's)."""
    _C.set_num_sms(num_sms)


def get_num_sms() -> int:
    """SMs the persistent grid uses (the setting, else the current device's count)."""
    return _C.get_num_sms()


__all__ = [
    'MMA_TYPES', 'MegaMoEError', 'SymmBuffer', 'bf16_mega_moe', 'fp8_fp4_mega_moe', 'fp8_mega_moe',
    'get_num_sms', 'get_symm_buffer_for_mega_moe', 'get_symm_buffer_size_for_mega_moe', 'get_timeout',
    'inverse_transform_weights_for_mega_moe', 'prepare_mega_moe_kernels', 'set_num_sms', 'set_timeout', 'testing',
    'transform_weights_for_mega_moe', 'utils',
]
