"""Tests for deep_gemm.testing: reference_moe, reference_moe_emulated, calc_diff.

Tolerances (calc_diff = ||a - b||^2 / (||a||^2 + ||b||^2) ~ (relative error)^2 / 2):

- reference_moe (float32) vs a float64 per-token loop: < 1e-10. Float32 dot products of length
  <= 256 err by ~1e-7 relative (measured calc_diff ~7e-14); any semantic slip (a lost slot, a wrong
  gate/up half) is > 1e-3.
- reference_moe_emulated (fp8 formats) vs reference_moe on the same dequantized weights: in
  (2e-4, 2e-3). E4M3 keeps 3 mantissa bits, so one rounding has relative rms error
  ~ 2^-3 / sqrt(12) * 0.7 ~ 0.025, i.e. calc_diff ~ 3e-4 per quantization. The x quantization
  reaches `a` through both gate and up (x2), the L1-output quantization adds one more: ~1e-3.
  Measured 0.88e-3 .. 1.01e-3 over 5 seeds (n=64, H=256, I=128, E=8, K=4). The lower bound proves
  the quantization steps are really applied.
- bf16xbf16: in (5e-7, 1e-5). BF16 keeps 8 bits: ~1.3e-6 per rounding, three roundings (a, o, y).
  Measured ~4e-6.
- reference_moe_emulated vs an independent per-token loop of the same steps: < 1e-7 with >= 99% of
  elements bit-equal. The two differ only in float32 summation order (~1e-7 relative), which rarely
  flips a BF16/E4M3 rounding (measured 0 .. 1.1e-8, 0 to 20 of 8192 elements differ). Leaving one
  step out costs 10x more: measured 1.4e-6 without the final BF16 rounding of y, 3.6e-6 without the
  BF16 combine slots, 4.8e-6 (bf16) / 2.5e-4 (fp8) without the L1-output quantization.
"""

from __future__ import annotations

from typing import Optional

import pytest
import torch
import torch.nn.functional as F

from deep_gemm.testing import calc_diff, reference_moe, reference_moe_emulated
from deep_gemm.utils import (
    cast_to_mxfp4,
    dequant_mxfp4,
    dequant_per_block_fp8,
    dequant_per_token_fp8,
    per_block_cast_to_fp8,
    per_token_cast_to_fp8,
)

from conftest import DEVICES, requires_cuda  # noqa: E402

HIDDEN, INTERMEDIATE, NUM_EXPERTS = 256, 128, 8


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _make_problem(n: int, num_topk: int, seed: int, mask_ratio: float = 0.0, device: str = "cpu"):
    """Random x [n, H], distinct experts per token, random masks, random weights [E, 2I, H] / [E, H, I]."""
    g = _gen(seed)
    x = torch.randn(n, HIDDEN, generator=g)
    topk_idx = torch.stack([torch.randperm(NUM_EXPERTS, generator=g)[:num_topk] for _ in range(n)]) \
        if n > 0 else torch.empty(0, num_topk, dtype=torch.int64)
    topk_idx = torch.where(torch.rand(n, num_topk, generator=g) < mask_ratio, -1, topk_idx)
    topk_weights = torch.rand(n, num_topk, generator=g) + 0.1
    l1 = torch.randn(NUM_EXPERTS, 2 * INTERMEDIATE, HIDDEN, generator=g) / HIDDEN ** 0.5
    l2 = torch.randn(NUM_EXPERTS, HIDDEN, INTERMEDIATE, generator=g) / INTERMEDIATE ** 0.5
    return tuple(t.to(device) for t in (x, topk_idx, topk_weights, l1, l2))


def _naive_moe(x, topk_idx, topk_weights, l1, l2, clamp: Optional[float] = None) -> torch.Tensor:
    """Token-by-token, slot-by-slot float64 MoE, written from the spec independently of the library."""
    n, num_topk = topk_idx.shape
    y = torch.zeros(n, x.shape[1], dtype=torch.float64)
    for t in range(n):
        for k in range(num_topk):
            e = int(topk_idx[t, k])
            if e < 0:
                continue
            h = l1[e].double().cpu() @ x[t].double().cpu()
            gate, up = h[:INTERMEDIATE], h[INTERMEDIATE:]
            if clamp is not None:
                gate = torch.minimum(gate, torch.tensor(clamp, dtype=torch.float64))
                up = torch.maximum(torch.minimum(up, torch.tensor(clamp, dtype=torch.float64)),
                                   torch.tensor(-clamp, dtype=torch.float64))
            a = gate * torch.sigmoid(gate) * up * float(topk_weights[t, k])
            y[t] += l2[e].double().cpu() @ a
    return y


def _naive_emulated(x_q, x_sf, topk_idx, topk_weights, l1, l2, mma_type: str) -> torch.Tensor:
    """Per-token loop of the kernel's rounding steps (same quant helpers, own loop structure)."""
    n, num_topk = topk_idx.shape
    y = torch.zeros(n, HIDDEN, dtype=torch.float32)
    for t in range(n):
        a0 = x_q[t:t + 1].float() if x_sf is None else dequant_per_token_fp8(x_q[t:t + 1], x_sf[t:t + 1])
        acc = torch.zeros(HIDDEN, dtype=torch.float32)
        for k in range(num_topk):
            e = int(topk_idx[t, k])
            if e < 0:
                continue
            h = (a0 @ l1[e].T)[0]
            a = F.silu(h[:INTERMEDIATE]) * h[INTERMEDIATE:] * topk_weights[t, k]
            if mma_type == "bf16xbf16":
                a_q = a.bfloat16().float()
            else:
                a_q = dequant_per_token_fp8(*per_token_cast_to_fp8(a[None]))[0]
            acc = acc + (l2[e] @ a_q).bfloat16().float()
        y[t] = acc.bfloat16().float()
    return y


def _quantized_weights(l1, l2, mma_type: str):
    """Dequantized weights of the given format, as a caller of reference_moe_emulated prepares them."""
    if mma_type == "fp8xfp8":
        return (dequant_per_block_fp8(*per_block_cast_to_fp8(l1)),
                dequant_per_block_fp8(*per_block_cast_to_fp8(l2)))
    if mma_type == "fp8xfp4":
        return dequant_mxfp4(*cast_to_mxfp4(l1)), dequant_mxfp4(*cast_to_mxfp4(l2))
    return l1.bfloat16().float(), l2.bfloat16().float()


def _quantized_x(x, mma_type: str):
    if mma_type == "bf16xbf16":
        return x.bfloat16(), None
    return per_token_cast_to_fp8(x)


# --------------------------------------------------------------------------------------------------
# reference_moe
# --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("num_topk", [2, 4])
@pytest.mark.parametrize("clamp", [None, 0.5])
def test_reference_matches_naive(num_topk, clamp):
    x, topk_idx, topk_weights, l1, l2 = _make_problem(48, num_topk, seed=num_topk, mask_ratio=0.2)
    expected = _naive_moe(x, topk_idx, topk_weights, l1, l2, clamp)

    y64 = reference_moe(x, topk_idx, topk_weights, l1, l2, clamp, dtype=torch.float64)
    assert y64.dtype == torch.float64 and y64.shape == (48, HIDDEN)
    torch.testing.assert_close(y64, expected, rtol=1e-12, atol=1e-12)

    y32 = reference_moe(x, topk_idx, topk_weights, l1, l2, activation_clamp=clamp)
    assert y32.dtype == torch.float32 and y32.shape == (48, HIDDEN)
    assert calc_diff(y32, expected) < 1e-10


def test_reference_accepts_bf16_inputs():
    x, topk_idx, topk_weights, l1, l2 = _make_problem(16, 2, seed=20)
    x, l1, l2 = x.bfloat16(), l1.bfloat16(), l2.bfloat16()
    y = reference_moe(x, topk_idx, topk_weights, l1, l2)
    assert y.dtype == torch.float32
    assert calc_diff(y, _naive_moe(x, topk_idx, topk_weights, l1, l2)) < 1e-10


def test_masked_slots_and_fully_masked_tokens():
    x, topk_idx, topk_weights, l1, l2 = _make_problem(32, 4, seed=21, mask_ratio=0.3)
    topk_idx[[3, 17]] = -1  # tokens routed nowhere
    y = reference_moe(x, topk_idx, topk_weights, l1, l2)
    assert bool((y[[3, 17]] == 0).all())
    assert bool((y.abs().sum(1)[topk_idx.max(1).values >= 0] > 0).all())
    assert calc_diff(y, _naive_moe(x, topk_idx, topk_weights, l1, l2)) < 1e-10

    # A masked slot contributes nothing whatever its weight; dropping the slot gives the same result
    for k in range(4):
        keep = [j for j in range(4) if j != k]
        only_masked_k = topk_idx.clone()
        only_masked_k[:, k] = -1
        y_masked = reference_moe(x, only_masked_k, topk_weights, l1, l2, dtype=torch.float64)
        y_dropped = reference_moe(x, only_masked_k[:, keep], topk_weights[:, keep], l1, l2,
                                  dtype=torch.float64)
        torch.testing.assert_close(y_masked, y_dropped, rtol=1e-13, atol=1e-13)


def test_all_tokens_one_expert():
    x, topk_idx, topk_weights, l1, l2 = _make_problem(40, 2, seed=22)
    topk_idx[:, 0] = 5
    topk_idx[:, 1] = -1
    y = reference_moe(x, topk_idx, topk_weights, l1, l2, dtype=torch.float64)
    # Dense formula for a single expert
    h = x.double() @ l1[5].double().T
    a = F.silu(h[:, :INTERMEDIATE]) * h[:, INTERMEDIATE:] * topk_weights[:, :1].double()
    torch.testing.assert_close(y, a @ l2[5].double().T, rtol=1e-12, atol=1e-12)
    assert calc_diff(reference_moe(x, topk_idx, topk_weights, l1, l2),
                     _naive_moe(x, topk_idx, topk_weights, l1, l2)) < 1e-10


def test_experts_receiving_nothing_are_not_read():
    x, topk_idx, topk_weights, l1, l2 = _make_problem(24, 2, seed=23)
    g = _gen(24)
    used = (1, 6)
    topk_idx = torch.tensor(used)[torch.stack([torch.randperm(2, generator=g) for _ in range(24)])]
    for e in range(NUM_EXPERTS):
        if e not in used:
            l1[e] = float("nan")
            l2[e] = float("nan")
    y = reference_moe(x, topk_idx, topk_weights, l1, l2)
    assert bool(torch.isfinite(y).all())
    assert calc_diff(y, _naive_moe(x, topk_idx, topk_weights, l1, l2)) < 1e-10
    x_q, x_sf = per_token_cast_to_fp8(x)
    y_emu = reference_moe_emulated(x_q, x_sf, topk_idx, topk_weights, l1, l2, "fp8xfp8")
    assert bool(torch.isfinite(y_emu).all())


def test_zero_tokens():
    x, topk_idx, topk_weights, l1, l2 = _make_problem(0, 3, seed=25)
    y = reference_moe(x, topk_idx, topk_weights, l1, l2)
    assert y.shape == (0, HIDDEN) and y.dtype == torch.float32
    x_q, x_sf = per_token_cast_to_fp8(x)
    for mma_type in ("fp8xfp8", "fp8xfp4"):
        y = reference_moe_emulated(x_q, x_sf, topk_idx, topk_weights, l1, l2, mma_type)
        assert y.shape == (0, HIDDEN) and y.dtype == torch.float32
    y = reference_moe_emulated(x.bfloat16(), None, topk_idx, topk_weights, l1, l2, "bf16xbf16")
    assert y.shape == (0, HIDDEN)


def test_activation_clamp():
    x, topk_idx, topk_weights, l1, l2 = _make_problem(32, 3, seed=26)
    x = x * 4  # pre-activations of a few units, so a clamp of 1 bites on both gate and up
    y = reference_moe(x, topk_idx, topk_weights, l1, l2)
    y_clamped = reference_moe(x, topk_idx, topk_weights, l1, l2, activation_clamp=1.0)
    assert calc_diff(y, y_clamped) > 1e-2
    assert calc_diff(y_clamped, _naive_moe(x, topk_idx, topk_weights, l1, l2, clamp=1.0)) < 1e-10
    # Gate is clamped from above only: a clamp on up alone would not give the naive result
    h = x.double() @ l1[0].double().T
    assert bool((h[:, :INTERMEDIATE] < -1).any()) and bool((h[:, INTERMEDIATE:] < -1).any())
    # A clamp above every pre-activation is a no-op, bit for bit
    assert torch.equal(reference_moe(x, topk_idx, topk_weights, l1, l2, activation_clamp=1e30), y)
    with pytest.raises(ValueError, match="activation_clamp"):
        reference_moe(x, topk_idx, topk_weights, l1, l2, activation_clamp=-1.0)
    with pytest.raises(ValueError, match="activation_clamp"):
        reference_moe(x, topk_idx, topk_weights, l1, l2, activation_clamp=float("nan"))


@pytest.mark.parametrize("bad_id", [NUM_EXPERTS, -2, 1000])
def test_bad_expert_id_raises(bad_id):
    x, topk_idx, topk_weights, l1, l2 = _make_problem(16, 2, seed=27)
    topk_idx[int(torch.randint(0, 16, (1,), generator=_gen(bad_id + 10))), 1] = bad_id
    with pytest.raises(ValueError, match="topk_idx holds expert ids"):
        reference_moe(x, topk_idx, topk_weights, l1, l2)
    x_q, x_sf = per_token_cast_to_fp8(x)
    with pytest.raises(ValueError, match="topk_idx holds expert ids"):
        reference_moe_emulated(x_q, x_sf, topk_idx, topk_weights, l1, l2, "fp8xfp8")


def test_reference_argument_errors():
    x, topk_idx, topk_weights, l1, l2 = _make_problem(8, 2, seed=28)
    with pytest.raises(TypeError, match="topk_idx must be int64"):
        reference_moe(x, topk_idx.int(), topk_weights, l1, l2)
    with pytest.raises(ValueError, match="topk_idx must have shape"):
        reference_moe(x, topk_idx[:4], topk_weights, l1, l2)
    with pytest.raises(ValueError, match="topk_weights must have shape"):
        reference_moe(x, topk_idx, topk_weights[:, :1], l1, l2)
    with pytest.raises(ValueError, match="l1_weights must have shape"):
        reference_moe(x, topk_idx, topk_weights, l1[:, :, :128], l2)
    with pytest.raises(ValueError, match="l2_weights must have shape"):
        reference_moe(x, topk_idx, topk_weights, l1, l2[:, :, :64])
    with pytest.raises(ValueError, match="x must have 2 dims"):
        reference_moe(x[0], topk_idx, topk_weights, l1, l2)
    with pytest.raises(ValueError, match="dtype must be"):
        reference_moe(x, topk_idx, topk_weights, l1, l2, dtype=torch.bfloat16)


# --------------------------------------------------------------------------------------------------
# reference_moe_emulated
# --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("mma_type,low,high", [("fp8xfp8", 2e-4, 2e-3), ("fp8xfp4", 2e-4, 2e-3),
                                                ("bf16xbf16", 5e-7, 1e-5)])
@pytest.mark.parametrize("clamp", [None, 0.75])
def test_emulated_vs_reference(mma_type, low, high, clamp):
    x, topk_idx, topk_weights, l1, l2 = _make_problem(64, 4, seed=30, mask_ratio=0.1)
    w1, w2 = _quantized_weights(l1, l2, mma_type)
    x_q, x_sf = _quantized_x(x.bfloat16(), mma_type)
    y = reference_moe_emulated(x_q, x_sf, topk_idx, topk_weights, w1, w2, mma_type, activation_clamp=clamp)
    assert y.dtype == torch.float32 and y.shape == (64, HIDDEN)
    assert torch.equal(y, y.bfloat16().float()), "result must be BF16-representable"
    # Same weights, unquantized activations: the difference is activation rounding only
    diff = calc_diff(y, reference_moe(x.bfloat16(), topk_idx, topk_weights, w1, w2, clamp))
    assert low < diff < high, f"{mma_type}: calc_diff {diff:.3g} outside ({low}, {high})"


@pytest.mark.parametrize("mma_type", ["fp8xfp8", "fp8xfp4", "bf16xbf16"])
def test_emulated_matches_stepwise_loop(mma_type):
    x, topk_idx, topk_weights, l1, l2 = _make_problem(32, 3, seed=31, mask_ratio=0.15)
    topk_idx[7] = -1
    w1, w2 = _quantized_weights(l1, l2, mma_type)
    x_q, x_sf = _quantized_x(x, mma_type)
    y = reference_moe_emulated(x_q, x_sf, topk_idx, topk_weights, w1, w2, mma_type)
    expected = _naive_emulated(x_q, x_sf, topk_idx, topk_weights, w1, w2, mma_type)
    assert calc_diff(y, expected) < 1e-7
    assert (y == expected).float().mean().item() >= 0.99
    assert bool((y[7] == 0).all())
    # Deterministic: a second call is bit-identical
    assert torch.equal(y, reference_moe_emulated(x_q, x_sf, topk_idx, topk_weights, w1, w2, mma_type))


def test_emulated_argument_errors():
    x, topk_idx, topk_weights, l1, l2 = _make_problem(8, 2, seed=32)
    x_q, x_sf = per_token_cast_to_fp8(x)
    with pytest.raises(ValueError, match="mma_type must be one of"):
        reference_moe_emulated(x_q, x_sf, topk_idx, topk_weights, l1, l2, "fp4xfp4")
    with pytest.raises(TypeError, match="x_q must be torch.float8_e4m3fn"):
        reference_moe_emulated(x.bfloat16(), x_sf, topk_idx, topk_weights, l1, l2, "fp8xfp4")
    with pytest.raises(ValueError, match="x_sf is required"):
        reference_moe_emulated(x_q, None, topk_idx, topk_weights, l1, l2, "fp8xfp8")
    with pytest.raises(TypeError, match="x_q must be torch.bfloat16"):
        reference_moe_emulated(x_q, None, topk_idx, topk_weights, l1, l2, "bf16xbf16")
    with pytest.raises(ValueError, match="x_sf must be None"):
        reference_moe_emulated(x.bfloat16(), x_sf, topk_idx, topk_weights, l1, l2, "bf16xbf16")
    with pytest.raises(ValueError, match="sf must have shape"):
        reference_moe_emulated(x_q, x_sf[:, :1], topk_idx, topk_weights, l1, l2, "fp8xfp8")
    # The L1 output is quantized per 128: intermediate must be a multiple of 128
    with pytest.raises(ValueError, match="intermediate \\(64\\) must be a multiple of 128"):
        reference_moe_emulated(x_q, x_sf, topk_idx, topk_weights, l1[:, 64:192], l2[:, :, :64], "fp8xfp8")


# --------------------------------------------------------------------------------------------------
# calc_diff
# --------------------------------------------------------------------------------------------------

def test_calc_diff_properties():
    g = _gen(40)
    a = torch.randn(64, 256, generator=g)
    assert calc_diff(a, a) == 0.0
    assert calc_diff(a, a.clone().bfloat16()) > 0.0
    for s in (0.5, 0.99, 1.01, 3.0):
        expected = (1 - s) ** 2 / (1 + s ** 2)
        assert calc_diff(a.double(), a.double() * s) == pytest.approx(expected, rel=1e-9)
    assert calc_diff(a, -a) == pytest.approx(2.0)
    b = a + 1e-3 * torch.randn(64, 256, generator=g)
    assert calc_diff(a, b) == pytest.approx(calc_diff(b, a), rel=1e-12)
    # ~ (relative error)^2 / 2
    assert calc_diff(a, b) == pytest.approx(1e-6 / 2, rel=0.1)
    assert calc_diff(torch.zeros(4), torch.zeros(4)) == 0.0


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_calc_diff_non_finite_is_inf(bad):
    g = _gen(41)
    a = torch.randn(32, 32, generator=g)
    b = a.clone()
    b[int(torch.randint(0, 32, (1,), generator=g)), int(torch.randint(0, 32, (1,), generator=g))] = bad
    assert calc_diff(a, b) == float("inf")
    assert calc_diff(b, a) == float("inf")
    assert not calc_diff(a, b) < 1e-3


def test_calc_diff_shape_mismatch():
    with pytest.raises(ValueError, match="same shape"):
        calc_diff(torch.randn(4, 4), torch.randn(4, 5))


# --------------------------------------------------------------------------------------------------
# GPU
# --------------------------------------------------------------------------------------------------

@requires_cuda
@pytest.mark.parametrize("mma_type", ["fp8xfp8", "fp8xfp4", "bf16xbf16"])
def test_gpu_matches_cpu(mma_type):
    x, topk_idx, topk_weights, l1, l2 = _make_problem(64, 4, seed=50, mask_ratio=0.1)
    y_cpu = reference_moe(x, topk_idx, topk_weights, l1, l2)
    cuda = [t.cuda() for t in (x, topk_idx, topk_weights, l1, l2)]
    y_gpu = reference_moe(*cuda)
    assert y_gpu.device.type == "cuda"
    assert calc_diff(y_gpu.cpu(), y_cpu) < 1e-10

    w1, w2 = _quantized_weights(l1, l2, mma_type)
    x_q, x_sf = _quantized_x(x, mma_type)
    y_emu = reference_moe_emulated(x_q, x_sf, topk_idx, topk_weights, w1, w2, mma_type)
    args = [x_q.cuda(), None if x_sf is None else x_sf.cuda(), topk_idx.cuda(), topk_weights.cuda(),
            w1.cuda(), w2.cuda()]
    y_emu_gpu = reference_moe_emulated(*args, mma_type)
    # float32 on both devices, differing only in accumulation order (~1e-13), which may also move an
    # E4M3 re-quantization of h across a rounding boundary now and then; 1e-8 is far above both and
    # far below any real mismatch (a wrong scale or row: 1e-3 and more)
    assert calc_diff(y_emu_gpu.cpu(), y_emu) < 1e-8
