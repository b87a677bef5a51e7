"""Test helpers: reference MoE layers, calc_diff (and, in `virtual_ranks`, R ranks on one GPU)."""

from .reference import MMA_TYPES, calc_diff, reference_moe, reference_moe_emulated

__all__ = [
    "MMA_TYPES",
    "calc_diff",
    "reference_moe",
    "reference_moe_emulated",
]

from .virtual_ranks import VirtualRankStreams, make_virtual_ranks

__all__ += ["VirtualRankStreams", "make_virtual_ranks"]
