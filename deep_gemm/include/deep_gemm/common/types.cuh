#pragma once

// Shared by host C++ (csrc/) and device code (JIT kernels): keep it free of CUDA-only constructs
// outside the DG_HOST_DEVICE / DG_DEVICE_ONLY guards.

#include <cstdint>

#if defined(__CUDACC__)
#define DG_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define DG_HOST_DEVICE inline
#endif

namespace deep_gemm {

// Weight/activation format of one Mega MoE call. Numeric values are part of the Python API
// (`deep_gemm._C.MmaType`) and of the generated kernel source: never renumber.
enum class MmaType : int {
    kFP8xFP4 = 0,    // x: E4M3 + FP32 per-128 scales; weights: MXFP4 (E2M1 + UE8M0 per 32)
    kFP8xFP8 = 1,    // x: E4M3 + FP32 per-128 scales; weights: E4M3 + FP32 per 128x128 block
    kBF16xBF16 = 2,  // everything BF16
};

DG_HOST_DEVICE constexpr bool is_fp8_activation(MmaType t) { return t != MmaType::kBF16xBF16; }
// Bytes of one activation element (x, L1 pool, L2 pool)
DG_HOST_DEVICE constexpr int activation_bytes(MmaType t) { return is_fp8_activation(t) ? 1 : 2; }

// Largest expert-parallel group one kernel supports (one NVLink node)
constexpr int kMaxRanks = 8;
// Activation scale granularity along hidden/intermediate (FP8 formats)
constexpr int kScaleGranularity = 128;

template <typename T>
DG_HOST_DEVICE constexpr T ceil_div(T a, T b) { return (a + b - 1) / b; }

template <typename T>
DG_HOST_DEVICE constexpr T align_up(T a, T b) { return ceil_div(a, b) * b; }

template <typename T>
DG_HOST_DEVICE constexpr T min_of(T a, T b) { return a < b ? a : b; }

template <typename T>
DG_HOST_DEVICE constexpr T max_of(T a, T b) { return a > b ? a : b; }

}  // namespace deep_gemm
