// What HBM bandwidth can the FP8 x FP4 decode pipeline's memory side reach on all SMs? A model of
// the Mega MoE kernel's narrow L1 loop without the math: per CTA one producer thread fills an
// S-stage ring, each stage the bytes of one FP8 x FP4 K-block of a 256-row L1 tile (two 8 KB packed
// code blocks, gate and up, each read sequentially through its own stream, plus their two 512-byte
// delta blocks from a third region and a 1 KB L2-resident A box); one consumer warp waits for a
// stage, holds it `hold` SM cycles (the math's time on a K-block) and releases it. Every CTA reads
// its own slice of a 2 GB weight region (never L2-resident; at G = SMs / 2 the first half of it),
// so all SMs stream at once, as at v4-flash n = 128.
//   nvcc -O2 -arch=sm_90a -o /tmp/fp4_probe scripts/fp4_stream_probe.cu
//   /tmp/fp4_probe      (sweeps CTAs, stages and hold; prints GB/s of code + delta bytes and the
//                        microseconds per stage per CTA)
// Result (H200, session 11): docs/PERF.md, "2026-11-30 (session 11)".
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>

#include "probe_common.cuh"

constexpr int kCodeBytes = 8192;     // one 128-row x 64-byte packed block
constexpr int kDeltaBytes = 512;     // its deltas
constexpr int kABytes = 1024;        // 8 token rows x 128 bytes
constexpr int kStageBytes = 2 * kCodeBytes + 2 * kDeltaBytes + kABytes;

// codes: [G][2 streams][kb_per_cta][8 KB]; deltas: [G][2][kb_per_cta][512]; a: 8 x 1 KB (shared by all)
__global__ void __launch_bounds__(64) stream(const uint8_t* codes, const uint8_t* deltas, const uint8_t* a, int stages,
                                             int kb_per_cta, int hold) {
    extern __shared__ __align__(1024) uint8_t smem[];
    auto* full = reinterpret_cast<uint64_t*>(smem + stages * kStageBytes);
    auto* empty = full + stages;
    if (threadIdx.x == 0) {
        for (int s = 0; s < stages; ++s) mb_init(full + s, 1), mb_init(empty + s, 1);
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();
    const size_t cta = blockIdx.x;
    if (threadIdx.x == 0) {
        for (int it = 0; it < kb_per_cta; ++it) {
            const int s = it % stages;
            mb_wait(empty + s, ((it / stages) & 1) ^ 1);
            mb_arrive_tx(full + s, kStageBytes);
            uint8_t* st = smem + s * kStageBytes;
            for (int h = 0; h < 2; ++h) {
                const size_t blk = (cta * 2 + h) * kb_per_cta + it;
                bulk_g2s(sa(st) + h * kCodeBytes, codes + blk * kCodeBytes, kCodeBytes, full + s);
                bulk_g2s(sa(st) + 2 * kCodeBytes + h * kDeltaBytes, deltas + blk * kDeltaBytes, kDeltaBytes, full + s);
            }
            bulk_g2s(sa(st) + 2 * kCodeBytes + 2 * kDeltaBytes, a + (cta % 8) * kABytes, kABytes, full + s);
        }
    } else if (threadIdx.x >= 32) {
        for (int it = 0; it < kb_per_cta; ++it) {
            const int s = it % stages;
            mb_wait(full + s, (it / stages) & 1);
            if (hold > 0) { const long long t0 = clock64(); while (clock64() - t0 < hold) {} }
            __syncwarp();
            if (threadIdx.x == 32) mb_arrive(empty + s);
        }
    }
}

static void check(cudaError_t e, const char* what) {
    if (e != cudaSuccess) { std::printf("%s: %s\n", what, cudaGetErrorString(e)); std::exit(1); }
}

int main() {
    int num_sms = 0;
    cudaDeviceGetAttribute(&num_sms, cudaDevAttrMultiProcessorCount, 0);
    const size_t code_region = size_t(2) << 30;
    const int kb_per_cta = static_cast<int>(code_region / (size_t(num_sms) * 2 * kCodeBytes));
    uint8_t *codes = nullptr, *deltas = nullptr, *a = nullptr;
    check(cudaMalloc(&codes, code_region), "cudaMalloc codes");
    check(cudaMalloc(&deltas, size_t(num_sms) * 2 * kb_per_cta * kDeltaBytes), "cudaMalloc deltas");
    check(cudaMalloc(&a, 8 * kABytes), "cudaMalloc a");
    cudaMemset(codes, 0x3c, code_region);
    cudaMemset(deltas, 0x01, size_t(num_sms) * 2 * kb_per_cta * kDeltaBytes);
    cudaMemset(a, 0x3c, 8 * kABytes);
    check(cudaFuncSetAttribute(stream, cudaFuncAttributeMaxDynamicSharedMemorySize, 232448), "cudaFuncSetAttribute");
    cudaEvent_t e0, e1;
    cudaEventCreate(&e0), cudaEventCreate(&e1);
    int clock_khz = 0;
    cudaDeviceGetAttribute(&clock_khz, cudaDevAttrClockRate, 0);
    std::printf("SMs %d, %d K-blocks per CTA, max SM clock %.0f MHz\n", num_sms, kb_per_cta, clock_khz / 1e3);
    std::printf("%4s %3s %5s %9s %14s\n", "G", "S", "hold", "GB/s", "us/stage/CTA");
    for (int hold : {0, 600, 900, 1200})
    for (int g : {num_sms / 2, num_sms})
    for (int stages : {4, 6, 8, 12}) {
        const int smem = stages * kStageBytes + 2 * stages * 8;
        if (smem > 232448) continue;
        const float best = best_of_3_ms(e0, e1, [&] { stream<<<g, 64, smem>>>(codes, deltas, a, stages, kb_per_cta, hold); });
        const cudaError_t err = cudaGetLastError();
        if (err != cudaSuccess) { std::printf("error: %s\n", cudaGetErrorString(err)); return 1; }
        const double bytes = double(g) * kb_per_cta * 2 * (kCodeBytes + kDeltaBytes);
        std::printf("%4d %3d %5d %9.0f %14.3f\n", g, stages, hold, bytes / (best * 1e-3) / 1e9, best * 1e3 / kb_per_cta);
    }
    return 0;
}
