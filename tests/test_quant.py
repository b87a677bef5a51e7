"""Tests for deep_gemm.utils quantization helpers (FP8 per token / per block, MXFP4).

Error bounds asserted (scaled domain v = x / sf, the value the E4M3 cast sees):

- E4M3 normals (|v| >= 2^-6) have 3 mantissa bits, so round-to-nearest errs by at most half an ulp,
  2^(floor(log2|v|) - 4) <= 2^-4 * |v|.
- E4M3 subnormals (|v| < 2^-6) are spaced 2^-9, so the error is at most 2^-10.
- Hence |dequant(x) - x| <= max(2^-4 * |x|, 2^-10 * sf), plus a few float32 ulps (2^-20 relative)
  for the scale multiply/divide. This is tighter than "2^-4 of the group amax" and implies it.

MXFP4: the dequantized value must be the nearest E2M1 grid point times 2^e (checked against the whole
grid), with e the smallest exponent such that amax / 2^e <= 6.
"""

from __future__ import annotations

import pytest
import torch

from deep_gemm.utils import (
    E2M1_VALUES,
    FP8_E4M3_MAX,
    cast_to_mxfp4,
    dequant_mxfp4,
    dequant_per_block_fp8,
    dequant_per_token_fp8,
    per_block_cast_to_fp8,
    per_token_cast_to_fp8,
)

from conftest import DEVICES, requires_cuda  # noqa: E402
FLOAT_DTYPES = [torch.float32, torch.bfloat16]

# Float32 slack for the two scale operations (inv, sf) and the dequant multiply: a few ulps
F32_SLACK = 2.0 ** -20


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _random_activations(n: int, h: int, dtype: torch.dtype, device: str, seed: int) -> torch.Tensor:
    """Normal values with per-row magnitudes spread over ~2^-12..2^12 and a few outliers."""
    g = _gen(seed)
    x = torch.randn(n, h, generator=g)
    x *= torch.exp2(torch.randint(-12, 13, (n, 1), generator=g).float())
    outliers = torch.rand(n, h, generator=g) < 0.002
    x = torch.where(outliers, x * 50, x)
    return x.to(dtype).to(device)


def _random_e4m3_codes(shape, g: torch.Generator) -> torch.Tensor:
    """Random finite E4M3 bytes (0x7F / 0xFF are NaN and excluded)."""
    codes = torch.randint(0, 256, shape, generator=g, dtype=torch.int32)
    codes = torch.where((codes & 0x7F) == 0x7F, codes - 1, codes)
    return codes.to(torch.uint8)


def _fp8_bound(x: torch.Tensor, sf_per_element: torch.Tensor) -> torch.Tensor:
    x = x.float().abs()
    return torch.maximum(x * 2.0 ** -4, sf_per_element * 2.0 ** -10) * (1 + F32_SLACK) + x * F32_SLACK


# --------------------------------------------------------------------------------------------------
# FP8 per token
# --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_per_token_error_bound(device, dtype):
    x = _random_activations(96, 512, dtype, device, seed=1)
    x_fp8, sf = per_token_cast_to_fp8(x)
    assert x_fp8.dtype == torch.float8_e4m3fn and x_fp8.shape == x.shape and x_fp8.device == x.device
    assert sf.dtype == torch.float32 and sf.shape == (96, 4) and sf.is_contiguous()

    deq = dequant_per_token_fp8(x_fp8, sf)
    assert deq.dtype == torch.float32 and deq.shape == x.shape
    err = (deq - x.float()).abs()
    bound = _fp8_bound(x, sf.repeat_interleave(128, dim=1))
    assert bool((err <= bound).all()), f"worst err/bound {(err / bound).max().item():.4f}"
    # Not vacuous: some element sits close to the worst case of the bound
    assert (err / bound).max().item() > 0.9
    # And the looser statement: error <= 2^-4 of the group amax
    amax = x.float().abs().reshape(96, 4, 128).amax(-1).repeat_interleave(128, dim=1)
    assert bool((err <= amax * 2.0 ** -4).all())


@pytest.mark.parametrize("device", DEVICES)
def test_per_token_formula_contract(device):
    """The exact kernel formula, recomputed independently in float64 with one rounding each."""
    x = _random_activations(32, 384, torch.bfloat16, device, seed=2)
    x_fp8, sf = per_token_cast_to_fp8(x)

    groups = x.double().reshape(32, 3, 128)
    amax = groups.abs().amax(-1, keepdim=True).clamp_min(torch.tensor(1e-10, dtype=torch.float32).item())
    # float64 quotient rounded once to float32 == IEEE float32 division (53 >= 2 * 24 + 2)
    sf_expected = (amax / FP8_E4M3_MAX).float()
    inv = (FP8_E4M3_MAX / amax).float()
    v = (groups * inv.double()).float()  # the float32 product, exact in float64 before rounding
    q_expected = v.to(torch.float8_e4m3fn).reshape(32, 384)

    assert torch.equal(sf, sf_expected.squeeze(-1))
    assert torch.equal(x_fp8.view(torch.uint8), q_expected.view(torch.uint8))
    # The group's max maps to +-448
    assert bool((x_fp8.float().abs().reshape(32, 3, 128).amax(-1) == FP8_E4M3_MAX).all())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_per_token_exact_roundtrip(device, dtype):
    """E4M3 values times a power-of-two scale 2^j, with +-448 * 2^j in each group, are exact."""
    g = _gen(3)
    n, h = 40, 512
    codes = _random_e4m3_codes((n, h), g)
    # One element per group set to +-448 (0x7E / 0xFE) so amax = 448 * 2^j and sf = 2^j exactly
    pos = torch.randint(0, 128, (n, h // 128), generator=g) + torch.arange(0, h, 128)
    sign = torch.randint(0, 2, (n, h // 128), generator=g, dtype=torch.uint8) << 7
    codes.scatter_(1, pos, 0x7E | sign)
    j = torch.randint(-10, 11, (n, h // 128), generator=g)
    scale = torch.exp2(j.float())
    x = codes.view(torch.float8_e4m3fn).float() * scale.repeat_interleave(128, dim=1)
    x = x.to(dtype).to(device)
    assert torch.equal(x.float().cpu().view(torch.int32),
                       (codes.view(torch.float8_e4m3fn).float() * scale.repeat_interleave(128, 1))
                       .view(torch.int32)), "test setup: input not exactly representable"

    x_fp8, sf = per_token_cast_to_fp8(x)
    assert torch.equal(x_fp8.view(torch.uint8).cpu(), codes)
    assert torch.equal(sf.cpu(), scale)
    deq = dequant_per_token_fp8(x_fp8, sf)
    assert torch.equal(deq.view(torch.int32), x.float().view(torch.int32))  # sign of zero too


@pytest.mark.parametrize("device", DEVICES)
def test_per_token_ties_round_to_even(device):
    """Group amax 448 (scale 1): midpoints between E4M3 values go to the even mantissa."""
    g = _gen(4)
    x = torch.randn(1, 128, generator=g).clamp(-400, 400)
    x[0, 0] = FP8_E4M3_MAX
    # (input, expected E4M3 byte): 1 + 2^-4 is between 1.0 (0x38) and 1.125 (0x39) -> 0x38;
    # 1.1875 between 1.125 and 1.25 (0x3A) -> 0x3A; subnormal 2^-10 between 0 and 2^-9 -> 0;
    # 3 * 2^-10 between 2^-9 (0x01) and 2^-8 (0x02) -> 0x02; 248 between 240 (0x77) and 256 (0x78)
    # -> 0x78 (carry into the exponent); 232 between 224 (0x76) and 240 (0x77) -> 0x76
    cases = [(1 + 2 ** -4, 0x38), (1.1875, 0x3A), (2 ** -10, 0x00), (3 * 2 ** -10, 0x02),
             (248.0, 0x78), (232.0, 0x76), (-(1 + 2 ** -4), 0xB8)]
    for i, (value, _) in enumerate(cases, start=1):
        x[0, i] = value
    x_fp8, sf = per_token_cast_to_fp8(x.to(device))
    assert sf.item() == 1.0
    got = x_fp8.view(torch.uint8).cpu()[0]
    for i, (value, byte) in enumerate(cases, start=1):
        assert got[i].item() == byte, f"{value} -> {got[i].item():#x}, expected {byte:#x}"


@pytest.mark.parametrize("device", DEVICES)
def test_per_token_zero_rows_and_empty(device):
    x = _random_activations(6, 256, torch.float32, device, seed=5)
    x[2] = 0.0
    x[4, 128:] = 0.0
    x_fp8, sf = per_token_cast_to_fp8(x)
    # Zero group: amax clamped to 1e-10, scale 1e-10 / 448, values exactly zero
    eps_sf = torch.tensor(1e-10, dtype=torch.float32) / torch.tensor(448.0)
    assert sf[2, 0].item() == sf[2, 1].item() == sf[4, 1].item() == eps_sf.item()
    assert bool((x_fp8[2].float() == 0).all()) and bool((x_fp8[4, 128:].float() == 0).all())
    deq = dequant_per_token_fp8(x_fp8, sf)
    assert bool((deq[2] == 0).all()) and bool((deq[4, 128:] == 0).all())
    assert bool((sf[[0, 1, 3, 5]] > 1e-10).all())

    empty_q, empty_sf = per_token_cast_to_fp8(torch.empty(0, 256, device=device))
    assert empty_q.shape == (0, 256) and empty_sf.shape == (0, 2)


def test_per_token_leading_dims():
    x = _random_activations(24, 256, torch.float32, "cpu", seed=6)
    q, sf = per_token_cast_to_fp8(x)
    q3, sf3 = per_token_cast_to_fp8(x.reshape(4, 6, 256))
    assert q3.shape == (4, 6, 256) and sf3.shape == (4, 6, 2)
    assert torch.equal(q3.reshape(24, 256).view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(sf3.reshape(24, 2), sf)
    assert torch.equal(dequant_per_token_fp8(q3, sf3).reshape(24, 256), dequant_per_token_fp8(q, sf))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_fp8_rejects_non_finite(bad):
    g = _gen(7)
    x = torch.randn(8, 256, generator=g)
    x[torch.randint(0, 8, (1,), generator=g), torch.randint(0, 256, (1,), generator=g)] = bad
    with pytest.raises(ValueError, match="x contains NaN or inf"):
        per_token_cast_to_fp8(x)
    w = torch.randn(2, 128, 256, generator=g)
    w[1, 5, 7] = bad
    with pytest.raises(ValueError, match="w contains NaN or inf"):
        per_block_cast_to_fp8(w)


def test_fp8_argument_errors():
    g = _gen(8)
    with pytest.raises(ValueError, match="x: last dim"):
        per_token_cast_to_fp8(torch.randn(4, 200, generator=g))
    with pytest.raises(TypeError, match="x must be"):
        per_token_cast_to_fp8(torch.randint(0, 5, (4, 128), generator=g))
    with pytest.raises(TypeError, match="x must be a torch.Tensor"):
        per_token_cast_to_fp8([1.0] * 128)
    with pytest.raises(ValueError, match="w: second-to-last dim"):
        per_block_cast_to_fp8(torch.randn(64, 128, generator=g))
    with pytest.raises(ValueError, match="w: last dim"):
        per_block_cast_to_fp8(torch.randn(128, 96, generator=g))
    q, sf = per_token_cast_to_fp8(torch.randn(4, 256, generator=g))
    with pytest.raises(ValueError, match="sf must have shape"):
        dequant_per_token_fp8(q, sf[:, :1])
    with pytest.raises(TypeError, match="x_fp8 must be torch.float8_e4m3fn"):
        dequant_per_token_fp8(q.float(), sf)
    with pytest.raises(TypeError, match="sf must be float32"):
        dequant_per_token_fp8(q, sf.double())
    wq, wsf = per_block_cast_to_fp8(torch.randn(256, 128, generator=g))
    with pytest.raises(ValueError, match="sf must have shape"):
        dequant_per_block_fp8(wq, wsf.T)


# --------------------------------------------------------------------------------------------------
# FP8 per block
# --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_per_block_error_bound_with_expert_dim(device, dtype):
    g = _gen(9)
    num_experts, m, k = 3, 256, 384
    w = torch.randn(num_experts, m, k, generator=g)
    # Different magnitude per 128x128 block
    w *= torch.exp2(torch.randint(-8, 9, (num_experts, 2, 1, 3, 1), generator=g).float()) \
        .expand(num_experts, 2, 128, 3, 128).reshape(num_experts, m, k)
    w = w.to(dtype).to(device)
    w_fp8, sf = per_block_cast_to_fp8(w)
    assert w_fp8.shape == w.shape and w_fp8.dtype == torch.float8_e4m3fn
    assert sf.shape == (num_experts, 2, 3) and sf.dtype == torch.float32

    amax = w.float().abs().reshape(num_experts, 2, 128, 3, 128).amax(dim=(2, 4))
    assert torch.equal(sf, (amax.double() / FP8_E4M3_MAX).float())
    deq = dequant_per_block_fp8(w_fp8, sf)
    sf_full = sf.repeat_interleave(128, 1).repeat_interleave(128, 2)
    err = (deq - w.float()).abs()
    bound = _fp8_bound(w, sf_full)
    assert bool((err <= bound).all()), f"worst err/bound {(err / bound).max().item():.4f}"
    assert (err / bound).max().item() > 0.9

    # A batch of experts quantizes exactly like each expert on its own
    for e in range(num_experts):
        q_e, sf_e = per_block_cast_to_fp8(w[e])
        assert torch.equal(q_e.view(torch.uint8), w_fp8[e].view(torch.uint8))
        assert torch.equal(sf_e, sf[e])


@pytest.mark.parametrize("device", DEVICES)
def test_per_block_exact_roundtrip(device):
    g = _gen(10)
    m, k = 256, 256
    codes = _random_e4m3_codes((2, m, k), g)
    # In each 128x128 block, one element is +-448 so the block scale is exactly 2^j
    for e in range(2):
        for bm in range(2):
            for bk in range(2):
                r = bm * 128 + int(torch.randint(0, 128, (1,), generator=g))
                c = bk * 128 + int(torch.randint(0, 128, (1,), generator=g))
                codes[e, r, c] = 0x7E | (int(torch.randint(0, 2, (1,), generator=g)) << 7)
    j = torch.randint(-12, 13, (2, 2, 2), generator=g)
    scale = torch.exp2(j.float())
    w = codes.view(torch.float8_e4m3fn).float() * scale.repeat_interleave(128, 1).repeat_interleave(128, 2)
    w_fp8, sf = per_block_cast_to_fp8(w.to(device))
    assert torch.equal(w_fp8.view(torch.uint8).cpu(), codes)
    assert torch.equal(sf.cpu(), scale)
    assert torch.equal(dequant_per_block_fp8(w_fp8, sf).cpu().view(torch.int32), w.view(torch.int32))


# --------------------------------------------------------------------------------------------------
# MXFP4
# --------------------------------------------------------------------------------------------------

def _e2m1_grid() -> torch.Tensor:
    return torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES), dtype=torch.float64)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_mxfp4_nearest_and_minimal_scale(device, dtype):
    g = _gen(11)
    num_experts, rows, k = 2, 48, 256
    w = torch.randn(num_experts, rows, k, generator=g)
    w *= torch.exp2(torch.randint(-30, 31, (num_experts, rows, 1), generator=g).float())
    w = w.to(dtype).to(device)
    packed, sf = cast_to_mxfp4(w)
    assert packed.shape == (num_experts, rows, k // 2) and packed.dtype == torch.uint8
    assert sf.shape == (num_experts, rows, k // 32) and sf.dtype == torch.uint8
    deq = dequant_mxfp4(packed, sf)
    assert deq.shape == w.shape and deq.dtype == torch.float32

    w64 = w.double().cpu().reshape(num_experts, rows, k // 32, 32)
    e = sf.cpu().long() - 127
    scale = torch.exp2(e.double()).unsqueeze(-1)
    # Smallest power of two: amax / 2^e <= 6 < amax / 2^(e - 1)
    amax = w64.abs().amax(-1, keepdim=True)
    assert bool((amax / scale <= 6).all()) and bool((amax / (scale / 2) > 6).all())
    # Nearest grid point: no point of the scaled grid is strictly closer
    err = (deq.double().cpu().reshape(w64.shape) - w64).abs()
    best = (w64.unsqueeze(-1) - _e2m1_grid() * scale.unsqueeze(-1)).abs().amin(-1)
    assert torch.equal(err, best)


@pytest.mark.parametrize("device", DEVICES)
def test_mxfp4_ties_to_even_code(device):
    g = _gen(12)
    # Midpoints of the magnitude grid and the even code they must round to
    ties = [(0.25, 0.0), (0.75, 1.0), (1.25, 1.0), (1.75, 2.0), (2.5, 2.0), (3.5, 4.0), (5.0, 4.0)]
    rows = []
    for _ in range(4):
        j = int(torch.randint(-20, 21, (1,), generator=g))
        signs = torch.where(torch.rand(len(ties), generator=g) < 0.5, -1.0, 1.0)
        row = torch.rand(32, generator=g) * 6 - 3  # fresh filler, |.| < 6
        row[: len(ties)] = torch.tensor([t for t, _ in ties]) * signs
        row[len(ties)] = 6.0  # pins the scale to 2^0
        rows.append((row * 2.0 ** j, torch.tensor([r for _, r in ties]) * signs * 2.0 ** j, j))
    w = torch.stack([r for r, _, _ in rows]).to(device)
    packed, sf = cast_to_mxfp4(w)
    deq = dequant_mxfp4(packed, sf).cpu()
    for i, (_, expected, j) in enumerate(rows):
        assert sf[i, 0].item() == 127 + j
        assert torch.equal(deq[i, : len(ties)], expected)


@pytest.mark.parametrize("device", DEVICES)
def test_mxfp4_exact_roundtrip(device):
    """Random nibbles and scales, with a +-6 in each group, come back bit-exactly."""
    g = _gen(13)
    shape = (3, 16, 128)
    nibbles = torch.randint(0, 16, shape, generator=g, dtype=torch.uint8)
    groups = nibbles.view(3, 16, 4, 32)
    pos = torch.randint(0, 32, (3, 16, 4, 1), generator=g)
    sign = torch.randint(0, 2, (3, 16, 4, 1), generator=g, dtype=torch.uint8) << 3
    groups.scatter_(-1, pos, 0x7 | sign)
    # 6 * 2^(s - 127) stays finite in float32 up to s = 252
    s = torch.randint(0, 253, (3, 16, 4), generator=g, dtype=torch.int32)
    s[0, 0, 0] = 0
    s[0, 0, 1] = 252
    s = s.to(torch.uint8)
    packed = (nibbles[..., 0::2] | (nibbles[..., 1::2] << 4)).contiguous()
    w = dequant_mxfp4(packed.to(device), s.to(device))
    assert bool(torch.isfinite(w).all())
    packed2, s2 = cast_to_mxfp4(w)
    assert torch.equal(packed2.cpu(), packed)
    assert torch.equal(s2.cpu(), s)


def test_mxfp4_nibble_order_by_hand():
    g = _gen(14)
    w = torch.rand(2, 64, generator=g) * 4 - 2  # |.| < 2 < 6: scale stays 2^0 with the 6 below
    w[0, 0], w[0, 1] = 1.0, -6.0          # codes 0x2 and 0xF -> byte 0xF2 (element 0 low)
    w[0, 32], w[0, 33] = -0.5, 3.0        # second group: codes 0x9 and 0x5 -> byte 0x59
    w[0, 34] = 6.0
    packed, sf = cast_to_mxfp4(w)
    assert packed[0, 0].item() == 0xF2
    assert packed[0, 16].item() == 0x59
    assert sf[0, 0].item() == 127 and sf[0, 1].item() == 127

    # Decode a hand-made byte: 0x3A = high 0x3 (+1.5), low 0xA (-1.0); scale byte 128 = x2
    hand = torch.randint(0, 256, (1, 16), generator=g, dtype=torch.uint8)
    hand[0, 0] = 0x3A
    out = dequant_mxfp4(hand, torch.tensor([[128]], dtype=torch.uint8))
    assert out[0, 0].item() == -2.0 and out[0, 1].item() == 3.0


def test_mxfp4_zero_and_tiny_groups():
    g = _gen(15)
    w = torch.randn(3, 64, generator=g)
    w[0, :32] = 0.0
    w[1, :32] = -0.0
    # Below the UE8M0 range: 6 * 2^e >= amax would need e < -127, so e clamps to -127 (s = 0)
    w[2, :32] = torch.randint(-3, 4, (32,), generator=g).float() * 2.0 ** -128
    w[2, 0] = 3 * 2.0 ** -128
    packed, sf = cast_to_mxfp4(w)
    assert sf[0, 0].item() == 0 and sf[1, 0].item() == 0 and sf[2, 0].item() == 0
    assert bool((packed[0, :16] == 0x00).all())
    assert bool((packed[1, :16] == 0x88).all())  # -0 keeps its sign bit
    deq = dequant_mxfp4(packed, sf)
    assert bool((deq[:2, :32] == 0).all())
    # 2^-128 * {0, +-1, +-2, +-3} scaled by 2^127 is {0, +-0.5, +-1, +-1.5}: exact, float32 subnormals
    assert torch.equal(deq[2, :32], w[2, :32])
    assert bool((sf[:, 1] > 100).all())


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_mxfp4_rejects_non_finite(bad):
    g = _gen(16)
    w = torch.randn(4, 64, generator=g)
    w[int(torch.randint(0, 4, (1,), generator=g)), int(torch.randint(0, 64, (1,), generator=g))] = bad
    with pytest.raises(ValueError, match="w contains NaN or inf"):
        cast_to_mxfp4(w)


def test_mxfp4_argument_errors():
    g = _gen(17)
    with pytest.raises(ValueError, match="w: last dim"):
        cast_to_mxfp4(torch.randn(4, 48, generator=g))
    packed, sf = cast_to_mxfp4(torch.randn(4, 64, generator=g))
    bad_sf = sf.clone()
    bad_sf[1, 1] = 255
    with pytest.raises(ValueError, match="255"):
        dequant_mxfp4(packed, bad_sf)
    with pytest.raises(ValueError, match="sf must have shape"):
        dequant_mxfp4(packed, sf[:, :1])
    with pytest.raises(TypeError, match="packed must be uint8"):
        dequant_mxfp4(packed.to(torch.int8), sf)
    with pytest.raises(TypeError, match="sf must be uint8"):
        dequant_mxfp4(packed, sf.float())
    with pytest.raises(ValueError, match="packed: 2 \\* last dim"):
        dequant_mxfp4(packed[:, :8], sf[:, :1])


# --------------------------------------------------------------------------------------------------
# CPU and GPU agree bit for bit
# --------------------------------------------------------------------------------------------------

@requires_cuda
def test_cpu_gpu_bit_exact():
    x = _random_activations(64, 512, torch.bfloat16, "cpu", seed=18)
    q_c, sf_c = per_token_cast_to_fp8(x)
    q_g, sf_g = per_token_cast_to_fp8(x.cuda())
    assert torch.equal(q_g.view(torch.uint8).cpu(), q_c.view(torch.uint8))
    assert torch.equal(sf_g.cpu(), sf_c)

    w = torch.randn(2, 256, 256, generator=_gen(19))
    q_c, sf_c = per_block_cast_to_fp8(w)
    q_g, sf_g = per_block_cast_to_fp8(w.cuda())
    assert torch.equal(q_g.view(torch.uint8).cpu(), q_c.view(torch.uint8))
    assert torch.equal(sf_g.cpu(), sf_c)

    p_c, s_c = cast_to_mxfp4(w)
    p_g, s_g = cast_to_mxfp4(w.cuda())
    assert torch.equal(p_g.cpu(), p_c) and torch.equal(s_g.cpu(), s_c)
    assert torch.equal(dequant_mxfp4(p_g, s_g).cpu(), dequant_mxfp4(p_c, s_c))
