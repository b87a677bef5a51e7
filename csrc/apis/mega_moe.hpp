#pragma once

// Python entry of the Mega MoE launcher. Tensor checks happen in Python (deep_gemm/mega/api.py),
// which hands over plain addresses; this layer only converts and launches.

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "../jit_kernels/impls/sm90_fp8_mega_moe.hpp"
#include "layout.hpp"

namespace deep_gemm::apis::mega_moe {

namespace py = pybind11;

inline void register_apis(py::module_& m) {
    m.attr("kMaxTimeoutSeconds") = jit_kernels::kMegaMoEMaxTimeoutSeconds;   // deep_gemm.set_timeout's bound
    m.def("launch_mega_moe",
          [](int mma_type, const std::vector<int64_t>& buffers, int rank, int num_experts, int num_max_tokens_per_rank,
             int num_topk, int hidden, int intermediate_hidden, int num_tokens, int64_t y, int64_t l1_weights,
             int64_t l1_weight_scales, int64_t l1_weight_deltas, int64_t l2_weights, int64_t l2_weight_scales,
             int64_t l2_weight_deltas, int64_t stats, int64_t host_status,
             int64_t trace, int64_t stream, double activation_clamp, bool fast_math, double timeout_s, int num_sms, int max_smem_bytes,
             bool peers_on_this_gpu, bool ranks_share_gpu, int hbm_gbps) {
              if (buffers.empty() or buffers.size() > static_cast<size_t>(kMaxRanks))
                  throw std::invalid_argument("buffers: expected 1.." + std::to_string(kMaxRanks) + " peer addresses");
              if (rank < 0 or rank >= static_cast<int>(buffers.size()))
                  throw std::invalid_argument("rank: expected 0 <= rank < " + std::to_string(buffers.size()));
              // The last line of defence: the kernel writes combine rows for n tokens
              if (num_tokens < 0 or num_tokens > num_max_tokens_per_rank)
                  throw std::invalid_argument("num_tokens: expected 0 <= num_tokens <= num_max_tokens_per_rank = " +
                                              std::to_string(num_max_tokens_per_rank));
              // (deep_gemm.set_timeout's range; a NaN or inf would not survive the conversion to nanoseconds)
              if (not (timeout_s > 0.0 and timeout_s <= jit_kernels::kMegaMoEMaxTimeoutSeconds))
                  throw std::invalid_argument("timeout_s: expected a number of seconds in (0, 1e6], got " + std::to_string(timeout_s));
              // The combine indexes y's 16-byte chunks in int32
              if (static_cast<int64_t>(num_tokens) * (hidden / 8) >= (int64_t(1) << 31))
                  throw std::invalid_argument("num_tokens: expected num_tokens * hidden / 8 < 2^31 (hidden = " +
                                              std::to_string(hidden) + ")");
              jit_kernels::SM90MegaMoEArgs a{static_cast<MmaType>(mma_type), buffers, rank, num_experts,
                                             num_max_tokens_per_rank, num_topk, hidden, intermediate_hidden, num_tokens,
                                             y, l1_weights, l1_weight_scales, l1_weight_deltas, l2_weights, l2_weight_scales,
                                             l2_weight_deltas, stats,
                                             host_status, trace, stream, activation_clamp, fast_math, timeout_s, num_sms,
                                             max_smem_bytes, peers_on_this_gpu, ranks_share_gpu, hbm_gbps};
              // Nothing is returned: formatting the config on every call would cost host time
              // (DG_PRINT_CONFIGS prints each distinct one once)
              jit_kernels::launch_sm90_mega_moe(a);
          },
          py::arg("mma_type"), py::arg("buffers"), py::arg("rank"), py::arg("num_experts"),
          py::arg("num_max_tokens_per_rank"), py::arg("num_topk"), py::arg("hidden"), py::arg("intermediate_hidden"),
          py::arg("num_tokens"), py::arg("y"), py::arg("l1_weights"), py::arg("l1_weight_scales"), py::arg("l1_weight_deltas"),
          py::arg("l2_weights"), py::arg("l2_weight_scales"), py::arg("l2_weight_deltas"), py::arg("stats"), py::arg("host_status"), py::arg("trace"), py::arg("stream"),
          py::arg("activation_clamp"), py::arg("fast_math"), py::arg("timeout_s"), py::arg("num_sms"),
          py::arg("max_smem_bytes"), py::arg("peers_on_this_gpu") = false, py::arg("ranks_share_gpu") = false,
          py::arg("hbm_gbps") = -1,
          "Launch one rank's Mega MoE kernel (addresses as ints; validated by deep_gemm.mega.api). hbm_gbps:\n"
          "the GPU's peak HBM bandwidth in GB/s (get_device_info), -1 the current device's. Holds the GIL: a\n"
          "first call that compiles its kernel reads settings from the environment, which a Python thread\n"
          "may change meanwhile (prepare_mega_moe compiles without it).");

    m.def("get_mega_moe_programmatic_launch", [] { return jit_kernels::mega_moe_programmatic_launch(); },
          "Whether the Mega MoE and staging kernels launch as programmatic dependents of the kernel before them\n"
          "on the stream (DG_MEGA_MOE_PDL: 1, the default, or 0; read once per process). Works without a GPU.");

    m.def("get_num_mega_moe_plans_built", [] { return jit_kernels::num_sm90_mega_moe_plans_built().load(); },
          "Launch plans (kernel, parameter block, tensor maps) built in this process: a call reuses the plan of\n"
          "earlier calls with the same buffers, weights, GPU and kernel variant (tests, host-overhead checks).");

    m.def("launch_mega_moe_stage",
          [](int mma_type, int num_ranks, int num_experts, int num_max_tokens_per_rank, int num_topk, int hidden,
             int intermediate_hidden, int64_t buffer, int64_t x, int64_t x_row_stride, int64_t topk_idx,
             int64_t topk_weights, int num_tokens, int num_sms, int64_t stream) {
              // checked (a bad shape raises instead of reaching a division by zero or a wrong offset)
              const auto lay = apis::layout::make_mega_moe_layout(num_ranks, num_experts, num_max_tokens_per_rank, num_topk,
                                                                  hidden, intermediate_hidden, mma_type);
              jit_kernels::launch_mega_moe_stage(static_cast<MmaType>(mma_type), lay, buffer, x, x_row_stride, topk_idx,
                                                 topk_weights, num_tokens, num_sms, stream);
          },
          py::arg("mma_type"), py::arg("num_ranks"), py::arg("num_experts"), py::arg("num_max_tokens_per_rank"),
          py::arg("num_topk"), py::arg("hidden"), py::arg("intermediate_hidden"), py::arg("buffer"), py::arg("x"),
          py::arg("x_row_stride"), py::arg("topk_idx"), py::arg("topk_weights"), py::arg("num_tokens"),
          py::arg("num_sms"), py::arg("stream"),
          "Launch the input-staging kernel of SymmBuffer.stage (validated in Python).");

    m.def("compile_mega_moe_stage",
          [](bool fp8, bool load) {
              jit::Compiler::instance().snapshot_environment();   // with the GIL: os.environ as it is now
              py::gil_scoped_release release;
              const auto dir = jit_kernels::compile_mega_moe_stage(fp8);
              if (load)
                  jit::get_kernel(dir, "mega_moe_stage");
              return dir.string();
          },
          py::arg("fp8"), py::arg("load") = false,
          "Compile (or fetch from the cache) the staging kernel; works without a GPU (and without the GIL). With\n"
          "load=True, also load it into the current CUDA context as its first launch would.");

    m.def("compile_mega_moe",
          [](int mma_type, int block_m, int num_stages, bool fast_math, int block_n_l2, int wide_n_min, bool signals_thread, bool cta_pair,
             bool weights_first) {
              jit_kernels::SM90MegaMoEVariant v{static_cast<MmaType>(mma_type), block_m, num_stages, fast_math, block_n_l2,
                                                wide_n_min, signals_thread, cta_pair};
              v.weights_first = weights_first;
              jit::Compiler::instance().snapshot_environment();   // with the GIL: os.environ as it is now
              py::gil_scoped_release release;
              return v.compile().string();
          },
          py::arg("mma_type"), py::arg("block_m"), py::arg("num_stages"), py::arg("fast_math") = true,
          py::arg("block_n_l2") = kMegaMoEBlockNL2, py::arg("wide_n_min") = 64, py::arg("signals_thread") = false,
          py::arg("cta_pair") = false, py::arg("weights_first") = false,
          "Compile (or fetch from DG_JIT_CACHE_DIR) one Mega MoE kernel variant for sm_90a; works without a GPU "
          "(and without the GIL: threads compile different variants in parallel). "
          "block_n_l2: the L2 task width, 128, (block_m 64) 256 / 512 or (block_m 128, fp8xfp8 / bf16xbf16) 256; wide_n_min: the narrowest transposed wide "
          "tile, 64 or (fp8xfp4, block_m 64) 16 / 32; signals_thread: (fp8xfp4, block_m 64) the kernel with the "
          "signals thread; weights_first: the weights-first kernel (num_stages 3-8; block_m and the options above unused). "
          "Returns the kernel's cache directory.");

    m.def("prepare_mega_moe",
          [](int mma_type, int num_ranks, int num_experts, int num_topk, int hidden, int intermediate_hidden,
             int num_tokens, int num_sms, int max_smem_bytes, bool fast_math, bool load, bool ranks_share_gpu, int hbm_gbps) {
              jit::Compiler::instance().snapshot_environment();   // with the GIL: os.environ as it is now
              py::gil_scoped_release release;
              return jit_kernels::prepare_sm90_mega_moe(mega_moe_mma_type(mma_type), num_ranks, num_experts, num_topk,
                                                        hidden, intermediate_hidden, num_tokens, num_sms, max_smem_bytes,
                                                        fast_math, load, ranks_share_gpu, hbm_gbps);
          },
          py::arg("mma_type"), py::arg("num_ranks"), py::arg("num_experts"), py::arg("num_topk"), py::arg("hidden"),
          py::arg("intermediate_hidden"), py::arg("num_tokens"), py::arg("num_sms"), py::arg("max_smem_bytes"),
          py::arg("fast_math") = true, py::arg("load") = false, py::arg("ranks_share_gpu") = false, py::arg("hbm_gbps") = -1,
          "Compile the kernel variant launch_mega_moe would launch for these arguments (works without a GPU,\n"
          "and without the GIL: a server's other threads run meanwhile) and, with load=True, load it into the\n"
          "current CUDA context as its first launch would (module load, shared-memory opt-in). Returns the\n"
          "kernel's cache directory.");

    m.def("get_mega_moe_kernel_source",
          [](int mma_type, int block_m, int num_stages, bool fast_math, int block_n_l2, int wide_n_min, bool signals_thread, bool cta_pair,
             bool weights_first) {
              jit_kernels::SM90MegaMoEVariant v{static_cast<MmaType>(mma_type), block_m, num_stages, fast_math, block_n_l2,
                                                wide_n_min, signals_thread, cta_pair};
              v.weights_first = weights_first;
              return v.source();
          },
          py::arg("mma_type"), py::arg("block_m"), py::arg("num_stages"), py::arg("fast_math") = true,
          py::arg("block_n_l2") = kMegaMoEBlockNL2, py::arg("wide_n_min") = 64, py::arg("signals_thread") = false,
          py::arg("cta_pair") = false, py::arg("weights_first") = false,
          "The generated source of one Mega MoE kernel variant (for inspection).");

    m.def("get_mega_moe_l1_split_max",
          [](int mma_type) {
              return jit_kernels::mega_moe_l1_split_max(mega_moe_mma_type(mma_type));
          },
          py::arg("mma_type"),
          "Most K parts of a split-K L1 tile the launcher allows for this format (DG_MEGA_MOE_L1_SPLIT or\n"
          "the heuristic's cap: 1 = never split). Works without a GPU.");

    m.def("get_mega_moe_l1_split_plan",
          [](int64_t tiles, int num_kb, int64_t grid, int split_max) {
              const auto plan = mega_moe_l1_split_plan(tiles, num_kb, grid, split_max);
              return py::make_tuple(plan.parts, plan.part_kb);
          },
          py::arg("tiles"), py::arg("num_kb"), py::arg("grid"), py::arg("split_max"),
          "The kernel's split-K L1 plan of a decode call whose `tiles` L1 tiles are all narrow: (K parts\n"
          "per tile, K-blocks of each part). Works without a GPU.");

    m.def("get_mega_moe_ws_plan",
          [](int mma_type, int hidden, int intermediate_hidden, int num_slots, int grid, int form) {
              if (form < 0 or form >= kMegaMoEWsPlanForms)
                  throw std::invalid_argument("get_mega_moe_ws_plan: form in 0..7 (whole L1 1 | whole L2 2 | L2 after L1 4)");
              const MegaMoEWsPlan plan(mega_moe_mma_type(mma_type), hidden, intermediate_hidden, num_slots, grid, form);
              py::dict d;
              d["kb1"] = plan.kb1, d["tiles1"] = plan.tiles1, d["units1"] = plan.units1, d["s1"] = plan.s1, d["chunks1"] = plan.chunks1;
              d["kb2"] = plan.kb2, d["per_column"] = plan.per_column, d["columns"] = plan.columns, d["units2"] = plan.units2;
              d["s2"] = plan.s2, d["chunks2"] = plan.chunks2, d["whole1"] = plan.whole1, d["whole2"] = plan.whole2;
              d["l2_after_l1"] = plan.l2_after_l1;
              return d;
          },
          py::arg("mma_type"), py::arg("hidden"), py::arg("intermediate_hidden"), py::arg("num_slots"), py::arg("grid"),
          py::arg("form") = 0,
          "The weights-first kernel's plan (MegaMoEWsPlan) for a call with `num_slots` distinct routed experts on\n"
          "`grid` CTAs in plan form `form` (bits: 1 whole L1 tiles, 2 whole L2 chunks, 4 L2 weights requested after\n"
          "every L1 weight): units, chunk length\n"
          "and chunks per phase. Works without a GPU.");

    m.def("set_mega_moe_ws_l2_lead",
          [](int lead) {
              if (lead < -1 or lead > jit_kernels::kMegaMoEWsMaxL2Lead)
                  throw std::invalid_argument("set_mega_moe_ws_l2_lead: expected -1 (the environment's DG_MEGA_MOE_WS_L2_LEAD), or 0.." +
                                              std::to_string(jit_kernels::kMegaMoEWsMaxL2Lead) + " units, got " + std::to_string(lead));
              return jit_kernels::mega_moe_ws_l2_lead_override().exchange(lead);
          },
          py::arg("lead"),
          "The weights-first kernel's L2 lead for the next calls: under the plan's L2-after-L1 gate (forms 4-7), an L1\n"
          "chunk counts as issued once at most `lead` of its units are left to issue, so L2 weight loads start that\n"
          "much earlier (0: after every L1 load); -1 (the start) follows DG_MEGA_MOE_WS_L2_LEAD, else 0. Returns the\n"
          "previous setting. A tuning aid for tests and benchmarks (docs/KERNEL.md).");

    m.def("get_mega_moe_ws_l2_lead", [] { return jit_kernels::select_mega_moe_ws_l2_lead(); },
          "The L2 lead the next weights-first call runs with (set_mega_moe_ws_l2_lead, else DG_MEGA_MOE_WS_L2_LEAD, else 0).\n"
          "Works without a GPU.");

    m.def("set_mega_moe_ws_plan",
          [](int form) {
              if (form < -1 or form >= kMegaMoEWsPlanForms)
                  throw std::invalid_argument("set_mega_moe_ws_plan: expected -1 (the environment's DG_MEGA_MOE_WS_PLAN), or a form 0..7");
              return jit_kernels::mega_moe_ws_plan_override().exchange(form);
          },
          py::arg("form"),
          "The weights-first kernel's plan form for the next calls, bits: 1 whole L1 tiles, 2 whole L2 chunks, 4 L2 weights\n"
          "requested after every L1 weight (0: split, all at once);\n"
          "-1 (the start) follows DG_MEGA_MOE_WS_PLAN, else the default. Returns the previous setting. A tuning aid\n"
          "for tests and benchmarks (docs/KERNEL.md).");

    m.def("set_mega_moe_weights_first",
          [](int choice) {
              if (choice < -1 or choice > 1)
                  throw std::invalid_argument("set_mega_moe_weights_first: expected -1 (the environment's DG_MEGA_MOE_WEIGHTS_FIRST), 0 or 1");
              return jit_kernels::mega_moe_weights_first_override().exchange(choice);
          },
          py::arg("choice"),
          "Whether calls that can run the weights-first kernel do (1), do not (0), or follow DG_MEGA_MOE_WEIGHTS_FIRST\n"
          "(-1, the start; unset: on, but for fp8xfp4); returns the previous setting. A tuning aid for tests and benchmarks (docs/KERNEL.md).");

    m.def("get_mega_moe_kernel_variant",
          [](int mma_type, int num_ranks, int num_experts, int num_topk, int hidden, int intermediate_hidden,
             int num_tokens, int num_sms, int max_smem_bytes, bool fast_math, bool ranks_share_gpu, int hbm_gbps) {
              const auto [config, v] = jit_kernels::select_sm90_mega_moe_variant(
                  mega_moe_mma_type(mma_type), num_ranks, num_experts, num_topk, hidden, intermediate_hidden,
                  num_tokens, num_sms, max_smem_bytes, fast_math, ranks_share_gpu, hbm_gbps);
              py::dict d;
              d["name"] = v.name();
              d["mma_type"] = static_cast<int>(v.mma_type);
              d["block_m"] = v.block_m;
              d["num_stages"] = v.num_stages;
              d["fast_math"] = v.fast_math;
              d["block_n_l2"] = v.block_n_l2;
              d["wide_n_min"] = v.wide_n_min;
              d["signals_thread"] = v.signals_thread;
              d["cta_pair"] = v.cta_pair;
              d["weights_first"] = v.weights_first;
              return d;
          },
          py::arg("mma_type"), py::arg("num_ranks"), py::arg("num_experts"), py::arg("num_topk"), py::arg("hidden"),
          py::arg("intermediate_hidden"), py::arg("num_tokens"), py::arg("num_sms"),
          py::arg("max_smem_bytes") = mega_moe_tiles::kSM90MaxSmemBytes, py::arg("fast_math") = true,
          py::arg("ranks_share_gpu") = false, py::arg("hbm_gbps") = -1,
          "The kernel variant launch_mega_moe would launch for this shape and token count (the heuristic's\n"
          "config with DG_MEGA_MOE_L2_BLOCK_N and DG_MEGA_MOE_WIDE_N applied): dict of name, mma_type, block_m,\n"
          "num_stages, fast_math, block_n_l2, wide_n_min, signals_thread, cta_pair, weights_first (DG_MEGA_MOE_SIGNALS_THREAD,\n"
          "DG_MEGA_MOE_WEIGHTS_FIRST and\n"
          "DG_MEGA_MOE_CTA_PAIR applied too; ranks_share_gpu: other ranks' kernels run on this GPU at once, as\n"
          "virtual ranks do, so no CTA pair unless forced; hbm_gbps: the GPU's peak HBM bandwidth in GB/s, -1 the\n"
          "current device's as the launcher takes it, 0 where there is none). Works without a GPU.");
}

}  // namespace deep_gemm::apis::mega_moe
