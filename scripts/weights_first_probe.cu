// docs/plans/decode-weights-first.md, first step: can every CTA of the grid start streaming a
// one-token call's weights right after reading the routing, and how long until the last byte is in?
// A model of mid FP8 n = 1 (2048 / 768 / 128 experts / top-8) without the math: after the same L2
// flush the benchmark does (256 MB written), each of G CTAs
//   1. reads the call's 8 routed expert ids (one cold line),
//   2. derives the same static plan: the 8 experts' L1 tiles (6 of 256 rows x 2048 K each: 768
//      K-blocks of 32 KB) split into G equal K ranges, and (CTAs < 128) one whole L2 tile of 128 rows
//      x 768 K (98 KB) into shared memory,
//   3. streams its L1 range through S stages (a consumer thread holds each for `hold` ns: the math)
//      and waits for its L2 tile.
// Modes: 0 = both (the plan), 1 = the L1 ranges only, 2 = today's L1 split (48 CTAs, one 256-row
// tile each, all 16 K-blocks) for comparison, 3 = the plan's whole chain without the math (step 2):
// after its L1 range a CTA writes a 1 KB FP32 partial per tile it touched and counts it; the CTA
// that counts a tile's last part sums the parts in part order (bitwise repeatable), writes the
// tile's output and counts it for its expert; a CTA with an L2 tile waits for its expert's 6 L1
// tiles, holds `hold` ns (the L2 math from shared memory) and writes its 256 bytes of output. Prints the event time of the launch and, from the
// per-CTA %globaltimer stamps, when the first CTA had its ids, issued its first load, and when the
// last CTA had all of its bytes (us after the first CTA started).
//   nvcc -O2 -std=c++17 -arch=sm_90a -o /tmp/wf_probe scripts/weights_first_probe.cu && /tmp/wf_probe
// The budget it checks: 37.7 MB at ~4.2 TB/s is ~9 us; the plan needs every byte in by ~11 us.
#include <cuda.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <vector>

#include "probe_common.cuh"

constexpr int kExperts = 128, kTopk = 8;
constexpr int kL1Rows = 2 * 768, kL1K = 2048;          // per expert: gate/up rows x hidden bytes (FP8)
constexpr int kL2Rows = 2048, kL2K = 768;              // per expert: hidden rows x intermediate bytes
constexpr int kL1TileRows = 256, kL1Tiles = kL1Rows / kL1TileRows, kL1Kb = kL1K / 128;
constexpr int kL2TileRows = 128, kL2Tiles = kL2Rows / kL2TileRows, kL2Kb = kL2K / 128;
constexpr int kStageBytes = kL1TileRows * 128;         // 32 KB
constexpr int kL2TileBytes = kL2TileRows * kL2K;       // 98 KB
constexpr int kMaxStages = 4;

struct Stamps { unsigned long long start, ids, first_issue, done; };

// Mode 3's workspace (zeroed before each launch): per L1 tile its parts' partials, the count of its
// parts done and its output; per expert slot the count of its L1 tiles done
constexpr int kMaxParts = 8;
struct Chain {
    float partial[kTopk * kL1Tiles][kMaxParts][kL1TileRows];
    float h[kTopk * kL1Tiles][kL1TileRows];
    unsigned int tile_parts_done[kTopk * kL1Tiles];
    unsigned int expert_tiles_done[kTopk];
    unsigned int l2_out[kTopk * kL2Tiles][64];
};

// The first CTA whose range of `units` (split evenly over g CTAs) holds unit u
__device__ __forceinline__ int cta_of_unit(int u, int units, int g) {
    int c = static_cast<int>((static_cast<int64_t>(u) * g) / units);
    while (static_cast<int64_t>(units) * (c + 1) / g <= u) ++c;
    while (c > 0 and static_cast<int64_t>(units) * c / g > u) --c;
    return c;
}

__global__ void __launch_bounds__(64) probe(const __grid_constant__ CUtensorMap tm_l1, const __grid_constant__ CUtensorMap tm_l2,
                                            const int64_t* ids, Stamps* stamps, Chain* chain, int mode, int stages, int hold_ns) {
    extern __shared__ __align__(1024) uint8_t smem[];
    uint8_t* l2_tile = smem + kMaxStages * kStageBytes;
    auto* full = reinterpret_cast<uint64_t*>(l2_tile + kL2TileBytes);
    auto* empty = full + kMaxStages;
    uint64_t* l2_bar = empty + kMaxStages;
    __shared__ int experts[kTopk];
    const uint64_t t_start = now_ns();
    if (threadIdx.x == 0) {
        for (int s = 0; s < stages; ++s) mb_init(full + s, 1), mb_init(empty + s, 1);
        mb_init(l2_bar, 1);
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
        // The routing: one line, read by every CTA (sorted ids: the plan is the same everywhere)
        int e[kTopk];
        for (int k = 0; k < kTopk; ++k) e[k] = static_cast<int>(__ldcg(ids + k));
        for (int i = 1; i < kTopk; ++i)
            for (int j = i; j > 0 and e[j - 1] > e[j]; --j) { const int t = e[j]; e[j] = e[j - 1], e[j - 1] = t; }
        for (int k = 0; k < kTopk; ++k) experts[k] = e[k];
    }
    __syncthreads();
    const uint64_t t_ids = now_ns();
    const int g = static_cast<int>(gridDim.x), c = static_cast<int>(blockIdx.x);
    // L1 units: (expert slot, tile, K-block), K-block fastest; this CTA's contiguous range
    const int units = kTopk * kL1Tiles * kL1Kb;
    int first = mode == 2 ? c * kL1Kb : static_cast<int>(static_cast<int64_t>(units) * c / g);
    int last = mode == 2 ? (c < kTopk * kL1Tiles ? first + kL1Kb : first) : static_cast<int>(static_cast<int64_t>(units) * (c + 1) / g);
    const bool has_l2 = (mode == 0 or mode == 3) and c < kTopk * kL2Tiles;
    uint64_t t_issue = 0;
    if (threadIdx.x == 0) {
        if (has_l2) {
            mb_arrive_tx(l2_bar, kL2TileBytes);
            const int e = experts[c / kL2Tiles], row0 = e * kL2Rows + (c % kL2Tiles) * kL2TileRows;
            for (int kb = 0; kb < kL2Kb; ++kb)
                asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4}], [%2];\n"
                             :: "r"(sa(l2_tile + kb * kL2TileRows * 128)), "l"(reinterpret_cast<uint64_t>(&tm_l2)), "r"(sa(l2_bar)),
                                "r"(kb * 128), "r"(row0) : "memory");
        }
        t_issue = now_ns();
        for (int u = first, it = 0; u < last; ++u, ++it) {
            const int s = it % stages;
            mb_wait(empty + s, ((it / stages) & 1) ^ 1);
            mb_arrive_tx(full + s, kStageBytes);
            const int kb = u % kL1Kb, tile = (u / kL1Kb) % kL1Tiles, e = experts[u / (kL1Kb * kL1Tiles)];
            asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4}], [%2];\n"
                         :: "r"(sa(smem + s * kStageBytes)), "l"(reinterpret_cast<uint64_t>(&tm_l1)), "r"(sa(full + s)),
                            "r"(kb * 128), "r"(e * kL1Rows + tile * kL1TileRows) : "memory");
        }
    } else if (threadIdx.x >= 32) {
        const int lane = threadIdx.x - 32;
        if (lane == 0) {
            for (int u = first, it = 0; u < last; ++u, ++it) {
                const int s = it % stages;
                mb_wait(full + s, (it / stages) & 1);
                if (hold_ns > 0) { const uint64_t t0 = now_ns(); while (now_ns() - t0 < static_cast<uint64_t>(hold_ns)) {} }
                mb_arrive(empty + s);
            }
        }
        __syncwarp();
        if (mode == 3) {
            // Every tile this range touched: its partial, then its part count; the last part sums
            for (int t = first / kL1Kb; t * kL1Kb < last; ++t) {
                const int part = c - cta_of_unit(t * kL1Kb, units, g);
                const int parts = cta_of_unit(t * kL1Kb + kL1Kb - 1, units, g) - cta_of_unit(t * kL1Kb, units, g) + 1;
                for (int r = lane; r < kL1TileRows; r += 32) chain->partial[t][part][r] = 1.0f + part;
                __threadfence();
                __syncwarp();
                unsigned int done = 0;
                if (lane == 0) done = atomicAdd(&chain->tile_parts_done[t], 1u) + 1;
                done = __shfl_sync(0xffffffffu, done, 0);
                if (done == static_cast<unsigned int>(parts)) {
                    __threadfence();   // acquire: the other parts' partials
                    for (int r = lane; r < kL1TileRows; r += 32) {
                        float sum = 0.0f;
                        for (int q = 0; q < parts; ++q) sum += __ldcg(&chain->partial[t][q][r]);
                        chain->h[t][r] = sum;
                    }
                    __threadfence();
                    __syncwarp();
                    if (lane == 0) atomicAdd(&chain->expert_tiles_done[t / kL1Tiles], 1u);
                }
            }
            if (has_l2) {
                if (lane == 0) {
                    mb_wait(l2_bar, 0);
                    const volatile unsigned int* ready = &chain->expert_tiles_done[c / kL2Tiles];
                    while (*ready < static_cast<unsigned int>(kL1Tiles)) {}
                    __threadfence();
                    if (hold_ns > 0) { const uint64_t t0 = now_ns(); while (now_ns() - t0 < static_cast<uint64_t>(hold_ns)) {} }
                }
                __syncwarp();
                // its 128 BF16 outputs (256 bytes), from the expert's L1 outputs as the L2 math would read them
                const float h0 = __ldcg(&chain->h[(c / kL2Tiles) * kL1Tiles][lane]);
                for (int i = lane; i < 64; i += 32) chain->l2_out[c][i] = __float_as_uint(h0);
            }
        } else if (has_l2 and lane == 0) {
            mb_wait(l2_bar, 0);
        }
        if (lane == 0) stamps[c].done = now_ns();
    }
    if (threadIdx.x == 0) stamps[c].start = t_start, stamps[c].ids = t_ids, stamps[c].first_issue = t_issue;
}

int main() {
    int sms = 0;
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
    const size_t l1_bytes = size_t(kExperts) * kL1Rows * kL1K, l2_bytes = size_t(kExperts) * kL2Rows * kL2K;
    void *l1 = nullptr, *l2 = nullptr, *flush = nullptr;
    int64_t* ids = nullptr;
    Stamps* stamps = nullptr;
    Chain* chain = nullptr;
    const size_t flush_bytes = size_t(256) << 20;
    cudaMalloc(&l1, l1_bytes), cudaMalloc(&l2, l2_bytes), cudaMalloc(&flush, flush_bytes);
    cudaMalloc(&ids, kTopk * sizeof(int64_t)), cudaMalloc(&stamps, 256 * sizeof(Stamps)), cudaMalloc(&chain, sizeof(Chain));
    cudaMemset(l1, 0x3c, l1_bytes), cudaMemset(l2, 0x3c, l2_bytes);
    const int64_t host_ids[kTopk] = {97, 3, 64, 12, 120, 45, 7, 88};
    cudaMemcpy(ids, host_ids, sizeof(host_ids), cudaMemcpyHostToDevice);
    const CUtensorMap tm_l1 = make_sw128_map(l1, uint64_t(kExperts) * kL1Rows, kL1K, kL1TileRows);
    const CUtensorMap tm_l2 = make_sw128_map(l2, uint64_t(kExperts) * kL2Rows, kL2K, kL2TileRows);
    const int smem = kMaxStages * kStageBytes + kL2TileBytes + (2 * kMaxStages + 1) * 8;
    cudaFuncSetAttribute(probe, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    cudaEvent_t e0, e1;
    cudaEventCreate(&e0), cudaEventCreate(&e1);
    const double weight_mb = (double(kTopk) * kL1Rows * kL1K + double(kTopk) * kL2Rows * kL2K) / 1e6;
    std::printf("%d SMs; the call's weights %.1f MB (%.1f us at 4.2 TB/s); median of 5 launches after a 256 MB write flush\n",
                sms, weight_mb, weight_mb / 4.2e6 * 1e6);
    std::printf("%-26s %4s %3s %5s %9s %8s %12s %10s %10s\n", "mode", "G", "S", "hold", "event us", "ids us", "1st issue us",
                "p50 done", "last done");
    const char* names[] = {"plan (L1 ranges + L2 tile)", "L1 ranges only", "L1 48 tiles (today)", "plan, whole chain"};
    for (int mode = 0; mode < 4; ++mode)
    for (int stages : {2, 4})
    for (int hold : {0, 400}) {
        const int g = mode == 2 ? kTopk * kL1Tiles : sms;
        std::vector<float> event_us;
        std::vector<double> ids_us, issue_us, p50_us, last_us;
        for (int rep = 0; rep < 5; ++rep) {
            cudaMemsetAsync(chain, 0, sizeof(Chain));
            cudaMemsetAsync(flush, rep, flush_bytes);
            cudaEventRecord(e0);
            probe<<<g, 64, smem>>>(tm_l1, tm_l2, ids, stamps, chain, mode, stages, hold);
            cudaEventRecord(e1);
            cudaEventSynchronize(e1);
            const cudaError_t err = cudaGetLastError();
            if (err != cudaSuccess) { std::printf("error: %s\n", cudaGetErrorString(err)); return 1; }
            float ms = 0;
            cudaEventElapsedTime(&ms, e0, e1);
            event_us.push_back(ms * 1e3f);
            std::vector<Stamps> h(g);
            cudaMemcpy(h.data(), stamps, g * sizeof(Stamps), cudaMemcpyDeviceToHost);
            unsigned long long t0 = ~0ull, first_ids = ~0ull, first_issue = ~0ull;
            std::vector<double> done;
            for (const auto& s : h) t0 = std::min(t0, s.start), first_ids = std::min(first_ids, s.ids), first_issue = std::min(first_issue, s.first_issue);
            for (const auto& s : h) done.push_back((s.done - t0) * 1e-3);
            std::sort(done.begin(), done.end());
            ids_us.push_back((first_ids - t0) * 1e-3), issue_us.push_back((first_issue - t0) * 1e-3);
            p50_us.push_back(done[done.size() / 2]), last_us.push_back(done.back());
        }
        auto median = [](auto v) { std::sort(v.begin(), v.end()); return v[v.size() / 2]; };
        std::printf("%-26s %4d %3d %5d %9.1f %8.2f %12.2f %10.2f %10.2f\n", names[mode], g, stages, hold, median(event_us),
                    median(ids_us), median(issue_us), median(p50_us), median(last_us));
    }
    return 0;
}
