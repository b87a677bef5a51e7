// What does compute-sanitizer racecheck report for two correct synchronization patterns the Mega
// MoE kernel uses? Both kernels below are race-free by construction, so a hazard they report is
// about the tool's model, not about the kernel (scripts/device_run.sh runs this after the kernel's
// own racecheck).
//   exchange: warpgroup 1 writes shared memory, both meet at bar.sync 4, 256, warpgroup 0 reads
//   bulk:     one producer thread fills a 2-stage ring with cp.async.bulk (complete_tx on a full
//             mbarrier); 128 consumer threads wait, read with ld.shared, release through an empty
//             mbarrier (one arrival per warp after __syncwarp)
//   cpasync:  the same ring filled with 4-byte cp.async whose completion the full mbarrier tracks
//             (cp.async.mbarrier.arrive, count-neutral), as the kernel brings a stage's weight scales
//   nvcc -arch=sm_90a -o /tmp/probe scripts/racecheck_probe.cu
//   compute-sanitizer --tool racecheck /tmp/probe exchange | bulk | cpasync
#include <cstdint>
#include <cstdio>
#include <cstring>

__device__ __forceinline__ void bar(int id, int n) { asm volatile("bar.sync %0, %1;\n" :: "r"(id), "r"(n) : "memory"); }
__device__ __forceinline__ uint32_t sa(const void* p) { return static_cast<uint32_t>(__cvta_generic_to_shared(p)); }
__device__ __forceinline__ void wait_parity(uint64_t* b, uint32_t parity) {
    uint32_t done = 0;
    while (!done)
        asm volatile("{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}\n"
                     : "=r"(done) : "r"(sa(b)), "r"(parity) : "memory");
}

__global__ void exchange(float* out) {
    __shared__ float xchg[32 * 128];
    const int wg = threadIdx.x / 128 - 1, tid = threadIdx.x % 128;   // warpgroup 0 of 3 does not take part
    if (wg < 0) return;
    float sum = 0.0f;
    for (int it = 0; it < 4; ++it) {
        for (int pass = 0; pass < 2; ++pass) {
            if (wg == 1)
                for (int i = 0; i < 32; ++i) xchg[i * 128 + tid] = static_cast<float>(it * 64 + pass * 32 + i + tid);
            bar(4, 256);
            if (wg == 0)
                for (int i = 0; i < 32; ++i) sum += xchg[i * 128 + tid];
            bar(4, 256);
        }
    }
    if (wg == 0) out[tid] = sum;
}

template <bool kCpAsync>
__global__ void bulk(const float* src, float* out) {
    __shared__ alignas(128) float stage[2][64];
    __shared__ alignas(8) uint64_t full[2], empty[2];
    if (threadIdx.x == 0) {
        for (int s = 0; s < 2; ++s) {
            asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;\n" :: "r"(sa(&full[s])) : "memory");
            asm volatile("mbarrier.init.shared::cta.b64 [%0], 4;\n" :: "r"(sa(&empty[s])) : "memory");
        }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();
    constexpr int kIters = 8;
    if (threadIdx.x == 0) {                       // producer
        for (int it = 0; it < kIters; ++it) {
            const int s = it % 2;
            wait_parity(&empty[s], ((it / 2) & 1) ^ 1);
            if constexpr (kCpAsync) {
                for (int i = 0; i < 64; ++i)
                    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" :: "r"(sa(&stage[s][i])), "l"(src + it * 64 + i) : "memory");
                asm volatile("cp.async.mbarrier.arrive.shared::cta.b64 [%0];\n" :: "r"(sa(&full[s])) : "memory");
                asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" :: "r"(sa(&full[s])) : "memory");
            } else {
                asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" :: "r"(sa(&full[s])), "r"(256) : "memory");
                asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], 256, [%2];\n"
                             :: "r"(sa(stage[s])), "l"(src + it * 64), "r"(sa(&full[s])) : "memory");
            }
        }
    } else if (threadIdx.x >= 128) {              // consumers
        const int tid = threadIdx.x - 128;
        float sum = 0.0f;
        for (int it = 0; it < kIters; ++it) {
            const int s = it % 2;
            wait_parity(&full[s], (it / 2) & 1);
            sum += stage[s][tid % 64];
            __syncwarp();
            if (tid % 32 == 0) asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" :: "r"(sa(&empty[s])) : "memory");
        }
        out[tid] = sum;
    }
}

int main(int argc, char** argv) {
    const char* probe = argc > 1 ? argv[1] : "exchange";
    float *src, *out;
    cudaMalloc(&src, 8 * 64 * sizeof(float));
    cudaMalloc(&out, 128 * sizeof(float));
    cudaMemset(src, 0, 8 * 64 * sizeof(float));
    if (std::strcmp(probe, "bulk") == 0) bulk<false><<<1, 256>>>(src, out);
    else if (std::strcmp(probe, "cpasync") == 0) bulk<true><<<1, 256>>>(src, out);
    else exchange<<<1, 384>>>(out);
    const cudaError_t e = cudaDeviceSynchronize();
    std::printf("probe %s: %s\n", probe, cudaGetErrorString(e));
    return e == cudaSuccess ? 0 : 1;
}
