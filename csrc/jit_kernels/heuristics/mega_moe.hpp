#pragma once

// Config choice of the SM90 Mega MoE kernel: pure C++ (no CUDA), unit-tested through
// `deep_gemm._C.get_mega_moe_config` (tests/test_heuristics.py).
//
// The config becomes the kernel's template arguments, so everything here is a compile-time constant
// of one generated kernel; the only inputs are the layer shape, the caller's token count, the SMs the
// kernel may occupy and the shared memory of one SM.

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <sstream>
#include <stdexcept>
#include <string>
#include <unordered_set>

#include <deep_gemm/common/types.cuh>
#include <deep_gemm/impls/mega_moe_params.cuh>
#include <deep_gemm/layout/mega_moe.cuh>

namespace deep_gemm {

// Tile sizes come from the kernel's own header (deep_gemm/impls/mega_moe_params.cuh); only the
// heuristic's own bounds live here
namespace mega_moe_tiles {
// Threads of one warpgroup
constexpr int kNumWarpgroupThreads = 128;
// Pipelines shallower than this cannot overlap TMA with WGMMA; deeper ones stop paying off
constexpr int kMinStages = 2;
constexpr int kMaxStages = 8;
// Weight stages an FP8 x FP4 decode task (block_m 64) streams before its inputs are ready
constexpr int kFP4DecodePrefetchStages = 3;
// The same for an L1 task of FP8 x FP8 / BF16 decode (their L2 tasks stream all stages)
constexpr int kDecodeL1PrefetchStages = 2;
// Expected tokens per expert from which FP8 x FP4 decode launches the kernel with transposed tiles of
// N = 16 / 32 (6: ~15 % of the M-blocks hold more than 8 tokens at Poisson 6)
constexpr int kFP4WideTokensPerExpert = 6;
// The signals thread (FP8 x FP4 decode): from this many expected L1 + L2 tasks per SM (docs/PERF.md,
// session 22: -1.8 to -3.9 % at v4-flash n = 4 / 8 / 128, 5.8-31 tasks per SM, -1.6 / -5.0 / -2.6 %
// at mid n = 8 / 32 / 128, -1.9 % at deepseek-v3 n = 8; +4.2 % at v4-flash n = 2, 2.9 per SM, and
// +7 % at one token, 1.5)
constexpr int kSignalsThreadMinTasksPerSM = 4;
// FP8 / BF16 decode: 512-wide L2 tasks from this many expected tokens per local expert touched
// (docs/PERF.md, session 28)
constexpr int kL2WideTokensPerExpert = 8;
// Prefill (BLOCK_M 128), FP8 x FP8 and BF16: 256-wide L2 tasks (one K loop over a 256-row B tile:
// FP8 two 128-column wgmma halves per K-block as L1's gate and up, BF16 one N = 256 wgmma). BF16
// takes them at every prefill call: measured (docs/PERF.md, session 38, one H100, 128 -> 256) mid
// n = 1280 / 2048 / 4096 / 8192 -19.5 / -20.6 / -22.3 / -24 %, v4-flash n = 4096 / 8192 -12 / -19 %.
// FP8 x FP8 from this many expected 256-wide L2 tasks per SM: mid n = 4096 (15.5 per SM) -3.4 %,
// v4-flash n = 4096 / 8192 (31 / 62) -1.9 / -9.0 %, deepseek-v3 n = 4096 (54) -4.2 % (session 37);
// at 7.8 per SM (one M-block per expert) mid n = 2048 -2.2 % but n = 1280 +1.4 % (session 38)
constexpr int kPrefillL2WideMinTasksPerSM = 12;
// BLOCK_M 64 (decode tiles) up to this many expected tokens per local expert, 128 (prefill tiles)
// above (docs/PERF.md, session 39, one H100, BLOCK_M 64 -> 128): BF16 deepseek-v3 n = 2048 (64 per
// expert) -24 %, v4-flash n = 2048 (48) -3.7 %; FP8 x FP8 deepseek-v3 n = 2048 -12 %, mid n = 1024
// (64) and v4-flash n = 2048 (48) within the spread; FP8 x FP4 deepseek-v3 n = 2048 +28 % (its
// BLOCK_M 64 kernel runs such M-blocks as transposed N = 64 tiles, the expansion hidden), so it keeps
// 64 up to 64 per expert, the rule all formats had before (session 40: above 64, BLOCK_M 64 won only
// at deepseek-v3 n = 4096, -8 %, and lost at v4-flash n = 4096 / mid n = 4096, +9 / +12 %; BF16's 128
// won 1.6-2.4 % at v4-flash from 24 per expert but lost at mid: neither edge moved)
constexpr int mega_moe_block_m_64_max_tokens(MmaType mma_type) {
    return mma_type == MmaType::kBF16xBF16 ? 47 : mma_type == MmaType::kFP8xFP8 ? 63 : 64;
}
// FP8 x FP4 also takes BLOCK_M 64 above kFP4Block64BandLo and up to kFP4Block64BandHi expected tokens
// per local expert: there most experts get a second 128-row M-block that is mostly padding (with
// Poisson-like counts around 1.1-1.4 x 128, ~25 % fewer padded rows in M-blocks of 64), and the
// 128-row kernel streams and expands the whole weight tile for it. Measured (docs/PERF.md, session 47,
// one H100, BLOCK_M 128 -> 64, tokens per expert): deepseek-v3 144 / 160 / 176 -10.4 / -8.2 / -5.1 %,
// v4-flash -7.4 / -5.2 / -2.9 %, mid -2.5 / -1.2 / +2.3 %; outside the band 64 lost: at 96 +7.5 /
// +10.5 / +10 %, at 192 +1.5 / +3.3 % (deepseek-v3 / v4-flash), at 256 +6.7 / +6.9 / +11.6 %; at 128
// itself mixed (-4.0 / -1.3 / +3.4 %: mid n = 2048, a benchmark row, would lose), so the band is open there
constexpr int kFP4Block64BandLo = 128;
constexpr int kFP4Block64BandHi = 176;
// The heuristic's BLOCK_M for `num_routed_pairs` (token, expert) pairs expected over `num_experts`
constexpr int mega_moe_block_m(MmaType mma_type, int64_t num_routed_pairs, int num_experts) {
    const auto above = [&](int per_expert) { return num_routed_pairs > static_cast<int64_t>(per_expert) * num_experts; };
    if (not above(mega_moe_block_m_64_max_tokens(mma_type)))
        return 64;
    if (mma_type == MmaType::kFP8xFP4 and above(kFP4Block64BandLo) and not above(kFP4Block64BandHi))
        return 64;
    return 128;
}
// The CTA pair (FP8 x FP4 decode: two CTAs an SM, one math warpgroup each; docs/KERNEL.md): from this
// many expected L1 + L2 tasks per SM, and below kFP4WideTokensPerExpert expected tokens per expert
// (where the two-warpgroup kernel would run M-blocks of more than 8 tokens as N = 64 transposed
// tiles; the pair runs them as passes of 8 tokens, and has no N = 16 / 32 tiles). Measured
// (docs/PERF.md, session 33, two-warpgroup kernel -> pair): v4-flash n = 8 / 16 / 32 / 64 / 128 / 192
// -3.7 / -7.8 / -8.3 / -8.6 / -9.1 / -8.1 % (0.19-4.5 tokens per expert),
// deepseek-v3 n = 4 / 8 / 32 / 128 -6.1 / -6.3 / -7.4 / -7.2 %, mid n = 16 / 32 / 64 -9.6 / -10.6 /
// -11.4 %; even at v4-flash n = 2 / 4 (2.9 / 5.8 tasks per SM), +3.3 % at mid n = 8 (6.8), +34 % at
// one token (1.5); at 6 tokens per expert, against the N = 16 / 32 variant, deepseek-v3 +1.6 %,
// v4-flash -0.7 %, mid -6.1 % (left to that variant)
constexpr int kCtaPairMinTasksPerSM = 8;
// The CTA pair with N = 16 / 32 transposed tiles (token passes of 32: `_pair_w16`) where the
// two-warpgroup kernel takes them (from kFP4WideTokensPerExpert): up to this many expected tokens per
// expert, and from kCtaPairWideMinTasksPerSM expected tasks per SM. Measured (docs/PERF.md, session
// 35, two-warpgroup kernel -> pair, one H200): v4-flash n = 256 / 384 / 512 / 1024 (6 / 9 / 12 / 24
// tokens per expert, 62 tasks per SM) -2.6 / -2.2 / -2.7 / -7.1 %, deepseek-v3 n = 192 / 256 / 512
// (6 / 8 / 16, 85 per SM) -2.9 / -3.3 / -4.8 %; mid n = 96-512 (6-32, 13.6 per SM) +0.7 to +12.7 %;
// past the edge (one H100): deepseek-v3 n = 768 / 1024 (24 / 32) +5.9 / +31 %, v4-flash n = 1536
// (36) +38 %: M-blocks of more than 32 tokens take a second pass over their weights. Only on parts
// with at least kCtaPairWideMinHbmGBps of peak HBM bandwidth: on an H100 (3.35 TB/s, where these
// rows run at its HBM rate) the same rows measured +1.9 to +3.5 % (v4-flash n = 256 / 512 / 682,
// deepseek-v3 n = 192 / 512), against the H200's (4.9 TB/s) gains above
constexpr int kCtaPairWideMaxTokensPerExpert = 16;
constexpr int kCtaPairWideMinTasksPerSM = 32;
constexpr int kCtaPairWideMinHbmGBps = 4000;
// Shared memory of one SM (228 KB) and what the driver reserves per resident CTA (1 KB): each CTA of
// the pair gets half less that reserve
constexpr int kSM90SmemPerSM = 233472;
constexpr int kSM90SmemReservedPerCTA = 1024;
// Opt-in shared memory per block on every Hopper part the kernel targets (H100/H200: 227 KB)
constexpr int kSM90MaxSmemBytes = 232448;
}  // namespace mega_moe_tiles

struct MegaMoEConfig {
    MmaType mma_type;
    int block_m;               // 64 or 128 pool rows per M-block
    int num_math_warpgroups;   // 2: 64 rows each (block_m 128) or half the columns each (block_m 64)
    int block_n_l1;            // 256: 128 gate + 128 up columns
    int block_n_l2;            // L2 task width, a kernel variant: 128, or 256 / 512 (decode, 128-wide tasks outnumber the SMs; FP8 x FP8 / BF16 prefill 256)
    int wide_n_min;            // narrowest transposed wide tile, a kernel variant: 64, or 16 (FP8 x FP4 decode, many tokens per expert)
    bool signals_thread;       // FP8 x FP4 decode: a dispatch thread raises the math's task signals (a kernel variant, `_sig`)
    bool cta_pair;             // FP8 x FP4 decode: two CTAs an SM, one math warpgroup each (a kernel variant, `_pair`)
    int block_k;               // 128 (FP8) or 64 (BF16): one 128-byte swizzle row
    int num_stages;            // TMA -> WGMMA pipeline depth
    int num_prefetch_stages;   // weight stages an L1 task streams before its tokens are in (<= num_stages)
    int num_prefetch_stages_l2;   // the same for an L2 task, before its M-block's L1 is done
    int num_sms;               // CTAs of the persistent grid
    int num_experts_per_wave;  // local experts scheduled together
    int smem_bytes;            // dynamic shared memory of one CTA
    int num_threads;           // 128 * (1 + num_math_warpgroups)

    // Shared-memory breakdown (smem_bytes = stages * (A + B per stage) + epilogue + other)
    int smem_a_per_stage;
    int smem_b_per_stage;
    int smem_epilogue;
    int smem_barriers;         // every fixed byte but the epilogue (FP4 expanded tile, barriers, tables, alignment)

    bool operator==(const MegaMoEConfig&) const = default;

    std::string to_string() const {
        static constexpr const char* kNames[] = {"fp8xfp4", "fp8xfp8", "bf16xbf16"};
        std::ostringstream os;
        os << "MegaMoEConfig(mma_type=" << kNames[static_cast<int>(mma_type)] << ", block_m=" << block_m
           << ", block_n_l1=" << block_n_l1 << ", block_n_l2=" << block_n_l2 << ", wide_n_min=" << wide_n_min
           << ", signals_thread=" << (signals_thread ? 1 : 0) << ", cta_pair=" << (cta_pair ? 1 : 0) << ", block_k=" << block_k
           << ", num_stages=" << num_stages << ", num_prefetch_stages=" << num_prefetch_stages << ", num_prefetch_stages_l2=" << num_prefetch_stages_l2 << ", num_math_warpgroups=" << num_math_warpgroups
           << ", num_threads=" << num_threads << ", num_sms=" << num_sms
           << ", num_experts_per_wave=" << num_experts_per_wave << ", smem_bytes=" << smem_bytes
           << " (stage A " << smem_a_per_stage << " + B " << smem_b_per_stage << ", epilogue " << smem_epilogue
           << ", other " << smem_barriers << "))";
        return os.str();
    }
};

[[noreturn]] inline void throw_invalid_config_arg(const std::string& name, long long value, const std::string& expected) {
    std::ostringstream os;
    os << "Mega MoE config: " << name << " = " << value << " is invalid: expected " << expected;
    throw std::invalid_argument(os.str());
}

// The integer of `deep_gemm._C` calls as the enum (0 fp8xfp4, 1 fp8xfp8, 2 bf16xbf16), rejecting anything else
inline MmaType mega_moe_mma_type(int mma_type) {
    if (mma_type < static_cast<int>(MmaType::kFP8xFP4) or mma_type > static_cast<int>(MmaType::kBF16xBF16))
        throw_invalid_config_arg("mma_type", mma_type, "0 (fp8xfp4), 1 (fp8xfp8) or 2 (bf16xbf16)");
    return static_cast<MmaType>(mma_type);
}

// `num_expected_tokens_per_rank` is the caller's `n` (tokens this call), `num_sms` the SMs the
// persistent grid may use (not necessarily the whole GPU), `max_smem_bytes` the opt-in shared memory
// of one block (232448 on H100/H200). `cta_pair`: -1 the heuristic's choice, 0 never, 1 wherever
// the kernel has the variant (FP8 x FP4 decode whose half of an SM fits two stages). `hbm_gbps`: the
// GPU's peak HBM bandwidth in GB/s (H100 SXM 3352, H200 4917), 0 unknown: choices measured to win on
// one part and lose on the other are taken only where it is known (kCtaPairWideMinHbmGBps).
inline MegaMoEConfig get_mega_moe_config(MmaType mma_type, int num_ranks, int num_experts, int num_topk,
                                         int hidden, int intermediate_hidden, int num_expected_tokens_per_rank,
                                         int num_sms, int max_smem_bytes, int cta_pair = -1, int hbm_gbps = 0,
                                         int block_m = 0) {
    using namespace mega_moe_tiles;
    mega_moe_mma_type(static_cast<int>(mma_type));   // the one range check of the format
    if (num_ranks < 1 or num_ranks > kMaxRanks)
        throw_invalid_config_arg("num_ranks", num_ranks, "1 <= num_ranks <= " + std::to_string(kMaxRanks));
    if (num_experts <= 0 or num_experts % num_ranks != 0)
        throw_invalid_config_arg("num_experts", num_experts, "a positive multiple of num_ranks = " + std::to_string(num_ranks));
    if (num_topk <= 0 or num_topk > num_experts)
        throw_invalid_config_arg("num_topk", num_topk, "1 <= num_topk <= num_experts = " + std::to_string(num_experts));
    if (hidden <= 0 or hidden % kScaleGranularity != 0)
        throw_invalid_config_arg("hidden", hidden, "a positive multiple of " + std::to_string(kScaleGranularity));
    if (intermediate_hidden <= 0 or intermediate_hidden % kScaleGranularity != 0)
        throw_invalid_config_arg("intermediate_hidden", intermediate_hidden, "a positive multiple of " + std::to_string(kScaleGranularity));
    if (num_expected_tokens_per_rank < 0)
        throw_invalid_config_arg("num_tokens", num_expected_tokens_per_rank, "a non-negative token count");
    if (num_sms <= 0)
        throw_invalid_config_arg("num_sms", num_sms, "a positive number of SMs");
    if (max_smem_bytes <= 0)
        throw_invalid_config_arg("max_smem_bytes", max_smem_bytes, "a positive byte count (232448 on H100/H200)");
    if (cta_pair < -1 or cta_pair > 1)
        throw_invalid_config_arg("cta_pair", cta_pair, "-1 (the heuristic's choice), 0 or 1");
    if (hbm_gbps < 0)
        throw_invalid_config_arg("hbm_gbps", hbm_gbps, ">= 0 (0: unknown)");
    if (block_m != 0 and block_m != 64 and block_m != 128)
        throw_invalid_config_arg("block_m", block_m, "0 (the heuristic's choice), 64 or 128");

    MegaMoEConfig c{};
    c.mma_type = mma_type;
    const int num_local_experts = num_experts / num_ranks;

    // Expected tokens one local expert receives: each of the R ranks sends n * topk (token, expert)
    // pairs spread over E experts. Exact in int64 (n * R * topk < 2^31 * 8 * 2^31).
    const int64_t num_routed_pairs = static_cast<int64_t>(num_expected_tokens_per_rank) * num_ranks * num_topk;
    // BLOCK_M = 64 while an expert's tokens fit one WGMMA M of 64 (a 128-row block would be half
    // padding, and two 64-row M-blocks give the scheduler twice the parallelism per expert); 128 rows
    // read each expert's weights once where 64-row M-blocks would read them for each of its M-blocks,
    // which pays above mega_moe_block_m_64_max_tokens per expert: for BF16 and FP8 x FP8 before the
    // M-blocks of 64 are full (the expected count is a mean: at 48-64 many experts take two); FP8 x
    // FP4 also in a band above 128 (kFP4Block64BandLo)
    c.block_m = block_m != 0 ? block_m : mega_moe_block_m(mma_type, num_routed_pairs, num_experts);
    static_assert(layout::kMinBlockM <= 64 and 128 <= layout::kMaxBlockM and layout::kMaxBlockM % 128 == 0,
                  "the buffer's pools must be padded for both BLOCK_M choices");
    c.num_math_warpgroups = kMegaMoENumMathWarpgroups;   // block_m 64: the two split the columns
    c.num_threads = kNumWarpgroupThreads * (1 + c.num_math_warpgroups);  // warpgroup 0: TMA + dispatch/combine
    c.block_n_l1 = kMegaMoEBlockNL1;
    c.block_n_l2 = kMegaMoEBlockNL2;   // decided below, once the expected experts are known
    c.block_k = mega_moe_block_k(mma_type);

    // Shared memory, from the kernel's own budget (deep_gemm/impls/mega_moe_params.cuh). Per stage:
    // the A tile (block_m rows x one 128-byte swizzle row of K) with its token scales (FP8
    // activations), and the largest B tile (L1: 256 rows x 128 bytes; L2's 128-row tile fits in it,
    // and so does BF16's 256 x 64 x 2 B; FP4 stages the packed tile, 256 x 64 B, and its exponent
    // deltas instead) with its weight block scales (FP8 activations: 16 bytes). Fixed: FP4's expanded
    // E4M3 B tiles (prefill two, which also hold the epilogue tile; decode one, which with the
    // epilogue tile after it stages the transposed wide tiles' L2 rows), the epilogue
    // staging tile elsewhere (L2's padded BF16 block_m x 128), the
    // barriers / scheduler tables, and 1024 bytes to re-align the dynamic shared-memory base for
    // the 128B-swizzled tiles ("other" below: all fixed bytes but the epilogue).
    c.smem_a_per_stage = c.block_m * 128 + mega_moe_stage_sf_bytes(mma_type, c.block_m);
    c.smem_b_per_stage = mega_moe_stage_bytes(mma_type, c.block_m) + mega_moe_stage_extra_bytes(mma_type, c.block_m) - c.smem_a_per_stage;
    c.smem_epilogue = mega_moe_epilogue_smem_bytes(mma_type, c.block_m);   // 0 where it lies in the expanded tiles
    const int per_stage = c.smem_a_per_stage + c.smem_b_per_stage;
    int num_stages = kMaxStages;
    while (num_stages >= kMinStages and mega_moe_smem_bytes(mma_type, c.block_m, num_stages) > max_smem_bytes) --num_stages;
    if (num_stages < kMinStages) {
        std::ostringstream os;
        os << "Mega MoE config: max_smem_bytes = " << max_smem_bytes << " fits fewer than " << kMinStages
           << " pipeline stages of " << per_stage << " bytes (block_m = " << c.block_m
           << "); expected max_smem_bytes >= " << mega_moe_smem_bytes(mma_type, c.block_m, kMinStages);
        throw std::invalid_argument(os.str());
    }
    c.num_stages = num_stages;
    // Weight prefetch: a task claims its first stages for weights before its tokens (L1) or L1 outputs
    // (L2) are in. FP8 x FP4 decode streams 3 (of 6) in both: the deeper prefetch of the L2 tasks
    // competes with the L1 tasks' loads on the decode chain (measured: mid n = 1 -7.5 %, v4-flash
    // n = 1 -2 %, n = 8 / 128 within 1 %; docs/PERF.md session 9). FP8 and BF16 decode: L1 tasks 2,
    // L2 tasks all (5): the prefetch in flight slows the pull of the tokens L1 waits for (one token,
    // mid FP8 / BF16: 7.4 / 7.7 us with 5 and 5, 6.4 / 4.4 with 2 and 5, 2.8 / 1.5 with none), and
    // L2 tasks need theirs deep (-2.2 % at mid / v4-flash FP8 n = 1, -0.5 to -0.8 % elsewhere at
    // n = 1 / 8, session 18); prefill streams all stages in both
    const bool decode = c.block_m == 64;
    c.num_prefetch_stages = not decode ? num_stages : min_of(num_stages, mma_type == MmaType::kFP8xFP4 ? kFP4DecodePrefetchStages : kDecodeL1PrefetchStages);
    c.num_prefetch_stages_l2 = decode and mma_type == MmaType::kFP8xFP4 ? min_of(num_stages, kFP4DecodePrefetchStages) : num_stages;
    c.smem_bytes = mega_moe_smem_bytes(mma_type, c.block_m, num_stages);
    c.smem_barriers = c.smem_bytes - num_stages * per_stage - c.smem_epilogue;
    c.num_sms = num_sms;

    // Experts per wave: the L1 tasks of one local expert are its expected M-blocks times the
    // 2I / 256 N-blocks. Scheduling a wave of experts together keeps the weights of a few experts hot
    // in L2 cache while still handing every SM a task; take the fewest experts whose tasks cover all
    // SMs once, so small experts (decode) are batched and large ones (prefill) run one at a time.
    const int64_t expected_mblocks = max_of<int64_t>(1, ceil_div<int64_t>(num_routed_pairs, static_cast<int64_t>(c.block_m) * num_experts));
    const int64_t l1_tasks_per_expert = expected_mblocks * (2 * static_cast<int64_t>(intermediate_hidden) / c.block_n_l1);
    c.num_experts_per_wave = static_cast<int>(min_of<int64_t>(num_local_experts, ceil_div<int64_t>(num_sms, l1_tasks_per_expert)));

    // L2 task width (a kernel variant: kL2BlockN). Decode (BLOCK_M = 64) whose 128-wide L2 tasks would
    // outnumber the SMs: 256-wide tasks, so the L2 phase takes fewer waves (v4-flash at one token: 192
    // tasks of 128 on 132 SMs leave a second round to 60 CTAs) and each task's fixed costs are paid
    // half as often; FP8 x FP4's transposed tiles (M-blocks of more than 8 tokens) also expand one
    // 64-row M tile while the other's wgmmas run (v4-flash n = 512: -23 %, mid n = 256: -17 %
    // against 128-wide tasks). FP8 and BF16 at 8 or more expected tokens per expert (wide M-blocks
    // next to the narrow ones): 512-wide tasks, a wide M-block's four 128-row passes under one
    // ticket (mid n = 128 / 256 / 512 FP8: -1.5 to -3 / -2 / -1.6 % against 256-wide, BF16 n = 256
    // -2 %; below 8 tokens per expert 512 loses: mid BF16 n = 8 +7 %). FP8 x FP4 stays at 256 there (512
    // within 1 % at n >= 32, +2.6 % at mid n = 8). docs/PERF.md, session 28. Per rank: its local
    // experts touched (at most E / R, at most the pairs it receives, n * topk on average) against
    // its own SMs.
    // One wave: where the L1 tasks fit the SMs (L1 is then a single round) and the 256-wide L2 tasks
    // would not but 512-wide ones would, every format takes 512: the L2 phase in one round of
    // two-pass tasks instead of two rounds, the second on a fraction of the SMs (deepseek-v3 at one
    // token: 128 L1 tasks, 224 L2 tasks of 256 or 112 of 512 on 132 SMs; FP8 -1.9 %, FP8 x FP4
    // -1.3 %, session 29 / 30). Without the L1 condition it loses (v4-flash n = 2, mid n = 4: +4 to
    // +14 %: L1 in two rounds already staggers the L2 tasks' starts).
    const int64_t pairs_per_rank = max_of<int64_t>(1, ceil_div<int64_t>(num_routed_pairs, num_ranks));
    const int64_t experts_touched = min_of<int64_t>(num_local_experts, pairs_per_rank);
    const int64_t l2_tasks_128 = experts_touched * expected_mblocks * (hidden / kMegaMoEBlockNL2);
    if (c.block_m == 64 and l2_tasks_128 > num_sms and hidden % (2 * kMegaMoEBlockNL2) == 0) {
        c.block_n_l2 = 2 * kMegaMoEBlockNL2;
        const bool wide_mblocks = pairs_per_rank >= kL2WideTokensPerExpert * experts_touched;
        const int64_t l1_tasks = experts_touched * l1_tasks_per_expert;
        const bool one_wave = l1_tasks <= num_sms and l2_tasks_128 > 2 * static_cast<int64_t>(num_sms) and
                              l2_tasks_128 <= 4 * static_cast<int64_t>(num_sms);
        if (hidden % (4 * kMegaMoEBlockNL2) == 0 and (one_wave or (mma_type != MmaType::kFP8xFP4 and wide_mblocks)))
            c.block_n_l2 = 4 * kMegaMoEBlockNL2;
    }

    // Prefill: 256-wide L2 tasks, BF16 always, FP8 x FP8 where an SM runs many (kPrefillL2WideMinTasksPerSM)
    if (c.block_m == 128 and mega_moe_l2_block_n_ok(mma_type, c.block_m, 2 * kMegaMoEBlockNL2) and hidden % (2 * kMegaMoEBlockNL2) == 0 and
        (mma_type == MmaType::kBF16xBF16 or l2_tasks_128 / 2 >= static_cast<int64_t>(kPrefillL2WideMinTasksPerSM) * num_sms))
        c.block_n_l2 = 2 * kMegaMoEBlockNL2;

    // FP8 x FP4 decode runs M-blocks of more than 8 tokens as transposed tiles of N = 64, or with the
    // kernel variant of N = 16 / 32 / 64 by the M-block's tokens, whose tensor work and promotion follow
    // the tokens (v4-flash n = 512: -17 %, mid n = 128: -9 %) but whose code slows the narrow tiles by
    // ~1 % (v4-flash n = 8 / 128): the variant from kFP4WideTokensPerExpert expected tokens per
    // local expert on (docs/PERF.md, session 17)
    c.wide_n_min = 64;
    if (mma_type == MmaType::kFP8xFP4 and c.block_m == 64 and
        num_routed_pairs >= static_cast<int64_t>(kFP4WideTokensPerExpert) * num_experts)
        c.wide_n_min = 16;

    // The signals thread (a kernel variant of FP8 x FP4 decode, kSignalsThread): worth it where a
    // CTA runs many tasks, each boundary paying the release fence and the L2 count's returning
    // atomic in warp 0; at a few tasks per CTA the extra hop lies on the L1 -> L2 chain
    const int64_t expected_tasks = experts_touched * expected_mblocks *
                                   (2 * static_cast<int64_t>(intermediate_hidden) / c.block_n_l1 + hidden / c.block_n_l2);
    c.signals_thread = mma_type == MmaType::kFP8xFP4 and c.block_m == 64 and
                       expected_tasks >= static_cast<int64_t>(kSignalsThreadMinTasksPerSM) * num_sms;

    // The CTA pair (a kernel variant of FP8 x FP4 decode, kCtaPair): two CTAs an SM, each one math
    // warpgroup that runs both halves of a tile, so one CTA's task boundary (epilogue, signals, the
    // next task's first stage) runs under the other's K-loop. Each CTA has half the SM's shared memory
    // (decode FP8 x FP4: 2 stages) and every M-block runs as token passes, never split-K: passes of 8
    // tokens as narrow tiles (wide_n_min 64), or with wide_n_min 16 / 32 passes of 32 tokens, each a
    // narrow or an N = 16 / 32 transposed tile. The heuristic picks it where an SM runs many tasks of
    // M-blocks of a few tokens (kCtaPairMinTasksPerSM), and with the N = 16 / 32 tiles where an SM
    // runs many tasks of M-blocks of at most ~32 tokens (kCtaPairWideMinTasksPerSM,
    // kCtaPairWideMaxTokensPerExpert: past them a second token pass re-reads the weights) on a GPU
    // with H200-class HBM (kCtaPairWideMinHbmGBps)
    c.cta_pair = false;
    const int pair_smem = min_of(max_smem_bytes, kSM90SmemPerSM / 2 - kSM90SmemReservedPerCTA);
    const bool pair_fits = mega_moe_smem_bytes(mma_type, c.block_m, kMinStages) <= pair_smem;
    const bool pair_ok = mega_moe_cta_pair_ok(mma_type, c.block_m, 64) and pair_fits;
    const bool pair_narrow = c.wide_n_min == 64 and expected_tasks >= static_cast<int64_t>(kCtaPairMinTasksPerSM) * num_sms;
    const bool pair_wide = c.wide_n_min == 16 and hbm_gbps >= kCtaPairWideMinHbmGBps and
                           expected_tasks >= static_cast<int64_t>(kCtaPairWideMinTasksPerSM) * num_sms and
                           num_routed_pairs <= static_cast<int64_t>(kCtaPairWideMaxTokensPerExpert) * num_experts;
    const bool pair_wanted = pair_narrow or pair_wide;
    if (pair_ok and (cta_pair == 1 or (cta_pair == -1 and pair_wanted))) {
        int stages = kMaxStages;
        while (mega_moe_smem_bytes(mma_type, c.block_m, stages) > pair_smem) --stages;   // >= kMinStages (pair_fits)
        c.cta_pair = true;   // with the heuristic's wide_n_min: 64 below 6 tokens per expert, 16 from there
        c.num_stages = stages;
        c.num_prefetch_stages = min_of(c.num_prefetch_stages, stages);
        c.num_prefetch_stages_l2 = min_of(c.num_prefetch_stages_l2, stages);
        c.smem_bytes = mega_moe_smem_bytes(mma_type, c.block_m, stages);
        c.smem_barriers = c.smem_bytes - stages * per_stage - c.smem_epilogue;
        c.num_math_warpgroups = 1;
        c.num_threads = kNumWarpgroupThreads * 2;
        c.num_sms = 2 * num_sms;   // CTAs of the grid: two an SM
    }
    return c;
}

// Most K parts of a split-K L1 tile (the kernel splits a decode call's narrow L1 tiles into 1, 2 or
// 4 parts, fewest rounds x K-blocks per part: docs/KERNEL.md). Measured, same-GPU A/B
// (docs/PERF.md, session 8): two parts are faster for FP8 x FP4 (-8 to -11 % at mid, one token)
// and BF16 (-5 %), whose narrow K-blocks cost more math (E2M1 expansion) or come twice as many per
// tile; FP8 x FP8 was slower (+1 to +3 %: its 16 K-blocks per tile already keep HBM near its rate
// once split) and four parts were slower in every format where the rule picked them (v4-flash at
// one token: FP8 +5 %, FP8 x FP4 +11 %). So: FP8 x FP8 never splits, the others up to two parts.
inline int get_mega_moe_l1_split_max(MmaType mma_type) {
    return mma_type == MmaType::kFP8xFP8 ? 1 : 2;
}

// Prints `config` to stdout when `DG_PRINT_CONFIGS=1`, once per distinct config for the life of the
// process (a serving loop would otherwise print on every call). Returns whether it printed.
inline bool print_config_if_requested(const MegaMoEConfig& config) {
    const char* env = std::getenv("DG_PRINT_CONFIGS");
    if (env == nullptr or std::string(env) != "1")
        return false;
    static std::mutex mutex;
    static std::unordered_set<std::string> printed;
    const std::string text = config.to_string();
    std::lock_guard<std::mutex> lock(mutex);
    if (not printed.insert(text).second)
        return false;
    std::printf("[deep_gemm] %s\n", text.c_str());
    std::fflush(stdout);
    return true;
}

}  // namespace deep_gemm
