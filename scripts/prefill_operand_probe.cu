// Is the FP8 prefill K-block bound by its operand stream from L2, and would 2-CTA clusters that
// multicast the shared weight tile lift that bound? A model of the Mega MoE kernel's 128-row L1
// task without its promotions and epilogue: per CTA one producer thread fills a 4-stage ring of
// 48 KB stages (A: 128 token rows x one 128-byte K-block, 16 KB; B: 256 weight rows x 128 bytes,
// 32 KB, both 128B-swizzled TMA boxes), two math warpgroups each run four m64n256k32 E4M3 wgmmas
// per K-block on their 64 rows (the tensor work of the kernel's gate and up halves), wait, and
// release the stage. Operands stay L2-resident (a few MB re-read by every CTA, as the prefill's
// M-blocks and weight tiles are: the bytes come from L2, not HBM).
//   cluster 1: every CTA loads its A and the whole B tile (48 KB a stage from L2: the kernel today)
//   cluster 2: CTA pairs work on two M-blocks of one expert's weight tile: each loads its own A
//              and one 128-row half of B, multicast to both CTAs (32 KB a stage from L2); a stage
//              is refilled once the math of both CTAs has released it (2: the releases at CTA scope;
//              2/rc: at cluster scope, session 47's form, whose cost on the math's path hid the rest)
// Modes: data (no wgmma: what the ring alone sustains), math (wgmma on streamed stages), smem (the
// producer loads nothing: wgmma on whatever the stages hold, the tensor cores' own rate), split (the
// kernel's form of the K-block: gate's 128 columns as four m64n128k32 wgmmas into 64 partial sums,
// wait, promote them into the accumulators with a per-row token scale times the block scale, then up's
// the same; registers moved to the math warpgroups as the kernel does, 56 / 224), split-smem (that
// without loads). smem against math says what the operand stream costs the tensor cores; split
// against math what the kernel's waits and promotions cost.
//   nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -I deep_gemm/include \
//        -I "$(python3 -c 'import deep_gemm.jit as j; print(j.find_cutlass_include())')" \
//        -o /tmp/operand_probe scripts/prefill_operand_probe.cu
//   /tmp/operand_probe     (as many CTAs as 2-CTA clusters fill at once, <= the SMs; per cluster size and
//                           mode: ns and SM cycles per K-block, GB/s from L2)
// Results: docs/PERF.md, session 47.
#include <cuda.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>

#include <deep_gemm/mma/sm90_wgmma.cuh>
#include <deep_gemm/ptx/sm90.cuh>

#include "probe_common.cuh"

namespace {

constexpr int kKBytes = 4096;                 // K of the modelled L1 (v4-flash hidden, FP8): 32 K-blocks a task
constexpr int kNumKb = kKBytes / 128;
constexpr int kABytes = 128 * 128;            // one K-block of a 128-row M-block
constexpr int kBBytes = 256 * 128;            // one K-block of a 256-row weight tile
constexpr int kStageBytes = kABytes + kBBytes;
constexpr int kStages = 4;
constexpr int kMBlocks = 16;                  // distinct A tiles (rows of the pool)
constexpr int kWTiles = 16;                   // distinct weight tiles
constexpr int kThreads = 384;

enum Mode { kData = 0, kMath = 1, kSmem = 2, kSplit = 3, kSplitSmem = 4 };
__host__ __device__ constexpr bool loads(int mode) { return mode != kSmem and mode != kSplitSmem; }

using Mma = deep_gemm::mma::WgmmaSS<cute::SM90::GMMA::MMA_64x256x32_F32E4M3E4M3_SS_TN<>, 128>;
using HalfMma = deep_gemm::mma::FP8MmaN128;   // 64 partial sums a thread

__device__ __forceinline__ uint32_t cluster_rank() { uint32_t r; asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r)); return r; }
__device__ __forceinline__ void cluster_sync() {
    asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void tma_2d(uint32_t dst, const CUtensorMap* map, uint64_t* bar, int x, int y) {
    asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4}], [%2];\n"
                 :: "r"(dst), "l"(reinterpret_cast<uint64_t>(map)), "r"(sa(bar)), "r"(x), "r"(y) : "memory");
}
// The box lands at the same offset in every CTA of `mask` and completes its bytes on each one's
// mbarrier at `bar`'s offset
__device__ __forceinline__ void tma_2d_multicast(uint32_t dst, const CUtensorMap* map, uint64_t* bar, int x, int y, uint16_t mask) {
    asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster"
                 " [%0], [%1, {%3, %4}], [%2], %5;\n"
                 :: "r"(dst), "l"(reinterpret_cast<uint64_t>(map)), "r"(sa(bar)), "r"(x), "r"(y), "h"(mask) : "memory");
}
// An arrival on `bar`'s offset in CTA `cta` of the cluster. kClusterScope: with release semantics at
// cluster scope (session 47's form: the arriving thread first makes its earlier memory accesses
// visible to the cluster, measured ~650 cycles an arrival, on the math warpgroup's path); else at the
// default CTA scope, as CUTLASS's ClusterBarrier::arrive(cta_id) does: a stage's release only says that
// the wgmmas reading it are done (warpgroup_wait), which orders nothing through memory
template <bool kClusterScope>
__device__ __forceinline__ void arrive_remote(uint64_t* bar, uint32_t cta) {
    if constexpr (kClusterScope)
        asm volatile("{\n .reg .b32 ra;\n mapa.shared::cluster.u32 ra, %0, %1;\n"
                     " mbarrier.arrive.release.cluster.shared::cluster.b64 _, [ra];\n}\n" :: "r"(sa(bar)), "r"(cta) : "memory");
    else
        asm volatile("{\n .reg .b32 ra;\n mapa.shared::cluster.u32 ra, %0, %1;\n"
                     " mbarrier.arrive.shared::cluster.b64 _, [ra];\n}\n" :: "r"(sa(bar)), "r"(cta) : "memory");
}

// One arrival per math warpgroup on stage s's empty barrier of every CTA that shares it
template <int kCluster, bool kClusterScope>
__device__ __forceinline__ void release(uint64_t* empty, int s, int wg) {
    asm volatile("bar.sync %0, 128;\n" :: "r"(wg) : "memory");
    if (threadIdx.x % 128 == 0) {
        if constexpr (kCluster > 1) {
            for (uint32_t c = 0; c < kCluster; ++c) arrive_remote<kClusterScope>(empty + s, c);
        } else {
            mb_arrive(empty + s);
        }
    }
}

// The kernel's K-block (l1_mainloop, FP8 x FP8, 128-row tiles): per half (gate, up) four m64n128k32
// wgmmas into fresh partial sums, wait, then acc += partial x (token scale of the row x block scale)
template <int kCluster, bool kClusterScope>
__device__ __forceinline__ void math_split(uint8_t* smem, uint64_t* full, uint64_t* empty, int wg, int total, long long* cycles) {
    float acc[2 * HalfMma::kNumAccum];
    #pragma unroll
    for (int i = 0; i < 2 * HalfMma::kNumAccum; ++i) acc[i] = 0.0f;
    const int row = (threadIdx.x % 128) / 32 * 16 + threadIdx.x % 32 / 4;   // the thread's first accumulator row
    const long long t0 = clock64();
    for (int it = 0; it < total; ++it) {
        const int s = it % kStages;
        mb_wait(full + s, (it / kStages) & 1);
        uint8_t* stage = smem + s * kStageBytes;
        // the row's token scales and the block scales, as the kernel reads them from the stage (bytes of
        // the A tile here: any finite values do for timing)
        const float* sf = reinterpret_cast<const float*>(stage);
        const float sa0 = 1.0f + 0.0f * sf[row], sa1 = 1.0f + 0.0f * sf[row + 8];
        const uint64_t da = deep_gemm::mma::make_k_major_sw128_desc(stage + (wg - 1) * 64 * 128);
        #pragma unroll
        for (int half = 0; half < 2; ++half) {
            float part[HalfMma::kNumAccum];
            const uint64_t db = deep_gemm::mma::make_k_major_sw128_desc(stage + kABytes + half * (kBBytes / 2));
            deep_gemm::mma::fence_operands(part);
            deep_gemm::mma::warpgroup_arrive();
            HalfMma::fma_k_block(da, db, part, false);
            deep_gemm::mma::warpgroup_commit();
            const float sb = 1.0f + 0.0f * sf[64 + half];
            deep_gemm::mma::warpgroup_wait<0>();
            deep_gemm::mma::fence_operands(part);
            #pragma unroll
            for (int i = 0; i < HalfMma::kNumAccum; ++i)
                acc[half * HalfMma::kNumAccum + i] += part[i] * (((i / 2) % 2 ? sa1 : sa0) * sb);
        }
        release<kCluster, kClusterScope>(empty, s, wg);
    }
    if (threadIdx.x == 128) cycles[blockIdx.x] = clock64() - t0;
    float sum = 0.0f;
    #pragma unroll
    for (int i = 0; i < 2 * HalfMma::kNumAccum; ++i) sum += acc[i];
    if (sum == 1234.5f) reinterpret_cast<float*>(smem)[threadIdx.x] = sum;   // keeps the math
}

template <int kCluster, bool kClusterScope>
__device__ void body(const CUtensorMap* tm_a, const CUtensorMap* tm_b, int mode, int tasks, float* sink, long long* cycles) {
    extern __shared__ __align__(1024) uint8_t smem[];
    auto* full = reinterpret_cast<uint64_t*>(smem + kStages * kStageBytes);
    auto* empty = full + kStages;
    const uint32_t rank = kCluster > 1 ? cluster_rank() : 0;
    const int wg = threadIdx.x / 128;
    if (threadIdx.x == 0) {
        // empty: one arrival per math warpgroup of every CTA that reads the stage's B
        for (int s = 0; s < kStages; ++s) mb_init(full + s, 1), mb_init(empty + s, 2 * kCluster);
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    if constexpr (kCluster > 1) cluster_sync(); else __syncthreads();
    // The pair's tasks: the same weight tile, M-blocks 2p and 2p + 1 (one CTA's M-block otherwise)
    const int pair = blockIdx.x / kCluster;
    const int total = tasks * kNumKb;
    // Registers as the kernel moves them: 56 for warpgroup 0, 224 for each math warpgroup (inside each
    // role's branch, so that ptxas gives the math code the larger budget)
    if (wg == 0) {
        deep_gemm::ptx::setmaxnreg_dec<56>();
        if (threadIdx.x == 0) {
            for (int it = 0; it < total; ++it) {
                const int s = it % kStages, kb = it % kNumKb, task = it / kNumKb;
                const int m_block = (pair * kCluster + rank + task * 7) % kMBlocks, w_tile = (pair + task * 5) % kWTiles;
                mb_wait<(kCluster > 1)>(empty + s, ((it / kStages) & 1) ^ 1);
                const uint32_t a = sa(smem + s * kStageBytes), b = a + kABytes;
                if (not loads(mode)) { mb_arrive(full + s); continue; }
                mb_arrive_tx(full + s, kStageBytes);
                tma_2d(a, tm_a, full + s, kb * 128, m_block * 128);
                if constexpr (kCluster > 1) {
                    const uint32_t half = kBBytes / kCluster;
                    tma_2d_multicast(b + rank * half, tm_b, full + s, kb * 128, w_tile * 256 + rank * (256 / kCluster),
                                     static_cast<uint16_t>((1u << kCluster) - 1));
                } else {
                    tma_2d(b, tm_b, full + s, kb * 128, w_tile * 256);
                }
            }
        }
    } else {
        deep_gemm::ptx::setmaxnreg_inc<224>();
        if (mode == kSplit or mode == kSplitSmem) {
            math_split<kCluster, kClusterScope>(smem, full, empty, wg, total, cycles);
        } else {
            float acc[Mma::kNumAccum];
            #pragma unroll
            for (int i = 0; i < Mma::kNumAccum; ++i) acc[i] = 0.0f;
            const long long t0 = clock64();
            for (int it = 0; it < total; ++it) {
                const int s = it % kStages;
                mb_wait(full + s, (it / kStages) & 1);
                if (mode != kData) {
                    uint8_t* stage = smem + s * kStageBytes;
                    const uint64_t da = deep_gemm::mma::make_k_major_sw128_desc(stage + (wg - 1) * 64 * 128);
                    const uint64_t db = deep_gemm::mma::make_k_major_sw128_desc(stage + kABytes);
                    deep_gemm::mma::fence_operands(acc);
                    deep_gemm::mma::warpgroup_arrive();
                    Mma::fma_k_block(da, db, acc, true);
                    deep_gemm::mma::warpgroup_commit();
                    deep_gemm::mma::warpgroup_wait<0>();
                    deep_gemm::mma::fence_operands(acc);
                }
                release<kCluster, kClusterScope>(empty, s, wg);
            }
            if (threadIdx.x == 128) cycles[blockIdx.x] = clock64() - t0;
            float sum = 0.0f;
            #pragma unroll
            for (int i = 0; i < Mma::kNumAccum; ++i) sum += acc[i];
            if (sum == 1234.5f) sink[threadIdx.x] = sum;   // keeps the wgmmas (never true for these bytes)
        }
    }
    // No CTA leaves while its peer may still multicast into it or arrive on its barriers
    __syncwarp();
    if constexpr (kCluster > 1) cluster_sync();
}

__global__ void __launch_bounds__(kThreads, 1) probe1(const __grid_constant__ CUtensorMap tm_a, const __grid_constant__ CUtensorMap tm_b,
                                                       int mode, int tasks, float* sink, long long* cycles) {
    body<1, false>(&tm_a, &tm_b, mode, tasks, sink, cycles);
}
template <bool kClusterScope>
__global__ void __cluster_dims__(2, 1, 1) __launch_bounds__(kThreads, 1) probe2(const __grid_constant__ CUtensorMap tm_a,
                                                                                const __grid_constant__ CUtensorMap tm_b,
                                                                                int mode, int tasks, float* sink, long long* cycles) {
    body<2, kClusterScope>(&tm_a, &tm_b, mode, tasks, sink, cycles);
}

}  // namespace

int main() {
    void *a = nullptr, *b = nullptr;
    cudaMalloc(&a, size_t(kMBlocks) * 128 * kKBytes);
    cudaMalloc(&b, size_t(kWTiles) * 256 * kKBytes);
    cudaMemset(a, 0x38, size_t(kMBlocks) * 128 * kKBytes);   // E4M3 1.0
    cudaMemset(b, 0x30, size_t(kWTiles) * 256 * kKBytes);    // E4M3 0.5
    const CUtensorMap tm_a = make_sw128_map(a, uint64_t(kMBlocks) * 128, kKBytes, 128);
    const CUtensorMap tm_b1 = make_sw128_map(b, uint64_t(kWTiles) * 256, kKBytes, 256), tm_b2 = make_sw128_map(b, uint64_t(kWTiles) * 256, kKBytes, 128);
    float* sink = nullptr;
    long long* cycles = nullptr;
    int num_sms = 0;
    cudaDeviceGetAttribute(&num_sms, cudaDevAttrMultiProcessorCount, 0);
    const int smem = kStages * kStageBytes + 2 * kStages * 8;
    cudaFuncSetAttribute(probe1, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    cudaFuncSetAttribute(probe2<false>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    cudaFuncSetAttribute(probe2<true>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    // Clusters are placed within a GPC: with one CTA an SM, GPCs of odd SM counts leave an SM idle.
    // Both cluster sizes run on the CTAs that 2-CTA clusters can hold at once (one wave each)
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3(num_sms / 2 * 2);
    cfg.blockDim = dim3(kThreads);
    cfg.dynamicSmemBytes = smem;
    int max_clusters = 0;
    if (cudaOccupancyMaxActiveClusters(&max_clusters, probe2<false>, &cfg) != cudaSuccess or max_clusters <= 0) {
        std::printf("cudaOccupancyMaxActiveClusters failed\n");
        return 1;
    }
    const int grid = std::min(num_sms / 2, max_clusters) * 2;
    std::printf("# %d SMs, at most %d 2-CTA clusters resident at once\n", num_sms, max_clusters);
    cudaMalloc(&sink, kThreads * sizeof(float));
    cudaMalloc(&cycles, grid * sizeof(long long));
    cudaEvent_t e0, e1;
    cudaEventCreate(&e0), cudaEventCreate(&e1);
    const int tasks = 24;
    const char* names[] = {"data", "math", "smem", "split", "split-smem"};
    std::printf("# %d CTAs, %d tasks of %d K-blocks each, %d stages of %d KB; A %d KB + B %d KB a stage\n", grid, tasks, kNumKb,
                kStages, kStageBytes / 1024, kABytes / 1024, kBBytes / 1024);
    std::printf("%7s %10s %10s %12s %14s %16s\n", "cluster", "mode", "us", "ns/K-block", "cycles/K-block", "L2 -> SM GB/s");
    for (int round = 0; round < 2; ++round)
    for (int config : {1, 2, 3})   // cluster 1; cluster 2 (CTA-scope releases); "2/rc": cluster 2, cluster-scope releases
    for (int mode : {kData, kMath, kSmem, kSplit, kSplitSmem}) {
        const int cluster = config == 1 ? 1 : 2;
        const float best = best_of_3_ms(e0, e1, [&] {
            if (config == 1) probe1<<<grid, kThreads, smem>>>(tm_a, tm_b1, mode, tasks, sink, cycles);
            else if (config == 2) probe2<false><<<grid, kThreads, smem>>>(tm_a, tm_b2, mode, tasks, sink, cycles);
            else probe2<true><<<grid, kThreads, smem>>>(tm_a, tm_b2, mode, tasks, sink, cycles);
        });
        const cudaError_t err = cudaDeviceSynchronize();
        if (err != cudaSuccess) { std::printf("error: %s\n", cudaGetErrorString(err)); return 1; }
        long long host_cycles[256] = {};
        cudaMemcpy(host_cycles, cycles, grid * sizeof(long long), cudaMemcpyDeviceToHost);
        double mean_cycles = 0;
        for (int i = 0; i < grid; ++i) mean_cycles += double(host_cycles[i]) / grid;
        const int kbs = tasks * kNumKb;
        // bytes each SM takes from L2: A + B (cluster 1) or A + half of B (cluster 2); none in smem mode
        const double l2_bytes = not loads(mode) ? 0.0 : double(grid) * kbs * (kABytes + kBBytes / cluster);
        std::printf("%7s %10s %10.1f %12.1f %14.0f %16.0f\n", config == 1 ? "1" : config == 2 ? "2" : "2/rc", names[mode], best * 1e3, best * 1e6 / kbs, mean_cycles / kbs,
                    l2_bytes / (best * 1e-3) / 1e9);
    }
    return 0;
}
