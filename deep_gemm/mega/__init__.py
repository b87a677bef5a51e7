"""Mega MoE: the symmetric buffer, the weight transforms and the fused MoE entry points.

    buf = get_symm_buffer_for_mega_moe(group, num_experts, num_max_tokens_per_rank, num_topk,
                                       hidden, intermediate_hidden, mma_type="fp8xfp4")
    l1, l2 = transform_weights_for_mega_moe(l1_weights, l2_weights)
    prepare_mega_moe_kernels(buf)         # optional: every kernel loaded up front (CUDA graphs)
    fp8_fp4_mega_moe(y, l1, l2, buf)      # or fp8_mega_moe / bf16_mega_moe
"""
from .api import bf16_mega_moe, fp8_fp4_mega_moe, fp8_mega_moe, prepare_mega_moe_kernels
from .buffer import (MMA_TYPES, SymmBuffer, get_mega_moe_layout, get_symm_buffer_for_mega_moe,
                     get_symm_buffer_size_for_mega_moe, mma_type_to_int)
from .transform import (dequant_mega_moe_fp4, fp4_expansion_table, fp4_packed_byte_position, fp4_sign_bit_position,
                        inverse_transform_weights_for_mega_moe, mxfp4_transform_error, transform_weights_for_mega_moe)

__all__ = [
    'MMA_TYPES',
    'SymmBuffer',
    'bf16_mega_moe',
    'dequant_mega_moe_fp4',
    'fp4_expansion_table',
    'fp4_packed_byte_position',
    'fp4_sign_bit_position',
    'fp8_fp4_mega_moe',
    'fp8_mega_moe',
    'get_mega_moe_layout',
    'get_symm_buffer_for_mega_moe',
    'get_symm_buffer_size_for_mega_moe',
    'inverse_transform_weights_for_mega_moe',
    'mma_type_to_int',
    'mxfp4_transform_error',
    'prepare_mega_moe_kernels',
    'transform_weights_for_mega_moe',
]
