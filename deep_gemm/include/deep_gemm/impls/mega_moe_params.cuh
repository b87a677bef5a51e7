#pragma once

// Runtime arguments of the Mega MoE kernel and its shared-memory budget: included by the host
// launcher (csrc/jit_kernels/impls/sm90_fp8_mega_moe.hpp), the heuristics and the kernel, so the
// struct and the byte counts are defined once.

#include "../common/types.cuh"
#include "../layout/mega_moe.cuh"

namespace deep_gemm {

// ---------------------------------------------------------------------------------------------
// Status word (workspace status[kStatusError]): the first error of a call, 0 = ok.
//   bits  0..7   code        bits 8..15  phase       bits 16..23 rank (the peer waited on, or own)
//   bits 24..39  CTA index   bits 40..63 detail (token index, count, ...)
enum class StatusCode : uint32_t {
    kOk = 0, kTimeout = 1, kBadExpertId = 2, kBadCount = 3, kDuplicateExpert = 4,
    kEpochMismatch = 5,   // a peer is two or more calls ahead: ranks were reset (or called) unevenly
};
enum class Phase : uint32_t {
    kNone = 0, kRecvCounts = 1, kPull = 2, kL1Wait = 3, kL2Wait = 4, kCombineWait = 5, kPipeline = 6, kCount = 7
};

DG_HOST_DEVICE constexpr uint64_t make_status(StatusCode code, Phase phase, uint32_t rank, uint32_t cta, uint64_t detail) {
    return static_cast<uint64_t>(code) | (static_cast<uint64_t>(phase) << 8) | (static_cast<uint64_t>(rank & 0xff) << 16) |
           (static_cast<uint64_t>(cta & 0xffff) << 24) | ((detail & 0xffffff) << 40);
}

// ---------------------------------------------------------------------------------------------
// Kernel shape constants shared by host and device
constexpr int kMegaMoEBlockNL1 = 256;        // 128 gate + 128 up rows (interleaved by the transform)
constexpr int kMegaMoEBlockNL2 = 128;        // L2 tile; an L2 task is one tile or two (kernel variant kL2BlockN)
constexpr int kMegaMoEMaxLocalExperts = 512; // scheduler tables in shared memory
constexpr int kMegaMoETaskRing = 4;          // scheduler -> roles task ring depth (decode kernels)
// The ring's depth by kernel: every role reads every ticket, so the producer runs at most this many
// tickets ahead of the slowest reader. In prefill that is the dispatch warps, each of whose pulls
// (a 128-row M-block, ~60 us) holds its ring position, so with 4 slots the math ran out of tickets
// behind a CTA's first pulls (gaps of ~60 us between its first L1 tasks: docs/PERF.md, session 36);
// 32 slots cover the L1 tasks of a CTA's pulls. Decode pulls take a few us: 4 (and 80 bytes of
// shared memory for its deeper pipelines).
DG_HOST_DEVICE constexpr int mega_moe_task_ring(int block_m) { return block_m == 128 ? 32 : kMegaMoETaskRing; }
// Narrow decode tiles: M-blocks of a BLOCK_M = 64 kernel with at most this many tokens; their A
// tiles are loaded as boxes of this many rows (the host builds a second activation tensor map)
constexpr int kMegaMoENarrowRows = 8;
// Kernels that have narrow tiles (BLOCK_M = 64: the split-column decode configuration); only they
// read the 8-row activation tensor maps, so the host builds those only for them
DG_HOST_DEVICE constexpr bool mega_moe_has_narrow_tiles(int block_m) { return block_m == 64; }
// Two math warpgroups at every BLOCK_M: 128 rows -> 64 rows each; 64 rows -> split columns
constexpr int kMegaMoENumMathWarpgroups = 2;
constexpr int kMegaMoEEpilogueRowBytes = kMegaMoEBlockNL2 * 2 + 16;  // BF16 row + 16 B pad (bank spread)

DG_HOST_DEVICE constexpr int mega_moe_block_k(MmaType t) { return 128 / activation_bytes(t); }
// L2 task width, a kernel variant (template argument kL2BlockN, heuristics: block_n_l2): one 128-wide
// tile, or 256 / 512 wide for decode tiles (BLOCK_M = 64: a narrow M-block's task is one or two
// 256-wide tiles, a wide one's two or four 128-wide tiles), or 256 wide for FP8 x FP8 and BF16 prefill
// tiles (BLOCK_M = 128: one K loop over a 256-row B tile, as L1's gate and up; FP8 x FP4's, with the
// tile expanded as L1's, measured 1.4-2.1 % slower: docs/PERF.md, session 40)
DG_HOST_DEVICE constexpr bool mega_moe_l2_block_n_ok(MmaType t, int block_m, int block_n_l2) {
    return block_n_l2 == kMegaMoEBlockNL2 or
           ((block_n_l2 == 2 * kMegaMoEBlockNL2 or block_n_l2 == 4 * kMegaMoEBlockNL2) and block_m == 64) or
           (block_n_l2 == 2 * kMegaMoEBlockNL2 and block_m == 128 and t != MmaType::kFP8xFP4);
}
// FP8 x FP4 decode kernels (BLOCK_M = 64) run M-blocks of more than 8 tokens as transposed wide tiles
// of N = 16, 32 or 64 (the M-block's tokens rounded up); which N a kernel carries is a variant
// (template argument kWideNMin, heuristics: wide_n_min): 64 (N = 64 only: the kernel for calls of a
// few tokens per expert, whose narrow loops the smaller tiles' code slowed by 1 %), 32 or 16 (N from
// 16 or 32 up to 64). Every other kernel: 64 (it runs no transposed tiles).
DG_HOST_DEVICE constexpr bool mega_moe_wide_n_ok(MmaType t, int block_m, int wide_n_min) {
    return wide_n_min == 64 or ((wide_n_min == 16 or wide_n_min == 32) and t == MmaType::kFP8xFP4 and block_m == 64);
}
// FP8 x FP4: a stage holds the packed E2M1 B tile (256 rows x 64 bytes per 128-wide K-block); the
// math warpgroups expand it into registers (decode: wgmma A fragments) or, at prefill, into an E4M3
// tile outside the stages (mega_moe_expanded_b_tiles), so a stage is 16 KB smaller than with FP8 weights
constexpr int kMegaMoEPackedRowBytes = 64;
// FP4 packed codes of one row and 128-wide K-block (transform_weights_for_mega_moe): the 64 bytes are
// permuted so that the codes of one thread's wgmma A fragments (K step ks = 0..3, quad lane
// q = lane % 4: K 32 ks + 4 q + [0, 4) and the same + 16) are one aligned 16-byte chunk, chunk q.
// Byte 16 ks + 8 hi + 2 q + b of the row's K-block (K elements 32 ks + 16 hi + 4 q + 2 b, + 1 in
// the low, high nibble) is stored at byte 16 q + 4 ks + 2 hi + b: 32-bit word ks of chunk q holds
// K 32 ks + 4 q + [0, 4) in its low 16 bits and K 32 ks + 16 + 4 q + [0, 4) in its high 16 bits.
constexpr int kMegaMoEFP4ChunkBytes = 16;
DG_HOST_DEVICE constexpr int mega_moe_fp4_packed_byte(int k_byte) {
    const int ks = k_byte / 16, hi = k_byte / 8 % 2, q = k_byte / 2 % 4, b = k_byte % 2;
    return kMegaMoEFP4ChunkBytes * q + 4 * ks + 2 * hi + b;
}
// Within each 32-bit word the transform also moves the signs (bit 3 of each code) to where the
// expansion needs them: nibble n keeps the magnitude (bits 0-2) of the code it held (n < 4: element
// n of K [0, 4) of the word's fragment pair, n >= 4: element n - 4 of K [16, 20)), and bit 3 of
// nibble n holds a sign: nibble 2 j + 1 that of element j of K [0, 4) (word bit 8 j + 7, the sign
// bit of the E4M3 byte it becomes), nibble 2 j that of element j of K [16, 20) (bit 8 j + 3, four
// below its E4M3 byte's sign bit). The word bit of the sign of element j of half `hi`:
DG_HOST_DEVICE constexpr int mega_moe_fp4_sign_bit(int hi, int j) { return 8 * j + (hi ? 3 : 7); }
DG_HOST_DEVICE constexpr int mega_moe_stage_b_bytes(MmaType t) {
    return t == MmaType::kFP8xFP4 ? kMegaMoEBlockNL1 * kMegaMoEPackedRowBytes : kMegaMoEBlockNL1 * 128;
}
// Expanded tiles: prefill (BLOCK_M = 128) keeps two, so that the expansion of K-block kb + 1 runs
// while the wgmma of K-block kb reads the other (the math warpgroups are not serialized on it);
// decode keeps one, which no K-loop reads (its narrow and transposed wide tiles expand into
// registers): it stages a transposed wide tile's L2 rows with the epilogue tile after it
DG_HOST_DEVICE constexpr int mega_moe_expanded_b_tiles(MmaType t, int block_m) {
    return t == MmaType::kFP8xFP4 ? (block_m == 128 ? 2 : 1) : 0;
}
DG_HOST_DEVICE constexpr int mega_moe_expanded_b_bytes(MmaType t, int block_m) {
    return mega_moe_expanded_b_tiles(t, block_m) * kMegaMoEBlockNL1 * 128;
}
DG_HOST_DEVICE constexpr int mega_moe_stage_bytes(MmaType t, int block_m) { return block_m * 128 + mega_moe_stage_b_bytes(t); }
DG_HOST_DEVICE constexpr int mega_moe_epilogue_bytes(int block_m) { return block_m * kMegaMoEEpilogueRowBytes; }
// Prefill FP8 x FP4: the epilogue tile lies in the two expanded tiles, idle from a task's last wgmma
// (both warpgroups meet at a barrier after it) to the next task's first expansion, so that the
// second tile costs no stage (4 stages, as with one tile)
DG_HOST_DEVICE constexpr bool mega_moe_epilogue_in_expanded(MmaType t, int block_m) { return mega_moe_expanded_b_tiles(t, block_m) == 2; }
DG_HOST_DEVICE constexpr int mega_moe_epilogue_smem_bytes(MmaType t, int block_m) {
    return mega_moe_epilogue_in_expanded(t, block_m) ? 0 : mega_moe_epilogue_bytes(block_m);
}
static_assert(mega_moe_epilogue_bytes(128) <= 2 * kMegaMoEBlockNL1 * 128, "the prefill epilogue tile fits in the expanded tiles");
// Per stage, next to the tiles: the M-block's activation scales for the K-block (FP8 activations,
// block_m floats), the B tile's exponent deltas (FP8 x FP4, 256 rows x 4 groups) and the B tile's
// FP32 weight block scales (FP8 activations: gate and up for L1, one for L2, padded to 16 bytes),
// all brought by the producer with the tiles, so the math loop never waits on a global load
// FP4 exponent deltas in HBM (transform_weights_for_mega_moe): one block per 128 rows and K-block,
// byte r * 4 + g = row r, 32-wide group g
constexpr int kMegaMoEDeltaBlockBytes = 128 * 4;
constexpr int kMegaMoEDeltaBytesL1 = kMegaMoEBlockNL1 / 128 * kMegaMoEDeltaBlockBytes;
constexpr int kMegaMoEStageWeightSfBytes = 16;
DG_HOST_DEVICE constexpr int mega_moe_stage_sf_bytes(MmaType t, int block_m) { return is_fp8_activation(t) ? block_m * 4 : 0; }
DG_HOST_DEVICE constexpr int mega_moe_stage_deltas_bytes(MmaType t) { return t == MmaType::kFP8xFP4 ? kMegaMoEDeltaBytesL1 : 0; }
DG_HOST_DEVICE constexpr int mega_moe_stage_weight_sf_bytes(MmaType t) { return is_fp8_activation(t) ? kMegaMoEStageWeightSfBytes : 0; }
// FP8 x FP4 rounds a stage's extras up to 128 bytes, so that every stage's delta slot (at the
// 128-byte multiple block_m * 4) is a valid destination for the deltas' tensor copy
DG_HOST_DEVICE constexpr int mega_moe_stage_extra_bytes(MmaType t, int block_m) {
    const int bytes = mega_moe_stage_sf_bytes(t, block_m) + mega_moe_stage_deltas_bytes(t) + mega_moe_stage_weight_sf_bytes(t);
    return t == MmaType::kFP8xFP4 ? align_up(bytes, 128) : bytes;
}
// K-blocks of one GEMM: bounds hidden and intermediate_hidden (checked by the host at layout time)
constexpr int kMegaMoEMaxKBlocks = 128;
// FP8 x FP4's E2M1 -> E4M3 expansion table in shared memory: [16 deltas][8 magnitudes] bytes,
// 128-aligned (its address rule: fp4_magnitudes in the kernel), placed after 16-aligned scalars,
// so at most kMegaMoEFP4TablePad bytes of padding before it
constexpr int kMegaMoEFP4TableBytes = 16 * 8;
constexpr int kMegaMoEFP4TableAlign = 128;
constexpr int kMegaMoEFP4TablePad = kMegaMoEFP4TableAlign - 16;
// FP8 x FP4 decode kernels only may be built with the signals thread (a kernel variant, `_sig`)
DG_HOST_DEVICE constexpr bool mega_moe_signals_thread_ok(MmaType t, int block_m) { return t == MmaType::kFP8xFP4 and block_m == 64; }
// The CTA pair (two CTAs an SM, one math warpgroup each): FP8 x FP4 decode kernels. With
// wide_n_min 64 every M-block runs as token passes of 8 narrow tiles; with 16 / 32 as passes of
// kMegaMoEPairPassRows tokens, each a narrow tile or a transposed one of N = 16 / 32 (N = 64 would
// not fit one warpgroup's registers with both halves of a tile)
constexpr int kMegaMoEPairPassRows = 32;
DG_HOST_DEVICE constexpr bool mega_moe_cta_pair_ok(MmaType t, int block_m, int wide_n_min) {
    return t == MmaType::kFP8xFP4 and block_m == 64 and (wide_n_min == 64 or wide_n_min == 32 or wide_n_min == 16);
}
// The signals thread's mailboxes (FP8 x FP4 decode kernels built with it): per math
// warpgroup a ring of kMegaMoESignalPosts posts, each a full and an empty mbarrier and a 4-byte
// word. They take the half of the pulled rows' table that 64-row M-blocks leave unused.
constexpr int kMegaMoESignalPosts = 4;
constexpr int kMegaMoESignalBytes = 2 * kMegaMoESignalPosts * (2 * 8 + 4);
// mbarriers (stages x 2 + ring x 2), ring slots, per-expert token counts and M-block table, the
// pulled M-block's row sources, 64 bytes of scalars, up to 16 bytes aligning them, the expansion
// table and its padding
DG_HOST_DEVICE constexpr int mega_moe_control_smem_bytes(int num_stages, int block_m) {
    return align_up(num_stages * 16 + mega_moe_task_ring(block_m) * 20 + (2 * kMegaMoEMaxLocalExperts + 1) * 4 +
                    layout::kMaxBlockM * 4 + 64 + 16 + kMegaMoEFP4TablePad + kMegaMoEFP4TableBytes, 1024);
}
// A pulled row's source in one uint32: rank in the top 3 bits, token slot (token * top-k + k)
// below (bounds num_max_tokens_per_rank * num_topk, checked by the host)
constexpr int kPullTokenBits = 29;
static_assert(kMaxRanks <= (1 << (32 - kPullTokenBits)), "a rank index fits the bits above the token");
// Prefill pulls (BLOCK_M = 128) move rows through shared memory with bulk copies: slot i (2 KB)
// belongs to dispatch thread i, which loads a piece of a row into it and stores it into the pool,
// so the pull has slots x 2 KB in flight instead of what the dispatch threads' registers hold
// (96 x 64 B). It fits in what the stages leave of an H100 / H200 SM (FP8 / BF16: 3 stages and the
// epilogue tile use 190 KB of 227; FP8 x FP4: 4 stages and the expanded tiles 203 KB); decode tiles (BLOCK_M = 64) pull a few rows and keep
// every byte for their deeper rings. Per slot: the bytes and one mbarrier; +128 to align the slots.
constexpr int kMegaMoEPullSlotBytes = 2048;
DG_HOST_DEVICE constexpr int mega_moe_pull_slots(MmaType t, int block_m) {
    return block_m == 128 ? (t == MmaType::kFP8xFP4 ? 8 : 16) : 0;
}
DG_HOST_DEVICE constexpr int mega_moe_pull_staging_bytes(MmaType t, int block_m) {
    return mega_moe_pull_slots(t, block_m) == 0 ? 0 : mega_moe_pull_slots(t, block_m) * (kMegaMoEPullSlotBytes + 8) + 128;
}
// Prefill combines (BLOCK_M = 128) move the top-k rows of y's chunks through shared memory with bulk
// copies: each math warpgroup owns kMegaMoECombineBufs buffers in its half of the pipeline stages
// (FP8 x FP4: and of the expanded tiles after them; idle once a CTA reaches its combine: every stage of the rank's GEMMs has been read when
// combine_ready is in), each buffer one batch of up to kMegaMoECombinePlanes top-k planes of 128
// 16-byte chunks, so a CTA has up to 2 x 4 x 16 KB of rows in flight where the register combine had
// 256 x 4 x 16 B. Their mbarriers (one per buffer) are the only bytes this adds to the budget.
constexpr int kMegaMoECombineBufs = 4;
constexpr int kMegaMoECombineBatchChunks = 128;   // one 16-byte chunk of y per math thread of a warpgroup
constexpr int kMegaMoECombinePlanes = 8;          // top-k planes per batch (more: several batches per chunk group)
constexpr int kMegaMoECombineBufBytes = kMegaMoECombinePlanes * kMegaMoECombineBatchChunks * 16;
DG_HOST_DEVICE constexpr bool mega_moe_has_bulk_combine(int block_m) { return block_m == 128; }
DG_HOST_DEVICE constexpr int mega_moe_combine_bar_bytes(int block_m) {
    return mega_moe_has_bulk_combine(block_m) ? kMegaMoENumMathWarpgroups * kMegaMoECombineBufs * 8 : 0;
}
DG_HOST_DEVICE constexpr int mega_moe_smem_bytes(MmaType t, int block_m, int num_stages) {
    // +1024: the dynamic shared-memory base is re-aligned to 1024 B for the swizzled tiles
    return num_stages * (mega_moe_stage_bytes(t, block_m) + mega_moe_stage_extra_bytes(t, block_m)) +
           mega_moe_expanded_b_bytes(t, block_m) + mega_moe_epilogue_smem_bytes(t, block_m) + mega_moe_pull_staging_bytes(t, block_m) +
           mega_moe_combine_bar_bytes(block_m) + mega_moe_control_smem_bytes(num_stages, block_m) + 1024;
}

// The weights-first kernel (impls/sm90_mega_moe_ws.cuh, docs/KERNEL.md "Weights first"): a
// one-rank call of at most kMegaMoEWsMaxPairs routed (token, slot) pairs, any format, run as
// chunks of kMegaMoEWsTileRows-row weight tiles that every CTA starts streaming at once. One math
// or two math warpgroups and a producer warp.
constexpr int kMegaMoEWsMaxPairs = 8;                          // wgmma N: the tokens (L1) and the pairs (L2)
static_assert(kMegaMoEWsMaxPairs == layout::kWsCountSlots, "a counter line per routed expert in ws_count");
// Math warpgroups: one, but two for FP8 x FP4 (each expands two of a stage's four 64-row M tiles;
// 1-3 % faster than one on an H100 at n = 1, docs/PERF.md session 52)
DG_HOST_DEVICE constexpr int mega_moe_ws_math_warpgroups(MmaType t) { return t == MmaType::kFP8xFP4 ? 2 : 1; }
DG_HOST_DEVICE constexpr int mega_moe_ws_math_threads(MmaType t) { return 128 * mega_moe_ws_math_warpgroups(t); }
DG_HOST_DEVICE constexpr int mega_moe_ws_threads(MmaType t) { return mega_moe_ws_math_threads(t) + 32; }   // + the producer warp
constexpr int kMegaMoEWsTileRows = 256;                        // L1: 128 gate + 128 up rows; L2: columns of y
// A stage: a weight tile's K-block (FP8 x FP8 / BF16: 128 bytes a row, 128B-swizzled; FP8 x FP4: the
// packed codes of its two 128-row blocks, 64 bytes a row, then their exponent deltas, 4 bytes a row)
DG_HOST_DEVICE constexpr int mega_moe_ws_stage_bytes(MmaType t) {
    return t == MmaType::kFP8xFP4 ? kMegaMoEWsTileRows * (kMegaMoEPackedRowBytes + 4) : kMegaMoEWsTileRows * 128;
}
DG_HOST_DEVICE constexpr int mega_moe_ws_stage_code_bytes(MmaType t) {
    return t == MmaType::kFP8xFP4 ? kMegaMoEWsTileRows * kMegaMoEPackedRowBytes : mega_moe_ws_stage_bytes(t);
}
static_assert(mega_moe_ws_stage_bytes(MmaType::kFP8xFP4) % 1024 == 0, "every stage (and the N side after them) 1024-aligned");
constexpr int kMegaMoEWsNSideBytes = kMegaMoEWsMaxPairs * 128; // a K-block of the N side
constexpr int kMegaMoEWsStageScaleBytes = 16;                  // a stage's two weight block scales (FP8), padded
constexpr int kMegaMoEWsScalarBytes = 256;
// FP8 x FP4's 17 KB stages: 8 (11 would fit at every shape, but timed no faster, 4-5 % slower with
// split L1 tiles: docs/PERF.md session 53); FP8 x FP8 and BF16 fit 6 at most
constexpr int kMegaMoEWsMaxStages = 8;
constexpr int kMegaMoEWsMinStages = 3;
// Its shared memory, the one place the kernel's carve-up and the launch's size come from: offsets
// from the 1024-aligned base of the stages' weight tiles (0), their N-side K-blocks, the pairs' rows
// (the L2 N side, every K-block), 8 x kMegaMoEWsTileRows FP32 exchange rows, the activation scales
// (FP8 activations: x's and the pairs' rows', per K-block and column), the stages' weight scales,
// the full and empty mbarriers, the N-side mbarrier, the stage words, FP8 x FP4's expansion table
// (128-aligned) and the scalars (16-aligned); `bytes`, the launch's dynamic shared memory, adds 1024
// for the base's alignment
struct MegaMoEWsSmem {
    int acts = 0, h_tile = 0, xchg = 0, x_sf = 0, h_sf = 0, stage_wsf = 0, full = 0, empty = 0, h_bar = 0, words = 0, table = 0,
        shared = 0, bytes = 0;
    DG_HOST_DEVICE constexpr MegaMoEWsSmem(MmaType t, int num_stages, int hidden, int intermediate) {
        const int block_k = 128 / activation_bytes(t);
        const bool fp8 = is_fp8_activation(t);
        int c = num_stages * mega_moe_ws_stage_bytes(t);
        acts = c, c += num_stages * kMegaMoEWsNSideBytes;
        h_tile = c, c += (intermediate / block_k) * kMegaMoEWsNSideBytes;
        xchg = c, c += kMegaMoEWsMaxPairs * kMegaMoEWsTileRows * 4;
        x_sf = c, c += fp8 ? (hidden / 128) * kMegaMoEWsMaxPairs * 4 : 0;
        h_sf = c, c += fp8 ? (intermediate / 128) * kMegaMoEWsMaxPairs * 4 : 0;
        stage_wsf = c, c += num_stages * kMegaMoEWsStageScaleBytes;
        full = c, c += num_stages * 8;
        empty = c, c += num_stages * 8;
        h_bar = c, c += 8;
        words = c, c += num_stages * 4;
        if (t == MmaType::kFP8xFP4) c = align_up(c, kMegaMoEFP4TableAlign), table = c, c += kMegaMoEFP4TableBytes;
        shared = align_up(c, 16);
        bytes = 1024 + shared + kMegaMoEWsScalarBytes;
    }
};
DG_HOST_DEVICE constexpr int mega_moe_ws_smem_bytes(MmaType t, int num_stages, int hidden, int intermediate) {
    return MegaMoEWsSmem(t, num_stages, hidden, intermediate).bytes;
}
// Whether a call can run weights-first: one rank (every input local), 1 to
// kMegaMoEWsMaxPairs routed pairs (n x top-k: so that an expert's pairs, duplicates included, fit
// the N = 8 side), whole kMegaMoEWsTileRows-wide column tiles of y, at most kMaxSplitTiles L1 tiles and
// kMaxWsChunks column tiles (the workspace's counters), and the fewest stages in shared memory
DG_HOST_DEVICE constexpr bool mega_moe_ws_ok(MmaType t, int num_ranks, int num_experts, int num_tokens, int num_topk, int hidden,
                                             int intermediate, int max_smem_bytes) {
    return num_ranks == 1 and num_tokens >= 1 and
           num_tokens * num_topk <= kMegaMoEWsMaxPairs and hidden % kMegaMoEWsTileRows == 0 and hidden / kMegaMoEWsTileRows <= layout::kMaxWsChunks and
           min_of(num_tokens * num_topk, num_experts) * (intermediate / 128) <= layout::kMaxSplitTiles and
           mega_moe_ws_smem_bytes(t, kMegaMoEWsMinStages, hidden, intermediate) <= max_smem_bytes;
}
// The most stages (at most kMegaMoEWsMaxStages) whose shared memory fits
DG_HOST_DEVICE constexpr int mega_moe_ws_stages(MmaType t, int hidden, int intermediate, int max_smem_bytes) {
    int s = kMegaMoEWsMaxStages;
    while (s > kMegaMoEWsMinStages and mega_moe_ws_smem_bytes(t, s, hidden, intermediate) > max_smem_bytes) --s;
    return s;
}

// The weights-first kernel's work, the same in every CTA (a function of the call's distinct routed
// experts, `num_slots`, the grid and the plan's form): L1 units (slot, 256-row tile, K-block) and L2
// units (256-wide column tile of y, slot, K-block), K fastest, each phase cut into chunks of s
// consecutive units. Split (the form's bit clear): at least one chunk per CTA (at most
// kMaxWsChunks) and at least one per tile / column tile, so that a chunk is at most one tile's worth
// and holds a part of at most two of them (its partial-sum slots). Whole (kMegaMoEWsWholeL1 /
// kMegaMoEWsWholeL2): a chunk is one L1 tile's whole K / one (column tile, slot)'s whole K, so an L1
// tile needs no exchange and an L2 chunk owns its pairs' columns of its column tile outright.
// kMegaMoEWsL2AfterL1: no L2 weight load is issued before every L1 one is (HBM serves the L1 bytes,
// on the critical path, first; the L2 bytes stream while L1's epilogues run), or, with a lead
// (MegaMoEParams::ws_l2_lead), before every L1 chunk has at most that many units left to issue.
constexpr int kMegaMoEWsWholeL1 = 1;
constexpr int kMegaMoEWsWholeL2 = 2;
constexpr int kMegaMoEWsL2AfterL1 = 4;
constexpr int kMegaMoEWsPlanForms = 8;
struct MegaMoEWsPlan {
    int kb1, tiles_per_expert, tiles1, units1, s1, chunks1;   // L1
    int kb2, per_column, columns, units2, s2, chunks2;        // L2: per_column = slots x kb2 units
    bool whole1, whole2, l2_after_l1;
    DG_HOST_DEVICE MegaMoEWsPlan(MmaType t, int hidden, int intermediate, int num_slots, int grid, int form) {
        const int bk = 128 / activation_bytes(t);
        const int target = min_of(grid, layout::kMaxWsChunks);
        whole1 = (form & kMegaMoEWsWholeL1) != 0, whole2 = (form & kMegaMoEWsWholeL2) != 0, l2_after_l1 = (form & kMegaMoEWsL2AfterL1) != 0;
        kb1 = hidden / bk, tiles_per_expert = intermediate / 128;
        tiles1 = num_slots * tiles_per_expert, units1 = tiles1 * kb1;
        s1 = units1 == 0 or whole1 ? kb1 : ceil_div(units1, max_of(target, tiles1));
        chunks1 = ceil_div(units1, s1);
        kb2 = intermediate / bk, per_column = num_slots * kb2, columns = hidden / kMegaMoEWsTileRows;
        units2 = columns * per_column;
        s2 = units2 == 0 or whole2 ? kb2 : ceil_div(units2, max_of(target, columns));
        chunks2 = ceil_div(units2, s2);
    }
};

// The task log's stamps (slot k of a task's entry, scripts/trace.py reads them by these names): the
// math's id word (rows << 40 | kind << 32 | task), ring slot read, first L1 stage ready, K-loop
// end, epilogue end; the producer's ticket in the ring, first stage claimed (B issued), first A
// tile issued, task decoded (before its first claim), first stage free (its empty-barrier wait done)
enum TraceTaskStamp : int {
    kTaskStampId = 0, kTaskStampGot, kTaskStampFirstStage, kTaskStampLoopEnd, kTaskStampEnd,
    kTaskStampTicket, kTaskStampClaimed, kTaskStampFirstA, kTaskStampDecoded, kTaskStampStageFree,
    kTaskStampCount
};
enum TraceTaskKind : int { kTaskKindL1 = 1, kTaskKindL2 = 2, kTaskKindCombine = 3 };

// Phase timestamps per CTA when `MegaMoEParams::trace` is set (a development aid: where does a
// decode call spend its microseconds). "first" slots keep the first stamp, the others the last.
enum TraceSlot : int {
    kTraceStart = 0, kTraceCounted, kTraceLayout, kTracePullEnd, kTraceL1Begin, kTraceL1End,
    kTraceL2Begin, kTraceL2End, kTraceCombineReady, kTraceCombineEnd, kTraceExit,
    kTracePullBegin, kTraceL1FirstStage,
    // The first L1 task of each CTA, per K-block (kb < 16): when the math warpgroups had the stage,
    // and when the producer issued its A tile
    kTraceKbReady = 16, kTraceKbIssue = 32, kTraceKbSlots = 16,
    // The task log: the first kTraceTasks L1 / L2 / combine tasks of each CTA, one TraceTaskStamp each
    kTraceTaskBase = 48, kTraceTasks = 16, kTraceTaskStamps = kTaskStampCount,
    // Task-log kernels only: the last L1 task of each CTA (its first K-blocks, kb < 16 of the task):
    // when the math had the stage (warpgroup 0's tracer), when the producer had it free (its
    // empty-barrier wait done) and issued its A tile, and when the tracer released it. Last-writer
    // stamps: in a many-task call a task in the middle of the run, in a one-token call its only one
    kTraceKbLastReady = kTraceTaskBase + kTraceTasks * kTraceTaskStamps, kTraceKbLastFree = kTraceKbLastReady + kTraceKbSlots,
    kTraceKbLastIssue = kTraceKbLastFree + kTraceKbSlots, kTraceKbLastRelease = kTraceKbLastIssue + kTraceKbSlots,
    kTraceSlots = kTraceKbLastRelease + kTraceKbSlots
};

struct MegaMoEParams {
    layout::MegaMoELayout layout;
    void* buffers[kMaxRanks];           // every rank's symmetric-buffer base (index = rank)
    int rank;
    int num_tokens;                     // this rank's n (<= num_max_tokens_per_rank)
    void* y;                            // BF16 [n, hidden]
    const float* l1_weight_scales;      // FP8/FP4: [E_local, 2I/128, H/128] (gate/up interleaved rows)
    const float* l2_weight_scales;      // FP8/FP4: [E_local, H/128, I/128]
    // FP4 exponent deltas, 512 bytes per (128-row block, K-block): [E_local, N/128, K/128, 128 rows x 4 groups]
    const uint8_t* l1_weight_deltas;    // N = 2I (interleaved rows), K = H
    const uint8_t* l2_weight_deltas;    // N = H, K = I
    int* cumulative_local_expert_recv_stats;  // int32 [E_local] or nullptr
    float activation_clamp;             // +inf when no clamp
    uint64_t timeout_ns;
    uint64_t* host_status;              // pinned, host-mapped mirror of the status word, or nullptr
    uint64_t* trace;                    // [grid][kTraceSlots] %globaltimer stamps (scripts/trace.py), or nullptr
    int num_prefetch_stages;            // weight stages an L1 task streams before its inputs are ready
    int num_prefetch_stages_l2;         // the same for an L2 task (before its M-block's L1 is done)
    int fp4_code_box_rows;              // FP8 x FP4: rows of an 8 KB code block in its tensor maps (64 of 128
                                        // bytes; 128 of 64 under DG_MEGA_MOE_FP4_CODE_ROW=64)
    // Every rank's buffer is on this GPU (EP1, virtual ranks): the cross-rank signals (counts,
    // combine rows and flags) need gpu scope only; else sys scope (peers over NVLink)
    int peers_on_this_gpu;
    // Most K parts per split-K L1 tile (DG_MEGA_MOE_L1_SPLIT, else the heuristic's cap per format;
    // 1 = never split): the kernel picks 1, 2 or 4 per call when every L1 tile is narrow (docs/KERNEL.md)
    int l1_split_max;
    // The weights-first kernel's plan form (MegaMoEWsPlan: kMegaMoEWsWholeL1 | kMegaMoEWsWholeL2 |
    // kMegaMoEWsL2AfterL1), set per call
    int ws_plan;
    // Under kMegaMoEWsL2AfterL1: an L1 chunk counts as issued once at most this many of its units are
    // left to issue (0: all issued), so the L2 weight loads start that much earlier (a tuning aid,
    // DG_MEGA_MOE_WS_L2_LEAD), set per call
    int ws_l2_lead;
};

// Split-K L1 of a decode call whose L1 tiles are all narrow (build_layout; docs/KERNEL.md): each of
// `tiles` tiles of `num_kb` K-blocks runs as `parts` consecutive tasks of `part_kb` K-blocks each. A narrow
// K-loop is bound by its per-K-block round trip, not by bytes, so the L1 phase lasts about
// ceil(tiles x s / grid) x num_kb / s K-blocks: the smallest such s of {1, 2, 4} (up to split_max,
// at most kMaxSplitParts parts) wins. Mid at one token: 48 tiles of 16 K-blocks on 132 SMs, s = 2
// (8); v4-flash: 96 tiles of 32, s = 4 (3 rounds of 8) under a cap of 4, else unsplit. The unsplit
// cost is taken as one round, so more tiles than SMs (small grids, virtual ranks) never split. Uneven parts
// (v4-flash: 24 + 8, the short ones three to each of the 36 idle SMs) measured +10.6 % there: each
// short part pays a first-stage wait and the exchange, ~2.5 us (docs/PERF.md, session 26).
struct MegaMoEL1Split {
    int parts;
    int part_kb;
};
DG_HOST_DEVICE constexpr MegaMoEL1Split mega_moe_l1_split_plan(int64_t tiles, int num_kb, int64_t grid, int split_max) {
    MegaMoEL1Split plan{1, num_kb};
    if (tiles <= 0 or tiles > layout::kMaxSplitTiles or grid <= 0) return plan;
    int64_t best = num_kb;
    for (int s = 2; s <= split_max; s *= 2) {
        if (num_kb % s != 0 or tiles * s > layout::kMaxSplitParts) break;
        const int64_t cost = ceil_div(tiles * s, grid) * (num_kb / s);
        if (cost < best) best = cost, plan = MegaMoEL1Split{s, num_kb / s};
    }
    return plan;
}

// `SymmBuffer.stage(x, topk_idx, topk_weights)`: one launch that fills a rank's inputs
struct MegaMoEStageParams {
    layout::MegaMoELayout layout;
    void* buffer;                       // this rank's buffer base
    const void* x;                      // BF16 [n, hidden], rows `x_row_stride` elements apart
    int64_t x_row_stride;
    const int64_t* topk_idx;            // [n, topk] contiguous
    const float* topk_weights;          // [n, topk] contiguous
    int num_tokens;
};

}  // namespace deep_gemm
