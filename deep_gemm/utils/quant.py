"""Quantize / dequantize helpers for the Mega MoE number formats (DESIGN.md §2).

Formats:

- **FP8 per token** (x, and the L1 output = L2 input): E4M3 values with one FP32 scale per
  token per 128 channels.
- **FP8 per block** (fp8xfp8 weights, DeepSeek-V3 checkpoints): E4M3 values with one FP32 scale
  per 128x128 block.
- **MXFP4** (fp8xfp4 weights, gpt-oss / DeepSeek-V4 checkpoints): E2M1 values packed two per
  byte with one UE8M0 (power-of-two) scale per 32 consecutive elements along K.

Everything runs on the device of the input (CPU or CUDA) and is bit-reproducible across the two:
only IEEE-exact float32 operations (multiply, true division, max) and torch's round-to-nearest-even
casts are used, never reciprocal-multiply shortcuts.

The input-validation helpers (`check_finite=True`, the MXFP4 NaN checks) read a flag back to the
host, i.e. they synchronize with the GPU: these helpers are for model loading, tests and benchmarks,
not for a CUDA-graph hot path.
"""

from __future__ import annotations

from typing import Tuple

import torch

__all__ = [
    "FP8_E4M3_MAX",
    "FP8_SCALE_GROUP",
    "FP8_AMAX_EPS",
    "E2M1_MAX",
    "E2M1_VALUES",
    "MXFP4_GROUP",
    "UE8M0_BIAS",
    "e4m3_quantize_with_amax",
    "per_token_cast_to_fp8",
    "per_block_cast_to_fp8",
    "dequant_per_token_fp8",
    "dequant_per_block_fp8",
    "cast_to_mxfp4",
    "dequant_mxfp4",
]

# Largest finite E4M3 (torch.float8_e4m3fn) magnitude: 1.75 * 2^8
FP8_E4M3_MAX = 448.0
# Channels (per token) or rows/columns (per block) that share one FP32 scale
FP8_SCALE_GROUP = 128
# Lower clamp of a group's amax before computing its scale: keeps an all-zero group finite
# (scale = 1e-10 / 448, every value quantizes to +-0) instead of dividing by zero. Same float32
# constant as the kernel's L1 epilogue (`fmaxf(amax, 1e-10f)`).
FP8_AMAX_EPS = 1e-10

# E2M1 magnitudes indexed by the 3-bit magnitude code 0..7
E2M1_VALUES: Tuple[float, ...] = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_MAX = 6.0
# Elements along K that share one UE8M0 scale
MXFP4_GROUP = 32
# UE8M0 byte s encodes 2^(s - 127); s == 255 is NaN
UE8M0_BIAS = 127
_UE8M0_NAN = 255
_MXFP4_MIN_EXP = -127
_MXFP4_MAX_EXP = 127


# --------------------------------------------------------------------------------------------------
# Validation
# --------------------------------------------------------------------------------------------------

def _check_tensor(t: object, name: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    return t


def _check_float_input(t: object, name: str, min_dim: int) -> torch.Tensor:
    t = _check_tensor(t, name)
    if not t.is_floating_point() or t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        raise TypeError(f"{name} must be a bfloat16/float16/float32 tensor, got {t.dtype}")
    if t.dim() < min_dim:
        raise ValueError(f"{name} must have at least {min_dim} dims, got shape {tuple(t.shape)}")
    return t


def _check_multiple(size: int, multiple: int, name: str, what: str) -> None:
    if size % multiple != 0:
        raise ValueError(f"{name}: {what} ({size}) must be a multiple of {multiple}")


def _check_finite(t: torch.Tensor, name: str) -> None:
    # One host sync; see the module docstring
    if t.numel() > 0 and not bool(torch.isfinite(t).all()):
        raise ValueError(f"{name} contains NaN or inf; it cannot be quantized")


# --------------------------------------------------------------------------------------------------
# FP8 E4M3 with FP32 scales
# --------------------------------------------------------------------------------------------------

def e4m3_quantize_with_amax(x: torch.Tensor, amax: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Quantize float32 `x` to E4M3 given each group's amax: the one formula shared by every FP8 path.

    This is bit-for-bit what the kernel's L1 epilogue does per token per 128 channels::

        amax = fmaxf(amax, 1e-10f);  inv = 448.0f / amax;  sf = amax / 448.0f;
        q = cvt.rn(v * inv)          // round to nearest even, |v * inv| <= 448 by construction

    All of it is IEEE float32 (true division, not reciprocal-multiply), so CPU, CUDA and the kernel
    agree bit-exactly. (The kernel must therefore compute `448.0f / amax` with a correctly rounded
    division, e.g. `__fdiv_rn`, also under fast-math.)

    Args:
        x: float32 tensor, any shape.
        amax: float32 tensor broadcastable to `x`: max |x| over each element's group (may be 0).

    Returns:
        (q, sf): q float8_e4m3fn with the shape of `x`; sf float32 with the shape of `amax`, such
        that `q.float() * sf` approximates `x`.
    """
    if x.dtype != torch.float32 or amax.dtype != torch.float32:
        raise TypeError(f"x and amax must be float32, got {x.dtype} and {amax.dtype}")
    amax = amax.clamp_min(FP8_AMAX_EPS)
    fp8_max = torch.full_like(amax, FP8_E4M3_MAX)
    # Tensor / tensor on the same device: a true IEEE division on CPU and CUDA. (`448.0 / amax` is
    # `amax.reciprocal() * 448` in torch, and `amax / 448.0` on CUDA multiplies by 1/448: both differ
    # from the kernel in the last bit.)
    sf = torch.div(amax, fp8_max)
    inv = torch.div(fp8_max, amax)
    q = (x * inv).to(torch.float8_e4m3fn)
    return q, sf


def per_token_cast_to_fp8(x: torch.Tensor, *, check_finite: bool = True) -> Tuple[torch.Tensor, torch.Tensor]:
    """Quantize activations to E4M3 with one FP32 scale per token per 128 channels.

    Per group of 128 channels: `amax = max(|x|)` clamped below at 1e-10 (an all-zero group gets
    `sf = 1e-10 / 448` and zero values), `sf = amax / 448`, `x_fp8 = round_to_nearest_even(x * (448 /
    amax))`, computed in float32 (see `e4m3_quantize_with_amax`). The group's max maps to +-448.

    Args:
        x: [n, h] (or [..., h]) bfloat16 / float16 / float32, h % 128 == 0.
        check_finite: raise ValueError on NaN/inf in `x` (costs one host sync).

    Returns:
        (x_fp8, sf): x_fp8 [n, h] torch.float8_e4m3fn; sf [n, h / 128] float32, contiguous.
    """
    x = _check_float_input(x, "x", 1)
    h = x.shape[-1]
    _check_multiple(h, FP8_SCALE_GROUP, "x", "last dim (hidden)")
    if check_finite:
        _check_finite(x, "x")
    groups = x.float().reshape(*x.shape[:-1], h // FP8_SCALE_GROUP, FP8_SCALE_GROUP)
    amax = groups.abs().amax(dim=-1, keepdim=True)
    q, sf = e4m3_quantize_with_amax(groups, amax)
    return q.reshape(x.shape), sf.squeeze(-1).contiguous()


def per_block_cast_to_fp8(w: torch.Tensor, *, check_finite: bool = True) -> Tuple[torch.Tensor, torch.Tensor]:
    """Quantize weights to E4M3 with one FP32 scale per 128x128 block (DeepSeek-V3 style).

    Same rule as `per_token_cast_to_fp8`, with the amax taken over each 128x128 block.

    Args:
        w: [..., m, k] bfloat16 / float16 / float32 (leading dims, e.g. experts, allowed),
            m % 128 == 0 and k % 128 == 0.
        check_finite: raise ValueError on NaN/inf in `w` (costs one host sync).

    Returns:
        (w_fp8, sf): w_fp8 [..., m, k] torch.float8_e4m3fn; sf [..., m / 128, k / 128] float32.
    """
    w = _check_float_input(w, "w", 2)
    m, k = w.shape[-2], w.shape[-1]
    _check_multiple(m, FP8_SCALE_GROUP, "w", "second-to-last dim (m)")
    _check_multiple(k, FP8_SCALE_GROUP, "w", "last dim (k)")
    if check_finite:
        _check_finite(w, "w")
    lead = w.shape[:-2]
    mb, kb = m // FP8_SCALE_GROUP, k // FP8_SCALE_GROUP
    blocks = w.float().reshape(*lead, mb, FP8_SCALE_GROUP, kb, FP8_SCALE_GROUP)
    amax = blocks.abs().amax(dim=(-3, -1), keepdim=True)
    q, sf = e4m3_quantize_with_amax(blocks, amax)
    return q.reshape(w.shape), sf.reshape(*lead, mb, kb).contiguous()


def _check_pair(q: object, sf: object, q_name: str, sf_name: str, q_dtype: torch.dtype, q_what: str,
                sf_dtype: torch.dtype, sf_what: str) -> Tuple[torch.Tensor, torch.Tensor]:
    """Quantized values and their scales: tensors of the expected dtypes on one device."""
    q, sf = _check_tensor(q, q_name), _check_tensor(sf, sf_name)
    if q.dtype != q_dtype:
        raise TypeError(f"{q_name} must be {q_what}, got {q.dtype}")
    if sf.dtype != sf_dtype:
        raise TypeError(f"{sf_name} must be {sf_what}, got {sf.dtype}")
    if q.device != sf.device:
        raise ValueError(f"{q_name} ({q.device}) and {sf_name} ({sf.device}) must be on the same device")
    return q, sf


def _check_fp8_pair(q: object, sf: object, q_name: str, sf_name: str) -> Tuple[torch.Tensor, torch.Tensor]:
    return _check_pair(q, sf, q_name, sf_name, torch.float8_e4m3fn, "torch.float8_e4m3fn", torch.float32, "float32")


def dequant_per_token_fp8(x_fp8: torch.Tensor, sf: torch.Tensor) -> torch.Tensor:
    """Inverse of `per_token_cast_to_fp8`: `x_fp8 * sf` per 128-channel group.

    Args:
        x_fp8: [n, h] (or [..., h]) torch.float8_e4m3fn, h % 128 == 0.
        sf: [n, h / 128] float32.

    Returns:
        float32 [n, h].
    """
    x_fp8, sf = _check_fp8_pair(x_fp8, sf, "x_fp8", "sf")
    if x_fp8.dim() < 1:
        raise ValueError("x_fp8 must have at least 1 dim")
    h = x_fp8.shape[-1]
    _check_multiple(h, FP8_SCALE_GROUP, "x_fp8", "last dim (hidden)")
    expected = (*x_fp8.shape[:-1], h // FP8_SCALE_GROUP)
    if tuple(sf.shape) != expected:
        raise ValueError(f"sf must have shape {expected} for x_fp8 of shape {tuple(x_fp8.shape)}, "
                         f"got {tuple(sf.shape)}")
    groups = x_fp8.float().reshape(*expected, FP8_SCALE_GROUP)
    return (groups * sf.unsqueeze(-1)).reshape(x_fp8.shape)


def dequant_per_block_fp8(w_fp8: torch.Tensor, sf: torch.Tensor) -> torch.Tensor:
    """Inverse of `per_block_cast_to_fp8`: `w_fp8 * sf` per 128x128 block.

    Args:
        w_fp8: [..., m, k] torch.float8_e4m3fn, m and k multiples of 128.
        sf: [..., m / 128, k / 128] float32.

    Returns:
        float32 [..., m, k].
    """
    w_fp8, sf = _check_fp8_pair(w_fp8, sf, "w_fp8", "sf")
    if w_fp8.dim() < 2:
        raise ValueError(f"w_fp8 must have at least 2 dims, got shape {tuple(w_fp8.shape)}")
    m, k = w_fp8.shape[-2], w_fp8.shape[-1]
    _check_multiple(m, FP8_SCALE_GROUP, "w_fp8", "second-to-last dim (m)")
    _check_multiple(k, FP8_SCALE_GROUP, "w_fp8", "last dim (k)")
    lead = w_fp8.shape[:-2]
    mb, kb = m // FP8_SCALE_GROUP, k // FP8_SCALE_GROUP
    if tuple(sf.shape) != (*lead, mb, kb):
        raise ValueError(f"sf must have shape {(*lead, mb, kb)} for w_fp8 of shape "
                         f"{tuple(w_fp8.shape)}, got {tuple(sf.shape)}")
    blocks = w_fp8.float().reshape(*lead, mb, FP8_SCALE_GROUP, kb, FP8_SCALE_GROUP)
    return (blocks * sf[..., :, None, :, None]).reshape(w_fp8.shape)


# --------------------------------------------------------------------------------------------------
# MXFP4: E2M1 packed two per byte, UE8M0 scale per 32 along K
# --------------------------------------------------------------------------------------------------

def _exp2_float64(e: torch.Tensor) -> torch.Tensor:
    """Exact 2^e as float64 for integer e in [-1022, 1023], built from the exponent bits."""
    return ((e.to(torch.int64) + 1023) << 52).view(torch.float64)


def _ue8m0_to_float32(s: torch.Tensor) -> torch.Tensor:
    """Exact 2^(s - 127) as float32 for UE8M0 bytes s in [0, 254] (s == 0 is the subnormal 2^-127)."""
    s = s.to(torch.int32)
    bits = torch.where(s > 0, s << 23, torch.full_like(s, 1 << 22))
    return bits.view(torch.float32)


def cast_to_mxfp4(w: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Quantize to MXFP4: E2M1 values packed two per byte, one UE8M0 scale per 32 along the last dim.

    Per group of 32 consecutive elements along k:

    - Scale: the smallest power of two 2^e with `amax / 2^e <= 6`, i.e. `e = ceil(log2(amax / 6))`
      (computed exactly from the exponent bits, no log rounding), clamped to the UE8M0 range
      [-127, 127]; stored as the byte `s = e + 127`. An all-zero group (the smallest e satisfying the
      rule is -inf) gets the clamp, s = 0; so does any group with amax < 6 * 2^-127. Float32
      inputs never need e > 126.
    - Values: each `w / 2^e` (exact in float64) is rounded to the nearest E2M1 magnitude in
      {0, 0.5, 1, 1.5, 2, 3, 4, 6}; a tie goes to the even magnitude code (0.25 -> 0, 0.75 -> 1,
      1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4), as IEEE round-to-nearest-even does.
      The sign bit is the input's sign bit, so negative values that round to zero give -0 (nibble
      0x8), as a hardware conversion does.
    - Nibble: sign (bit 3) | magnitude code (bits 0-2). Byte j of a row holds element 2j in its LOW
      nibble and element 2j + 1 in its HIGH nibble.

    Args:
        w: [..., k] bfloat16 / float16 / float32, k % 32 == 0, finite (NaN/inf raise ValueError;
            checked with one host sync).

    Returns:
        (packed, sf): packed uint8 [..., k / 2]; sf uint8 [..., k / 32].
    """
    w = _check_float_input(w, "w", 1)
    k = w.shape[-1]
    _check_multiple(k, MXFP4_GROUP, "w", "last dim (k)")
    _check_finite(w, "w")
    lead = w.shape[:-1]
    if w.numel() == 0:
        return (torch.zeros(*lead, k // 2, dtype=torch.uint8, device=w.device),
                torch.zeros(*lead, k // MXFP4_GROUP, dtype=torch.uint8, device=w.device))

    # float64: every bf16/f16/f32 value and every scaling by 2^-e below is exact
    groups = w.to(torch.float64).reshape(*lead, k // MXFP4_GROUP, MXFP4_GROUP)
    amax = groups.abs().amax(dim=-1)
    # amax = m * 2^p with m in [0.5, 1); 6 * 2^e = 0.75 * 2^(e + 3), so amax <= 6 * 2^e holds first
    # at e = p - 3 when m <= 0.75 and at e = p - 2 otherwise
    mantissa, exponent = torch.frexp(amax)
    e = exponent.to(torch.int32) - torch.where(mantissa <= 0.75, 3, 2).to(torch.int32)
    e = torch.where(amax == 0, torch.full_like(e, _MXFP4_MIN_EXP), e)
    e = e.clamp(_MXFP4_MIN_EXP, _MXFP4_MAX_EXP)

    scaled = groups * _exp2_float64(-e).unsqueeze(-1)
    magnitude = scaled.abs()
    grid = torch.tensor(E2M1_VALUES, dtype=torch.float64, device=w.device)
    midpoints = (grid[:-1] + grid[1:]) / 2
    # lo: code when a tie rounds down, hi: when it rounds up; they differ only on a midpoint
    lo = torch.bucketize(magnitude, midpoints, right=False)
    hi = torch.bucketize(magnitude, midpoints, right=True)
    code = torch.where(lo % 2 == 0, lo, hi)  # lo == hi off ties; on a tie the two differ by 1
    sign = torch.signbit(scaled).to(torch.int64)
    nibble = ((sign << 3) | code).to(torch.uint8).reshape(*lead, k // 2, 2)
    packed = nibble[..., 0] | (nibble[..., 1] << 4)
    sf = (e + UE8M0_BIAS).to(torch.uint8)
    return packed.contiguous(), sf.contiguous()


def dequant_mxfp4(packed: torch.Tensor, sf: torch.Tensor) -> torch.Tensor:
    """Inverse of `cast_to_mxfp4`: E2M1 value times 2^(sf - 127), exactly, in float32.

    Args:
        packed: uint8 [..., k / 2], element 2j in the low nibble of byte j, 2j + 1 in the high one.
        sf: uint8 [..., k / 32] UE8M0 scales; 255 (NaN) raises ValueError (one host sync).

    Returns:
        float32 [..., k]. Exact, except that products of 2^128 or more overflow to inf (e.g.
        s = 253 with a value >= 4): `cast_to_mxfp4` produces that only for float32 groups with
        amax >= 3.5 * 2^126 (~3e38).
    """
    packed, sf = _check_pair(packed, sf, "packed", "sf", torch.uint8, "uint8", torch.uint8, "uint8 (UE8M0)")
    if packed.dim() < 1:
        raise ValueError("packed must have at least 1 dim")
    k = packed.shape[-1] * 2
    _check_multiple(k, MXFP4_GROUP, "packed", "2 * last dim (k)")
    expected = (*packed.shape[:-1], k // MXFP4_GROUP)
    if tuple(sf.shape) != expected:
        raise ValueError(f"sf must have shape {expected} for packed of shape {tuple(packed.shape)}, "
                         f"got {tuple(sf.shape)}")
    if sf.numel() > 0 and bool((sf == _UE8M0_NAN).any()):
        raise ValueError("sf contains 255, the UE8M0 NaN encoding")

    table = torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES), dtype=torch.float32,
                         device=packed.device)
    low = (packed & 0xF).to(torch.int64)
    high = (packed >> 4).to(torch.int64)
    values = torch.stack((table[low], table[high]), dim=-1)
    values = values.reshape(*packed.shape[:-1], k // MXFP4_GROUP, MXFP4_GROUP)
    return (values * _ue8m0_to_float32(sf).unsqueeze(-1)).reshape(*packed.shape[:-1], k)
