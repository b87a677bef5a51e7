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

def kernel_byte(j):
    # Where byte j (0..63) of a row's K-block sits in the kernel layout's 64 bytes of the row, written
    # out here from the definition (16 ks + 8 hi + 2 q + b -> 16 q + 4 ks + 2 hi + b) rather than
    # taken from transform.py
    ks, hi, q, b = j // 16, (j // 8) % 2, (j // 2) % 4, j % 2
    return 16 * q + 4 * ks + 2 * hi + b


def sign_source_bit(bit):
    # Which bit of a word in fragment order (nibble n < 4: element n of K [0, 4), else element n - 4
    # of K [16, 20); sign in bit 3 of each nibble) the kernel word's bit `bit` holds, written out here
    # from the definition: magnitude bits stay, the sign of element j of K [0, 4) (bit 4 j + 3) moves
    # to 8 j + 7, that of K [16, 20) (bit 16 + 4 j + 3) to 8 j + 3
    if bit % 4 != 3:
        return bit
    j = bit // 8
    return 4 * j + 3 if bit % 8 == 7 else 16 + 4 * j + 3


def unplace_signs_bytes(t):
    # uint8 [..., 4 m] kernel words (little-endian) -> the same words in fragment order, bit by bit
    bits = (t.reshape(*t.shape[:-1], -1, 4, 1) >> torch.arange(8, dtype=torch.uint8)) & 1   # [..., words, 4 bytes, 8 bits]
    bits = bits.reshape(*t.shape[:-1], -1, 32)
    inverse = [0] * 32
    for bit in range(32):
        inverse[sign_source_bit(bit)] = bit
    bits = bits[..., inverse].reshape(*t.shape[:-1], -1, 4, 8)
    return (bits << torch.arange(8, dtype=torch.uint8)).sum(-1, dtype=torch.uint8).reshape(t.shape)


def unblock_packed(t):
    # Kernel-format packed codes [E, N/128, K/128, 8192] -> row-major [E, N, K/2]
    e, nb, kb, _ = t.shape
    rows = unplace_signs_bytes(t.reshape(e, nb, kb, 128, 64))[..., [kernel_byte(j) for j in range(64)]]
    return rows.permute(0, 1, 3, 2, 4).reshape(e, nb * 128, kb * 64)


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
    # Packed codes: byte r * 64 + kernel_byte(j) of block (e, nb, kb) holds the magnitudes of byte
    # kb * 64 + j of row nb * 128 + r (j = 7: ks 0, hi 0, q 3, b 1 -> 49; j = 63 stays; j = 22: ks 1,
    # hi 0, q 3, b 0 -> 52), its sign bits moved within the word (sign_source_bit)
    assert t2[0][1, 2, 1, 5 * 64 + 49] & 0x77 == l2[0][1, 2 * 128 + 5, 64 + 7] & 0x77
    assert t2[0][0, 0, 1, 127 * 64 + 63] & 0x77 == l2[0][0, 127, 64 + 63] & 0x77
    assert t2[0][0, 1, 0, 3 * 64 + 52] & 0x77 == l2[0][0, 128 + 3, 22] & 0x77
    assert_interleaved(l1[0], unblock_packed(t1[0]), 128)
    assert_same(unblock_packed(t2[0]), l2[0])
    r1, r2 = inverse_transform_weights_for_mega_moe(t1, t2)
    assert_same(r1, l1)
    assert_same(r2, l2)


def test_fp4_transforms_leave_their_inputs_alone():
    # The sign placement maps words into a new tensor (one expert at a time); neither direction may
    # write into the caller's tensors (a view of the kernel format is what the inverse reshapes)
    l1, l2 = fp4_pair(seed=3)
    before = [t.clone() for pair in (l1, l2) for t in pair]
    t1, t2 = transform_weights_for_mega_moe(l1, l2)
    assert all(torch.equal(a, b) for a, b in zip(before, [t for pair in (l1, l2) for t in pair]))
    kernel_before = [t.clone() for pair in (t1, t2) for t in pair]
    inverse_transform_weights_for_mega_moe(t1, t2)
    assert all(torch.equal(a, b) for a, b in zip(kernel_before, [t for pair in (t1, t2) for t in pair]))


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


def test_fp4_int8_packed_weights_accepted():
    # packed bytes held as int8 (some checkpoints, DeepGEMM's tests) are the same bits
    l1, l2 = fp4_pair(seed=38)
    t_ref = transform_weights_for_mega_moe(l1, l2)
    as_int8 = lambda p: (p[0].view(torch.int8), p[1])
    assert_same(transform_weights_for_mega_moe(as_int8(l1), as_int8(l2)), t_ref)


def test_activation_keyword():
    # DeepGEMM's signature takes activation=; SwiGLU is the only one (the gate/up layout is its)
    l1, l2 = fp4_pair(seed=39)
    assert_same(transform_weights_for_mega_moe(l1, l2, activation='swiglu'), transform_weights_for_mega_moe(l1, l2))
    with pytest.raises(ValueError, match="activation = 'gelu' is not supported"):
        transform_weights_for_mega_moe(l1, l2, activation='gelu')


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


# --------------------------------------------------------------------------------------------------
# The permuted packed layout against the kernel's loads (a CPU model of the device code's indexing)
# --------------------------------------------------------------------------------------------------

def test_fp4_packed_byte_permutation_matches_the_kernel_header():
    from deep_gemm import _C
    from deep_gemm.mega import fp4_packed_byte_position
    positions = [fp4_packed_byte_position(j) for j in range(64)]
    assert sorted(positions) == list(range(64))
    assert positions == [kernel_byte(j) for j in range(64)] == list(_C.kMegaMoEFP4PackedByte)
    with pytest.raises(ValueError, match='k_byte'):
        fp4_packed_byte_position(64)


def test_fp4_sign_bits_match_the_kernel_header():
    from deep_gemm import _C
    from deep_gemm.mega import fp4_sign_bit_position
    positions = [[fp4_sign_bit_position(hi, j) for j in range(4)] for hi in range(2)]
    assert [list(row) for row in _C.kMegaMoEFP4SignBit] == positions
    # the definition written out (sign_source_bit): the sign of element j of half hi, bit 16 hi + 4 j + 3
    assert all(sign_source_bit(positions[hi][j]) == 16 * hi + 4 * j + 3 for hi in range(2) for j in range(4))
    # one bit each: with the 24 magnitude bits they fill the word
    assert len({p for row in positions for p in row} | {b for b in range(32) if b % 4 != 3}) == 32
    with pytest.raises(ValueError, match='hi'):
        fp4_sign_bit_position(2, 0)


def test_fp4_permutation_puts_fragment_codes_in_one_chunk():
    # SM90 wgmma m64nNk32 E4M3, A from registers: for K step ks, register i of the thread with
    # q = lane % 4 holds K elements 32 ks + 4 q + 16 (i // 2) + [0, 4), lowest K in the lowest byte
    # (rows lane / 4 + 8 (i % 2) of the warp's 16: the same K for both rows)
    from deep_gemm.mega.transform import _packed_to_kernel_blocks
    # One row of 2 K-blocks whose packed byte j holds j: a kernel byte then names its source byte
    w = torch.arange(128, dtype=torch.uint8).reshape(1, 1, 128).repeat(1, 128, 1)
    # (the signs moved within each word put back first: this is about where the bytes go)
    kernel = unplace_signs_bytes(_packed_to_kernel_blocks(w))[0, 0]              # [K-blocks, 8192]
    for kb in range(2):
        row = kernel[kb, 5 * 64:6 * 64].tolist()              # row 5 of the block
        for q in range(4):
            chunk = row[16 * q:16 * q + 16]
            for ks in range(4):
                word = chunk[4 * ks:4 * ks + 4]               # 32-bit word ks of the chunk, bytes low to high
                for i in range(4):
                    # the register's 4 elements come from 2 bytes, the low nibble first: element
                    # 2 j' + n of the checkpoint row is nibble n of source byte j'
                    k0 = 32 * ks + 4 * q + 16 * (i // 2)
                    half = word[2 * (i // 2):2 * (i // 2) + 2]   # low 16 bits for i < 2, high for i >= 2
                    assert [x - kb * 64 for x in half] == [k0 // 2, k0 // 2 + 1]
                # all 8 codes of the word lie in 32-wide group ks (one delta)
                assert {(2 * (x - kb * 64)) // 32 for x in word} == {ks}


def _prmt(a, b, sel):
    # PTX prmt.b32 default mode: result byte i = byte (nibble i & 7) of {b, a}; nibble bit 3 replicates
    # that byte's sign bit into all 8 bits
    src = [(a >> (8 * i)) & 0xFF for i in range(4)] + [(b >> (8 * i)) & 0xFF for i in range(4)]
    out = 0
    for i in range(4):
        n = (sel >> (4 * i)) & 0xF
        v = src[n & 7]
        if n & 8:
            v = 0xFF if v & 0x80 else 0
        out |= v << (8 * i)
    return out


def _expand_e2m1x8(codes, mag_x, mag_y):
    # The kernel's expand_e2m1x8: 8 codes (signs placed by the transform) -> E4M3 bytes of K [0, 4)
    # and [16, 20) of a fragment pair
    sel = codes & 0x77777777
    return (_prmt(mag_x, mag_y, sel) | (codes & 0x80808080),
            _prmt(mag_x, mag_y, sel >> 16) | ((codes << 4) & 0x80808080))


def _kernel_layout_case(seed):
    # One 256-row x 128-K L1 stage (the first gate and up blocks of expert 0, K-block 0) in the kernel
    # layout, the table rows the kernel's prmt reads (codes 0..7 of each delta, 8 bytes), and the
    # stage's E4M3 bytes by the transform's dequant rule (fp4_expansion_table[delta, code])
    from deep_gemm.mega.transform import _deltas_from_kernel_blocks, _packed_from_kernel_blocks, _unpack_e2m1_codes
    (w1, sf1), l2 = fp4_pair(seed=seed, sf_low=105, sf_high=131)   # deltas up to the clamp (15)
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')                            # lossy groups: expected here
        t1, _ = transform_weights_for_mega_moe((w1, sf1), l2)
    w, delta = t1[0][:1, :2, :1], t1[1][:1, :2, :1]
    packed, deltas = w.flatten().tolist(), delta.flatten().tolist()  # [256 rows][64 bytes], [256 rows][4 groups]
    table = fp4_expansion_table()
    codes = _unpack_e2m1_codes(_packed_from_kernel_blocks(w))[0]                                 # [256, 128]
    d = _deltas_from_kernel_blocks(delta)[0].to(torch.int64).repeat_interleave(32, dim=-1)
    assert int(d.max()) == 15     # the clamped row of the table is covered
    mag = [(int.from_bytes(bytes(table[r, :4].tolist()), 'little'), int.from_bytes(bytes(table[r, 4:8].tolist()), 'little'))
           for r in range(16)]
    return packed, deltas, mag, table[d, codes]


def _word(data, offset):
    return int.from_bytes(bytes(data[offset:offset + 4]), 'little')


def test_fp4_wide_expansion_model_writes_the_swizzled_tile():
    # expand_fp4_tile<256>: warp w of the 8 math warps, group u, lane l (t = 32 w + l) loads 16 bytes at
    # 16 t + u * 4096 and its row's deltas at (t & ~3) + u * 256, expands word ks into (ks, hi = 0 / 1),
    # and stores with two stmatrix.x4 at out and out ^ 64 (+ u * 8192); stmatrix: lane 8 m + j gives
    # the address of row j of matrix m, whose 16 bytes are register m of lanes 4 j .. 4 j + 3
    packed, deltas, mag, expected = _kernel_layout_case(seed=61)
    tile = bytearray(256 * 128)
    for w in range(8):
        for u in range(4):
            regs, addrs = [], []
            for lane in range(32):
                t = 32 * w + lane
                offset, d4 = 16 * t + u * 4096, _word(deltas, (t & ~3) + u * 256)
                e = [_expand_e2m1x8(_word(packed, offset + 4 * ks), *mag[(d4 >> (8 * ks)) & 15]) for ks in range(4)]
                regs.append(([e[0][0], e[0][1], e[1][0], e[1][1]], [e[2][0], e[2][1], e[3][0], e[3][1]]))
                out = t // 32 * 1024 + t % 8 * 128 + (((t // 8 % 4) ^ (t % 8)) << 4) + u * 8192
                addrs.append((out, (out ^ 64)))
            for x in range(2):
                for m in range(4):
                    for j in range(8):
                        a = addrs[8 * m + j][x]
                        for word in range(4):
                            tile[a + 4 * word:a + 4 * word + 4] = regs[4 * j + word][x][m].to_bytes(4, 'little')
    # 128B swizzle (TMA's, what the wgmma descriptor reads): chunk c of row r at r // 8 * 1024 + r % 8 * 128 + (c ^ r % 8) * 16
    got = torch.empty(256, 128, dtype=torch.uint8)
    for r in range(256):
        for c in range(8):
            a = r // 8 * 1024 + r % 8 * 128 + ((c ^ (r % 8)) * 16)
            got[r, 16 * c:16 * c + 16] = torch.tensor(list(tile[a:a + 16]), dtype=torch.uint8)
    assert torch.equal(got, expected)


def test_fp4_narrow_fragment_model_matches_the_wgmma_layout():
    # narrow_fp4_fragments: thread (wg, warp, lane) of row block rb loads 16 bytes at row * 64 + 16 (lane % 4)
    # for rows rb * 128 + 64 wg + 16 warp + lane / 4 (+ 8), 4 deltas at row * 4; frag[ks][h] / frag[ks][2 + h]
    # must be the E4M3 bytes of that row at K 32 ks + 4 (lane % 4) + [0, 4) / + 16 (the wgmma A layout)
    packed, deltas, mag, expected = _kernel_layout_case(seed=67)
    for rb in range(2):
        for wg in range(2):
            for warp in range(4):
                for lane in range(32):
                    q = lane % 4
                    for h in range(2):
                        row = rb * 128 + wg * 64 + warp * 16 + lane // 4 + 8 * h
                        d4 = _word(deltas, row * 4)
                        for ks in range(4):
                            lo, hi = _expand_e2m1x8(_word(packed, row * 64 + 16 * q + 4 * ks), *mag[(d4 >> (8 * ks)) & 15])
                            k0 = 32 * ks + 4 * q
                            assert list(lo.to_bytes(4, 'little')) == expected[row, k0:k0 + 4].tolist()
                            assert list(hi.to_bytes(4, 'little')) == expected[row, k0 + 16:k0 + 20].tolist()
