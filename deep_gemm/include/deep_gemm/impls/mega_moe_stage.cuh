#pragma once

// Stage one rank's inputs into its symmetric buffer in one launch: BF16 x -> E4M3 + FP32 scale
// per token per 128 (FP8 formats; the same formula, bit for bit, as
// deep_gemm.utils.per_token_cast_to_fp8 and the kernel's L1 epilogue) or a BF16 copy, plus the
// routing (topk_idx, topk_weights). Grid-stride over tokens; one warp per 128-channel group.

#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include "../ptx/sm90.cuh"
#include "mega_moe_params.cuh"

namespace deep_gemm::mega_moe_stage {

constexpr int kNumThreads = 256;
constexpr int kNumWarps = kNumThreads / 32;

template <bool kFP8>
__device__ __forceinline__ void stage(const MegaMoEStageParams& p) {
    // The Mega MoE kernel that follows (a programmatic dependent) may start its setup on the SMs this
    // small grid leaves free; it waits for this grid's writes before it reads any of them
    if (threadIdx.x == 0) ptx::griddepcontrol_launch_dependents();
    // Itself launched the same way: the buffer's inputs may still be read by the previous call's kernel,
    // and x by the kernel that produced it, until they complete
    ptx::griddepcontrol_wait();
    const auto& lay = p.layout;
    const int hidden = lay.hidden, topk = lay.num_topk;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    auto* x_out = lay.get_ptr<uint8_t>(p.buffer, lay.x);
    auto* idx_out = lay.get_ptr<int64_t>(p.buffer, lay.topk_idx);
    auto* w_out = lay.get_ptr<float>(p.buffer, lay.topk_weights);
    for (int t = blockIdx.x; t < p.num_tokens; t += gridDim.x) {
        const auto* row = static_cast<const __nv_bfloat16*>(p.x) + t * p.x_row_stride;
        for (int k = threadIdx.x; k < topk; k += kNumThreads) {
            idx_out[static_cast<int64_t>(t) * topk + k] = p.topk_idx[static_cast<int64_t>(t) * topk + k];
            w_out[static_cast<int64_t>(t) * topk + k] = p.topk_weights[static_cast<int64_t>(t) * topk + k];
        }
        if constexpr (kFP8) {
            auto* sf_out = lay.get_ptr<float>(p.buffer, lay.x_sf) + static_cast<int64_t>(t) * (hidden / kScaleGranularity);
            // Each lane holds 4 of a group's 128 channels (8 bytes of BF16)
            for (int g = warp; g < hidden / kScaleGranularity; g += kNumWarps) {
                const uint2 raw = *reinterpret_cast<const uint2*>(row + g * kScaleGranularity + lane * 4);
                const float2 a = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&raw.x));
                const float2 b = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&raw.y));
                float amax = fmaxf(fmaxf(fabsf(a.x), fabsf(a.y)), fmaxf(fabsf(b.x), fabsf(b.y)));
                #pragma unroll
                for (int d = 16; d > 0; d /= 2) amax = fmaxf(amax, __shfl_xor_sync(0xffffffff, amax, d));
                amax = fmaxf(amax, 1e-10f);
                const float inv = __fdiv_rn(448.0f, amax);
                const __nv_fp8x2_storage_t lo = __nv_cvt_float2_to_fp8x2(make_float2(a.x * inv, a.y * inv), __NV_SATFINITE, __NV_E4M3);
                const __nv_fp8x2_storage_t hi = __nv_cvt_float2_to_fp8x2(make_float2(b.x * inv, b.y * inv), __NV_SATFINITE, __NV_E4M3);
                *reinterpret_cast<uint32_t*>(x_out + static_cast<int64_t>(t) * hidden + g * kScaleGranularity + lane * 4) =
                    static_cast<uint32_t>(lo) | (static_cast<uint32_t>(hi) << 16);
                if (lane == 0) sf_out[g] = __fdiv_rn(amax, 448.0f);
            }
        } else {
            auto* out = reinterpret_cast<int4*>(x_out + static_cast<int64_t>(t) * hidden * 2);
            const auto* in = reinterpret_cast<const int4*>(row);
            for (int c = threadIdx.x; c < hidden / 8; c += kNumThreads) out[c] = in[c];
        }
    }
}

}  // namespace deep_gemm::mega_moe_stage

#define DG_DEFINE_MEGA_MOE_STAGE_KERNEL(NAME, FP8)                                                     \
    extern "C" __global__ void __launch_bounds__(deep_gemm::mega_moe_stage::kNumThreads, 1)           \
    NAME(const __grid_constant__ deep_gemm::MegaMoEStageParams params) {                             \
        deep_gemm::mega_moe_stage::stage<FP8>(params);                                                \
    }
