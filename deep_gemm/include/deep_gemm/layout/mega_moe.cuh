#pragma once

// The symmetric buffer of one Mega MoE rank. This is the only place its layout is written down:
// the host sizes the allocation and makes the Python views from `MegaMoELayout`, and the kernel
// receives the same struct by value, so host and device cannot disagree on an offset.
//
//   [workspace | inputs | L1 pool | L2 pool | combine slots]
//
// workspace   status words, control counters, per-(local expert, source rank) receive counts and
//             source-index lists (written by peers), this rank's per-expert send counts (a
//             prefill count's CTAs reserve slots there), per-M-block arrival / L1-done counters,
//             per-pool-row routing info (source rank, token, top-k slot) and top-k weight, and the
//             split-K L1 exchange of decode calls (per L1 tile: a counter and both K halves' partial
//             sums), and the weights-first kernel's counters (it shares the split-K partials)
// inputs      x [N, H], x_sf [N, H/128] (FP8 formats), topk_idx [N, K] int64, topk_weights [N, K] f32
// L1 pool     tokens pulled from every source rank, grouped by local expert, each expert padded to
//             a multiple of BLOCK_M rows: act [rows, H], scales [H/128][rows] (M-major so that an
//             M-block's scales for one K-block are contiguous)
// L2 pool     L1 output after SwiGLU: act [rows, I], scales [I/128][rows]
// combine     BF16 [K][N][H]: L2 output rows written back by the expert owners, summed into y
//
// Pool rows bound (T = tokens a rank can receive, E = local experts):
//   T    = R * N * min(K, E)                       (a token sends each local expert at most one row)
//   rows = align(T + min(E, T) * (kMaxBlockM - 1), kMaxBlockM)
// so pools grow with tokens x top-k, never with experts x tokens.

#include "../common/types.cuh"

namespace deep_gemm::layout {

// Block sizes the pools are padded for: any BLOCK_M in [kMinBlockM, kMaxBlockM] that divides
// kMaxBlockM fits the same buffer, so the heuristics may change BLOCK_M per call.
constexpr int kMinBlockM = 64;
constexpr int kMaxBlockM = 128;
// Every section starts on this boundary (TMA wants 16 B, 128B-swizzled tiles want 1024 B)
constexpr int64_t kSectionAlignment = 1024;
constexpr int kNumStatusWords = 8;
constexpr int kNumControlWords = 16;
// Split-K L1 tiles (decode calls whose L1 tiles are all narrow): at most kMaxSplitTiles tiles
// (one counter each) and kMaxSplitParts K parts per call, each part kSplitPartialFloats FP32
// partial sums (the math warpgroups' 256 threads x 8 accumulators)
constexpr int kMaxSplitTiles = 128;
constexpr int kMaxSplitParts = 576;
constexpr int kSplitPartialFloats = 256 * 8;
// The weights-first kernel (impls/sm90_mega_moe_ws.cuh): each phase (L1, L2) runs in at most
// kMaxWsChunks chunks of units; split chunks keep at most two partial sums each in split_partials
// (L1 in slots [0, 2 kMaxWsChunks), L2 after them), whole L2 chunks their columns in one slot per
// column tile of y (L2's first kMaxWsChunks slots). Its counters, in the ws_count section: one per L1
// tile, one per 256-wide column tile of y, and on lines of their own (polled or claimed by every
// CTA) the chunk queue, the CTAs that left, the L1 chunks fully issued and per routed expert (slot)
// its L1 tiles done
constexpr int kMaxWsChunks = 144;
constexpr int kWsL2PartialBase = 2 * kMaxWsChunks;   // L2's first split_partials slot
constexpr int kWsCountSlots = 8;                     // routed experts (slots) of a call: kMegaMoEWsMaxPairs
constexpr int kWsCountLineWords = 32;
constexpr int kWsCountL1Tiles = 0;
constexpr int kWsCountColumns = kWsCountL1Tiles + kMaxSplitTiles;
constexpr int kWsCountQueue = (kWsCountColumns + kMaxWsChunks + kWsCountLineWords - 1) / kWsCountLineWords * kWsCountLineWords;
constexpr int kWsCountExited = kWsCountQueue + kWsCountLineWords;
constexpr int kWsCountL1Issued = kWsCountExited + kWsCountLineWords;   // L1 chunks whose every load is issued
constexpr int kWsCountSlotDone = kWsCountL1Issued + kWsCountLineWords;  // + kWsCountLineWords x slot
constexpr int kWsCountWords = 1024;
static_assert(kWsCountSlotDone + kWsCountSlots * kWsCountLineWords <= kWsCountWords and 2 * kWsL2PartialBase <= kMaxSplitParts,
              "the weights-first kernel's workspace");

// Control word slots (uint32, local to a rank)
constexpr int kControlEpoch = 0;          // number of calls completed on this buffer
constexpr int kControlTaskQueue = 1;      // next task index of the dynamic scheduler
constexpr int kControlExitedCtas = 2;     // CTAs that left the current call
constexpr int kControlL2TasksDone = 3;    // L2 tasks finished in the current call
constexpr int kControlCountClaim = 4;     // count tickets: ticket 0 counts this rank's tokens, or each ticket a slice of them
constexpr int kControlNumMBlocks = 5;     // M-blocks of the current call (for the end-of-call reset)
constexpr int kControlCountDone = 6;      // count slices finished (a count of several slices: the last one publishes)

// Status words: the first error of a call (0 = ok) and whether it was fatal (the call stopped
// working and the workspace needs `reset()`); encoding in `deep_gemm/impls/mega_moe_params.cuh`.
constexpr int kStatusError = 0;
constexpr int kStatusAbort = 1;

struct Section {
    int64_t offset;
    int64_t num_bytes;
};

struct MegaMoELayout {
    // Shape
    int num_ranks, num_experts, num_local_experts, num_max_tokens_per_rank, num_topk;
    int hidden, intermediate_hidden;
    MmaType mma_type;
    int num_pool_rows, num_max_mblocks;

    // Workspace
    Section status, control, recv_count, combine_ready, send_count, src_index, mblock_arrival, mblock_l1_done;
    Section row_info, row_weight, split_count, split_partials, ws_count;
    // Inputs
    Section x, x_sf, topk_idx, topk_weights;
    // Pools
    Section l1_act, l1_sf, l2_act, l2_sf;
    // Combine
    Section combine;
    int64_t num_workspace_bytes, num_bytes;

    DG_HOST_DEVICE static int64_t pool_rows(int num_ranks, int num_local_experts, int num_max_tokens_per_rank, int num_topk) {
        const int64_t t = static_cast<int64_t>(num_ranks) * num_max_tokens_per_rank * min_of(num_topk, num_local_experts);
        return align_up<int64_t>(t + min_of<int64_t>(num_local_experts, t) * (kMaxBlockM - 1), kMaxBlockM);
    }

    MegaMoELayout() = default;

    // Preconditions (checked by the host before constructing): every count positive,
    // num_experts % num_ranks == 0, hidden and intermediate_hidden multiples of 128.
    DG_HOST_DEVICE MegaMoELayout(int num_ranks, int num_experts, int num_max_tokens_per_rank, int num_topk,
                                 int hidden, int intermediate_hidden, MmaType mma_type)
        : num_ranks(num_ranks), num_experts(num_experts), num_local_experts(num_experts / num_ranks),
          num_max_tokens_per_rank(num_max_tokens_per_rank), num_topk(num_topk),
          hidden(hidden), intermediate_hidden(intermediate_hidden), mma_type(mma_type) {
        const int64_t rows = pool_rows(num_ranks, num_local_experts, num_max_tokens_per_rank, num_topk);
        num_pool_rows = static_cast<int>(rows);
        num_max_mblocks = static_cast<int>(rows / kMinBlockM);

        const int64_t n = num_max_tokens_per_rank, h = hidden, i = intermediate_hidden;
        const int64_t act = activation_bytes(mma_type);
        const bool fp8 = is_fp8_activation(mma_type);
        int64_t cursor = 0;
        auto take = [&](int64_t num_bytes) {
            Section s{cursor, num_bytes};
            cursor = align_up<int64_t>(cursor + num_bytes, kSectionAlignment);
            return s;
        };
        status = take(kNumStatusWords * 8);
        control = take(kNumControlWords * 4);
        recv_count = take(static_cast<int64_t>(num_local_experts) * num_ranks * 8);
        combine_ready = take(static_cast<int64_t>(num_ranks) * 8);
        send_count = take(static_cast<int64_t>(num_experts) * 4);
        src_index = take(static_cast<int64_t>(num_local_experts) * num_ranks * n * 4);
        mblock_arrival = take(static_cast<int64_t>(num_max_mblocks) * 4);
        mblock_l1_done = take(static_cast<int64_t>(num_max_mblocks) * 4);
        row_info = take(rows * 4);
        row_weight = take(rows * 4);
        split_count = take(kMaxSplitTiles * 4);
        split_partials = take(static_cast<int64_t>(kMaxSplitParts) * kSplitPartialFloats * 4);
        ws_count = take(kWsCountWords * 4);
        num_workspace_bytes = cursor;

        x = take(n * h * act);
        x_sf = take(fp8 ? n * (h / kScaleGranularity) * 4 : 0);
        topk_idx = take(n * num_topk * 8);
        topk_weights = take(n * num_topk * 4);

        l1_act = take(rows * h * act);
        l1_sf = take(fp8 ? rows * (h / kScaleGranularity) * 4 : 0);
        l2_act = take(rows * i * act);
        l2_sf = take(fp8 ? rows * (i / kScaleGranularity) * 4 : 0);

        combine = take(static_cast<int64_t>(num_topk) * n * h * 2);
        num_bytes = cursor;
    }

    template <typename T>
    DG_HOST_DEVICE T* get_ptr(void* base, const Section& s) const {
        return reinterpret_cast<T*>(static_cast<char*>(base) + s.offset);
    }
};

}  // namespace deep_gemm::layout
