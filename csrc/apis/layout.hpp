#pragma once

// Python bindings of the symmetric-buffer layout (`deep_gemm/layout/mega_moe.cuh`).
//
// Every host path that builds a `MegaMoELayout` goes through `make_mega_moe_layout`, which checks
// the header's preconditions first: the header itself trusts its arguments (it also runs on the
// device), so this is the one place where a bad shape becomes a Python error instead of a wrong
// offset.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>

#include <pybind11/pybind11.h>

#include <deep_gemm/common/types.cuh>
#include <deep_gemm/impls/mega_moe_params.cuh>
#include <deep_gemm/layout/mega_moe.cuh>

namespace deep_gemm::apis::layout {

using deep_gemm::layout::MegaMoELayout;
using deep_gemm::layout::Section;
namespace buffer_layout = deep_gemm::layout;  // `layout` alone names this namespace here

// Every section of the layout, in buffer order, with the name the Python side sees.
// Adding a section to the header without listing it here fails the `test_layout` coverage test.
inline constexpr std::pair<const char*, Section MegaMoELayout::*> kSections[] = {
    {"status", &MegaMoELayout::status},
    {"control", &MegaMoELayout::control},
    {"recv_count", &MegaMoELayout::recv_count},
    {"combine_ready", &MegaMoELayout::combine_ready},
    {"send_count", &MegaMoELayout::send_count},
    {"src_index", &MegaMoELayout::src_index},
    {"mblock_arrival", &MegaMoELayout::mblock_arrival},
    {"mblock_l1_done", &MegaMoELayout::mblock_l1_done},
    {"row_info", &MegaMoELayout::row_info},
    {"row_weight", &MegaMoELayout::row_weight},
    {"split_count", &MegaMoELayout::split_count},
    {"split_partials", &MegaMoELayout::split_partials},
    {"ws_count", &MegaMoELayout::ws_count},
    {"x", &MegaMoELayout::x},
    {"x_sf", &MegaMoELayout::x_sf},
    {"topk_idx", &MegaMoELayout::topk_idx},
    {"topk_weights", &MegaMoELayout::topk_weights},
    {"l1_act", &MegaMoELayout::l1_act},
    {"l1_sf", &MegaMoELayout::l1_sf},
    {"l2_act", &MegaMoELayout::l2_act},
    {"l2_sf", &MegaMoELayout::l2_sf},
    {"combine", &MegaMoELayout::combine},
};
inline constexpr int kNumSections = static_cast<int>(sizeof(kSections) / sizeof(kSections[0]));

[[noreturn]] inline void throw_invalid(const std::string& name, long long value, const std::string& expected) {
    std::ostringstream os;
    os << "Mega MoE buffer: " << name << " = " << value << " is invalid: expected " << expected;
    throw std::invalid_argument(os.str());
}

// Maps the integer of `deep_gemm._C` calls to the enum, rejecting anything else.
inline MmaType check_mma_type(int mma_type) {
    if (mma_type < static_cast<int>(MmaType::kFP8xFP4) or mma_type > static_cast<int>(MmaType::kBF16xBF16))
        throw_invalid("mma_type", mma_type, "0 (fp8xfp4), 1 (fp8xfp8) or 2 (bf16xbf16)");
    return static_cast<MmaType>(mma_type);
}

// Checks the header's preconditions and that every offset fits its integer type, then builds the
// layout. Raises `std::invalid_argument` (Python `ValueError`) naming the first bad argument.
inline MegaMoELayout make_mega_moe_layout(int num_ranks, int num_experts, int num_max_tokens_per_rank, int num_topk,
                                          int hidden, int intermediate_hidden, int mma_type) {
    if (num_ranks < 1 or num_ranks > kMaxRanks)
        throw_invalid("num_ranks", num_ranks, "1 <= num_ranks <= " + std::to_string(kMaxRanks) + " (one NVLink node)");
    if (num_experts <= 0)
        throw_invalid("num_experts", num_experts, "a positive number");
    if (num_experts % num_ranks != 0)
        throw_invalid("num_experts", num_experts, "a multiple of num_ranks = " + std::to_string(num_ranks));
    if (num_max_tokens_per_rank <= 0)
        throw_invalid("num_max_tokens_per_rank", num_max_tokens_per_rank, "a positive number");
    if (num_topk <= 0)
        throw_invalid("num_topk", num_topk, "a positive number");
    if (num_topk > num_experts)
        throw_invalid("num_topk", num_topk, "at most num_experts = " + std::to_string(num_experts));
    if (hidden <= 0 or hidden % kScaleGranularity != 0)
        throw_invalid("hidden", hidden, "a positive multiple of " + std::to_string(kScaleGranularity));
    if (intermediate_hidden <= 0 or intermediate_hidden % kScaleGranularity != 0)
        throw_invalid("intermediate_hidden", intermediate_hidden, "a positive multiple of " + std::to_string(kScaleGranularity));
    const MmaType type = check_mma_type(mma_type);
    // FP8 activations: the kernel keeps a task's weight block scales (one per K-block) in shared
    // memory and a pulled row's scales in registers
    constexpr int kMaxK = kMegaMoEMaxKBlocks * kScaleGranularity;
    if (is_fp8_activation(type) and hidden > kMaxK)
        throw_invalid("hidden", hidden, "at most " + std::to_string(kMaxK) + " with FP8 activations");
    if (is_fp8_activation(type) and intermediate_hidden > kMaxK)
        throw_invalid("intermediate_hidden", intermediate_hidden, "at most " + std::to_string(kMaxK) + " with FP8 activations");
    // The kernel keeps per-local-expert tables in shared memory and encodes (rank, token, slot) of a
    // pool row in an int32
    if (num_experts / num_ranks > kMegaMoEMaxLocalExperts)
        throw_invalid("num_experts", num_experts, "at most " + std::to_string(kMegaMoEMaxLocalExperts) +
                      " local experts per rank (num_experts / num_ranks)");
    // ... and a pulled row's (source rank, token slot) in a uint32 of shared memory
    if (static_cast<int64_t>(num_max_tokens_per_rank) * num_topk >= (int64_t(1) << kPullTokenBits))
        throw_invalid("num_max_tokens_per_rank", num_max_tokens_per_rank,
                      "num_max_tokens_per_rank * num_topk < 2^" + std::to_string(kPullTokenBits));
    if (static_cast<int64_t>(num_ranks) * num_max_tokens_per_rank * num_topk >= (int64_t(1) << 31))
        throw_invalid("num_max_tokens_per_rank", num_max_tokens_per_rank,
                      "num_ranks * num_max_tokens_per_rank * num_topk < 2^31");

    // The header computes in int64 without overflow checks. Bound every product it forms from above
    // in floating point (each partial product is at most the total, so bounding the total is enough);
    // the margin of 2^62 absorbs rounding and section alignment.
    const int num_local_experts = num_experts / num_ranks;
    const long double r = num_ranks, e = num_local_experts, n = num_max_tokens_per_rank, k = num_topk;
    const long double h = hidden, i = intermediate_hidden;
    const long double rows_bound = r * n * std::min(k, e) + e * buffer_layout::kMaxBlockM + buffer_layout::kMaxBlockM;
    if (rows_bound > static_cast<long double>(std::numeric_limits<int32_t>::max())) {
        std::ostringstream os;
        os << "Mega MoE buffer: the pools would need about " << static_cast<double>(rows_bound)
           << " rows (num_ranks * num_max_tokens_per_rank * min(num_topk, num_local_experts) plus padding), "
           << "more than int32 can index: reduce num_max_tokens_per_rank = " << num_max_tokens_per_rank;
        throw std::invalid_argument(os.str());
    }
    const long double bytes_bound =
        rows_bound * (16.0L + 2.0L * (h + i) + 4.0L * (h + i) / kScaleGranularity) +  // pools, per-row info
        n * (2.0L * h + 4.0L * h / kScaleGranularity + 12.0L * k + 2.0L * k * h) +     // inputs, combine
        e * r * n * 4.0L + e * r * 8.0L + r * 8.0L + 64.0L * buffer_layout::kSectionAlignment;  // workspace
    if (bytes_bound > std::ldexp(1.0L, 62)) {
        std::ostringstream os;
        os << "Mega MoE buffer: the layout would take about " << static_cast<double>(bytes_bound)
           << " bytes, more than int64 offsets allow: reduce num_max_tokens_per_rank = " << num_max_tokens_per_rank
           << " or hidden = " << hidden;
        throw std::invalid_argument(os.str());
    }

    const MegaMoELayout result(num_ranks, num_experts, num_max_tokens_per_rank, num_topk, hidden, intermediate_hidden, type);
    // Exact post-conditions (the bounds above make these unreachable unless the header changes)
    if (result.num_pool_rows <= 0 or result.num_max_mblocks <= 0 or result.num_bytes <= 0)
        throw std::logic_error("Mega MoE buffer: layout overflowed although its bounds passed (layout header changed?)");
    return result;
}

inline pybind11::dict layout_to_dict(const MegaMoELayout& l) {
    pybind11::dict d;
    for (const auto& [name, member] : kSections) {
        const Section& s = l.*member;
        d[name] = pybind11::make_tuple(s.offset, s.num_bytes);
    }
    d["num_bytes"] = l.num_bytes;
    d["num_workspace_bytes"] = l.num_workspace_bytes;
    d["num_pool_rows"] = l.num_pool_rows;
    d["num_max_mblocks"] = l.num_max_mblocks;
    d["num_local_experts"] = l.num_local_experts;
    return d;
}

inline void register_apis(pybind11::module_& m) {
    namespace py = pybind11;
    m.def("get_mega_moe_layout",
          [](int num_ranks, int num_experts, int num_max_tokens_per_rank, int num_topk, int hidden,
             int intermediate_hidden, int mma_type) {
              return layout_to_dict(make_mega_moe_layout(num_ranks, num_experts, num_max_tokens_per_rank, num_topk,
                                                         hidden, intermediate_hidden, mma_type));
          },
          py::arg("num_ranks"), py::arg("num_experts"), py::arg("num_max_tokens_per_rank"), py::arg("num_topk"),
          py::arg("hidden"), py::arg("intermediate_hidden"), py::arg("mma_type"),
          "Symmetric-buffer layout of one Mega MoE rank.\n\n"
          "Returns a dict: section name -> (offset, num_bytes) for every section (status, control, recv_count,\n"
          "combine_ready, send_count, src_index, mblock_arrival, mblock_l1_done, row_info, row_weight, split_count,\n"
          "split_partials, ws_count, x, x_sf, topk_idx,\n"
          "topk_weights, l1_act, l1_sf, l2_act, l2_sf, combine), plus num_bytes, num_workspace_bytes,\n"
          "num_pool_rows, num_max_mblocks and num_local_experts. mma_type: 0 fp8xfp4, 1 fp8xfp8, 2 bf16xbf16.\n"
          "Raises ValueError naming the first invalid argument.");
    m.def("get_symm_buffer_size_for_mega_moe",
          [](int num_ranks, int num_experts, int num_max_tokens_per_rank, int num_topk, int hidden,
             int intermediate_hidden, int mma_type) {
              return make_mega_moe_layout(num_ranks, num_experts, num_max_tokens_per_rank, num_topk, hidden,
                                          intermediate_hidden, mma_type).num_bytes;
          },
          py::arg("num_ranks"), py::arg("num_experts"), py::arg("num_max_tokens_per_rank"), py::arg("num_topk"),
          py::arg("hidden"), py::arg("intermediate_hidden"), py::arg("mma_type"),
          "Bytes of one rank's Mega MoE symmetric buffer (same arguments as get_mega_moe_layout).");
    m.attr("kMaxRanks") = kMaxRanks;
    // The status words' slots and codes, so that deep_gemm/mega/status.py decodes what the kernel wrote
    m.attr("kStatusError") = buffer_layout::kStatusError;
    m.attr("kStatusAbort") = buffer_layout::kStatusAbort;
    m.attr("kNumStatusWords") = buffer_layout::kNumStatusWords;
    m.attr("kControlEpoch") = buffer_layout::kControlEpoch;   // the control word (uint32) holding the last call's epoch
    // Formats and development aids whose numbers Python code must agree with
    m.attr("kMegaMoEDeltaBlockBytes") = kMegaMoEDeltaBlockBytes;
    py::list fp4_packed_byte;     // [k_byte] -> byte of the row's permuted 64 (transform.py must agree)
    for (int j = 0; j < kMegaMoEPackedRowBytes; ++j) fp4_packed_byte.append(mega_moe_fp4_packed_byte(j));
    m.attr("kMegaMoEFP4PackedByte") = py::tuple(fp4_packed_byte);
    py::list fp4_sign_bit;        // [hi][j] -> word bit of the sign of element j of K half hi (transform.py must agree)
    for (int hi = 0; hi < 2; ++hi) {
        py::list row;
        for (int j = 0; j < 4; ++j) row.append(mega_moe_fp4_sign_bit(hi, j));
        fp4_sign_bit.append(py::tuple(row));
    }
    m.attr("kMegaMoEFP4SignBit") = py::tuple(fp4_sign_bit);
    m.attr("kTraceSlots") = static_cast<int>(kTraceSlots);
    m.attr("kTraceKbReady") = static_cast<int>(kTraceKbReady);
    m.attr("kTraceKbIssue") = static_cast<int>(kTraceKbIssue);
    m.attr("kTraceKbLastReady") = static_cast<int>(kTraceKbLastReady);
    m.attr("kTraceKbLastFree") = static_cast<int>(kTraceKbLastFree);
    m.attr("kTraceKbLastIssue") = static_cast<int>(kTraceKbLastIssue);
    m.attr("kTraceKbLastRelease") = static_cast<int>(kTraceKbLastRelease);
    m.attr("kTraceKbSlots") = static_cast<int>(kTraceKbSlots);
    m.attr("kTraceTaskBase") = static_cast<int>(kTraceTaskBase);
    m.attr("kTraceTasks") = static_cast<int>(kTraceTasks);
    m.attr("kTraceTaskStamps") = static_cast<int>(kTraceTaskStamps);
    py::dict task_stamps, task_kinds;   // the task log's slots and kinds (scripts/trace.py --tasks)
    task_stamps["id"] = static_cast<int>(kTaskStampId);
    task_stamps["got"] = static_cast<int>(kTaskStampGot);
    task_stamps["first_stage"] = static_cast<int>(kTaskStampFirstStage);
    task_stamps["loop_end"] = static_cast<int>(kTaskStampLoopEnd);
    task_stamps["end"] = static_cast<int>(kTaskStampEnd);
    task_stamps["ticket"] = static_cast<int>(kTaskStampTicket);
    task_stamps["claimed"] = static_cast<int>(kTaskStampClaimed);
    task_stamps["first_a"] = static_cast<int>(kTaskStampFirstA);
    task_stamps["decoded"] = static_cast<int>(kTaskStampDecoded);
    task_stamps["stage_free"] = static_cast<int>(kTaskStampStageFree);
    task_kinds[py::int_(static_cast<int>(kTaskKindL1))] = "L1";
    task_kinds[py::int_(static_cast<int>(kTaskKindL2))] = "L2";
    task_kinds[py::int_(static_cast<int>(kTaskKindCombine))] = "combine";
    m.attr("kTraceTaskStamp") = task_stamps;
    m.attr("kTraceTaskKinds") = task_kinds;
    py::dict codes, phases;
    codes["timeout"] = static_cast<int>(StatusCode::kTimeout);
    codes["bad_expert_id"] = static_cast<int>(StatusCode::kBadExpertId);
    codes["bad_count"] = static_cast<int>(StatusCode::kBadCount);
    codes["duplicate_expert"] = static_cast<int>(StatusCode::kDuplicateExpert);
    codes["epoch_mismatch"] = static_cast<int>(StatusCode::kEpochMismatch);
    phases["none"] = static_cast<int>(Phase::kNone);
    phases["recv_counts"] = static_cast<int>(Phase::kRecvCounts);
    phases["pull"] = static_cast<int>(Phase::kPull);
    phases["l1_wait"] = static_cast<int>(Phase::kL1Wait);
    phases["l2_wait"] = static_cast<int>(Phase::kL2Wait);
    phases["combine_wait"] = static_cast<int>(Phase::kCombineWait);
    phases["pipeline"] = static_cast<int>(Phase::kPipeline);
    phases["count"] = static_cast<int>(Phase::kCount);
    m.attr("STATUS_CODES") = codes;
    m.attr("STATUS_PHASES") = phases;
    m.attr("kMegaMoESectionAlignment") = buffer_layout::kSectionAlignment;
}

}  // namespace deep_gemm::apis::layout
