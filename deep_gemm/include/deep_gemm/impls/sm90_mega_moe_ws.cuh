#pragma once

// The weights-first kernel: one launch for a one-rank call of at most kWsMaxPairs routed (token,
// slot) pairs (docs/plans/decode-weights-first.md, docs/KERNEL.md "Weights first"). At one token the
// persistent kernel spends ~16 us on its chain (count, layout, pull, arrival) before its L1 K-loop
// streams the weights; here every CTA reads the routing itself and starts streaming weights at once.
//
//   routing  every CTA reads the n x top-k ids (one or two lines) and derives the same table: the
//            distinct experts in ascending id ("slots" j), and per pair c = token x top-k + k its
//            slot, token and weight. No count, no pull: the tokens' rows are read from the inputs.
//   units    L1: (slot j, 256-row gate/up tile, K-block), K fastest; L2: (256-wide column tile of y,
//            slot j, K-block), K fastest. Each phase's units are cut into chunks of consecutive units
//            (MegaMoEWsPlan: split, about one chunk per CTA and at most one tile's worth, or whole,
//            one tile's / one (column tile, slot)'s whole K); claimed from one queue, every L1 chunk
//            before any L2 chunk, so a CTA that waits (L2 on L1) waits for work some running CTA
//            holds: the kernel completes with part of its grid resident.
//   L1       the tile's weights are the wgmma M side (4 x 64 rows), the tokens its N = 8 (rows 0..7 of
//            x: columns of tokens >= n hold garbage no pair reads). FP8 x FP4: the stage holds the
//            tile's packed E2M1 codes and exponent deltas; each math thread expands its own A
//            fragments into registers (sm90_mega_moe::fp4, the persistent kernel's narrow tiles' rule). Split: a chunk's partial sums of
//            a tile go to the workspace; the chunk that counts a tile's last part sums the parts in
//            part order (bitwise repeatable). The tile's last (or only) chunk runs the epilogue:
//            SwiGLU (+clamp) x the pair's top-k weight, FP8 per-128 quantization (the persistent
//            kernel's arithmetic), into row c of the L2 pool for each pair c of the tile's expert;
//            then one count of the slot's L1 tiles done.
//   L2       an L2 unit of slot j waits for slot j's L1 tiles (a counter per slot), then loads the
//            pairs' rows as the N = 8 side (column c = pair c); each unit's product is added into
//            column c only where pair c belongs to the unit's slot. Per column tile: split chunks'
//            partial sums are summed in part order by its last part; whole chunks each own their
//            pairs' columns, which the last of them reads back. That last one writes y's columns:
//            per token its pairs' rows, each rounded to BF16, summed in pair (top-k slot) order, as
//            the persistent kernel's combine.
//
// Roles: the math warpgroup (warps 0-3; FP8 x FP4: two, warps 0-7, warpgroup w taking M tiles w and
// w + 2 of every stage, so L1's gate and up rows of a half stay in one thread), then the producer warp
// (one lane: the queue and the TMA loads).

#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include "mega_moe_fp4.cuh"
#include "sm90_fp8_mega_moe.cuh"

namespace deep_gemm::sm90_mega_moe_ws {

using namespace deep_gemm::ptx;
namespace L = deep_gemm::layout;
using sm90_mega_moe::report;
using sm90_mega_moe::SharedControl;

// Short names of mega_moe_params.cuh's constants (the launcher sizes the launch from the same ones)
constexpr int kWsMaxPairs = kMegaMoEWsMaxPairs;
constexpr int kWsTileRows = kMegaMoEWsTileRows;
constexpr int kWsActBytes = kMegaMoEWsNSideBytes;
constexpr uint32_t kWsEnd = 0x80000000u;    // stage word: no more units
constexpr uint32_t kWsPhaseL2 = 0x40000000u;
constexpr int kWsBarrierMath = 1;
constexpr uint32_t kWsPollMask = 63;
// The trace's slots (MegaMoEParams::trace; scripts/trace.py prints them under these names when the
// call ran weights-first): per CTA the first or (L1 / L2 ends, the last epilogues) the last stamp
enum WsTraceSlot : int {
    kWsTraceStart = 0, kWsTraceRouting, kWsTraceFirstIssue, kWsTraceFirstStage, kWsTraceL1Consumed, kWsTraceL1Epilogue,
    kWsTraceL1Waited, kWsTraceHLoaded, kWsTraceL2Consumed, kWsTraceYWritten, kWsTraceExit, kWsTraceSlots
};
// Task-log variants only (DG_MEGA_MOE_TASK_LOG=1: `_tasklog`, scripts/trace.py --tasks; the other
// variants' SASS carries none of it): per CTA, the first kTraceKbSlots units of its first L1 chunk
// (issued: kTraceKbIssue, the math had it: kTraceKbReady) and of its first L2 chunk (the producer had
// the stage free: kTraceKbLastFree, issued: kTraceKbLastIssue, the math had it: kTraceKbLastReady,
// released it: kTraceKbLastRelease), by the unit's place in its chunk
constexpr bool kWsStageLog = sm90_mega_moe::kTaskLogKBlocks;

struct WsShared {
    SharedControl ctrl;
    int num_slots;
    int bad_token;                   // the first pair with a bad expert id: its token, or -1
    int split_last;
    int wait_ok;
    int pair_slot[kWsMaxPairs];      // -1: masked, a bad id, or no pair (c >= n x top-k); pair c's token is c / top-k
    float pair_weight[kWsMaxPairs];
    int slot_expert[kWsMaxPairs];
};

template <MmaType kMmaType, int kNumStages, bool kFastMath>
struct WsKernel {
    static constexpr bool kFP8 = is_fp8_activation(kMmaType);   // FP8 activations and FP32 weight block scales
    static constexpr bool kFP4 = kMmaType == MmaType::kFP8xFP4;  // E2M1 weights, expanded into A fragments
    static constexpr int kWsStageBytes = mega_moe_ws_stage_bytes(kMmaType);
    static constexpr int kCodeBytes = mega_moe_ws_stage_code_bytes(kMmaType);   // FP8 x FP4: the deltas follow
    static constexpr int kActBytes = kFP8 ? 1 : 2;
    static constexpr int kMathWGs = mega_moe_ws_math_warpgroups(kMmaType);
    static constexpr int kMathThreads = mega_moe_ws_math_threads(kMmaType);
    static constexpr int kThreads = mega_moe_ws_threads(kMmaType);
    static constexpr int kProducerWarp = kMathThreads / 32;
    static constexpr int kTiles = 4 / kMathWGs;   // a thread's 64-row M tiles of a stage
    // A partial-sum slot (exchange, exchange_columns): each math thread's kTiles x 4 accumulators
    static_assert(kMathThreads * kTiles * 4 == L::kSplitPartialFloats, "a split_partials slot holds one tile's accumulators");
    static constexpr int BLOCK_K = 128 / kActBytes;
    using Mma = std::conditional_t<kFP8, mma::FP8MmaN8, mma::BF16MmaN8>;
    static constexpr int kStageScaleFloats = kMegaMoEWsStageScaleBytes / 4;
    static_assert(sizeof(WsShared) <= kMegaMoEWsScalarBytes and kWsTraceSlots <= kTraceSlots);

    const MegaMoEParams& p;
    const L::MegaMoELayout& lay;
    uint8_t* stages;
    uint8_t* acts;
    uint8_t* h_tile;
    float* xchg;       // [8][256] FP32
    float* x_sf;       // [H / 128][8]
    float* h_sf;       // [I / 128][8]
    float* stage_wsf;  // [stage][4]
    uint8_t* fp4_table;   // FP8 x FP4: [16 deltas][8 magnitudes] E4M3, 128-aligned
    uint64_t *full, *empty, *h_bar;
    uint32_t* words;
    WsShared* sh;
    uint32_t epoch = 0;

    // The carve-up of MegaMoEWsSmem, the layout the launcher sized the launch by
    __device__ WsKernel(const MegaMoEParams& params, uint8_t* base) : p(params), lay(params.layout) {
        const MegaMoEWsSmem o(kMmaType, kNumStages, lay.hidden, lay.intermediate_hidden);
        stages = base, acts = base + o.acts, h_tile = base + o.h_tile;
        xchg = reinterpret_cast<float*>(base + o.xchg), x_sf = reinterpret_cast<float*>(base + o.x_sf);
        h_sf = reinterpret_cast<float*>(base + o.h_sf), stage_wsf = reinterpret_cast<float*>(base + o.stage_wsf);
        full = reinterpret_cast<uint64_t*>(base + o.full), empty = reinterpret_cast<uint64_t*>(base + o.empty);
        h_bar = reinterpret_cast<uint64_t*>(base + o.h_bar), words = reinterpret_cast<uint32_t*>(base + o.words);
        fp4_table = base + o.table;
        sh = reinterpret_cast<WsShared*>(base + o.shared);
    }

    template <typename T>
    __device__ T* mine(const L::Section& s) const { return lay.get_ptr<T>(p.buffers[p.rank], s); }
    // scripts/trace.py (MegaMoEParams::trace): this kernel's stamps, slot by WsTraceSlot
    __device__ void trace(int slot) const {
        if (p.trace != nullptr) p.trace[static_cast<int64_t>(blockIdx.x) * kTraceSlots + slot] = globaltimer_ns();
    }
    __device__ uint32_t* counts() const { return mine<uint32_t>(lay.ws_count); }
    __device__ uint32_t* slot_done(int j) const { return counts() + L::kWsCountSlotDone + L::kWsCountLineWords * j; }
    __device__ bool aborted() const {
        return *reinterpret_cast<volatile int*>(&sh->ctrl.abort) or ld_volatile(mine<uint64_t>(lay.status) + L::kStatusAbort) != 0;
    }

    // An mbarrier wait that gives up when the call is aborted (the other side may have left)
    __device__ bool wait_bar(uint64_t* bar, uint32_t parity) {
        for (uint32_t n = 1;; ++n) {
            if (mbarrier_try_wait(bar, parity)) return true;
            if ((n & kWsPollMask) == 0 and aborted()) {
                *reinterpret_cast<volatile int*>(&sh->ctrl.abort) = 1;
                return false;
            }
        }
    }

    // ------------------------------------------------------------------------------------------
    // Every CTA: the routing table (warp 4, one lane a pair)
    __device__ void read_routing() {
        const int lane = lane_idx();
        const int num_pairs = p.num_tokens * lay.num_topk;   // <= kWsMaxPairs (the host's rule)
        int64_t e = -1;
        float w = 0.0f;
        if (lane < num_pairs) e = mine<int64_t>(lay.topk_idx)[lane], w = mine<float>(lay.topk_weights)[lane];
        const bool valid = lane < num_pairs and e >= 0 and e < lay.num_experts;
        const bool bad = lane < num_pairs and not valid and e != -1;   // never used as an index: flagged, masked
        const int ei = valid ? static_cast<int>(e) : -1;
        // slot = the distinct valid experts below this pair's; an expert's first pair names its slot
        int below = 0;
        bool first = valid;
        #pragma unroll
        for (int d = 0; d < kWsMaxPairs; ++d) {
            const int ed = __shfl_sync(0xffffffff, ei, d);
            bool first_d = ed >= 0;
            #pragma unroll
            for (int q = 0; q < d; ++q) first_d = first_d and __shfl_sync(0xffffffff, ei, q) != ed;
            if (first_d and ed < ei) ++below;
            if (d < lane and ed == ei) first = false;
        }
        const uint32_t firsts = __ballot_sync(0xffffffff, valid and first);
        const uint32_t bads = __ballot_sync(0xffffffff, bad);
        if (lane < kWsMaxPairs) {
            sh->pair_slot[lane] = valid ? below : -1;
            sh->pair_weight[lane] = w;
            if (valid and first) sh->slot_expert[below] = ei;
        }
        if (lane == 0) {
            sh->num_slots = __popc(firsts);
            sh->bad_token = bads == 0 ? -1 : (__ffs(bads) - 1) / lay.num_topk;
        }
    }

    // x's scales (FP8), [K-block][token], 0 for tokens >= n (their columns are never read)
    __device__ void read_x_scales(int tid) {
        if constexpr (kFP8) {
            const int kbs = lay.hidden / 128;
            const float* src = mine<float>(lay.x_sf);
            for (int i = tid; i < kbs * kWsMaxPairs; i += kMathThreads) {
                const int kb = i / kWsMaxPairs, t = i % kWsMaxPairs;
                x_sf[i] = t < p.num_tokens ? __ldcg(src + static_cast<int64_t>(t) * kbs + kb) : 0.0f;
            }
        }
    }

    // Before a CTA's first L2 weight load under kMegaMoEWsL2AfterL1: every L1 chunk's loads issued, but
    // for at most p.ws_l2_lead units each (bounded; the chunks are held by running CTAs, whose
    // producers never wait on L2)
    __device__ bool wait_l1_issued(const MegaMoEWsPlan& plan) {
        const uint32_t* issued = counts() + L::kWsCountL1Issued;
        const uint64_t start = globaltimer_ns();
        for (uint32_t n = 1; ld_acquire_gpu(issued) < static_cast<uint32_t>(plan.chunks1); ++n) {
            if ((n & kWsPollMask) == 0) {
                if (aborted()) return false;
                if (globaltimer_ns() - start > p.timeout_ns) {
                    report(p, StatusCode::kTimeout, Phase::kL2Wait, p.rank, n, true, &sh->ctrl);
                    return false;
                }
            }
        }
        return true;
    }

    // ------------------------------------------------------------------------------------------
    // Producer (one lane of warp 4): claim chunks, stream their units through the stages. The
    // weight tile of a unit (and for L1 x's K-block, for FP8 the tile's two block scales) lands on
    // the stage's full barrier; the stage's word says which unit it is.
    __device__ void producer(const CUtensorMap* tm_x, const CUtensorMap* tm_l1_w, const CUtensorMap* tm_l2_w, const MegaMoEWsPlan& plan,
                             int ticket) {
        auto* queue = counts() + L::kWsCountQueue;
        const int total = plan.chunks1 + plan.chunks2;
        const int rows1 = 2 * lay.intermediate_hidden;
        uint32_t it = 0;
        bool l2_cleared = not plan.l2_after_l1;
        const int lead = max_of(p.ws_l2_lead, 0);
        int logged = 0;   // stage log: bit 0 the first L1 chunk is logged, bit 1 the first L2 chunk
        while (ticket < total) {
            const bool l2 = ticket >= plan.chunks1;
            const int k = l2 ? ticket - plan.chunks1 : ticket;
            const int s_units = l2 ? plan.s2 : plan.s1;
            const int u_end = min_of(l2 ? plan.units2 : plan.units1, (k + 1) * s_units);
            if (l2 and not l2_cleared) {
                if (not wait_l1_issued(plan)) return;
                l2_cleared = true;
            }
            const bool stage_log = kWsStageLog and not (logged & (l2 ? 2 : 1));
            if constexpr (kWsStageLog) logged |= l2 ? 2 : 1;
            // the L1 chunk's unit after whose issue it counts as issued (kWsCountL1Issued): the last
            // one, or `lead` before it; -1: not counted (L2, or no L2-after-L1 gate). Every chunk has
            // a unit (MegaMoEWsPlan: chunks = ceil(units / s)), so each L1 chunk counts exactly once
            const int counted_at = not l2 and plan.l2_after_l1 ? max_of(k * s_units, u_end - 1 - lead) : -1;
            for (int u = k * s_units; u < u_end; ++u, ++it) {
                const int s = static_cast<int>(it % kNumStages);
                if (not wait_bar(empty + s, ((it / kNumStages) & 1) ^ 1)) return;
                const int pos = u - k * s_units;   // the unit's place in its chunk (stage log)
                if (stage_log and l2 and pos < kTraceKbSlots) trace(kTraceKbLastFree + pos);
                words[s] = (l2 ? kWsPhaseL2 : 0u) | static_cast<uint32_t>(u);
                int kb, row;
                const float* wsf;
                int block_stride;   // scale floats between the tile's two 128-row blocks
                if (not l2) {
                    kb = u % plan.kb1;
                    const int tile = u / plan.kb1, tl = tile % plan.tiles_per_expert;
                    const int e = sh->slot_expert[tile / plan.tiles_per_expert];
                    row = e * rows1 + tl * kWsTileRows;
                    block_stride = lay.hidden / 128;
                    wsf = p.l1_weight_scales + (static_cast<int64_t>(e) * (rows1 / 128) + 2 * tl) * block_stride + kb * BLOCK_K / 128;
                } else {
                    kb = u % plan.kb2;
                    const int r = u / plan.kb2, ct = r / sh->num_slots;
                    const int e = sh->slot_expert[r % sh->num_slots];
                    row = e * lay.hidden + ct * kWsTileRows;
                    block_stride = lay.intermediate_hidden / 128;
                    wsf = p.l2_weight_scales + (static_cast<int64_t>(e) * (lay.hidden / 128) + 2 * ct) * block_stride + kb * BLOCK_K / 128;
                }
                if constexpr (kFP8) {
                    cp_async_4(stage_wsf + kStageScaleFloats * s, wsf);
                    cp_async_4(stage_wsf + kStageScaleFloats * s + 1, wsf + block_stride);
                    cp_async_arrive_on(full + s);
                }
                mbarrier_arrive_expect_tx(full + s, kWsStageBytes + (l2 ? 0 : kWsActBytes));
                if constexpr (kFP4) {
                    // The tile's two 128-row blocks: their codes in one box of the pair map (two 8 KB
                    // blocks back to back), their deltas (512 bytes a block, [row blocks][K-blocks] in
                    // HBM) by two bulk copies after them
                    const int rb0 = row / 128, kbs = l2 ? plan.kb2 : plan.kb1;
                    const uint8_t* deltas = l2 ? p.l2_weight_deltas : p.l1_weight_deltas;
                    tma_load_4d(stages + s * kWsStageBytes, l2 ? tm_l2_w : tm_l1_w, full + s, 0, 0, kb, rb0);
                    #pragma unroll
                    for (int b = 0; b < 2; ++b)
                        bulk_load(stages + s * kWsStageBytes + kCodeBytes + b * kMegaMoEDeltaBlockBytes,
                                  deltas + (static_cast<int64_t>(rb0 + b) * kbs + kb) * kMegaMoEDeltaBlockBytes, kMegaMoEDeltaBlockBytes, full + s);
                } else {
                    tma_load_2d(stages + s * kWsStageBytes, l2 ? tm_l2_w : tm_l1_w, full + s, kb * BLOCK_K, row);
                }
                if (not l2) tma_load_2d(acts + s * kWsActBytes, tm_x, full + s, kb * BLOCK_K, 0);
                if (it == 0) trace(kWsTraceFirstIssue);
                if (stage_log and pos < kTraceKbSlots) trace((l2 ? kTraceKbLastIssue : kTraceKbIssue) + pos);
                if (u == counted_at) red_release_gpu_add(counts() + L::kWsCountL1Issued, 1);
            }
            // The next claim waits for a free stage: by then every resident CTA has drawn its first
            // ticket, so the first wave of chunks goes one to a CTA
            const int s = static_cast<int>(it % kNumStages);
            if (not wait_bar(empty + s, ((it / kNumStages) & 1) ^ 1)) return;
            ticket = static_cast<int>(atomicAdd(queue, 1u));
        }
        const int s = static_cast<int>(it % kNumStages);
        if (not wait_bar(empty + s, ((it / kNumStages) & 1) ^ 1)) return;
        words[s] = kWsEnd;
        mbarrier_arrive(full + s);
    }

    // ------------------------------------------------------------------------------------------
    // Math: a thread's kTiles 64-row M tiles of a stage's 256 rows, tile m its warpgroup's m-th
    // (M tile q(m) = wg + kMathWGs m: all four with one warpgroup; with two, warpgroup w takes w and
    // w + 2), 4 accumulators each: row 16 warp + lane / 4 + 8 (i / 2) of the M tile (warp: within the
    // warpgroup), column 2 (lane % 4) + i % 2 (a token in L1, a pair in L2)
    struct Thread {
        int tid, warp, lane, wg, r0, c0;
        __device__ explicit Thread(int t)
            : tid(t), warp(kMathWGs == 1 ? t / 32 : t / 32 % 4), lane(t % 32), wg(kMathWGs == 1 ? 0 : t / 128),
              r0(warp * 16 + (t % 32) / 4), c0((t % 4) * 2) {}
        __device__ int q(int m) const { return wg + kMathWGs * m; }
        __device__ int row(int i) const { return r0 + 8 * (i / 2); }
        __device__ int col(int i) const { return c0 + i % 2; }
    };
    using Acc = float[kTiles][4];

    // The thread's M tiles of a stage's weights times the N side's K-block. FP8 x FP4 (accumulate
    // false, `table` the expansion table's shared address): M tile q's A fragments expanded from the
    // stage's codes (rows 64 q + 16 warp + lane / 4 (+ 8)), then its wgmmas issued, which run while
    // the next tile's are expanded; the fragments stay live until the wait
    __device__ static void stage_mma(const uint8_t* w_tile, const uint8_t* n_tile, Acc& d, bool accumulate, const Thread& th, uint32_t table) {
        const uint64_t dn = mma::make_k_major_sw128_desc(n_tile);
        #pragma unroll
        for (int m = 0; m < kTiles; ++m) mma::fence_operands(d[m]);
        if constexpr (kFP4) {
            sm90_mega_moe::fp4::Fragments frag[kTiles];
            const uint32_t codes = smem_addr(w_tile), deltas = codes + kCodeBytes;
            #pragma unroll
            for (int m = 0; m < kTiles; ++m) {
                sm90_mega_moe::fp4::Rows r;
                sm90_mega_moe::fp4::load_rows(codes, deltas, 64 * th.q(m) + 16 * th.warp, th.lane, r, table);
                sm90_mega_moe::fp4::expand(r, frag[m], table);
                mma::warpgroup_arrive();
                mma::FP8MmaRegAN8::fma_k_block(frag[m], dn, d[m], false);
            }
            mma::warpgroup_commit();
            mma::warpgroup_wait<0>();
            #pragma unroll
            for (int m = 0; m < kTiles; ++m) mma::fence_fragments(frag[m]);
        } else {
            mma::warpgroup_arrive();
            #pragma unroll
            for (int m = 0; m < kTiles; ++m) Mma::fma_k_block(mma::make_k_major_sw128_desc(w_tile + th.q(m) * 64 * 128), dn, d[m], accumulate);
            mma::warpgroup_commit();
            mma::warpgroup_wait<0>();
        }
        #pragma unroll
        for (int m = 0; m < kTiles; ++m) mma::fence_operands(d[m]);
    }

    // After the math threads' stores of one part of a group of `parts`: its count (acquire and
    // release: the parts' stores before, the last part's loads after); whether this part is the
    // last, which resets the count for the next call
    __device__ bool count_part(uint32_t* count, int parts, const Thread& th) {
        named_barrier(kWsBarrierMath, kMathThreads);
        if (th.tid == 0) {
            const bool last = atom_acq_rel_gpu_add(count, 1) == static_cast<uint32_t>(parts - 1);
            if (last) *count = 0;
            *reinterpret_cast<volatile int*>(&sh->split_last) = last;
        }
        named_barrier(kWsBarrierMath, kMathThreads);
        return ld_volatile_shared_s32(smem_addr(&sh->split_last));
    }

    // The piece of a group (an L1 tile, a column tile of y) that chunk `k` ends: when the group has
    // more than one part, this part's partial sums go out and its count in; the last part sums every
    // part in part order into `acc` (the same bits whichever CTA is last) and returns true. The
    // group's parts are the chunks [first, first + parts); chunk k' keeps its part of a group in
    // slot base + 2 k' + (0 if the group is the chunk's first, else 1).
    __device__ bool exchange(int group, int group_units, int s_units, int k, int base, uint32_t* count, const Thread& th, Acc& acc) {
        const int first = (group * group_units) / s_units, parts = ((group + 1) * group_units - 1) / s_units - first + 1;
        if (parts == 1) return true;
        const auto slot = [&](int kk) { return base + 2 * kk + ((kk * s_units) / group_units == group ? 0 : 1); };
        const auto part_ptr = [&](int kk) {
            return reinterpret_cast<float4*>(mine<float>(lay.split_partials) + static_cast<int64_t>(slot(kk)) * L::kSplitPartialFloats) + th.tid * kTiles;
        };
        float4* own = part_ptr(k);
        #pragma unroll
        for (int m = 0; m < kTiles; ++m) __stcg(own + m, make_float4(acc[m][0], acc[m][1], acc[m][2], acc[m][3]));
        if (not count_part(count, parts, th)) return false;
        Acc own_v;
        #pragma unroll
        for (int m = 0; m < kTiles; ++m)
            #pragma unroll
            for (int i = 0; i < 4; ++i) own_v[m][i] = acc[m][i];
        // four parts' loads in flight at a time (one round trip each, not one a part), summed in part order
        for (int base_k = first; base_k < first + parts; base_k += 4) {
            float4 v[4][kTiles];
            #pragma unroll
            for (int b = 0; b < 4; ++b) {
                const int kk = base_k + b;
                if (kk < first + parts and kk != k) {
                    const float4* src = part_ptr(kk);
                    #pragma unroll
                    for (int m = 0; m < kTiles; ++m) v[b][m] = __ldcg(src + m);
                } else {
                    #pragma unroll
                    for (int m = 0; m < kTiles; ++m) v[b][m] = make_float4(own_v[m][0], own_v[m][1], own_v[m][2], own_v[m][3]);
                }
            }
            #pragma unroll
            for (int b = 0; b < 4; ++b) {
                if (base_k + b >= first + parts) break;
                #pragma unroll
                for (int m = 0; m < kTiles; ++m) {
                    const float f[4] = {v[b][m].x, v[b][m].y, v[b][m].z, v[b][m].w};
                    #pragma unroll
                    for (int i = 0; i < 4; ++i) acc[m][i] = base_k + b == first ? f[i] : acc[m][i] + f[i];
                }
            }
        }
        return true;
    }

    // A whole L2 chunk (column tile ct, slot j: every K-block) owns the columns of slot j's pairs: it
    // writes those (scalars: a float4 of the exchange rows spans two columns, maybe two chunks') into
    // the column tile's slot, counts; the last of the column tile's num_slots chunks reads every
    // column back (one round trip) into `acc`. Columns of no pair are never written (nor read after).
    __device__ bool exchange_columns(int ct, int j, uint32_t* count, const Thread& th, Acc& acc) {
        const int num_slots = sh->num_slots;
        if (num_slots == 1) return true;
        float* part = mine<float>(lay.split_partials) + static_cast<int64_t>(L::kWsL2PartialBase + ct) * L::kSplitPartialFloats + th.tid * 4 * kTiles;
        const bool m0 = sh->pair_slot[th.c0] == j, m1 = sh->pair_slot[th.c0 + 1] == j;
        #pragma unroll
        for (int m = 0; m < kTiles; ++m)
            #pragma unroll
            for (int i = 0; i < 4; ++i)
                if ((i & 1) ? m1 : m0) __stcg(part + 4 * m + i, acc[m][i]);
        if (not count_part(count, num_slots, th)) return false;
        float4 v[kTiles];
        #pragma unroll
        for (int m = 0; m < kTiles; ++m) v[m] = __ldcg(reinterpret_cast<const float4*>(part) + m);
        #pragma unroll
        for (int m = 0; m < kTiles; ++m) acc[m][0] = v[m].x, acc[m][1] = v[m].y, acc[m][2] = v[m].z, acc[m][3] = v[m].w;
        return true;
    }

    // L1 epilogue of tile `tile` (slot j's 256-row tile tl): SwiGLU (+clamp) per (row, token), then
    // for each pair c of slot j its token's 128 values x the pair's weight into row c of the L2 pool
    // (FP8: quantized per the block's amax, the persistent kernel's arithmetic), one count after
    __device__ void l1_epilogue(int tile, int tiles_per_expert, const Thread& th, const Acc& acc) {
        const int j = tile / tiles_per_expert, tl = tile % tiles_per_expert;
        const float clamp = p.activation_clamp;
        // gate's M tiles are 0 and 1, up's 2 and 3: the thread's first half of tiles gate, second up
        static_assert(kTiles % 2 == 0 and kMathWGs * (kTiles / 2) == 2, "a thread holds gate and up of the same rows");
        #pragma unroll
        for (int m = 0; m < kTiles / 2; ++m)
            #pragma unroll
            for (int i = 0; i < 4; ++i) {
                const float g = fminf(acc[m][i], clamp), u = fminf(fmaxf(acc[m + kTiles / 2][i], -clamp), clamp);
                xchg[th.col(i) * 128 + 64 * th.q(m) + th.row(i)] = sm90_mega_moe::silu<kFastMath>(g) * u;   // [token][128]
            }
        named_barrier(kWsBarrierMath, kMathThreads);
        auto* l2_act = mine<uint8_t>(lay.l2_act);
        #pragma unroll
        for (int c = th.tid / 32; c < kWsMaxPairs; c += kMathThreads / 32) {
            if (sh->pair_slot[c] != j) continue;   // warp-uniform
            const float w = sh->pair_weight[c];
            const float4 v = *reinterpret_cast<const float4*>(xchg + (c / lay.num_topk) * 128 + th.lane * 4);
            const int64_t col = static_cast<int64_t>(c) * lay.intermediate_hidden + tl * 128 + th.lane * 4;
            if constexpr (kFP8) {
                float amax = fmaxf(fmaxf(fabsf(v.x), fabsf(v.y)), fmaxf(fabsf(v.z), fabsf(v.w)));
                #pragma unroll
                for (int d = 1; d < 32; d *= 2) amax = fmaxf(amax, __shfl_xor_sync(0xffffffff, amax, d));
                // The amax is taken before the top-k weight, exactly as max |act x w| (rounding is monotonic)
                const float a = fmaxf(amax * fabsf(w), 1e-10f), inv = __fdiv_rn(448.0f, a);
                const auto q8 = [&](float x) {
                    return static_cast<uint32_t>(__nv_cvt_float_to_fp8((x * w) * inv, __NV_SATFINITE, __NV_E4M3));
                };
                *reinterpret_cast<uint32_t*>(l2_act + col) = q8(v.x) | (q8(v.y) << 8) | (q8(v.z) << 16) | (q8(v.w) << 24);
                if (th.lane == 0) mine<float>(lay.l2_sf)[static_cast<int64_t>(tl) * lay.num_pool_rows + c] = __fdiv_rn(a, 448.0f);
            } else {
                const __nv_bfloat162 lo = __floats2bfloat162_rn(v.x * w, v.y * w), hi = __floats2bfloat162_rn(v.z * w, v.w * w);
                uint2 packed;
                packed.x = *reinterpret_cast<const uint32_t*>(&lo), packed.y = *reinterpret_cast<const uint32_t*>(&hi);
                *reinterpret_cast<uint2*>(l2_act + col * 2) = packed;
            }
        }
        // The rows are read by TMA (async proxy) in other CTAs after the count's release
        fence_proxy_async_global();
        named_barrier(kWsBarrierMath, kMathThreads);
        if (th.tid == 0) red_release_gpu_add(slot_done(j), 1);
    }

    // Column tile ct of y from the pairs' sums: per token, its pairs' columns added in pair order
    // (top-k slot order), each rounded to BF16 first: the persistent kernel's combine, bit for bit
    // in the sum's order
    __device__ void y_epilogue(int ct, const Thread& th, const Acc& acc) {
        #pragma unroll
        for (int m = 0; m < kTiles; ++m)
            #pragma unroll
            for (int i = 0; i < 4; ++i) xchg[th.col(i) * kWsTileRows + 64 * th.q(m) + th.row(i)] = acc[m][i];   // [pair][256]
        named_barrier(kWsBarrierMath, kMathThreads);
        auto* y = reinterpret_cast<__nv_bfloat16*>(p.y);
        for (int idx = th.tid; idx < p.num_tokens * (kWsTileRows / 2); idx += kMathThreads) {
            const int t = idx / (kWsTileRows / 2), cc = (idx % (kWsTileRows / 2)) * 2;
            float s0 = 0.0f, s1 = 0.0f;
            #pragma unroll
            for (int c = 0; c < kWsMaxPairs; ++c) {
                if (sh->pair_slot[c] >= 0 and c / lay.num_topk == t) {
                    // each pair's row rounded to BF16 first, as the persistent kernel's combine rows are
                    const float2 v = __bfloat1622float2(__float22bfloat162_rn(*reinterpret_cast<const float2*>(xchg + c * kWsTileRows + cc)));
                    s0 += v.x, s1 += v.y;
                }
            }
            *reinterpret_cast<__nv_bfloat162*>(y + static_cast<int64_t>(t) * lay.hidden + ct * kWsTileRows + cc) = __floats2bfloat162_rn(s0, s1);
        }
        named_barrier(kWsBarrierMath, kMathThreads);   // xchg is free again
    }

    // Before an L2 unit of slot j when the pairs' rows in shared memory are not yet slot j's: slot j's
    // L1 tiles done (bounded), then the pairs' rows (TMA, every K-block; rows of other slots' pairs
    // may be mid-write: their columns are never selected) and, FP8, their scales. h_phase: the
    // loads of h_tile before this one (> 0: rows loaded for another slot, which every warp's wgmma
    // must be done with first; its parity is the h_bar phase this load completes).
    __device__ bool wait_l1_and_load_h(const CUtensorMap* tm_h, const MegaMoEWsPlan& plan, int j, uint32_t h_phase, const Thread& th) {
        if (h_phase > 0) named_barrier(kWsBarrierMath, kMathThreads);
        if (th.tid == 0) {
            const uint32_t* done = slot_done(j);
            const uint64_t start = globaltimer_ns();
            bool ok = true;
            for (uint32_t n = 1; ld_acquire_gpu(done) < static_cast<uint32_t>(plan.tiles_per_expert); ++n) {
                if ((n & kWsPollMask) == 0) {
                    if (aborted()) { ok = false; break; }
                    if (globaltimer_ns() - start > p.timeout_ns) {
                        report(p, StatusCode::kTimeout, Phase::kL2Wait, p.rank, n, true, &sh->ctrl);
                        ok = false;
                        break;
                    }
                }
            }
            if (ok) {
                mbarrier_arrive_expect_tx(h_bar, plan.kb2 * kWsActBytes);
                for (int kb = 0; kb < plan.kb2; ++kb) tma_load_2d(h_tile + kb * kWsActBytes, tm_h, h_bar, kb * BLOCK_K, 0);
            }
            *reinterpret_cast<volatile int*>(&sh->wait_ok) = ok;
            trace(kWsTraceL1Waited);
        }
        named_barrier(kWsBarrierMath, kMathThreads);
        if (not ld_volatile_shared_s32(smem_addr(&sh->wait_ok))) {
            *reinterpret_cast<volatile int*>(&sh->ctrl.abort) = 1;
            return false;
        }
        if constexpr (kFP8) {
            const float* src = mine<float>(lay.l2_sf);
            for (int i = th.tid; i < plan.kb2 * kWsMaxPairs; i += kMathThreads)
                h_sf[i] = __ldcg(src + static_cast<int64_t>(i / kWsMaxPairs) * lay.num_pool_rows + i % kWsMaxPairs);
        }
        named_barrier(kWsBarrierMath, kMathThreads);
        const bool loaded = wait_bar(h_bar, h_phase & 1);
        if (th.tid == 0) trace(kWsTraceHLoaded);
        return loaded;
    }

    __device__ void math(const CUtensorMap* tm_h, const MegaMoEWsPlan& plan) {
        const Thread th(static_cast<int>(threadIdx.x));
        Acc acc;
        const uint32_t table = kFP4 ? smem_addr(fp4_table) : 0u;
        int h_slot = -1;        // whose pairs' rows h_tile holds
        uint32_t h_phase = 0;   // loads of h_tile so far
        int log_chunk1 = -1, log_chunk2 = -1;   // stage log: the first L1 / L2 chunk this CTA's math saw
        for (uint32_t it = 0;; ++it) {
            const int s = static_cast<int>(it % kNumStages);
            if (not wait_bar(full + s, (it / kNumStages) & 1)) return;
            const uint32_t word = words[s];
            if (word & kWsEnd) return;
            if (it == 0 and th.tid == 0) trace(kWsTraceFirstStage);
            const int u = static_cast<int>(word & (kWsPhaseL2 - 1));
            const float ws0 = kFP8 ? stage_wsf[kStageScaleFloats * s] : 1.0f, ws1 = kFP8 ? stage_wsf[kStageScaleFloats * s + 1] : 1.0f;
            // Stage log: this unit's place in its chunk, if the chunk is the CTA's first of its phase (else -1)
            int log_pos = -1;
            if constexpr (kWsStageLog) {
                const bool l2 = (word & kWsPhaseL2) != 0;
                const int su = l2 ? plan.s2 : plan.s1, chunk = u / su;
                if (l2 and log_chunk2 < 0) log_chunk2 = chunk;
                if (not l2 and log_chunk1 < 0) log_chunk1 = chunk;
                const int first = l2 ? log_chunk2 : log_chunk1;
                if (chunk == first and u - chunk * su < kTraceKbSlots) log_pos = u - chunk * su;
                if (log_pos >= 0 and th.tid == 0) trace((l2 ? kTraceKbLastReady : kTraceKbReady) + log_pos);
            }
            if (not (word & kWsPhaseL2)) {
                const int kb = u % plan.kb1, tile = u / plan.kb1;
                const bool first = kb == 0 or u % plan.s1 == 0;
                if (first) {
                    #pragma unroll
                    for (int m = 0; m < kTiles; ++m)
                        #pragma unroll
                        for (int i = 0; i < 4; ++i) acc[m][i] = 0.0f;
                }
                if constexpr (kFP8) {
                    Acc part;
                    stage_mma(stages + s * kWsStageBytes, acts + s * kWsActBytes, part, false, th, table);
                    const float xs0 = x_sf[kb * kWsMaxPairs + th.c0], xs1 = x_sf[kb * kWsMaxPairs + th.c0 + 1];
                    #pragma unroll
                    for (int m = 0; m < kTiles; ++m) {
                        const float sw = th.q(m) < 2 ? ws0 : ws1;   // the tile's 128-row block's scale
                        #pragma unroll
                        for (int i = 0; i < 4; ++i) acc[m][i] += part[m][i] * ((i & 1) ? xs1 * sw : xs0 * sw);
                    }
                } else {
                    stage_mma(stages + s * kWsStageBytes, acts + s * kWsActBytes, acc, not first, th, table);
                }
                if (th.lane == 0) mbarrier_arrive(empty + s);
                if (th.tid == 0) trace(kWsTraceL1Consumed);
                const bool last = (u + 1) % plan.kb1 == 0 or (u + 1) % plan.s1 == 0 or u + 1 == plan.units1;
                if (last and exchange(tile, plan.kb1, plan.s1, u / plan.s1, 0, counts() + L::kWsCountL1Tiles + tile, th, acc)) {
                    l1_epilogue(tile, plan.tiles_per_expert, th, acc);
                    if (th.tid == 0) trace(kWsTraceL1Epilogue);
                }
            } else {
                const int kb = u % plan.kb2, r = u / plan.kb2, j = r % sh->num_slots, ct = r / sh->num_slots;
                if (h_slot != j) {
                    if (not wait_l1_and_load_h(tm_h, plan, j, h_phase++, th)) return;
                    h_slot = j;
                }
                if (u % plan.per_column == 0 or u % plan.s2 == 0) {
                    #pragma unroll
                    for (int m = 0; m < kTiles; ++m)
                        #pragma unroll
                        for (int i = 0; i < 4; ++i) acc[m][i] = 0.0f;
                }
                Acc part;
                stage_mma(stages + s * kWsStageBytes, h_tile + kb * kWsActBytes, part, false, th, table);
                if (th.lane == 0) mbarrier_arrive(empty + s);
                if (th.tid == 0) trace(kWsTraceL2Consumed);
                if (kWsStageLog and log_pos >= 0 and th.tid == 0) trace(kTraceKbLastRelease + log_pos);
                // Column c of the product counts only where pair c belongs to this unit's expert (the
                // other columns hold other experts' pairs, or rows no pair wrote: a select, never a multiply)
                const bool m0 = sh->pair_slot[th.c0] == j, m1 = sh->pair_slot[th.c0 + 1] == j;
                const float hs0 = kFP8 ? h_sf[kb * kWsMaxPairs + th.c0] : 1.0f, hs1 = kFP8 ? h_sf[kb * kWsMaxPairs + th.c0 + 1] : 1.0f;
                #pragma unroll
                for (int m = 0; m < kTiles; ++m) {
                    const float sw = th.q(m) < 2 ? ws0 : ws1;
                    #pragma unroll
                    for (int i = 0; i < 4; ++i) {
                        const float v = kFP8 ? part[m][i] * ((i & 1) ? hs1 * sw : hs0 * sw) : part[m][i];
                        acc[m][i] += ((i & 1) ? m1 : m0) ? v : 0.0f;
                    }
                }
                const bool last = (u + 1) % plan.per_column == 0 or (u + 1) % plan.s2 == 0 or u + 1 == plan.units2;
                uint32_t* count = counts() + L::kWsCountColumns + ct;
                if (last and (plan.whole2 ? exchange_columns(ct, j, count, th, acc)
                                          : exchange(ct, plan.per_column, plan.s2, u / plan.s2, L::kWsL2PartialBase, count, th, acc))) {
                    y_epilogue(ct, th, acc);
                    if (th.tid == 0) trace(kWsTraceYWritten);
                }
            }
        }
    }

    // A call whose every pair is masked has no units: y is zero
    __device__ void zero_y(int tid) {
        const int64_t chunks = static_cast<int64_t>(p.num_tokens) * lay.hidden / 8;
        for (int64_t i = blockIdx.x * static_cast<int64_t>(kMathThreads) + tid; i < chunks; i += static_cast<int64_t>(gridDim.x) * kMathThreads)
            reinterpret_cast<int4*>(p.y)[i] = make_int4(0, 0, 0, 0);
    }

    // ------------------------------------------------------------------------------------------
    __device__ void run(const CUtensorMap* tm_x, const CUtensorMap* tm_h, const CUtensorMap* tm_l1_w, const CUtensorMap* tm_l2_w) {
        const int warp = warp_idx();
        auto* control = mine<uint32_t>(lay.control);
        if (threadIdx.x == 0) {
            for (int s = 0; s < kNumStages; ++s) mbarrier_init(full + s, 1), mbarrier_init(empty + s, kMathThreads / 32);   // a lane of each math warp
            mbarrier_init(h_bar, 1);
            fence_barrier_init();
            sh->ctrl.abort = 0;
        }
        if constexpr (kFP4) sm90_mega_moe::fp4::fill_table(fp4_table, static_cast<int>(threadIdx.x), kThreads);   // read after __syncthreads
        if (warp == kProducerWarp and lane_idx() == 0) {
            prefetch_tma_descriptor(tm_x), prefetch_tma_descriptor(tm_h);
            prefetch_tma_descriptor(tm_l1_w), prefetch_tma_descriptor(tm_l2_w);
        }
        // Launched as a programmatic dependent: every global access waits for the kernel before
        griddepcontrol_wait();
        if (threadIdx.x == kMathThreads) trace(kWsTraceStart);
        int ticket = 0;
        if (warp == kProducerWarp) {
            if (lane_idx() == 0) ticket = static_cast<int>(atomicAdd(counts() + L::kWsCountQueue, 1u)), epoch = control[L::kControlEpoch] + 1;
            read_routing();
        } else {
            read_x_scales(static_cast<int>(threadIdx.x));
        }
        __syncthreads();
        if (threadIdx.x == kMathThreads) trace(kWsTraceRouting);
        const MegaMoEWsPlan plan(lay.mma_type, lay.hidden, lay.intermediate_hidden, sh->num_slots, static_cast<int>(gridDim.x), p.ws_plan);
        if (warp == kProducerWarp) {
            if (lane_idx() == 0) {
                if (ticket == 0) {   // one CTA: the statistics and the bad-id flag
                    if (p.cumulative_local_expert_recv_stats != nullptr)
                        for (int c = 0; c < kWsMaxPairs; ++c)
                            if (sh->pair_slot[c] >= 0) atomicAdd(p.cumulative_local_expert_recv_stats + sh->slot_expert[sh->pair_slot[c]], 1);
                    if (sh->bad_token >= 0) report(p, StatusCode::kBadExpertId, Phase::kCount, p.rank, sh->bad_token, false, &sh->ctrl);
                }
                producer(tm_x, tm_l1_w, tm_l2_w, plan, ticket);
            }
            __syncwarp();
        } else {
            if (sh->num_slots == 0) zero_y(static_cast<int>(threadIdx.x));
            math(tm_h, plan);
        }

        // Leave; the last CTA out resets the call's counters and advances the epoch
        __syncthreads();
        if (threadIdx.x == kMathThreads) {
            trace(kWsTraceExit);
            __threadfence();
            const uint32_t exited = atom_acq_rel_gpu_add(counts() + L::kWsCountExited, 1);
            if (exited == gridDim.x - 1 and ld_volatile(mine<uint64_t>(lay.status) + L::kStatusAbort) == 0) {
                for (int j = 0; j < sh->num_slots; ++j) *slot_done(j) = 0;
                counts()[L::kWsCountQueue] = 0;
                counts()[L::kWsCountL1Issued] = 0;
                counts()[L::kWsCountExited] = 0;
                control[L::kControlEpoch] = epoch;
            }
        }
    }
};

}  // namespace deep_gemm::sm90_mega_moe_ws

// The JIT runtime instantiates this with the variant chosen by the launcher
#define DG_DEFINE_SM90_MEGA_MOE_WS_KERNEL(NAME, MMA_TYPE, NUM_STAGES, FAST_MATH)                                      \
    extern "C" __global__ void __launch_bounds__(deep_gemm::mega_moe_ws_threads(MMA_TYPE), 1)                           \
    NAME(const __grid_constant__ deep_gemm::MegaMoEParams params, const __grid_constant__ CUtensorMap tm_x,           \
         const __grid_constant__ CUtensorMap tm_h, const __grid_constant__ CUtensorMap tm_l1_w,                       \
         const __grid_constant__ CUtensorMap tm_l2_w) {                                                                \
        extern __shared__ __align__(1024) uint8_t dg_smem[];                                                          \
        auto* base = reinterpret_cast<uint8_t*>(deep_gemm::align_up<uintptr_t>(reinterpret_cast<uintptr_t>(dg_smem), 1024)); \
        deep_gemm::sm90_mega_moe_ws::WsKernel<MMA_TYPE, NUM_STAGES, FAST_MATH> kernel(params, base);                   \
        kernel.run(&tm_x, &tm_h, &tm_l1_w, &tm_l2_w);                                                                  \
    }
