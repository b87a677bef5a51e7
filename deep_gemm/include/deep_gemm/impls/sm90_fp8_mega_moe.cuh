#pragma once

// The SM90 Mega MoE kernel: one persistent launch per rank does
//   count/reserve -> pull -> L1 GEMM + SwiGLU (+clamp) x top-k weight (+FP8 re-quantization)
//   -> L2 GEMM -> write-back into the source rank's combine slots -> combine into y.
// FP8 x FP8 (per-128 FP32 promotion) and BF16 x BF16 share everything but the MMA loop.
//
// Scheduling: a dynamic task queue per rank (an atomic counter in the workspace). Task indices are
// ordered so that every task depends only on tasks with smaller indices of its own rank or on
// other ranks' progress:
//     [pull: M] [L1: M x I/128] [L2: M x H/kL2BlockN] [combine: ceil(n / kCombineTokens)]
// A CTA claims a task only when it is ready to run it, so a CTA that waits (on an M-block's
// arrival counter, on L1 completion, on peers) waits for work that a running CTA already holds:
// the kernel completes even when only some of its CTAs are resident (other streams on the GPU).
//
// Roles (warpgroup 0 is the producer side, warpgroups 1.. are math):
//   warp 0, one lane   scheduler (claims tasks, feeds the task ring) + TMA producer
//   warps 1..3         dispatch: pull tasks (copy routed tokens into the L1 pool)
//   math warpgroups    wgmma, promotion, epilogues (64 rows each, or split columns of 64 rows), combine
//
// Every spin-wait is bounded (params.timeout_ns); on timeout or a fatal error the kernel records a
// status word, every CTA leaves, and the host raises (DESIGN.md §6).

#include <cstddef>
#include <type_traits>

#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include "../mma/sm90_wgmma.cuh"
#include "../ptx/sm90.cuh"
#include "mega_moe_params.cuh"

namespace deep_gemm::sm90_mega_moe {

using namespace deep_gemm::ptx;
namespace L = deep_gemm::layout;

constexpr int kNumDispatchWarps = 3;
constexpr int kNumDispatchThreads = kNumDispatchWarps * 32;
// Named barrier ids (0 is __syncthreads)
constexpr int kBarrierDispatch = 1;
constexpr int kBarrierMathBase = 2;  // + math warpgroup index (2, 3)
constexpr int kBarrierMathAll = 4;   // every math warpgroup (FP4 tile expansion, split-column exchange)
// bar.red decisions (leave on abort) get barriers of their own, apart from those that order data
constexpr int kBarrierDispatchDecide = 5;
constexpr int kBarrierMathDecide = 6;   // + math warpgroup (6, 7) when each decides alone
// Prefill combine (bulk): each math warpgroup's buffers are refilled after a barrier of its own
// (8, 9), never one across warpgroups: on abort each may leave its task loop alone
constexpr int kBarrierCombineBase = 8;
// Registers per thread the kernel is launched with: __launch_bounds__(384, 1) gives each thread
// 65536 / 384 rounded down to a multiple of 8. `setmaxnreg` only moves registers between the
// warpgroups of this pool (a CTA's 384 x 168): an increase the pool cannot cover waits forever.
constexpr int kLaunchRegisters = 168;
// The CTA-pair variant (DG_MEGA_MOE_CTA_PAIR defined before this header; docs/KERNEL.md "Two CTAs
// per SM"): one math warpgroup, 256 threads, two CTAs an SM, 128 registers a thread (Kernel::kCtaPair)
#ifndef DG_MEGA_MOE_CTA_PAIR
#define DG_MEGA_MOE_CTA_PAIR 0
#endif
// How often a spin loop looks at the global status word and the clock
constexpr uint32_t kPollMask = 63;
// Suspend-time hints (ns) of the waits that are mostly idle: a role waiting for its next task in
// the ring (the dispatch warps see every task, and pull only a few), and the producer waiting for a
// free stage (the math is the slow side of the ring). The default try_wait comes back after ~70
// cycles, so those waits spun through a fifth of the kernel's instructions at FP8 x FP4 decode
// (Nsight Compute, docs/PERF.md), issue slots taken from the math warps of the same scheduler. A
// suspended thread wakes when the phase completes; the hint only bounds the sleep (and so, times
// kPollMask, how late an idle role sees an abort).
constexpr uint32_t kRingSuspendNs = 2000;
constexpr uint32_t kStageSuspendNs = 2000;
// The trace's task log (MegaMoEParams::trace, scripts/trace.py --tasks): a kernel variant of its own
#ifndef DG_MEGA_MOE_TASK_LOG
#define DG_MEGA_MOE_TASK_LOG 0
#endif
constexpr bool kTaskLog = DG_MEGA_MOE_TASK_LOG != 0;
// Level 1 also stamps the first K-blocks of each CTA's last L1 task; level 2 ("light") keeps the
// per-task stamps only, whose cost is per task, not per K-block
constexpr bool kTaskLogKBlocks = DG_MEGA_MOE_TASK_LOG == 1;
// The trace's K-block stamps of each CTA's first L1 task (kTraceKbReady / kTraceKbIssue): off in the light log
constexpr bool kTraceKBlockStamps = DG_MEGA_MOE_TASK_LOG != 2;

// The signals thread (FP8 x FP4 decode kernels, the `_sig` variant the heuristic picks where a CTA
// runs many long tasks: settle_signals)
#ifndef DG_MEGA_MOE_SIGNALS_THREAD
#define DG_MEGA_MOE_SIGNALS_THREAD 0
#endif
constexpr bool kSignalsThreadBuild = DG_MEGA_MOE_SIGNALS_THREAD != 0;

struct SharedControl {
    int first_task;
    int count_slice;   // the count slice this CTA claimed last (kControlCountClaim)
    int count_last;    // this CTA finished the count's last slice: it publishes the counts
    int late;          // peers already moved to the next call: nothing left here for this CTA
    int abort;         // a fatal error was seen: leave
    int is_last_cta;
    int num_mblocks;
    uint32_t epoch;
    // Written by the producer when it stops arming stages (abort, or done): stages from armed_final
    // on are never armed; stages in [dead_from, armed_final) were completed with A tiles of no
    // meaning (the drain). The math's stage waits decide on these, so every thread of a group
    // decides alike without a barrier (the same stage index, the same words after the same wait).
    uint32_t armed_final;
    uint32_t dead_from;
    int l1_split;      // K parts per L1 tile this call (1, 2 or 4), decided alike by every CTA
    int split_last;    // the math's split-K exchange: this CTA finished the tile's last part
    unsigned long long trace_first;   // trace slots stamped so far (first-only stamps, scripts/trace.py)
    uint32_t l2_owed_count[2];        // prefill kernels: L2 tasks done and not yet counted, per math warpgroup (kBatchL2Counts)
};
static_assert(sizeof(SharedControl) <= 64, "the 64 bytes of scalars in mega_moe_control_smem_bytes");
static_assert(kTraceTaskBase <= 64, "one bit of SharedControl::trace_first per first-only trace slot");

// Record the first error of the call (own buffer + host mirror); fatal ones also stop every CTA
__device__ __forceinline__ void report(const MegaMoEParams& p, StatusCode code, Phase phase, uint32_t rank,
                                       uint64_t detail, bool fatal, SharedControl* ctrl) {
    auto* status = p.layout.get_ptr<unsigned long long>(p.buffers[p.rank], p.layout.status);
    const uint64_t word = make_status(code, phase, rank, blockIdx.x, detail);
    if (atomicCAS(&status[L::kStatusError], 0ull, word) == 0ull and p.host_status != nullptr)
        reinterpret_cast<volatile uint64_t*>(p.host_status)[L::kStatusError] = word;   // mirror: same slots
    if (fatal) {
        atomicExch(&status[L::kStatusAbort], 1ull);
        if (p.host_status != nullptr) reinterpret_cast<volatile uint64_t*>(p.host_status)[L::kStatusAbort] = 1;
        if (ctrl != nullptr) *reinterpret_cast<volatile int*>(&ctrl->abort) = 1;
    }
    __threadfence_system();
}

// Spin until `ready()`; false if the call was aborted (by this wait timing out or anyone else)
template <typename Ready>
__device__ __forceinline__ bool bounded_wait(const MegaMoEParams& p, SharedControl* ctrl, Phase phase, uint32_t peer, Ready&& ready) {
    if (ready()) return true;
    const auto* abort_word = p.layout.get_ptr<uint64_t>(p.buffers[p.rank], p.layout.status) + L::kStatusAbort;
    const uint64_t start = globaltimer_ns();
    for (uint32_t n = 1;; ++n) {
        if (ready()) return true;
        if ((n & kPollMask) == 0) {
            if (*reinterpret_cast<volatile int*>(&ctrl->abort) or ld_volatile(abort_word) != 0) {
                *reinterpret_cast<volatile int*>(&ctrl->abort) = 1;
                return false;
            }
            if (globaltimer_ns() - start > p.timeout_ns) {
                report(p, StatusCode::kTimeout, phase, peer, n, true, ctrl);
                return false;
            }
        }
    }
}

// fast: MUFU exp2 + approximate division (~2 ulp, far below the FP8 step); exact: IEEE expf and
// division, whose slow paths are subroutine calls (a separate kernel variant, so the fast one stays lean).
// The exp2 flushes subnormals (`.ftz`): __expf's non-ftz form wraps each MUFU.EX2 in three
// instructions (a compare, a halving, a squaring) that keep results below 2^-126 subnormal, and
// 1 + e rounds every such e to 1 all the same, so silu's value is unchanged
template <bool kFastMath>
__device__ __forceinline__ float silu(float g) {
    if constexpr (kFastMath) {
        float e;
        asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(e) : "f"(g * -1.4426950408889634f));
        return __fdividef(g, 1.0f + e);
    } else {
        return g / (1.0f + expf(-g));
    }
}

// The kernel's TMA descriptors (__grid_constant__ parameters): activation pools (BLOCK_M-row boxes,
// and kMegaMoENarrowRows-row boxes for narrow tiles) and weights
// FP8 x FP4 also: a 128-row block pair's codes (L1: l1_w itself; L2: l2_w_pair) and deltas in one
// box each (other formats get placeholders they never read)
struct TensorMaps {
    const CUtensorMap *l1_act, *l1_w, *l2_act, *l2_w, *l1_act_narrow, *l2_act_narrow, *l2_w_pair, *l1_d_pair, *l2_d_pair;
    // 16- and 32-row boxes of the activation pools: the A tiles of transposed wide tiles of N = 16 / 32
    // (kernels with wide_n_min < 64; others get the full-box maps and never read these)
    const CUtensorMap *l1_act_16, *l2_act_16, *l1_act_32, *l2_act_32;
};

// kL2BlockN: the L2 task width (mega_moe_params.cuh), a variant of its own so that the 128-wide
// kernel carries no code of the 256-wide tasks (compiled in, they slowed it: docs/KERNEL.md)
// kWideNMin: the narrowest transposed wide tile (FP8 x FP4 decode; mega_moe_wide_n_ok), a variant too
template <MmaType kMmaType, int BLOCK_M, int kNumStages, bool kFastMath, int kL2BlockN, int kWideNMin>
struct Kernel {
    static_assert(BLOCK_M == 64 or BLOCK_M == 128, "one or two math warpgroups of 64 rows");
    static_assert(mega_moe_l2_block_n_ok(kMmaType, BLOCK_M, kL2BlockN), "L2 tasks: 128 wide, 256 / 512 wide with BLOCK_M = 64, or 256 wide FP8 / BF16 with BLOCK_M = 128");
    static_assert(mega_moe_wide_n_ok(kMmaType, BLOCK_M, kWideNMin), "transposed tiles below N = 64: FP8 x FP4 decode only");
    static_assert(L::kMaxBlockM % BLOCK_M == 0 and BLOCK_M >= L::kMinBlockM, "pools are padded for kMinBlockM..kMaxBlockM");
    static_assert(kNumStages >= 2, "pipeline needs at least double buffering");

    static constexpr bool kFP8 = is_fp8_activation(kMmaType);          // FP8 activations (and FP8 WGMMA)
    static constexpr bool kFP4 = kMmaType == MmaType::kFP8xFP4;        // weights E2M1, expanded in smem
    static constexpr int kActBytes = activation_bytes(kMmaType);
    // Two math warpgroups: BLOCK_M = 128 gives each 64 rows; BLOCK_M = 64 splits the columns
    // The CTA pair (FP8 x FP4 decode built with DG_MEGA_MOE_CTA_PAIR): a constant of the template's
    // parameters, so that the two-warpgroup kernels never instantiate the pair's `if constexpr` code
    static constexpr bool kCtaPair = DG_MEGA_MOE_CTA_PAIR != 0 and kMmaType == MmaType::kFP8xFP4;
    static_assert(DG_MEGA_MOE_CTA_PAIR == 0 or kCtaPair, "the CTA pair: FP8 x FP4 decode kernels only");
    static constexpr int kNumMathWGs = kCtaPair ? 1 : kMegaMoENumMathWarpgroups;
    static constexpr int kCtasPerSM = kCtaPair ? 2 : 1;
    static constexpr int kHalves = 2 / kNumMathWGs;   // a tile's warpgroup halves one math warpgroup runs
    static_assert(not kCtaPair or mega_moe_cta_pair_ok(kMmaType, BLOCK_M, kWideNMin),
                  "the CTA pair: FP8 x FP4 decode kernels only, every M-block as token passes of narrow or N = 16 / 32 tiles");
    static constexpr bool kSplitN = BLOCK_M == 64;
    // FP8 x FP4 decode: M-blocks of more than 8 tokens run transposed (weights as register A, tokens
    // as N = BLOCK_M; transposed_l1_mainloop), not as wide tiles over an expanded E4M3 tile
    static constexpr bool kTransposedWide = kFP4 and kSplitN;
    static constexpr bool kWideN16 = kWideNMin <= 16, kWideN32 = kWideNMin <= 32;   // transposed tiles of N = 16 / 32 (else 64)
    static_assert(kSplitN == mega_moe_has_narrow_tiles(BLOCK_M), "the host builds the narrow A tensor maps by this rule");
    static constexpr int kNumThreads = 128 * (1 + kNumMathWGs);
    static constexpr int BLOCK_K = mega_moe_block_k(kMmaType);      // one 128-byte swizzle row
    static constexpr int kABytes = BLOCK_M * 128;
    static constexpr int kNarrowABytes = kMegaMoENarrowRows * 128;   // A box of a narrow tile
    static constexpr int kBBytesL1 = kMegaMoEBlockNL1 * 128;
    static constexpr int kBBytesL2 = kMegaMoEBlockNL2 * 128;
    // An L2 task of a narrow or transposed M-block runs kL2Passes passes of kL2PassN rows (128 or
    // 256: one B tile, kL2Tiles 128-column tiles) over all of I's K-blocks; a 512-wide task is two
    // 256-row passes. A wide M-block's task runs kL2WidePasses passes of 128 rows.
    static constexpr int kL2PassN = kL2BlockN < 2 * kMegaMoEBlockNL2 ? kL2BlockN : 2 * kMegaMoEBlockNL2;
    static constexpr int kL2Tiles = kL2PassN / kMegaMoEBlockNL2;       // 128-column tiles per pass
    static constexpr int kL2Passes = kL2BlockN / kL2PassN;
    static constexpr int kL2WidePasses = kL2BlockN / kMegaMoEBlockNL2;
    // BLOCK_M = 128 (prefill, FP8 / BF16) with 256-wide L2 tasks: a task is one K loop over a 256-row B
    // tile (l2_mainloop<2>: FP8 two 128-column wgmma halves per K-block as L1's gate and up, BF16 one
    // N = 256 wgmma), not two passes
    static constexpr bool kL2OnePass = not kSplitN and kL2BlockN == 2 * kMegaMoEBlockNL2;
    static constexpr int kStageBytes = mega_moe_stage_bytes(kMmaType, BLOCK_M);
    static constexpr int kStageSfBytes = mega_moe_stage_sf_bytes(kMmaType, BLOCK_M);
    static constexpr int kStageExtraBytes = mega_moe_stage_extra_bytes(kMmaType, BLOCK_M);
    static constexpr int kStageDeltaBytes = mega_moe_stage_deltas_bytes(kMmaType);
    static constexpr int kNumMathThreads = 128 * kNumMathWGs;
    // Prefill FP8 x FP4: two expanded tiles, K-block kb + 1 expanded while kb's wgmma runs
    static constexpr bool kExpandAhead = mega_moe_expanded_b_tiles(kMmaType, BLOCK_M) == 2;
    static constexpr bool kEpilogueInExpanded = mega_moe_epilogue_in_expanded(kMmaType, BLOCK_M);   // the same kernels
    static_assert(not kEpilogueInExpanded or kL2BlockN == kMegaMoEBlockNL2,
                  "a two-tile L2 task would need epilogue_tile_free() between its tiles");
    static constexpr int kNumRingConsumers = kNumDispatchThreads + 128 * kNumMathWGs;
    static constexpr int kTaskRing = mega_moe_task_ring(BLOCK_M);   // the task ring's depth (mega_moe_params.cuh)
    static_assert(kStageBytes == kABytes + (kFP4 ? kMegaMoEBlockNL1 * kMegaMoEPackedRowBytes : kBBytesL1));
    // FP8 x FP4: the deltas' tensor copy lands at each stage's delta slot, 128-byte aligned (the base
    // is 1024-aligned; the stages, the expanded tile and the epilogue tile are whole 128-byte units)
    static_assert(not kFP4 or ((kNumStages * kStageBytes + mega_moe_expanded_b_bytes(kMmaType, BLOCK_M) + mega_moe_epilogue_smem_bytes(kMmaType, BLOCK_M)) % 128 == 0 and
                               kStageExtraBytes % 128 == 0 and kStageSfBytes % 128 == 0),
                  "FP8 x FP4 delta slots must be 128-byte aligned");
    static_assert(kStageExtraBytes % 16 == 0 and kStageSfBytes % 16 == 0 and kStageDeltaBytes % 16 == 0,
                  "bulk copies into a stage's extras need 16-byte alignment");
    // Register quotas after `setmaxnreg`. The producer thread (warp 0) spilled its per-stage state
    // at 40 (local-memory loads between the empty-barrier wait and the TMA issue): 56 holds it, and
    // the math warpgroups give up 8. BF16 with 128-row tiles keeps 232 (its accumulators need them:
    // 224 cost it 11 % at n = 4096, docs/PERF.md).
    static constexpr bool kMathNeedsAll = kMmaType == MmaType::kBF16xBF16 and BLOCK_M == 128;
    static constexpr int kMathRegisters = kCtaPair ? 200 : kMathNeedsAll ? 232 : 224;
    static constexpr int kProducerRegisters = kMathNeedsAll ? 40 : 56;
    static constexpr int kThreadRegisters = kCtaPair ? 65536 / (kNumThreads * kCtasPerSM) / 8 * 8 : kLaunchRegisters;
    static_assert(kNumMathWGs * 128 * kMathRegisters + 128 * kProducerRegisters <= kNumThreads * kThreadRegisters and
                  kThreadRegisters == 65536 / (kNumThreads * kCtasPerSM) / 8 * 8 and kMathRegisters % 8 == 0 and kProducerRegisters % 8 == 0,
                  "setmaxnreg quotas within the CTA's register pool");

    // ------------------------------------------------------------------------------------------
    // Shared memory carve-up (sizes from mega_moe_params.cuh, which the host also uses)
    struct Smem {
        uint8_t* stages;          // [kNumStages][A tile | B tile (FP8 x FP4: packed E2M1)]
        uint8_t* expanded_b;      // FP8 x FP4: the E4M3 B tile(s) the wgmma reads, expanded from a stage
        uint8_t* epilogue;
        uint8_t* extras;          // [kNumStages][A scales | FP4 deltas | B weight scales]
        uint8_t* pull_staging;    // [kPullSlots][kMegaMoEPullSlotBytes] prefill pulls (BLOCK_M 128), 128-aligned
        uint64_t* pull_bars;      // [kPullSlots] one mbarrier per slot
        uint64_t* combine_bars;   // [math warpgroup][kMegaMoECombineBufs] bulk combine (BLOCK_M 128)
        uint64_t* full;
        uint64_t* empty;
        uint64_t* ring_full;
        uint64_t* ring_empty;
        int* ring_task;
        int* expert_tokens;       // [E_local]
        int* mblock_begin;        // [E_local + 1], exclusive prefix of M-blocks per local expert
        uint32_t* pull_rows;      // [BLOCK_M] the pulled M-block's (source rank, token slot) per row
        uint8_t* fp4_table;       // [16 deltas][8 magnitudes] E4M3 bytes, 128-aligned (FP8 x FP4 only)
        uint64_t* signal_bars;    // [math warpgroup][post][full, empty] (the signals thread's mailboxes)
        uint32_t* signal_posts;   // [math warpgroup][post]
        SharedControl* ctrl;

        __device__ explicit Smem(uint8_t* base) {
            stages = base;
            expanded_b = base + kNumStages * kStageBytes;     // stage sizes are multiples of 1024
            // prefill FP8 x FP4: the epilogue tile in the expanded tiles (mega_moe_epilogue_in_expanded)
            epilogue = kEpilogueInExpanded ? expanded_b : expanded_b + mega_moe_expanded_b_bytes(kMmaType, BLOCK_M);
            extras = expanded_b + mega_moe_expanded_b_bytes(kMmaType, BLOCK_M) + mega_moe_epilogue_smem_bytes(kMmaType, BLOCK_M);
            auto* c = extras + kNumStages * kStageExtraBytes;
            pull_staging = reinterpret_cast<uint8_t*>(align_up<uintptr_t>(reinterpret_cast<uintptr_t>(c), 128));
            pull_bars = reinterpret_cast<uint64_t*>(pull_staging + kPullSlots * kMegaMoEPullSlotBytes);
            c += mega_moe_pull_staging_bytes(kMmaType, BLOCK_M);   // 0 without slots
            combine_bars = reinterpret_cast<uint64_t*>(c);
            c += mega_moe_combine_bar_bytes(BLOCK_M);             // 0 without the bulk combine
            full = reinterpret_cast<uint64_t*>(c);
            empty = full + kNumStages;
            ring_full = empty + kNumStages;
            ring_empty = ring_full + kTaskRing;
            ring_task = reinterpret_cast<int*>(ring_empty + kTaskRing);
            expert_tokens = ring_task + kTaskRing;
            mblock_begin = expert_tokens + kMegaMoEMaxLocalExperts;
            pull_rows = reinterpret_cast<uint32_t*>(mblock_begin + kMegaMoEMaxLocalExperts + 1);
            ctrl = reinterpret_cast<SharedControl*>(align_up<uintptr_t>(reinterpret_cast<uintptr_t>(pull_rows + L::kMaxBlockM), 16));
            // 128-aligned: a decode tile's table row address is the base with its low byte replaced by the
            // row's offset, which carries the base's bit 7 (fp4_magnitudes, fp4_table_hi)
            fp4_table = reinterpret_cast<uint8_t*>(align_up<uintptr_t>(reinterpret_cast<uintptr_t>(ctrl + 1), kMegaMoEFP4TableAlign));
            // decode kernels: after the BLOCK_M row sources a pull uses, in the kMaxBlockM the table holds
            signal_bars = reinterpret_cast<uint64_t*>(align_up<uintptr_t>(reinterpret_cast<uintptr_t>(pull_rows + BLOCK_M), 8));
            signal_posts = reinterpret_cast<uint32_t*>(signal_bars + kNumMathWGs * kMegaMoESignalPosts * 2);
        }
        // The control block as carved above (its start is 16-aligned), padding included, against
        // the budget the host allocates (mega_moe_control_smem_bytes): aligning the table to 128
        // from a 16-aligned address skips at most kMegaMoEFP4TablePad bytes
        static constexpr int kControlBytesUsed =
            align_up(align_up(kNumStages * 16 + kTaskRing * 20 + (2 * kMegaMoEMaxLocalExperts + 1) * 4 + L::kMaxBlockM * 4, 16) +
                     static_cast<int>(sizeof(SharedControl)), 16) + kMegaMoEFP4TablePad + kMegaMoEFP4TableBytes;
        static_assert(kNumMathWGs * kMegaMoESignalPosts * (2 * 8 + 4) <= kMegaMoESignalBytes and
                      (BLOCK_M != 64 or BLOCK_M * 4 + 4 + kMegaMoESignalBytes <= L::kMaxBlockM * 4),
                      "the mailboxes fit what 64-row pulls leave of the row-source table (4 bytes: 8-aligning them)");
        __device__ uint64_t* signal_full(int wg, int q) const { return signal_bars + (wg * kMegaMoESignalPosts + q) * 2; }
        __device__ uint64_t* signal_empty(int wg, int q) const { return signal_full(wg, q) + 1; }
        __device__ uint32_t signal_post(int wg, int q) const { return smem_addr(signal_posts + wg * kMegaMoESignalPosts + q); }
        static_assert(kControlBytesUsed <= mega_moe_control_smem_bytes(kNumStages, BLOCK_M), "control block outgrew its budget");
        // The pull's slots and their mbarriers, after re-aligning to 128 B (at most 127 B lost), within the host's budget
        static constexpr int kSlots = mega_moe_pull_slots(kMmaType, BLOCK_M);
        static_assert(kSlots == 0 or kSlots * (kMegaMoEPullSlotBytes + 8) + 127 <= mega_moe_pull_staging_bytes(kMmaType, BLOCK_M),
                      "pull staging outgrew its budget");
        // The bulk combine's buffer b of math warpgroup wg: in the warpgroup's half of the stages and
        // the expanded tiles after them (all idle once the rank's GEMMs are over)
        static constexpr int kCombineHalfBytes = (kNumStages * kStageBytes + mega_moe_expanded_b_bytes(kMmaType, BLOCK_M)) / kNumMathWGs;
        static_assert(kCombineHalfBytes % 16 == 0, "bulk copies into the combine buffers need 16-byte alignment");
        __device__ uint8_t* combine_buf(int wg, int b) const { return stages + wg * kCombineHalfBytes + b * kMegaMoECombineBufBytes; }
        // Stage addresses are computed, not stored: an array indexed by a run-time stage would live in local memory
        __device__ uint8_t* stage_a(int s) const { return stages + s * kStageBytes; }
        __device__ uint8_t* stage_b(int s) const { return stages + s * kStageBytes + kABytes; }
        // Prefill FP8 x FP4 (two expanded tiles): the one of the stage_iter-th stage, by its parity
        __device__ uint8_t* expanded(uint32_t stage_iter) const { return expanded_b + (stage_iter & 1) * kBBytesL1; }
        // The B tile the wgmma of the stage_iter-th stage (ring slot s) reads: the stage's own, or
        // FP8 x FP4's expanded tile (prefill: of two, by the stage's parity)
        __device__ uint8_t* mma_b(int s, uint32_t stage_iter) const {
            return kExpandAhead ? expanded(stage_iter) : kFP4 ? expanded_b : stage_b(s);
        }
        __device__ float* stage_sf(int s) const { return reinterpret_cast<float*>(extras + s * kStageExtraBytes); }
        __device__ uint8_t* stage_deltas(int s) const { return extras + s * kStageExtraBytes + kStageSfBytes; }
        // The K-block's FP32 weight block scales of the B tile, one per 128-row block: L1 [gate, up],
        // L2 [block] (256 wide, a narrow tile: [block 2j, block 2j + 1])
        __device__ float* stage_wsf(int s) const {
            return reinterpret_cast<float*>(extras + s * kStageExtraBytes + kStageSfBytes + kStageDeltaBytes);
        }
        // The math loops read the scales by 32-bit shared address (`ld.shared`, not a generic load)
        __device__ float token_sf(int s, int row) const { return ld_shared_f32(smem_addr(stage_sf(s)) + row * 4); }
        __device__ float weight_sf(int s, int i) const { return ld_shared_f32(smem_addr(stage_wsf(s)) + i * 4); }
    };

    // Task space of one call, identical in every CTA of a rank once the receive counts are known
    // (split-K decode calls: l1_split consecutive L1 tasks per tile, one per K part)
    struct Tasks {
        int num_mblocks, num_l1_nblocks, num_l2_nblocks, num_combine, l1_split;
        __device__ int pull_end() const { return num_mblocks; }
        __device__ int l1_end() const { return pull_end() + num_mblocks * num_l1_nblocks * l1_split; }
        __device__ int l2_end() const { return l1_end() + num_mblocks * num_l2_nblocks; }
        __device__ int total() const { return l2_end() + num_combine; }
    };

    const MegaMoEParams& p;
    const L::MegaMoELayout& lay;
    Smem sm;
    Tasks tasks;
    uint32_t epoch;
    // A task's completion signal that thread 0 of a math warpgroup still owes: the M-block of an L1
    // task (its l1_done count) or an L2 task (the rank's L2 count). Owed from the epilogue's barrier
    // (a release after it still covers every thread's stores: cumulativity) to raise_signals() at
    // the thread's next task, after the task-start barrier and before the math waits for anything
    // of that task (its first stage may belong to an L2 task of the same M-block, whose A tile the
    // producer issues only after this count: no wait depends on a signal still owed). The fence's
    // wait for the epilogue's stores then runs in warp 0 while the other warps start the next task,
    // instead of in front of the task-start barrier that every math thread meets.
    // FP8 x FP4 decode kernels only (docs/PERF.md, session 20): there it gained 0.5-2.5 % at every
    // row timed but mid at one token (+2 %); the FP8 and BF16 decode kernels lost 1-4 % at one token
    // and were even elsewhere;
    // in the 128-row kernels, whose loops sit at ptxas's register limit, the two registers across
    // the task loop put local accesses into the K-loops (SASS). Every other kernel compiles to the
    // SASS it has without the deferral.
    static constexpr bool kDeferTaskSignals = kFP4 and BLOCK_M == 64;
    static constexpr bool kSignalsThread = kSignalsThreadBuild and kDeferTaskSignals;
    static_assert(not kSignalsThreadBuild or mega_moe_signals_thread_ok(kMmaType, BLOCK_M), "the signals thread: FP8 x FP4 decode kernels only");
    int owed_l1_m = -1;
    bool owed_l2 = false;
    // Prefill (BLOCK_M = 128) kernels count a warpgroup's L2 tasks in one release when it leaves
    // them (at its first combine ticket, or when it leaves the task loop) instead of one release and
    // returning atomic per task: a CTA's tickets rise, so its L2 tasks come in one run, and only the
    // combine, which waits for every L2 task of the rank (combine_ready), reads the count. Per task
    // the fence waited for the 16 KB of combine rows just stored, in front of the next task's
    // barrier (L2 epilogue 5.8 us at mid FP8 n = 4096 on an H100: docs/PERF.md, session 36). The
    // count lives in shared memory (SharedControl::l2_owed_count): a register held across the task loop
    // puts local accesses into these kernels' K-loops (see kDeferTaskSignals).
    static constexpr bool kBatchL2Counts = BLOCK_M == 128;
    static_assert(kNumMathWGs <= 2, "SharedControl::l2_owed_count has a word per math warpgroup");

    __device__ Kernel(const MegaMoEParams& params, uint8_t* smem_base) : p(params), lay(params.layout), sm(smem_base) {}

    template <typename T>
    __device__ T* mine(const L::Section& s) const { return lay.get_ptr<T>(p.buffers[p.rank], s); }
    template <typename T>
    __device__ T* peer(int rank, const L::Section& s) const { return lay.get_ptr<T>(p.buffers[rank], s); }

    // Ordering of what crosses ranks (counts, source indices, combine rows and flags): system scope
    // when peers are other GPUs, gpu scope when every rank's buffer is on this one (a sys-scope
    // fence costs far more, and the L2 tasks and the combine signal pay it on the decode chain)
    __device__ void fence_peers() const { if (p.peers_on_this_gpu) fence_acq_rel_gpu(); else fence_acq_rel_sys(); }
    __device__ uint64_t ld_acquire_peers(const uint64_t* a) const { return p.peers_on_this_gpu ? ld_acquire_gpu_u64(a) : ld_acquire_sys(a); }
    __device__ void st_release_peers(uint64_t* a, uint64_t v) const {
        if (p.peers_on_this_gpu) st_release_gpu_u64(a, v); else st_release_sys(a, v);
    }

    // A first-only stamp is decided in shared memory: a global read of the stamp would put an L2
    // round trip (~0.5 us) in front of every stamp and distort the timeline it records
    __device__ void trace(int slot, bool first_only = false) const {
        if (p.trace == nullptr) return;
        if (first_only and (atomicOr(&sm.ctrl->trace_first, 1ull << slot) >> slot & 1)) return;
        p.trace[blockIdx.x * kTraceSlots + slot] = globaltimer_ns();
    }

    __device__ int expert_of_mblock(int m) const {
        int lo = 0, hi = lay.num_local_experts - 1;   // largest le with mblock_begin[le] <= m
        while (lo < hi) {
            const int mid = (lo + hi + 1) / 2;
            if (sm.mblock_begin[mid] <= m) lo = mid; else hi = mid - 1;
        }
        return lo;
    }

    // Rows of M-block m that hold tokens (the rest is padding: computed, never written back)
    __device__ int valid_rows(int m, int le) const {
        return max_of(0, min_of(BLOCK_M, sm.expert_tokens[le] - (m - sm.mblock_begin[le]) * BLOCK_M));
    }

    // ------------------------------------------------------------------------------------------
    // Pair i of this rank takes `slot` in the owner's source list of expert e (a remote store)
    __device__ void send_source(int e, int slot, int i) const {
        const int owner = e / lay.num_local_experts, le = e % lay.num_local_experts;
        peer<int>(owner, lay.src_index)[(static_cast<int64_t>(le) * lay.num_ranks + p.rank) * lay.num_max_tokens_per_rank + slot] = i;
    }
    // This rank's count for expert e into the owner's recv_count: cut at N, tagged with the call's epoch
    __device__ void publish_count(int e, int count) const {
        const int owner = e / lay.num_local_experts, le = e % lay.num_local_experts;
        const uint64_t cut = min_of(count, lay.num_max_tokens_per_rank);
        st_release_peers(peer<uint64_t>(owner, lay.recv_count) + le * lay.num_ranks + p.rank, (static_cast<uint64_t>(epoch) << 32) | cut);
    }

    static constexpr int kCountBatch = 8;   // count_and_send: routing entries per thread loaded at once
    // Count and reserve (whole CTA, the CTA holding ticket 0): every routed (token, slot) gets a
    // slot in the owner's per-(local expert, source rank) list; counts are published epoch-tagged.
    __device__ void count_and_send() {
        const int num_experts = lay.num_experts, num_topk = lay.num_topk, n_max = lay.num_max_tokens_per_rank;
        int* counts = reinterpret_cast<int*>(sm.stage_a(0));     // pipeline stages are idle here
        for (int e = threadIdx.x; e < num_experts; e += kNumThreads) counts[e] = 0;
        __syncthreads();

        // kCountBatch routing entries per thread loaded before any is used: one round trip per batch
        // instead of one per entry (prefill: ~85 entries per thread, 33-39 us counted one by one)
        const auto* topk_idx = mine<int64_t>(lay.topk_idx);
        const int num_pairs = p.num_tokens * num_topk;
        for (int base = threadIdx.x; base < num_pairs; base += kCountBatch * kNumThreads) {
            int64_t batch[kCountBatch];
            #pragma unroll
            for (int b = 0; b < kCountBatch; ++b) batch[b] = base + b * kNumThreads < num_pairs ? topk_idx[base + b * kNumThreads] : -1;
            #pragma unroll 1
            for (int b = 0; b < kCountBatch; ++b) {
                const int i = base + b * kNumThreads;
                const int64_t e = batch[0];   // shifted down, not indexed by b: the batch stays in registers
                #pragma unroll
                for (int q = 0; q + 1 < kCountBatch; ++q) batch[q] = batch[q + 1];
                if (e == -1) continue;
                if (e < -1 or e >= num_experts) {   // never used as an index: flagged, treated as masked
                    report(p, StatusCode::kBadExpertId, Phase::kCount, p.rank, i / num_topk, false, sm.ctrl);
                    continue;
                }
                const int slot = atomicAdd(&counts[e], 1);
                if (slot >= n_max) {                // only possible when a token lists an expert twice
                    report(p, StatusCode::kDuplicateExpert, Phase::kCount, p.rank, i / num_topk, false, sm.ctrl);
                    // Mask it in this buffer's routing copy so the combine skips the slot (its combine row
                    // is never written this call)
                    mine<int64_t>(lay.topk_idx)[i] = -1;
                    continue;
                }
                send_source(static_cast<int>(e), slot, i);
            }
        }
        // release: the owner's pull must see the source indices written above
        fence_peers();
        __syncthreads();
        for (int e = threadIdx.x; e < num_experts; e += kNumThreads) publish_count(e, counts[e]);
        // The scratch counts live in stage 0, which TMA (async proxy) writes next
        fence_proxy_async_shared();
        __syncthreads();
    }

    // Prefill counts run in slices of kCountSlicePairs routed pairs, one CTA each: on one CTA the count
    // took 37 us at mid n = 4096 (32768 pairs: 256 KB of routing loads and as many scattered 4-byte
    // stores through one SM) while the grid waited for it (docs/PERF.md, session 14). Calls of at
    // most one batch per thread on one CTA (kSingleCountPairs) keep count_and_send as it was: there
    // the slices' two extra global round trips (the reservation, the slice's done count) cost more
    // than they spread (mid n = 256, 2 slices: +1 %). So do the decode kernels (BLOCK_M 64, which
    // the heuristic picks up to 64 routed pairs per expert): compiled in, the slices' ~1000
    // instructions moved their loops' code and v4-flash FP8 x FP4 n = 8 read +0.8 %.
    static constexpr bool kSlicedCount = BLOCK_M == 128;
    static constexpr int kCountSliceBatch = 4;                         // pairs per thread and slice
    static constexpr int kCountSlicePairs = kCountSliceBatch * kNumThreads;
    static constexpr int kSingleCountPairs = kCountBatch * kNumThreads;   // one count_and_send batch per thread
    // A slice's per-expert scratch: [E] slots taken in the slice, then [E] bases reserved for it
    static_assert(kNumStages * kStageBytes >= 2 * kMegaMoEMaxLocalExperts * kMaxRanks * 4, "count scratch fits the stages");
    __device__ int num_count_slices() const {
        if constexpr (not kSlicedCount) return 1;
        const int num_pairs = p.num_tokens * lay.num_topk;
        return num_pairs <= kSingleCountPairs ? 1 : ceil_div(num_pairs, kCountSlicePairs);
    }

    // Every CTA at its start: the count's slices are claimed from kControlCountClaim by whichever
    // CTAs run (the first claim was drawn with the CTA's setup), so the count never waits for a CTA
    // that is not resident, and a CTA claims again after each slice until none is left.
    __device__ void count() {
        const int num_slices = num_count_slices();
        int slice = sm.ctrl->count_slice;
        if (num_slices == 1) {
            if (slice == 0) {
                count_and_send();
                if (threadIdx.x == 0) trace(kTraceCounted);
            }
            return;
        }
        if constexpr (kSlicedCount) while (slice < num_slices) {
            count_slice(slice, num_slices);
            if (threadIdx.x == 0) {
                trace(kTraceCounted);
                sm.ctrl->count_slice = static_cast<int>(atomicAdd(mine<uint32_t>(lay.control) + L::kControlCountClaim, 1));
            }
            // (the next write of count_slice is after the next slice's barriers: every thread has read it)
            __syncthreads();
            slice = sm.ctrl->count_slice;
        }
    }

    // One slice of a count of several (whole CTA): pairs [slice x kCountSlicePairs, ...) of this rank.
    // Slots are taken in shared memory, then each expert's share of the slice is reserved in this
    // rank's send_count with one global atomic, so every pair's slot in the owner's list is the
    // reserved base plus its slot within the slice. The CTA that finishes the last slice publishes
    // the totals as count_and_send does (same cut at n_max, same epoch tag); the last CTA out of the
    // call zeroes send_count. A thread reports its first bad or cut pair once, after its pairs.
    __device__ void count_slice(int slice, int num_slices) {
        const int num_experts = lay.num_experts, num_topk = lay.num_topk, n_max = lay.num_max_tokens_per_rank;
        int* counts = reinterpret_cast<int*>(sm.stage_a(0));     // pipeline stages are idle here
        int* bases = counts + num_experts;
        for (int e = threadIdx.x; e < num_experts; e += kNumThreads) counts[e] = 0;
        __syncthreads();

        auto* topk_idx = mine<int64_t>(lay.topk_idx);
        auto* send_count = mine<int>(lay.send_count);
        const int num_pairs = p.num_tokens * num_topk, first = slice * kCountSlicePairs + static_cast<int>(threadIdx.x);
        int64_t batch[kCountSliceBatch];
        int local[kCountSliceBatch];
        #pragma unroll
        for (int b = 0; b < kCountSliceBatch; ++b) batch[b] = first + b * kNumThreads < num_pairs ? topk_idx[first + b * kNumThreads] : -1;
        #pragma unroll
        for (int b = 0; b < kCountSliceBatch; ++b) {
            const bool valid = batch[b] >= 0 and batch[b] < num_experts;   // never used as an index otherwise
            local[b] = valid ? atomicAdd(&counts[valid ? batch[b] : 0], 1) : 0;
        }
        __syncthreads();
        for (int e = threadIdx.x; e < num_experts; e += kNumThreads)
            if (counts[e] > 0) bases[e] = atomicAdd(send_count + e, counts[e]);
        __syncthreads();
        StatusCode error = StatusCode::kOk;
        int error_token = 0;
        #pragma unroll 1
        for (int b = 0; b < kCountSliceBatch; ++b) {
            const int i = first + b * kNumThreads;
            // shifted down, not indexed by b: the batch stays in registers
            const int64_t e = batch[0];
            const int slot_in_slice = local[0];
            #pragma unroll
            for (int q = 0; q + 1 < kCountSliceBatch; ++q) batch[q] = batch[q + 1], local[q] = local[q + 1];
            if (e == -1) continue;
            const bool bad = e < -1 or e >= num_experts;   // flagged, treated as masked
            const int slot = bad ? 0 : bases[e] + slot_in_slice;
            if (bad or slot >= n_max) {         // the cut: only possible when a token lists an expert twice
                if (error == StatusCode::kOk) error = bad ? StatusCode::kBadExpertId : StatusCode::kDuplicateExpert, error_token = i / num_topk;
                if (not bad) topk_idx[i] = -1;  // the combine skips the slot (as in count_and_send)
                continue;
            }
            send_source(static_cast<int>(e), slot, i);
        }
        if (error != StatusCode::kOk) report(p, error, Phase::kCount, p.rank, error_token, false, sm.ctrl);
        // release: the owners' pulls must see the source indices written above; the slice's done
        // count (after the barrier, cumulative) orders them before the publication of the totals
        fence_peers();
        __syncthreads();
        if (threadIdx.x == 0)
            sm.ctrl->count_last = atom_acq_rel_gpu_add(mine<uint32_t>(lay.control) + L::kControlCountDone, 1) + 1 ==
                                  static_cast<uint32_t>(num_slices);
        __syncthreads();
        if (sm.ctrl->count_last) {
            // acquire (thread 0's, above): every slice's reservations and source indices
            fence_acq_rel_gpu();
            for (int e = threadIdx.x; e < num_experts; e += kNumThreads) publish_count(e, __ldcg(send_count + e));
        }
        // The scratch lives in stage 0, which TMA (async proxy) writes next
        fence_proxy_async_shared();
        __syncthreads();
    }

    // How many calls a published tag (a count's upper word, a combine_ready flag) is ahead of this
    // call's epoch: < 0 not yet published, 0 this call's, > 0 a peer's later call. The difference
    // is taken modulo 2^32, so the 32-bit epoch may wrap (after 2^32 calls on a buffer: ~16 days
    // of a buffer shared by 60 layers at 50 steps/s) while tags stay within a call or two of it
    __device__ static int32_t calls_ahead(uint64_t tag, uint32_t epoch) {
        return static_cast<int32_t>(static_cast<uint32_t>(tag) - epoch);
    }

    // Every CTA: wait for every source's counts, build the per-expert M-block table in smem
    __device__ void build_layout() {
        const int num_le = lay.num_local_experts, num_ranks = lay.num_ranks;
        for (int le = threadIdx.x; le < num_le; le += kNumThreads) sm.expert_tokens[le] = 0;
        __syncthreads();
        const auto* recv = mine<uint64_t>(lay.recv_count);
        for (int i = threadIdx.x; i < num_le * num_ranks; i += kNumThreads) {
            uint64_t v = 0;
            const bool ok = bounded_wait(p, sm.ctrl, Phase::kRecvCounts, i % num_ranks, [&] {
                v = ld_acquire_peers(recv + i);
                return calls_ahead(v >> 32, epoch) >= 0;
            });
            if (not ok) break;
            if (const int32_t ahead = calls_ahead(v >> 32, epoch); ahead > 0) {
                // One call ahead: that peer finished this call, so this CTA has nothing left to do.
                // Two or more: impossible in lockstep (a peer cannot finish call c + 1 before this
                // rank signals it), so the ranks' epochs diverged (reset() on some ranks only)
                if (ahead > 1)
                    report(p, StatusCode::kEpochMismatch, Phase::kRecvCounts, i % num_ranks, v >> 32, true, sm.ctrl);
                sm.ctrl->late = 1;
                break;
            }
            const uint32_t count = static_cast<uint32_t>(v);
            if (count > static_cast<uint32_t>(lay.num_max_tokens_per_rank)) {
                report(p, StatusCode::kBadCount, Phase::kRecvCounts, i % num_ranks, count, true, sm.ctrl);
                break;
            }
            atomicAdd(&sm.expert_tokens[i / num_ranks], static_cast<int>(count));
        }
        __syncthreads();
        if (sm.ctrl->late or sm.ctrl->abort) return;

        // Exclusive scan of M-blocks per expert (warp 0)
        if (threadIdx.x < 32) {
            int running = 0, max_tokens = 0;
            for (int base = 0; base < num_le; base += 32) {
                const int le = base + static_cast<int>(threadIdx.x);
                const int mblocks = le < num_le ? ceil_div(sm.expert_tokens[le], BLOCK_M) : 0;
                if (le < num_le) max_tokens = max_of(max_tokens, sm.expert_tokens[le]);
                int incl = mblocks;
                #pragma unroll
                for (int d = 1; d < 32; d *= 2) {
                    const int up = __shfl_up_sync(0xffffffff, incl, d);
                    if (threadIdx.x >= static_cast<unsigned>(d)) incl += up;
                }
                if (le < num_le) sm.mblock_begin[le] = running + incl - mblocks;
                running += __shfl_sync(0xffffffff, incl, 31);
            }
            #pragma unroll
            for (int d = 16; d > 0; d /= 2) max_tokens = max_of(max_tokens, __shfl_xor_sync(0xffffffff, max_tokens, d));
            if (threadIdx.x == 0) {
                sm.mblock_begin[num_le] = running;
                sm.ctrl->num_mblocks = running;
                // Split-K L1 (decode): when every L1 tile is narrow (at most kNarrowRows tokens per
                // expert), each tile may run as s consecutive tasks of num_kb / s K-blocks
                // (mega_moe_l1_split_plan, mega_moe_params.cuh)
                const int64_t tiles = static_cast<int64_t>(running) * (lay.intermediate_hidden / 128);
                const int num_kb = lay.hidden / BLOCK_K;
                MegaMoEL1Split split{1, num_kb};
                if (kSplitN and max_tokens <= kNarrowRows) split = mega_moe_l1_split_plan(tiles, num_kb, gridDim.x, p.l1_split_max);
                sm.ctrl->l1_split = split.parts;
                if (static_cast<int64_t>(running) * BLOCK_M > lay.num_pool_rows)
                    report(p, StatusCode::kBadCount, Phase::kRecvCounts, p.rank, running, true, sm.ctrl);
            }
        }
        __syncthreads();
    }

    // ------------------------------------------------------------------------------------------
    // Pull one M-block (dispatch warps): copy its tokens from the source ranks into the L1 pool.
    // Two steps: (1) one thread per row finds where the row comes from (source rank, token) and
    // writes its routing info, every row at once; (2) teams of threads copy the rows, kPullInFlight
    // 16-byte loads per thread issued before their stores, the team as wide as the rows allow (a
    // decode M-block often holds one token: 96 threads move it in one round trip).
    static constexpr int kPullRowsPerThread = ceil_div(BLOCK_M, kNumDispatchThreads);
    static constexpr int kPullInFlight = 4;   // 16-byte loads per thread before their stores (40 registers)
    // A row's batches also carry its FP8 scales, one per thread and batch: that covers them while a
    // batch holds at most as many chunks per thread as a scale has 16-byte chunks of activations
    static_assert(kPullInFlight <= kScaleGranularity / 16, "the pull's batches cover a row's scales");
    static constexpr uint32_t kPullNoRow = 0xffffffffu;
    // A pulled row's source from sm.pull_rows (not kPullNoRow)
    struct PullSource { int rank, slot; };
    __device__ static PullSource pull_source(uint32_t packed) {
        return {static_cast<int>(packed >> kPullTokenBits), static_cast<int>(packed & ((1u << kPullTokenBits) - 1))};
    }
    static constexpr int kPullSlots = mega_moe_pull_slots(kMmaType, BLOCK_M);
    static_assert(kPullSlots <= kNumDispatchThreads, "a pull slot per dispatch thread");
    static constexpr int kPullScalesInFlight = 8;   // bulk pulls: FP8 scale loads per thread before their stores

    __device__ void pull(int m, int dispatch_thread, uint32_t& slot_uses) {
        const int le = expert_of_mblock(m);
        const int first_pos = (m - sm.mblock_begin[le]) * BLOCK_M;
        const int num_rows = valid_rows(m, le);
        const int num_ranks = lay.num_ranks, n_max = lay.num_max_tokens_per_rank, topk = lay.num_topk;
        const int64_t g0 = static_cast<int64_t>(m) * BLOCK_M;
        auto* row_info = mine<int>(lay.row_info);
        auto* row_weight = mine<float>(lay.row_weight);
        if (dispatch_thread == 0) trace(kTracePullBegin, true);

        // (1) Rows of this thread: r = dispatch_thread + kNumDispatchThreads * u
        int token_slot[kPullRowsPerThread], src[kPullRowsPerThread];
        #pragma unroll
        for (int u = 0; u < kPullRowsPerThread; ++u) {
            const int r = dispatch_thread + kNumDispatchThreads * u;
            src[u] = 0, token_slot[u] = -1;
            if (r >= num_rows) continue;
            const int pos = first_pos + r;
            if (num_ranks > 1) {
                // Which source rank: every count loaded at once, then a prefix walk
                const auto* recv = mine<uint64_t>(lay.recv_count) + le * num_ranks;
                int c[kMaxRanks];
                #pragma unroll
                for (int q = 0; q < kMaxRanks; ++q)
                    c[q] = q < num_ranks ? static_cast<int>(static_cast<uint32_t>(__ldcg(reinterpret_cast<const unsigned long long*>(recv + q)))) : 0;
                int prefix = 0;
                bool found = false;
                #pragma unroll
                for (int q = 0; q < kMaxRanks; ++q) {
                    if (q >= num_ranks or found) continue;
                    if (pos < prefix + c[q]) found = true, src[u] = q;
                    else prefix += c[q];
                }
                // Always found (the M-block table sums the same counts); else the row is reported below
                if (found)
                    token_slot[u] = __ldcg(mine<int>(lay.src_index) + (static_cast<int64_t>(le) * num_ranks + src[u]) * n_max + (pos - prefix));
            } else {
                token_slot[u] = __ldcg(mine<int>(lay.src_index) + static_cast<int64_t>(le) * n_max + pos);
            }
        }
        #pragma unroll
        for (int u = 0; u < kPullRowsPerThread; ++u) {
            const int r = dispatch_thread + kNumDispatchThreads * u;
            if (r >= BLOCK_M) continue;
            uint32_t packed = kPullNoRow;
            int info = -1;
            if (r < num_rows) {
                if (token_slot[u] < 0 or token_slot[u] >= n_max * topk) {
                    // Written by a peer: never trusted as an index. Fatal (the call's routing is
                    // broken); the row becomes padding so nothing below reads or writes outside the buffers.
                    report(p, StatusCode::kBadCount, Phase::kPull, src[u], first_pos + r, true, sm.ctrl);
                } else {
                    info = src[u] * n_max * topk + token_slot[u];
                    packed = (static_cast<uint32_t>(src[u]) << kPullTokenBits) | static_cast<uint32_t>(token_slot[u]);
                }
            }
            // Padding rows (and broken ones): their output is never written back. A valid row's
            // top-k weight is written with its bytes below.
            row_info[g0 + r] = info;
            if (packed == kPullNoRow) row_weight[g0 + r] = 0.0f;
            sm.pull_rows[r] = packed;
        }
        named_barrier(kBarrierDispatch, kNumDispatchThreads);

        if constexpr (kPullSlots > 0) {
            pull_rows_bulk(g0, num_rows, dispatch_thread, slot_uses);
        } else {
            pull_rows_registers(g0, num_rows, dispatch_thread);
        }
        // release: L1 TMA loads (async proxy, other CTAs) of this M-block must see the rows written
        // above. Each thread fences its writes into the async proxy; after the barrier one release
        // covers every thread's writes (cumulativity: the barrier orders them before it).
        fence_proxy_async_global();
        named_barrier(kBarrierDispatch, kNumDispatchThreads);
        if (dispatch_thread == 0) red_release_gpu_add(mine<uint32_t>(lay.mblock_arrival) + m, 1), trace(kTracePullEnd);
    }

    // (2) Row bytes and scales (decode tiles): teams of 96 / min(rows, 3) threads, a row per team at
    // a time, so a lone decode row gets every dispatch thread and a full M-block one warp per row
    __device__ void pull_rows_registers(int64_t g0, int num_rows, int dispatch_thread) {
        const int hidden = lay.hidden, topk = lay.num_topk;
        auto* row_weight = mine<float>(lay.row_weight);
        const int num_teams = max_of(1, min_of(num_rows, kNumDispatchWarps));
        const int team_size = kNumDispatchThreads / num_teams;
        const int team = dispatch_thread / team_size, team_thread = dispatch_thread % team_size;
        const int row_bytes = hidden * kActBytes, num_chunks = row_bytes / 16;
        const int num_sf = kFP8 ? hidden / kScaleGranularity : 0;
        auto* l1_act = mine<uint8_t>(lay.l1_act);
        auto* l1_sf = mine<float>(lay.l1_sf);
        for (int r = team; r < num_rows and team < num_teams; r += num_teams) {
            const uint32_t packed = sm.pull_rows[r];
            if (packed == kPullNoRow) continue;
            const auto [src_rank, slot] = pull_source(packed);
            const int64_t token = slot / topk, g = g0 + r;
            float weight = 0.0f;
            if (team_thread == 0) weight = __ldcg(peer<float>(src_rank, lay.topk_weights) + slot);
            const auto* from = reinterpret_cast<const int4*>(peer<uint8_t>(src_rank, lay.x) + token * row_bytes);
            auto* to = reinterpret_cast<int4*>(l1_act + g * row_bytes);
            const float* sf = kFP8 ? peer<float>(src_rank, lay.x_sf) + token * num_sf : nullptr;
            // Batches of kPullInFlight chunks per thread, all loads before their stores; batch b also
            // moves scale team_thread + b * team_size (a row has 8x more chunks than scales, so the
            // batches cover them), one register instead of a row's worth
            for (int c0 = team_thread, b = 0; c0 < num_chunks; c0 += team_size * kPullInFlight, ++b) {
                int4 v[kPullInFlight];
                const int k = team_thread + team_size * b;
                float sf_v = 0.0f;
                if (kFP8 and k < num_sf) sf_v = __ldcg(sf + k);
                #pragma unroll
                for (int u = 0; u < kPullInFlight; ++u)
                    if (c0 + team_size * u < num_chunks) v[u] = ld_global_nc(from + c0 + team_size * u);
                #pragma unroll
                for (int u = 0; u < kPullInFlight; ++u)
                    if (c0 + team_size * u < num_chunks) to[c0 + team_size * u] = v[u];
                if (kFP8 and k < num_sf) l1_sf[static_cast<int64_t>(k) * lay.num_pool_rows + g] = sf_v;
            }
            if (team_thread == 0) row_weight[g] = weight;
        }
    }

    // (2) Row bytes and scales (prefill tiles, kPullSlots > 0). Bytes: pieces of at most a slot
    // (row r's bytes [o, o + 2 KB)); dispatch thread i < kPullSlots moves pieces i, i + kPullSlots,
    // ... through its slot: bulk load, wait, bulk store into the pool row, and before the next load
    // into the slot, wait until the store has read it. Its stores' writes are complete before the
    // caller's fence and release. Scales and top-k weights: the other dispatch threads, generic
    // loads and stores (kPullScalesInFlight per thread at a time).
    __device__ void pull_rows_bulk(int64_t g0, int num_rows, int dispatch_thread, uint32_t& slot_uses) {
        const int hidden = lay.hidden, topk = lay.num_topk;
        const int row_bytes = hidden * kActBytes;
        const int pieces_per_row = ceil_div(row_bytes, kMegaMoEPullSlotBytes);
        auto* l1_act = mine<uint8_t>(lay.l1_act);
        if (dispatch_thread < kPullSlots) {
            uint8_t* slot = sm.pull_staging + dispatch_thread * kMegaMoEPullSlotBytes;
            uint64_t* bar = sm.pull_bars + dispatch_thread;
            for (int piece = dispatch_thread; piece < num_rows * pieces_per_row; piece += kPullSlots) {
                const int r = piece / pieces_per_row, offset = (piece % pieces_per_row) * kMegaMoEPullSlotBytes;
                const uint32_t packed = sm.pull_rows[r];
                if (packed == kPullNoRow) continue;
                const auto [src_rank, token_slot] = pull_source(packed);
                const int64_t token = token_slot / topk;
                const uint32_t bytes = min_of(kMegaMoEPullSlotBytes, row_bytes - offset);
                bulk_wait_read<0>();   // this slot's previous store has read it
                mbarrier_arrive_expect_tx(bar, bytes);
                bulk_load(slot, peer<uint8_t>(src_rank, lay.x) + token * row_bytes + offset, bytes, bar);
                const uint32_t parity = slot_uses++ & 1;
                if (not bounded_wait(p, sm.ctrl, Phase::kPull, src_rank, [&] { return mbarrier_try_wait(bar, parity); })) break;
                fence_proxy_async_shared();   // the landed bytes, read next by the async proxy's store
                bulk_store(l1_act + (g0 + r) * row_bytes + offset, slot, bytes);
                bulk_commit();
            }
            bulk_wait<0>();
        } else {
            constexpr int kHelpers = kNumDispatchThreads - kPullSlots;
            const int helper = dispatch_thread - kPullSlots;
            auto* row_weight = mine<float>(lay.row_weight);
            for (int r = helper; r < num_rows; r += kHelpers) {
                const uint32_t packed = sm.pull_rows[r];
                if (packed == kPullNoRow) continue;
                const auto [src_rank, slot] = pull_source(packed);
                row_weight[g0 + r] = __ldcg(peer<float>(src_rank, lay.topk_weights) + slot);
            }
            if constexpr (kFP8) {
                // scale k of row r: scale index i = r * num_sf + k, kPullScalesInFlight at a time per helper
                const int num_sf = hidden / kScaleGranularity, num = num_rows * num_sf;
                auto* l1_sf = mine<float>(lay.l1_sf);
                for (int i0 = helper; i0 < num; i0 += kHelpers * kPullScalesInFlight) {
                    float v[kPullScalesInFlight];
                    #pragma unroll
                    for (int u = 0; u < kPullScalesInFlight; ++u) {
                        const int i = i0 + kHelpers * u, r = i / num_sf;
                        const uint32_t packed = i < num ? sm.pull_rows[r] : kPullNoRow;
                        v[u] = 0.0f;
                        if (packed != kPullNoRow) {
                            const auto [src_rank, slot] = pull_source(packed);
                            v[u] = __ldcg(peer<float>(src_rank, lay.x_sf) + static_cast<int64_t>(slot / topk) * num_sf + i % num_sf);
                        }
                    }
                    #pragma unroll
                    for (int u = 0; u < kPullScalesInFlight; ++u) {
                        const int i = i0 + kHelpers * u;
                        if (i < num and sm.pull_rows[i / num_sf] != kPullNoRow)
                            l1_sf[static_cast<int64_t>(i % num_sf) * lay.num_pool_rows + g0 + i / num_sf] = v[u];
                    }
                }
            }
        }
    }

    // Combine: y[t] = sum over valid slots k (in order) of the BF16 rows (the GEMMs are over by
    // then), on the math warpgroups: a group is one warpgroup, `thread` its index among the
    // kNumCombineThreads, kSlotsInFlight the top-k rows it loads at once (decode tiles 8: one round
    // trip per chunk at top-k <= 8). Prefill tiles combine through shared memory (combine_bulk),
    // whose bytes in flight registers could not hold, unless their stages are too few for its
    // buffers (kBulkCombine): then here with 4 (8 would cost the BF16 128-row main loop its
    // registers; with the register combine compiled in, that loop spills). The dispatch warps (40 registers) took a
    // share with 128-row tiles until measured: without them mid / BF16 mid n = 4096 ran 6 % faster
    // (docs/PERF.md).
    static constexpr int kMathCombineSlots = kSplitN ? 8 : 4;
    // The prefill kernels combine through shared memory where each math warpgroup's buffers fit its
    // half of the stages (H100 / H200: FP8 and BF16 at 3 stages, FP8 x FP4 at 4 and its two expanded
    // tiles); FP8 and BF16 with fewer stages (a smaller shared memory) keep the register combine
    // (FP8 x FP4's halves hold the buffers at any stage count)
    static constexpr bool kBulkCombine = mega_moe_has_bulk_combine(BLOCK_M) and
                                         Smem::kCombineHalfBytes >= kMegaMoECombineBufs * kMegaMoECombineBufBytes;
    static constexpr int kNumCombineThreads = kNumMathThreads;

    // Combine tasks split y's 16-byte chunks (n x hidden / 8, token-major) into equal contiguous
    // ranges: as many tasks as one chunk per combine thread gives, at most one per CTA, so that
    // decode spreads its few rows over many CTAs (one round trip each) and prefill has no more
    // tasks than CTAs (a CTA holds one combine task at a time: scheduler()).
    struct CombineRange { int first, last; };
    __device__ int combine_chunks() const { return p.num_tokens * (lay.hidden / 8); }   // < 2^31: checked at launch (csrc/apis/mega_moe.hpp)
    __device__ int num_combine_tasks() const {
        return min_of(static_cast<int>(gridDim.x), ceil_div(combine_chunks(), kNumCombineThreads));
    }
    __device__ CombineRange combine_range(int c) const {
        const int chunks = combine_chunks(), per_task = ceil_div(chunks, tasks.num_combine);
        return {c * per_task, min_of(chunks, (c + 1) * per_task)};
    }

    // acquire: rank q has written its L2 rows for our tokens this call (combine_ready[q]); thread q
    // of a group waits for rank q, the group's barrier extends it to the others
    __device__ void wait_combine_ready(int q) const {
        if (q >= lay.num_ranks) return;
        const auto* flag = mine<uint64_t>(lay.combine_ready) + q;
        bounded_wait(p, sm.ctrl, Phase::kCombineWait, q, [&] { return calls_ahead(ld_acquire_peers(flag), epoch) >= 0; });
    }
    // 8 BF16 values of a 16-byte chunk added into FP32 sums; the sums rounded back into a chunk
    template <typename Chunk>
    __device__ static void add_bf16x8(float (&sum)[8], const Chunk& v) {
        const auto* h = reinterpret_cast<const __nv_bfloat162*>(&v);
        #pragma unroll
        for (int j = 0; j < 4; ++j) {
            const float2 f = __bfloat1622float2(h[j]);
            sum[2 * j] += f.x, sum[2 * j + 1] += f.y;
        }
    }
    __device__ static int4 bf16x8_of(const float (&sum)[8]) {
        int4 out;
        auto* o = reinterpret_cast<__nv_bfloat162*>(&out);
        #pragma unroll
        for (int j = 0; j < 4; ++j) o[j] = __floats2bfloat162_rn(sum[2 * j], sum[2 * j + 1]);
        return out;
    }

    // on_ready(): called by every thread once the rows are there (or the call aborted)
    template <int kSlotsInFlight, typename OnReady>
    __device__ void combine(int c, int thread, int group_thread, int group_threads, int group_barrier, OnReady&& on_ready) {
        wait_combine_ready(group_thread);
        named_barrier(group_barrier, group_threads);
        on_ready();
        if (sm.ctrl->abort) return;
        if (thread == 0) trace(kTraceCombineReady, true);

        const int hidden = lay.hidden, topk = lay.num_topk, n_max = lay.num_max_tokens_per_rank;
        const auto* topk_idx = mine<int64_t>(lay.topk_idx);
        const auto* slots = mine<__nv_bfloat16>(lay.combine);
        auto* y = static_cast<__nv_bfloat16*>(p.y);
        const int chunks_per_token = hidden / 8;
        const CombineRange range = combine_range(c);
        for (int i = range.first + thread; i < range.last; i += kNumCombineThreads) {
            const int t = i / chunks_per_token, col = (i % chunks_per_token) * 8;
            float sum[8] = {};
            // Top-k slots in groups of kSlotsInFlight: every load of a group is issued before the
            // first add (a dependent chain of L2 round trips cost ~6x here)
            for (int k0 = 0; k0 < topk; k0 += kSlotsInFlight) {
                int4 v[kSlotsInFlight];
                bool valid[kSlotsInFlight];
                #pragma unroll
                for (int dk = 0; dk < kSlotsInFlight; ++dk) {
                    const int k = k0 + dk;
                    const int64_t e = k < topk ? topk_idx[static_cast<int64_t>(t) * topk + k] : -1;
                    valid[dk] = e >= 0 and e < lay.num_experts;
                    if (valid[dk])
                        v[dk] = __ldcg(reinterpret_cast<const int4*>(slots + (static_cast<int64_t>(k) * n_max + t) * hidden + col));
                }
                #pragma unroll
                for (int dk = 0; dk < kSlotsInFlight; ++dk) {
                    if (valid[dk]) add_bf16x8(sum, v[dk]);    // fixed order: k ascending
                }
            }
            *reinterpret_cast<int4*>(y + static_cast<int64_t>(t) * hidden + col) = bf16x8_of(sum);
        }
        if (thread == 0) trace(kTraceCombineEnd);
    }

    // ------------------------------------------------------------------------------------------
    // Scheduler + TMA producer (one lane)
    __device__ void scheduler(const TensorMaps& tm) {
        const CUtensorMap *tm_l1_w = tm.l1_w, *tm_l2_w = tm.l2_w;
        uint32_t stage_iter = 0;
        // Stages armed so far, and how many of them also have their A tile issued: on abort every
        // armed stage is completed and waited for, so no TMA write lands after the CTA has left
        uint32_t armed_end = 0, a_issued_end = 0;
        const int total = tasks.total();
        auto* control = mine<uint32_t>(lay.control);
        const auto* arrival = mine<uint32_t>(lay.mblock_arrival);
        const auto* l1_done = mine<uint32_t>(lay.mblock_l1_done);
        bool is_l1 = false, narrow = false;
        [[maybe_unused]] int tok_pass = 0, tok_passes = 1;   // the CTA pair: the task's token passes (math(): the same)
        [[maybe_unused]] int pair_rows = 0;                 // the CTA pair with N = 16 / 32 tiles: the task's M-block's tokens
        [[maybe_unused]] int a_rows = BLOCK_M;   // N = 16 / 32 transposed tiles: the A box's rows (16, 32, or BLOCK_M)
        int m = 0;
        int kb0 = 0;    // the task's first K-block (split-K L1 part q of s: q x num_kb / s)
        // A stage's bytes are expected when it is claimed (B may be streamed before the task's inputs
        // are ready), but the producer arrives on its full barrier only here, after the acquire of
        // the task's dependency: a math thread that waited for any stage of a task is ordered after
        // that acquire, so its plain loads of what the pull / L1 CTAs wrote (row weights, routing)
        // need no acquire of their own.
        auto issue_a = [&](uint32_t it) {
            const int s = it % kNumStages, kb = static_cast<int>(it - stage_iter) + kb0;
            // A narrow tile's math reads rows 0 .. kNarrowRows - 1 only: a box of those rows (the
            // same bytes, same swizzle) instead of BLOCK_M rows, 7/8 less per stage to bring in
            const CUtensorMap* tm_act = is_l1 ? (narrow ? tm.l1_act_narrow : tm.l1_act) : (narrow ? tm.l2_act_narrow : tm.l2_act);
            if constexpr (kWideN16 or kWideN32) {   // a transposed tile of N = 16 / 32 reads that many rows
                if (a_rows == 16) tm_act = is_l1 ? tm.l1_act_16 : tm.l2_act_16;
                if (a_rows == 32) tm_act = is_l1 ? tm.l1_act_32 : tm.l2_act_32;
            }
            if constexpr (kCtaPair) tma_load_2d(sm.stage_a(s), tm_act, sm.full + s, kb * BLOCK_K, m * BLOCK_M + tok_pass * kPairPassRows);
            else tma_load_2d(sm.stage_a(s), tm_act, sm.full + s, kb * BLOCK_K, m * BLOCK_M);
            if constexpr (kStageSfBytes > 0) {
                // the M-block's activation scales of this K-block: BLOCK_M contiguous floats (pool is M-major)
                const float* sf = mine<float>(is_l1 ? lay.l1_sf : lay.l2_sf) + static_cast<int64_t>(kb) * lay.num_pool_rows + m * BLOCK_M;
                bulk_load(sm.stage_sf(s), sf, kStageSfBytes, sm.full + s);
            }
            mbarrier_arrive(sm.full + s);
        };
        // Task-log kernels: A tile of K-block kb (of the task) issued (kTraceKbLastIssue)
        [[maybe_unused]] const auto trace_last_issue = [&](int kb) {
            if constexpr (kTaskLogKBlocks) trace(kTraceKbLastIssue + kb);
        };
        // Task log (kTaskLog kernels, traced calls): this thread's stamps 5-9 of the entry the math
        // gives the same task (both count the tasks past the pull in ring order)
        [[maybe_unused]] int plog = -1, plogged = 0;
        [[maybe_unused]] const auto producer_log = [&](int k) {
            if constexpr (kTaskLog) {
                if (plog >= 0) p.trace[blockIdx.x * kTraceSlots + kTraceTaskBase + plog * kTraceTaskStamps + k] = globaltimer_ns();
            }
        };
        for (int i = 0;; ++i) {
            int t = i == 0 ? sm.ctrl->first_task : static_cast<int>(atomicAdd(control + L::kControlTaskQueue, 1));
            const int slot = i % kTaskRing;
            const bool slot_free = bounded_wait(p, sm.ctrl, Phase::kPipeline, p.rank,
                                                [&] { return mbarrier_try_wait(sm.ring_empty + slot, ((i / kTaskRing) & 1) ^ 1); });
            if (not slot_free) t = total;    // aborted: let every role leave
            sm.ring_task[slot] = t;
            mbarrier_arrive(sm.ring_full + slot);
            if (t >= total) break;
            if constexpr (kTaskLog) {
                plog = p.trace != nullptr and plogged < kTraceTasks and t >= tasks.pull_end() ? plogged++ : -1;
                producer_log(kTaskStampTicket);
            }

            if (t < tasks.pull_end()) continue;   // the dispatch warps'
            if (t >= tasks.l2_end()) {
                // A combine task: the math releases its slot once combine_ready is in (math()); while
                // other combine tasks are left, claim the next ticket only then, so that a CTA waiting
                // for combine_ready holds one task, not a ring of them (an abort ends the wait; the
                // next claim then leaves). After the last one the next ticket ends the CTA: claim it now.
                if (t + 1 < total)
                    bounded_wait(p, sm.ctrl, Phase::kPipeline, p.rank,
                                 [&] { return mbarrier_try_wait(sm.ring_empty + slot, (i / kTaskRing) & 1); });
                continue;
            }
            is_l1 = t < tasks.l1_end();
            const int idx = is_l1 ? t - tasks.pull_end() : t - tasks.l1_end();
            const int nblocks = is_l1 ? tasks.num_l1_nblocks : tasks.num_l2_nblocks;
            // split-K L1: consecutive tasks are the K parts of one tile (math(): the same rule)
            const int split = is_l1 ? tasks.l1_split : 1;
            const int tile = idx / split;
            m = tile / nblocks;
            const int j = tile % nblocks;
            const int le = expert_of_mblock(m);

            // num_kb: K-blocks of the whole reduction (the strides below); task_kb of this task,
            // K-blocks [kb0, kb0 + task_kb)
            const int num_kb = (is_l1 ? lay.hidden : lay.intermediate_hidden) / BLOCK_K;
            const int task_kb = num_kb / split;
            kb0 = (idx % split) * task_kb;
            // The task's B rows (L1: 256, gate row block 2j, up 2j + 1), streamed in one pass, but
            // for a wider L2 task (kL2BlockN 256 / 512): passes of kL2PassN rows (256) when its M-block
            // is narrow (or transposed), else passes of 128 rows, each pass a whole K loop (the math
            // runs its tile once per pass)
            int b_rows = is_l1 ? kMegaMoEBlockNL1 : kMegaMoEBlockNL2;
            int num_passes = 1;
            if constexpr (kL2OnePass) {
                if (not is_l1) b_rows = kL2PassN;
            } else if constexpr (kL2BlockN > kMegaMoEBlockNL2) {
                if (not is_l1 and (kTransposedWide or valid_rows(m, le) <= kNarrowRows)) {   // as the math decides
                    b_rows = kL2PassN;
                    if constexpr (kL2Passes > 1) num_passes = kL2Passes;
                } else if (not is_l1) {
                    num_passes = kL2WidePasses;
                }
            }
            // With kL2Tiles == 1 what follows is the 128-wide kernel from before the 256-wide
            // variant, and its SASS is identical (docs/KERNEL.md): keep the 256-wide code in
            // `if constexpr` and out of the expressions the 128-wide kernel evaluates
            int b_row0 = le * (is_l1 ? 2 * lay.intermediate_hidden : lay.hidden) + j * b_rows * num_passes;
            // FP8 x FP4: B arrives packed (64 bytes per row and K-block) with its exponent deltas
            // (4 bytes per row and K-block); the math warpgroups expand it
            const uint32_t b_bytes = kFP4 ? b_rows * (kMegaMoEPackedRowBytes + 4)
                                          : (is_l1 ? kBBytesL1 : kL2Tiles == 1 ? kBBytesL2 : b_rows * 128);
            // The math's choice of tile for the same M-block (math(): L1 and L2 tasks; for a two-pass
            // L2 task, both passes). The rule is spelled out in these three places rather than in a
            // helper: a helper reorders the SASS of the BLOCK_M = 64 kernels (measured on the CPU),
            // which would need a GPU A/B to land
            narrow = kSplitN and (kCtaPair or valid_rows(m, le) <= kNarrowRows);
            if constexpr (kCtaPair) tok_pass = 0, tok_passes = pair_token_passes(valid_rows(m, le));
            uint32_t a_bytes = narrow ? kNarrowABytes : kABytes;
            if constexpr (kWideN16 or kWideN32) {   // the math's choice of N (math(): the same rule)
                const int rows = valid_rows(m, le);
                if constexpr (kPairWide) {   // the first token pass's tile (pair_pass_geometry: the next ones')
                    pair_rows = rows;
                    a_rows = pair_pass(rows, 0).n, narrow = a_rows == kNarrowRows;
                } else {
                    a_rows = narrow ? kNarrowRows : kWideN16 and rows <= 16 ? 16 : kWideN32 and rows <= 32 ? 32 : BLOCK_M;
                }
                a_bytes = static_cast<uint32_t>(a_rows) * 128;
            }
            uint32_t stage_bytes = a_bytes + kStageSfBytes + b_bytes;   // the CTA pair with N = 16 / 32 tiles: per token pass
            // Token pass q's A box (N rows at token q x kPairPassRows: issue_a) and the stage bytes that go with it
            [[maybe_unused]] const auto pair_pass_geometry = [&](int q) {
                a_rows = pair_pass(pair_rows, q).n, narrow = a_rows == kNarrowRows;
                stage_bytes = static_cast<uint32_t>(a_rows) * 128 + kStageSfBytes + b_bytes;
            };
            const CUtensorMap* tm_w = is_l1 ? tm_l1_w : tm_l2_w;
            // FP4 packed codes and deltas: one block each per (128-row block, K-block), the blocks of a
            // row block K-major; block0 = the pass's first row block at K-block 0
            const uint8_t* deltas = nullptr;
            int64_t block0 = 0;
            int row_block0 = 0;     // the pass's first row block among all of the weight's 128-row blocks
            // FP32 weight block scales, [K-blocks] per 128-row block (adjacent row blocks adjacent):
            // L1 gate row block 2j, up 2j + 1
            const float* w_sf = nullptr;
            if constexpr (kFP8)
                w_sf = is_l1 ? p.l1_weight_scales + (static_cast<int64_t>(le) * (2 * lay.intermediate_hidden / 128) + 2 * j) * num_kb
                             : p.l2_weight_scales + (static_cast<int64_t>(le) * (lay.hidden / 128) + j * kL2WidePasses) * num_kb;
            if constexpr (kFP4) {
                const int row_blocks = (is_l1 ? 2 * lay.intermediate_hidden : lay.hidden) / 128;
                row_block0 = le * row_blocks + j * (b_rows * num_passes / 128);
                block0 = static_cast<int64_t>(row_block0) * num_kb;
                deltas = is_l1 ? p.l1_weight_deltas : p.l2_weight_deltas;
            }
            auto claim_stage = [&](uint32_t it) {
                const int s = it % kNumStages;
                if (not bounded_wait(p, sm.ctrl, Phase::kPipeline, p.rank,
                                     [&] { return mbarrier_try_wait_suspend<kStageSuspendNs>(sm.empty + s, ((it / kNumStages) & 1) ^ 1); }))
                    return false;
                if (kTaskLog and it == stage_iter) producer_log(kTaskStampStageFree);
                mbarrier_expect_tx(sm.full + s, stage_bytes);
                const int kb = static_cast<int>(it - stage_iter) + kb0;
                if constexpr (kTaskLogKBlocks) {
                    if (is_l1 and it - stage_iter < kTraceKbSlots) trace(kTraceKbLastFree + static_cast<int>(it - stage_iter));
                }
                if constexpr (kFP4) {
                    if (b_rows == 2 * kMegaMoEBlockNL2) {
                        // A row-block pair (L1: gate 2j and up 2j + 1; a narrow 256-wide L2 tile): its two
                        // 8 KB code blocks in one 4-D box {row bytes, block rows, K-block kb, 2 row blocks}
                        // and its two delta blocks in one 3-D box, each landing as the pair's two blocks
                        // back to back, as the per-block copies below put them
                        tma_load_4d(sm.stage_b(s), is_l1 ? tm_l1_w : tm.l2_w_pair, sm.full + s, 0, 0, kb, row_block0);
                        tma_load_3d(sm.stage_deltas(s), is_l1 ? tm.l1_d_pair : tm.l2_d_pair, sm.full + s, 0, kb, row_block0);
                    } else {
                        // Per 128-row block: its packed codes (one contiguous 8 KB block, a TMA box of
                        // p.fp4_code_box_rows rows: the map's view of the block) and its deltas (512 bytes)
                        for (int rb = 0; rb < b_rows / 128; ++rb) {
                            const int64_t block = block0 + static_cast<int64_t>(rb) * num_kb + kb;
                            tma_load_2d(sm.stage_b(s) + rb * 128 * kMegaMoEPackedRowBytes, tm_w, sm.full + s, 0, static_cast<int>(block * p.fp4_code_box_rows));
                            bulk_load(sm.stage_deltas(s) + rb * kMegaMoEDeltaBlockBytes, deltas + block * kMegaMoEDeltaBlockBytes,
                                      kMegaMoEDeltaBlockBytes, sm.full + s);
                        }
                    }
                } else {
                    tma_load_2d(sm.stage_b(s), tm_w, sm.full + s, kb * BLOCK_K, b_row0);   // L1 256 rows, L2 128
                    if constexpr (kL2Tiles == 2) {   // a narrow M-block's (or kL2OnePass) 256-row L2 pass: its second 128 rows
                        if (not is_l1 and b_rows == kL2PassN)
                            tma_load_2d(sm.stage_b(s) + kMegaMoEBlockNL2 * 128, tm_w, sm.full + s, kb * BLOCK_K, b_row0 + kMegaMoEBlockNL2);
                    }
                }
                if constexpr (kFP8) {
                    // The K-block's weight scales ride with the tile (one per 128-row block): 4-byte
                    // copies, so the full barrier also waits for them (the math reads them from the stage)
                    cp_async_4(sm.stage_wsf(s), w_sf + kb);
                    if constexpr (kL2Tiles == 1) {
                        if (is_l1) cp_async_4(sm.stage_wsf(s) + 1, w_sf + num_kb + kb);
                    } else {   // L1 gate and up, or both row blocks of a 256-row L2 tile
                        if (b_rows == 2 * kMegaMoEBlockNL2) cp_async_4(sm.stage_wsf(s) + 1, w_sf + num_kb + kb);
                    }
                    cp_async_arrive_on(sm.full + s);
                }
                armed_end = it + 1;
                return true;
            };

            // Weights do not depend on this call's routing: stream the first stages of B while the
            // M-block's tokens (L1) or its L1 outputs (L2) are still on their way. In decode this
            // overlaps nearly all L2 weight traffic with L1, and all of it with dispatch. The
            // dependency is probed (relaxed load) before the first stage is claimed and looked at
            // once that claim is in: when it is already met (later L2 tasks, prefill), A tiles go out
            // with their B at once, not after the prefetched stages and a blocking acquire.
            const uint32_t* dep = is_l1 ? arrival + m : l1_done + m;
            const uint32_t dep_target = is_l1 ? 1u : static_cast<uint32_t>(tasks.num_l1_nblocks * kNumMathWGs);
            const Phase dep_phase = is_l1 ? Phase::kL1Wait : Phase::kL2Wait;
            const uint32_t probe = ld_relaxed_gpu(dep);
            const int num_prefetch = min_of(task_kb, min_of(kNumStages, is_l1 ? p.num_prefetch_stages : p.num_prefetch_stages_l2));
            bool ok = true, ready = false;
            if constexpr (kTaskLog) producer_log(kTaskStampDecoded);
            [[maybe_unused]] next_pass:   // an L2 task's next pass (a goto: no loop in the 128-wide kernel)
            {
                int a_next = 0;     // the first K-block of this pass whose A tile is not issued yet
                for (int kb = 0; kb < task_kb and ok; ++kb) {
                    if (not ready and kb >= num_prefetch) {
                        // acquire: L1 waits for its M-block's tokens, L2 for all L1 N-blocks of its M-block
                        ok = bounded_wait(p, sm.ctrl, dep_phase, p.rank, [&] { return ld_acquire_gpu(dep) >= dep_target; });
                        if (not ok) break;
                        fence_proxy_async_global();
                        ready = true;
                        // The prefetched stages get their A tiles before the next claim, which may wait for
                        // the math to release one of them (it cannot before its A arrives)
                        for (; a_next < kb; ++a_next) {
                            issue_a(stage_iter + a_next), a_issued_end = stage_iter + a_next + 1;
                            if (kTaskLog and a_next == 0) producer_log(kTaskStampFirstA);
                            if (kTraceKBlockStamps and is_l1 and a_next < kTraceKbSlots) trace(kTraceKbIssue + a_next, true), trace_last_issue(a_next);
                        }
                    }
                    ok = claim_stage(stage_iter + kb);
                    if (not ok) break;
                    if (kTaskLog and kb == 0) producer_log(kTaskStampClaimed);
                    if (kb == 0 and not ready and probe >= dep_target) {
                        fence_acq_rel_gpu();          // after the relaxed probe: an acquire of the dependency
                        fence_proxy_async_global();
                        ready = true;
                    }
                    for (; ready and a_next <= kb; ++a_next) {
                        issue_a(stage_iter + a_next), a_issued_end = stage_iter + a_next + 1;
                        if (kTaskLog and a_next == 0) producer_log(kTaskStampFirstA);
                        if (kTraceKBlockStamps and is_l1 and a_next < kTraceKbSlots) trace(kTraceKbIssue + a_next, true), trace_last_issue(a_next);
                    }
                }
                if (ok and not ready) {   // every K-block was prefetched: wait, then all A tiles
                    ok = bounded_wait(p, sm.ctrl, dep_phase, p.rank, [&] { return ld_acquire_gpu(dep) >= dep_target; });
                    if (ok) {
                        fence_proxy_async_global();
                        for (; a_next < task_kb; ++a_next) {
                            issue_a(stage_iter + a_next), a_issued_end = stage_iter + a_next + 1;
                            if (kTaskLog and a_next == 0) producer_log(kTaskStampFirstA);
                            if (kTraceKBlockStamps and is_l1 and a_next < kTraceKbSlots) trace(kTraceKbIssue + a_next, true), trace_last_issue(a_next);
                        }
                    }
                }
            }
            if (not ok) break;
            stage_iter += task_kb;
            if constexpr (kCtaPair) {
                if (++tok_pass < tok_passes) {   // the same B rows for the next kPairPassRows tokens (issue_a)
                    if constexpr (kPairWide) pair_pass_geometry(tok_pass);
                    ready = true;
                    goto next_pass;
                }
                tok_pass = 0;
                if constexpr (kPairWide) pair_pass_geometry(0);   // a 512-wide L2 task's second weight pass starts over
            }
            if constexpr (kL2BlockN > kMegaMoEBlockNL2) {
                if (--num_passes > 0) {   // the task's next b_rows rows; its dependency is met (ready)
                    ready = true;
                    // 128-row blocks a pass spans: 1 in a 256-wide kernel (only a wide M-block's task has
                    // two passes there), b_rows / 128 in a 512-wide one
                    const int pass_rbs = kL2Passes > 1 ? b_rows / kMegaMoEBlockNL2 : 1;
                    b_row0 += pass_rbs * kMegaMoEBlockNL2;
                    if constexpr (kFP8) w_sf += pass_rbs * num_kb;
                    if constexpr (kFP4) block0 += pass_rbs * num_kb, row_block0 += pass_rbs;
                    goto next_pass;
                }
            }
        }

        // Aborted (or done: then nothing is pending). Stages armed without their A tile get it now
        // (in-bounds pool rows; the contents do not matter, the math leaves at them: dead_from,
        // published before their arrivals release it), then every armed stage is waited for. Stages
        // past armed_end are never armed: the math leaves when it waits for one (armed_final).
        *reinterpret_cast<volatile uint32_t*>(&sm.ctrl->dead_from) = a_issued_end;
        *reinterpret_cast<volatile uint32_t*>(&sm.ctrl->armed_final) = armed_end;
        for (uint32_t it = a_issued_end; it < armed_end; ++it) issue_a(it);
        const uint64_t start = globaltimer_ns();
        for (uint32_t it = armed_end > kNumStages ? armed_end - kNumStages : 0; it < armed_end; ++it)
            while (not mbarrier_try_wait(sm.full + it % kNumStages, (it / kNumStages) & 1) and globaltimer_ns() - start < p.timeout_ns) {}
    }

    // The i-th task of the ring (every consumer thread reads every slot); `total` when aborted.
    // Every consumer thread releases the slot once (release_task): at once, but a math thread holding a
    // combine task only once combine_ready is in.
    __device__ int next_task(int i, int total, bool release = true) {
        const int slot = i % kTaskRing;
        const bool ok = bounded_wait(p, sm.ctrl, Phase::kPipeline, p.rank,
                                     [&] { return mbarrier_try_wait_suspend<kRingSuspendNs>(sm.ring_full + slot, (i / kTaskRing) & 1); });
        const int t = ok ? sm.ring_task[slot] : total;
        if (release) release_task(i);
        return t;
    }
    __device__ void release_task(int i) { mbarrier_arrive(sm.ring_empty + i % kTaskRing); }

    // Dispatch warps: pull tasks from the ring
    __device__ void dispatch_worker() {
        const int dispatch_thread = static_cast<int>(threadIdx.x) - 32;
        const int total = tasks.total();
        uint32_t slot_uses = 0;   // bulk pulls: how often this thread's slot was filled (its mbarrier's phase)
        for (int i = 0;; ++i) {
            const int t = next_task(i, total);
            // one decision for the whole group (its next named barrier needs every thread)
            // Calls with the signals thread: past this CTA's pulls (its tickets rise) dispatch thread 0
            // takes over the group's part of the ring and raises the math's signals (signals_worker)
            const bool to_signals = kSignalsThread and t >= tasks.pull_end();
            if (named_barrier_or(kBarrierDispatchDecide, kNumDispatchThreads, to_signals or t >= total or sm.ctrl->abort)) {
                if constexpr (kSignalsThread) {
                    if (to_signals and dispatch_thread == 0) signals_worker(i + 1, t >= total);
                }
                break;
            }
            if (t < tasks.pull_end()) pull(t, dispatch_thread, slot_uses);
        }
    }

    // ------------------------------------------------------------------------------------------
    // Math warpgroups. BLOCK_M = 128: each warpgroup owns 64 rows and all columns of a tile.
    // BLOCK_M = 64 (decode): both warpgroups share the 64 rows and split the columns (L1: gate and
    // up of 64 of the 128 output columns each, L2: 64 of 128), so the MMAs of one K-block run on
    // both at once instead of one after the other, and each runs half of every epilogue.
    struct MathThread {
        int wg, tid, warp, lane;
        bool tracer;   // thread 0 of its warpgroup, in a traced call: writes the K-loop's trace stamps
        int log;       // tracer of warpgroup 0: the task-log entry of the task it runs, or -1
        __device__ int row_in_tile(int half) const { return (kSplitN ? 0 : wg * 64) + warp * 16 + lane / 4 + 8 * half; }
        __device__ int row0() const { return kSplitN ? 0 : wg * 64; }   // first tile row of this warpgroup
    };

    // Task log (scripts/trace.py --tasks): stamp k of the task mt.log. Only in the kernel variant
    // built with DG_MEGA_MOE_TASK_LOG=1 or 2 (its stamps moved registers in the K-loops of the others)
    __device__ void log_task(const MathThread& mt, int k, uint64_t value = 0) const {
        if constexpr (kTaskLog) {
            if (mt.log >= 0)
                p.trace[blockIdx.x * kTraceSlots + kTraceTaskBase + mt.log * kTraceTaskStamps + k] = k == kTaskStampId ? value : globaltimer_ns();
        }
    }
    __device__ void log_task_id(const MathThread& mt, TraceTaskKind kind, int rows, int t) const {
        log_task(mt, kTaskStampId, static_cast<uint64_t>(rows) << 40 | static_cast<uint64_t>(kind) << 32 | static_cast<uint32_t>(t));
    }

    // Leave-now decisions of the math side, taken by every thread of the group that meets at
    // barriers: both warpgroups when they share a tile (split columns) or a barrier (FP4
    // expansion), else each warpgroup alone, so that 64-row tiles of a 128-row block never wait
    // for each other
    static constexpr bool kMathWideDecisions = kSplitN or kFP4;
    __device__ bool math_any(bool pred, const MathThread& mt) const {
        return kMathWideDecisions ? named_barrier_or(kBarrierMathDecide, kNumMathThreads, pred)
                                  : named_barrier_or(kBarrierMathDecide + mt.wg, 128, pred);
    }

    // Wait for a stage's bytes; false when the call was aborted. No group barrier: the decision
    // follows from the stage itself, the same for every thread that waits for it. A stage the
    // producer armed completes (its drain issues the missing A tiles; task_stages_dead stops the
    // task before its epilogue); a stage it never armed never completes: leave once armed_final
    // says so. The math's own bound (twice the producer's) is a last resort for a copy that never lands.
    __device__ bool wait_full(uint32_t stage_iter) {
        const int s = stage_iter % kNumStages;
        const uint32_t parity = (stage_iter / kNumStages) & 1;
        const uint32_t ctrl = smem_addr(sm.ctrl);
        constexpr uint32_t kArmedFinal = offsetof(SharedControl, armed_final);
        if (not mbarrier_try_wait(sm.full + s, parity)) {
            const uint64_t start = globaltimer_ns();
            for (uint32_t n = 1; not mbarrier_try_wait(sm.full + s, parity); ++n) {
                if ((n & kPollMask) != 0) continue;
                if (stage_iter >= static_cast<uint32_t>(ld_volatile_shared_s32(ctrl + kArmedFinal))) return false;
                if (globaltimer_ns() - start > 2 * p.timeout_ns) {
                    report(p, StatusCode::kTimeout, Phase::kPipeline, p.rank, n, true, sm.ctrl);
                    return false;
                }
            }
        }
        return true;
    }
    // After a task's K-loop (stage_iter one past its last stage): were its last stages completed by
    // the producer's drain (A tiles of no meaning)? Then leave before the epilogue. Checked once per
    // task rather than after every stage wait: a dead stage's bytes only reach the accumulators,
    // and dead stages are the suffix [dead_from, armed_final), so the task's last stage tells.
    __device__ bool task_stages_dead(uint32_t stage_iter) const {
        return stage_iter - 1 >= static_cast<uint32_t>(ld_volatile_shared_s32(smem_addr(sm.ctrl) + offsetof(SharedControl, dead_from)));
    }
    // wait_full for L1 K-block kb, with its trace stamps (scripts/trace.py: first stage, K-block
    // cadence). One predicate per K-block when not tracing (mt.tracer: decided once per call)
    // instead of the stamps' own tests (Nsight Compute put ~8 % of the FP8 x FP4 decode L1 loop's
    // stall samples there; taking them out did not change the time: docs/PERF.md, session 13).
    __device__ bool wait_full_l1(int kb, uint32_t stage_iter, const MathThread& mt) {
        if (not wait_full(stage_iter)) return false;
        if (mt.tracer and kb < kTraceKbSlots) {
            if (kb == 0) trace(kTraceL1FirstStage, true), log_task(mt, kTaskStampFirstStage);
            if (kTraceKBlockStamps and mt.wg == 0) trace(kTraceKbReady + kb, true);
            if (kTaskLogKBlocks and mt.wg == 0) trace(kTraceKbLastReady + kb);
        }
        return true;
    }
    // Task-log kernels: when warpgroup 0's tracer released K-block kb of an L1 task (kTraceKbLastRelease)
    __device__ void trace_l1_release(int kb, const MathThread& mt) const {
        if constexpr (kTaskLogKBlocks) {
            if (mt.tracer and mt.wg == 0 and kb < kTraceKbSlots) trace(kTraceKbLastRelease + kb);
        }
    }
    // Every lane's reads of the stage (wgmma and the scales in it) happen before its warp's arrival
    __device__ void release_stage(uint32_t stage_iter, const MathThread& mt) {
        __syncwarp();
        if (mt.lane == 0) mbarrier_arrive(sm.empty + stage_iter % kNumStages);
    }

    // FP8 x FP4. Code c of a 32-wide group with exponent delta d becomes RNE_e4m3(e2m1(c) * 2^(6 - d)):
    // the magnitude fp4_table[d][c & 7] with c's sign bit as bit 7 (E4M3 is sign-magnitude); the rest
    // of the scale (2^(base - 133)) is the FP32 block scale applied at promotion. The packed codes
    // are permuted within each row and K-block (mega_moe_fp4_packed_byte): word ks of the row's
    // 16-byte chunk q holds the 8 codes of one wgmma fragment pair, K 32 ks + 4 q + [0, 4) (magnitudes
    // in the low 16 bits) and K 32 ks + 16 + 4 q + [0, 4) (high 16 bits), all of delta group ks, with
    // the signs placed for the expansion (mega_moe_fp4_sign_bit).
    static constexpr bool fp4_chunks_hold_fragments() {
        for (int ks = 0; ks < 4; ++ks)
            for (int hi = 0; hi < 2; ++hi)
                for (int q = 0; q < 4; ++q)
                    for (int b = 0; b < 2; ++b)
                        if (mega_moe_fp4_packed_byte(16 * ks + 8 * hi + 2 * q + b) != kMegaMoEFP4ChunkBytes * q + 4 * ks + 2 * hi + b) return false;
        return true;
    }
    static constexpr bool fp4_signs_where_expanded() {
        for (int j = 0; j < 4; ++j)
            if (mega_moe_fp4_sign_bit(0, j) != 8 * j + 7 or mega_moe_fp4_sign_bit(1, j) + 4 != 8 * j + 7) return false;
        return true;
    }
    static_assert(fp4_signs_where_expanded(), "expand_e2m1x8 takes .x's signs in place and .y's shifted up by 4");
    static_assert(not kFP4 or (fp4_chunks_hold_fragments() and kMegaMoEFP4ChunkBytes * 4 == kMegaMoEPackedRowBytes and
                               mma::kWgmmaStepsPerKBlock == 4 and BLOCK_K / mma::kWgmmaStepsPerKBlock == 32),
                  "chunk q = lane % 4 of a row, word ks = K step ks = 32-wide delta group ks: the layout the loads below assume");

    // 8 codes (one 32-bit word of a chunk) -> E4M3 bytes of K [0, 4) (.x, magnitudes from nibbles 0-3)
    // and K [16, 20) (.y, nibbles 4-7) of the fragment pair, with `mag` the table row of their group's
    // delta. The transform placed the signs (mega_moe_fp4_sign_bit): .x's at bits 8 j + 7, where E4M3
    // keeps its sign, .y's at bits 8 j + 3, four places below; bit 3 of every nibble is a sign, so
    // it is masked out of the prmt selectors (it would select prmt's sign-replicate mode)
    __device__ __forceinline__ static uint2 expand_e2m1x8(uint32_t codes, uint2 mag) {
        const uint32_t sel = codes & 0x77777777u;
        return make_uint2(prmt(mag.x, mag.y, sel) | (codes & 0x80808080u),
                          prmt(mag.x, mag.y, sel >> 16) | ((codes << 4) & 0x80808080u));
    }
    // A row's delta word (byte g: group g's delta) as the byte offsets of its 4 table rows (8 bytes
    // per delta), or-ed with `hi` (fp4_table_hi). Weights are host data: the mask keeps a corrupted
    // byte from indexing past the table.
    static_assert(kMegaMoEFP4TableBytes == 16 * 8, "the offsets below: 4 bits of delta, 8-byte rows");
    __device__ __forceinline__ static uint32_t fp4_table_offsets(uint32_t deltas, uint32_t hi) { return ((deltas << 3) & 0x78787878u) | hi; }
    // Decode tiles: the table is 128-aligned, so a row's address is the table's with its low byte
    // replaced by the row's offset and the table address's bit 7, which `hi` carries in every byte
    // (one prmt per row, selector 0x765g: no add, no uniform register for the base). Prefill tiles
    // (BLOCK_M 128) keep the older form, the offset byte zero-extended by one prmt and added to the
    // base, which ptxas holds in a uniform register there: the form above measured no faster at
    // prefill and put two more values of the 128-row L1 loop in local memory.
    __device__ __forceinline__ static uint32_t fp4_table_hi(uint32_t table) { return BLOCK_M == 128 ? 0u : (table & 0x80u) * 0x01010101u; }
    __device__ __forceinline__ static uint2 fp4_magnitudes(uint32_t offsets, int g, uint32_t table) {
        if constexpr (BLOCK_M == 128) return ld_shared_v2(table + prmt(offsets, 0u, 0x4440u + g));
        else return ld_shared_v2(prmt(offsets, table, 0x7650u + g));
    }
    __device__ __forceinline__ uint32_t fp4_table_offsets(uint32_t deltas) const { return fp4_table_offsets(deltas, fp4_table_hi(smem_addr(sm.fp4_table))); }
    __device__ __forceinline__ uint2 fp4_magnitudes(uint32_t offsets, int g) const { return fp4_magnitudes(offsets, g, smem_addr(sm.fp4_table)); }
    // A value the compiler cannot recompute: in the narrow loops it re-derived the table address
    // from the control block's in every K-block (7 more instructions per K-block)
    __device__ __forceinline__ static uint32_t opaque_u32(uint32_t v) {
        uint32_t r;
        asm volatile("mov.b32 %0, %1;" : "=r"(r) : "r"(v));
        return r;
    }

    // Wide tiles (prefill; decode runs transposed wide tiles): expand the stage's packed B tile into
    // the E4M3 tile `dst` the wgmma reads (sm.expanded(stage_iter), of two: the next K-block's
    // expanded while the wgmma reads this one's). A barrier of all math threads before
    // the first store, so that no warpgroup overwrites the tile while the other's wgmma of an earlier
    // K-block still reads it, and one after the last; in the 128B-swizzled K-major layout that TMA
    // would have produced, so the FP8 wgmma path runs unchanged. A warp takes 8-row groups
    // warp, warp + 8, ...; lane l loads chunk l % 4 of row l / 4 (the warp's 32 lanes read the
    // group's 512 contiguous bytes: no bank conflicts) and expands it into 8 words, word (ks, hi) =
    // bytes 4 (l % 4) .. + 3 of the row's 16-byte chunk 2 ks + hi of the E4M3 tile: exactly the
    // stmatrix fragment of 8 x 16-byte matrix (ks, hi), so two stmatrix.x4 write the group
    // (chunk c of row r at r * 128 + (c ^ r % 8) * 16 in its 1024-byte atom).
    // Part kPart of kParts expands groups [kPart, kPart + 1) * kGroups / kParts of each thread (the
    // L1 loop: gate's rows under gate's wgmma, up's under up's); the first barrier is part 0's, the
    // fence and the last barrier the last part's, so every math thread meets both once a tile.
    template <int kRows, int kPart = 0, int kParts = 1>
    __device__ void expand_fp4_tile(int s, uint8_t* dst) {
        constexpr int kMathWarps = kNumMathThreads / 32, kGroups = kRows / 8 / kMathWarps;
        static_assert(kNumMathThreads == 256 and kRows % (8 * kMathWarps) == 0 and kRows % 128 == 0,
                      "whole 8-row groups per warp, whole delta blocks");
        static_assert(kGroups % kParts == 0 and kPart < kParts, "whole groups per part");
        constexpr int kU0 = kPart * (kGroups / kParts), kU1 = kU0 + kGroups / kParts;
        // Math thread t = 32 warp + lane, read here rather than taken from the caller: from values live
        // across the task loop ptxas spilled the row index (one local load per K-block at BLOCK_M = 128);
        // these addresses cost a few integer instructions per tile
        uint32_t tid;
        asm volatile("mov.u32 %0, %%tid.x;" : "=r"(tid));
        const uint32_t t = tid - 128;
        // Lane's row of group u: 8 (warp + 8 u) + lane / 4. Packed [row][64 bytes]: chunk lane % 4 of
        // row 8 warp + lane / 4 is at 16 t; deltas [row][4 groups] at 4 (t / 4) (the delta blocks of
        // consecutive 128-row blocks are adjacent, as the packed blocks)
        const uint32_t packed = smem_addr(sm.stage_b(s)) + t * kMegaMoEFP4ChunkBytes;
        const uint32_t deltas = smem_addr(sm.stage_deltas(s)) + (t & ~3u);
        // stmatrix addresses in 1024-byte atoms: row t % 8 of the group, chunk t / 8 % 4 (first x4)
        // and 4 + t / 8 % 4 (second: the tile is 1024-aligned, so that is bit 6 flipped)
        const uint32_t out = smem_addr(dst) + t / 32 * 1024 + t % 8 * 128 + (((t / 8 % 4) ^ (t % 8)) << 4);
        constexpr int kGroupStride = 8 * kMathWarps;   // rows between a warp's groups
        // All groups' codes loaded first (their latencies overlap), but while a wgmma holds its
        // accumulators (kExpandAhead) one group at a time: the loads' registers would spill them
        constexpr int kLoadsAhead = kExpandAhead ? 1 : kU1 - kU0;
        uint4 codes[kGroups];
        uint32_t offsets[kGroups];
        #pragma unroll
        for (int u = kU0; u < kU0 + kLoadsAhead; ++u) {
            codes[u] = ld_shared_v4(packed + u * kGroupStride * kMegaMoEPackedRowBytes);
            offsets[u] = fp4_table_offsets(ld_shared_u32(deltas + u * kGroupStride * 4));
        }
        #pragma unroll
        for (int u = kU0; u < kU1; ++u) {
            if (u >= kU0 + kLoadsAhead) {
                codes[u] = ld_shared_v4(packed + u * kGroupStride * kMegaMoEPackedRowBytes);
                offsets[u] = fp4_table_offsets(ld_shared_u32(deltas + u * kGroupStride * 4));
            }
            uint2 e[mma::kWgmmaStepsPerKBlock];
            #pragma unroll
            for (int ks = 0; ks < mma::kWgmmaStepsPerKBlock; ++ks) e[ks] = expand_e2m1x8(word_of(codes[u], ks), fp4_magnitudes(offsets[u], ks));
            // Before the first store: every math thread's wgmma on the tile's previous contents is
            // complete (each waited for its own; the other warpgroup's may still be reading it)
            if (kPart == 0 and u == 0) named_barrier(kBarrierMathAll, kNumMathThreads);
            const uint32_t group = u * kGroupStride / 8 * 1024;
            stmatrix_x4(out + group, e[0].x, e[0].y, e[1].x, e[1].y);
            stmatrix_x4((out ^ 64) + group, e[2].x, e[2].y, e[3].x, e[3].y);
        }
        // The wgmma (async proxy) reads what these generic stores wrote; every math warpgroup
        // reads the whole tile, so all of them must be done expanding
        if constexpr (kPart == kParts - 1) {
            fence_proxy_async_shared();
            named_barrier(kBarrierMathAll, kNumMathThreads);
        }
    }

    // Columns per warpgroup and accumulators per thread. L1: gate and up of kL1Cols output columns
    // (acc[0, kL1Half) gate, acc[kL1Half, 2 kL1Half) up; split: columns [64 wg, 64 wg + 64) of the
    // 128-wide block, so SwiGLU stays in the thread); L2: kL2Cols columns.
    static constexpr int kL1Cols = kSplitN ? 64 : 128;
    static constexpr int kL1Half = kL1Cols / 2;
    static constexpr int kL1Acc = 2 * kL1Half;
    static constexpr int kL2Cols = kSplitN ? 64 : 128;
    static constexpr int kL2Acc = kL2Cols / 2;
    using FP8L2Mma = std::conditional_t<kSplitN, mma::FP8MmaN64, mma::FP8MmaN128>;
    using BF16L2Mma = std::conditional_t<kSplitN, mma::BF16MmaN64, mma::BF16MmaN128>;

    // L1 (column c of gate pairs with column c of up). Also returns the top-k weights of this
    // thread's two rows (read while the MMAs run).
    __device__ bool l1_mainloop(int m, uint32_t& stage_iter, const MathThread& mt, float (&acc)[kL1Acc], float (&row_w)[2]) {
        static_assert(not kFP4 or kExpandAhead, "FP8 x FP4 runs wide tiles at prefill only (decode: transposed_l1_mainloop)");
        const int num_kb = lay.hidden / BLOCK_K;
        const int64_t g0 = static_cast<int64_t>(m) * BLOCK_M + mt.row_in_tile(0);
        // Issued while the first MMAs run, used in the epilogue (ordered after the pull's writes by
        // the stage wait: see issue_a in the scheduler)
        auto read_task_inputs = [&] {
            row_w[0] = __ldcg(mine<float>(lay.row_weight) + g0);
            row_w[1] = __ldcg(mine<float>(lay.row_weight) + g0 + 8);
        };
        // B rows: gate [0, 128), up [128, 256); split: this warpgroup's 64 of each
        const uint32_t a_offset = mt.row0() * 128, gate_offset = (kSplitN ? mt.wg * 64 : 0) * 128, up_offset = gate_offset + 128 * 128;
        float* gate = acc;
        float* up = acc + kL1Half;
        if constexpr (kFP8) {
            #pragma unroll
            for (int i = 0; i < kL1Acc; ++i) acc[i] = 0.0f;
            if constexpr (kExpandAhead) {   // the first K-block's tile; each next one while up's wgmma runs
                if (not wait_full_l1(0, stage_iter, mt)) return false;
                expand_fp4_tile<kMegaMoEBlockNL1>(stage_iter % kNumStages, sm.expanded(stage_iter));
            }
            for (int kb = 0; kb < num_kb; ++kb, ++stage_iter) {
                if constexpr (not kExpandAhead) {
                    if (not wait_full_l1(kb, stage_iter, mt)) return false;
                }
                const int s = stage_iter % kNumStages;
                // (kExpandAhead: read after the expansion, below)
                const float sa0 = kExpandAhead ? 0.0f : sm.token_sf(s, mt.row_in_tile(0));
                const float sa1 = kExpandAhead ? 0.0f : sm.token_sf(s, mt.row_in_tile(1));
                const float sg = kExpandAhead ? 0.0f : sm.weight_sf(s, 0), su = kExpandAhead ? 0.0f : sm.weight_sf(s, 1);
                uint8_t* const b_tile = sm.mma_b(s, stage_iter);
                const uint64_t da = mma::make_k_major_sw128_desc(sm.stage_a(s) + a_offset);
                const uint64_t dg = mma::make_k_major_sw128_desc(b_tile + gate_offset);
                const uint64_t du = mma::make_k_major_sw128_desc(b_tile + up_offset);
                if constexpr (kSplitN) {
                    // gate and up of 64 columns each: both issued, one wait
                    float part_g[32], part_u[32];
                    mma::fence_operands(part_g), mma::fence_operands(part_u);
                    mma::warpgroup_arrive();
                    mma::FP8MmaN64::fma_k_block(da, dg, part_g, false);
                    mma::FP8MmaN64::fma_k_block(da, du, part_u, false);
                    mma::warpgroup_commit();
                    if (kb == 0) read_task_inputs();
                    mma::warpgroup_wait<0>();
                    mma::fence_operands(part_g), mma::fence_operands(part_u);
                    release_stage(stage_iter, mt);
                    #pragma unroll
                    for (int i = 0; i < 32; ++i) {
                        gate[i] += part_g[i] * ((i & 2) ? sa1 * sg : sa0 * sg);
                        up[i] += part_u[i] * ((i & 2) ? sa1 * su : sa0 * su);
                    }
                } else {
                    // 128 columns: gate, then up (two sets of 64 partial sums would not fit next to acc)
                    float part[64];
                    #pragma unroll
                    for (int half = 0; half < 2; ++half) {
                        mma::fence_operands(part);
                        mma::warpgroup_arrive();
                        mma::FP8MmaN128::fma_k_block(da, half == 0 ? dg : du, part, false);
                        mma::warpgroup_commit();
                        if (kb == 0 and half == 0) read_task_inputs();
                        if constexpr (kExpandAhead) {
                            // The next K-block's tile into the other expanded tile, its gate rows
                            // while gate's wgmma runs and its up rows while up's does
                            // (expand_fp4_tile's first barrier: both warpgroups' wgmmas of the
                            // K-block before, which read that tile, are complete)
                            if (kb + 1 < num_kb) {
                                if (half == 0) {
                                    if (not wait_full_l1(kb + 1, stage_iter + 1, mt)) {
                                        mma::warpgroup_wait<0>();
                                        return false;
                                    }
                                    expand_fp4_tile<kMegaMoEBlockNL1, 0, 2>((stage_iter + 1) % kNumStages, sm.expanded(stage_iter + 1));
                                } else {
                                    expand_fp4_tile<kMegaMoEBlockNL1, 1, 2>((stage_iter + 1) % kNumStages, sm.expanded(stage_iter + 1));
                                }
                            }
                        }
                        // kExpandAhead: the scales read after the expansion (held across it, they
                        // were spilled: the wgmma's accumulators and acc fill the registers)
                        float sb = half == 0 ? sg : su, sr0 = sa0, sr1 = sa1;
                        if (kExpandAhead)
                            sb = sm.weight_sf(s, half), sr0 = sm.token_sf(s, mt.row_in_tile(0)), sr1 = sm.token_sf(s, mt.row_in_tile(1));
                        mma::warpgroup_wait<0>();
                        mma::fence_operands(part);
                        if (half == 1) release_stage(stage_iter, mt);
                        const float s0 = sr0 * sb, s1 = sr1 * sb;
                        #pragma unroll
                        for (int i = 0; i < 64; ++i) acc[half * 64 + i] += part[i] * ((i & 2) ? s1 : s0);
                    }
                }
            }
        } else {
            // BF16: split, gate and up of 64 columns each; else one N = 256 wgmma over [gate | up]
            // (its accumulators 0..63 are columns 0..127 = gate), which reads A once
            float (&acc_g)[kL1Half] = *reinterpret_cast<float (*)[kL1Half]>(gate);
            float (&acc_u)[kL1Half] = *reinterpret_cast<float (*)[kL1Half]>(up);
            // 128-row tiles: zeroed first, so that the first wgmma's (unscaled) input is not the
            // previous task's values; else the accumulator is live across the task loop, and with the
            // 256-wide L2 task's next to it both went through local memory every K-block
            if constexpr (not kSplitN) {
                #pragma unroll
                for (int i = 0; i < kL1Acc; ++i) acc[i] = 0.0f;
            }
            for (int kb = 0; kb < num_kb; ++kb, ++stage_iter) {
                if (not wait_full(stage_iter)) return false;
                const int s = stage_iter % kNumStages;
                const uint64_t da = mma::make_k_major_sw128_desc(sm.stage_a(s) + a_offset);
                const uint64_t dg = mma::make_k_major_sw128_desc(sm.mma_b(s, stage_iter) + gate_offset);
                const uint64_t du = mma::make_k_major_sw128_desc(sm.mma_b(s, stage_iter) + up_offset);
                mma::fence_operands(acc);
                mma::warpgroup_arrive();
                if constexpr (kSplitN) {
                    mma::BF16MmaN64::fma_k_block(da, dg, acc_g, kb > 0);
                    mma::BF16MmaN64::fma_k_block(da, du, acc_u, kb > 0);
                } else {
                    mma::BF16MmaN256::fma_k_block(da, dg, acc, kb > 0);
                }
                mma::warpgroup_commit();
                if (kb == 0) read_task_inputs();
                mma::warpgroup_wait<0>();
                mma::fence_operands(acc);
                release_stage(stage_iter, mt);
            }
        }
        return true;
    }

    // BLOCK_M = 128, BF16, FP8 x FP8 with 256-wide L2 tasks and FP8 x FP4 (kSkipIdleRows): a warpgroup whose 64
    // rows of the M-block are all padding (an expert's last M-block of at most 64 tokens) runs no
    // wgmma. It waits for each of the task's stages and releases it (idle_mainloop), so the other
    // warpgroup paces the stages alone, and its epilogue, which would write nothing, only counts the
    // task. The same rows are idle in the M-block's L1 and L2 tasks, so nothing reads what its L1
    // task would have written. Not in the FP8 x FP8 128-wide kernel, whose L1 K-loop it gave a spilled
    // counter (+2.8 % at mid n = 4096).
    static constexpr bool kSkipIdleRows = not kSplitN and (kMmaType == MmaType::kBF16xBF16 or kL2OnePass or kExpandAhead);
    __device__ static bool idle_rows(const MathThread& mt, int rows) { return mt.row0() >= rows; }
    // FP8 x FP4 prefill (kExpandAhead): the idle warpgroup runs no wgmma either, but expands its half
    // of every B tile with the other (expand_fp4_tile's barriers: the same calls in the same order as
    // l1_mainloop's / l2_mainloop's) and releases each stage after the next one's expansion (session
    // 41, H200: deepseek-v3 n = 4096 -5.4 %, v4-flash n = 8192 -4.4 %, mid n = 2048 -3.4 %)
    template <int kRows>
    __device__ bool idle_mainloop(int num_kb, uint32_t& stage_iter, const MathThread& mt) {
        if constexpr (kExpandAhead) {
            if (not wait_full(stage_iter)) return false;
            expand_fp4_tile<kRows>(stage_iter % kNumStages, sm.expanded(stage_iter));
            for (int kb = 0; kb < num_kb; ++kb, ++stage_iter) {
                if (kb + 1 < num_kb) {
                    if (not wait_full(stage_iter + 1)) return false;
                    expand_fp4_tile<kRows>((stage_iter + 1) % kNumStages, sm.expanded(stage_iter + 1));
                }
                release_stage(stage_iter, mt);
            }
            return true;
        }
        for (int kb = 0; kb < num_kb; ++kb, ++stage_iter) {
            if (not wait_full(stage_iter)) return false;
            release_stage(stage_iter, mt);
        }
        return true;
    }

    // kTiles 128-column tiles of the stage's B tile (2: kL2OnePass, acc[0, 64) the first tile's)
    template <int kTiles = 1>
    __device__ bool l2_mainloop(uint32_t& stage_iter, const MathThread& mt, float (&acc)[kL2Acc * kTiles]) {
        static_assert(not kFP4 or kExpandAhead, "FP8 x FP4 runs wide tiles at prefill only (decode: transposed_l2_mainloop)");
        static_assert(kTiles == 1 or (kL2OnePass and not kFP4), "two tiles a K-block: 256-wide FP8 / BF16 prefill tasks");
        const int num_kb = lay.intermediate_hidden / BLOCK_K;
        const uint32_t a_offset = mt.row0() * 128, b_offset = kSplitN ? mt.wg * 64 * 128 : 0;
        if constexpr (kTiles == 2 and kFP8) {
            // as l1_mainloop's gate and up: one tile's wgmmas, wait, promote, the next's (two sets of
            // 64 partial sums would not fit next to acc)
            #pragma unroll
            for (int i = 0; i < 2 * kL2Acc; ++i) acc[i] = 0.0f;
            for (int kb = 0; kb < num_kb; ++kb, ++stage_iter) {
                if (not wait_full(stage_iter)) return false;
                const int s = stage_iter % kNumStages;
                const float sa0 = sm.token_sf(s, mt.row_in_tile(0)), sa1 = sm.token_sf(s, mt.row_in_tile(1));
                const uint64_t da = mma::make_k_major_sw128_desc(sm.stage_a(s) + a_offset);
                float part[kL2Acc];
                #pragma unroll
                for (int t = 0; t < 2; ++t) {
                    const uint64_t db = mma::make_k_major_sw128_desc(sm.mma_b(s, stage_iter) + t * kBBytesL2);
                    mma::fence_operands(part);
                    mma::warpgroup_arrive();
                    FP8L2Mma::fma_k_block(da, db, part, false);
                    mma::warpgroup_commit();
                    const float sb = sm.weight_sf(s, t);
                    mma::warpgroup_wait<0>();
                    mma::fence_operands(part);
                    if (t == 1) release_stage(stage_iter, mt);
                    const float s0 = sa0 * sb, s1 = sa1 * sb;
                    #pragma unroll
                    for (int i = 0; i < kL2Acc; ++i) acc[t * kL2Acc + i] += part[i] * ((i & 2) ? s1 : s0);
                }
            }
        } else if constexpr (kTiles == 2) {
            // BF16: one N = 256 wgmma over both tiles (accumulators 0..63: the first tile's columns).
            // Zeroed first: the first wgmma's (unscaled) input is then not the previous task's
            // values, which would keep a second 128-register array live across the task loop
            #pragma unroll
            for (int i = 0; i < 2 * kL2Acc; ++i) acc[i] = 0.0f;
            for (int kb = 0; kb < num_kb; ++kb, ++stage_iter) {
                if (not wait_full(stage_iter)) return false;
                const int s = stage_iter % kNumStages;
                const uint64_t da = mma::make_k_major_sw128_desc(sm.stage_a(s) + a_offset);
                const uint64_t db = mma::make_k_major_sw128_desc(sm.mma_b(s, stage_iter));
                mma::fence_operands(acc);
                mma::warpgroup_arrive();
                mma::BF16MmaN256::fma_k_block(da, db, acc, kb > 0);
                mma::warpgroup_commit();
                mma::warpgroup_wait<0>();
                mma::fence_operands(acc);
                release_stage(stage_iter, mt);
            }
        } else if constexpr (kFP8) {
            float part[kL2Acc];
            #pragma unroll
            for (int i = 0; i < kL2Acc; ++i) acc[i] = 0.0f;
            if constexpr (kExpandAhead) {   // as in l1_mainloop: each next tile while the wgmma runs
                if (not wait_full(stage_iter)) return false;
                expand_fp4_tile<kMegaMoEBlockNL2>(stage_iter % kNumStages, sm.expanded(stage_iter));
            }
            for (int kb = 0; kb < num_kb; ++kb, ++stage_iter) {
                if constexpr (not kExpandAhead) {
                    if (not wait_full(stage_iter)) return false;
                }
                const int s = stage_iter % kNumStages;
                const float sb = sm.weight_sf(s, 0);
                const float s0 = sm.token_sf(s, mt.row_in_tile(0)) * sb, s1 = sm.token_sf(s, mt.row_in_tile(1)) * sb;
                const uint64_t da = mma::make_k_major_sw128_desc(sm.stage_a(s) + a_offset);
                const uint64_t db = mma::make_k_major_sw128_desc(sm.mma_b(s, stage_iter) + b_offset);
                mma::fence_operands(part);
                mma::warpgroup_arrive();
                FP8L2Mma::fma_k_block(da, db, part, false);
                mma::warpgroup_commit();
                if constexpr (kExpandAhead) {
                    if (kb + 1 < num_kb) {
                        if (not wait_full(stage_iter + 1)) {
                            mma::warpgroup_wait<0>();
                            return false;
                        }
                        expand_fp4_tile<kMegaMoEBlockNL2>((stage_iter + 1) % kNumStages, sm.expanded(stage_iter + 1));
                    }
                }
                mma::warpgroup_wait<0>();
                mma::fence_operands(part);
                release_stage(stage_iter, mt);
                #pragma unroll
                for (int i = 0; i < kL2Acc; ++i) acc[i] += part[i] * ((i & 2) ? s1 : s0);
            }
        } else {
            for (int kb = 0; kb < num_kb; ++kb, ++stage_iter) {
                if (not wait_full(stage_iter)) return false;
                const int s = stage_iter % kNumStages;
                const uint64_t da = mma::make_k_major_sw128_desc(sm.stage_a(s) + a_offset);
                const uint64_t db = mma::make_k_major_sw128_desc(sm.mma_b(s, stage_iter) + b_offset);
                mma::fence_operands(acc);
                mma::warpgroup_arrive();
                BF16L2Mma::fma_k_block(da, db, acc, kb > 0);
                mma::warpgroup_commit();
                mma::warpgroup_wait<0>();
                mma::fence_operands(acc);
                release_stage(stage_iter, mt);
            }
        }
        return true;
    }

    // L1 epilogue: SwiGLU (+clamp) x top-k weight, FP8 per-128 quantization (or BF16), into the L2 pool.
    // Each warpgroup writes and copies out its own part of the tile (rows or, split, columns); split,
    // a row's 128 columns span both warpgroups, so the FP8 amax is exchanged (in the tile's row pad).
    __device__ void l1_epilogue(int m, int j, int num_rows, const MathThread& mt, float (&acc)[kL1Acc], const float (&row_w)[2]) {
        uint8_t* tile = sm.epilogue + mt.row0() * kMegaMoEEpilogueRowBytes;
        const int col_base = kSplitN ? mt.wg * 64 : 0;      // first column of this warpgroup in the 128-wide block
        const float clamp = p.activation_clamp;
        float* gate = acc;
        const float* up = acc + kL1Half;
        float amax[2];
        #pragma unroll
        for (int half = 0; half < 2; ++half) {
            // The activation overwrites the gate accumulator in place
            amax[half] = 0.0f;
            #pragma unroll
            for (int q = 0; q < kL1Cols / 8; ++q) {
                #pragma unroll
                for (int b = 0; b < 2; ++b) {
                    const int i = q * 4 + half * 2 + b;
                    const float gt = fminf(gate[i], clamp);
                    const float u = fminf(fmaxf(up[i], -clamp), clamp);
                    gate[i] = silu<kFastMath>(gt) * u * row_w[half];
                    amax[half] = fmaxf(amax[half], fabsf(gate[i]));
                }
            }
            // the 4 lanes of a quad hold this warpgroup's columns of the row
            amax[half] = fmaxf(amax[half], __shfl_xor_sync(0xffffffff, amax[half], 1));
            amax[half] = fmaxf(amax[half], __shfl_xor_sync(0xffffffff, amax[half], 2));
        }
        if constexpr (kFP8 and kSplitN) {
            // [row][warpgroup] floats in the 16-byte pad after each 256-byte tile row
            static_assert(kMegaMoEEpilogueRowBytes - 256 >= 2 * 4, "two amax floats fit the row pad");
            auto slot = [&](int half, int wg) {
                return reinterpret_cast<float*>(tile + (mt.row_in_tile(half) - mt.row0()) * kMegaMoEEpilogueRowBytes + 256) + wg;
            };
            if (mt.lane % 4 == 0) *slot(0, mt.wg) = amax[0], *slot(1, mt.wg) = amax[1];
            named_barrier(kBarrierMathAll, kNumMathThreads);
            amax[0] = fmaxf(amax[0], *slot(0, mt.wg ^ 1));
            amax[1] = fmaxf(amax[1], *slot(1, mt.wg ^ 1));
            // the slots are rewritten by the next task only after this barrier
            named_barrier(kBarrierMathAll, kNumMathThreads);
        }
        #pragma unroll
        for (int half = 0; half < 2; ++half) {
            const int r = mt.row_in_tile(half);
            uint8_t* row = tile + (r - mt.row0()) * kMegaMoEEpilogueRowBytes;
            const int col0 = col_base + (mt.lane % 4) * 2;
            if constexpr (kFP8) {
                // Correctly rounded divisions: the scale and the quantized bytes then match
                // deep_gemm.utils.per_token_cast_to_fp8 bit for bit on the same float inputs
                const float a = fmaxf(amax[half], 1e-10f);
                const float inv = __fdiv_rn(448.0f, a);
                #pragma unroll
                for (int q = 0; q < kL1Cols / 8; ++q) {
                    const int i = q * 4 + half * 2;
                    const __nv_fp8x2_storage_t pair = __nv_cvt_float2_to_fp8x2(make_float2(gate[i] * inv, gate[i + 1] * inv), __NV_SATFINITE, __NV_E4M3);
                    *reinterpret_cast<__nv_fp8x2_storage_t*>(row + q * 8 + col0) = pair;
                }
                if (mt.lane % 4 == 0 and (not kSplitN or mt.wg == 0))   // split: both hold the same scale
                    mine<float>(lay.l2_sf)[static_cast<int64_t>(j) * lay.num_pool_rows + static_cast<int64_t>(m) * BLOCK_M + r] = __fdiv_rn(a, 448.0f);
            } else {
                #pragma unroll
                for (int q = 0; q < kL1Cols / 8; ++q) {
                    const int i = q * 4 + half * 2;
                    *reinterpret_cast<__nv_bfloat162*>(row + (q * 8 + col0) * 2) = __floats2bfloat162_rn(gate[i], gate[i + 1]);
                }
            }
        }
        named_barrier(kBarrierMathBase + mt.wg, 128);
        // 16-byte row copies into the L2 pool: this warpgroup's columns of [j*128, j*128+128) of I,
        // rows that hold tokens only (a decode M-block is mostly padding)
        constexpr int kRowBytes = kL1Cols * kActBytes, kChunks = kRowBytes / 16;
        const int byte0 = col_base * kActBytes;
        const int rows = max_of(0, min_of(64, num_rows - mt.row0()));
        auto* l2_act = mine<uint8_t>(lay.l2_act);
        for (int c = mt.tid; c < rows * kChunks; c += 128) {
            const int r = c / kChunks, col = byte0 + (c % kChunks) * 16;
            const int64_t g = static_cast<int64_t>(m) * BLOCK_M + mt.row0() + r;
            *reinterpret_cast<int4*>(l2_act + g * lay.intermediate_hidden * kActBytes + j * 128 * kActBytes + col) =
                *reinterpret_cast<const int4*>(tile + r * kMegaMoEEpilogueRowBytes + col);
        }
        // release: L2 TMA loads (async proxy, other CTAs) must see these rows and scales. Each
        // thread fences its writes into the async proxy; after the barrier one release covers
        // every thread's writes (cumulativity: the barrier orders them before it).
        fence_proxy_async_global();
        named_barrier(kBarrierMathBase + mt.wg, 128);
        if (mt.tid == 0) signal_l1_done(m);
    }

    // An L2 epilogue's copy-out: thread `tid` of a warpgroup copies chunk tid % kChunks of rows
    // r0 + i x (128 / kChunks), i < kPasses. Their routing (row_info: source rank, token, top-k slot)
    // is loaded for every pass at once, before the tile is staged, so its round trip overlaps the
    // staging stores and the barrier: loaded inside the copy loop, each pass waited for its own load
    // (L2 latency), up to 8 of them in a row (a 128-row L2 epilogue took 5.8 us: docs/PERF.md,
    // session 36). Rows past `rows` get -1 (never written back, as masked slots).
    template <int kChunks, int kPasses>
    __device__ void load_row_infos(int (&info)[kPasses], int64_t first_row, int tid, int rows) const {
        static_assert(128 % kChunks == 0, "a pass covers whole rows");
        const int* row_info = mine<int>(lay.row_info) + first_row;
        #pragma unroll
        for (int i = 0; i < kPasses; ++i) {
            const int r = tid / kChunks + i * (128 / kChunks);
            info[i] = r < rows ? __ldcg(row_info + r) : -1;
        }
    }
    // Row `info`'s combine slot in its source rank's buffer: byte `byte` of H-column block `col0`
    __device__ uint8_t* combine_slot(int info, int64_t col0, int byte) const {
        const int n_max = lay.num_max_tokens_per_rank, topk = lay.num_topk;
        const int src = info / (n_max * topk), token = (info % (n_max * topk)) / topk, k = info % topk;
        return peer<uint8_t>(src, lay.combine) + ((static_cast<int64_t>(k) * n_max + token) * lay.hidden + col0) * 2 + byte;
    }

    // An L2 tile's copy-out: 16-byte chunks of this warpgroup's columns per row, and the copy passes
    // of its 64 rows over the warpgroup's 128 threads
    static constexpr int kL2Chunks = kL2Cols * 2 / 16;
    static constexpr int kL2CopyPasses = 64 * kL2Chunks / 128;
    // The routing of the warpgroup's rows of M-block m (padding rows: -1, never written back)
    __device__ void load_l2_row_infos(int (&info)[kL2CopyPasses], int m, int num_rows, const MathThread& mt) const {
        const int rows = max_of(0, min_of(64, num_rows - mt.row0()));
        load_row_infos<kL2Chunks>(info, static_cast<int64_t>(m) * BLOCK_M + mt.row0(), mt.tid, rows);
    }

    // L2 epilogue: BF16 rows straight into the source rank's combine slot [k][token][hidden]. Each
    // warpgroup stages and copies out only its own part of the tile (its 64 rows, or split: its 64
    // columns), so the two never share shared-memory bytes here. `j`: the tile's 128-column block
    // of H; kLastTile: the task's last tile (a 256-wide task of a wide M-block has two), which
    // signals the task done.
    template <bool kLastTile = true>
    __device__ void l2_epilogue(int m, int j, int num_rows, const MathThread& mt, float (&acc)[kL2Acc]) {
        int info[kL2CopyPasses];
        load_l2_row_infos(info, m, num_rows, mt);
        l2_epilogue<kLastTile>(j, mt, acc, info);
    }
    // ... with the rows' routing loaded by the caller (a 256-wide kL2OnePass task: one load, two tiles)
    template <bool kLastTile>
    __device__ void l2_epilogue(int j, const MathThread& mt, float (&acc)[kL2Acc], const int (&info)[kL2CopyPasses]) {
        uint8_t* tile = sm.epilogue + mt.row0() * kMegaMoEEpilogueRowBytes;
        const int col_base = kSplitN ? mt.wg * 64 : 0;      // columns of the 128-wide N-block
        #pragma unroll
        for (int half = 0; half < 2; ++half) {
            uint8_t* row = tile + (mt.row_in_tile(half) - mt.row0()) * kMegaMoEEpilogueRowBytes;
            #pragma unroll
            for (int q = 0; q < kL2Cols / 8; ++q) {
                const int i = q * 4 + half * 2;
                *reinterpret_cast<__nv_bfloat162*>(row + (col_base + q * 8 + (mt.lane % 4) * 2) * 2) = __floats2bfloat162_rn(acc[i], acc[i + 1]);
            }
        }
        named_barrier(kBarrierMathBase + mt.wg, 128);
        const int col = col_base * 2 + (mt.tid % kL2Chunks) * 16;
        #pragma unroll
        for (int i = 0; i < kL2CopyPasses; ++i) {
            const int r = mt.tid / kL2Chunks + i * (128 / kL2Chunks);
            if (info[i] >= 0)
                *reinterpret_cast<int4*>(combine_slot(info[i], j * 128, col)) = *reinterpret_cast<const int4*>(tile + r * kMegaMoEEpilogueRowBytes + col);
        }
        end_l2_pass(mt, kLastTile);
    }
    // The end of an L2 task's pass (a tile's epilogue): the last signals the task done; before the
    // others the warpgroup meets, as the next pass rewrites the staging rows this one copied out
    __device__ void end_l2_pass(const MathThread& mt, bool last) {
        if (last) finish_l2_task(mt);
        else named_barrier(kBarrierMathBase + mt.wg, 128);
    }

    // After a warpgroup's combine-row stores of an L2 task. Release (fence_peers: system scope when
    // peers are other GPUs): the source rank's combine reads these rows after our signal. One fence
    // after the barrier covers every thread's stores (cumulativity).
    __device__ void finish_l2_task(const MathThread& mt) {
        named_barrier(kBarrierMathBase + mt.wg, 128);
        if (mt.tid == 0) {
            if constexpr (kDeferTaskSignals) owed_l2 = true;
            else if constexpr (kBatchL2Counts) ++sm.ctrl->l2_owed_count[mt.wg];
            else count_l2_task();
        }
    }
    // `n` L2 tasks of a warpgroup done: every combine row they stored is released (the fence after
    // the tasks' barriers covers every thread's stores: cumulativity)
    __device__ void count_l2_task(uint32_t n = 1) {
        fence_peers();
        const uint32_t target = static_cast<uint32_t>(tasks.num_mblocks * tasks.num_l2_nblocks * kNumMathWGs);
        if (atom_acq_rel_gpu_add(mine<uint32_t>(lay.control) + L::kControlL2TasksDone, n) + n == target)
            signal_combine_ready();
    }
    // kBatchL2Counts: thread 0 of a warpgroup whose next ticket is not an L2 task (or that leaves)
    // counts the L2 tasks it owes, before anything of that ticket can wait for combine_ready
    __device__ void raise_l2_counts(const MathThread& mt, int next_task) {
        if constexpr (kBatchL2Counts) {
            if (mt.tid != 0 or (next_task >= tasks.l1_end() and next_task < tasks.l2_end())) return;
            if (const uint32_t n = sm.ctrl->l2_owed_count[mt.wg]; n > 0) sm.ctrl->l2_owed_count[mt.wg] = 0, count_l2_task(n);
        }
    }
    // release (thread 0 of a warpgroup, after the epilogue's barrier: cumulativity covers every
    // thread's rows and scales): the L2 tasks of M-block m may read its L1 outputs
    __device__ void count_l1_task(int m) { red_release_gpu_add(mine<uint32_t>(lay.mblock_l1_done) + m, 1); }
    __device__ void signal_l1_done(int m) {
        if constexpr (kDeferTaskSignals) owed_l1_m = m;
        else count_l1_task(m);
    }
    // The signals thread 0 owes (kDeferTaskSignals; see owed_l1_m)
    __device__ void raise_signals() {
        if constexpr (kDeferTaskSignals) {
            if (owed_l1_m >= 0) count_l1_task(owed_l1_m), owed_l1_m = -1;
            if (owed_l2) owed_l2 = false, count_l2_task();
        }
    }

    // The signals thread (kSignalsThread: FP8 x FP4 decode kernels built with it): thread 0 of a
    // math warpgroup hands what it owes to dispatch thread 0 instead of raising it, so the release
    // fence (its wait for the epilogue's stores) and the L2 count's returning atomic leave warp 0,
    // which the warpgroup's next wgmma waits for. A post is one word in a ring of
    // kMegaMoESignalPosts per warpgroup: the owed L1 M-block + 1 (bits 0-29), the owed L2 count
    // (bit 30), the warpgroup's last post (bit 31, at the ticket it leaves on). Ordering: the
    // epilogue's stores, the warpgroup's barrier, the post's mbarrier arrival (release, CTA scope),
    // the signals thread's wait (acquire), its release at gpu / system scope: cumulativity carries
    // every thread's stores as when thread 0 raised the signal itself. A kernel variant: measured
    // -1.8 / -3.1 / -3.9 % at v4-flash FP8 x FP4 n = 4 / 8 / 128 and -1.9 % at deepseek-v3 n = 8,
    // but +7 % at one token, where the hop lies on the L1 -> L2 chain (docs/PERF.md, session 22);
    // as a run-time flag its off path cost the other calls 1-4 % (registers moved in the task
    // loop). The heuristic picks it where tasks are many and long.
    uint32_t signal_posts_made = 0;   // thread 0 of a math warpgroup: its posts so far
    static constexpr uint32_t kPostL2 = 1u << 30, kPostLast = 1u << 31;
    __device__ void settle_signals(const MathThread& mt, bool leave) {
        if constexpr (kSignalsThread) {
            if (mt.tid != 0 or (not leave and owed_l1_m < 0 and not owed_l2)) return;
            const uint32_t q = signal_posts_made++;
            const int slot = static_cast<int>(q % kMegaMoESignalPosts);
            // the slot's previous post read (the first round passes at once); false on abort
            if (not bounded_wait(p, sm.ctrl, Phase::kPipeline, p.rank,
                                 [&] { return mbarrier_try_wait(sm.signal_empty(mt.wg, slot), ((q / kMegaMoESignalPosts) & 1) ^ 1); }))
                return;
            st_shared_u32(sm.signal_post(mt.wg, slot), static_cast<uint32_t>(owed_l1_m + 1) | (owed_l2 ? kPostL2 : 0u) | (leave ? kPostLast : 0u));
            mbarrier_arrive(sm.signal_full(mt.wg, slot));
            owed_l1_m = -1, owed_l2 = false;
        } else {
            raise_signals();
        }
    }
    // Dispatch thread 0 once its CTA's pulls are behind it (its ticket at ring index ring_next - 1
    // was past the pulls; ring_done: it was the last): consume the ring for the whole dispatch group
    // (one arrival of kNumDispatchThreads a ticket) and raise the posted signals, until both math
    // warpgroups posted their last. Polls both without blocking on either; leaves on abort.
    __device__ void signals_worker(int ring_next, bool ring_done) {
        const int total = tasks.total();
        const auto* abort_word = mine<uint64_t>(lay.status) + L::kStatusAbort;
        uint32_t taken[kNumMathWGs] = {};
        bool last[kNumMathWGs] = {};
        uint64_t idle_since = 0;
        for (;;) {
            bool progress = false;
            while (not ring_done and mbarrier_test_wait(sm.ring_full + ring_next % kTaskRing, (ring_next / kTaskRing) & 1)) {
                const int t = sm.ring_task[ring_next % kTaskRing];
                mbarrier_arrive_count(sm.ring_empty + ring_next % kTaskRing, kNumDispatchThreads);
                ++ring_next, ring_done = t >= total, progress = true;
            }
            #pragma unroll
            for (int wg = 0; wg < kNumMathWGs; ++wg) {
                const int slot = static_cast<int>(taken[wg] % kMegaMoESignalPosts);
                if (last[wg] or not mbarrier_test_wait(sm.signal_full(wg, slot), (taken[wg] / kMegaMoESignalPosts) & 1)) continue;
                const uint32_t post = ld_shared_u32(sm.signal_post(wg, slot));
                mbarrier_arrive(sm.signal_empty(wg, slot));
                ++taken[wg], progress = true, last[wg] = (post & kPostLast) != 0;
                if (const int m = static_cast<int>(post & (kPostL2 - 1)) - 1; m >= 0) count_l1_task(m);
                if (post & kPostL2) count_l2_task();
            }
            bool all_last = true;
            #pragma unroll
            for (int wg = 0; wg < kNumMathWGs; ++wg) all_last = all_last and last[wg];
            if (all_last) return;
            if (progress) {
                idle_since = 0;
                continue;
            }
            // Idle: a math warpgroup that left on abort posts nothing more; the roles that wait for
            // its work report the error, so leave without a report of our own
            if (*reinterpret_cast<volatile int*>(&sm.ctrl->abort) or ld_volatile(abort_word) != 0) return;
            const uint64_t now = globaltimer_ns();
            if (idle_since == 0) idle_since = now;
            else if (now - idle_since > 2 * p.timeout_ns) return;
            __nanosleep(64);
        }
    }

    // ------------------------------------------------------------------------------------------
    // Narrow decode tiles (BLOCK_M = 64, at most kNarrowRows tokens in the M-block): the weights
    // are the wgmma M side and the tokens its N = 8, so a tile that holds one token stops paying
    // for 64 rows of tensor work and promotion. Warpgroup w takes weight rows [64 w, 64 w + 64) of
    // each 128-row block of the B tile (L1: of gate and of up, so SwiGLU stays in the thread; a
    // 256-wide L2 tile: all of row block w). The tokens are rows 0..7 of the stage's A tile, read as
    // the K-major N side; the producer side is unchanged (but for a 256-wide L2 task, whose narrow
    // tile is one 256-row B tile). Accumulator i of a thread's 4 per 64-row M tile: weight row
    // warp * 16 + lane / 4 + 8 * (i / 2) of the tile's 64, token (lane % 4) * 2 + i % 2.
    static constexpr int kNarrowRows = kMegaMoENarrowRows;
    // The CTA pair runs every M-block as token passes, one after another, each a whole K loop over the
    // task's weights (at least one, as for an empty M-block): passes of kNarrowRows tokens as narrow
    // tiles, or (kernels with wide_n_min 16 / 32) passes of kMegaMoEPairPassRows tokens, each a narrow
    // tile (at most kNarrowRows tokens) or a transposed one of N = 16 / 32 (pair_pass)
    static constexpr bool kPairWide = kCtaPair and (kWideN16 or kWideN32);
    static constexpr int kPairPassRows = kPairWide ? kMegaMoEPairPassRows : kNarrowRows;
    static_assert(kPairPassRows % kNarrowRows == 0 and kPairPassRows <= 32 and BLOCK_M % kPairPassRows == 0);
    __device__ static int pair_token_passes(int rows) { return max_of(1, ceil_div(rows, kPairPassRows)); }
    // Token pass q of an M-block of `rows` tokens: its first token o, its tokens (0 for an empty
    // M-block) and its tile's N (kNarrowRows: a narrow tile; 16 / 32: transposed). The producer
    // (its A box and stage bytes) and the math (its loop) both decide by this.
    struct PairPass {
        int o, rows, n;
    };
    __device__ static PairPass pair_pass(int rows, int q) {
        const int o = q * kPairPassRows, r = min_of(kPairPassRows, rows - o);
        return {o, r, not kPairWide or r <= kNarrowRows ? kNarrowRows : kWideN16 and r <= 16 ? 16 : 32};
    }
    struct NarrowThread {
        int r0, c0;   // weight row of accumulators 0, 1 within the warpgroup's 64; token of accumulators 0, 2
        __device__ explicit NarrowThread(const MathThread& mt) : r0(mt.warp * 16 + mt.lane / 4), c0((mt.lane % 4) * 2) {}
        __device__ int row(int i) const { return r0 + 8 * (i / 2); }
        __device__ int token(int i) const { return c0 + i % 2; }
    };

    // FP8 x FP4 on a narrow tile: the weights are the wgmma A side, which may come from registers,
    // so each thread expands exactly its own A fragments (no E4M3 tile in shared memory, no proxy
    // fence, no barrier across warpgroups). Rows row0 + 16 warp + lane / 4 (+ 8) of the B tile, row0
    // the first row of the warpgroup's 64-row M tile (128 rb + 64 wg in 128-row block rb; a 256-wide
    // L2 tile: 128 wg + 64 t): per row one 16-byte load of chunk lane % 4 (a warp reads 8 consecutive
    // rows, 512 contiguous bytes: no bank conflicts), one 32-bit load of its 4 deltas and 4 table rows;
    // word ks of the chunk expands to frag[ks][h] (K 32 ks + 4 (lane % 4) + [0, 4)) and frag[ks][2 + h]
    // (the same + 16), the layout of mma::WgmmaRS. Same rule as expand_fp4_tile (bit-identical).
    using FP4Fragments = uint32_t[mma::kWgmmaStepsPerKBlock][4];
    struct FP4Rows {             // a thread's two rows of one 64-row M tile: code chunks, table offsets
        uint4 codes[2];
        uint32_t offsets[2];
    };
    __device__ void narrow_fp4_load(int s, int row0, const MathThread& mt, FP4Rows& r, uint32_t table) const {
        const int row = row0 + mt.warp * 16 + mt.lane / 4;
        const uint32_t packed = smem_addr(sm.stage_b(s)) + row * kMegaMoEPackedRowBytes + (mt.lane % 4) * kMegaMoEFP4ChunkBytes;
        const uint32_t deltas = smem_addr(sm.stage_deltas(s)) + row * 4;
        #pragma unroll
        for (int h = 0; h < 2; ++h) {
            r.codes[h] = ld_shared_v4(packed + h * 8 * kMegaMoEPackedRowBytes);
            r.offsets[h] = fp4_table_offsets(ld_shared_u32(deltas + h * 8 * 4), fp4_table_hi(table));
        }
    }
    // One K-block of an M tile: expand its fragments, then (wgmma.fence: their A registers were just
    // written) issue its 4 wgmmas, which run while the caller expands the next M tile (L1: gate's
    // under up's expansion; a 256-wide L2 tile: its first M tile's under the second's). One fence
    // per M tile: a fence every 2 K steps measured slower (docs/PERF.md, session 16).
    // (Mma: the 8-token tile's m64n8k32, or a transposed wide tile's m64n64k32.)
    __device__ static void narrow_fp4_expand(const FP4Rows& r, FP4Fragments& frag, uint32_t table) {
        #pragma unroll
        for (int ks = 0; ks < mma::kWgmmaStepsPerKBlock; ++ks) {
            #pragma unroll
            for (int h = 0; h < 2; ++h) {
                const uint2 e = expand_e2m1x8(word_of(r.codes[h], ks), fp4_magnitudes(r.offsets[h], ks, table));
                frag[ks][h] = e.x;
                frag[ks][2 + h] = e.y;
            }
        }
    }
    template <typename Mma = mma::FP8MmaRegAN8>
    __device__ static void narrow_fp4_k_block(const FP4Rows& r, FP4Fragments& frag, uint64_t dt, float (&d)[Mma::kNumAccum], uint32_t table) {
        narrow_fp4_expand(r, frag, table);
        mma::warpgroup_arrive();
        Mma::fma_k_block(frag, dt, d, false);
    }

    // L1 on a narrow tile: gate and up of this warpgroup's 64 rows. Also returns the top-k weights
    // of this thread's two tokens (ordered after the pull's writes by the stage wait).
    // num_kb: the task's K-blocks (all of H, or a split-K half); o: the tile's first token within the
    // M-block (the CTA pair's token passes, narrow_l1_mainloop_pair; 0 elsewhere)
    __device__ bool narrow_l1_mainloop(int m, int num_kb, uint32_t& stage_iter, const MathThread& mt, float (&gate)[4 * kHalves],
                                       float (&up)[4 * kHalves], float (&tok_w)[2], int o = 0) {
        if constexpr (kCtaPair) return narrow_l1_mainloop_pair(m, num_kb, stage_iter, mt, gate, up, tok_w, o);
        const NarrowThread nt(mt);
        const uint32_t gate_offset = mt.wg * 64 * 128, up_offset = gate_offset + 128 * 128;
        // Read after the loop (ordered after the pull's writes by the first stage wait): two
        // predicated loads inside it cost every K-block, not only the first (FP8 x FP4 decode
        // -1.3 to -1.9 % at v4-flash n = 8 / 128; a model of the loop: +11 %; docs/PERF.md, session 24)
        const float* tok_w_src = narrow_token_weights(m, nt) + o;
        [[maybe_unused]] const uint32_t table = kFP4 ? opaque_u32(smem_addr(sm.fp4_table)) : 0u;   // once per task
        const auto read_token_weights = [&] { tok_w[0] = __ldcg(tok_w_src), tok_w[1] = __ldcg(tok_w_src + 1); };
        #pragma unroll
        for (int i = 0; i < 4; ++i) gate[i] = up[i] = 0.0f;
        for (int kb = 0; kb < num_kb; ++kb, ++stage_iter) {
            if (not wait_full_l1(kb, stage_iter, mt)) return false;
            const int s = stage_iter % kNumStages;
            const uint64_t dt = mma::make_k_major_sw128_desc(sm.stage_a(s));
            const uint64_t dg = mma::make_k_major_sw128_desc(sm.mma_b(s, stage_iter) + gate_offset);
            const uint64_t du = mma::make_k_major_sw128_desc(sm.mma_b(s, stage_iter) + up_offset);
            if constexpr (kFP8) {
                const float sa0 = sm.token_sf(s, o + nt.c0), sa1 = sm.token_sf(s, o + nt.c0 + 1);
                const float sg = sm.weight_sf(s, 0), su = sm.weight_sf(s, 1);
                float part_g[4], part_u[4];
                FP4Fragments ag, au;     // FP8 x FP4: A fragments of gate (row block 0) and up (row block 1)
                mma::fence_operands(part_g), mma::fence_operands(part_u);
                if constexpr (kFP4) {
                    // gate's wgmmas run while up's fragments are expanded
                    FP4Rows rg, ru;
                    narrow_fp4_load(s, mt.wg * 64, mt, rg, table), narrow_fp4_load(s, 128 + mt.wg * 64, mt, ru, table);
                    narrow_fp4_k_block(rg, ag, dt, part_g, table);
                    narrow_fp4_k_block(ru, au, dt, part_u, table);
                } else {
                    mma::warpgroup_arrive();
                    mma::FP8MmaN8::fma_k_block(dg, dt, part_g, false);
                    mma::FP8MmaN8::fma_k_block(du, dt, part_u, false);
                }
                mma::warpgroup_commit();
                mma::warpgroup_wait<0>();
                mma::fence_operands(part_g), mma::fence_operands(part_u);
                if constexpr (kFP4) mma::fence_fragments(ag), mma::fence_fragments(au);
                release_stage(stage_iter, mt); trace_l1_release(kb, mt);
                #pragma unroll
                for (int i = 0; i < 4; ++i) {
                    gate[i] += part_g[i] * ((i & 1) ? sa1 * sg : sa0 * sg);
                    up[i] += part_u[i] * ((i & 1) ? sa1 * su : sa0 * su);
                }
            } else {
                mma::fence_operands(gate), mma::fence_operands(up);
                mma::warpgroup_arrive();
                mma::BF16MmaN8::fma_k_block(dg, dt, gate, kb > 0);
                mma::BF16MmaN8::fma_k_block(du, dt, up, kb > 0);
                mma::warpgroup_commit();
                mma::warpgroup_wait<0>();
                mma::fence_operands(gate), mma::fence_operands(up);
                release_stage(stage_iter, mt); trace_l1_release(kb, mt);
            }
        }
        read_token_weights();
        return true;
    }

    // The CTA pair's narrow L1 loop (FP8 x FP4, one math warpgroup): both warpgroup halves of the
    // tile, gate / up rows 64 h of each row block into accumulators [4 h, 4 h + 4); all four M tiles
    // expanded and issued before one wait. Tokens o + [0, 8) of the M-block.
    __device__ bool narrow_l1_mainloop_pair(int m, int num_kb, uint32_t& stage_iter, const MathThread& mt, float (&gate)[4 * kHalves],
                                            float (&up)[4 * kHalves], float (&tok_w)[2], int o) {
        static_assert(kFP4 and kHalves == 2);
        const NarrowThread nt(mt);
        const float* tok_w_src = narrow_token_weights(m, nt) + o;   // read after the loop, as narrow_l1_mainloop
        const uint32_t table = opaque_u32(smem_addr(sm.fp4_table));   // once per task
        #pragma unroll
        for (int i = 0; i < 4 * kHalves; ++i) gate[i] = up[i] = 0.0f;
        for (int kb = 0; kb < num_kb; ++kb, ++stage_iter) {
            if (not wait_full_l1(kb, stage_iter, mt)) return false;
            const int s = stage_iter % kNumStages;
            const uint64_t dt = mma::make_k_major_sw128_desc(sm.stage_a(s));
            const float sa0 = sm.token_sf(s, o + nt.c0), sa1 = sm.token_sf(s, o + nt.c0 + 1);
            const float sg = sm.weight_sf(s, 0), su = sm.weight_sf(s, 1);
            float part_g[kHalves][4], part_u[kHalves][4];
            FP4Fragments ag[kHalves], au[kHalves];     // A fragments of gate (row block 0) and up (row block 1)
            FP4Rows rg[kHalves], ru[kHalves];
            #pragma unroll
            for (int h = 0; h < kHalves; ++h) mma::fence_operands(part_g[h]), mma::fence_operands(part_u[h]);
            #pragma unroll
            for (int h = 0; h < kHalves; ++h)
                narrow_fp4_load(s, h * 64, mt, rg[h], table), narrow_fp4_load(s, 128 + h * 64, mt, ru[h], table);
            // each M tile's wgmmas run while the next one's fragments are expanded
            #pragma unroll
            for (int h = 0; h < kHalves; ++h) {
                narrow_fp4_k_block(rg[h], ag[h], dt, part_g[h], table);
                narrow_fp4_k_block(ru[h], au[h], dt, part_u[h], table);
            }
            mma::warpgroup_commit();
            mma::warpgroup_wait<0>();
            #pragma unroll
            for (int h = 0; h < kHalves; ++h) {
                mma::fence_operands(part_g[h]), mma::fence_operands(part_u[h]);
                mma::fence_fragments(ag[h]), mma::fence_fragments(au[h]);
            }
            release_stage(stage_iter, mt); trace_l1_release(kb, mt);
            #pragma unroll
            for (int h = 0; h < kHalves; ++h)
                #pragma unroll
                for (int i = 0; i < 4; ++i) {
                    gate[4 * h + i] += part_g[h][i] * ((i & 1) ? sa1 * sg : sa0 * sg);
                    up[4 * h + i] += part_u[h][i] * ((i & 1) ? sa1 * su : sa0 * su);
                }
        }
        tok_w[0] = __ldcg(tok_w_src), tok_w[1] = __ldcg(tok_w_src + 1);
        return true;
    }

    // Split-K L1 (both math warpgroups, after K part `part` of `split` of tile `tile`): write this
    // part's partial sums, count the part in; the last part to finish sums all parts and returns
    // true (it runs the epilogue), the others return false. Nobody waits: a part's partials are out
    // before its count (stores, barrier, one release by thread 0: cumulativity), and the last one's
    // acquire of the count orders its reads after every other part's stores. The sum runs in part
    // order (part 0 + part 1 + ...) whichever CTA is last, so calls stay bitwise repeatable. The
    // last part resets the counter for the next call.
    static_assert(kCtaPair or L::kSplitPartialFloats == kNumMathThreads * 8, "split partials: gate[4] + up[4] per math thread");
    __device__ bool split_l1_exchange(int tile, int part, int split, const MathThread& mt, float (&gate)[4], float (&up)[4]) {
        const int thread = mt.wg * 128 + mt.tid;
        float4* partials = reinterpret_cast<float4*>(mine<float>(lay.split_partials) +
                                                     static_cast<int64_t>(tile) * split * L::kSplitPartialFloats) + thread * 2;
        constexpr int kPartStride = L::kSplitPartialFloats / 4;   // float4s per part
        __stcg(partials + part * kPartStride, make_float4(gate[0], gate[1], gate[2], gate[3]));
        __stcg(partials + part * kPartStride + 1, make_float4(up[0], up[1], up[2], up[3]));
        named_barrier(kBarrierMathAll, kNumMathThreads);
        if (thread == 0) {
            auto* count = mine<uint32_t>(lay.split_count) + tile;
            const bool last = atom_acq_rel_gpu_add(count, 1) == static_cast<uint32_t>(split - 1);
            if (last) *count = 0;
            *reinterpret_cast<volatile int*>(&sm.ctrl->split_last) = last;
        }
        named_barrier(kBarrierMathAll, kNumMathThreads);
        if (not ld_volatile_shared_s32(smem_addr(&sm.ctrl->split_last))) return false;
        float g[4], u[4];
        #pragma unroll
        for (int i = 0; i < 4; ++i) g[i] = gate[i], u[i] = up[i];
        for (int q = 0; q < split; ++q) {
            float4 pg = make_float4(g[0], g[1], g[2], g[3]), pu = make_float4(u[0], u[1], u[2], u[3]);
            if (q != part) pg = __ldcg(partials + q * kPartStride), pu = __ldcg(partials + q * kPartStride + 1);
            if (q == 0) {
                gate[0] = pg.x, gate[1] = pg.y, gate[2] = pg.z, gate[3] = pg.w;
                up[0] = pu.x, up[1] = pu.y, up[2] = pu.z, up[3] = pu.w;
            } else {
                gate[0] += pg.x, gate[1] += pg.y, gate[2] += pg.z, gate[3] += pg.w;
                up[0] += pu.x, up[1] += pu.y, up[2] += pu.z, up[3] += pu.w;
            }
        }
        return true;
    }

    __device__ const float* narrow_token_weights(int m, const NarrowThread& nt) const {
        return mine<float>(lay.row_weight) + static_cast<int64_t>(m) * BLOCK_M + nt.c0;
    }

    // L1 epilogue of a narrow tile: SwiGLU (+clamp) x top-k weight, then per token the FP8 amax
    // over the block's 128 columns (this thread's rows, the warp's by shuffles, the 8 math warps'
    // through shared memory), quantization (the same arithmetic as the wide tile), and the token
    // rows into the L2 pool. Token rows of the staging tile span both warpgroups' columns.
    // o: the tile's first token within the M-block; last: the task's last token pass (it signals)
    __device__ void narrow_l1_epilogue(int m, int j, int num_rows, const MathThread& mt, const float (&gate)[4 * kHalves],
                                       const float (&up)[4 * kHalves], const float (&tok_w)[2], int o = 0, bool last = true) {
        const NarrowThread nt(mt);
        const float clamp = p.activation_clamp;
        uint8_t* tile = sm.epilogue;    // row t: token t's 128 columns of the block
        float act[4 * kHalves], amax[2] = {0.0f, 0.0f};
        #pragma unroll
        for (int i = 0; i < 4 * kHalves; ++i) {
            const float gt = fminf(gate[i], clamp);
            const float u = fminf(fmaxf(up[i], -clamp), clamp);
            act[i] = silu<kFastMath>(gt) * u;   // x the top-k weight below: (silu x u) x w
        }
        const int col = mt.wg * 64;     // this warpgroup's first column of the block (the pair: + 64 h)
        if constexpr (kFP8) {
            // The amax is taken before the top-k weight, a token's one factor: max |act x w| =
            // max |act| x |w| exactly (rounding is monotonic), so the weight's load (after the
            // K-loop) is first needed after the exchange below, not before it
            #pragma unroll
            for (int i = 0; i < 4 * kHalves; ++i) amax[i % 2] = fmaxf(amax[i % 2], fabsf(act[i]));
            // lanes of equal lane % 4 hold the same tokens
            #pragma unroll
            for (int t = 0; t < 2; ++t)
                #pragma unroll
                for (int d = 4; d < 32; d *= 2) amax[t] = fmaxf(amax[t], __shfl_xor_sync(0xffffffff, amax[t], d));
            // [math warp][token] in staging rows kNarrowRows.. (never token rows of a narrow tile)
            static_assert(kNarrowRows * 2 <= BLOCK_M and kNumMathWGs * 4 * kNarrowRows * 4 <= kNarrowRows * kMegaMoEEpilogueRowBytes);
            auto* xchg = reinterpret_cast<float*>(tile + kNarrowRows * kMegaMoEEpilogueRowBytes);
            if (mt.lane < 4) {
                xchg[(mt.wg * 4 + mt.warp) * kNarrowRows + nt.c0] = amax[0];
                xchg[(mt.wg * 4 + mt.warp) * kNarrowRows + nt.c0 + 1] = amax[1];
            }
            named_barrier(kBarrierMathAll, kNumMathThreads);
            #pragma unroll
            for (int w = 0; w < kNumMathWGs * 4; ++w) {
                amax[0] = fmaxf(amax[0], xchg[w * kNarrowRows + nt.c0]);
                amax[1] = fmaxf(amax[1], xchg[w * kNarrowRows + nt.c0 + 1]);
            }
            // Correctly rounded divisions, as the wide tile (bit-identical to per_token_cast_to_fp8)
            float a[2], inv[2];
            #pragma unroll
            for (int t = 0; t < 2; ++t) a[t] = fmaxf(amax[t] * fabsf(tok_w[t]), 1e-10f), inv[t] = __fdiv_rn(448.0f, a[t]);
            #pragma unroll
            for (int h = 0; h < kHalves; ++h)
                #pragma unroll
                for (int i = 0; i < 4; ++i) {
                    const __nv_fp8_storage_t q = __nv_cvt_float_to_fp8((act[4 * h + i] * tok_w[i % 2]) * inv[i % 2], __NV_SATFINITE, __NV_E4M3);
                    tile[nt.token(i) * kMegaMoEEpilogueRowBytes + col + 64 * h + nt.row(i)] = q;
                }
            if (mt.wg == 0 and mt.warp == 0 and mt.lane < 4) {
                #pragma unroll
                for (int t = 0; t < 2; ++t)
                    if (nt.c0 + t < num_rows)
                        mine<float>(lay.l2_sf)[static_cast<int64_t>(j) * lay.num_pool_rows + static_cast<int64_t>(m) * BLOCK_M + o + nt.c0 + t] =
                            __fdiv_rn(a[t], 448.0f);
            }
        } else {
            #pragma unroll
            for (int h = 0; h < kHalves; ++h)
                #pragma unroll
                for (int i = 0; i < 4; ++i)
                    *reinterpret_cast<__nv_bfloat16*>(tile + nt.token(i) * kMegaMoEEpilogueRowBytes + (col + 64 * h + nt.row(i)) * 2) =
                        __float2bfloat16_rn(act[4 * h + i] * tok_w[i % 2]);
        }
        named_barrier(kBarrierMathAll, kNumMathThreads);
        // 16-byte chunks of the token rows into the L2 pool, over all math threads
        constexpr int kChunks = 128 * kActBytes / 16;
        const int thread = mt.wg * 128 + mt.tid;
        auto* l2_act = mine<uint8_t>(lay.l2_act);
        if (thread < num_rows * kChunks) {
            const int t = thread / kChunks, c = (thread % kChunks) * 16;
            const int64_t g = static_cast<int64_t>(m) * BLOCK_M + o + t;
            *reinterpret_cast<int4*>(l2_act + (g * lay.intermediate_hidden + j * 128) * kActBytes + c) =
                *reinterpret_cast<const int4*>(tile + t * kMegaMoEEpilogueRowBytes + c);
        }
        // release, as the wide tile: every thread fences into the async proxy, one release per
        // warpgroup after the barrier (the L2 dependency counts kNumMathWGs per L1 task)
        fence_proxy_async_global();
        named_barrier(kBarrierMathAll, kNumMathThreads);
        if (last and mt.tid == 0) signal_l1_done(m);
    }

    // L2 on a narrow tile of kL2PassN output columns (one pass of the task): warpgroup w runs the kL2Tiles 64-row wgmma M
    // tiles [kL2Tiles w, kL2Tiles w + kL2Tiles) of the B tile (128 wide: its 64 of the 128 columns;
    // 256 wide: both halves of row block w, whose weight scale is stage float w). acc: 4 per tile.
    // The CTA pair (kHalves = 2): the one math warpgroup runs both warpgroups' tiles, accumulators
    // [4 kL2Tiles h, 4 kL2Tiles (h + 1)) those of half h
    // o: the tile's first token within the M-block (the pair's token passes; 0 elsewhere)
    __device__ bool narrow_l2_mainloop(uint32_t& stage_iter, const MathThread& mt, float (&acc)[4 * kL2Tiles * kHalves], int o = 0) {
        const NarrowThread nt(mt);
        const int num_kb = lay.intermediate_hidden / BLOCK_K;
        const uint32_t b_offset = mt.wg * kL2Tiles * 64 * 128;
        [[maybe_unused]] const uint32_t table = kFP4 ? opaque_u32(smem_addr(sm.fp4_table)) : 0u;   // once per task
        #pragma unroll
        for (int i = 0; i < 4 * kL2Tiles * kHalves; ++i) acc[i] = 0.0f;
        if constexpr (kCtaPair) return narrow_l2_mainloop_pair(stage_iter, mt, acc, num_kb, table, o);
        for (int kb = 0; kb < num_kb; ++kb, ++stage_iter) {
            if (not wait_full(stage_iter)) return false;
            const int s = stage_iter % kNumStages;
            const uint64_t dt = mma::make_k_major_sw128_desc(sm.stage_a(s));
            const uint64_t db = mma::make_k_major_sw128_desc(sm.mma_b(s, stage_iter) + b_offset);
            if constexpr (kFP8) {
                const float sb = sm.weight_sf(s, kL2Tiles == 2 ? mt.wg : 0);
                const float s0 = sm.token_sf(s, nt.c0) * sb, s1 = sm.token_sf(s, nt.c0 + 1) * sb;
                float part[4 * kL2Tiles];
                // FP8 x FP4 only: A fragments of M tile t from the B rows the SS descriptor would
                // read, b_offset / 128 + 64 t = (kL2Tiles wg + t) * 64 (256 wide: halves of row block wg)
                FP4Fragments ab;
                [[maybe_unused]] FP4Fragments ab1;   // a 256-wide tile's second M tile
                mma::fence_operands(part);
                if constexpr (kFP4) {
                    // a 256-wide tile: the first M tile's wgmmas run while the second's fragments are expanded
                    FP4Rows r0;
                    [[maybe_unused]] FP4Rows r1;
                    narrow_fp4_load(s, mt.wg * kL2Tiles * 64, mt, r0, table);
                    if constexpr (kL2Tiles == 2) narrow_fp4_load(s, mt.wg * kL2Tiles * 64 + 64, mt, r1, table);
                    narrow_fp4_k_block(r0, ab, dt, *reinterpret_cast<float (*)[4]>(part), table);
                    if constexpr (kL2Tiles == 2) narrow_fp4_k_block(r1, ab1, dt, *reinterpret_cast<float (*)[4]>(part + 4), table);
                } else {
                    mma::warpgroup_arrive();
                    narrow_l2_fma<mma::FP8MmaN8>(db, dt, part, false);
                }
                mma::warpgroup_commit();
                mma::warpgroup_wait<0>();
                mma::fence_operands(part);
                if constexpr (kFP4) {
                    mma::fence_fragments(ab);
                    if constexpr (kL2Tiles == 2) mma::fence_fragments(ab1);
                }
                release_stage(stage_iter, mt);
                #pragma unroll
                for (int i = 0; i < 4 * kL2Tiles; ++i) acc[i] += part[i] * ((i & 1) ? s1 : s0);
            } else {
                mma::fence_operands(acc);
                mma::warpgroup_arrive();
                narrow_l2_fma<mma::BF16MmaN8>(db, dt, acc, kb > 0);
                mma::warpgroup_commit();
                mma::warpgroup_wait<0>();
                mma::fence_operands(acc);
                release_stage(stage_iter, mt);
            }
        }
        return true;
    }
    // The CTA pair's narrow L2 loop (FP8 x FP4): M tiles t of half h at B rows (kL2Tiles h + t) 64,
    // all expanded and issued before one wait
    __device__ bool narrow_l2_mainloop_pair(uint32_t& stage_iter, const MathThread& mt, float (&acc)[4 * kL2Tiles * kHalves], int num_kb,
                                            uint32_t table, int o) {
        const NarrowThread nt(mt);
        for (int kb = 0; kb < num_kb; ++kb, ++stage_iter) {
            if (not wait_full(stage_iter)) return false;
            const int s = stage_iter % kNumStages;
            const uint64_t dt = mma::make_k_major_sw128_desc(sm.stage_a(s));
            // the stage's scales are read before its release (the producer refills it after that)
            float s0[kHalves], s1[kHalves];
            #pragma unroll
            for (int h = 0; h < kHalves; ++h) {
                const float sb = sm.weight_sf(s, kL2Tiles == 2 ? h : 0);
                s0[h] = sm.token_sf(s, o + nt.c0) * sb, s1[h] = sm.token_sf(s, o + nt.c0 + 1) * sb;
            }
            float part[kHalves][4 * kL2Tiles];
            FP4Fragments ab[kHalves][kL2Tiles];
            FP4Rows r[kHalves][kL2Tiles];
            #pragma unroll
            for (int h = 0; h < kHalves; ++h) mma::fence_operands(part[h]);
            #pragma unroll
            for (int h = 0; h < kHalves; ++h)
                #pragma unroll
                for (int t = 0; t < kL2Tiles; ++t) narrow_fp4_load(s, (h * kL2Tiles + t) * 64, mt, r[h][t], table);
            #pragma unroll
            for (int h = 0; h < kHalves; ++h)
                #pragma unroll
                for (int t = 0; t < kL2Tiles; ++t) narrow_fp4_k_block(r[h][t], ab[h][t], dt, *reinterpret_cast<float (*)[4]>(part[h] + 4 * t), table);
            mma::warpgroup_commit();
            mma::warpgroup_wait<0>();
            #pragma unroll
            for (int h = 0; h < kHalves; ++h) {
                mma::fence_operands(part[h]);
                #pragma unroll
                for (int t = 0; t < kL2Tiles; ++t) mma::fence_fragments(ab[h][t]);
            }
            release_stage(stage_iter, mt);
            #pragma unroll
            for (int h = 0; h < kHalves; ++h)
                #pragma unroll
                for (int i = 0; i < 4 * kL2Tiles; ++i) acc[4 * kL2Tiles * h + i] += part[h][i] * ((i & 1) ? s1[h] : s0[h]);
        }
        return true;
    }

    // One K-block of the kL2Tiles wgmma M tiles (64 B rows each, consecutive in the B tile)
    template <typename Mma>
    __device__ static void narrow_l2_fma(uint64_t db, uint64_t dt, float (&d)[4 * kL2Tiles], bool accumulate) {
        if constexpr (kL2Tiles == 1) {
            Mma::fma_k_block(db, dt, d, accumulate);
        } else {
            Mma::fma_k_block(db, dt, *reinterpret_cast<float (*)[4]>(d), accumulate);
            Mma::fma_k_block(mma::advance_desc(db, 64 * 128), dt, *reinterpret_cast<float (*)[4]>(d + 4), accumulate);
        }
    }

    // L2 epilogue of a narrow tile: BF16 token rows into the source ranks' combine slots; each
    // warpgroup stages and copies its own kL2Tiles x 64 columns of every token row (staging rows
    // of kL2PassN BF16 + 16 bytes). `j`: the pass's kL2PassN-column block of H; last_pass: the
    // task's last pass (a 512-wide task has two), which signals the task done.
    __device__ void narrow_l2_epilogue(int m, int j, int num_rows, const MathThread& mt, const float (&acc)[4 * kL2Tiles * kHalves],
                                       bool last_pass = true, int o = 0) {
        const NarrowThread nt(mt);
        constexpr int kRowBytes = kL2PassN * 2 + 16;
        static_assert(kNarrowRows * kRowBytes <= BLOCK_M * kMegaMoEEpilogueRowBytes, "staging rows fit the epilogue tile");
        uint8_t* tile = sm.epilogue;
        const int col = mt.wg * kL2Tiles * 64;
        constexpr int kChunks = kL2Tiles * kHalves * 64 * 2 / 16;   // this warpgroup's columns of a token row
        static_assert(kCtaPair or kNarrowRows * kChunks <= 128, "one 16-byte chunk per thread");
        // the pair: both halves' columns, up to two chunks a thread; else one chunk a thread at most
        constexpr int kPasses = ceil_div(kNarrowRows * kChunks, 128);
        int info[kPasses];
        load_row_infos<kChunks>(info, static_cast<int64_t>(m) * BLOCK_M + o, mt.tid, num_rows);
        #pragma unroll
        for (int t = 0; t < kL2Tiles * kHalves; ++t)
            #pragma unroll
            for (int i = 0; i < 4; ++i)
                *reinterpret_cast<__nv_bfloat16*>(tile + nt.token(i) * kRowBytes + (col + t * 64 + nt.row(i)) * 2) = __float2bfloat16_rn(acc[4 * t + i]);
        named_barrier(kBarrierMathBase + mt.wg, 128);
        const int c = col * 2 + (mt.tid % kChunks) * 16;
        #pragma unroll
        for (int i = 0; i < kPasses; ++i) {
            const int t = mt.tid / kChunks + i * (128 / kChunks);
            if (info[i] >= 0)
                *reinterpret_cast<int4*>(combine_slot(info[i], j * kL2PassN, c)) = *reinterpret_cast<const int4*>(tile + t * kRowBytes + c);
        }
        end_l2_pass(mt, last_pass);
    }

    // ------------------------------------------------------------------------------------------
    // Transposed wide tiles (FP8 x FP4 decode kernels, kTransposedWide): an M-block of more than 8
    // tokens runs the way a narrow tile does, with N = BLOCK_M = 64: the weights are the wgmma M
    // side, expanded into each thread's own A fragments, and the whole 64-row A tile is the K-major
    // N side. So FP8 x FP4 decode keeps no E4M3 tile, no stmatrix, no proxy fence and no barrier
    // across warpgroups in its K-loops (the wide tile's expand-then-wgmma chain: docs/PERF.md,
    // session 17). Padding tokens (pool rows past the M-block's) are columns of their own: they
    // never reach a real token's sums, amax or output row. Accumulator i of a thread's 32 per
    // 64-row M tile (the m64n64 layout): weight row r0 + 8 ((i / 2) % 2) of the tile's 64, token
    // 8 (i / 4) + c0 + i % 2, i.e. this thread's token slot 2 (i / 4) + i % 2 of 16.
    // kN: the tile's N, the M-block's tokens rounded up to 16, 32 or 64 (wide_n), so that the tensor
    // work and the promotion follow the tokens; kN / 2 accumulators per M tile, kN / 4 tokens a thread
    template <int kN>
    using WideMma = std::conditional_t<kN == 16, mma::FP8MmaRegAN16, std::conditional_t<kN == 32, mma::FP8MmaRegAN32, mma::FP8MmaRegAN64>>;
    __device__ static constexpr int wide_slot(int i) { return 2 * (i / 4) + i % 2; }
    __device__ static int wide_row(const NarrowThread& nt, int i) { return nt.r0 + 8 * ((i / 2) % 2); }
    __device__ static int wide_token(const NarrowThread& nt, int k) { return 8 * (k / 2) + nt.c0 + k % 2; }   // slot k's token
    // (o: the tile's first token within the M-block, the CTA pair's token passes; 0 elsewhere)
    template <int kN>
    __device__ void wide_token_sf(int s, const NarrowThread& nt, float (&sa)[(kN / 4)], int o = 0) const {
        #pragma unroll
        for (int g = 0; g < (kN / 4) / 2; ++g) {
            const uint2 v = ld_shared_v2(smem_addr(sm.stage_sf(s)) + (o + 8 * g + nt.c0) * 4);
            sa[2 * g] = __uint_as_float(v.x), sa[2 * g + 1] = __uint_as_float(v.y);
        }
    }

    // One K-block of two M tiles (L1: gate and up; a 256-wide L2 tile: its two) through one set of
    // partial sums: the first M tile's wgmmas run while the second's fragments are expanded, the
    // first's partials are promoted (`promote0`, which also reads the token scales) before the
    // second's wgmmas reuse them. Two sets in flight (32 more registers a thread) put values of the
    // whole math loop, the narrow tiles' too, in local memory. The caller releases the stage.
    // N = 16 / 32 (kN / 2 registers a set) keep two sets in flight: the second M tile's wgmmas are
    // issued before the first's promotion (wait_group 1), which then runs under them. N = 64 passes
    // the same array twice: one set, the second M tile's wgmmas after the first's promotion (kOneSet;
    // also the CTA pair's N = 32 tiles, whose sums of both halves leave no room for two).
    template <int kN, bool kOneSet = kN == 64, typename Promote0>
    __device__ static void wide_fp4_k_block_pair(const FP4Rows& r0, const FP4Rows& r1, uint64_t dt, float (&part0)[(kN / 2)],
                                                 float (&part1)[(kN / 2)], uint32_t table, Promote0&& promote0) {
        FP4Fragments a0, a1;
        mma::fence_operands(part0);
        narrow_fp4_k_block<WideMma<kN>>(r0, a0, dt, part0, table);
        mma::warpgroup_commit();
        if constexpr (kOneSet) {
            narrow_fp4_expand(r1, a1, table);
            mma::warpgroup_wait<0>();
            mma::fence_operands(part0);
            mma::fence_fragments(a0);
            promote0();
            mma::warpgroup_arrive();
            WideMma<kN>::fma_k_block(a1, dt, part1, false);
            mma::warpgroup_commit();
        } else {
            mma::fence_operands(part1);
            narrow_fp4_k_block<WideMma<kN>>(r1, a1, dt, part1, table);
            mma::warpgroup_commit();
            mma::warpgroup_wait<1>();
            mma::fence_operands(part0);
            mma::fence_fragments(a0);
            promote0();
        }
        mma::warpgroup_wait<0>();
        mma::fence_operands(part1);
        mma::fence_fragments(a1);
    }

    // L1: gate and up of this warpgroup's 64 rows (as narrow_l1_mainloop), all of H's K-blocks
    template <int kN>
    __device__ bool transposed_l1_mainloop(uint32_t& stage_iter, const MathThread& mt, float (&gate)[(kN / 2)], float (&up)[(kN / 2)]) {
        const NarrowThread nt(mt);
        const int num_kb = lay.hidden / BLOCK_K;
        const uint32_t table = opaque_u32(smem_addr(sm.fp4_table));   // once per task
        #pragma unroll
        for (int i = 0; i < (kN / 2); ++i) gate[i] = up[i] = 0.0f;
        for (int kb = 0; kb < num_kb; ++kb, ++stage_iter) {
            if (not wait_full_l1(kb, stage_iter, mt)) return false;
            const int s = stage_iter % kNumStages;
            const uint64_t dt = mma::make_k_major_sw128_desc(sm.stage_a(s));
            const float sg = sm.weight_sf(s, 0), su = sm.weight_sf(s, 1);
            float sa[(kN / 4)], part[(kN / 2)], part_u_own[(kN / 2)];
            float (&part_u)[(kN / 2)] = kN == 64 ? part : part_u_own;   // one set at N = 64
            FP4Rows rg, ru;
            narrow_fp4_load(s, mt.wg * 64, mt, rg, table), narrow_fp4_load(s, 128 + mt.wg * 64, mt, ru, table);
            wide_fp4_k_block_pair<kN>(rg, ru, dt, part, part_u, table, [&] {
                wide_token_sf<kN>(s, nt, sa);
                #pragma unroll
                for (int i = 0; i < (kN / 2); ++i) gate[i] += part[i] * (sa[wide_slot(i)] * sg);
            });
            release_stage(stage_iter, mt); trace_l1_release(kb, mt);
            #pragma unroll
            for (int i = 0; i < (kN / 2); ++i) up[i] += part_u[i] * (sa[wide_slot(i)] * su);
        }
        return true;
    }

    // L1 epilogue (as narrow_l1_epilogue, for 64 tokens): the top-k weights read first (their
    // latency under the SwiGLUs and the amax exchange, which does without them; held across the
    // K-loop they cost it local memory), each token's amax over the block's 128 columns exchanged as [token][math warp]
    // in bytes 128.. of the token's staging row (its FP8 values take bytes 0..127)
    template <int kN>
    __device__ void transposed_l1_epilogue(int m, int j, int num_rows, const MathThread& mt, const float (&gate)[(kN / 2)],
                                           const float (&up)[(kN / 2)]) {
        const NarrowThread nt(mt);
        const float clamp = p.activation_clamp;
        uint8_t* tile = sm.epilogue;    // row t: token t's 128 columns of the block
        float tok_w[(kN / 4)], act[(kN / 2)], amax[(kN / 4)];
        const float* src = narrow_token_weights(m, nt);
        #pragma unroll
        for (int k = 0; k < (kN / 4); ++k) tok_w[k] = __ldcg(src + wide_token(nt, k) - nt.c0), amax[k] = 0.0f;
        #pragma unroll
        for (int i = 0; i < (kN / 2); ++i) {
            const float gt = fminf(gate[i], clamp);
            const float u = fminf(fmaxf(up[i], -clamp), clamp);
            act[i] = silu<kFastMath>(gt) * u;   // then x w: (silu x u) x w, the narrow tile's order
        }
        // The amax before the top-k weight (max |act x w| = max |act| x |w| exactly, as the narrow
        // tile): the weights' loads are first needed after the exchange, not under 8-32 SwiGLUs
        #pragma unroll
        for (int i = 0; i < (kN / 2); ++i) amax[wide_slot(i)] = fmaxf(amax[wide_slot(i)], fabsf(act[i]));
        // lanes of equal lane % 4 hold the same tokens
        #pragma unroll
        for (int k = 0; k < (kN / 4); ++k)
            #pragma unroll
            for (int d = 4; d < 32; d *= 2) amax[k] = fmaxf(amax[k], __shfl_xor_sync(0xffffffff, amax[k], d));
        constexpr int kXchg = 128;
        static_assert((kCtaPair or kNumMathWGs * 4 == 8) and kXchg + 8 * 4 <= kMegaMoEEpilogueRowBytes and kMegaMoEEpilogueRowBytes % 16 == 0 and
                      BLOCK_M * kMegaMoEEpilogueRowBytes <= mega_moe_epilogue_smem_bytes(kMmaType, BLOCK_M),
                      "a token's 8 warp maxima: two 16-byte loads inside its staging row, 64 rows in the epilogue tile");
        const uint32_t xchg = smem_addr(tile) + kXchg;
        if (mt.lane < 4) {
            #pragma unroll
            for (int k = 0; k < (kN / 4); ++k) st_shared_f32(xchg + wide_token(nt, k) * kMegaMoEEpilogueRowBytes + (mt.wg * 4 + mt.warp) * 4, amax[k]);
        }
        named_barrier(kBarrierMathAll, kNumMathThreads);
        #pragma unroll
        for (int k = 0; k < (kN / 4); ++k) {
            const uint4 a = ld_shared_v4(xchg + wide_token(nt, k) * kMegaMoEEpilogueRowBytes);
            const uint4 b = ld_shared_v4(xchg + wide_token(nt, k) * kMegaMoEEpilogueRowBytes + 16);
            amax[k] = fmaxf(fmaxf(fmaxf(__uint_as_float(a.x), __uint_as_float(a.y)), fmaxf(__uint_as_float(a.z), __uint_as_float(a.w))),
                            fmaxf(fmaxf(__uint_as_float(b.x), __uint_as_float(b.y)), fmaxf(__uint_as_float(b.z), __uint_as_float(b.w))));
        }
        // Correctly rounded divisions, as the wide tile (bit-identical to per_token_cast_to_fp8)
        float a[(kN / 4)], inv[(kN / 4)];
        #pragma unroll
        for (int k = 0; k < (kN / 4); ++k) a[k] = fmaxf(amax[k] * fabsf(tok_w[k]), 1e-10f), inv[k] = __fdiv_rn(448.0f, a[k]);
        const int col = mt.wg * 64;     // this warpgroup's first column of the block
        #pragma unroll
        for (int i = 0; i < (kN / 2); ++i) {
            const __nv_fp8_storage_t q = __nv_cvt_float_to_fp8((act[i] * tok_w[wide_slot(i)]) * inv[wide_slot(i)], __NV_SATFINITE, __NV_E4M3);
            tile[(8 * (i / 4) + nt.c0 + i % 2) * kMegaMoEEpilogueRowBytes + col + wide_row(nt, i)] = q;
        }
        if (mt.wg == 0 and mt.warp == 0 and mt.lane < 4) {
            #pragma unroll
            for (int k = 0; k < (kN / 4); ++k)
                if (wide_token(nt, k) < num_rows)
                    mine<float>(lay.l2_sf)[static_cast<int64_t>(j) * lay.num_pool_rows + static_cast<int64_t>(m) * BLOCK_M + wide_token(nt, k)] =
                        __fdiv_rn(a[k], 448.0f);
        }
        named_barrier(kBarrierMathAll, kNumMathThreads);
        // 16-byte chunks of the token rows into the L2 pool, over all math threads
        constexpr int kChunks = 128 / 16;
        auto* l2_act = mine<uint8_t>(lay.l2_act);
        for (int c = mt.wg * 128 + mt.tid; c < num_rows * kChunks; c += kNumMathThreads) {
            const int t = c / kChunks, off = (c % kChunks) * 16;
            const int64_t g = static_cast<int64_t>(m) * BLOCK_M + t;
            *reinterpret_cast<int4*>(l2_act + g * lay.intermediate_hidden + j * 128 + off) =
                *reinterpret_cast<const int4*>(tile + t * kMegaMoEEpilogueRowBytes + off);
        }
        // release, as the narrow tile
        fence_proxy_async_global();
        named_barrier(kBarrierMathAll, kNumMathThreads);
        if (mt.tid == 0) signal_l1_done(m);
    }

    // L2 (as narrow_l2_mainloop): warpgroup w's kL2Tiles 64-row M tiles of the B tile
    template <int kN>
    __device__ bool transposed_l2_mainloop(uint32_t& stage_iter, const MathThread& mt, float (&acc)[(kN / 2) * kL2Tiles]) {
        const NarrowThread nt(mt);
        const int num_kb = lay.intermediate_hidden / BLOCK_K;
        const uint32_t table = opaque_u32(smem_addr(sm.fp4_table));   // once per task
        #pragma unroll
        for (int i = 0; i < (kN / 2) * kL2Tiles; ++i) acc[i] = 0.0f;
        for (int kb = 0; kb < num_kb; ++kb, ++stage_iter) {
            if (not wait_full(stage_iter)) return false;
            const int s = stage_iter % kNumStages;
            const uint64_t dt = mma::make_k_major_sw128_desc(sm.stage_a(s));
            const float sb = sm.weight_sf(s, kL2Tiles == 2 ? mt.wg : 0);
            float sa[(kN / 4)], part[(kN / 2)];
            FP4Rows r0, r1;
            narrow_fp4_load(s, mt.wg * kL2Tiles * 64, mt, r0, table);
            if constexpr (kL2Tiles == 2) {
                narrow_fp4_load(s, mt.wg * kL2Tiles * 64 + 64, mt, r1, table);
                float part1_own[(kN / 2)];
                float (&part1)[(kN / 2)] = kN == 64 ? part : part1_own;   // one set at N = 64
                wide_fp4_k_block_pair<kN>(r0, r1, dt, part, part1, table, [&] {
                    wide_token_sf<kN>(s, nt, sa);
                    #pragma unroll
                    for (int i = 0; i < (kN / 2); ++i) acc[i] += part[i] * (sa[wide_slot(i)] * sb);
                });
                release_stage(stage_iter, mt);
                #pragma unroll
                for (int i = 0; i < (kN / 2); ++i) acc[(kN / 2) + i] += part1[i] * (sa[wide_slot(i)] * sb);
            } else {
                FP4Fragments a0;
                mma::fence_operands(part);
                narrow_fp4_k_block<WideMma<kN>>(r0, a0, dt, part, table);
                mma::warpgroup_commit();
                mma::warpgroup_wait<0>();
                mma::fence_operands(part);
                mma::fence_fragments(a0);
                wide_token_sf<kN>(s, nt, sa);
                release_stage(stage_iter, mt);
                #pragma unroll
                for (int i = 0; i < (kN / 2); ++i) acc[i] += part[i] * (sa[wide_slot(i)] * sb);
            }
        }
        return true;
    }

    // L2 epilogue (as narrow_l2_epilogue, for 64 token rows): staged in the expanded tile, which no
    // loop of these kernels reads, and the epilogue tile after it (64 rows of 256 columns: 33 KB)
    template <int kN>
    __device__ void transposed_l2_epilogue(int m, int j, int num_rows, const MathThread& mt, const float (&acc)[(kN / 2) * kL2Tiles], bool last_pass = true) {
        const NarrowThread nt(mt);
        constexpr int kRowBytes = kL2PassN * 2 + 16;
        static_assert(not kEpilogueInExpanded and
                      BLOCK_M * kRowBytes <= mega_moe_expanded_b_bytes(kMmaType, BLOCK_M) + mega_moe_epilogue_smem_bytes(kMmaType, BLOCK_M),
                      "64 staging rows fit the expanded tile and the epilogue tile after it");
        uint8_t* tile = sm.expanded_b;
        const int col = mt.wg * kL2Tiles * 64;
        constexpr int kChunks = kL2Tiles * 64 * 2 / 16;
        constexpr int kPasses = ceil_div(kN * kChunks, 128);   // at most kN rows
        int info[kPasses];
        load_row_infos<kChunks>(info, static_cast<int64_t>(m) * BLOCK_M, mt.tid, num_rows);
        #pragma unroll
        for (int t = 0; t < kL2Tiles; ++t)
            #pragma unroll
            for (int i = 0; i < (kN / 2); ++i)
                *reinterpret_cast<__nv_bfloat16*>(tile + (8 * (i / 4) + nt.c0 + i % 2) * kRowBytes + (col + t * 64 + wide_row(nt, i)) * 2) =
                    __float2bfloat16_rn(acc[(kN / 2) * t + i]);
        named_barrier(kBarrierMathBase + mt.wg, 128);
        const int off = col * 2 + (mt.tid % kChunks) * 16;
        #pragma unroll
        for (int i = 0; i < kPasses; ++i) {
            const int t = mt.tid / kChunks + i * (128 / kChunks);
            if (info[i] >= 0)
                *reinterpret_cast<int4*>(combine_slot(info[i], j * kL2PassN, off)) = *reinterpret_cast<const int4*>(tile + t * kRowBytes + off);
        }
        end_l2_pass(mt, last_pass);
    }

    // ------------------------------------------------------------------------------------------
    // The CTA pair's transposed tiles (kernels with wide_n_min 16 / 32, kPairWide): a token pass of
    // more than kNarrowRows tokens (pair_pass) runs as the two-warpgroup kernel's transposed tile of
    // N = 16 / 32 does, with the one math warpgroup taking both warpgroups' halves of the weight rows
    // (kHalves = 2): [h] holds the accumulators of what warpgroup h runs there. Tokens o + [0, kN)
    // of the M-block are the tile's N (their A box, issue_a; their scales at o in the stage).
    // N = 64 is not built: both halves' accumulators and the partial sums in flight would not fit
    // the pair's 200 registers.

    // L1: per half h gate rows 64 h and up rows 128 + 64 h of the B tile (as transposed_l1_mainloop,
    // gate's wgmmas under up's expansion); the stage is released after the second half's wgmmas
    template <int kN>
    __device__ bool transposed_l1_mainloop_pair(int o, uint32_t& stage_iter, const MathThread& mt, float (&gate)[kHalves][kN / 2],
                                                float (&up)[kHalves][kN / 2]) {
        static_assert(kPairWide and kHalves == 2 and (kN == 16 or kN == 32), "the CTA pair's transposed tiles: N = 16 / 32");
        const NarrowThread nt(mt);
        const int num_kb = lay.hidden / BLOCK_K;
        const uint32_t table = opaque_u32(smem_addr(sm.fp4_table));   // once per task
        #pragma unroll
        for (int h = 0; h < kHalves; ++h)
            #pragma unroll
            for (int i = 0; i < kN / 2; ++i) gate[h][i] = up[h][i] = 0.0f;
        for (int kb = 0; kb < num_kb; ++kb, ++stage_iter) {
            if (not wait_full_l1(kb, stage_iter, mt)) return false;
            const int s = stage_iter % kNumStages;
            const uint64_t dt = mma::make_k_major_sw128_desc(sm.stage_a(s));
            const float sg = sm.weight_sf(s, 0), su = sm.weight_sf(s, 1);
            float sa[kN / 4];
            #pragma unroll
            for (int h = 0; h < kHalves; ++h) {
                // N = 32: one set of partial sums (two put the loop's values in local memory: SASS)
                constexpr bool kOneSet = kN == 32;
                float part[kN / 2], part_u_own[kN / 2];
                float (&part_u)[kN / 2] = kOneSet ? part : part_u_own;
                FP4Rows rg, ru;
                narrow_fp4_load(s, h * 64, mt, rg, table), narrow_fp4_load(s, 128 + h * 64, mt, ru, table);
                wide_fp4_k_block_pair<kN, kOneSet>(rg, ru, dt, part, part_u, table, [&] {
                    if (h == 0) wide_token_sf<kN>(s, nt, sa, o);   // read before the release below
                    #pragma unroll
                    for (int i = 0; i < kN / 2; ++i) gate[h][i] += part[i] * (sa[wide_slot(i)] * sg);
                });
                if (h == kHalves - 1) release_stage(stage_iter, mt), trace_l1_release(kb, mt);
                #pragma unroll
                for (int i = 0; i < kN / 2; ++i) up[h][i] += part_u[i] * (sa[wide_slot(i)] * su);
            }
        }
        return true;
    }

    // L1 epilogue (as transposed_l1_epilogue): each token's amax over both halves' rows in the
    // thread, then over the warpgroup's 4 warps through bytes 128.. of the token's staging row; the
    // pass's token rows into the L2 pool at o. last: the task's last token pass (it signals).
    template <int kN>
    __device__ void transposed_l1_epilogue_pair(int m, int j, int num_rows, int o, bool last, const MathThread& mt,
                                                const float (&gate)[kHalves][kN / 2], const float (&up)[kHalves][kN / 2]) {
        const NarrowThread nt(mt);
        const float clamp = p.activation_clamp;
        uint8_t* tile = sm.epilogue;    // row t: token o + t's 128 columns of the block
        float tok_w[kN / 4], act[kHalves][kN / 2], amax[kN / 4];
        const float* src = narrow_token_weights(m, nt) + o;
        #pragma unroll
        for (int k = 0; k < kN / 4; ++k) tok_w[k] = __ldcg(src + wide_token(nt, k) - nt.c0), amax[k] = 0.0f;
        #pragma unroll
        for (int h = 0; h < kHalves; ++h)
            #pragma unroll
            for (int i = 0; i < kN / 2; ++i) {
                const float gt = fminf(gate[h][i], clamp);
                const float u = fminf(fmaxf(up[h][i], -clamp), clamp);
                act[h][i] = silu<kFastMath>(gt) * u;   // then x w, as the other tiles
                amax[wide_slot(i)] = fmaxf(amax[wide_slot(i)], fabsf(act[h][i]));   // before the weight, as they do
            }
        // lanes of equal lane % 4 hold the same tokens
        #pragma unroll
        for (int k = 0; k < kN / 4; ++k)
            #pragma unroll
            for (int d = 4; d < 32; d *= 2) amax[k] = fmaxf(amax[k], __shfl_xor_sync(0xffffffff, amax[k], d));
        constexpr int kXchg = 128;
        static_assert(kXchg + 4 * 4 <= kMegaMoEEpilogueRowBytes and kMegaMoEEpilogueRowBytes % 16 == 0 and
                      kN * kMegaMoEEpilogueRowBytes <= mega_moe_epilogue_smem_bytes(kMmaType, BLOCK_M),
                      "a token's 4 warp maxima: one 16-byte load inside its staging row");
        const uint32_t xchg = smem_addr(tile) + kXchg;
        if (mt.lane < 4) {
            #pragma unroll
            for (int k = 0; k < kN / 4; ++k) st_shared_f32(xchg + wide_token(nt, k) * kMegaMoEEpilogueRowBytes + mt.warp * 4, amax[k]);
        }
        named_barrier(kBarrierMathAll, kNumMathThreads);
        #pragma unroll
        for (int k = 0; k < kN / 4; ++k) {
            const uint4 a = ld_shared_v4(xchg + wide_token(nt, k) * kMegaMoEEpilogueRowBytes);
            amax[k] = fmaxf(fmaxf(__uint_as_float(a.x), __uint_as_float(a.y)), fmaxf(__uint_as_float(a.z), __uint_as_float(a.w)));
        }
        // Correctly rounded divisions, as the other tiles (bit-identical to per_token_cast_to_fp8)
        float a[kN / 4], inv[kN / 4];
        #pragma unroll
        for (int k = 0; k < kN / 4; ++k) a[k] = fmaxf(amax[k] * fabsf(tok_w[k]), 1e-10f), inv[k] = __fdiv_rn(448.0f, a[k]);
        #pragma unroll
        for (int h = 0; h < kHalves; ++h)
            #pragma unroll
            for (int i = 0; i < kN / 2; ++i) {
                const __nv_fp8_storage_t q = __nv_cvt_float_to_fp8((act[h][i] * tok_w[wide_slot(i)]) * inv[wide_slot(i)], __NV_SATFINITE, __NV_E4M3);
                tile[(8 * (i / 4) + nt.c0 + i % 2) * kMegaMoEEpilogueRowBytes + 64 * h + wide_row(nt, i)] = q;
            }
        if (mt.warp == 0 and mt.lane < 4) {
            #pragma unroll
            for (int k = 0; k < kN / 4; ++k)
                if (wide_token(nt, k) < num_rows)
                    mine<float>(lay.l2_sf)[static_cast<int64_t>(j) * lay.num_pool_rows + static_cast<int64_t>(m) * BLOCK_M + o + wide_token(nt, k)] =
                        __fdiv_rn(a[k], 448.0f);
        }
        named_barrier(kBarrierMathAll, kNumMathThreads);
        // 16-byte chunks of the token rows into the L2 pool
        constexpr int kChunks = 128 / 16;
        auto* l2_act = mine<uint8_t>(lay.l2_act);
        for (int c = mt.tid; c < num_rows * kChunks; c += kNumMathThreads) {
            const int t = c / kChunks, off = (c % kChunks) * 16;
            const int64_t g = static_cast<int64_t>(m) * BLOCK_M + o + t;
            *reinterpret_cast<int4*>(l2_act + g * lay.intermediate_hidden + j * 128 + off) =
                *reinterpret_cast<const int4*>(tile + t * kMegaMoEEpilogueRowBytes + off);
        }
        // release, as the other tiles; only the last pass counts the task in
        fence_proxy_async_global();
        named_barrier(kBarrierMathAll, kNumMathThreads);
        if (last and mt.tid == 0) signal_l1_done(m);
    }

    // L2 (as transposed_l2_mainloop): the pass's M tiles T = 0 .. 2 kL2Tiles - 1 at B rows 64 T (tile
    // T is what warpgroup T / kL2Tiles runs there), two at a time through wide_fp4_k_block_pair:
    // tiles 2 u and 2 u + 1 lie in one 128-row block (a 256-wide pass: row block u, weight scale u;
    // a 128-wide pass: its one block), so they share a weight scale
    template <int kN>
    __device__ bool transposed_l2_mainloop_pair(int o, uint32_t& stage_iter, const MathThread& mt, float (&acc)[kHalves * kL2Tiles][kN / 2]) {
        static_assert(kPairWide and kHalves == 2 and (kN == 16 or kN == 32), "the CTA pair's transposed tiles: N = 16 / 32");
        constexpr int kTiles = kHalves * kL2Tiles;
        const NarrowThread nt(mt);
        const int num_kb = lay.intermediate_hidden / BLOCK_K;
        const uint32_t table = opaque_u32(smem_addr(sm.fp4_table));   // once per task
        #pragma unroll
        for (int t = 0; t < kTiles; ++t)
            #pragma unroll
            for (int i = 0; i < kN / 2; ++i) acc[t][i] = 0.0f;
        for (const uint32_t end = stage_iter + num_kb; stage_iter != end; ++stage_iter) {   // no K-block index: one register less
            if (not wait_full(stage_iter)) return false;
            const int s = stage_iter % kNumStages;
            const uint64_t dt = mma::make_k_major_sw128_desc(sm.stage_a(s));
            float sb[kTiles / 2], sa[kN / 4];   // read before the release below
            #pragma unroll
            for (int u = 0; u < kTiles / 2; ++u) sb[u] = sm.weight_sf(s, kL2Tiles == 2 ? u : 0);
            #pragma unroll
            for (int u = 0; u < kTiles / 2; ++u) {
                // N = 32: one set of partial sums (two put the loop's values in local memory: SASS)
                constexpr bool kOneSet = kN == 32;
                float part0[kN / 2], part1_own[kN / 2];
                float (&part1)[kN / 2] = kOneSet ? part0 : part1_own;
                FP4Rows r0, r1;
                narrow_fp4_load(s, 2 * u * 64, mt, r0, table), narrow_fp4_load(s, (2 * u + 1) * 64, mt, r1, table);
                wide_fp4_k_block_pair<kN, kOneSet>(r0, r1, dt, part0, part1, table, [&] {
                    if (u == 0) wide_token_sf<kN>(s, nt, sa, o);
                    #pragma unroll
                    for (int i = 0; i < kN / 2; ++i) acc[2 * u][i] += part0[i] * (sa[wide_slot(i)] * sb[u]);
                });
                if (u == kTiles / 2 - 1) release_stage(stage_iter, mt);
                #pragma unroll
                for (int i = 0; i < kN / 2; ++i) acc[2 * u + 1][i] += part1[i] * (sa[wide_slot(i)] * sb[u]);
            }
        }
        return true;
    }

    // L2 epilogue (as transposed_l2_epilogue): the pass's kN token rows of kL2PassN columns staged in
    // the expanded tile, then the valid ones into the source ranks' combine slots (token o + t)
    template <int kN>
    __device__ void transposed_l2_epilogue_pair(int m, int j, int num_rows, int o, bool last_pass, const MathThread& mt,
                                                const float (&acc)[kHalves * kL2Tiles][kN / 2]) {
        const NarrowThread nt(mt);
        constexpr int kRowBytes = kL2PassN * 2 + 16;
        static_assert(kN * kRowBytes <= mega_moe_expanded_b_bytes(kMmaType, BLOCK_M), "kN staging rows fit the expanded tile");
        uint8_t* tile = sm.expanded_b;
        constexpr int kChunks = kL2PassN * 2 / 16;   // a token row's chunks: every column of the pass
        constexpr int kPasses = ceil_div(kN * kChunks, 128);   // at most kN rows
        int info[kPasses];
        load_row_infos<kChunks>(info, static_cast<int64_t>(m) * BLOCK_M + o, mt.tid, num_rows);
        #pragma unroll
        for (int t = 0; t < kHalves * kL2Tiles; ++t)
            #pragma unroll
            for (int i = 0; i < kN / 2; ++i)
                *reinterpret_cast<__nv_bfloat16*>(tile + (8 * (i / 4) + nt.c0 + i % 2) * kRowBytes + (t * 64 + wide_row(nt, i)) * 2) =
                    __float2bfloat16_rn(acc[t][i]);
        named_barrier(kBarrierMathBase + mt.wg, 128);
        const int off = (mt.tid % kChunks) * 16;
        #pragma unroll
        for (int i = 0; i < kPasses; ++i) {
            const int t = mt.tid / kChunks + i * (128 / kChunks);
            if (info[i] >= 0)
                *reinterpret_cast<int4*>(combine_slot(info[i], j * kL2PassN, off)) = *reinterpret_cast<const int4*>(tile + t * kRowBytes + off);
        }
        end_l2_pass(mt, last_pass);
    }

    // All of this rank's L2 rows are out: tell every source rank
    __device__ void signal_combine_ready() const {
        fence_peers();
        for (int r = 0; r < lay.num_ranks; ++r)
            st_release_peers(lay.get_ptr<uint64_t>(p.buffers[r], lay.combine_ready) + p.rank, epoch);
    }

    // Prefill combine (BLOCK_M = 128), the same sums in the same order as combine(), with the rows
    // brought through shared memory. A combine task's chunks of y [first, last) are the same byte
    // range of every top-k plane of the combine slots ([k][token][hidden], token-major like y), so
    // a batch is one bulk copy per plane: chunks [c0, c0 + 128) of planes [k0, k0 + 8), into one of
    // the warpgroup's kMegaMoECombineBufs buffers (16 KB each, in its Smem::kCombineHalfBytes), completed on
    // that buffer's mbarrier. Each warpgroup takes half of the task's range and runs alone: its own
    // buffers, mbarriers and barrier (no barrier spans the warpgroups: on abort each leaves its task
    // loop by its own decision). Thread t sums chunk c0 + t over the valid planes of its token
    // (FP32, k ascending: bit-identical to combine()), writes y after the last plane group, and the
    // warpgroup's barrier (which also ORs the leave decision) frees the buffer for the batch
    // kMegaMoECombineBufs ahead. `batches`: this warpgroup's batches so far (the mbarriers' phases).
    //
    // The stages are free: the wait for combine_ready includes this rank's own, raised after every
    // math warpgroup of every CTA of the rank finished its L2 tasks (their wgmma reads of the stages
    // complete before their epilogues); every stage the producer armed was waited for by the math
    // before that, and after the first combine ticket the producer arms none (later tickets are
    // combine tasks or the end). FP8 x FP4: so are the expanded tiles, which also hold the epilogue
    // tile (generic stores, then these bulk copies' async-proxy writes: math() fences them).
    template <typename OnReady>
    __device__ void combine_bulk(int c, const MathThread& mt, uint32_t& batches, OnReady&& on_ready) {
        wait_combine_ready(mt.tid);
        named_barrier(kBarrierMathBase + mt.wg, 128);
        on_ready();
        // An abort seen here is not a return: the warpgroup decides once, at the first batch's
        // barrier (threads that left here alone would leave the others waiting at it)
        bool leave = sm.ctrl->abort != 0;
        if (mt.wg == 0 and mt.tid == 0) trace(kTraceCombineReady, true);

        constexpr int kChunks = kMegaMoECombineBatchChunks, kPlanes = kMegaMoECombinePlanes, kBufs = kMegaMoECombineBufs;
        static_assert(kChunks == 128, "one chunk of a batch per thread of the warpgroup");
        const int hidden = lay.hidden, topk = lay.num_topk, n_max = lay.num_max_tokens_per_rank;
        const int chunks_per_token = hidden / 8;
        const CombineRange range = combine_range(c);
        const int half = ceil_div(range.last - range.first, kNumMathWGs);
        const int first = range.first + mt.wg * half, last = min_of(range.last, first + half);
        const int num_kgroups = ceil_div(topk, kPlanes);
        const int num_batches = max_of(0, ceil_div(last - first, kChunks)) * num_kgroups;
        const auto* slots = mine<uint8_t>(lay.combine);
        const auto* topk_idx = mine<int64_t>(lay.topk_idx);
        auto* y = static_cast<__nv_bfloat16*>(p.y);
        uint64_t* bars = sm.combine_bars + mt.wg * kBufs;
        const uint32_t q0 = batches;
        // Batch b: chunk group b / num_kgroups, planes from (b % num_kgroups) * kPlanes (one thread issues)
        auto issue = [&](int b) {
            const int c0 = first + b / num_kgroups * kChunks, k0 = b % num_kgroups * kPlanes;
            const int num_k = min_of(kPlanes, topk - k0);
            const uint32_t bytes = static_cast<uint32_t>(min_of(kChunks, last - c0)) * 16;
            const int buf = static_cast<int>((q0 + b) % kBufs);
            uint8_t* dst = sm.combine_buf(mt.wg, buf);
            mbarrier_arrive_expect_tx(bars + buf, bytes * num_k);
            for (int dk = 0; dk < num_k; ++dk)
                bulk_load(dst + dk * kChunks * 16, slots + static_cast<int64_t>(k0 + dk) * n_max * hidden * 2 + static_cast<int64_t>(c0) * 16,
                          bytes, bars + buf);
        };
        if (mt.tid == 0) {
            // the rows were written by generic stores (acquired above), the bulk copies read them
            fence_proxy_async_global();
            for (int b = 0; b < min_of(kBufs, num_batches); ++b) issue(b);
        }
        float sum[8];
        int b = 0;
        for (; b < num_batches; ++b) {
            const int kg = b % num_kgroups, k0 = kg * kPlanes;
            const int i = first + b / num_kgroups * kChunks + mt.tid;    // this thread's chunk of y
            // Which planes of the chunk's token hold a row: loaded before the wait, so the loads
            // overlap the batch's copies
            uint32_t valid = 0;
            if (i < last) {
                const int64_t t = i / chunks_per_token;
                #pragma unroll
                for (int dk = 0; dk < kPlanes; ++dk) {
                    const int64_t e = k0 + dk < topk ? topk_idx[t * topk + k0 + dk] : -1;
                    if (e >= 0 and e < lay.num_experts) valid |= 1u << dk;
                }
            }
            const uint32_t q = q0 + b;
            const int buf = static_cast<int>(q % kBufs);
            if (not leave) leave = not bounded_wait(p, sm.ctrl, Phase::kCombineWait, p.rank, [&] { return mbarrier_try_wait(bars + buf, (q / kBufs) & 1); });
            if (not leave and i < last) {
                if (kg == 0) {
                    #pragma unroll
                    for (int j = 0; j < 8; ++j) sum[j] = 0.0f;
                }
                const uint32_t src = smem_addr(sm.combine_buf(mt.wg, buf)) + mt.tid * 16;
                #pragma unroll
                for (int dk = 0; dk < kPlanes; ++dk) {
                    if (valid >> dk & 1) add_bf16x8(sum, ld_shared_v4(src + dk * kChunks * 16));    // fixed order: k ascending
                }
                if (kg == num_kgroups - 1) *reinterpret_cast<int4*>(y + static_cast<int64_t>(i) * 8) = bf16x8_of(sum);
            }
            // Every thread has read the buffer before it is refilled, and all agree whether to go on
            if (named_barrier_or(kBarrierCombineBase + mt.wg, 128, leave)) break;
            if (mt.tid == 0 and b + kBufs < num_batches) issue(b + kBufs);
        }
        if (b < num_batches) {
            // Left on abort: batches b .. b + kBufs - 1 may still be landing in shared memory; wait for
            // them (bounded) so that no bulk write reaches shared memory after the CTA has exited
            if (mt.tid == 0) {
                const uint64_t start = globaltimer_ns();
                for (int r = b; r < min_of(num_batches, b + kBufs); ++r) {
                    const uint32_t q = q0 + r;
                    while (not mbarrier_try_wait(bars + q % kBufs, (q / kBufs) & 1) and globaltimer_ns() - start < p.timeout_ns) {}
                }
            }
            return;
        }
        batches += num_batches;
        if (mt.wg == 0 and mt.tid == 0) trace(kTraceCombineEnd);
    }

    // Prefill FP8 x FP4 (kEpilogueInExpanded): before a task's epilogue writes its tile, which lies in
    // the expanded tiles, both warpgroups' wgmmas of the task (which read them) are complete: each
    // waited for its own before it arrives here. (The next task's first expansion meets the other
    // way round at expand_fp4_tile's first barrier, after both epilogues.) Every thread of both
    // reaches it or neither: the leave decisions before it follow from the stages.
    __device__ void epilogue_tile_free() const {
        if constexpr (kEpilogueInExpanded) named_barrier(kBarrierMathAll, kNumMathThreads);
    }

    __device__ void math(int wg) {
        MathThread mt;
        mt.wg = wg;
        mt.tid = static_cast<int>(threadIdx.x) - 128 * (wg + 1);
        mt.warp = mt.tid / 32;
        mt.lane = mt.tid % 32;
        mt.tracer = p.trace != nullptr and mt.tid == 0;
        mt.log = -1;
        int logged = 0;   // task-log entries written (tracer of warpgroup 0)
        const int total = tasks.total();
        uint32_t stage_iter = 0;
        uint32_t combine_batches = 0;   // bulk combine: this warpgroup's batches so far (its mbarriers' phases)
        for (int i = 0;; ++i) {
            const int t = next_task(i, total, false);
            const bool is_combine = t >= tasks.l2_end() and t < total;
            if (not is_combine) release_task(i);
            // kEpilogueInExpanded: this thread's epilogue stores into the expanded tiles (generic
            // proxy) before the bulk combine's copies into them (async proxy), ordered by the
            // barrier below and combine_ready
            if constexpr (kEpilogueInExpanded) {
                if (is_combine) fence_proxy_async_shared();
            }
            // Leave together: the math warpgroups meet at barriers and wgmma until the task ends
            const bool leave = math_any(t >= total or sm.ctrl->abort, mt);
            settle_signals(mt, leave);
            raise_l2_counts(mt, leave ? total : t);
            if (leave) {
                if (is_combine) release_task(i);
                break;
            }
            if (kTaskLog and mt.tracer) {
                mt.log = mt.wg == 0 and logged < kTraceTasks and t >= tasks.pull_end() ? logged++ : -1;
                log_task(mt, kTaskStampGot);
            }
            if (t >= tasks.pull_end() and t < tasks.l1_end()) {
                // split-K: consecutive tasks are the K parts of one tile (the scheduler's rule)
                const int idx = t - tasks.pull_end(), tile = idx / tasks.l1_split;
                const int m = tile / tasks.num_l1_nblocks, j = tile % tasks.num_l1_nblocks;
                float acc[kL1Acc], row_w[2];
                if (mt.tid == 0) trace(kTraceL1Begin, true);
                const int le = expert_of_mblock(m), rows = valid_rows(m, le);
                if (kTaskLog and mt.tracer) log_task_id(mt, kTaskKindL1, rows, t);
                if constexpr (kCtaPair and not kPairWide) {
                    // Token passes of 8 (the producer streams the same passes), never split (the host:
                    // l1_split_max 1); only the last pass signals the M-block's L1 count
                    float gate[4 * kHalves], up[4 * kHalves], tok_w[2];
                    const int passes = pair_token_passes(rows);
                    bool ok = true;
                    for (int q = 0; q < passes; ++q) {
                        const int o = q * kNarrowRows;
                        ok = narrow_l1_mainloop(m, lay.hidden / BLOCK_K, stage_iter, mt, gate, up, tok_w, o) and not task_stages_dead(stage_iter);
                        if (not ok) break;
                        log_task(mt, kTaskStampLoopEnd);
                        narrow_l1_epilogue(m, j, min_of(kNarrowRows, rows - o), mt, gate, up, tok_w, o, q == passes - 1);
                    }
                    if (not ok) break;
                    if (mt.tid == 0 and mt.wg == 0) trace(kTraceL1End);
                    if (kTaskLog and mt.tracer) log_task(mt, kTaskStampEnd);
                    continue;
                }
                if constexpr (kPairWide) {
                    // Token passes of 32 (pair_pass: the producer streams the same passes), each a narrow
                    // or an N = 16 / 32 tile; never split; only the last pass signals the M-block's L1
                    // count. (The pair without these tiles keeps the loop above, the SASS measured.)
                    const int passes = pair_token_passes(rows);
                    bool ok = true;
                    for (int q = 0; q < passes; ++q) {
                        const PairPass g = pair_pass(rows, q);
                        if (g.n == kNarrowRows) {
                            float gate[4 * kHalves], up[4 * kHalves], tok_w[2];
                            ok = narrow_l1_mainloop(m, lay.hidden / BLOCK_K, stage_iter, mt, gate, up, tok_w, g.o) and not task_stages_dead(stage_iter);
                            if (not ok) break;
                            log_task(mt, kTaskStampLoopEnd);
                            narrow_l1_epilogue(m, j, g.rows, mt, gate, up, tok_w, g.o, q == passes - 1);
                        } else {
                            const auto run = [&](auto n) {
                                constexpr int kN = decltype(n)::value;
                                float gate[kHalves][kN / 2], up[kHalves][kN / 2];
                                if (not transposed_l1_mainloop_pair<kN>(g.o, stage_iter, mt, gate, up) or task_stages_dead(stage_iter)) return false;
                                log_task(mt, kTaskStampLoopEnd);
                                transposed_l1_epilogue_pair<kN>(m, j, g.rows, g.o, q == passes - 1, mt, gate, up);
                                return true;
                            };
                            if constexpr (kWideN16) ok = g.n == 16 ? run(std::integral_constant<int, 16>{}) : run(std::integral_constant<int, 32>{});
                            else ok = run(std::integral_constant<int, 32>{});
                            if (not ok) break;
                        }
                    }
                    if (not ok) break;
                    if (mt.tid == 0 and mt.wg == 0) trace(kTraceL1End);
                    if (kTaskLog and mt.tracer) log_task(mt, kTaskStampEnd);
                    continue;
                }
                if (kSplitN and rows <= kNarrowRows) {   // the producer applies the same rule (scheduler)
                    float gate[4 * kHalves], up[4 * kHalves], tok_w[2];
                    const int task_kb = lay.hidden / BLOCK_K / tasks.l1_split;
                    if (not narrow_l1_mainloop(m, task_kb, stage_iter, mt, gate, up, tok_w) or task_stages_dead(stage_iter)) break;
                    log_task(mt, kTaskStampLoopEnd);
                    // split-K: only the tile's last finisher (sum of all parts) runs the epilogue
                    if (tasks.l1_split == 1 or split_l1_exchange(tile, idx % tasks.l1_split, tasks.l1_split, mt,
                                                                 *reinterpret_cast<float (*)[4]>(gate), *reinterpret_cast<float (*)[4]>(up)))
                        narrow_l1_epilogue(m, j, rows, mt, gate, up, tok_w);
                } else if constexpr (kTransposedWide and (kWideN16 or kWideN32)) {
                    // Never split (as the wide loop below): all of H's K-blocks; N by the tokens
                    const auto run = [&](auto n) {
                        constexpr int kN = decltype(n)::value;
                        float gate[kN / 2], up[kN / 2];
                        if (not transposed_l1_mainloop<kN>(stage_iter, mt, gate, up) or task_stages_dead(stage_iter)) return false;
                        log_task(mt, kTaskStampLoopEnd);
                        transposed_l1_epilogue<kN>(m, j, rows, mt, gate, up);
                        return true;
                    };
                    if (not (rows <= 16 and kWideN16 ? run(std::integral_constant<int, 16>{})
                             : rows <= 32 and kWideN32 ? run(std::integral_constant<int, 32>{}) : run(std::integral_constant<int, 64>{}))) break;
                } else if constexpr (kTransposedWide) {   // N = 64 only (the lambda above changes this kernel's SASS)
                    float gate[32], up[32];
                    if (not transposed_l1_mainloop<64>(stage_iter, mt, gate, up) or task_stages_dead(stage_iter)) break;
                    log_task(mt, kTaskStampLoopEnd);
                    transposed_l1_epilogue<64>(m, j, rows, mt, gate, up);
                } else if constexpr (kSkipIdleRows) {
                    // The wide loop and epilogue of the `else` below, or the idle warpgroup's stage
                    // releases and count. Spelled out twice: the idle test in the `else` branch moved
                    // the other kernels' SASS (+1 % at mid FP8 n = 4096, docs/PERF.md session 37)
                    if (not idle_rows(mt, rows)) {
                        if (not l1_mainloop(m, stage_iter, mt, acc, row_w) or task_stages_dead(stage_iter)) break;
                        log_task(mt, kTaskStampLoopEnd);
                        epilogue_tile_free();
                        l1_epilogue(m, j, rows, mt, acc, row_w);
                    } else {
                        if (not idle_mainloop<kMegaMoEBlockNL1>(lay.hidden / BLOCK_K, stage_iter, mt) or task_stages_dead(stage_iter)) break;
                        log_task(mt, kTaskStampLoopEnd);
                        epilogue_tile_free();
                        if (mt.tid == 0) signal_l1_done(m);   // nothing written: its count only
                    }
                } else {
                    // Never split (l1_split > 1 only when every tile is narrow: max_tokens <= kNarrowRows
                    // in build_layout); the wide loop runs all of H's K-blocks, as the producer streams them
                    if (not l1_mainloop(m, stage_iter, mt, acc, row_w) or task_stages_dead(stage_iter)) break;
                    log_task(mt, kTaskStampLoopEnd);
                    epilogue_tile_free();
                    l1_epilogue(m, j, rows, mt, acc, row_w);
                }
                if (mt.tid == 0 and mt.wg == 0) trace(kTraceL1End);
            } else if (t >= tasks.l1_end() and t < tasks.l2_end()) {
                const int idx = t - tasks.l1_end(), m = idx / tasks.num_l2_nblocks, j = idx % tasks.num_l2_nblocks;
                float acc[kL2Acc];
                if (mt.tid == 0) trace(kTraceL2Begin, true);
                const int le = expert_of_mblock(m), rows = valid_rows(m, le);
                if (kTaskLog and mt.tracer) log_task_id(mt, kTaskKindL2, rows, t);
                if constexpr (kCtaPair and not kPairWide) {
                    // per weight pass (a 512-wide task: two) the token passes of 8, as the producer;
                    // only the last of all signals the task done
                    float narrow_acc[4 * kL2Tiles * kHalves];
                    const int passes = pair_token_passes(rows);
                    bool ok = true;
                    for (int pass = 0; pass < kL2Passes and ok; ++pass)
                        for (int q = 0; q < passes; ++q) {
                            const int o = q * kNarrowRows;
                            ok = narrow_l2_mainloop(stage_iter, mt, narrow_acc, o) and not task_stages_dead(stage_iter);
                            if (not ok) break;
                            log_task(mt, kTaskStampLoopEnd);
                            narrow_l2_epilogue(m, kL2Passes * j + pass, min_of(kNarrowRows, rows - o), mt, narrow_acc,
                                               pass == kL2Passes - 1 and q == passes - 1, o);
                        }
                    if (not ok) break;
                    if (mt.tid == 0) trace(kTraceL2End);
                    if (kTaskLog and mt.tracer) log_task(mt, kTaskStampEnd);
                    continue;
                }
                if constexpr (kPairWide) {
                    // per weight pass the token passes of 32 (pair_pass), each a narrow or an N = 16 / 32
                    // tile, as the producer; only the last of all signals the task done
                    const int passes = pair_token_passes(rows);
                    bool ok = true;
                    for (int pass = 0; pass < kL2Passes and ok; ++pass)
                        for (int q = 0; q < passes; ++q) {
                            const PairPass g = pair_pass(rows, q);
                            const bool last = pass == kL2Passes - 1 and q == passes - 1;
                            if (g.n == kNarrowRows) {
                                float narrow_acc[4 * kL2Tiles * kHalves];
                                ok = narrow_l2_mainloop(stage_iter, mt, narrow_acc, g.o) and not task_stages_dead(stage_iter);
                                if (not ok) break;
                                log_task(mt, kTaskStampLoopEnd);
                                narrow_l2_epilogue(m, kL2Passes * j + pass, g.rows, mt, narrow_acc, last, g.o);
                            } else {
                                const auto run = [&](auto n) {
                                    constexpr int kN = decltype(n)::value;
                                    float wide_acc[kHalves * kL2Tiles][kN / 2];
                                    if (not transposed_l2_mainloop_pair<kN>(g.o, stage_iter, mt, wide_acc) or task_stages_dead(stage_iter)) return false;
                                    log_task(mt, kTaskStampLoopEnd);
                                    transposed_l2_epilogue_pair<kN>(m, kL2Passes * j + pass, g.rows, g.o, last, mt, wide_acc);
                                    return true;
                                };
                                if constexpr (kWideN16) ok = g.n == 16 ? run(std::integral_constant<int, 16>{}) : run(std::integral_constant<int, 32>{});
                                else ok = run(std::integral_constant<int, 32>{});
                                if (not ok) break;
                            }
                        }
                    if (not ok) break;
                    if (mt.tid == 0) trace(kTraceL2End);
                    if (kTaskLog and mt.tracer) log_task(mt, kTaskStampEnd);
                    continue;
                }
                if (kSplitN and rows <= kNarrowRows) {   // the producer applies the same rule (scheduler)
                    float narrow_acc[4 * kL2Tiles * kHalves];
                    // One pass (128 / 256 wide) written out, not as the loop's one trip: the loop form
                    // changes the SASS of every 128- and 256-wide decode kernel (checked on the CPU in
                    // session 29), which the H200 has measured in this form; the same for the two
                    // transposed branches below
                    if constexpr (kL2Passes == 1) {
                        if (not narrow_l2_mainloop(stage_iter, mt, narrow_acc) or task_stages_dead(stage_iter)) break;
                        log_task(mt, kTaskStampLoopEnd);
                        narrow_l2_epilogue(m, j, rows, mt, narrow_acc);
                    } else {   // a 512-wide task: two 256-row passes (a loop: one copy of the K-loop)
                        bool ok = true;
                        for (int pass = 0; pass < kL2Passes; ++pass) {
                            ok = narrow_l2_mainloop(stage_iter, mt, narrow_acc) and not task_stages_dead(stage_iter);
                            if (not ok) break;
                            log_task(mt, kTaskStampLoopEnd);
                            narrow_l2_epilogue(m, kL2Passes * j + pass, rows, mt, narrow_acc, pass == kL2Passes - 1);
                        }
                        if (not ok) break;
                    }
                } else if constexpr (kTransposedWide and (kWideN16 or kWideN32)) {   // passes over the task's B rows, as a narrow tile (scheduler)
                    const auto run = [&](auto n) {
                        constexpr int kN = decltype(n)::value;
                        float wide_acc[kN / 2 * kL2Tiles];
                        if constexpr (kL2Passes == 1) {
                            if (not transposed_l2_mainloop<kN>(stage_iter, mt, wide_acc) or task_stages_dead(stage_iter)) return false;
                            log_task(mt, kTaskStampLoopEnd);
                            transposed_l2_epilogue<kN>(m, j, rows, mt, wide_acc);
                        } else {
                            for (int pass = 0; pass < kL2Passes; ++pass) {
                                if (not transposed_l2_mainloop<kN>(stage_iter, mt, wide_acc) or task_stages_dead(stage_iter)) return false;
                                log_task(mt, kTaskStampLoopEnd);
                                transposed_l2_epilogue<kN>(m, kL2Passes * j + pass, rows, mt, wide_acc, pass == kL2Passes - 1);
                            }
                        }
                        return true;
                    };
                    if (not (rows <= 16 and kWideN16 ? run(std::integral_constant<int, 16>{})
                             : rows <= 32 and kWideN32 ? run(std::integral_constant<int, 32>{}) : run(std::integral_constant<int, 64>{}))) break;
                } else if constexpr (kTransposedWide) {
                    float wide_acc[32 * kL2Tiles];
                    if constexpr (kL2Passes == 1) {
                        if (not transposed_l2_mainloop<64>(stage_iter, mt, wide_acc) or task_stages_dead(stage_iter)) break;
                        log_task(mt, kTaskStampLoopEnd);
                        transposed_l2_epilogue<64>(m, j, rows, mt, wide_acc);
                    } else {
                        bool ok = true;
                        for (int pass = 0; pass < kL2Passes; ++pass) {
                            ok = transposed_l2_mainloop<64>(stage_iter, mt, wide_acc) and not task_stages_dead(stage_iter);
                            if (not ok) break;
                            log_task(mt, kTaskStampLoopEnd);
                            transposed_l2_epilogue<64>(m, kL2Passes * j + pass, rows, mt, wide_acc, pass == kL2Passes - 1);
                        }
                        if (not ok) break;
                    }
                } else if constexpr (kSkipIdleRows) {
                    // The idle warpgroup's stage releases and count, or the 128-wide task of the branch
                    // below (spelled out twice, as in the L1 task's), or a 256-wide (kL2OnePass) one: one
                    // K loop, its two tiles' epilogues
                    if (idle_rows(mt, rows)) {
                        if (not idle_mainloop<kMegaMoEBlockNL2>(lay.intermediate_hidden / BLOCK_K, stage_iter, mt) or task_stages_dead(stage_iter)) break;
                        log_task(mt, kTaskStampLoopEnd);
                        epilogue_tile_free();
                        finish_l2_task(mt);   // nothing written: its count only
                    } else if constexpr (kL2Tiles == 1) {
                        if (not l2_mainloop(stage_iter, mt, acc) or task_stages_dead(stage_iter)) break;
                        log_task(mt, kTaskStampLoopEnd);
                        epilogue_tile_free();
                        l2_epilogue(m, j, rows, mt, acc);
                    } else {
                        static_assert(kL2OnePass);
                        float wide_acc[2 * kL2Acc];
                        if (not l2_mainloop<2>(stage_iter, mt, wide_acc) or task_stages_dead(stage_iter)) break;
                        log_task(mt, kTaskStampLoopEnd);
                        int info[kL2CopyPasses];   // the same rows for both tiles
                        load_l2_row_infos(info, m, rows, mt);
                        l2_epilogue<false>(2 * j, mt, *reinterpret_cast<float (*)[kL2Acc]>(wide_acc), info);
                        l2_epilogue<true>(2 * j + 1, mt, *reinterpret_cast<float (*)[kL2Acc]>(wide_acc + kL2Acc), info);
                    }
                } else if constexpr (kL2Tiles == 1) {
                    if (not l2_mainloop(stage_iter, mt, acc) or task_stages_dead(stage_iter)) break;
                    log_task(mt, kTaskStampLoopEnd);
                    epilogue_tile_free();
                    l2_epilogue(m, j, rows, mt, acc);
                } else if constexpr (kL2WidePasses == 2) {   // a 256-wide task of a wide M-block: its two 128-column tiles, as the producer streams them
                    if (not l2_mainloop(stage_iter, mt, acc) or task_stages_dead(stage_iter)) break;
                    log_task(mt, kTaskStampLoopEnd);
                    l2_epilogue<false>(m, 2 * j, rows, mt, acc);
                    if (not l2_mainloop(stage_iter, mt, acc) or task_stages_dead(stage_iter)) break;
                    log_task(mt, kTaskStampLoopEnd);
                    l2_epilogue(m, 2 * j + 1, rows, mt, acc);
                } else {   // a 512-wide task of a wide M-block: its four 128-column tiles (a loop: one copy of the K-loop)
                    bool ok = true;
                    for (int pass = 0; pass < kL2WidePasses - 1; ++pass) {
                        ok = l2_mainloop(stage_iter, mt, acc) and not task_stages_dead(stage_iter);
                        if (not ok) break;
                        log_task(mt, kTaskStampLoopEnd);
                        l2_epilogue<false>(m, kL2WidePasses * j + pass, rows, mt, acc);
                    }
                    if (not ok or not l2_mainloop(stage_iter, mt, acc) or task_stages_dead(stage_iter)) break;
                    log_task(mt, kTaskStampLoopEnd);
                    l2_epilogue(m, kL2WidePasses * j + kL2WidePasses - 1, rows, mt, acc);
                }
                if (mt.tid == 0) trace(kTraceL2End);
            } else if (is_combine) {
                if (kTaskLog and mt.tracer) log_task_id(mt, kTaskKindCombine, 0, t);
                if constexpr (kBulkCombine)
                    combine_bulk(t - tasks.l2_end(), mt, combine_batches, [&] { release_task(i); });
                else
                    combine<kMathCombineSlots>(t - tasks.l2_end(), 128 * mt.wg + mt.tid, mt.tid, 128, kBarrierMathBase + mt.wg,
                                               [&] { release_task(i); });
            }
            if (kTaskLog and mt.tracer) log_task(mt, kTaskStampEnd);
        }
    }

    // ------------------------------------------------------------------------------------------
    __device__ void run(const TensorMaps& tm) {
        const int warp = warp_idx();
        auto* control = mine<uint32_t>(lay.control);
        SharedControl* ctrl = sm.ctrl;

        if (threadIdx.x == 0) {
            for (int s = 0; s < kNumStages; ++s) {
                mbarrier_init(sm.full + s, 1);
                mbarrier_init(sm.empty + s, 4 * kNumMathWGs);      // one lane per math warp
            }
            for (int r = 0; r < kTaskRing; ++r) {
                mbarrier_init(sm.ring_full + r, 1);
                mbarrier_init(sm.ring_empty + r, kNumRingConsumers);
            }
            for (int i = 0; i < kPullSlots; ++i) mbarrier_init(sm.pull_bars + i, 1);   // its dispatch thread
            if constexpr (kSignalsThread)
                for (int i = 0; i < kNumMathWGs * kMegaMoESignalPosts; ++i)
                    mbarrier_init(sm.signal_full(i / kMegaMoESignalPosts, i % kMegaMoESignalPosts), 1),   // the poster
                    mbarrier_init(sm.signal_empty(i / kMegaMoESignalPosts, i % kMegaMoESignalPosts), 1);  // the signals thread
            if constexpr (kBulkCombine)
                for (int i = 0; i < kNumMathWGs * kMegaMoECombineBufs; ++i) mbarrier_init(sm.combine_bars + i, 1);   // the issuing thread
            fence_barrier_init();
            ctrl->late = 0;
            ctrl->abort = 0;
            ctrl->is_last_cta = 0;
            ctrl->num_mblocks = 0;
            ctrl->armed_final = 0xffffffffu;
            ctrl->dead_from = 0xffffffffu;
            ctrl->l1_split = 1;
            ctrl->trace_first = 0;
            ctrl->l2_owed_count[0] = ctrl->l2_owed_count[1] = 0;
        }
        if constexpr (kFP4) {
            // fp4_table[d][c] = RNE_e4m3(e2m1(c) * 2^(6 - d)) for the magnitudes c < 8, the rule of
            // transform_weights_for_mega_moe (the sign bit is or-ed in by expand_e2m1x8)
            for (int i = threadIdx.x; i < kMegaMoEFP4TableBytes; i += kNumThreads) {
                constexpr float kE2M1[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
                const int d = i / 8, c = i % 8;
                const float v = kE2M1[c] * exp2f(static_cast<float>(6 - d));
                sm.fp4_table[i] = static_cast<uint8_t>(__nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E4M3));
            }
        }
        if (warp == 0 and lane_idx() == 0) {
            prefetch_tma_descriptor(tm.l1_act), prefetch_tma_descriptor(tm.l1_w);
            prefetch_tma_descriptor(tm.l2_act), prefetch_tma_descriptor(tm.l2_w);
            if constexpr (kSplitN) prefetch_tma_descriptor(tm.l1_act_narrow), prefetch_tma_descriptor(tm.l2_act_narrow);
            if constexpr (kWideN16) prefetch_tma_descriptor(tm.l1_act_16), prefetch_tma_descriptor(tm.l2_act_16);
            if constexpr (kWideN32) prefetch_tma_descriptor(tm.l1_act_32), prefetch_tma_descriptor(tm.l2_act_32);
        }
        // Launched as a programmatic dependent (the launcher's launch attribute): the setup above
        // touches only shared memory and the parameters, so it overlaps the kernel before this one
        // on the stream (the staging kernel, or the previous call's tail); every global access
        // below waits for that kernel's writes (inputs, and the counters the previous call reset)
        griddepcontrol_wait();
        if (threadIdx.x == 0) {
            trace(kTraceStart);
            // Written by the previous launch on this stream (or reset()): a plain load suffices
            ctrl->epoch = control[L::kControlEpoch] + 1;
            ctrl->count_slice = static_cast<int>(atomicAdd(control + L::kControlCountClaim, 1));
        }
        __syncthreads();
        epoch = ctrl->epoch;

        count();
        build_layout();
        if (threadIdx.x == 0) trace(kTraceLayout);

        if (not ctrl->late and not ctrl->abort) {
            tasks.num_mblocks = ctrl->num_mblocks;
            tasks.num_l1_nblocks = lay.intermediate_hidden / 128;
            tasks.l1_split = kSplitN ? ctrl->l1_split : 1;   // BLOCK_M = 128 kernels never split (a constant 1 there)
            tasks.num_l2_nblocks = lay.hidden / kL2BlockN;
            tasks.num_combine = num_combine_tasks();
            if (threadIdx.x == 0) {
                control[L::kControlNumMBlocks] = tasks.num_mblocks;
                ctrl->first_task = static_cast<int>(atomicAdd(control + L::kControlTaskQueue, 1));
            }
            __syncthreads();
            if (ctrl->first_task == 0 and threadIdx.x == 0) {
                if (p.cumulative_local_expert_recv_stats != nullptr)
                    for (int le = 0; le < lay.num_local_experts; ++le)
                        atomicAdd(p.cumulative_local_expert_recv_stats + le, sm.expert_tokens[le]);
                if (tasks.num_mblocks == 0) signal_combine_ready();   // no L2 task will do it
            }
            __syncthreads();

            if (warp < 4) {
                setmaxnreg_dec<kProducerRegisters>();
                if (warp == 0) {
                    if (elect_one()) scheduler(tm);
                    __syncwarp();
                } else {
                    dispatch_worker();
                }
            } else {
                setmaxnreg_inc<kMathRegisters>();
                math(warp / 4 - 1);
            }
            // The call's closing barrier: this rank's next call writes counts and source indices into
            // every peer, so it must not start before every peer has pulled this call's tokens.
            // combine_ready[q] says rank q's L2 tasks (hence its pulls) are done; a rank with tokens
            // waits for it in its combine tasks, but a rank with n = 0 has none: one CTA waits here.
            if (ctrl->first_task == 0) wait_combine_ready(static_cast<int>(threadIdx.x));
        }

        // Leave; the last CTA out resets the per-call counters for the next call on this buffer
        __syncthreads();
        if (threadIdx.x == 0) {
            trace(kTraceExit);
            __threadfence();
            const uint32_t exited = atom_acq_rel_gpu_add(control + L::kControlExitedCtas, 1);
            ctrl->is_last_cta = exited == gridDim.x - 1;
        }
        __syncthreads();
        if (ctrl->is_last_cta) {
            const auto* status = mine<uint64_t>(lay.status);
            if (ld_volatile(status + L::kStatusAbort) != 0) return;    // reset() on the host clears it
            const int num_mblocks = static_cast<int>(__ldcg(control + L::kControlNumMBlocks));
            auto* arrival = mine<uint32_t>(lay.mblock_arrival);
            auto* l1_done = mine<uint32_t>(lay.mblock_l1_done);
            for (int m = threadIdx.x; m < num_mblocks; m += kNumThreads) arrival[m] = 0, l1_done[m] = 0;
            if (num_count_slices() > 1) {
                auto* send_count = mine<int>(lay.send_count);
                for (int e = threadIdx.x; e < lay.num_experts; e += kNumThreads) send_count[e] = 0;
            }
            if (threadIdx.x == 0) {
                control[L::kControlTaskQueue] = 0;
                control[L::kControlCountDone] = 0;
                control[L::kControlL2TasksDone] = 0;
                control[L::kControlCountClaim] = 0;
                control[L::kControlExitedCtas] = 0;
                control[L::kControlEpoch] = epoch;
            }
        }
    }
};

}  // namespace deep_gemm::sm90_mega_moe

// The JIT runtime instantiates this with the config chosen by the heuristics
#define DG_DEFINE_SM90_MEGA_MOE_KERNEL(NAME, MMA_TYPE, BLOCK_M, NUM_STAGES, FAST_MATH, L2_BLOCK_N, WIDE_N_MIN)        \
    extern "C" __global__ void __launch_bounds__(deep_gemm::sm90_mega_moe::Kernel<MMA_TYPE, BLOCK_M, NUM_STAGES, FAST_MATH, L2_BLOCK_N, WIDE_N_MIN>::kNumThreads, \
                                                 deep_gemm::sm90_mega_moe::Kernel<MMA_TYPE, BLOCK_M, NUM_STAGES, FAST_MATH, L2_BLOCK_N, WIDE_N_MIN>::kCtasPerSM) \
    NAME(const __grid_constant__ deep_gemm::MegaMoEParams params, const __grid_constant__ CUtensorMap tm_l1_act,       \
         const __grid_constant__ CUtensorMap tm_l1_w, const __grid_constant__ CUtensorMap tm_l2_act,                   \
         const __grid_constant__ CUtensorMap tm_l2_w, const __grid_constant__ CUtensorMap tm_l1_act_narrow,            \
         const __grid_constant__ CUtensorMap tm_l2_act_narrow, const __grid_constant__ CUtensorMap tm_l2_w_pair,       \
         const __grid_constant__ CUtensorMap tm_l1_d_pair, const __grid_constant__ CUtensorMap tm_l2_d_pair,          \
         const __grid_constant__ CUtensorMap tm_l1_act_16, const __grid_constant__ CUtensorMap tm_l2_act_16,          \
         const __grid_constant__ CUtensorMap tm_l1_act_32, const __grid_constant__ CUtensorMap tm_l2_act_32) {        \
        extern __shared__ __align__(1024) uint8_t dg_smem[];                                                          \
        auto* base = reinterpret_cast<uint8_t*>(deep_gemm::align_up<uintptr_t>(reinterpret_cast<uintptr_t>(dg_smem), 1024)); \
        deep_gemm::sm90_mega_moe::Kernel<MMA_TYPE, BLOCK_M, NUM_STAGES, FAST_MATH, L2_BLOCK_N, WIDE_N_MIN> kernel(params, base);  \
        kernel.run({&tm_l1_act, &tm_l1_w, &tm_l2_act, &tm_l2_w, &tm_l1_act_narrow, &tm_l2_act_narrow, &tm_l2_w_pair,  \
                    &tm_l1_d_pair, &tm_l2_d_pair, &tm_l1_act_16, &tm_l2_act_16, &tm_l1_act_32, &tm_l2_act_32});          \
    }
