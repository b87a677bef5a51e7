// How fast can G CTAs stream weight tiles with TMA, and what bounds it? A model of the Mega MoE
// kernel's decode L1 loop without the math: per CTA one producer thread fills an S-stage ring with
// 256-row x 128-byte weight boxes (one K-block of a 256-row L1 tile, 32 KB) plus, optionally, an
// 8 KB "A" box that stays L2-resident; one consumer thread waits for a stage, holds it `hold_ns`
// (the math's time on a K-block), and releases it. Each CTA walks `slabs` tiles of 16 K-blocks,
// every tile fresh rows of a 640 MB matrix (never L2-resident).
//   layouts: 0 = row-major weights [rows, 2048 B] (a K-block is 128 B of each row, 2 KB apart), one
//            256-row box; 1 = the same, two 128-row boxes; 2 = blocked: each 128 x 128 block is 16 KB
//            contiguous, two boxes of 128 rows; 3 = a K-block's 256 x 128 B contiguous (32 KB), one 1-D
//            bulk copy (a layout the transform would pre-swizzle); 4 = the same in four 8 KB bulk copies
//   nvcc -O2 -arch=sm_90a -o /tmp/tma_probe scripts/tma_stream_probe.cu
//   /tmp/tma_probe            (sweeps G, S, layout, hold; prints GB/s of weight bytes and us per stage)
//   /tmp/tma_probe per-sm     (hold 0, no A: G from 1 to 132, layouts 0 / 3 / 4, weights from HBM
//                              (fresh rows) and L2-resident (each CTA re-reads one tile): what one SM ingests)
// Results (H200): docs/PERF.md "what bounds the decode K-block" (session 5) and session 30.
#include <cuda.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "probe_common.cuh"

constexpr int kKBytes = 2048;       // row length of the weight matrix (mid shape: hidden 2048, FP8)
constexpr int kNumKb = kKBytes / 128;
constexpr int kTileRows = 256;
constexpr int kBBytes = kTileRows * 128;
constexpr int kABytes = 64 * 128;

__device__ __forceinline__ void tma_2d(void* dst, const CUtensorMap* map, uint64_t* bar, int x, int y) {
    asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4}], [%2];\n"
                 :: "r"(sa(dst)), "l"(reinterpret_cast<uint64_t>(map)), "r"(sa(bar)), "r"(x), "r"(y) : "memory");
}

__global__ void __launch_bounds__(64) stream(const __grid_constant__ CUtensorMap tm_row, const __grid_constant__ CUtensorMap tm_blk,
                                             const __grid_constant__ CUtensorMap tm_a, const uint8_t* w, int layout, int stages, int slabs, int hold_ns, int use_a,
                                             int hot) {
    extern __shared__ __align__(1024) uint8_t smem[];
    const int stage_bytes = kBBytes + kABytes;
    auto* full = reinterpret_cast<uint64_t*>(smem + stages * stage_bytes);
    auto* empty = full + stages;
    if (threadIdx.x == 0) {
        for (int s = 0; s < stages; ++s) mb_init(full + s, 1), mb_init(empty + s, 1);
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();
    const int total = slabs * kNumKb;
    if (threadIdx.x == 0) {
        for (int it = 0; it < total; ++it) {
            const int s = it % stages, kb = it % kNumKb, tile = hot ? static_cast<int>(blockIdx.x) : blockIdx.x * slabs + it / kNumKb;
            mb_wait(empty + s, ((it / stages) & 1) ^ 1);
            mb_arrive_tx(full + s, kBBytes + (use_a ? kABytes : 0));
            uint8_t* b = smem + s * stage_bytes;
            if (layout == 0) {
                tma_2d(b, &tm_row, full + s, kb * 128, tile * kTileRows);
            } else if (layout == 1) {
                tma_2d(b, &tm_row, full + s, kb * 128, tile * kTileRows);
                tma_2d(b + kBBytes / 2, &tm_row, full + s, kb * 128, tile * kTileRows + 128);
            } else if (layout >= 3) {
                // K-block kb of tile `tile`: 32 KB contiguous at (tile * kNumKb + kb) * 32 KB
                const uint8_t* src = w + (static_cast<size_t>(tile) * kNumKb + kb) * kBBytes;
                const int pieces = layout == 3 ? 1 : 4;
                for (int q = 0; q < pieces; ++q)
                    bulk_g2s(sa(b) + q * (kBBytes / pieces), src + q * (kBBytes / pieces), kBBytes / pieces, full + s);
            } else {
                // blocks of 128 rows x 128 B, row blocks K-block-major: block (rb, kb) at rows (rb * 16 + kb) * 128
                for (int h = 0; h < 2; ++h)
                    tma_2d(b + h * kBBytes / 2, &tm_blk, full + s, 0, ((tile * 2 + h) * kNumKb + kb) * 128);
            }
            if (use_a) tma_2d(b + kBBytes, &tm_a, full + s, kb * 128, (blockIdx.x % 8) * 64);
        }
    } else if (threadIdx.x == 32) {
        for (int it = 0; it < total; ++it) {
            const int s = it % stages;
            mb_wait(full + s, (it / stages) & 1);
            if (hold_ns > 0) { const uint64_t t0 = now_ns(); while (now_ns() - t0 < static_cast<uint64_t>(hold_ns)) {} }
            mb_arrive(empty + s);
        }
    }
}

int main(int argc, char** argv) {
    const bool per_sm = argc > 1 and std::string(argv[1]) == "per-sm";
    const size_t w_bytes = size_t(640) << 20;
    void *w = nullptr, *a = nullptr;
    cudaMalloc(&w, w_bytes);
    cudaMalloc(&a, 8 * 64 * kKBytes);
    cudaMemset(w, 0x3c, w_bytes);
    cudaMemset(a, 0x3c, 8 * 64 * kKBytes);
    const uint64_t rows = w_bytes / kKBytes;
    const CUtensorMap tm_row0 = make_sw128_map(w, rows, kKBytes, 256), tm_row1 = make_sw128_map(w, rows, kKBytes, 128);
    const CUtensorMap tm_blk = make_sw128_map(w, w_bytes / 128, 128, 128);
    const CUtensorMap tm_a = make_sw128_map(a, 8 * 64, kKBytes, 64);
    cudaFuncSetAttribute(stream, cudaFuncAttributeMaxDynamicSharedMemorySize, 232448);
    cudaEvent_t e0, e1;
    cudaEventCreate(&e0), cudaEventCreate(&e1);
    const char* names[] = {"row 1x256", "row 2x128", "blocked 2x128", "bulk 1x32K", "bulk 4x8K"};
    if (per_sm) {
        std::printf("%4s %3s %-12s %4s %9s %12s %9s\n", "G", "S", "layout", "hot", "GB/s", "us/stage/CTA", "GB/s/SM");
        for (int hot = 0; hot < 2; ++hot)
        for (int g : {1, 8, 16, 32, 48, 64, 96, 132})
        for (int stages : {3, 5})
        for (int layout : {0, 3, 4}) {
            const int smem = stages * (kBBytes + kABytes) + 2 * stages * 8;
            const int slabs = 8;
            const float best = best_of_3_ms(e0, e1, [&] {
                stream<<<g, 64, smem>>>(tm_row0, tm_blk, tm_a, static_cast<const uint8_t*>(w), layout, stages, slabs, 0, 0, hot);
            });
            const cudaError_t err = cudaGetLastError();
            if (err != cudaSuccess) { std::printf("error: %s\n", cudaGetErrorString(err)); return 1; }
            const double bytes = double(g) * slabs * kNumKb * kBBytes;
            const double gbs = bytes / (best * 1e-3) / 1e9;
            std::printf("%4d %3d %-12s %4d %9.0f %12.3f %9.1f\n", g, stages, names[layout], hot, gbs, best * 1e3 / (slabs * kNumKb), gbs / g);
        }
        return 0;
    }
    std::printf("%4s %3s %-12s %5s %2s %9s %12s\n", "G", "S", "layout", "hold", "A", "GB/s", "us/stage/CTA");
    for (int use_a = 1; use_a >= 0; --use_a)
    for (int hold : {0, 500, 1000})
    for (int g : {32, 48, 96, 132})
    for (int stages : {3, 5, 7})
    for (int layout = 0; layout < 3; ++layout) {
        const int stage_bytes = kBBytes + kABytes;
        const int smem = stages * stage_bytes + 2 * stages * 8;
        if (smem > 232448) continue;
        const int slabs = 8;
        if (static_cast<uint64_t>(g) * slabs * kTileRows > rows) continue;
        const float best = best_of_3_ms(e0, e1, [&] {
            stream<<<g, 64, smem>>>(layout == 0 ? tm_row0 : tm_row1, tm_blk, tm_a, static_cast<const uint8_t*>(w), layout, stages, slabs, hold, use_a, 0);
        });
        const cudaError_t err = cudaGetLastError();
        if (err != cudaSuccess) { std::printf("error: %s\n", cudaGetErrorString(err)); return 1; }
        const double bytes = double(g) * slabs * kNumKb * kBBytes;
        std::printf("%4d %3d %-12s %5d %2d %9.0f %12.3f\n", g, stages, names[layout], hold, use_a, bytes / (best * 1e-3) / 1e9,
                    best * 1e3 / (slabs * kNumKb));
    }
    return 0;
}
