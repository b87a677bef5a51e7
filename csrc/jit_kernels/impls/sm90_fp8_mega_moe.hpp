#pragma once

// Runtime of `deep_gemm/include/deep_gemm/impls/sm90_fp8_mega_moe.cuh`: code generation (the
// config becomes template arguments), tensor maps, launch. Shapes stay run-time values, so a
// handful of variants (format x BLOCK_M x stages x fast math x L2 task width) cover every model.

#include <array>
#include <atomic>
#include <cmath>
#include <initializer_list>
#include <map>
#include <mutex>
#include <tuple>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include <deep_gemm/impls/mega_moe_params.cuh>
#include <algorithm>

#include "../../jit/compiler.hpp"
#include "../../jit/kernel_runtime.hpp"
#include "../../jit/tma.hpp"
#include "../heuristics/mega_moe.hpp"

namespace deep_gemm::jit_kernels {

inline const char* mma_type_cpp_name(MmaType t) {
    switch (t) {
        case MmaType::kFP8xFP4: return "deep_gemm::MmaType::kFP8xFP4";
        case MmaType::kFP8xFP8: return "deep_gemm::MmaType::kFP8xFP8";
        default: return "deep_gemm::MmaType::kBF16xBF16";
    }
}

// A tuning aid's value: one of `allowed` (as written), -1 when unset; anything else raises
inline int read_env_choice(const char* name, std::initializer_list<const char*> allowed) {
    const std::string v = jit::get_env(name);
    if (v.empty()) return -1;
    std::string expected;
    for (const char* a : allowed) {
        if (v == a) return std::stoi(v);
        expected += (expected.empty() ? "" : ", ") + std::string(a);
    }
    jit::raise_invalid_argument(name, ": expected one of ", expected, ", got '", v, "'");
    return -1;
}

// One kernel: the kernel's template parameters, in their order (Kernel<kMmaType, BLOCK_M,
// kNumStages, kFastMath, kL2BlockN, kWideNMin>), and whether it is built with the signals thread
// (DG_MEGA_MOE_SIGNALS_THREAD defined before the header)
struct SM90MegaMoEVariant {
    MmaType mma_type;
    int block_m, num_stages;
    bool fast_math;
    int block_n_l2;     // L2 task width: 128, 256 / 512 with block_m 64, or 256 FP8 x FP8 / BF16 with block_m 128 (mega_moe_l2_block_n_ok)
    int wide_n_min = 64;   // narrowest transposed wide tile: 64, or 16 / 32 for FP8 x FP4 with block_m 64 (mega_moe_wide_n_ok)
    bool signals_thread = false;   // FP8 x FP4 with block_m 64 only (mega_moe_signals_thread_ok)
    bool cta_pair = false;         // FP8 x FP4 decode: two CTAs an SM, one math warpgroup each (mega_moe_cta_pair_ok)
    bool weights_first = false;    // the weights-first kernel (sm90_mega_moe_ws.cuh: num_stages and fast_math only)

    void check() const {
        if (weights_first) {
            if (num_stages < kMegaMoEWsMinStages or num_stages > kMegaMoEWsMaxStages)
                jit::raise_invalid_argument("weights_first: num_stages in [", kMegaMoEWsMinStages, ", ", kMegaMoEWsMaxStages, "], got ", num_stages);
            return;
        }
        if (not mega_moe_l2_block_n_ok(mma_type, block_m, block_n_l2))
            jit::raise_invalid_argument("block_n_l2: expected 128, 256 / 512 with block_m = 64, or 256 for fp8xfp8 / bf16xbf16 with block_m = 128; got ",
                                        block_n_l2, " with block_m = ", block_m, " (mma_type ", static_cast<int>(mma_type), ")");
        if (not mega_moe_wide_n_ok(mma_type, block_m, wide_n_min))
            jit::raise_invalid_argument("wide_n_min: expected 64, or 16 / 32 for fp8xfp4 with block_m = 64; got ", wide_n_min,
                                        " with block_m = ", block_m);
        if (signals_thread and not mega_moe_signals_thread_ok(mma_type, block_m))
            jit::raise_invalid_argument("signals_thread: fp8xfp4 with block_m = 64 only; got block_m = ", block_m,
                                        " (mma_type ", static_cast<int>(mma_type), ")");
        if (cta_pair and not mega_moe_cta_pair_ok(mma_type, block_m, wide_n_min))
            jit::raise_invalid_argument("cta_pair: fp8xfp4 with block_m = 64 (wide_n_min 16, 32 or 64) only; got block_m = ", block_m,
                                        ", wide_n_min = ", wide_n_min, " (mma_type ", static_cast<int>(mma_type), ")");
    }

    std::string name() const {
        static constexpr const char* kNames[] = {"fp8xfp4", "fp8xfp8", "bf16xbf16"};
        std::ostringstream os;
        if (weights_first) {
            os << "sm90_mega_moe_ws_" << kNames[static_cast<int>(mma_type)] << "_s" << num_stages << (fast_math ? "_fast" : "_exact");
            if (task_log() == 1) os << "_tasklog";   // its stage log (kWsStageLog); level 2 has nothing for it
            return os.str();
        }
        os << "sm90_mega_moe_" << kNames[static_cast<int>(mma_type)] << "_m" << block_m << "_n" << block_n_l2
           << "_s" << num_stages << (fast_math ? "_fast" : "_exact");
        if (signals_thread) os << "_sig";
        if (cta_pair) os << "_pair";
        if (wide_n_min != 64) os << "_w" << wide_n_min;
        if (task_log() == 1) os << "_tasklog";
        if (task_log() == 2) os << "_tasklight";
        return os.str();
    }

    // DG_MEGA_MOE_TASK_LOG=1 (read once per process): every kernel variant is built with the trace's
    // task log (scripts/trace.py --tasks; the weights-first kernel: its stage log), a development aid
    // kept out of the others' SASS; =2: the
    // task log's per-task stamps only, without any per-K-block stamp (trace.py --tasks-light: the
    // untraced kernel's pace). The kernel header reads the level (kTaskLog, kTaskLogKBlocks)
    static int task_log() {
        static const int level = std::max(0, read_env_choice("DG_MEGA_MOE_TASK_LOG", {"0", "1", "2"}));
        return level;
    }

    std::string source() const {
        check();
        std::ostringstream os;
        if (weights_first) {
            if (task_log() == 1) os << "#define DG_MEGA_MOE_TASK_LOG 1\n";
            os << "#include <deep_gemm/impls/sm90_mega_moe_ws.cuh>\n\n"
               << "DG_DEFINE_SM90_MEGA_MOE_WS_KERNEL(sm90_mega_moe, " << mma_type_cpp_name(mma_type) << ", " << num_stages << ", "
               << (fast_math ? "true" : "false") << ")\n";
            return os.str();
        }
        if (task_log()) os << "#define DG_MEGA_MOE_TASK_LOG " << task_log() << "\n";
        if (signals_thread) os << "#define DG_MEGA_MOE_SIGNALS_THREAD 1\n";
        if (cta_pair) os << "#define DG_MEGA_MOE_CTA_PAIR 1\n";
        os << "#include <deep_gemm/impls/sm90_fp8_mega_moe.cuh>\n\n"
           << "DG_DEFINE_SM90_MEGA_MOE_KERNEL(sm90_mega_moe, " << mma_type_cpp_name(mma_type) << ", " << block_m << ", "
           << num_stages << ", " << (fast_math ? "true" : "false") << ", " << block_n_l2 << ", " << wide_n_min << ")\n";
        return os.str();
    }

    // Compile (or find in the cache) on any machine, GPU or not. Remembered per variant, so a
    // launch does not regenerate and hash the source. nvcc runs outside the lock: threads compiling
    // different variants run in parallel (scripts/prebuild_kernels.py --jobs), and jit::compile
    // serializes threads asking for the same one
    std::filesystem::path compile() const {
        static std::mutex mutex;
        static std::map<std::tuple<uint64_t, int, int, int, bool, int, int, bool, bool, bool>, std::filesystem::path> compiled;
        // the compiler's generation first: after set_cache_dir / init the variant is looked up afresh
        const auto key = std::make_tuple(jit::compile_generation(), static_cast<int>(mma_type), block_m, num_stages, fast_math, block_n_l2,
                                         wide_n_min, signals_thread, cta_pair, weights_first);
        {
            std::lock_guard<std::mutex> lock(mutex);
            if (auto it = compiled.find(key); it != compiled.end())
                return it->second;
        }
        const auto dir = jit::compile(name(), source());
        std::lock_guard<std::mutex> lock(mutex);
        return compiled.emplace(key, dir).first->second;
    }
};

// Everything one launch needs, as plain integers from Python (no torch in C++)
struct SM90MegaMoEArgs {
    MmaType mma_type;
    std::vector<int64_t> buffers;   // every rank's buffer base address
    int rank, num_experts, num_max_tokens_per_rank, num_topk, hidden, intermediate_hidden;
    int num_tokens;
    int64_t y, l1_weights, l1_weight_scales, l1_weight_deltas, l2_weights, l2_weight_scales, l2_weight_deltas;
    int64_t stats, host_status, trace, stream;
    double activation_clamp;        // <= 0 or inf: none
    bool fast_math;
    double timeout_s;
    int num_sms;                    // CTAs for this rank's launch
    int max_smem_bytes;
    bool peers_on_this_gpu = false; // every rank's buffer on this GPU (EP1, virtual ranks): gpu-scope signals
    bool ranks_share_gpu = false;   // other ranks' kernels of the call run on this GPU at once (virtual ranks): no CTA pair
    int hbm_gbps = -1;              // the GPU's peak HBM bandwidth (GB/s; the Python launcher's cached device info), -1 ask the driver
};

inline CUtensorMap make_kmajor_tma(int64_t ptr, CUtensorMapDataType dtype, uint64_t k, uint64_t rows, uint32_t box_k,
                                   uint32_t box_rows, uint64_t row_bytes,
                                   CUtensorMapSwizzle swizzle = CU_TENSOR_MAP_SWIZZLE_128B) {
    return jit::make_tma<2>(reinterpret_cast<void*>(ptr), dtype,
                            {jit::TmaDim{k, box_k, 0, "K", "BLOCK_K", "-"},
                             jit::TmaDim{rows, box_rows, row_bytes, "rows", "block rows", "row stride"}},
                            swizzle);
}

// The L2 task width a call launches: the heuristic's, or the tuning aid DG_MEGA_MOE_L2_BLOCK_N = 128,
// 256 or 512 (docs/KERNEL.md; read once per process), which picks the kernel variant of that width
// where there is one (256 / 512 with BLOCK_M 64, 256 for FP8 x FP8 / BF16 with BLOCK_M 128) and the hidden size is whole tasks of it, else the
// widest narrower one that is
inline int select_mega_moe_l2_block_n(const MegaMoEConfig& config, int hidden) {
    static const int l2_block_n_override = read_env_choice("DG_MEGA_MOE_L2_BLOCK_N", {"128", "256", "512"});
    for (int width = l2_block_n_override > 0 ? l2_block_n_override : config.block_n_l2; width > kMegaMoEBlockNL2; width /= 2) {
        if (mega_moe_l2_block_n_ok(config.mma_type, config.block_m, width) and hidden % width == 0) return width;
    }
    return kMegaMoEBlockNL2;
}

// The narrowest transposed wide tile a call launches: the heuristic's, or the tuning aid
// DG_MEGA_MOE_WIDE_N = 16, 32 or 64 (read once per process) where the kernel has transposed tiles
inline int select_mega_moe_wide_n_min(const MegaMoEConfig& config) {
    static const int wide_n_override = read_env_choice("DG_MEGA_MOE_WIDE_N", {"16", "32", "64"});
    const int n = wide_n_override > 0 ? wide_n_override : config.wide_n_min;
    return mega_moe_wide_n_ok(config.mma_type, config.block_m, n) ? n : 64;
}

// Whether a call launches the kernel with the signals thread: the heuristic's choice, or the tuning
// aid DG_MEGA_MOE_SIGNALS_THREAD = 0 / 1 (read once per process) where the kernel can have one
inline bool select_mega_moe_signals_thread(const MegaMoEConfig& config) {
    static const int signals_override = read_env_choice("DG_MEGA_MOE_SIGNALS_THREAD", {"0", "1"});
    const bool on = signals_override >= 0 ? signals_override == 1 : config.signals_thread;
    return on and mega_moe_signals_thread_ok(config.mma_type, config.block_m);
}

// The weights-first choice set at run time (_C.set_mega_moe_weights_first: tests and benchmarks
// switch it within one process); -1: the environment's
inline std::atomic<int>& mega_moe_weights_first_override() {
    static std::atomic<int> choice{-1};
    return choice;
}

// Whether a call runs the weights-first kernel: where it can (mega_moe_ws_ok), unless turned off by
// the run-time override or else DG_MEGA_MOE_WEIGHTS_FIRST = 0 (read once per process). On by default
// for FP8 x FP8 and BF16: faster than the persistent kernel at n = 1 on every shape timed (H100: mid
// FP8 -11.7 %, BF16 -3.9 %, v4-flash FP8 -9.2 %, DeepSeek-V3 FP8 -1.1 %; docs/PERF.md session 51).
// FP8 x FP4 only when asked (= 1, or the override): correct, but at n = 1 faster than the persistent
// kernel at mid only (form 6), slower at v4-flash and DeepSeek-V3 (H100, docs/PERF.md session 52)
inline bool mega_moe_weights_first_by_default(MmaType mma_type) { return mma_type != MmaType::kFP8xFP4; }
inline bool select_mega_moe_weights_first(MmaType mma_type, int num_ranks, int num_experts, int num_tokens, int num_topk, int hidden,
                                          int intermediate_hidden, int max_smem_bytes) {
    static const int env_choice = read_env_choice("DG_MEGA_MOE_WEIGHTS_FIRST", {"0", "1"});
    const int set = mega_moe_weights_first_override().load(std::memory_order_relaxed);
    const int choice = set >= 0 ? set : env_choice;
    return (choice >= 0 ? choice == 1 : mega_moe_weights_first_by_default(mma_type)) and
           mega_moe_ws_ok(mma_type, num_ranks, num_experts, num_tokens, num_topk, hidden, intermediate_hidden, max_smem_bytes);
}

// The weights-first kernel's plan form (MegaMoEWsPlan: kMegaMoEWsWholeL1 | kMegaMoEWsWholeL2 |
// kMegaMoEWsL2AfterL1) set at run time (_C.set_mega_moe_ws_plan); -1: the tuning aid
// DG_MEGA_MOE_WS_PLAN = 0..7 (read once per process), else kMegaMoEWsDefaultPlan. The default: whole L1 tiles, whole L2 chunks, L2 weights after L1's (form 7: fastest of the eight at
// n = 1 of mid, v4-flash and DeepSeek-V3 shapes on an H100, docs/PERF.md session 51)
constexpr int kMegaMoEWsDefaultPlan = kMegaMoEWsWholeL1 | kMegaMoEWsWholeL2 | kMegaMoEWsL2AfterL1;
inline std::atomic<int>& mega_moe_ws_plan_override() {
    static std::atomic<int> form{-1};
    return form;
}
inline int select_mega_moe_ws_plan() {
    static_assert(kMegaMoEWsPlanForms == 8, "the forms DG_MEGA_MOE_WS_PLAN accepts");
    static const int env_form = read_env_choice("DG_MEGA_MOE_WS_PLAN", {"0", "1", "2", "3", "4", "5", "6", "7"});
    const int set = mega_moe_ws_plan_override().load(std::memory_order_relaxed);
    return set >= 0 ? set : env_form >= 0 ? env_form : kMegaMoEWsDefaultPlan;
}

// The weights-first kernel's L2 lead (MegaMoEParams::ws_l2_lead: under the plan's L2-after-L1 gate, an
// L1 chunk counts as issued with at most this many units left to issue) set at run time
// (_C.set_mega_moe_ws_l2_lead); -1: the tuning aid DG_MEGA_MOE_WS_L2_LEAD = 0..kMegaMoEWsMaxL2Lead
// (read once per process), else 0 (L2 weights after every L1 load: form 7 as timed in session 51)
constexpr int kMegaMoEWsMaxL2Lead = 64;
inline std::atomic<int>& mega_moe_ws_l2_lead_override() {
    static std::atomic<int> lead{-1};
    return lead;
}
inline int select_mega_moe_ws_l2_lead() {
    static const int env_lead = [] {
        const std::string v = jit::get_env("DG_MEGA_MOE_WS_L2_LEAD");
        if (v.empty()) return -1;
        size_t used = 0;
        int lead = -1;
        try {
            lead = std::stoi(v, &used);
        } catch (const std::exception&) {
            used = 0;
        }
        if (used != v.size() or lead < 0 or lead > kMegaMoEWsMaxL2Lead)
            jit::raise_invalid_argument("DG_MEGA_MOE_WS_L2_LEAD: expected an integer in [0, ", kMegaMoEWsMaxL2Lead, "], got '", v, "'");
        return lead;
    }();
    const int set = mega_moe_ws_l2_lead_override().load(std::memory_order_relaxed);
    return set >= 0 ? set : env_lead >= 0 ? env_lead : 0;
}

// The longest spin-wait bound a call accepts (~11.6 days; deep_gemm.set_timeout's range is (0, this]):
// the kernels count it in uint64 nanoseconds and some waits wait twice the bound
constexpr double kMegaMoEMaxTimeoutSeconds = 1e6;

// Peak HBM bandwidth (GB/s) of the current device, for the heuristic's bandwidth-dependent choices
// where the caller does not pass it (the Python launcher does, from its cached device info: no driver
// query per call); 0 (unknown) without a driver or a device, as on a CPU-only machine
inline int current_device_hbm_gbps() {
    if (not jit::has_cuda_driver()) return 0;
    try {
        return jit::hbm_gbps(jit::current_device_info());
    } catch (const std::exception&) {
        return 0;
    }
}

// The config a call launches (the heuristic's, with the L2 width, wide tiles and signals thread above) and its kernel variant.
// hbm_gbps: the GPU's peak HBM bandwidth, -1 the current device's (current_device_hbm_gbps)
inline std::pair<MegaMoEConfig, SM90MegaMoEVariant> select_sm90_mega_moe_variant(
        MmaType mma_type, int num_ranks, int num_experts, int num_topk, int hidden, int intermediate_hidden,
        int num_tokens, int num_sms, int max_smem_bytes, bool fast_math, bool ranks_share_gpu = false, int hbm_gbps = -1) {
    // The CTA pair: the heuristic's choice, or the tuning aid DG_MEGA_MOE_CTA_PAIR = 0 / 1 (read once per
    // process) where the kernel has the variant, with the call's wide_n_min (DG_MEGA_MOE_WIDE_N applies:
    // the pair's token passes of 32 with N = 16 / 32 tiles, or of 8 at 64). Not the heuristic's where ranks share the GPU (virtual
    // ranks, `ranks_share_gpu`): every rank's persistent grid must be resident at once, and each rank
    // picks its kernel from its own n, so a pair rank (two CTAs of half the shared memory an SM, which
    // the block scheduler may spread one an SM) beside a one-CTA-an-SM rank could leave CTAs without an
    // SM, waiting on each other until the spin-wait bound (seen: 4 virtual ranks, n = 64 / 7 / 0 / 1024)
    static const int pair_override = read_env_choice("DG_MEGA_MOE_CTA_PAIR", {"0", "1"});
    // BLOCK_M: the heuristic's, or the tuning aid DG_MEGA_MOE_BLOCK_M = 64 / 128 (read once per process)
    static const int block_m_override = read_env_choice("DG_MEGA_MOE_BLOCK_M", {"64", "128"});
    const int pair_choice = pair_override >= 0 ? pair_override : ranks_share_gpu ? 0 : -1;
    auto config = get_mega_moe_config(mma_type, num_ranks, num_experts, num_topk, hidden, intermediate_hidden,
                                      num_tokens, num_sms, max_smem_bytes, pair_choice,
                                      hbm_gbps >= 0 ? hbm_gbps : current_device_hbm_gbps(), max_of(block_m_override, 0));
    config.block_n_l2 = select_mega_moe_l2_block_n(config, hidden);
    config.wide_n_min = select_mega_moe_wide_n_min(config);
    config.signals_thread = select_mega_moe_signals_thread(config);
    if (select_mega_moe_weights_first(mma_type, num_ranks, num_experts, num_tokens, num_topk, hidden, intermediate_hidden, max_smem_bytes)) {
        // The most stages that fit, or at most the tuning aid DG_MEGA_MOE_WS_STAGES (read once per process)
        static const int ws_stages_cap = read_env_choice("DG_MEGA_MOE_WS_STAGES", {"3", "4", "5", "6", "7", "8"});
        static_assert(kMegaMoEWsMinStages == 3 and kMegaMoEWsMaxStages == 8, "the stage counts DG_MEGA_MOE_WS_STAGES accepts");
        config.num_stages = mega_moe_ws_stages(mma_type, hidden, intermediate_hidden, max_smem_bytes);
        if (ws_stages_cap > 0) config.num_stages = std::min(config.num_stages, ws_stages_cap);
        config.num_threads = mega_moe_ws_threads(mma_type);
        config.smem_bytes = mega_moe_ws_smem_bytes(mma_type, config.num_stages, hidden, intermediate_hidden);
        SM90MegaMoEVariant v{mma_type, config.block_m, config.num_stages, fast_math, config.block_n_l2};
        v.weights_first = true;
        return {config, v};
    }
    return {config, SM90MegaMoEVariant{mma_type, config.block_m, config.num_stages, fast_math, config.block_n_l2, config.wide_n_min,
                                       config.signals_thread, config.cta_pair}};
}

// Compile the variant a call with these arguments launches and, with `load`, load it into the
// current context and opt in to its shared memory: what the first launch would do. Loading a
// module may synchronize the context (CUDA lazy loading), so a launcher that starts several ranks
// whose kernels wait for each other (virtual ranks, one thread) loads every rank's kernel first:
// a load between two ranks' launches waits for the first rank, which waits for the second.
inline std::string prepare_sm90_mega_moe(MmaType mma_type, int num_ranks, int num_experts, int num_topk, int hidden,
                                         int intermediate_hidden, int num_tokens, int num_sms, int max_smem_bytes,
                                         bool fast_math, bool load, bool ranks_share_gpu = false, int hbm_gbps = -1) {
    const auto [config, variant] = select_sm90_mega_moe_variant(mma_type, num_ranks, num_experts, num_topk, hidden,
                                                                intermediate_hidden, num_tokens, num_sms, max_smem_bytes,
                                                                fast_math, ranks_share_gpu, hbm_gbps);
    const auto dir = variant.compile();
    if (load)
        jit::get_kernel(dir, "sm90_mega_moe").ensure_dynamic_smem(static_cast<uint32_t>(config.smem_bytes));
    return dir.string();
}

// Most K parts of a split-K L1 tile this process launches with: DG_MEGA_MOE_L1_SPLIT (tuning aid:
// 0 or 1 never split, 2, 4; read once) or else the heuristic's per-format cap
inline int mega_moe_l1_split_max(MmaType mma_type) {
    static const int override_max = read_env_choice("DG_MEGA_MOE_L1_SPLIT", {"0", "1", "2", "4"});
    return override_max >= 0 ? max_of(override_max, 1) : get_mega_moe_l1_split_max(mma_type);
}

// Whether the Mega MoE and staging kernels launch as programmatic dependents of the kernel before
// them on the stream (their setup then overlaps that kernel's tail; docs/KERNEL.md): on, unless
// the tuning aid DG_MEGA_MOE_PDL=0 (read once per process) turns it off
inline bool mega_moe_programmatic_launch() {
    static const int choice = read_env_choice("DG_MEGA_MOE_PDL", {"0", "1"});
    return choice != 0;
}

// What a launch derives from a call's fixed arguments (the buffers, shape, weights, GPU and kernel
// variant) and not from its tokens, outputs or stream: the loaded kernel, the parameter block without
// the per-call fields, the tensor maps and the grid. Encoding the maps (a driver call each, up to 13)
// and finding the kernel by its string key took ~3 us of each launch (H100 host, docs/PERF.md session
// 48), so a plan is built once per key and reused (sm90_mega_moe_plan); every field of it is a
// function of the key alone.
struct SM90MegaMoELaunchPlan {
    static constexpr int kNumMaps = 13;
    jit::Kernel* kernel = nullptr;
    MegaMoEParams params{};   // num_tokens, y, stats, clamp, timeout, host_status, trace: set per call
    std::array<CUtensorMap, kNumMaps> maps{};
    int num_maps = kNumMaps;           // the weights-first kernel takes 4
    jit::LaunchConfig launch_config;   // stream: set per call
};

// Everything a plan is made from: the current context (kernels are loaded per context), the call's
// fixed arguments and the config fields the plan reads (sm90_mega_moe_plan_key fills every entry)
inline constexpr int kSM90MegaMoEPlanKeyFields = 25;   // after the context, format, ranks, rank and buffers
using SM90MegaMoEPlanKey = std::array<int64_t, 4 + kMaxRanks + kSM90MegaMoEPlanKeyFields>;

inline SM90MegaMoEPlanKey sm90_mega_moe_plan_key(const SM90MegaMoEArgs& a, const MegaMoEConfig& c, const SM90MegaMoEVariant& v,
                                                 CUcontext context) {
    const auto fields = std::to_array<int64_t>({
        a.num_experts, a.num_max_tokens_per_rank, a.num_topk, a.hidden, a.intermediate_hidden, a.l1_weights,
        a.l1_weight_scales, a.l1_weight_deltas, a.l2_weights, a.l2_weight_scales, a.l2_weight_deltas, a.peers_on_this_gpu,
        v.block_m, v.num_stages, v.fast_math, v.block_n_l2, v.wide_n_min, v.signals_thread, v.cta_pair, c.num_sms,
        c.num_threads, c.smem_bytes, c.num_prefetch_stages, c.num_prefetch_stages_l2, v.weights_first});
    static_assert(std::tuple_size_v<decltype(fields)> == kSM90MegaMoEPlanKeyFields, "every field has its key entry");
    SM90MegaMoEPlanKey key{};
    size_t i = 0;
    key[i++] = static_cast<int64_t>(reinterpret_cast<uintptr_t>(context));
    key[i++] = static_cast<int64_t>(a.mma_type);
    key[i++] = static_cast<int64_t>(a.buffers.size());
    key[i++] = a.rank;
    for (int r = 0; r < kMaxRanks; ++r) key[i++] = r < static_cast<int>(a.buffers.size()) ? a.buffers[r] : 0;
    for (const int64_t x : fields) key[i++] = x;
    return key;
}

// Plans built in this process (tests: repeated calls reuse theirs)
inline std::atomic<int64_t>& num_sm90_mega_moe_plans_built() {
    static std::atomic<int64_t> count{0};
    return count;
}

inline SM90MegaMoELaunchPlan make_sm90_mega_moe_plan(const SM90MegaMoEArgs& a, const MegaMoEConfig& config,
                                                     const SM90MegaMoEVariant& variant) {
    const int num_ranks = static_cast<int>(a.buffers.size());
    SM90MegaMoELaunchPlan plan;
    ++num_sm90_mega_moe_plans_built();
    plan.kernel = &jit::get_kernel(variant.compile(), "sm90_mega_moe");
    MegaMoEParams& params = plan.params;
    params.layout = layout::MegaMoELayout(num_ranks, a.num_experts, a.num_max_tokens_per_rank, a.num_topk, a.hidden,
                                          a.intermediate_hidden, a.mma_type);
    for (int r = 0; r < num_ranks; ++r) params.buffers[r] = reinterpret_cast<void*>(a.buffers[r]);
    params.rank = a.rank;
    params.l1_weight_scales = reinterpret_cast<const float*>(a.l1_weight_scales);
    params.l2_weight_scales = reinterpret_cast<const float*>(a.l2_weight_scales);
    params.l1_weight_deltas = reinterpret_cast<const uint8_t*>(a.l1_weight_deltas);
    params.l2_weight_deltas = reinterpret_cast<const uint8_t*>(a.l2_weight_deltas);
    params.peers_on_this_gpu = a.peers_on_this_gpu ? 1 : 0;
    // Tuning aid (docs/KERNEL.md): DG_MEGA_MOE_PREFETCH_STAGES=k sets the weight prefetch of L1 and L2
    // tasks (at most all stages), =k1,k2 each; default the heuristic's
    static const std::pair<int, int> prefetch_override = [] {
        const std::string v = jit::get_env("DG_MEGA_MOE_PREFETCH_STAGES");
        if (v.empty()) return std::make_pair(-1, -1);
        const auto parse = [&](const std::string& s) {
            size_t used = 0;
            int value = -1;
            try { value = std::stoi(s, &used); } catch (const std::exception&) { used = 0; }
            if (s.empty() or used != s.size() or value < 0)
                jit::raise_invalid_argument("DG_MEGA_MOE_PREFETCH_STAGES: expected k or k1,k2 (non-negative integers), got '", v, "'");
            return value;
        };
        const size_t comma = v.find(',');
        if (comma == std::string::npos) return std::make_pair(parse(v), parse(v));
        return std::make_pair(parse(v.substr(0, comma)), parse(v.substr(comma + 1)));
    }();
    params.num_prefetch_stages = prefetch_override.first >= 0 ? std::min(prefetch_override.first, config.num_stages) : config.num_prefetch_stages;
    params.num_prefetch_stages_l2 = prefetch_override.second >= 0 ? std::min(prefetch_override.second, config.num_stages) : config.num_prefetch_stages_l2;
    params.l1_split_max = variant.cta_pair ? 1 : mega_moe_l1_split_max(a.mma_type);
    params.ws_plan = 0;   // per call (launch_sm90_mega_moe): the run-time override may change between calls
    params.ws_l2_lead = 0;   // the same
    // An FP8 x FP4 code block (8 KB, contiguous) is copied as 64 rows of 128 bytes, not as the
    // 128 weight rows of 64 bytes it holds: the same bytes land at the same shared-memory offsets
    // (unswizzled), with half the box rows for the TMA unit to walk per stage (-0.5 to -1.1 % at
    // every FP8 x FP4 decode row, docs/PERF.md session 20). DG_MEGA_MOE_FP4_CODE_ROW=64 (tuning
    // aid): the 64-byte rows, for A/B
    static const int code_row_override = read_env_choice("DG_MEGA_MOE_FP4_CODE_ROW", {"64", "128"});
    const uint64_t code_row = code_row_override > 0 ? code_row_override : 2 * kMegaMoEPackedRowBytes;
    params.fp4_code_box_rows = static_cast<int>(128 * kMegaMoEPackedRowBytes / code_row);

    plan.launch_config.grid = {static_cast<uint32_t>(config.num_sms), 1, 1};
    plan.launch_config.block = {static_cast<uint32_t>(config.num_threads), 1, 1};
    plan.launch_config.smem_bytes = static_cast<uint32_t>(config.smem_bytes);
    plan.launch_config.programmatic = mega_moe_programmatic_launch();
    const auto& lay = params.layout;
    const bool fp8 = is_fp8_activation(a.mma_type);
    const bool fp4 = a.mma_type == MmaType::kFP8xFP4;
    // FP8 x FP4: a stage of a 256-row tile (L1's gate/up pair, a narrow 256-wide L2 tile, a weights-first
    // tile) takes the two 128-row blocks of a pair with one copy for the codes: the codes as
    // [row blocks][K-blocks][8 KB as rows of code_row bytes] in boxes {code_row, 8192 / code_row, 1, 2}
    const auto pair_codes = [&](int64_t ptr, uint64_t k, uint64_t rows) {
        const uint64_t kbs = k / 128, block = 128 * kMegaMoEPackedRowBytes;
        return jit::make_tma<4>(reinterpret_cast<void*>(ptr), CU_TENSOR_MAP_DATA_TYPE_UINT8,
                                {jit::TmaDim{code_row, static_cast<uint32_t>(code_row), 0, "packed row bytes", "packed row bytes", "-"},
                                 jit::TmaDim{static_cast<uint64_t>(params.fp4_code_box_rows), static_cast<uint32_t>(params.fp4_code_box_rows),
                                             code_row, "block rows", "block rows", "packed row bytes"},
                                 jit::TmaDim{kbs, 1, block, "K-blocks", "one K-block", "block bytes"},
                                 jit::TmaDim{rows / 128, 2, kbs * block, "row blocks", "row-block pair", "row-block bytes"}},
                                CU_TENSOR_MAP_SWIZZLE_NONE);
    };
    if (variant.weights_first) {
        // x's rows (8-row boxes of the inputs; at least 8 rows, past n_max the buffer's next sections: only
        // columns of tokens >= n read them), the pairs' rows in the L2 pool (8-row boxes), 256-row weight tiles
        // (FP8 x FP4: the pair maps of their codes; the kernel copies their deltas itself)
        const auto dt = fp8 ? CU_TENSOR_MAP_DATA_TYPE_UINT8 : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16;
        const uint64_t act = activation_bytes(a.mma_type), h = a.hidden, i = a.intermediate_hidden, e = lay.num_local_experts;
        const uint32_t bk = static_cast<uint32_t>(mega_moe_block_k(a.mma_type)), n = kMegaMoEWsMaxPairs;
        const auto own = a.buffers[a.rank];
        plan.maps[0] = make_kmajor_tma(own + lay.x.offset, dt, h, std::max<uint64_t>(lay.num_max_tokens_per_rank, n), bk, n, h * act);
        plan.maps[1] = make_kmajor_tma(own + lay.l2_act.offset, dt, i, lay.num_pool_rows, bk, n, i * act);
        plan.maps[2] = fp4 ? pair_codes(a.l1_weights, h, e * 2 * i) : make_kmajor_tma(a.l1_weights, dt, h, e * 2 * i, bk, kMegaMoEWsTileRows, h * act);
        plan.maps[3] = fp4 ? pair_codes(a.l2_weights, i, e * h) : make_kmajor_tma(a.l2_weights, dt, i, e * h, bk, kMegaMoEWsTileRows, i * act);
        plan.num_maps = 4;
        return plan;
    }
    const auto dtype = fp8 ? CU_TENSOR_MAP_DATA_TYPE_UINT8 : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16;
    const uint64_t act = activation_bytes(a.mma_type);
    const uint32_t bk = static_cast<uint32_t>(mega_moe_block_k(a.mma_type));
    const auto own = a.buffers[a.rank];
    const uint64_t h = a.hidden, i = a.intermediate_hidden, e = lay.num_local_experts, rows = lay.num_pool_rows;
    CUtensorMap tm_l1_act = make_kmajor_tma(own + lay.l1_act.offset, dtype, h, rows, bk, config.block_m, h * act);
    // FP8 x FP4 weights: blocks of 128 rows x 64 packed bytes, one per 128 x 128 weight block and
    // contiguous ([E, N/128, K/128, 8192], transform.py), seen as rows of code_row bytes (above); a box is one
    // block (L2's one-block loads; the pair maps below take two), unswizzled (the math warpgroups expand it
    // into the swizzled E4M3 tile or, on narrow tiles, into wgmma A fragments; the transform permutes
    // each row's 64 bytes for those loads, mega_moe_fp4_packed_byte)
    const auto w_tma = [&](int64_t ptr, uint64_t k, uint64_t rows, uint32_t box_rows) {
        return fp4 ? make_kmajor_tma(ptr, CU_TENSOR_MAP_DATA_TYPE_UINT8, code_row, rows * (k / 128) * kMegaMoEPackedRowBytes / code_row,
                                     static_cast<uint32_t>(code_row), static_cast<uint32_t>(params.fp4_code_box_rows), code_row,
                                     CU_TENSOR_MAP_SWIZZLE_NONE)
                   : make_kmajor_tma(ptr, dtype, k, rows, bk, box_rows, k * act);
    };
    CUtensorMap tm_l1_w = w_tma(a.l1_weights, h, e * 2 * i, kMegaMoEBlockNL1);
    CUtensorMap tm_l2_act = make_kmajor_tma(own + lay.l2_act.offset, dtype, i, rows, bk, config.block_m, i * act);
    CUtensorMap tm_l2_w = w_tma(a.l2_weights, i, e * h, kMegaMoEBlockNL2);
    // FP8 x FP4 (pair_codes above): the deltas of a row-block pair in one copy too, as
    // [row blocks][K-blocks][128 x 4 bytes] in boxes {128, 1, 2} (32-bit elements). L1 stages are
    // always pairs (its code map is the pair map); L2 keeps its one-block map for the other tiles.
    // Other formats get placeholders (never read).
    const auto pair_deltas = [&](int64_t ptr, uint64_t k, uint64_t rows) {
        const uint64_t kbs = k / 128;
        return jit::make_tma<3>(reinterpret_cast<void*>(ptr), CU_TENSOR_MAP_DATA_TYPE_UINT32,
                                {jit::TmaDim{kMegaMoEDeltaBlockBytes / 4, kMegaMoEDeltaBlockBytes / 4, 0, "delta words", "delta words", "-"},
                                 jit::TmaDim{kbs, 1, kMegaMoEDeltaBlockBytes, "K-blocks", "one K-block", "delta block bytes"},
                                 jit::TmaDim{rows / 128, 2, kbs * kMegaMoEDeltaBlockBytes, "row blocks", "row-block pair", "row-block delta bytes"}},
                                CU_TENSOR_MAP_SWIZZLE_NONE);
    };
    if (fp4) tm_l1_w = pair_codes(a.l1_weights, h, e * 2 * i);
    CUtensorMap tm_l2_w_pair = fp4 ? pair_codes(a.l2_weights, i, e * h) : tm_l2_w;
    CUtensorMap tm_l1_d_pair = fp4 ? pair_deltas(a.l1_weight_deltas, h, e * 2 * i) : tm_l2_w;
    CUtensorMap tm_l2_d_pair = fp4 ? pair_deltas(a.l2_weight_deltas, i, e * h) : tm_l2_w;

    // Narrow decode tiles read only the first kMegaMoENarrowRows rows of an M-block's A tile: the same
    // pools in boxes of that many rows. Kernels without narrow tiles never read these parameters and
    // get the full-box maps (no extra encode on their launches)
    const bool narrow = mega_moe_has_narrow_tiles(config.block_m);
    CUtensorMap tm_l1_act_narrow =
        narrow ? make_kmajor_tma(own + lay.l1_act.offset, dtype, h, rows, bk, kMegaMoENarrowRows, h * act) : tm_l1_act;
    CUtensorMap tm_l2_act_narrow =
        narrow ? make_kmajor_tma(own + lay.l2_act.offset, dtype, i, rows, bk, kMegaMoENarrowRows, i * act) : tm_l2_act;

    // Transposed wide tiles of N = 16 / 32 (wide_n_min < 64) read that many rows of the A tile: boxes
    // of 16 and 32 rows; other kernels get the full-box maps (no extra encodes)
    const auto box = [&](int n, bool l1) {
        return config.wide_n_min <= n ? (l1 ? make_kmajor_tma(own + lay.l1_act.offset, dtype, h, rows, bk, n, h * act)
                                            : make_kmajor_tma(own + lay.l2_act.offset, dtype, i, rows, bk, n, i * act))
                                      : (l1 ? tm_l1_act : tm_l2_act);
    };
    CUtensorMap tm_l1_act_16 = box(16, true), tm_l2_act_16 = box(16, false), tm_l1_act_32 = box(32, true), tm_l2_act_32 = box(32, false);
    // The kernel's parameter order after the parameter block
    plan.maps = {tm_l1_act, tm_l1_w, tm_l2_act, tm_l2_w, tm_l1_act_narrow, tm_l2_act_narrow, tm_l2_w_pair, tm_l1_d_pair,
                 tm_l2_d_pair, tm_l1_act_16, tm_l2_act_16, tm_l1_act_32, tm_l2_act_32};
    return plan;
}

// Plans kept at most (a server has a few buffers, weight sets and variants; past this many the
// cache starts over rather than grow: plans are rebuilt as calls need them)
inline constexpr size_t kMaxSM90MegaMoEPlans = 256;

// The plan of a call, built on first use of its key and copied out (so that no reference outlives
// the lock). Distinct keys whose weights or buffers were freed stay cached until the cap: a key
// holds addresses only, never memory, and a later allocation at the same addresses with the same
// shapes gets the same (correct) plan.
inline SM90MegaMoELaunchPlan sm90_mega_moe_plan(const SM90MegaMoEArgs& a, const MegaMoEConfig& config,
                                                const SM90MegaMoEVariant& variant) {
    static std::mutex mutex;
    static std::map<SM90MegaMoEPlanKey, SM90MegaMoELaunchPlan> plans;
    const auto key = sm90_mega_moe_plan_key(a, config, variant, jit::ensure_context());
    {
        std::lock_guard<std::mutex> lock(mutex);
        if (auto it = plans.find(key); it != plans.end()) return it->second;
    }
    // Built outside the lock: compiling a variant takes seconds, and another thread's launch of a
    // ready plan need not wait for it (two threads building one key insert the same plan)
    SM90MegaMoELaunchPlan plan = make_sm90_mega_moe_plan(a, config, variant);
    std::lock_guard<std::mutex> lock(mutex);
    if (plans.size() >= kMaxSM90MegaMoEPlans) plans.clear();
    plans.emplace(key, plan);
    return plan;
}

inline MegaMoEConfig launch_sm90_mega_moe(const SM90MegaMoEArgs& a) {
    const int num_ranks = static_cast<int>(a.buffers.size());
    const auto [config, variant] = select_sm90_mega_moe_variant(a.mma_type, num_ranks, a.num_experts, a.num_topk, a.hidden,
                                                                a.intermediate_hidden, a.num_tokens, a.num_sms,
                                                                a.max_smem_bytes, a.fast_math, a.ranks_share_gpu, a.hbm_gbps);
    print_config_if_requested(config);
    SM90MegaMoELaunchPlan plan = sm90_mega_moe_plan(a, config, variant);
    MegaMoEParams& params = plan.params;
    params.num_tokens = a.num_tokens;
    params.y = reinterpret_cast<void*>(a.y);
    params.cumulative_local_expert_recv_stats = reinterpret_cast<int*>(a.stats);
    params.activation_clamp = a.activation_clamp > 0 and std::isfinite(a.activation_clamp)
                                  ? static_cast<float>(a.activation_clamp) : INFINITY;
    params.timeout_ns = static_cast<uint64_t>(a.timeout_s * 1e9);   // in (0, kMegaMoEMaxTimeoutSeconds]: the binding's check
    params.host_status = reinterpret_cast<uint64_t*>(a.host_status);
    params.trace = reinterpret_cast<uint64_t*>(a.trace);
    params.ws_plan = variant.weights_first ? select_mega_moe_ws_plan() : 0;
    params.ws_l2_lead = variant.weights_first ? select_mega_moe_ws_l2_lead() : 0;
    void* args[1 + SM90MegaMoELaunchPlan::kNumMaps] = {&params};
    for (int m = 0; m < plan.num_maps; ++m) args[1 + m] = &plan.maps[m];
    plan.launch_config.stream = reinterpret_cast<CUstream>(a.stream);
    jit::launch(*plan.kernel, plan.launch_config, args);
    return config;
}

// ---------------------------------------------------------------------------------------------
// Input staging (`SymmBuffer.stage`): a small kernel of its own, one variant per activation type
// Compiled once per process and activation type (FP8 quantizes, BF16 copies), and again after the
// compiler's settings change (jit::compile_generation: the remembered path is in the old cache)
inline std::filesystem::path compile_mega_moe_stage(bool fp8) {
    static std::mutex mutex;
    static std::filesystem::path compiled[2];
    static uint64_t generation[2];   // the compiler's when compiled[fp8] was found
    std::lock_guard<std::mutex> lock(mutex);
    const uint64_t now = jit::compile_generation();
    if (compiled[fp8].empty() or generation[fp8] != now) {
        std::ostringstream os;
        os << "#include <deep_gemm/impls/mega_moe_stage.cuh>\n\n"
           << "DG_DEFINE_MEGA_MOE_STAGE_KERNEL(mega_moe_stage, " << (fp8 ? "true" : "false") << ")\n";
        compiled[fp8] = jit::compile(fp8 ? "mega_moe_stage_fp8" : "mega_moe_stage_bf16", os.str());
        generation[fp8] = now;
    }
    return compiled[fp8];
}

inline void launch_mega_moe_stage(MmaType mma_type, const layout::MegaMoELayout& lay, int64_t buffer, int64_t x,
                                  int64_t x_row_stride, int64_t topk_idx, int64_t topk_weights, int num_tokens,
                                  int num_sms, int64_t stream) {
    const std::filesystem::path cubin = compile_mega_moe_stage(is_fp8_activation(mma_type));
    if (num_tokens == 0)
        return;
    auto& kernel = jit::get_kernel(cubin, "mega_moe_stage");
    MegaMoEStageParams params{lay, reinterpret_cast<void*>(buffer), reinterpret_cast<const void*>(x), x_row_stride,
                              reinterpret_cast<const int64_t*>(topk_idx), reinterpret_cast<const float*>(topk_weights),
                              num_tokens};
    void* args[] = {&params};
    jit::LaunchConfig config;
    config.grid = {static_cast<uint32_t>(std::min(num_tokens, 4 * num_sms)), 1, 1};
    config.block = {256, 1, 1};
    config.stream = reinterpret_cast<CUstream>(stream);
    config.programmatic = mega_moe_programmatic_launch();
    jit::launch(kernel, config, args);
}

}  // namespace deep_gemm::jit_kernels
