#pragma once

// TMA descriptors (CUtensorMap) for the kernels' bulk tensor copies.
//
// cuTensorMapEncodeTiled answers a bad argument with a bare CUDA_ERROR_INVALID_VALUE. Every rule
// it enforces that a caller can get wrong is checked here first, on the host and before the
// driver is touched (so the checks also run, and are tested, on machines without a GPU), with a
// message naming the argument and the value expected.
//
// Dimension order is the driver's: dimension 0 is the innermost (contiguous) one. For a
// row-major [rows, cols] tensor: inner_dim = cols, outer_dim = rows, outer_stride_bytes =
// row pitch in bytes.

#include <array>
#include <cstdint>
#include <string>

#include "driver.hpp"

namespace deep_gemm::jit {

// Bytes of one element; the packed sub-byte types are SM100-only and rejected (FP4 weights on
// SM90 travel as uint8 pairs).
inline uint32_t tma_element_bytes(CUtensorMapDataType dtype) {
    switch (dtype) {
        case CU_TENSOR_MAP_DATA_TYPE_UINT8: return 1;
        case CU_TENSOR_MAP_DATA_TYPE_UINT16:
        case CU_TENSOR_MAP_DATA_TYPE_FLOAT16:
        case CU_TENSOR_MAP_DATA_TYPE_BFLOAT16: return 2;
        case CU_TENSOR_MAP_DATA_TYPE_UINT32:
        case CU_TENSOR_MAP_DATA_TYPE_INT32:
        case CU_TENSOR_MAP_DATA_TYPE_FLOAT32:
        case CU_TENSOR_MAP_DATA_TYPE_FLOAT32_FTZ:
        case CU_TENSOR_MAP_DATA_TYPE_TFLOAT32:
        case CU_TENSOR_MAP_DATA_TYPE_TFLOAT32_FTZ: return 4;
        case CU_TENSOR_MAP_DATA_TYPE_UINT64:
        case CU_TENSOR_MAP_DATA_TYPE_INT64:
        case CU_TENSOR_MAP_DATA_TYPE_FLOAT64: return 8;
        default:
            raise_invalid_argument("dtype: CUtensorMapDataType ", static_cast<int>(dtype),
                                   " is not supported on SM90 (use UINT8 for packed FP4/FP8 bytes)");
    }
}

// The span (bytes) within which a swizzle mode permutes 16-byte chunks; 0 for no swizzle. The
// inner box must fit in it. The 128B_ATOM_* modes are SM100-only and rejected.
inline uint32_t tma_swizzle_span_bytes(CUtensorMapSwizzle swizzle) {
    switch (swizzle) {
        case CU_TENSOR_MAP_SWIZZLE_NONE: return 0;
        case CU_TENSOR_MAP_SWIZZLE_32B: return 32;
        case CU_TENSOR_MAP_SWIZZLE_64B: return 64;
        case CU_TENSOR_MAP_SWIZZLE_128B: return 128;
        default:
            raise_invalid_argument("swizzle: CUtensorMapSwizzle ", static_cast<int>(swizzle),
                                   " is not supported on SM90 (use NONE, 32B, 64B or 128B)");
    }
}

// One dimension of a tiled tensor map, with the argument names used in error messages.
struct TmaDim {
    uint64_t size;              // elements
    uint32_t box;               // elements per copy
    uint64_t stride_bytes;      // distance between consecutive indices; ignored for dimension 0
    const char* size_name;
    const char* box_name;
    const char* stride_name;
};

template <size_t kRank>
CUtensorMap make_tma(void* ptr, CUtensorMapDataType dtype, const std::array<TmaDim, kRank>& dims, CUtensorMapSwizzle swizzle,
                     CUtensorMapL2promotion l2_promotion = CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                     CUtensorMapFloatOOBfill oob_fill = CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) {
    static_assert(kRank >= 1 and kRank <= 5, "TMA tensors have 1 to 5 dimensions");
    const uint32_t element_bytes = tma_element_bytes(dtype);
    const uint32_t swizzle_span = tma_swizzle_span_bytes(swizzle);
    const auto address = reinterpret_cast<uintptr_t>(ptr);

    if (ptr == nullptr or address % 16 != 0)
        raise_invalid_argument("ptr: a TMA global address must be non-null and 16-byte aligned, got 0x", std::hex, address);
    for (size_t i = 0; i < kRank; ++i) {
        const TmaDim& dim = dims[i];
        if (dim.size == 0 or dim.size > (uint64_t(1) << 32))
            raise_invalid_argument(dim.size_name, " must be in [1, 2^32], got ", dim.size);
        if (dim.box == 0 or dim.box > 256)
            raise_invalid_argument(dim.box_name, " must be in [1, 256] (a TMA box limit), got ", dim.box);
        if (i == 0)
            continue;
        // Each stride covers at least the extent of the dimension inside it, else rows overlap
        const uint64_t inner_extent = i == 1 ? dims[0].size * element_bytes : dims[i - 1].stride_bytes * dims[i - 1].size;
        if (dim.stride_bytes % 16 != 0 or dim.stride_bytes >= (uint64_t(1) << 40))
            raise_invalid_argument(dim.stride_name, " must be a multiple of 16 below 2^40, got ", dim.stride_bytes);
        if (dim.stride_bytes < inner_extent)
            raise_invalid_argument(dim.stride_name, " = ", dim.stride_bytes, " is smaller than the ", inner_extent,
                                   " bytes of the dimension inside it (", i == 1 ? dims[0].size_name : dims[i - 1].size_name,
                                   "): rows would overlap");
    }
    const uint64_t inner_box_bytes = uint64_t(dims[0].box) * element_bytes;
    if (inner_box_bytes % 16 != 0)
        raise_invalid_argument(dims[0].box_name, " * element size = ", inner_box_bytes, " bytes must be a multiple of 16");
    if (swizzle_span != 0 and inner_box_bytes > swizzle_span)
        raise_invalid_argument(dims[0].box_name, " * element size = ", inner_box_bytes, " bytes exceeds the ", swizzle_span,
                               "-byte swizzle span: use a smaller ", dims[0].box_name, " or a wider swizzle");
    const bool is_integer = dtype == CU_TENSOR_MAP_DATA_TYPE_UINT8 or dtype == CU_TENSOR_MAP_DATA_TYPE_UINT16 or
                            dtype == CU_TENSOR_MAP_DATA_TYPE_UINT32 or dtype == CU_TENSOR_MAP_DATA_TYPE_INT32 or
                            dtype == CU_TENSOR_MAP_DATA_TYPE_UINT64 or dtype == CU_TENSOR_MAP_DATA_TYPE_INT64;
    if (oob_fill != CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE and is_integer)
        raise_invalid_argument("oob_fill: a NaN fill needs a floating-point dtype, got an integer one");

    cuuint64_t global_dims[kRank], global_strides[kRank > 1 ? kRank - 1 : 1];
    cuuint32_t box_dims[kRank], element_strides[kRank];
    for (size_t i = 0; i < kRank; ++i) {
        global_dims[i] = dims[i].size;
        box_dims[i] = dims[i].box;
        element_strides[i] = 1;
        if (i > 0)
            global_strides[i - 1] = dims[i].stride_bytes;
    }

    // The driver reads and writes the map through a 64-byte-aligned pointer (its documented
    // requirement); CUtensorMap is declared alignas(64), so a local one satisfies it.
    CUtensorMap map;
    const auto& d = driver();
    const CUresult result = d.cuTensorMapEncodeTiled(&map, dtype, kRank, ptr, global_dims, global_strides, box_dims,
                                                     element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle, l2_promotion, oob_fill);
    if (result != CUDA_SUCCESS) {
        std::string context = "dtype " + std::to_string(static_cast<int>(dtype)) + ", swizzle " +
                              std::to_string(static_cast<int>(swizzle));
        for (size_t i = 0; i < kRank; ++i)
            context += std::string(", ") + dims[i].size_name + " " + std::to_string(dims[i].size) + " box " +
                       std::to_string(dims[i].box) + (i > 0 ? " stride " + std::to_string(dims[i].stride_bytes) + " B" : "");
        d.check(result, "cuTensorMapEncodeTiled", context);
    }
    return map;
}

// A 2D map over [outer_dim, inner_dim] (row-major, row pitch `outer_stride_bytes`), copied in
// boxes of [outer_box, inner_box].
inline CUtensorMap make_tma_2d(void* ptr, CUtensorMapDataType dtype, uint64_t inner_dim, uint64_t outer_dim, uint32_t inner_box,
                               uint32_t outer_box, uint64_t outer_stride_bytes, CUtensorMapSwizzle swizzle,
                               CUtensorMapL2promotion l2_promotion = CU_TENSOR_MAP_L2_PROMOTION_L2_256B) {
    return make_tma<2>(ptr, dtype,
                       {{{inner_dim, inner_box, 0, "inner_dim", "inner_box", "(unused)"},
                         {outer_dim, outer_box, outer_stride_bytes, "outer_dim", "outer_box", "outer_stride_bytes"}}},
                       swizzle, l2_promotion);
}

// A 3D map over [outer_dim, middle_dim, inner_dim], e.g. per-expert weights [E, N, K] with
// inner = K, middle = N, outer = E.
inline CUtensorMap make_tma_3d(void* ptr, CUtensorMapDataType dtype, uint64_t inner_dim, uint64_t middle_dim, uint64_t outer_dim,
                               uint32_t inner_box, uint32_t middle_box, uint32_t outer_box, uint64_t middle_stride_bytes,
                               uint64_t outer_stride_bytes, CUtensorMapSwizzle swizzle,
                               CUtensorMapL2promotion l2_promotion = CU_TENSOR_MAP_L2_PROMOTION_L2_256B) {
    return make_tma<3>(ptr, dtype,
                       {{{inner_dim, inner_box, 0, "inner_dim", "inner_box", "(unused)"},
                         {middle_dim, middle_box, middle_stride_bytes, "middle_dim", "middle_box", "middle_stride_bytes"},
                         {outer_dim, outer_box, outer_stride_bytes, "outer_dim", "outer_box", "outer_stride_bytes"}}},
                       swizzle, l2_promotion);
}

}  // namespace deep_gemm::jit
