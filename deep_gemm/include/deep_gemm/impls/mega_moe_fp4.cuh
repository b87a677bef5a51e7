#pragma once

// FP8 x FP4's E2M1 -> E4M3 expansion into wgmma A fragments, each thread its own, for the
// weights-first kernel (impls/sm90_mega_moe_ws.cuh). The rule, the packed code layout and the
// table are the persistent kernel's (sm90_fp8_mega_moe.cuh: expand_e2m1x8, fp4_table_offsets,
// fp4_magnitudes' decode form, narrow_fp4_load / narrow_fp4_expand), bit for bit: code c of a 32-wide
// group with exponent delta d becomes RNE_e4m3(e2m1(c) * 2^(6 - d)), the magnitude table[d][c & 7]
// with c's sign bit placed by the transform. The persistent kernel keeps its own copy: routing its
// decode loops through these reorders their SASS (checked on the CPU), which would need a GPU A/B to land.

#include <cuda_fp8.h>

#include "../mma/sm90_wgmma.cuh"
#include "../ptx/sm90.cuh"
#include "mega_moe_params.cuh"

namespace deep_gemm::sm90_mega_moe::fp4 {

using namespace deep_gemm::ptx;

// 8 codes (one 32-bit word of a row's 16-byte chunk) -> the E4M3 bytes of K [0, 4) (.x) and K [16, 20) (.y)
__device__ __forceinline__ uint2 expand_e2m1x8(uint32_t codes, uint2 mag) {
    const uint32_t sel = codes & 0x77777777u;
    return make_uint2(prmt(mag.x, mag.y, sel) | (codes & 0x80808080u), prmt(mag.x, mag.y, sel >> 16) | ((codes << 4) & 0x80808080u));
}
// A row's delta word as the byte offsets of its 4 table rows, or-ed with `hi` (table_hi)
__device__ __forceinline__ uint32_t table_offsets(uint32_t deltas, uint32_t hi) { return ((deltas << 3) & 0x78787878u) | hi; }
// The 128-aligned table's bit 7 in every byte: a row's address is the table's with its low byte replaced
__device__ __forceinline__ uint32_t table_hi(uint32_t table) { return (table & 0x80u) * 0x01010101u; }
__device__ __forceinline__ uint2 magnitudes(uint32_t offsets, int g, uint32_t table) { return ld_shared_v2(prmt(offsets, table, 0x7650u + g)); }

// A thread's A fragments of one K-block of a 64-row M tile (the layout of mma::WgmmaRS) and what they
// are expanded from: its two rows' code chunks and table offsets
using Fragments = uint32_t[mma::kWgmmaStepsPerKBlock][4];
struct Rows {
    uint4 codes[2];
    uint32_t offsets[2];
};
// The thread's rows row0 + lane / 4 (+ 8) of packed codes [row][kMegaMoEPackedRowBytes] at `packed` and
// deltas [row][4] at `deltas` (shared addresses): chunk lane % 4 of each (a warp reads 8 consecutive
// rows, 512 contiguous bytes: no bank conflicts)
__device__ __forceinline__ void load_rows(uint32_t packed, uint32_t deltas, int row0, int lane, Rows& r, uint32_t table) {
    const int row = row0 + lane / 4;
    const uint32_t codes = packed + row * kMegaMoEPackedRowBytes + (lane % 4) * kMegaMoEFP4ChunkBytes;
    #pragma unroll
    for (int h = 0; h < 2; ++h) {
        r.codes[h] = ld_shared_v4(codes + h * 8 * kMegaMoEPackedRowBytes);
        r.offsets[h] = table_offsets(ld_shared_u32(deltas + (row + h * 8) * 4), table_hi(table));
    }
}
// Word ks of a row's chunk expands to frag[ks][h] (K 32 ks + 4 (lane % 4) + [0, 4)) and frag[ks][2 + h] (the same + 16)
__device__ __forceinline__ void expand(const Rows& r, Fragments& frag, uint32_t table) {
    #pragma unroll
    for (int ks = 0; ks < mma::kWgmmaStepsPerKBlock; ++ks) {
        #pragma unroll
        for (int h = 0; h < 2; ++h) {
            const uint2 e = expand_e2m1x8(word_of(r.codes[h], ks), magnitudes(r.offsets[h], ks, table));
            frag[ks][h] = e.x;
            frag[ks][2 + h] = e.y;
        }
    }
}
// table[d][c] = RNE_e4m3(e2m1(c) * 2^(6 - d)) for the magnitudes c < 8, the rule of
// transform_weights_for_mega_moe (the sign bit is or-ed in by expand_e2m1x8); threads tid of num_threads
__device__ __forceinline__ void fill_table(uint8_t* table, int tid, int num_threads) {
    for (int i = tid; i < kMegaMoEFP4TableBytes; i += num_threads) {
        // twice the E2M1 magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6 as nibbles (an array indexed at run time
        // would live in local memory)
        const int d = i / 8, c = i % 8;
        const float v = 0.5f * static_cast<float>((0xC8643210u >> (4 * c)) & 0xFu) * exp2f(static_cast<float>(6 - d));
        table[i] = static_cast<uint8_t>(__nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E4M3));
    }
}
}  // namespace deep_gemm::sm90_mega_moe::fp4
