"""Reference MoE layers and the accuracy metric the Mega MoE tests use.

- `reference_moe`: the mathematical contract of one Mega MoE call (DESIGN.md §1), in float32 or
  float64, with no activation quantization.
- `reference_moe_emulated`: the same layer with the kernel's own rounding steps (FP8 / BF16
  activations, BF16 combine slots, float32 top-k sum in slot order), so that a kernel's error can be
  split into "quantization, expected" and "kernel bug".
- `calc_diff`: DeepGEMM-style similarity, ~ squared relative error.

All functions run on the device of their inputs. They validate routing on the host (one sync), so they
are for tests and benchmarks, not for a hot path.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F

from ..utils.quant import FP8_SCALE_GROUP, _check_tensor, dequant_per_token_fp8, per_token_cast_to_fp8

__all__ = ["MMA_TYPES", "reference_moe", "reference_moe_emulated", "calc_diff"]

# Weight/activation formats of one Mega MoE call (same names as the Python API's `mma_type`)
MMA_TYPES: Tuple[str, ...] = ("fp8xfp8", "fp8xfp4", "bf16xbf16")


# --------------------------------------------------------------------------------------------------
# Validation
# --------------------------------------------------------------------------------------------------

def _check_float(t: object, name: str, dim: int) -> torch.Tensor:
    t = _check_tensor(t, name)
    if not t.is_floating_point() or t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        raise TypeError(f"{name} must be a bfloat16/float16/float32/float64 tensor, got {t.dtype}")
    if t.dim() != dim:
        raise ValueError(f"{name} must have {dim} dims, got shape {tuple(t.shape)}")
    return t


def _check_clamp(activation_clamp: Optional[float]) -> Optional[float]:
    if activation_clamp is None:
        return None
    c = float(activation_clamp)
    if not c >= 0.0:  # also rejects NaN
        raise ValueError(f"activation_clamp must be None or >= 0, got {activation_clamp}")
    return c


def _check_routing(n: int, hidden: int, topk_idx: object, topk_weights: object,
                   l1_weights: object, l2_weights: object, device: torch.device) -> Tuple[int, int]:
    """Check shapes, dtypes and devices shared by both references; returns (num_experts, intermediate)."""
    topk_idx = _check_tensor(topk_idx, "topk_idx")
    if topk_idx.dtype != torch.int64:
        raise TypeError(f"topk_idx must be int64, got {topk_idx.dtype}")
    if topk_idx.dim() != 2 or topk_idx.shape[0] != n:
        raise ValueError(f"topk_idx must have shape [n={n}, topk], got {tuple(topk_idx.shape)}")
    topk_weights = _check_float(topk_weights, "topk_weights", 2)
    if tuple(topk_weights.shape) != tuple(topk_idx.shape):
        raise ValueError(f"topk_weights must have shape {tuple(topk_idx.shape)} like topk_idx, "
                         f"got {tuple(topk_weights.shape)}")
    l1 = _check_float(l1_weights, "l1_weights", 3)
    l2 = _check_float(l2_weights, "l2_weights", 3)
    num_experts = l1.shape[0]
    if l1.shape[1] % 2 != 0 or l1.shape[2] != hidden:
        raise ValueError(f"l1_weights must have shape [E, 2 * intermediate, hidden={hidden}], "
                         f"got {tuple(l1.shape)}")
    intermediate = l1.shape[1] // 2
    if tuple(l2.shape) != (num_experts, hidden, intermediate):
        raise ValueError(f"l2_weights must have shape [E={num_experts}, hidden={hidden}, "
                         f"intermediate={intermediate}], got {tuple(l2.shape)}")
    for name, t in (("topk_idx", topk_idx), ("topk_weights", topk_weights),
                    ("l1_weights", l1), ("l2_weights", l2)):
        if t.device != device:
            raise ValueError(f"{name} is on {t.device}, expected {device} like x")
    if topk_idx.numel() > 0:
        lo, hi = int(topk_idx.min()), int(topk_idx.max())
        if lo < -1 or hi >= num_experts:
            raise ValueError(f"topk_idx holds expert ids in [{lo}, {hi}], expected -1 (masked) or "
                             f"[0, {num_experts})")
    return num_experts, intermediate


def _tokens_per_expert(topk_idx: torch.Tensor,
                       num_experts: int) -> Dict[int, Tuple[torch.Tensor, torch.Tensor]]:
    """Group valid (token, slot) pairs by expert: {expert: (token indices, slot indices)}, in
    increasing (token, slot) order; experts that receive nothing are absent."""
    valid = topk_idx >= 0
    tokens, slots = valid.nonzero(as_tuple=True)
    experts = topk_idx[tokens, slots]
    order = torch.sort(experts, stable=True).indices
    tokens, slots, experts = tokens[order], slots[order], experts[order]
    counts: List[int] = torch.bincount(experts, minlength=num_experts).tolist()
    groups: Dict[int, Tuple[torch.Tensor, torch.Tensor]] = {}
    start = 0
    for e, c in enumerate(counts):
        if c > 0:
            groups[e] = (tokens[start:start + c], slots[start:start + c])
        start += c
    return groups


def _swiglu(h: torch.Tensor, intermediate: int, weights: torch.Tensor,
            activation_clamp: Optional[float]) -> torch.Tensor:
    """`silu(gate) * up * weight` for h = [gate | up] of shape [m, 2I]; weights [m]."""
    gate, up = h[:, :intermediate], h[:, intermediate:]
    if activation_clamp is not None:
        gate = gate.clamp(max=activation_clamp)
        up = up.clamp(-activation_clamp, activation_clamp)
    return F.silu(gate) * up * weights.unsqueeze(1)


# --------------------------------------------------------------------------------------------------
# References
# --------------------------------------------------------------------------------------------------

def reference_moe(x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                  l1_weights: torch.Tensor, l2_weights: torch.Tensor,
                  activation_clamp: Optional[float] = None, *,
                  dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Unquantized MoE layer: the contract of one Mega MoE call.

    For each token t and slot k with expert e = topk_idx[t, k] != -1::

        h = x[t] @ l1[e].T;  gate, up = h[:I], h[I:]
        if activation_clamp is not None: gate = min(gate, c); up = clamp(up, -c, c)
        a = silu(gate) * up * topk_weights[t, k]
        y[t] += a @ l2[e].T

    Computed per expert (only experts that receive tokens are read) in `dtype`.

    Args:
        x: [n, H] any float dtype (converted to `dtype`).
        topk_idx: int64 [n, K]; -1 = masked slot. Ids outside [-1, E) raise ValueError.
        topk_weights: float [n, K].
        l1_weights: float [E, 2I, H], rows [gate | up] (first I rows gate).
        l2_weights: float [E, H, I].
        activation_clamp: optional clamp c >= 0 (see above).
        dtype: compute and result dtype, torch.float32 (default) or torch.float64.

    Returns:
        [n, H] in `dtype` (float32 by default); tokens with every slot masked are 0.
    """
    if dtype not in (torch.float32, torch.float64):
        raise ValueError(f"dtype must be torch.float32 or torch.float64, got {dtype}")
    x = _check_float(x, "x", 2)
    n, hidden = x.shape
    num_experts, intermediate = _check_routing(n, hidden, topk_idx, topk_weights,
                                               l1_weights, l2_weights, x.device)
    clamp = _check_clamp(activation_clamp)

    xf = x.to(dtype)
    y = torch.zeros(n, hidden, dtype=dtype, device=x.device)
    for e, (tokens, slots) in _tokens_per_expert(topk_idx, num_experts).items():
        h = xf[tokens] @ l1_weights[e].to(dtype).T
        a = _swiglu(h, intermediate, topk_weights[tokens, slots].to(dtype), clamp)
        y.index_add_(0, tokens, a @ l2_weights[e].to(dtype).T)
    return y


def reference_moe_emulated(x_q: torch.Tensor, x_sf: Optional[torch.Tensor], topk_idx: torch.Tensor,
                           topk_weights: torch.Tensor, l1_weights: torch.Tensor,
                           l2_weights: torch.Tensor, mma_type: str,
                           activation_clamp: Optional[float] = None) -> torch.Tensor:
    """MoE layer with the kernel's rounding steps, to tell kernel error from quantization error.

    Weights are taken already dequantized (the caller uses `deep_gemm.utils.dequant_*`), so this
    function does not care how they were stored; only the activations follow `mma_type`:

    1. L1 input: `a0 = dequant_per_token_fp8(x_q, x_sf)` for the fp8 formats; `x_q.float()` for bf16.
    2. L1: `h = a0 @ W1[e].T` in float32; `a = silu(gate) * up * topk_weight` with the optional clamp,
       as in `reference_moe`.
    3. L1 output = L2 input: fp8 formats re-quantize `a` per token row per 128 with
       `per_token_cast_to_fp8` (the kernel's L1-epilogue formula) and dequantize; bf16 rounds `a` to
       bf16.
    4. L2: `o = a_q @ W2[e].T` in float32, rounded to bf16 (the kernel writes each top-k
       contribution as one BF16 row into a combine slot).
    5. Combine: `y[t] = sum over valid k, in increasing k, of float32(o_k)`, accumulated in float32,
       then rounded to bf16.

    The kernel's FP8 WGMMA accumulates with per-128 promotion rather than in plain float32; that
    difference is not emulated (it is far below the quantization error).

    Args:
        x_q: [n, H]: torch.float8_e4m3fn for "fp8xfp8" / "fp8xfp4", torch.bfloat16 for "bf16xbf16".
        x_sf: float32 [n, H / 128] for the fp8 formats; None for "bf16xbf16".
        topk_idx: int64 [n, K]; -1 = masked slot. Ids outside [-1, E) raise ValueError.
        topk_weights: float32 [n, K].
        l1_weights: dequantized float [E, 2I, H], rows [gate | up].
        l2_weights: dequantized float [E, H, I]; I % 128 == 0 for the fp8 formats.
        mma_type: one of "fp8xfp8", "fp8xfp4", "bf16xbf16".
        activation_clamp: optional clamp c >= 0.

    Returns:
        float32 [n, H] holding bf16-representable values (the kernel's BF16 `y`).
    """
    if mma_type not in MMA_TYPES:
        raise ValueError(f"mma_type must be one of {MMA_TYPES}, got {mma_type!r}")
    fp8 = mma_type != "bf16xbf16"
    x_q = _check_tensor(x_q, "x_q")
    if x_q.dim() != 2:
        raise ValueError(f"x_q must have 2 dims [n, hidden], got shape {tuple(x_q.shape)}")
    n, hidden = x_q.shape
    if fp8:
        if x_q.dtype != torch.float8_e4m3fn:
            raise TypeError(f"x_q must be torch.float8_e4m3fn for {mma_type}, got {x_q.dtype}")
        if x_sf is None:
            raise ValueError(f"x_sf is required for {mma_type}")
        _check_tensor(x_sf, "x_sf")
        if x_sf.device != x_q.device:
            raise ValueError(f"x_sf is on {x_sf.device}, expected {x_q.device} like x_q")
        a0 = dequant_per_token_fp8(x_q, x_sf)
    else:
        if x_q.dtype != torch.bfloat16:
            raise TypeError(f"x_q must be torch.bfloat16 for bf16xbf16, got {x_q.dtype}")
        if x_sf is not None:
            raise ValueError("x_sf must be None for bf16xbf16")
        a0 = x_q.float()
    num_experts, intermediate = _check_routing(n, hidden, topk_idx, topk_weights,
                                               l1_weights, l2_weights, x_q.device)
    if fp8 and intermediate % FP8_SCALE_GROUP != 0:
        raise ValueError(f"l1_weights/l2_weights: intermediate ({intermediate}) must be a multiple "
                         f"of {FP8_SCALE_GROUP} for {mma_type}")
    clamp = _check_clamp(activation_clamp)

    # Combine slots [n, K, H] in BF16, as the kernel's [topk][token][hidden] (masked slots unused)
    num_topk = topk_idx.shape[1]
    slots_bf16 = torch.zeros(n, num_topk, hidden, dtype=torch.bfloat16, device=x_q.device)
    for e, (tokens, slots) in _tokens_per_expert(topk_idx, num_experts).items():
        h = a0[tokens] @ l1_weights[e].float().T
        a = _swiglu(h, intermediate, topk_weights[tokens, slots].float(), clamp)
        if fp8:
            # NaN/inf propagate (no check): a broken input must fail calc_diff, not raise here
            a_q = dequant_per_token_fp8(*per_token_cast_to_fp8(a, check_finite=False))
        else:
            a_q = a.bfloat16().float()
        slots_bf16[tokens, slots] = (a_q @ l2_weights[e].float().T).bfloat16()

    # Fixed-order float32 sum over the top-k slots, then BF16 like the kernel's `y`
    valid = topk_idx >= 0
    y = torch.zeros(n, hidden, dtype=torch.float32, device=x_q.device)
    for k in range(num_topk):
        y = torch.where(valid[:, k:k + 1], y + slots_bf16[:, k].float(), y)
    return y.bfloat16().float()


# --------------------------------------------------------------------------------------------------
# Metric
# --------------------------------------------------------------------------------------------------

def calc_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """DeepGEMM-style difference `1 - 2 * sum(a * b) / sum(a * a + b * b)`, in float64.

    Equals `||a - b||^2 / (||a||^2 + ||b||^2)`: 0 for identical tensors, ~ (relative error)^2 / 2 for
    a close `b` (a copy scaled by s gives (1 - s)^2 / (1 + s^2)), at most 2 (b = -a). Two all-zero
    tensors give 0. A NaN or inf in either input gives float('inf'), so any `< bound` check fails.

    Args:
        a, b: tensors of the same shape, any float dtype, same device.

    Returns:
        Python float.
    """
    a, b = _check_tensor(a, "a"), _check_tensor(b, "b")
    if a.shape != b.shape:
        raise ValueError(f"a and b must have the same shape, got {tuple(a.shape)} and {tuple(b.shape)}")
    a, b = a.double(), b.double()
    if not (bool(torch.isfinite(a).all()) and bool(torch.isfinite(b).all())):
        return float("inf")
    denominator = float((a * a + b * b).sum())
    if denominator == 0.0:
        return 0.0
    # The same quantity as 1 - 2ab / (a^2 + b^2), without its cancellation near 0
    return float(((a - b) ** 2).sum()) / denominator
