"""Quantize / pack helpers for the Mega MoE number formats (FP8 E4M3 per token / per block, MXFP4)."""

from .quant import (
    E2M1_MAX,
    E2M1_VALUES,
    FP8_AMAX_EPS,
    FP8_E4M3_MAX,
    FP8_SCALE_GROUP,
    MXFP4_GROUP,
    UE8M0_BIAS,
    cast_to_mxfp4,
    dequant_mxfp4,
    dequant_per_block_fp8,
    dequant_per_token_fp8,
    e4m3_quantize_with_amax,
    per_block_cast_to_fp8,
    per_token_cast_to_fp8,
)

__all__ = [
    "E2M1_MAX",
    "E2M1_VALUES",
    "FP8_AMAX_EPS",
    "FP8_E4M3_MAX",
    "FP8_SCALE_GROUP",
    "MXFP4_GROUP",
    "UE8M0_BIAS",
    "cast_to_mxfp4",
    "dequant_mxfp4",
    "dequant_per_block_fp8",
    "dequant_per_token_fp8",
    "e4m3_quantize_with_amax",
    "per_block_cast_to_fp8",
    "per_token_cast_to_fp8",
]
