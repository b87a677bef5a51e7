#pragma once

// Python bindings of the Mega MoE config heuristics (`csrc/jit_kernels/heuristics/mega_moe.hpp`),
// for tests and for inspecting what the launcher will pick.

#include <pybind11/pybind11.h>

#include "../jit_kernels/heuristics/mega_moe.hpp"

namespace deep_gemm::apis::heuristics {

inline pybind11::dict config_to_dict(const MegaMoEConfig& c) {
    pybind11::dict d;
    d["mma_type"] = static_cast<int>(c.mma_type);
    d["block_m"] = c.block_m;
    d["num_math_warpgroups"] = c.num_math_warpgroups;
    d["block_n_l1"] = c.block_n_l1;
    d["block_n_l2"] = c.block_n_l2;
    d["wide_n_min"] = c.wide_n_min;
    d["signals_thread"] = c.signals_thread;
    d["cta_pair"] = c.cta_pair;
    d["block_k"] = c.block_k;
    d["num_stages"] = c.num_stages;
    d["num_prefetch_stages"] = c.num_prefetch_stages;
    d["num_prefetch_stages_l2"] = c.num_prefetch_stages_l2;
    d["num_sms"] = c.num_sms;
    d["num_experts_per_wave"] = c.num_experts_per_wave;
    d["smem_bytes"] = c.smem_bytes;
    d["num_threads"] = c.num_threads;
    d["smem_a_per_stage"] = c.smem_a_per_stage;
    d["smem_b_per_stage"] = c.smem_b_per_stage;
    d["smem_epilogue"] = c.smem_epilogue;
    d["smem_barriers"] = c.smem_barriers;
    d["description"] = c.to_string();
    return d;
}

inline MegaMoEConfig config_from_args(int mma_type, int num_ranks, int num_experts, int num_topk, int hidden,
                                      int intermediate_hidden, int num_tokens, int num_sms, int max_smem_bytes, int cta_pair = -1,
                                      int hbm_gbps = 0, int block_m = 0) {
    return get_mega_moe_config(mega_moe_mma_type(mma_type), num_ranks, num_experts, num_topk, hidden,
                               intermediate_hidden, num_tokens, num_sms, max_smem_bytes, cta_pair, hbm_gbps, block_m);
}

inline void register_apis(pybind11::module_& m) {
    namespace py = pybind11;
    m.def("get_mega_moe_config",
          [](int mma_type, int num_ranks, int num_experts, int num_topk, int hidden, int intermediate_hidden,
             int num_tokens, int num_sms, int max_smem_bytes, int cta_pair, int hbm_gbps, int block_m) {
              return config_to_dict(config_from_args(mma_type, num_ranks, num_experts, num_topk, hidden,
                                                     intermediate_hidden, num_tokens, num_sms, max_smem_bytes, cta_pair,
                                                     hbm_gbps, block_m));
          },
          py::arg("mma_type"), py::arg("num_ranks"), py::arg("num_experts"), py::arg("num_topk"), py::arg("hidden"),
          py::arg("intermediate_hidden"), py::arg("num_tokens"), py::arg("num_sms"),
          py::arg("max_smem_bytes") = mega_moe_tiles::kSM90MaxSmemBytes, py::arg("cta_pair") = -1, py::arg("hbm_gbps") = 0,
          py::arg("block_m") = 0,
          "Kernel config the Mega MoE launcher picks for this shape and token count (dict of MegaMoEConfig\n"
          "fields plus 'description'). mma_type: 0 fp8xfp4, 1 fp8xfp8, 2 bf16xbf16. cta_pair: -1 the\n"
          "heuristic's choice, 0 never, 1 wherever the kernel has the variant. hbm_gbps: the GPU's peak HBM\n"
          "bandwidth in GB/s (the launcher passes the device's: H100 SXM 3352, H200 4917), 0 unknown.\n"
          "block_m: 0 the heuristic's choice, 64 or 128 (DG_MEGA_MOE_BLOCK_M). Raises ValueError.");
    m.def("print_mega_moe_config_if_requested",
          [](int mma_type, int num_ranks, int num_experts, int num_topk, int hidden, int intermediate_hidden,
             int num_tokens, int num_sms, int max_smem_bytes) {
              return print_config_if_requested(config_from_args(mma_type, num_ranks, num_experts, num_topk, hidden,
                                                                intermediate_hidden, num_tokens, num_sms, max_smem_bytes));
          },
          py::arg("mma_type"), py::arg("num_ranks"), py::arg("num_experts"), py::arg("num_topk"), py::arg("hidden"),
          py::arg("intermediate_hidden"), py::arg("num_tokens"), py::arg("num_sms"),
          py::arg("max_smem_bytes") = mega_moe_tiles::kSM90MaxSmemBytes,
          "What the launcher does with DG_PRINT_CONFIGS=1: print the config once per distinct config.\n"
          "Returns whether it printed.");
}

}  // namespace deep_gemm::apis::heuristics
