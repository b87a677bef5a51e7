#pragma once

// Warpgroup MMA (wgmma) for K-major operands in 128B-swizzled shared memory.
// The instruction atoms come from CuTe (cute/arch/mma_sm90_gmma.hpp); this file adds descriptor
// construction and array-based wrappers so kernels write `Mma::fma(desc_a, desc_b, acc, accumulate)`.

#include <cstdint>
#include <utility>

#include <cute/arch/mma_sm90_gmma.hpp>

namespace deep_gemm::mma {

// Shared-memory matrix descriptor (PTX ISA, "Matrix Descriptor Format") for a K-major tile whose
// rows are 128 bytes wide and 128B-swizzled, as TMA writes them with CU_TENSOR_MAP_SWIZZLE_128B:
// 8 rows form one 1024-byte swizzle atom, so the stride between 8-row groups is 1024 bytes; the
// leading offset is unused for swizzled K-major layouts whose K extent fits one atom.
__device__ __forceinline__ uint64_t make_k_major_sw128_desc(const void* smem_tile) {
    constexpr uint64_t kStrideBytes = 1024;
    constexpr uint64_t kSwizzle128B = 1;
    const uint64_t addr = static_cast<uint32_t>(__cvta_generic_to_shared(smem_tile));
    return ((addr & 0x3FFFF) >> 4) | (uint64_t(1) << 16) | ((kStrideBytes >> 4) << 32) | (kSwizzle128B << 62);
}

// Advance a descriptor along K by `bytes` inside the 128-byte swizzle row (the hardware applies
// the swizzle to the final address, so a plain offset of the start address is correct). Only the
// low word changes: its start-address field (14 bits, shared memory / 16) plus the offset stays far
// below 2^32, so a 32-bit add (one instruction, no carry into the constant high word) does it.
__device__ __forceinline__ uint64_t advance_desc(uint64_t desc, uint32_t bytes) {
    const uint32_t lo = static_cast<uint32_t>(desc) + (bytes >> 4);
    return (desc & 0xFFFFFFFF00000000ull) | lo;
}

__device__ __forceinline__ void warpgroup_arrive() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void warpgroup_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int kPending>
__device__ __forceinline__ void warpgroup_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;\n" :: "n"(kPending) : "memory"); }

// Keep the compiler from moving accumulator reads/writes across wgmma issue/wait points
template <int N>
__device__ __forceinline__ void fence_operands(float (&d)[N]) {
    #pragma unroll
    for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i]) :: "memory");
}

// Bytes one wgmma instruction consumes along K (32 FP8 or 16 BF16 elements), and instructions per
// 128-byte K-block (one swizzle row: a pipeline stage)
constexpr uint32_t kWgmmaKBytes = 32;
constexpr int kWgmmaStepsPerKBlock = 128 / kWgmmaKBytes;

template <typename Atom, int N>
struct WgmmaSS {
    static constexpr int kNumAccum = N;

    template <size_t... I>
    __device__ __forceinline__ static void call(uint64_t a, uint64_t b, float (&d)[N], bool accumulate, std::index_sequence<I...>) {
        Atom::fma(a, b, d[I]..., accumulate ? cute::SM90::GMMA::ScaleOut::One : cute::SM90::GMMA::ScaleOut::Zero);
    }

    __device__ __forceinline__ static void fma(uint64_t desc_a, uint64_t desc_b, float (&d)[N], bool accumulate) {
        call(desc_a, desc_b, d, accumulate, std::make_index_sequence<N>{});
    }

    // One 128-byte K-block: its K steps, the first accumulating into `d` only when `accumulate`
    __device__ __forceinline__ static void fma_k_block(uint64_t desc_a, uint64_t desc_b, float (&d)[N], bool accumulate) {
        #pragma unroll
        for (int ks = 0; ks < kWgmmaStepsPerKBlock; ++ks)
            fma(advance_desc(desc_a, ks * kWgmmaKBytes), advance_desc(desc_b, ks * kWgmmaKBytes), d, accumulate or ks > 0);
    }
};

// A from registers (RS), B from shared memory. For E4M3, a[i] holds 4 consecutive K elements
// (lowest K in the lowest byte) of row (warp % 4) * 16 + lane / 4 + 8 * (i % 2), K offset
// (lane % 4) * 4 + 16 * (i / 2) within the instruction's 32. The wgmma reads `a` asynchronously:
// keep it live until the wait (fence_fragments after warpgroup_wait).
template <typename Atom, int N>
struct WgmmaRS {
    static constexpr int kNumAccum = N;
    using Fragment = uint32_t[4];

    template <size_t... I>
    __device__ __forceinline__ static void call(const Fragment& a, uint64_t b, float (&d)[N], bool accumulate, std::index_sequence<I...>) {
        Atom::fma(a[0], a[1], a[2], a[3], b, d[I]..., accumulate ? cute::SM90::GMMA::ScaleOut::One : cute::SM90::GMMA::ScaleOut::Zero);
    }

    __device__ __forceinline__ static void fma(const Fragment& a, uint64_t desc_b, float (&d)[N], bool accumulate) {
        call(a, desc_b, d, accumulate, std::make_index_sequence<N>{});
    }

    // One 128-byte K-block: a[ks] is K step ks's fragment
    __device__ __forceinline__ static void fma_k_block(const Fragment (&a)[kWgmmaStepsPerKBlock], uint64_t desc_b, float (&d)[N], bool accumulate) {
        #pragma unroll
        for (int ks = 0; ks < kWgmmaStepsPerKBlock; ++ks)
            fma(a[ks], advance_desc(desc_b, ks * kWgmmaKBytes), d, accumulate or ks > 0);
    }
};

// Keep register A fragments live (and unmodified) until here: the wgmma that reads them has completed
template <int M, int N>
__device__ __forceinline__ void fence_fragments(uint32_t (&a)[M][N]) {
    #pragma unroll
    for (int i = 0; i < M; ++i)
        #pragma unroll
        for (int j = 0; j < N; ++j) asm volatile("" : "+r"(a[i][j]) :: "memory");
}

// 64 rows (one warpgroup) x N columns x K per instruction; accumulators: N/2 floats per thread.
// Accumulator i of a thread holds row (warp % 4) * 16 + lane / 4 + 8 * ((i / 2) % 2) and column
// (i / 4) * 8 + (lane % 4) * 2 + (i % 2).
using FP8MmaN8 = WgmmaSS<cute::SM90::GMMA::MMA_64x8x32_F32E4M3E4M3_SS_TN<>, 4>;
using FP8MmaRegAN8 = WgmmaRS<cute::SM90::GMMA::MMA_64x8x32_F32E4M3E4M3_RS_TN<>, 4>;
using FP8MmaN64 = WgmmaSS<cute::SM90::GMMA::MMA_64x64x32_F32E4M3E4M3_SS_TN<>, 32>;
using FP8MmaRegAN16 = WgmmaRS<cute::SM90::GMMA::MMA_64x16x32_F32E4M3E4M3_RS_TN<>, 8>;
using FP8MmaRegAN32 = WgmmaRS<cute::SM90::GMMA::MMA_64x32x32_F32E4M3E4M3_RS_TN<>, 16>;
using FP8MmaRegAN64 = WgmmaRS<cute::SM90::GMMA::MMA_64x64x32_F32E4M3E4M3_RS_TN<>, 32>;
using FP8MmaN128 = WgmmaSS<cute::SM90::GMMA::MMA_64x128x32_F32E4M3E4M3_SS_TN<>, 64>;
using BF16MmaN8 = WgmmaSS<cute::SM90::GMMA::MMA_64x8x16_F32BF16BF16_SS<cute::SM90::GMMA::Major::K, cute::SM90::GMMA::Major::K>, 4>;
using BF16MmaN64 = WgmmaSS<cute::SM90::GMMA::MMA_64x64x16_F32BF16BF16_SS<cute::SM90::GMMA::Major::K, cute::SM90::GMMA::Major::K>, 32>;
using BF16MmaN128 = WgmmaSS<cute::SM90::GMMA::MMA_64x128x16_F32BF16BF16_SS<cute::SM90::GMMA::Major::K, cute::SM90::GMMA::Major::K>, 64>;
using BF16MmaN256 = WgmmaSS<cute::SM90::GMMA::MMA_64x256x16_F32BF16BF16_SS<cute::SM90::GMMA::Major::K, cute::SM90::GMMA::Major::K>, 128>;

}  // namespace deep_gemm::mma
