"""Weight transforms (`deep_gemm/mega/transform.py`): gate/up interleave, MXFP4 rebasing, inverses."""
import warnings

import pytest
import torch

from deep_gemm.mega import (dequant_mega_moe_fp4, fp4_expansion_table, inverse_transform_weights_for_mega_moe,
                            mxfp4_transform_error, transform_weights_for_mega_moe)
from deep_gemm.utils import dequant_mxfp4

E, I, H = 2, 256, 384   # 2 gate/up block pairs, 3 K-blocks of hidden


def gen(seed):
    return torch.Generator().manual_seed(seed)


def random_bf16(shape, seed):
    return torch.randn(shape, generator=gen(seed)).to(torch.bfloat16)


def random_fp8(shape, seed):
    n, k = shape[1], shape[2]
    w = (torch.randn(shape, generator=gen(seed)) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    sf = torch.rand(shape[0], n // 128, k // 128, generator=gen(seed + 1)) + 1e-3
    return w, sf


def random_mxfp4(shape, seed, sf_low=117, sf_high=131):
    """Packed E2M1 [E, N, K/2] and UE8M0 [E, N, K/32] with exponents in [sf_low, sf_high]."""
    e, n, k = shape
    w = torch.randint(0, 256, (e, n, k // 2), generator=gen(seed), dtype=torch.uint8)
    sf = torch.randint(sf_low, sf_high + 1, (e, n, k // 32), generator=gen(seed + 1), dtype=torch.uint8)
    return w, sf


def assert_same(a, b):
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    else:
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_same(x, y)


def l1_blocks_by_row(t, rows_per_block):
    """Check helper: rows [rows_per_block * j, rows_per_block * (j+1)) of gate and up."""
    half = t.shape[1] // 2
    gate, up = t[:, :half], t[:, half:]
    return [(gate[:, j * rows_per_block:(j + 1) * rows_per_block], up[:, j * rows_per_block:(j + 1) * rows_per_block])
            for j in range(half // rows_per_block)]


def assert_interleaved(original, transformed, rows_per_block):
    assert transformed.is_contiguous()
    for j, (gate, up) in enumerate(l1_blocks_by_row(original, rows_per_block)):
        base = 2 * rows_per_block * j
        assert torch.equal(transformed[:, base:base + rows_per_block].view(torch.uint8), gate.view(torch.uint8))
        assert torch.equal(transformed[:, base + rows_per_block:base + 2 * rows_per_block].view(torch.uint8),
                           up.view(torch.uint8))


# --------------------------------------------------------------------------------------------------
# BF16 / FP8
# --------------------------------------------------------------------------------------------------

def test_bf16_interleave_and_round_trip():
    l1, l2 = random_bf16((E, 2 * I, H), 0), random_bf16((E, H, I), 1)
    t1, t2 = transform_weights_for_mega_moe(l1, l2)
    assert t1.dtype == torch.bfloat16 and t1.shape == l1.shape
    assert_interleaved(l1, t1, 128)
    assert_same(t2, l2)
    r1, r2 = inverse_transform_weights_for_mega_moe(t1, t2)
    assert_same(r1, l1)
    assert_same(r2, l2)


def test_interleave_row_positions():
    # Row r of l1 holds r (as r % 128 in column 0 and r // 128 in column 1: exact in BF16): gate block j
    # lands at [256j, 256j+128), up block j at [256j+128, 256j+256)
    rows = torch.arange(2 * I)
    l1 = torch.zeros(1, 2 * I, 128)
    l1[0, :, 0], l1[0, :, 1] = (rows % 128).float(), (rows // 128).float()
    t1, _ = transform_weights_for_mega_moe(l1.to(torch.bfloat16), torch.zeros(1, 128, I, dtype=torch.bfloat16))
    got = (t1[0, :, 0].float() + 128 * t1[0, :, 1].float()).long()
    for j in range(I // 128):
        assert torch.equal(got[256 * j:256 * j + 128], rows[128 * j:128 * j + 128])
        assert torch.equal(got[256 * j + 128:256 * j + 256], rows[I + 128 * j:I + 128 * j + 128])


def test_non_contiguous_input_is_accepted():
    l1 = random_bf16((E, H, 2 * I), 2).transpose(1, 2)
    t1, _ = transform_weights_for_mega_moe(l1, random_bf16((E, H, I), 3))
    assert_interleaved(l1.contiguous(), t1, 128)


def test_fp8_interleave_and_round_trip():
    l1, l2 = random_fp8((E, 2 * I, H), 10), random_fp8((E, H, I), 20)
    (w1, sf1), (w2, sf2) = transform_weights_for_mega_moe(l1, l2)
    assert w1.dtype == torch.float8_e4m3fn and sf1.dtype == torch.float32
    assert_interleaved(l1[0], w1, 128)
    assert_interleaved(l1[1], sf1, 1)     # block-scale rows follow their 128-row blocks
    assert_same((w2, sf2), l2)
    r1, r2 = inverse_transform_weights_for_mega_moe((w1, sf1), (w2, sf2))
    assert_same(r1, l1)
    assert_same(r2, l2)


@pytest.mark.parametrize('l1, l2, error', [
    (torch.zeros(E, 2 * I, H), torch.zeros(E, H, I), TypeError),                                   # float32
    (torch.zeros(E, 2 * I, H, dtype=torch.bfloat16), torch.zeros(E, H, 2 * I, dtype=torch.bfloat16), ValueError),
    (torch.zeros(E, 2 * I, 200, dtype=torch.bfloat16), torch.zeros(E, 200, I, dtype=torch.bfloat16), ValueError),
    (torch.zeros(E, 2 * 128 + 128, H, dtype=torch.bfloat16), torch.zeros(E, H, 192, dtype=torch.bfloat16), ValueError),
    (torch.zeros(E, 2 * I, H, dtype=torch.bfloat16), torch.zeros(E + 1, H, I, dtype=torch.bfloat16), ValueError),
])
def test_invalid_weights_raise(l1, l2, error):
    with pytest.raises(error):
        transform_weights_for_mega_moe(l1, l2)


def test_fp8_scale_shape_is_checked():
    (w1, sf1), l2 = random_fp8((E, 2 * I, H), 0), random_fp8((E, H, I), 1)
    with pytest.raises(ValueError, match='l1 scales'):
        transform_weights_for_mega_moe((w1, sf1[:, :-1]), l2)


# --------------------------------------------------------------------------------------------------
# FP4 expansion table
# --------------------------------------------------------------------------------------------------

E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]


def test_expansion_table_matches_torch_e4m3_rounding():
    table = fp4_expansion_table()
    assert table.dtype == torch.uint8 and table.shape == (16, 16)
    values = torch.tensor(E2M1, dtype=torch.float64)
    for d in range(16):
        expected = (values * 2.0 ** (6 - d)).to(torch.float8_e4m3fn).view(torch.uint8)
        assert torch.equal(table[d], expected), d


def test_expansion_table_exact_up_to_delta_14():
    table = fp4_expansion_table()
    values = torch.tensor(E2M1, dtype=torch.float64)
    for d in range(15):
        got = table[d].view(torch.float8_e4m3fn).to(torch.float64)
        assert torch.equal(got, values * 2.0 ** (6 - d)), d
    # Delta 15 is not: 0.5 * 2^-9 rounds (to even) to 0
    assert table[15, 1].item() == 0 and table[15, 2].item() == 1


# --------------------------------------------------------------------------------------------------
# MXFP4
# --------------------------------------------------------------------------------------------------

def unblock_packed(t):
    # Kernel-format packed codes [E, N/128, K/128, 8192] -> row-major [E, N, K/2], written out here
    # rather than taken from transform.py
    e, nb, kb, _ = t.shape
    return t.reshape(e, nb, kb, 128, 64).permute(0, 1, 3, 2, 4).reshape(e, nb * 128, kb * 64)


def fp4_pair(seed=0, **kwargs):
    return random_mxfp4((E, 2 * I, H), seed, **kwargs), random_mxfp4((E, H, I), seed + 100, **kwargs)


def test_fp4_format_and_round_trip():
    l1, l2 = fp4_pair()
    with warnings.catch_warnings():
        warnings.simplefilter('error')    # exponents span 14: lossless, no warning
        t1, t2 = transform_weights_for_mega_moe(l1, l2)
    for t, (w, sf) in ((t1, l1), (t2, l2)):
        assert len(t) == 3
        n, k = w.shape[1], w.shape[2] * 2
        assert t[0].dtype == torch.uint8 and t[0].shape == (E, n // 128, k // 128, 8192)
        assert t[1].dtype == torch.uint8 and t[1].shape == (E, n // 128, k // 128, 512) and int(t[1].max()) <= 14
        assert t[2].dtype == torch.float32 and t[2].shape == (E, n // 128, k // 128)
        assert all(x.is_contiguous() for x in t)
    # Packed codes: byte r * 64 + j of block (e, nb, kb) is byte kb * 64 + j of row nb * 128 + r
    assert t2[0][1, 2, 1, 5 * 64 + 7] == l2[0][1, 2 * 128 + 5, 64 + 7]
    assert t2[0][0, 0, 1, 127 * 64 + 63] == l2[0][0, 127, 64 + 63]
    assert_interleaved(l1[0], unblock_packed(t1[0]), 128)
    assert_same(unblock_packed(t2[0]), l2[0])
    r1, r2 = inverse_transform_weights_for_mega_moe(t1, t2)
    assert_same(r1, l1)
    assert_same(r2, l2)


def test_fp4_kernel_dequant_equals_mxfp4_dequant():
    l1, l2 = fp4_pair(seed=5)
    t1, t2 = transform_weights_for_mega_moe(l1, l2)
    # l2: row order unchanged
    assert torch.equal(dequant_mega_moe_fp4(*t2), dequant_mxfp4(*l2))
    # l1: compare after undoing the interleave on the dequantized rows
    kernel = dequant_mega_moe_fp4(*t1)
    reference = dequant_mxfp4(*l1)
    for j, (gate, up) in enumerate(l1_blocks_by_row(reference, 128)):
        assert torch.equal(kernel[:, 256 * j:256 * j + 128], gate)
        assert torch.equal(kernel[:, 256 * j + 128:256 * j + 256], up)


def test_fp4_block_scale_and_delta_values():
    (w1, sf1), l2 = fp4_pair(seed=7)
    t1, _ = transform_weights_for_mega_moe((w1, sf1), l2)
    # Undo the interleave (block rows [g0, u0, g1, u1] -> [g0, g1, u0, u1]) and recompute from the scales
    nb, kb = 2 * I // 128, H // 128
    scale = t1[2].reshape(E, nb // 2, 2, kb).transpose(1, 2).reshape(E, nb, kb)
    # Kernel deltas [E, NB, KB, 512], byte r * 4 + g = row r, group g of the block: same block-row undo
    delta = t1[1].reshape(E, nb // 2, 2, kb, 128, 4).transpose(1, 2).reshape(E, nb, kb, 128, 4)
    base = sf1.to(torch.int32).reshape(E, nb, 128, kb, 4).amax(dim=(2, 4))
    assert torch.equal(scale, torch.exp2(base.double() - 133).float())
    expected_delta = base[:, :, None, :, None] - sf1.to(torch.int32).reshape(E, nb, 128, kb, 4)
    assert torch.equal(delta.to(torch.int32), expected_delta.permute(0, 1, 3, 2, 4))


def test_fp4_delta_kernel_layout():
    # The defining property on random row-major deltas: new[e, nb, kb, r * 4 + g] == old[e, nb * 128 + r, kb * 4 + g]
    from deep_gemm.mega.transform import _deltas_from_kernel_blocks, _deltas_to_kernel_blocks
    e, n, k = 3, 384, 512
    old = torch.randint(0, 256, (e, n, k // 32), generator=gen(43), dtype=torch.uint8)
    new = _deltas_to_kernel_blocks(old)
    assert new.dtype == torch.uint8 and new.shape == (e, n // 128, k // 128, 512) and new.is_contiguous()
    ei, nb, kb, r, g = torch.meshgrid(torch.arange(e), torch.arange(n // 128), torch.arange(k // 128),
                                      torch.arange(128), torch.arange(4), indexing='ij')
    assert torch.equal(new[ei, nb, kb, r * 4 + g], old[ei, nb * 128 + r, kb * 4 + g])
    # Spot checks by hand, and the inverse
    assert new[2, 1, 3, 127 * 4 + 3] == old[2, 255, 15] and new[0, 2, 1, 5 * 4 + 2] == old[0, 261, 6]
    assert torch.equal(_deltas_from_kernel_blocks(new), old)

    # The transform's deltas follow it: l2 rows as is, l1 rows interleaved first, then blocked
    (w1, sf1), (w2, sf2) = fp4_pair(seed=47)
    t1, t2 = transform_weights_for_mega_moe((w1, sf1), (w2, sf2))
    for t, sf, interleaved in ((t1, sf1, True), (t2, sf2, False)):
        rows_first = sf.to(torch.int32)
        if interleaved:
            half = rows_first.shape[1] // 2
            rows_first = torch.cat([torch.cat([rows_first[:, j * 128:(j + 1) * 128],
                                               rows_first[:, half + j * 128:half + (j + 1) * 128]], dim=1)
                                    for j in range(half // 128)], dim=1)
        nb_, kb_ = rows_first.shape[1] // 128, rows_first.shape[2] // 4
        base = rows_first.reshape(E, nb_, 128, kb_, 4).amax(dim=(2, 4))
        old_layout = (base.repeat_interleave(128, dim=1).repeat_interleave(4, dim=2) - rows_first).clamp(max=15)
        ei, nb, kb, r, g = torch.meshgrid(torch.arange(E), torch.arange(nb_), torch.arange(kb_),
                                          torch.arange(128), torch.arange(4), indexing='ij')
        assert torch.equal(t[1][ei, nb, kb, r * 4 + g].to(torch.int32), old_layout[ei, nb * 128 + r, kb * 4 + g])
    # The round trip still reproduces the input
    r1, r2 = inverse_transform_weights_for_mega_moe(t1, t2)
    assert_same(r1, (w1, sf1))
    assert_same(r2, (w2, sf2))


def test_fp4_old_delta_layout_rejected():
    (w1, sf1), (w2, sf2) = fp4_pair(seed=53)
    t1, t2 = transform_weights_for_mega_moe((w1, sf1), (w2, sf2))
    from deep_gemm.mega.transform import _deltas_from_kernel_blocks
    old_style = (t2[0], _deltas_from_kernel_blocks(t2[1]), t2[2])   # row-major [E, N, K/32]
    with pytest.raises(ValueError, match=r'dequant_mega_moe_fp4 delta must have shape \(2, 3, 2, 512\)'):
        dequant_mega_moe_fp4(*old_style)
    with pytest.raises(ValueError, match=r'l2 delta must have shape \(2, 3, 2, 512\) \(\[E, N/128, K/128, 512\]'):
        inverse_transform_weights_for_mega_moe(t1, old_style)


def test_fp4_full_exponent_range_and_lossy_groups():
    # Exponents over the whole UE8M0 range 0..254: most groups are far below their block's max
    l1, l2 = fp4_pair(seed=11, sf_low=0, sf_high=254)
    # ... except two blocks of l2 with a narrow spread (one at the top of the range), which stay exact
    sf2 = l2[1].clone()
    sf2[0, :128, :4] = torch.randint(240, 255, (128, 4), generator=gen(3), dtype=torch.uint8)
    sf2[1, 128:256, 4:8] = torch.randint(0, 15, (128, 4), generator=gen(4), dtype=torch.uint8)
    l2 = (l2[0], sf2)
    report = mxfp4_transform_error(*l1)
    assert report['num_groups'] == l1[1].numel()
    assert report['num_clamped_groups'] > 0 and report['num_lossy_groups'] > 0
    assert report['num_lossy_groups'] <= report['num_clamped_groups']
    assert 0 < report['max_rel_error'] <= 1.0
    with pytest.warns(UserWarning, match='lose precision'):
        _, t2 = transform_weights_for_mega_moe(l1, l2)
    kernel = dequant_mega_moe_fp4(*t2)
    reference = dequant_mxfp4(*l2)
    assert torch.equal(kernel[0, :128, :128], reference[0, :128, :128])
    assert torch.equal(kernel[1, 128:256, 128:256], reference[1, 128:256, 128:256])
    assert not torch.equal(kernel, reference)


def test_fp4_one_group_20_exponents_below_reports_loss():
    (w1, sf1), l2 = fp4_pair(seed=13, sf_low=127, sf_high=127)
    w1, sf1 = w1.clone(), sf1.clone()
    # Every nibble of group (expert 0, row 5, group 2) is 0.5 (code 1): 20 exponents below its block's
    # base they would need 0.5 * 2^(6 - 20) = 2^-15, under E4M3's 2^-9, so the whole group is lost
    sf1[0, 5, 2] = 107
    w1[0, 5, 2 * 16:3 * 16] = 0x11
    report = mxfp4_transform_error(w1, sf1)
    assert report['num_clamped_groups'] == 1
    assert report['num_lossy_groups'] == 1 and report['num_lossy_blocks'] == 1
    block = dequant_mxfp4(w1, sf1)[0, :128, :128].double()
    expected = block[5, 64:96].norm() / block.norm()   # the lost group's values become 0
    assert report['max_rel_error'] == pytest.approx(float(expected), rel=1e-12)
    with pytest.warns(UserWarning, match=r'1 of \d+ MXFP4 groups') as record:
        t1, t2 = transform_weights_for_mega_moe((w1, sf1), l2)
    assert f'{report["max_rel_error"]:.3e}' in str(record[0].message)
    # The kernel-side weights: that group is zero, everything else exact
    kernel = dequant_mega_moe_fp4(*t1)
    reference = dequant_mxfp4(w1, sf1)
    assert bool((kernel[0, 5, 64:96] == 0).all())
    reference[0, 5, 64:96] = 0
    gate_up = torch.cat([kernel[:, 256 * j:256 * j + 128] for j in range(I // 128)] +
                        [kernel[:, 256 * j + 128:256 * j + 256] for j in range(I // 128)], dim=1)
    assert torch.equal(gate_up, reference)


def test_fp4_delta_15_partial_loss():
    # A group exactly 15 below: code 2 (1.0 -> 2^-9) survives, code 1 (0.5 -> 2^-10) rounds to 0
    (w1, sf1), l2 = fp4_pair(seed=17, sf_low=127, sf_high=127)
    w1, sf1 = w1.clone(), sf1.clone()
    sf1[1, 0, 0] = 112
    w1[1, 0, :16] = 0x21   # elements alternate 0.5, 1.0
    report = mxfp4_transform_error(w1, sf1)
    assert report['num_lossy_groups'] == 1
    with pytest.warns(UserWarning):
        t1, _ = transform_weights_for_mega_moe((w1, sf1), l2)
    kernel = dequant_mega_moe_fp4(*t1)[1, 0, :32]
    assert torch.equal(kernel[0::2], torch.zeros(16))
    assert torch.equal(kernel[1::2], torch.full((16,), 2.0 ** -15))


def test_fp4_clamped_but_zero_groups_do_not_warn():
    # All-zero rows with a tiny exponent next to normal rows: clamped, but nothing to lose
    (w1, sf1), l2 = fp4_pair(seed=19, sf_low=120, sf_high=127)
    w1, sf1 = w1.clone(), sf1.clone()
    w1[:, 3] = 0
    w1[:, 9] = 0x88      # -0 everywhere
    sf1[:, 3] = 0
    sf1[:, 9] = 0
    report = mxfp4_transform_error(w1, sf1)
    assert report['num_clamped_groups'] == 2 * E * H // 32
    assert report['num_lossy_groups'] == 0 and report['max_rel_error'] == 0.0
    with warnings.catch_warnings():
        warnings.simplefilter('error')
        t1, t2 = transform_weights_for_mega_moe((w1, sf1), l2)
    kernel = dequant_mega_moe_fp4(*t1)
    assert bool((kernel[:, 3] == 0).all())
    # Zero rows come back as zero rows (their exponent is clamped to base - 15)
    (rw1, rsf1), _ = inverse_transform_weights_for_mega_moe(t1, t2)
    assert torch.equal(rw1, w1)
    assert bool((dequant_mxfp4(rw1, rsf1)[:, 3] == 0).all())


def test_fp4_max_magnitude_everywhere():
    # 6 (code 7) and -6 (code 15) in every element, exponents up to 254: no E4M3 overflow (384 <= 448)
    (w1, sf1), (w2, sf2) = fp4_pair(seed=23, sf_low=240, sf_high=254)
    w1 = torch.full_like(w1, 0xF7)
    w2 = torch.full_like(w2, 0x77)
    t1, t2 = transform_weights_for_mega_moe((w1, sf1), (w2, sf2))
    table = fp4_expansion_table()
    for d in range(15):
        assert table[d, 7].view(torch.float8_e4m3fn).float().item() == 6 * 2.0 ** (6 - d)
    kernel = dequant_mega_moe_fp4(*t2)
    reference = dequant_mxfp4(w2, sf2)
    finite = torch.isfinite(reference)
    assert torch.equal(kernel[finite], reference[finite])
    r1, r2 = inverse_transform_weights_for_mega_moe(t1, t2)
    assert_same(r1, (w1, sf1))
    assert_same(r2, (w2, sf2))


def test_fp4_smallest_exponents_exact():
    # Exponents 0..14 (scales down to 2^-127): block scales 2^(b - 133) are float32 subnormals, still exact
    l1, l2 = fp4_pair(seed=29, sf_low=0, sf_high=14)
    t1, t2 = transform_weights_for_mega_moe(l1, l2)
    assert torch.equal(dequant_mega_moe_fp4(*t2), dequant_mxfp4(*l2))
    r1, r2 = inverse_transform_weights_for_mega_moe(t1, t2)
    assert_same(r1, l1)
    assert_same(r2, l2)


def test_fp4_nan_scale_rejected():
    (w1, sf1), l2 = fp4_pair(seed=31)
    sf1 = sf1.clone()
    sf1[0, 0, 0] = 255
    with pytest.raises(ValueError, match='255'):
        transform_weights_for_mega_moe((w1, sf1), l2)


def test_fp4_torch_dtypes_accepted():
    if not hasattr(torch, 'float4_e2m1fn_x2') or not hasattr(torch, 'float8_e8m0fnu'):
        pytest.skip('torch without float4_e2m1fn_x2 / float8_e8m0fnu')
    l1, l2 = fp4_pair(seed=37)
    t_ref = transform_weights_for_mega_moe(l1, l2)
    typed = lambda p: (p[0].view(torch.float4_e2m1fn_x2), p[1].view(torch.float8_e8m0fnu))
    t = transform_weights_for_mega_moe(typed(l1), typed(l2))
    assert_same(t, t_ref)


def test_fp4_shape_checks():
    (w1, sf1), l2 = fp4_pair(seed=41)
    with pytest.raises(ValueError, match='l1 scales'):
        transform_weights_for_mega_moe((w1, sf1[..., :-1]), l2)
    with pytest.raises(ValueError, match='multiple of 128'):
        transform_weights_for_mega_moe((w1[..., :-16], sf1[..., :-1]), l2)


def test_fp4_delta_block_size_matches_the_kernel():
    # The transform writes the blocks the kernel's bulk copies read: one size, defined by the kernel header
    from deep_gemm import _C
    from deep_gemm.mega.transform import FP4_DELTA_BLOCK_BYTES
    assert FP4_DELTA_BLOCK_BYTES == _C.kMegaMoEDeltaBlockBytes == 512
