// Helpers shared by the standalone probes (tma_stream_probe.cu, fp4_stream_probe.cu, math_warps_probe.cu,
// prefill_operand_probe.cu), which build with nvcc alone, without the package's runtime (the operand probe adds
// the package's and CuTe's include paths for its wgmma atoms): mbarriers, bulk copies, 128B-swizzled tensor
// maps, the clock, and the best of three timed launches.
#pragma once
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cuda.h>
#include <cuda_runtime.h>

__device__ __forceinline__ uint32_t sa(const void* p) { return static_cast<uint32_t>(__cvta_generic_to_shared(p)); }
__device__ __forceinline__ void mb_init(uint64_t* b, uint32_t n) { asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" :: "r"(sa(b)), "r"(n)); }
__device__ __forceinline__ void mb_arrive(uint64_t* b) { asm volatile("{\n .reg .b64 st;\n mbarrier.arrive.shared::cta.b64 st, [%0];\n}\n" :: "r"(sa(b)) : "memory"); }
__device__ __forceinline__ void mb_arrive_tx(uint64_t* b, uint32_t bytes) {
    asm volatile("{\n .reg .b64 st;\n mbarrier.arrive.expect_tx.shared::cta.b64 st, [%0], %1;\n}\n" :: "r"(sa(b)), "r"(bytes) : "memory");
}
// A 1-D bulk copy global -> shared memory that completes its bytes on mbarrier `bar`
__device__ __forceinline__ void bulk_g2s(uint32_t dst, const void* src, uint32_t bytes, uint64_t* bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n"
                 :: "r"(dst), "l"(reinterpret_cast<uint64_t>(src)), "r"(bytes), "r"(sa(bar)) : "memory");
}
__device__ __forceinline__ uint64_t now_ns() { uint64_t t; asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t)); return t; }
// kCluster: acquire at cluster scope (arrivals from other CTAs of the cluster order their reads of
// the stage before the waiter's next writes into it)
template <bool kCluster = false>
__device__ __forceinline__ void mb_wait(uint64_t* b, uint32_t parity) {
    uint32_t done = 0;
    while (!done) {
        if constexpr (kCluster)
            asm volatile("{\n .reg .pred p;\n mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}\n"
                         : "=r"(done) : "r"(sa(b)), "r"(parity) : "memory");
        else
            asm volatile("{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}\n"
                         : "=r"(done) : "r"(sa(b)), "r"(parity) : "memory");
    }
}

// Milliseconds of the fastest of three runs of launch() (events e0, e1 around each)
template <typename Launch>
float best_of_3_ms(cudaEvent_t e0, cudaEvent_t e1, Launch&& launch) {
    float best = 1e30f;
    for (int rep = 0; rep < 3; ++rep) {
        cudaEventRecord(e0);
        launch();
        cudaEventRecord(e1);
        cudaEventSynchronize(e1);
        float ms = 0;
        cudaEventElapsedTime(&ms, e0, e1);
        if (ms < best) best = ms;
    }
    return best;
}

// A 2-D uint8 tensor map of `rows` rows of `row_bytes`, boxes of 128 bytes x `box_rows` rows, 128B-swizzled
// (the kernel's tiles), through the driver entry point (no -lcuda)
inline CUtensorMap make_sw128_map(void* base, uint64_t rows, uint64_t row_bytes, uint32_t box_rows) {
    using Encode = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*, const cuuint64_t*,
                                const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave, CUtensorMapSwizzle,
                                CUtensorMapL2promotion, CUtensorMapFloatOOBfill);
    static Encode encode = nullptr;
    if (encode == nullptr) {
        cudaDriverEntryPointQueryResult q;
        cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", reinterpret_cast<void**>(&encode), 12000, cudaEnableDefault, &q);
        if (encode == nullptr) { std::printf("no cuTensorMapEncodeTiled\n"); std::exit(1); }
    }
    CUtensorMap m;
    const cuuint64_t dims[2] = {row_bytes, rows};
    const cuuint64_t strides[1] = {row_bytes};
    const cuuint32_t box[2] = {128, box_rows};
    const cuuint32_t elem_strides[2] = {1, 1};
    const CUresult r = encode(&m, CU_TENSOR_MAP_DATA_TYPE_UINT8, 2, base, dims, strides, box, elem_strides,
                                              CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                                              CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    if (r != CUDA_SUCCESS) { std::printf("cuTensorMapEncodeTiled failed: %d\n", static_cast<int>(r)); std::exit(1); }
    return m;
}
