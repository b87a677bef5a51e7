"""Weight transforms of the Mega MoE kernel, run once at model load (DESIGN.md §2).

Checkpoint format -> kernel format, detected from dtypes (E = local experts, I = intermediate_hidden,
H = hidden; l1 rows are [gate | up], both weights K-major):

=============  ========================================================  =====================================
format         checkpoint (input)                                        kernel (output)
=============  ========================================================  =====================================
bf16xbf16      l1 bfloat16 [E, 2I, H]; l2 bfloat16 [E, H, I]             l1 gate/up interleaved; l2 as is
fp8xfp8        l1 (w e4m3 [E, 2I, H], sf f32 [E, 2I/128, H/128])          w and sf rows interleaved; l2 as is
               l2 (w e4m3 [E, H, I], sf f32 [E, H/128, I/128])
fp8xfp4        l1 (w uint8 [E, 2I, H/2] packed E2M1, sf uint8             l1 (w uint8 [E, 2I/128, H/128, 8192],
               [E, 2I, H/32] UE8M0); l2 (w [E, H, I/2], sf [E, H, I/32])  delta uint8 [E, 2I/128, H/128, 512],
                                                                         block_scale f32 [E, 2I/128, H/128]),
                                                                         interleaved; l2 the same 3-tuple
                                                                         ([E, H/128, I/128, ...]), not
                                                                         interleaved
=============  ========================================================  =====================================

Gate/up interleave: l1 rows become [gate 0:128, up 0:128, gate 128:256, up 128:256, ...], so the
kernel's 256-row L1 N-block holds 128 gate rows and the matching 128 up rows and one thread's
accumulators hold both halves of SwiGLU.

MXFP4 rebasing: WGMMA has no FP4 input on SM90, so the kernel expands E2M1 to E4M3 (in shared memory,
or in registers on decode tiles) with a byte lookup. For every 128 x 128 block (128 rows x 4 groups of
32 along K per row) the base exponent b is the largest UE8M0 exponent s of the block; each group stores
delta = b - s (clamped to 15) and the block stores block_scale = 2^(b - 127 - 6), applied in FP32 at
promotion. Nibble c of a group with delta d expands to RNE_e4m3(e2m1(c) * 2^(6 - d)): exact for d <=
14, because E2M1 values have one mantissa bit and E4M3 subnormals reach 2^-9 (0.5 * 2^(6-14) = 2^-9),
and 6 * 2^6 = 384 <= 448 never overflows. Groups with d > 14 lose their smallest values (or all of
them); the transform warns with the count and the error, see `mxfp4_transform_error`.

Packed layout (kernel format): uint8 [E, N/128, K/128, 8192], one contiguous 8 KB block per 128 x 128
weight block, so the kernel streams a K-block of 128 rows as one contiguous copy instead of 128 rows
of 64 bytes K/2 bytes apart. Row r of the block owns bytes r * 64 .. r * 64 + 63, which hold its 64
packed bytes of the K-block permuted: byte j = 16 ks + 8 hi + 2 q + b of the K-block (elements 2j,
2j + 1 in the low, high nibble; ks, q in 0..3, hi, b in 0..1) is stored at 16 q + 4 ks + 2 hi + b
(`fp4_packed_byte_position`). Nibble order within a byte is unchanged. So the magnitudes (bits 0-2
of each nibble) of w[e, nb, kb, r * 64 + 16 q + 4 ks + 2 hi + b] are those of byte
kb * 64 + 16 ks + 8 hi + 2 q + b of row nb * 128 + r of the checkpoint-order [E, N, K/2] (after the
l1 interleave). The sign bits (bit 3 of each nibble) are then moved within each little-endian 32-bit
word (4 bytes 16 q + 4 ks + [0, 4): nibbles 0-3 are elements K 32 ks + 4 q + [0, 4), nibbles 4-7
the same + 16, see below): the sign of element j of the low half goes to bit 8 j + 7 (the sign bit
of the E4M3 byte it becomes), that of element j of the high half to bit 8 j + 3
(`fp4_sign_bit_position`), so the kernel expands a word with 7 instructions.

Why: on SM90 the 32-wide K step ks of a wgmma A fragment (E4M3, A in registers) gives the thread with
lane % 4 = q the elements 32 ks + 4 q + [0, 4) and 32 ks + 16 + 4 q + [0, 4) of its rows. After the
permutation the 16-byte chunk q of a row (bytes 16 q .. 16 q + 15) holds exactly those codes for all 4
K steps, one 32-bit word per K step (low 16 bits: 32 ks + 4 q + [0, 4), high 16 bits: the same + 16),
and word ks lies in 32-wide group ks, i.e. one delta. A thread loads its fragment codes of a row with
one 16-byte load, and a warp's 32 lanes (8 rows x 4 chunks) read 512 contiguous bytes. The same words
are the stmatrix fragments the kernel uses to write the shared-memory E4M3 tile of its wide tiles.

Delta layout (kernel format): uint8 [E, N/128, K/128, 512], one contiguous 512-byte block per
128 x 128 weight block, so the kernel fetches one K-block's deltas of a 128-row weight block with a
single bulk copy. Within a block, byte r * 4 + g is the delta of row r (0..127) and 32-wide group g
(0..3) of the 128-wide K-block: delta[e, nb, kb, r * 4 + g] is the delta of row nb * 128 + r and
group kb * 4 + g of the row-major [E, N, K/32] deltas. For l1 the rows are gate/up interleaved
first, then blocked (N = 2I, K = H; l2: N = H, K = I).
"""
from __future__ import annotations

import functools
import warnings
from typing import Dict, Tuple, Union

import torch

from ..utils.quant import E2M1_VALUES

# Rows of one gate (or up) block in the interleaved L1 layout: half of the kernel's L1 BLOCK_N
GATE_UP_INTERLEAVE = 128
# Rows and K elements of one weight block sharing an FP32 scale (fp8xfp8 sf, fp8xfp4 block_scale)
WEIGHT_BLOCK = 128
# K elements sharing one UE8M0 exponent in MXFP4
MXFP4_GROUP = 32
# E4M3 values of a group are e2m1 * 2^(6 - delta): the largest exponent shift that cannot overflow
# E4M3 (6 * 2^6 = 384 <= 448)
FP4_EXPANSION_SHIFT = 6
# Largest delta for which the expansion is exact (E4M3 subnormals reach 2^-9 = 0.5 * 2^(6 - 14))
FP4_MAX_EXACT_DELTA = 14
# Deltas are stored in 4 bits' worth of table rows; larger ones are clamped to this
FP4_MAX_DELTA = 15
# Bytes of one 128 x 128 weight block's deltas in the kernel layout: 128 rows x 4 groups of 32
FP4_DELTA_BLOCK_BYTES = WEIGHT_BLOCK * (WEIGHT_BLOCK // MXFP4_GROUP)
# Bytes of one 128 x 128 weight block's packed E2M1 codes in the kernel layout: 128 rows x 64 bytes
FP4_PACKED_BLOCK_BYTES = WEIGHT_BLOCK * WEIGHT_BLOCK // 2
# Packed bytes of one row of a 128-wide K-block, and the chunk of them that holds one thread's wgmma
# A fragment codes of the row for the K-block's 4 K steps (module docstring)
FP4_PACKED_ROW_BYTES = WEIGHT_BLOCK // 2
FP4_FRAGMENT_CHUNK_BYTES = 16
_UE8M0_NAN = 255

WeightsBF16 = torch.Tensor
WeightsFP8 = Tuple[torch.Tensor, torch.Tensor]
WeightsFP4 = Tuple[torch.Tensor, torch.Tensor, torch.Tensor]
Weights = Union[WeightsBF16, WeightsFP8, WeightsFP4]

# Where the kernel's (weights, FP32 block scales, FP4 exponent deltas) of one layer's weights sit in
# the format's tuple (None: the format has none): bf16 (w,), fp8 (w, scales), fp4 (w, delta, block_scale)
_KERNEL_WEIGHT_ORDER = {'bf16xbf16': (0, None, None), 'fp8xfp8': (0, 1, None), 'fp8xfp4': (0, 2, 1)}


def kernel_weight_addresses(mma_type: str, l1, l2) -> Tuple[int, ...]:
    """The six addresses the kernel takes of transformed weights (`transform_weights_for_mega_moe`): l1's
    weights, block scales and FP4 deltas, then l2's; 0 where the format has none. A bf16 layer's weights
    may be the tensor itself or a 1-tuple of it."""
    order = _KERNEL_WEIGHT_ORDER[mma_type]
    return tuple(0 if k is None else (w if isinstance(w, torch.Tensor) else w[k]).data_ptr()
                 for w in (l1, l2) for k in order)


# --------------------------------------------------------------------------------------------------
# E2M1 -> E4M3 expansion table
# --------------------------------------------------------------------------------------------------

def _e4m3_positive_values() -> Tuple[float, ...]:
    """Values of the E4M3 (float8_e4m3fn) codes 0x00..0x7E (0x7F is NaN): bias 7, 3 mantissa bits."""
    values = []
    for code in range(0x7F):
        exponent, mantissa = code >> 3, code & 7
        values.append(mantissa * 2.0 ** -9 if exponent == 0 else (1 + mantissa / 8) * 2.0 ** (exponent - 7))
    return tuple(values)


def _round_to_e4m3_code(value: float) -> int:
    """E4M3 code of round-to-nearest-even(|value|) for 0 <= |value| <= 448, by exhaustive search.

    Written from the format's definition (not from a float cast) so that the test comparing it with
    torch's float8_e4m3fn rounding checks two independent implementations.
    """
    magnitude = abs(value)
    best_code, best_error = 0, float('inf')
    for code, v in enumerate(_e4m3_positive_values()):
        error = abs(v - magnitude)
        # On a tie keep the code with the even mantissa (round half to even)
        if error < best_error or (error == best_error and code % 2 == 0):
            best_code, best_error = code, error
    return best_code


@functools.lru_cache(maxsize=None)
def _fp4_expansion_rows() -> Tuple[Tuple[int, ...], ...]:
    rows = []
    for delta in range(FP4_MAX_DELTA + 1):
        row = []
        for code in range(16):
            # E2M1 code: bit 3 sign, bits 2..0 magnitude index (exponent 2 bits, mantissa 1 bit)
            sign = 0x80 if code & 8 else 0
            row.append(sign | _round_to_e4m3_code(E2M1_VALUES[code & 7] * 2.0 ** (FP4_EXPANSION_SHIFT - delta)))
        rows.append(tuple(row))
    return tuple(rows)


def fp4_expansion_table(device: Union[str, torch.device, None] = None) -> torch.Tensor:
    """The kernel's E2M1 -> E4M3 expansion table: uint8 [16, 16], [delta, code] -> E4M3 bits.

    Entry [d, c] is the float8_e4m3fn encoding of round-to-nearest-even(e2m1(c) * 2^(6 - d)), where
    c is a 4-bit E2M1 code (bit 3 = sign, so code 8 is -0 -> 0x80) and d the group's delta. Rows
    0..14 are exact; row 15 (clamped deltas) rounds 0.5 * 2^-9 to 0 and 1.5 * 2^-9 to 2^-8.
    """
    return torch.tensor(_fp4_expansion_rows(), dtype=torch.uint8, device=device)


# --------------------------------------------------------------------------------------------------
# Layout helpers
# --------------------------------------------------------------------------------------------------

def _interleave_gate_up(t: torch.Tensor, rows_per_block: int) -> torch.Tensor:
    """[E, 2I, ...] rows [gate | up] -> [gate 0, up 0, gate 1, up 1, ...] in blocks of `rows_per_block`."""
    e, n = t.shape[0], t.shape[1]
    num_blocks = n // 2 // rows_per_block
    return (t.reshape(e, 2, num_blocks, rows_per_block, *t.shape[2:]).transpose(1, 2)
            .reshape(t.shape).contiguous())


def _deinterleave_gate_up(t: torch.Tensor, rows_per_block: int) -> torch.Tensor:
    """Inverse of `_interleave_gate_up`."""
    e, n = t.shape[0], t.shape[1]
    num_blocks = n // 2 // rows_per_block
    return (t.reshape(e, num_blocks, 2, rows_per_block, *t.shape[2:]).transpose(1, 2)
            .reshape(t.shape).contiguous())


def _blocks(t: torch.Tensor, cols_per_block: int) -> torch.Tensor:
    """[E, N, C] -> [E, N/128, C/cols_per_block, 128, cols_per_block] (a view of 128-row weight blocks)."""
    e, n, c = t.shape
    return t.reshape(e, n // WEIGHT_BLOCK, WEIGHT_BLOCK, c // cols_per_block, cols_per_block).permute(0, 1, 3, 2, 4)


def _unblocks(t: torch.Tensor) -> torch.Tensor:
    """Inverse of `_blocks`: [E, NB, CB, 128, cb] -> [E, NB * 128, CB * cb]."""
    e, nb, cb, r, c = t.shape
    return t.permute(0, 1, 3, 2, 4).reshape(e, nb * r, cb * c)


def _deltas_to_kernel_blocks(delta: torch.Tensor) -> torch.Tensor:
    """Row-major deltas uint8 [E, N, K/32] -> the kernel layout [E, N/128, K/128, 512].

    out[e, nb, kb, r * 4 + g] = delta[e, nb * 128 + r, kb * 4 + g]: one contiguous 512-byte block per
    128 x 128 weight block (row r, group g of the block).
    """
    e, n, groups = delta.shape
    return (_blocks(delta, WEIGHT_BLOCK // MXFP4_GROUP)
            .reshape(e, n // WEIGHT_BLOCK, groups * MXFP4_GROUP // WEIGHT_BLOCK, FP4_DELTA_BLOCK_BYTES).contiguous())


def _deltas_from_kernel_blocks(delta: torch.Tensor) -> torch.Tensor:
    """Inverse of `_deltas_to_kernel_blocks`: [E, N/128, K/128, 512] -> row-major [E, N, K/32]."""
    e, nb, kb, _ = delta.shape
    return _unblocks(delta.reshape(e, nb, kb, WEIGHT_BLOCK, WEIGHT_BLOCK // MXFP4_GROUP)).contiguous()


def fp4_packed_byte_position(k_byte: int) -> int:
    """Where byte `k_byte` (0..63) of a row's packed K-block lands in the kernel layout's 64 bytes of
    that row: 16 ks + 8 hi + 2 q + b -> 16 q + 4 ks + 2 hi + b (module docstring). The kernel header's
    `mega_moe_fp4_packed_byte` is the same map (`deep_gemm._C.kMegaMoEFP4PackedByte`, tested)."""
    if not 0 <= k_byte < FP4_PACKED_ROW_BYTES:
        raise ValueError(f'k_byte must be in [0, {FP4_PACKED_ROW_BYTES}), got {k_byte}')
    ks, hi, q, b = k_byte // 16, k_byte // 8 % 2, k_byte // 2 % 4, k_byte % 2
    return FP4_FRAGMENT_CHUNK_BYTES * q + 4 * ks + 2 * hi + b


def _permute_packed_rows(blocks: torch.Tensor) -> torch.Tensor:
    """[..., 64] bytes of rows in K order -> the kernel's permuted order: [ks, hi, q, b] -> [q, ks, hi, b]."""
    return blocks.reshape(*blocks.shape[:-1], 4, 2, 4, 2).movedim(-2, -4).reshape(blocks.shape)


def _unpermute_packed_rows(blocks: torch.Tensor) -> torch.Tensor:
    """Inverse of `_permute_packed_rows`: [q, ks, hi, b] -> [ks, hi, q, b]."""
    return blocks.reshape(*blocks.shape[:-1], 4, 4, 2, 2).movedim(-4, -2).reshape(blocks.shape)


def fp4_sign_bit_position(hi: int, j: int) -> int:
    """Bit of a kernel-layout 32-bit code word that holds the sign of element j (0..3) of the word's
    K [0, 4) (hi = 0) or K [16, 20) (hi = 1) elements: 8 j + 7 or 8 j + 3 (module docstring). The
    kernel header's `mega_moe_fp4_sign_bit` is the same map (`deep_gemm._C.kMegaMoEFP4SignBit`, tested)."""
    if hi not in (0, 1) or not 0 <= j < 4:
        raise ValueError(f'expected hi in (0, 1) and j in [0, 4), got hi={hi}, j={j}')
    return 8 * j + (3 if hi else 7)


def _move_signs(words: torch.Tensor, to_kernel: bool) -> torch.Tensor:
    """int32 words of 8 codes in fragment order (nibble j < 4: element j of K [0, 4), nibble 4 + j:
    element j of K [16, 20); sign in bit 3) <-> the kernel's word: the same magnitudes (bits 0-2 of
    each nibble), the sign of element j of K [0, 4) at bit 8 j + 7 and that of K [16, 20) at bit
    8 j + 3 (module docstring). `to_kernel` picks the direction; each undoes the other."""
    out = words & 0x77777777
    for hi in range(2):
        for j in range(4):
            fragment_bit, kernel_bit = 16 * hi + 4 * j + 3, fp4_sign_bit_position(hi, j)
            src, dst = (fragment_bit, kernel_bit) if to_kernel else (kernel_bit, fragment_bit)
            out |= ((words >> src) & 1) << dst
    return out


def _map_words(blocks: torch.Tensor, fn) -> torch.Tensor:
    """Apply `fn` to the little-endian 32-bit words of uint8 `blocks` (last dim a multiple of 4), one
    leading index (expert) at a time: its temporaries stay one expert's size, not the layer's."""
    words = blocks.contiguous().view(torch.int32)
    out = torch.empty_like(words)
    for i in range(words.shape[0]):
        out[i] = fn(words[i])
    return out.view(torch.uint8)


def _packed_to_kernel_blocks(w: torch.Tensor) -> torch.Tensor:
    """Row-major packed E2M1 [E, N, K/2] -> the kernel's [E, N/128, K/128, 8192] (module docstring):
    blocked, each row's 64 bytes of a K-block permuted, the signs of each word placed."""
    e, n, half_k = w.shape
    blocks = _map_words(_permute_packed_rows(_blocks(w, FP4_PACKED_ROW_BYTES)), lambda x: _move_signs(x, to_kernel=True))   # [E, NB, KB, 128, 64]
    return blocks.reshape(e, n // WEIGHT_BLOCK, half_k * 2 // WEIGHT_BLOCK, FP4_PACKED_BLOCK_BYTES).contiguous()


def _packed_from_kernel_blocks(w: torch.Tensor) -> torch.Tensor:
    """Inverse of `_packed_to_kernel_blocks`: [E, N/128, K/128, 8192] -> [E, N, K/2]."""
    e, nb, kb, _ = w.shape
    rows = _map_words(w.reshape(e, nb, kb, WEIGHT_BLOCK, FP4_PACKED_ROW_BYTES), lambda x: _move_signs(x, to_kernel=False))
    return _unblocks(_unpermute_packed_rows(rows)).contiguous()


def _unpack_e2m1_codes(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., k/2] -> int64 codes [..., k]; element 2j is the low nibble of byte j."""
    codes = torch.stack((packed & 0xF, packed >> 4), dim=-1)
    return codes.reshape(*packed.shape[:-1], packed.shape[-1] * 2).to(torch.int64)


def _pow2_float32(exponent: torch.Tensor) -> torch.Tensor:
    """Exact 2^exponent in float32 for integer exponents in [-149, 127], subnormals included, built from bits."""
    exponent = exponent.to(torch.int32)
    normal = (exponent + 127).clamp(min=1) << 23
    subnormal = torch.ones_like(exponent) << (exponent + 149).clamp(min=0, max=22)
    return torch.where(exponent >= -126, normal, subnormal).view(torch.float32)


def _pow2_float64(exponent: torch.Tensor) -> torch.Tensor:
    """Exact 2^exponent in float64 for integer exponents in [-1022, 1023], built from bits."""
    return ((exponent.to(torch.int64) + 1023) << 52).view(torch.float64)


# --------------------------------------------------------------------------------------------------
# Argument checks
# --------------------------------------------------------------------------------------------------

def _check_3d(t: object, name: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f'{name} must be a torch.Tensor, got {type(t).__name__}')
    if t.dim() != 3:
        raise ValueError(f'{name} must be 3-D [num_local_experts, N, K], got shape {tuple(t.shape)}')
    return t


def _check_multiple(value: int, multiple: int, what: str) -> None:
    if value % multiple != 0:
        raise ValueError(f'{what} = {value} must be a multiple of {multiple}')


def _check_shape(t: torch.Tensor, expected: Tuple[int, ...], name: str, layout: str = '') -> None:
    if tuple(t.shape) != tuple(expected):
        hint = f' ({layout})' if layout else ''
        raise ValueError(f'{name} must have shape {tuple(expected)}{hint}, got {tuple(t.shape)}')


def _as_uint8(t: torch.Tensor, name: str, allowed: Tuple[torch.dtype, ...]) -> torch.Tensor:
    if t.dtype not in allowed:
        raise TypeError(f'{name} must be one of {[str(d) for d in allowed]}, got {t.dtype}')
    return t if t.dtype == torch.uint8 else t.view(torch.uint8)


# int8: packed bytes as some checkpoints and DeepGEMM's own tests hold them (read as uint8, bit for bit)
_FP4_DTYPES = (torch.uint8, torch.int8) + ((torch.float4_e2m1fn_x2,) if hasattr(torch, 'float4_e2m1fn_x2') else ())
_UE8M0_DTYPES = (torch.uint8,) + ((torch.float8_e8m0fnu,) if hasattr(torch, 'float8_e8m0fnu') else ())


def _check_mxfp4(w: object, sf: object, name: str) -> Tuple[torch.Tensor, torch.Tensor]:
    """Checkpoint MXFP4 weights: w [E, N, K/2] packed E2M1, sf [E, N, K/32] UE8M0 -> uint8 views."""
    w = _as_uint8(_check_3d(w, f'{name} weights'), f'{name} weights', _FP4_DTYPES)
    sf = _as_uint8(_check_3d(sf, f'{name} scales'), f'{name} scales', _UE8M0_DTYPES)
    e, n, half_k = w.shape
    k = half_k * 2
    _check_multiple(n, WEIGHT_BLOCK, f'{name} rows (N)')
    _check_multiple(k, WEIGHT_BLOCK, f'{name} K (2 * last dim of the packed weights)')
    _check_shape(sf, (e, n, k // MXFP4_GROUP), f'{name} scales')
    if w.device != sf.device:
        raise ValueError(f'{name} weights ({w.device}) and scales ({sf.device}) must be on the same device')
    if sf.numel() > 0 and bool((sf == _UE8M0_NAN).any()):
        raise ValueError(f'{name} scales contain 255, the UE8M0 NaN encoding')
    return w.contiguous(), sf.contiguous()


def _check_fp8(w: object, sf: object, name: str) -> Tuple[torch.Tensor, torch.Tensor]:
    """Checkpoint FP8 weights: w e4m3 [E, N, K], sf float32 [E, N/128, K/128]."""
    w, sf = _check_3d(w, f'{name} weights'), _check_3d(sf, f'{name} scales')
    if w.dtype != torch.float8_e4m3fn:
        raise TypeError(f'{name} weights must be torch.float8_e4m3fn, got {w.dtype}')
    if sf.dtype != torch.float32:
        raise TypeError(f'{name} scales must be torch.float32, got {sf.dtype}')
    e, n, k = w.shape
    _check_multiple(n, WEIGHT_BLOCK, f'{name} rows (N)')
    _check_multiple(k, WEIGHT_BLOCK, f'{name} K')
    _check_shape(sf, (e, n // WEIGHT_BLOCK, k // WEIGHT_BLOCK), f'{name} scales')
    if w.device != sf.device:
        raise ValueError(f'{name} weights ({w.device}) and scales ({sf.device}) must be on the same device')
    return w.contiguous(), sf.contiguous()


def _check_bf16(w: object, name: str) -> torch.Tensor:
    w = _check_3d(w, f'{name} weights')
    if w.dtype != torch.bfloat16:
        raise TypeError(f'{name} weights must be torch.bfloat16, got {w.dtype}')
    _check_multiple(w.shape[1], WEIGHT_BLOCK, f'{name} rows (N)')
    _check_multiple(w.shape[2], WEIGHT_BLOCK, f'{name} K')
    return w.contiguous()


def _check_l1_l2_shapes(l1_nk: Tuple[int, int, int], l2_nk: Tuple[int, int, int]) -> None:
    (e1, n1, k1), (e2, n2, k2) = l1_nk, l2_nk
    if e1 != e2:
        raise ValueError(f'l1 has {e1} experts and l2 has {e2}: expected the same number of local experts')
    if n1 % (2 * GATE_UP_INTERLEAVE) != 0:
        raise ValueError(f'l1 rows = {n1} (2 * intermediate_hidden) must be a multiple of {2 * GATE_UP_INTERLEAVE}')
    if n1 != 2 * k2:
        raise ValueError(f'l1 rows = {n1} must be 2 * l2 K = 2 * {k2} (rows [gate | up] of intermediate_hidden each)')
    if k1 != n2:
        raise ValueError(f'l1 K = {k1} (hidden) must equal l2 rows = {n2} (hidden)')


def _detect_format(l1: object, l2: object) -> str:
    """'bf16xbf16', 'fp8xfp8' or 'fp8xfp4' from the checkpoint weights' dtypes."""
    if isinstance(l1, torch.Tensor) and isinstance(l2, torch.Tensor):
        if l1.dtype == torch.bfloat16 and l2.dtype == torch.bfloat16:
            return 'bf16xbf16'
        raise TypeError(f'tensor weights must both be torch.bfloat16, got l1 {l1.dtype} and l2 {l2.dtype} '
                        '(FP8 and FP4 weights are (weights, scales) tuples)')
    if not (isinstance(l1, (tuple, list)) and isinstance(l2, (tuple, list)) and len(l1) == 2 and len(l2) == 2):
        raise TypeError('l1_weights and l2_weights must both be bfloat16 tensors or both be (weights, scales) '
                        f'pairs, got {type(l1).__name__} and {type(l2).__name__}')
    dtypes = (getattr(l1[0], 'dtype', None), getattr(l2[0], 'dtype', None))
    if all(d == torch.float8_e4m3fn for d in dtypes):
        return 'fp8xfp8'
    if all(d in _FP4_DTYPES for d in dtypes):
        return 'fp8xfp4'
    raise TypeError(f'weights dtypes {dtypes} match no format: expected float8_e4m3fn (fp8xfp8) or packed '
                    'E2M1 uint8 / int8 / float4_e2m1fn_x2 (fp8xfp4) for both l1 and l2')


# --------------------------------------------------------------------------------------------------
# MXFP4 rebasing
# --------------------------------------------------------------------------------------------------

def _rebase_mxfp4(w: torch.Tensor, sf: torch.Tensor) -> WeightsFP4:
    """Checked MXFP4 (w [E, N, K/2], sf [E, N, K/32]) -> (w, delta, block_scale), not interleaved.

    delta comes back row-major [E, N, K/32] (checkpoint row order); `_deltas_to_kernel_blocks` makes
    the kernel layout after any row interleave.
    """
    s = _blocks(sf.to(torch.int16), WEIGHT_BLOCK // MXFP4_GROUP)  # [E, NB, KB, 128, 4]
    base = s.amax(dim=(-2, -1))                                     # [E, NB, KB]
    delta = (base[..., None, None] - s).clamp(max=FP4_MAX_DELTA).to(torch.uint8)
    block_scale = _pow2_float32(base - 127 - FP4_EXPANSION_SHIFT)
    return w, _unblocks(delta).contiguous(), block_scale.contiguous()


def _check_kernel_fp4(w: object, delta: object, block_scale: object, name: str) -> Tuple[int, int, int]:
    """Kernel-format FP4 weights: w uint8 [E, N/128, K/128, 8192], delta uint8 [E, N/128, K/128, 512],
    block_scale float32 [E, N/128, K/128]. Returns (E, N, K)."""
    for t, what in ((w, 'weights'), (delta, 'delta'), (block_scale, 'block_scale')):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f'{name} {what} must be a torch.Tensor, got {type(t).__name__}')
    if w.dtype != torch.uint8 or delta.dtype != torch.uint8 or block_scale.dtype != torch.float32:
        raise TypeError(f'{name}: expected (uint8, uint8, float32), got ({w.dtype}, {delta.dtype}, {block_scale.dtype})')
    if w.dim() != 4 or w.shape[3] != FP4_PACKED_BLOCK_BYTES:
        raise ValueError(f'{name} weights must have shape [E, N/128, K/128, {FP4_PACKED_BLOCK_BYTES}] (one contiguous '
                         f'block of packed E2M1 per 128 x 128 weight block, from transform_weights_for_mega_moe), '
                         f'got {list(w.shape)}')
    e, nb, kb, _ = w.shape
    _check_shape(delta, (e, nb, kb, FP4_DELTA_BLOCK_BYTES), f'{name} delta',
                 f'[E, N/128, K/128, {FP4_DELTA_BLOCK_BYTES}]: one {FP4_DELTA_BLOCK_BYTES}-byte block of '
                 'deltas per 128 x 128 weight block, from transform_weights_for_mega_moe')
    _check_shape(block_scale, (e, nb, kb), f'{name} block_scale')
    return e, nb * WEIGHT_BLOCK, kb * WEIGHT_BLOCK


def dequant_mega_moe_fp4(w: torch.Tensor, delta: torch.Tensor, block_scale: torch.Tensor) -> torch.Tensor:
    """The weights the kernel computes with, from its FP4 format, exactly, in float32.

    Args:
        w: uint8 [E, N/128, K/128, 8192] packed E2M1 blocks (see the module docstring: 64 bytes per
            row, permuted within the row for the kernel's fragment loads).
        delta: uint8 [E, N/128, K/128, 512], 0..15: each group's exponent below its block's base;
            delta[e, nb, kb, r * 4 + g] belongs to row nb * 128 + r, K elements
            [(kb * 4 + g) * 32, (kb * 4 + g + 1) * 32) (see the module docstring).
        block_scale: float32 [E, N/128, K/128], 2^(base - 133).

    Returns:
        float32 [E, N, K]: fp4_expansion_table()[delta, code] as E4M3, times block_scale. Row order is
        that of the input (interleaved for a transformed l1).
    """
    e, n, k = _check_kernel_fp4(w, delta, block_scale, 'dequant_mega_moe_fp4')
    if delta.numel() > 0 and int(delta.max()) > FP4_MAX_DELTA:
        raise ValueError(f'delta must be <= {FP4_MAX_DELTA}, got {int(delta.max())}')
    table = fp4_expansion_table(w.device).flatten()
    codes = _unpack_e2m1_codes(_packed_from_kernel_blocks(w))
    deltas = _deltas_from_kernel_blocks(delta).to(torch.int64).repeat_interleave(MXFP4_GROUP, dim=-1)
    e4m3 = table[deltas * 16 + codes].view(torch.float8_e4m3fn).to(torch.float32)
    scale = block_scale.repeat_interleave(WEIGHT_BLOCK, dim=-2).repeat_interleave(WEIGHT_BLOCK, dim=-1)
    return e4m3 * scale


def mxfp4_transform_error(w: torch.Tensor, sf: torch.Tensor, *, chunk_blocks: int = 256) -> Dict[str, float]:
    """What the kernel's E4M3 expansion loses on checkpoint MXFP4 weights (w [E, N, K/2], sf [E, N, K/32]).

    A group loses precision when its exponent lies more than 14 below the largest of its 128 x 128
    block (its smallest E2M1 values fall under E4M3's subnormal range). Only blocks holding such
    groups are dequantized, in chunks of `chunk_blocks`, so the check is cheap on real checkpoints.

    Returns a dict:
        num_groups:         groups of 32 in the tensor
        num_clamped_groups: groups with delta > 14 (potentially lossy)
        num_lossy_groups:   groups whose kernel-side values differ from the checkpoint's
        num_lossy_blocks:   128 x 128 blocks holding a lossy group
        max_rel_error:      max over blocks of ||W_kernel - W|| / ||W|| (Frobenius, per block); 0.0 if none
    """
    w, sf = _check_mxfp4(w, sf, 'mxfp4_transform_error')
    s = _blocks(sf.to(torch.int16), WEIGHT_BLOCK // MXFP4_GROUP)  # [E, NB, KB, 128, 4]
    true_delta = s.amax(dim=(-2, -1))[..., None, None] - s
    clamped = true_delta > FP4_MAX_EXACT_DELTA
    result = {'num_groups': int(sf.numel()), 'num_clamped_groups': int(clamped.sum()), 'num_lossy_groups': 0,
              'num_lossy_blocks': 0, 'max_rel_error': 0.0}
    if result['num_clamped_groups'] == 0:
        return result

    table = fp4_expansion_table(w.device).flatten()
    e2m1 = torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES), dtype=torch.float64, device=w.device)
    packed_blocks = _blocks(w, WEIGHT_BLOCK // 2)  # [E, NB, KB, 128, 64]
    candidates = clamped.flatten(-2).any(dim=-1).nonzero()
    max_rel_error = 0.0
    for chunk in candidates.split(chunk_blocks):
        index = (chunk[:, 0], chunk[:, 1], chunk[:, 2])
        codes = _unpack_e2m1_codes(packed_blocks[index])                       # [m, 128, 128]
        d = true_delta[index].to(torch.int64).repeat_interleave(MXFP4_GROUP, dim=-1)
        # Both sides divided by the block scale 2^(base - 133): float64 holds them exactly, no overflow
        original = e2m1[codes] * _pow2_float64(FP4_EXPANSION_SHIFT - d)
        kernel = table[d.clamp(max=FP4_MAX_DELTA) * 16 + codes].view(torch.float8_e4m3fn).to(torch.float64)
        diff = kernel - original
        lossy_groups = (diff != 0).reshape(*diff.shape[:-1], -1, MXFP4_GROUP).any(dim=-1)
        result['num_lossy_groups'] += int(lossy_groups.sum())
        result['num_lossy_blocks'] += int(lossy_groups.flatten(1).any(dim=-1).sum())
        diff_norm = diff.square().sum(dim=(-2, -1)).sqrt()
        original_norm = original.square().sum(dim=(-2, -1)).sqrt()
        # An all-zero block expands to zeros (diff 0): relative error 0, not 0 / 0
        rel = torch.where(original_norm > 0, diff_norm / original_norm.clamp(min=torch.finfo(torch.float64).tiny),
                          torch.zeros_like(diff_norm))
        if rel.numel() > 0:
            max_rel_error = max(max_rel_error, float(rel.max()))
    result['max_rel_error'] = max_rel_error
    return result


def _transform_mxfp4(w: torch.Tensor, sf: torch.Tensor, name: str) -> WeightsFP4:
    report = mxfp4_transform_error(w, sf)
    if report['num_lossy_groups'] > 0:
        warnings.warn(
            f'transform_weights_for_mega_moe: {name}: {report["num_lossy_groups"]} of {report["num_groups"]} MXFP4 '
            f'groups lie more than {FP4_MAX_EXACT_DELTA} exponents below the largest scale of their 128x128 block '
            f'and lose precision in the kernel\'s E4M3 expansion ({report["num_lossy_blocks"]} blocks affected, '
            f'max relative error of an affected block ||W_kernel - W|| / ||W|| = {report["max_rel_error"]:.3e}); '
            'see deep_gemm.mega.mxfp4_transform_error', stacklevel=3)
    return _rebase_mxfp4(w, sf)


# --------------------------------------------------------------------------------------------------
# Public transforms
# --------------------------------------------------------------------------------------------------

def transform_weights_for_mega_moe(l1_weights: Weights, l2_weights: Weights, activation: str = 'swiglu') -> Tuple[Weights, Weights]:
    """Checkpoint weights -> the kernel's weight format (run once at model load).

    `activation`: "swiglu", the only one (accepted for DeepGEMM's signature; l1's gate/up layout is SwiGLU's).

    The format is detected from the dtypes (see the module docstring for the table):
        bf16xbf16: l1 bfloat16 [E, 2I, H], l2 bfloat16 [E, H, I]
        fp8xfp8:   l1 (e4m3 [E, 2I, H], float32 [E, 2I/128, H/128]), l2 (e4m3 [E, H, I], float32 [E, H/128, I/128])
        fp8xfp4:   l1 (uint8 [E, 2I, H/2], UE8M0 uint8 [E, 2I, H/32]), l2 (uint8 [E, H, I/2], uint8 [E, H, I/32]);
                   int8 / float4_e2m1fn_x2 and float8_e8m0fnu are accepted for the weights / scales.
    l1 rows are [gate | up]. Returns (l1, l2) for `bf16_mega_moe` / `fp8_mega_moe` / `fp8_fp4_mega_moe`:
    l1 gate/up interleaved in blocks of 128 rows; MXFP4 becomes (w uint8 [E, N/128, K/128, 8192], delta
    uint8 [E, N/128, K/128, 512], block_scale float32 [E, N/128, K/128]): per 128 x 128 weight block one
    contiguous 8 KB block of packed codes (w[e, nb, kb, r * 64 + fp4_packed_byte_position(j)] = byte
    kb * 64 + j of row nb * 128 + r) and one 512-byte block of deltas (delta[e, nb, kb, r * 4 + g] =
    row nb * 128 + r, group kb * 4 + g), rows after the l1 interleave. Warns when MXFP4 groups lose
    precision (see `mxfp4_transform_error`). Runs on the inputs' device.
    """
    if activation != 'swiglu':
        raise ValueError(f'activation = {activation!r} is not supported: expected "swiglu"')
    kind = _detect_format(l1_weights, l2_weights)
    if kind == 'bf16xbf16':
        l1, l2 = _check_bf16(l1_weights, 'l1'), _check_bf16(l2_weights, 'l2')
        _check_l1_l2_shapes(tuple(l1.shape), tuple(l2.shape))
        return _interleave_gate_up(l1, GATE_UP_INTERLEAVE), l2
    if kind == 'fp8xfp8':
        (w1, sf1), (w2, sf2) = _check_fp8(*l1_weights, 'l1'), _check_fp8(*l2_weights, 'l2')
        _check_l1_l2_shapes(tuple(w1.shape), tuple(w2.shape))
        return ((_interleave_gate_up(w1, GATE_UP_INTERLEAVE), _interleave_gate_up(sf1, 1)), (w2, sf2))
    (w1, sf1), (w2, sf2) = _check_mxfp4(*l1_weights, 'l1'), _check_mxfp4(*l2_weights, 'l2')
    _check_l1_l2_shapes((w1.shape[0], w1.shape[1], w1.shape[2] * 2), (w2.shape[0], w2.shape[1], w2.shape[2] * 2))
    w1, delta1, scale1 = _transform_mxfp4(w1, sf1, 'l1')
    w2, delta2, scale2 = _transform_mxfp4(w2, sf2, 'l2')
    # Rows interleaved first, then the deltas blocked (the interleave moves whole 128-row blocks)
    l1 = (_packed_to_kernel_blocks(_interleave_gate_up(w1, GATE_UP_INTERLEAVE)),
          _deltas_to_kernel_blocks(_interleave_gate_up(delta1, GATE_UP_INTERLEAVE)), _interleave_gate_up(scale1, 1))
    return l1, (_packed_to_kernel_blocks(w2), _deltas_to_kernel_blocks(delta2), scale2)


def _inverse_rebase_mxfp4(w: torch.Tensor, delta: torch.Tensor, block_scale: torch.Tensor,
                          name: str) -> Tuple[torch.Tensor, torch.Tensor]:
    """Inverse of `_rebase_mxfp4`: (w [E, N, K/2], row-major delta [E, N, K/32] as from
    `_deltas_from_kernel_blocks`, block_scale [E, N/128, K/128]), shapes already checked ->
    checkpoint (w, sf UE8M0 [E, N, K/32])."""
    mantissa, exponent = torch.frexp(block_scale)
    base = exponent.to(torch.int16) - 1 + 127 + FP4_EXPANSION_SHIFT
    if block_scale.numel() > 0 and not bool(((mantissa == 0.5) & (base >= 0) & (base <= 254)).all()):
        raise ValueError(f'{name} block_scale must hold powers of two 2^(b - 133) with 0 <= b <= 254')
    d = _blocks(delta.to(torch.int16), WEIGHT_BLOCK // MXFP4_GROUP)
    sf = base[..., None, None] - d
    if sf.numel() > 0 and not bool(((d <= FP4_MAX_DELTA) & (sf >= 0)).all()):
        raise ValueError(f'{name} delta must be <= {FP4_MAX_DELTA} and <= its block\'s base exponent')
    return w.contiguous(), _unblocks(sf).to(torch.uint8).contiguous()


def inverse_transform_weights_for_mega_moe(l1: Weights, l2: Weights) -> Tuple[Weights, Weights]:
    """Kernel weight format -> the checkpoint format `transform_weights_for_mega_moe` took.

    bf16xbf16 and fp8xfp8 come back bit-exactly. fp8xfp4 comes back as (packed uint8, UE8M0 uint8):
    exactly, except groups whose delta was clamped to 15, which come back with the exponent
    base - 15 (the precision those groups lose in the kernel, see `mxfp4_transform_error`).
    """
    if isinstance(l1, torch.Tensor) and isinstance(l2, torch.Tensor):
        l1, l2 = _check_bf16(l1, 'l1'), _check_bf16(l2, 'l2')
        _check_l1_l2_shapes(tuple(l1.shape), tuple(l2.shape))
        return _deinterleave_gate_up(l1, GATE_UP_INTERLEAVE), l2
    if isinstance(l1, (tuple, list)) and isinstance(l2, (tuple, list)) and len(l1) == 2 and len(l2) == 2:
        (w1, sf1), (w2, sf2) = _check_fp8(*l1, 'l1'), _check_fp8(*l2, 'l2')
        _check_l1_l2_shapes(tuple(w1.shape), tuple(w2.shape))
        return (_deinterleave_gate_up(w1, GATE_UP_INTERLEAVE), _deinterleave_gate_up(sf1, 1)), (w2, sf2)
    if isinstance(l1, (tuple, list)) and isinstance(l2, (tuple, list)) and len(l1) == 3 and len(l2) == 3:
        shape1 = _check_kernel_fp4(*l1, 'l1')
        shape2 = _check_kernel_fp4(*l2, 'l2')
        _check_l1_l2_shapes(shape1, shape2)
        # Deltas unblocked to rows first, then the rows de-interleaved (the forward order reversed)
        w1, delta1, scale1 = (_deinterleave_gate_up(_packed_from_kernel_blocks(l1[0]), GATE_UP_INTERLEAVE),
                              _deinterleave_gate_up(_deltas_from_kernel_blocks(l1[1]), GATE_UP_INTERLEAVE),
                              _deinterleave_gate_up(l1[2], 1))
        return (_inverse_rebase_mxfp4(w1, delta1, scale1, 'l1'),
                _inverse_rebase_mxfp4(_packed_from_kernel_blocks(l2[0]), _deltas_from_kernel_blocks(l2[1]), l2[2], 'l2'))
    raise TypeError('expected kernel-format weights: bfloat16 tensors, (e4m3, float32) pairs or '
                    '(uint8, uint8, float32) triples for both l1 and l2')
