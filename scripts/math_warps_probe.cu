// Would more math warps per scheduler speed up the FP8 x FP4 narrow decode K-block? A model of the
// Mega MoE kernel's narrow L1 loop (narrow_l1_mainloop, FP8 x FP4) with its math and its stage ring
// but no memory traffic: one producer thread cycles a 6-stage ring of shared-memory stages whose
// contents stay put (packed E2M1 codes of a 256-row K-block, their deltas, an 8-token A tile), and W
// math warpgroups share each K-block's four 64-row M tiles (gate 0, gate 1, up 0, up 1), T = 4 / W
// tiles each: W = 2 is the kernel's split (each warpgroup gate w and up w), W = 4 one tile each,
// W = 1 all four. Per K-block and tile a thread does what the kernel's does: two 16-byte code loads
// and two delta loads, the table offsets, per 32-bit code word one 8-byte table-row load and the
// PRMT / LOP3 expansion into wgmma A fragments, `wgmma.fence`, four m64n8k32 RS wgmmas; then
// commit, wait, release (lane 0 of each warp arrives on the stage's empty barrier) and the
// promotion FMAs. Modes: 0 as above, 1 without the wgmmas (expansion only), 2 without the
// expansion (wgmmas on fragments expanded once, before the loop), 3 the fragments stored into an
// E4M3 tile in shared memory (4 x 16-byte stores per tile, 128B-swizzled rows; the bytes' K order
// is not the wgmma's, which timing does not see), proxy fence and warpgroup barrier, then SS wgmmas
// (A from shared memory instead of registers), 4 as 0 with warpgroup 1 started half a K-block
// (430 cycles) late, so the two warpgroups' expansions and wgmmas alternate, 5 pipelined across
// K-blocks (two fragment / partial-sum sets: K-block kb's wgmmas stay in flight while kb + 1 is
// waited for, loaded and expanded, then kb is waited for with wait_group 1, released and promoted;
// four K-blocks per loop iteration, drained at its end, because a loop back-edge with RS wgmmas in
// flight makes ptxas serialize them all, C7518). Streamed runs: the producer
// fills each stage from HBM as the kernel's does (two 8 KB code blocks, two 512-byte delta blocks,
// the 1 KB A tile, by bulk copies; every CTA its own slice of a 2 GB region, never L2-resident),
// so the math meets the memory side of fp4_stream_probe.cu. Extras (a bit mask, what the kernel's
// loop has beyond this model): 1 the promotion's four scale loads per K-block (two token scales per
// thread, two weight scales) and their products, 2 the stage index opaque to the compiler (not
// provably warp-uniform, as the kernel's stage_iter: descriptors through R2UR), 4 a trace test per
// K-block (a parameter pointer that is null, the kernel's per-K-block stamps), 8 the top-k weights
// loaded in the first K-block (two predicated global loads). Each line also gives SM cycles per
// K-block (clock64) and the clock they imply.
//   nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -o /tmp/math_probe scripts/math_warps_probe.cu
//   /tmp/math_probe        (one CTA per SM on every SM; prints ns per K-block per CTA for W = 1, 2, 4)
//   /tmp/math_probe pipelined   (mode 5 against mode 0 only, twice)
//   /tmp/math_probe tasks [checks | stages]   (task boundaries: one CTA x two math warpgroups against two CTAs x one per SM)
// Results (H200): docs/PERF.md, "2026-12-02 (session 24)" and "(session 25)" (mode 5), "(session 31)" (tasks).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "probe_common.cuh"

constexpr int kStages = 6;
constexpr int kRows = 256;                    // a K-block of a narrow L1 tile: gate 128 + up 128 rows
constexpr int kRowBytes = 64;                 // 128 K of E2M1 per row
constexpr int kCodeBytes = kRows * kRowBytes; // 16 KB
constexpr int kDeltaBytes = kRows * 4;        // one delta byte per 32-group, 4 groups per row
constexpr int kABytes = 8 * 128;              // 8 tokens x 128 bytes of E4M3, 128B-swizzled
constexpr int kStageBytes = kCodeBytes + kDeltaBytes + kABytes;   // 18 KB, a multiple of 1024
constexpr int kTableBytes = 128;              // 16 deltas x 8-byte magnitude rows
static_assert(kStageBytes % 1024 == 0, "A tiles 1024-aligned");

__device__ __forceinline__ uint32_t prmt(uint32_t a, uint32_t b, uint32_t sel) {
    uint32_t r;
    asm volatile("prmt.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(sel));
    return r;
}
__device__ __forceinline__ uint4 lds128(uint32_t a) {
    uint4 v;
    asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(a));
    return v;
}
__device__ __forceinline__ uint2 lds64(uint32_t a) {
    uint2 v;
    asm volatile("ld.shared.v2.u32 {%0, %1}, [%2];" : "=r"(v.x), "=r"(v.y) : "r"(a));
    return v;
}
__device__ __forceinline__ uint32_t lds32(uint32_t a) {
    uint32_t v;
    asm volatile("ld.shared.u32 %0, [%1];" : "=r"(v) : "r"(a));
    return v;
}
__device__ __forceinline__ uint32_t word_of(const uint4& v, int i) { return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w; }
__device__ __forceinline__ void named_sync(int id, int n) { asm volatile("bar.sync %0, %1;" :: "r"(id), "r"(n) : "memory"); }

// wgmma needs the arch-specific target (compute_90a): a pass for plain compute_90 (what a bare
// `nvcc -arch=sm_90a` also runs, as tests/test_scripts_cpu.py does) gets traps instead
#if defined(__CUDA_ARCH__) and not defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define PROBE_NO_WGMMA 1
#endif

// K-major 128B-swizzled shared-memory descriptor (PTX ISA "Matrix Descriptor Format"): stride 1024
// between 8-row groups, swizzle mode 1 (128 B)
__device__ __forceinline__ uint64_t sw128_desc(uint32_t smem) {
    return ((smem & 0x3FFFFu) >> 4) | (1ull << 16) | (64ull << 32) | (1ull << 62);
}
// D (64 x 8, FP32) += A (64 x 32 E4M3, registers) x B (8 x 32 E4M3, K-major in shared memory)
__device__ __forceinline__ void wgmma_n8(const uint32_t (&a)[4], uint64_t b, float (&d)[4], int scale_d) {
#ifdef PROBE_NO_WGMMA
    __trap();
#else
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %9, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n8k32.f32.e4m3.e4m3 {%0, %1, %2, %3}, {%4, %5, %6, %7}, %8, p, 1, 1;\n}\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(scale_d));
#endif
}
// The same with A (64 x 32 E4M3) K-major in shared memory
__device__ __forceinline__ void wgmma_n8_ss(uint64_t a, uint64_t b, float (&d)[4], int scale_d) {
#ifdef PROBE_NO_WGMMA
    __trap();
#else
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %6, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n8k32.f32.e4m3.e4m3 {%0, %1, %2, %3}, %4, %5, p, 1, 1;\n}\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]) : "l"(a), "l"(b), "r"(scale_d));
#endif
}
__device__ __forceinline__ void sts128(uint32_t a, uint32_t x, uint32_t y, uint32_t z, uint32_t w) {
    asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};" :: "r"(a), "r"(x), "r"(y), "r"(z), "r"(w) : "memory");
}
#ifdef PROBE_NO_WGMMA
__device__ __forceinline__ void wg_fence() {}
__device__ __forceinline__ void wg_commit() {}
__device__ __forceinline__ void wg_wait0() {}
__device__ __forceinline__ void wg_wait1() {}
#else
__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wg_wait0() { asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory"); }
__device__ __forceinline__ void wg_wait1() { asm volatile("wgmma.wait_group.sync.aligned 1;" ::: "memory"); }
#endif
// Mode 5's stage wait and release with wgmmas in flight: the spin inside one asm block and the
// one-lane arrive predicated in it, so the compiler sees no divergent path (a C++ spin loop or an
// `if (lane == 0)` there makes ptxas serialize every wgmma, C7518)
__device__ __forceinline__ void mb_wait_asm(uint64_t* b, uint32_t parity) {
    asm volatile("{\n .reg .pred p;\n WAIT_%=:\n mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n @!p bra WAIT_%=;\n}\n"
                 :: "r"(sa(b)), "r"(parity) : "memory");
}
__device__ __forceinline__ void mb_arrive_lane0(uint64_t* b, int lane) {
    asm volatile("{\n .reg .pred p;\n .reg .b64 st;\n setp.eq.s32 p, %1, 0;\n @p mbarrier.arrive.shared::cta.b64 st, [%0];\n}\n"
                 :: "r"(sa(b)), "r"(lane) : "memory");
}
template <int N>
__device__ __forceinline__ void keep(float (&d)[N]) {
    #pragma unroll
    for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i]) :: "memory");
}
__device__ __forceinline__ void keep(uint32_t (&a)[4][4]) {
    #pragma unroll
    for (int i = 0; i < 4; ++i)
        #pragma unroll
        for (int j = 0; j < 4; ++j) asm volatile("" : "+r"(a[i][j]) :: "memory");
}

// The kernel's expansion rule (sm90_fp8_mega_moe.cuh: expand_e2m1x8, fp4_magnitudes, fp4_table_offsets)
__device__ __forceinline__ uint2 expand8(uint32_t codes, uint2 mag) {
    const uint32_t sel = codes & 0x77777777u;
    return make_uint2(prmt(mag.x, mag.y, sel) | (codes & 0x80808080u), prmt(mag.x, mag.y, sel >> 16) | ((codes << 4) & 0x80808080u));
}
struct Rows { uint4 codes[2]; uint32_t offsets[2]; };

// A thread's code chunks and table offsets of its T M tiles of the stage at `base` (tile q of the
// four: W = 2 -> gate wg, up wg, the kernel's rows 64 wg and 128 + 64 wg)
template <int W, int T>
__device__ __forceinline__ void load_rows(uint32_t base, int wg, int warp, int lane, uint32_t hi, Rows (&r)[T]) {
    #pragma unroll
    for (int t = 0; t < T; ++t) {
        const int q = W == 2 ? (t == 0 ? wg : 2 + wg) : W == 4 ? wg : t;
        const int row0 = (q / 2) * 128 + (q % 2) * 64, row = row0 + warp * 16 + lane / 4;
        #pragma unroll
        for (int h = 0; h < 2; ++h) {
            r[t].codes[h] = lds128(base + (row + 8 * h) * kRowBytes + (lane % 4) * 16);
            r[t].offsets[h] = ((lds32(base + kCodeBytes + (row + 8 * h) * 4) << 3) & 0x78787878u) | hi;
        }
    }
}
// One M tile's wgmma A fragments from its rows (the kernel's narrow_fp4_expand)
__device__ __forceinline__ void expand_rows(const Rows& r, uint32_t (&fr)[4][4], uint32_t tab) {
    #pragma unroll
    for (int ks = 0; ks < 4; ++ks)
        #pragma unroll
        for (int h = 0; h < 2; ++h) {
            const uint2 e = expand8(word_of(r.codes[h], ks), lds64(prmt(r.offsets[h], tab, 0x7650u + ks)));
            fr[ks][h] = e.x, fr[ks][2 + h] = e.y;
        }
}

// The producer's copies of stage `st` (the kernel's: two 8 KB code blocks, two 512-byte delta
// blocks, the 1 KB A tile), completing on `full`; blk: this CTA's K-block in src
__device__ __forceinline__ void copy_stage(uint64_t* full, uint32_t st, const uint8_t* blk, const uint8_t* a_src) {
    mb_arrive_tx(full, kStageBytes);
    for (int h = 0; h < 2; ++h) {
        bulk_g2s(st + h * (kCodeBytes / 2), blk + h * (kCodeBytes / 2), kCodeBytes / 2, full);
        bulk_g2s(st + kCodeBytes + h * (kDeltaBytes / 2), blk + kCodeBytes + h * (kDeltaBytes / 2), kDeltaBytes / 2, full);
    }
    bulk_g2s(st + kCodeBytes + kDeltaBytes, a_src, kABytes, full);
}
// Per M tile: the fragments expanded from its rows, then its four m64n8k32 RS wgmmas into part[t]
template <int T>
__device__ __forceinline__ void expand_and_issue(const Rows (&r)[T], uint32_t (&frag)[T][4][4], float (&part)[T][4], uint64_t desc_tok, uint32_t tab) {
    #pragma unroll
    for (int t = 0; t < T; ++t) {
        keep(part[t]);
        expand_rows(r[t], frag[t], tab);
        wg_fence();
        #pragma unroll
        for (int ks = 0; ks < 4; ++ks) wgmma_n8(frag[t][ks], desc_tok + ks * 2, part[t], ks > 0);
    }
}
// Extras bit 1: the promotion's scales, read from the stage (any floats of it: timing only)
template <int T>
__device__ __forceinline__ void promotion_scales(uint32_t base, int lane, float (&sc)[T][2]) {
    const uint32_t sf = base + kCodeBytes + kDeltaBytes;
    const float sa0 = __uint_as_float(lds32(sf + (lane % 4) * 8)), sa1 = __uint_as_float(lds32(sf + (lane % 4) * 8 + 4));
    #pragma unroll
    for (int t = 0; t < T; ++t) {
        const float sw = __uint_as_float(lds32(sf + 512 + t * 4));
        sc[t][0] = sa0 * sw, sc[t][1] = sa1 * sw;
    }
}

// src: null, or [CTA][K-block][16 KB codes | 1 KB deltas] and 1 KB of A at its end (shared)
template <int W, int kMode, int kProducerWork = 0, bool kBusyWarp = false, int kExtras = 0>
__global__ void __launch_bounds__(128 * (W + 1), 1) probe(int num_kb, const uint8_t* src, unsigned long long* out_ns, float* sink,
                                                          unsigned long long* trace) {
    constexpr int T = 4 / W;   // M tiles per warpgroup and K-block
    extern __shared__ __align__(1024) uint8_t smem[];
    uint8_t* stages = smem;
    uint8_t* e4m3 = smem + kStages * kStageBytes;   // mode 3: [warpgroup][tile][64 rows x 128 B]
    uint8_t* table = e4m3 + 4 * 8192;
    auto* full = reinterpret_cast<uint64_t*>(table + kTableBytes);
    auto* empty = full + kStages;
    volatile int* math_done = reinterpret_cast<volatile int*>(empty + kStages);   // kBusyWarp's stop flag
    // Contents: codes and A of small E4M3 values, deltas 0..15, magnitudes as the kernel's table
    for (int i = threadIdx.x; i < kStages * kStageBytes / 4; i += blockDim.x)
        reinterpret_cast<uint32_t*>(stages)[i] = (i * 2654435761u) & 0x0f3f0f3fu;
    for (int i = threadIdx.x; i < kTableBytes; i += blockDim.x) table[i] = static_cast<uint8_t>((i * 7) & 0x3f);
    if (threadIdx.x == 0) {
        *math_done = 0;
        for (int s = 0; s < kStages; ++s) mb_init(full + s, 1), mb_init(empty + s, 4 * W);
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
    const uint64_t t0 = now_ns();
    const long long c0 = clock64();
    if (threadIdx.x < 128) {
        if (threadIdx.x == 0) {   // producer: a stage is "filled" by arriving on its full barrier (or by copies)
            const uint8_t* a_src = src + size_t(gridDim.x) * num_kb * (kCodeBytes + kDeltaBytes);
            for (int it = 0; it < num_kb; ++it) {
                const int s = it % kStages;
                mb_wait(empty + s, ((it / kStages) & 1) ^ 1);
                if (src == nullptr) {
                    mb_arrive(full + s);
                    continue;
                }
                copy_stage(full + s, sa(stages + s * kStageBytes), src + (size_t(blockIdx.x) * num_kb + it) * (kCodeBytes + kDeltaBytes), a_src);
                // the kernel's producer runs ~100 dependent instructions a stage on its hot path
                // (docs/PERF.md, session 20): as many dependent IMADs, on the same scheduler as
                // two math warps
                // (kProducerWork < 0: as many in four independent chains, issue slots without the latency)
                uint32_t x = static_cast<uint32_t>(it), y = x + 1, z = x + 2, w = x + 3;
                #pragma unroll
                for (int i = 0; i < kProducerWork; ++i) asm volatile("mad.lo.u32 %0, %0, 3, 1;" : "+r"(x));
                #pragma unroll
                for (int i = 0; i < -kProducerWork / 4; ++i) {
                    asm volatile("mad.lo.u32 %0, %0, 3, 1;" : "+r"(x));
                    asm volatile("mad.lo.u32 %0, %0, 3, 1;" : "+r"(y));
                    asm volatile("mad.lo.u32 %0, %0, 3, 1;" : "+r"(z));
                    asm volatile("mad.lo.u32 %0, %0, 3, 1;" : "+r"(w));
                }
                if ((x ^ y ^ z ^ w) == 0x12345678u) sink[0] = 1.0f;
            }
        }
        // kBusyWarp: warp 1 (the dispatch warps' place) runs dependent IMADs until the math is done,
        // a busy role on the scheduler of two math warps that the ring does not wait for
        if (kBusyWarp and threadIdx.x == 32) {
            uint32_t x = 1;
            while (*math_done == 0) {
                #pragma unroll
                for (int i = 0; i < 64; ++i) asm volatile("mad.lo.u32 %0, %0, 3, 1;" : "+r"(x));
            }
            if (x == 0x12345678u) sink[1] = 1.0f;
        }
        return;
    }
    const int wg = threadIdx.x / 128 - 1, tid = threadIdx.x % 128, warp = tid / 32, lane = tid % 32;
    const uint32_t tab = sa(table), hi = (tab & 0x80u) * 0x01010101u;
    float acc[T][4] = {};
    uint32_t frag[T][4][4];
    #pragma unroll
    for (int t = 0; t < T; ++t)
        #pragma unroll
        for (int k = 0; k < 4; ++k)
            #pragma unroll
            for (int j = 0; j < 4; ++j) frag[t][k][j] = 0x38383838u;
    if (kMode == 4 and wg == 1) { const long long t = clock64(); while (clock64() - t < 430) {} }
    float tok_w[2] = {1.0f, 1.0f};
    if constexpr (kMode == 5) {
        // Pipelined across K-blocks: K-block kb's wgmmas (into one of two partial-sum and
        // fragment sets) stay in flight while kb + 1 is waited for, loaded and expanded; kb is
        // then waited for (wait_group 1), released and promoted. Each stage is held one K-block
        // longer (its release follows the next stage's wait).
        float part_a[T][4], part_b[T][4];
        uint32_t frag_b[T][4][4];
        #pragma unroll
        for (int t = 0; t < T; ++t)
            #pragma unroll
            for (int k = 0; k < 4; ++k)
                #pragma unroll
                for (int j = 0; j < 4; ++j) frag_b[t][k][j] = 0x38383838u;
        const auto issue = [&](int kb, float (&part)[T][4], uint32_t (&fr)[T][4][4]) {
            const int s = kb % kStages;
            mb_wait_asm(full + s, (kb / kStages) & 1);
            const uint32_t base = sa(stages + s * kStageBytes);
            const uint64_t desc_tok = sw128_desc(base + kCodeBytes + kDeltaBytes);
            Rows r[T];
            load_rows<W, T>(base, wg, warp, lane, hi, r);
            expand_and_issue<T>(r, fr, part, desc_tok, tab);
            wg_commit();
        };
        const auto retire = [&](int kb, float (&part)[T][4], uint32_t (&fr)[T][4][4], bool last) {
            if (last) wg_wait0(); else wg_wait1();
            #pragma unroll
            for (int t = 0; t < T; ++t) keep(part[t]), keep(fr[t]);
            mb_arrive_lane0(empty + kb % kStages, lane);
            #pragma unroll
            for (int t = 0; t < T; ++t)
                #pragma unroll
                for (int i = 0; i < 4; ++i) acc[t][i] += part[t][i] * 0.5f;
        };
        // Four K-blocks per iteration, drained at its end: a loop back-edge with RS wgmmas in flight
        // makes ptxas serialize every wgmma of the function (C7518, whatever the waits and
        // arrives look like), straight-line code does not. num_kb: a multiple of 4 (main)
        for (int kb = 0; kb < num_kb; kb += 4) {
            issue(kb, part_a, frag);
            issue(kb + 1, part_b, frag_b);
            retire(kb, part_a, frag, false);
            issue(kb + 2, part_a, frag);
            retire(kb + 1, part_b, frag_b, false);
            issue(kb + 3, part_b, frag_b);
            retire(kb + 2, part_a, frag, false);
            retire(kb + 3, part_b, frag_b, true);
        }
    }
    for (int kb = 0; kb < (kMode == 5 ? 0 : num_kb); ++kb) {
        int kbv = kb;
        if constexpr ((kExtras & 2) != 0) asm volatile("mov.b32 %0, %0;" : "+r"(kbv));
        const int s = kbv % kStages;
        mb_wait(full + s, (kb / kStages) & 1);
        const uint32_t base = sa(stages + s * kStageBytes);
        const uint64_t desc_tok = sw128_desc(base + kCodeBytes + kDeltaBytes);   // the wgmma's B: 8 tokens
        Rows r[T];
        load_rows<W, T>(base, wg, warp, lane, hi, r);
        float part[T][4];
        #pragma unroll
        for (int t = 0; t < T; ++t) {
            keep(part[t]);
            if constexpr (kMode != 2) expand_rows(r[t], frag[t], tab);
            if constexpr (kMode == 3) {
                const uint32_t tile = sa(e4m3 + (wg * T + t) * 8192);
                #pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const int row = warp * 16 + lane / 4 + 8 * h, c = 2 * (lane % 4);
                    sts128(tile + row * 128 + ((c ^ (row % 8)) * 16), frag[t][0][h], frag[t][1][h], frag[t][2][h], frag[t][3][h]);
                    sts128(tile + row * 128 + (((c + 1) ^ (row % 8)) * 16), frag[t][0][2 + h], frag[t][1][2 + h], frag[t][2][2 + h], frag[t][3][2 + h]);
                }
                asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
                named_sync(2 + wg, 128);
                wg_fence();
                const uint64_t desc_w = sw128_desc(tile);
                #pragma unroll
                for (int ks = 0; ks < 4; ++ks) wgmma_n8_ss(desc_w + ks * 2, desc_tok + ks * 2, part[t], ks > 0);
            } else if constexpr (kMode != 1) {
                wg_fence();
                #pragma unroll
                for (int ks = 0; ks < 4; ++ks) wgmma_n8(frag[t][ks], desc_tok + ks * 2, part[t], ks > 0);
            } else {
                #pragma unroll
                for (int i = 0; i < 4; ++i) part[t][i] = __uint_as_float(frag[t][i][0] ^ frag[t][i][3]) * 1e-30f;
            }
        }
        wg_commit();
        if constexpr ((kExtras & 8) != 0) {
            if (kb == 0) tok_w[0] = __ldcg(sink + 64 + lane), tok_w[1] = __ldcg(sink + 96 + lane);
        }
        float sc[T][2];
        #pragma unroll
        for (int t = 0; t < T; ++t) sc[t][0] = sc[t][1] = 0.5f;
        if constexpr ((kExtras & 1) != 0) promotion_scales<T>(base, lane, sc);
        wg_wait0();
        #pragma unroll
        for (int t = 0; t < T; ++t) keep(part[t]), keep(frag[t]);
        if (lane == 0) mb_arrive(empty + s);
        if constexpr ((kExtras & 4) != 0) {
            if (trace != nullptr and tid == 0 and kb < 16) trace[kb] = now_ns();
        }
        #pragma unroll
        for (int t = 0; t < T; ++t)
            #pragma unroll
            for (int i = 0; i < 4; ++i) acc[t][i] += part[t][i] * sc[t][i & 1];
    }
    acc[0][0] += tok_w[0] + tok_w[1];
    named_sync(1, 128 * W);
    if (tid == 0 and wg == 0) {
        out_ns[blockIdx.x] = now_ns() - t0, out_ns[gridDim.x + blockIdx.x] = clock64() - c0;
        *math_done = 1;
    }
    float v = 0.0f;
    #pragma unroll
    for (int t = 0; t < T; ++t)
        #pragma unroll
        for (int i = 0; i < 4; ++i) v += acc[t][i];
    if (v == 1234.5f) sink[threadIdx.x] = v;   // keeps the math live
}

// Task boundaries (`tasks` mode): does a CTA pair per SM, each with one math warpgroup doing all four
// M tiles, hide the boundaries between decode tasks that one CTA with two warpgroups pays in full?
// Streamed as above (each CTA its own slice), kS stages, and every task_kb K-blocks a task boundary:
// the producer stops for prod_ns before the next task's first stage (the kernel's ticket and task
// decode, ~1.4 us at mid n = 128, docs/PERF.md session 25) and the math, after the task's last
// K-block, spends epi_ns in an "epilogue": kEpi 0 a wait (nanosleep polling: the kernel's epilogue
// is mostly barriers, stores and fences), 1 four independent IMAD chains (an issuing epilogue).
// W = 2 is the kernel today (one CTA per SM, 384 threads); W = 1 runs two CTAs per SM (256 threads
// each, setmaxnreg 56 / 200, as a one-warpgroup kernel would have to). Each CTA reports its time;
// the SM's rate is kCtas x num_kb K-blocks over it.
__device__ __forceinline__ void pause_ns(uint64_t ns) {
    const uint64_t end = now_ns() + ns;
    while (now_ns() < end) __nanosleep(64);
}
__device__ __forceinline__ uint32_t busy_ns(uint64_t ns, uint32_t seed) {
    uint32_t x = seed, y = seed + 1, z = seed + 2, w = seed + 3;
    const uint64_t end = now_ns() + ns;
    while (now_ns() < end) {
        #pragma unroll
        for (int i = 0; i < 8; ++i) {
            asm volatile("mad.lo.u32 %0, %0, 3, 1;" : "+r"(x));
            asm volatile("mad.lo.u32 %0, %0, 3, 1;" : "+r"(y));
            asm volatile("mad.lo.u32 %0, %0, 3, 1;" : "+r"(z));
            asm volatile("mad.lo.u32 %0, %0, 3, 1;" : "+r"(w));
        }
    }
    return x ^ y ^ z ^ w;
}
template <int W, int kS, int kEpi, int kExtras = 0>
__global__ void __launch_bounds__(128 * (W + 1), W == 1 ? 2 : 1) task_probe(int num_kb, int task_kb, int epi_ns, int prod_ns,
                                                                            const uint8_t* src, unsigned long long* out_ns, float* sink) {
    constexpr int T = 4 / W;
    extern __shared__ __align__(1024) uint8_t smem[];
    uint8_t* stages = smem;
    uint8_t* table = stages + kS * kStageBytes;
    auto* full = reinterpret_cast<uint64_t*>(table + kTableBytes);
    auto* empty = full + kS;
    for (int i = threadIdx.x; i < kTableBytes; i += blockDim.x) table[i] = static_cast<uint8_t>((i * 7) & 0x3f);
    if (threadIdx.x == 0) {
        for (int s = 0; s < kS; ++s) mb_init(full + s, 1), mb_init(empty + s, 4 * W);
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
    const uint64_t t0 = now_ns();
    if (threadIdx.x < 128) {
#ifndef PROBE_NO_WGMMA
        if constexpr (W == 1) asm volatile("setmaxnreg.dec.sync.aligned.u32 56;\n");
#endif
        if (threadIdx.x == 0) {
            const uint8_t* a_src = src + size_t(gridDim.x) * num_kb * (kCodeBytes + kDeltaBytes);
            // task position by a counter, not `it % task_kb` (a run-time division per stage)
            for (int it = 0, in_task = 0; it < num_kb; ++it, ++in_task) {
                const int s = it % kS;
                if (in_task == task_kb) in_task = 0, pause_ns(prod_ns);
                mb_wait(empty + s, ((it / kS) & 1) ^ 1);
                if (src == nullptr) {   // in shared memory: the math alone
                    mb_arrive(full + s);
                    continue;
                }
                copy_stage(full + s, sa(stages + s * kStageBytes), src + (size_t(blockIdx.x) * num_kb + it) * (kCodeBytes + kDeltaBytes), a_src);
            }
        }
        return;
    }
#ifndef PROBE_NO_WGMMA
    if constexpr (W == 1) asm volatile("setmaxnreg.inc.sync.aligned.u32 200;\n");
#endif
    const int wg = threadIdx.x / 128 - 1, tid = threadIdx.x % 128, warp = tid / 32, lane = tid % 32;
    const uint32_t tab = sa(table), hi = (tab & 0x80u) * 0x01010101u;
    float acc[T][4] = {};
    uint32_t frag[T][4][4];
    uint32_t spin = 0;
    float tok_w[2] = {1.0f, 1.0f};
    for (int kb = 0, in_task = 0; kb < num_kb; ++kb) {
        int kbv = kb;
        if constexpr ((kExtras & 2) != 0) asm volatile("mov.b32 %0, %0;" : "+r"(kbv));
        const int s = kbv % kS;
        mb_wait(full + s, (kb / kS) & 1);
        const uint32_t base = sa(stages + s * kStageBytes);
        const uint64_t desc_tok = sw128_desc(base + kCodeBytes + kDeltaBytes);
        Rows r[T];
        load_rows<W, T>(base, wg, warp, lane, hi, r);
        float part[T][4];
        expand_and_issue<T>(r, frag, part, desc_tok, tab);
        wg_commit();
        if constexpr ((kExtras & 8) != 0) {
            if (in_task == 0) tok_w[0] += __ldcg(sink + 64 + lane), tok_w[1] += __ldcg(sink + 96 + lane);
        }
        float sc[T][2];
        #pragma unroll
        for (int t = 0; t < T; ++t) sc[t][0] = sc[t][1] = 0.5f;
        if constexpr ((kExtras & 1) != 0) promotion_scales<T>(base, lane, sc);
        wg_wait0();
        #pragma unroll
        for (int t = 0; t < T; ++t) keep(part[t]), keep(frag[t]);
        if (lane == 0) mb_arrive(empty + s);
        #pragma unroll
        for (int t = 0; t < T; ++t)
            #pragma unroll
            for (int i = 0; i < 4; ++i) acc[t][i] += part[t][i] * sc[t][i & 1];
        if (++in_task == task_kb) {   // the task's epilogue, then both warpgroups meet (the kernel's task barrier)
            in_task = 0;
            if constexpr (kEpi == 0) pause_ns(epi_ns); else spin ^= busy_ns(epi_ns, kb);
            named_sync(1, 128 * W);
        }
    }
    named_sync(1, 128 * W);
    if (tid == 0 and wg == 0) out_ns[blockIdx.x] = now_ns() - t0;
    float v = static_cast<float>(spin & 1) + tok_w[0] + tok_w[1];
    #pragma unroll
    for (int t = 0; t < T; ++t)
        #pragma unroll
        for (int i = 0; i < 4; ++i) v += acc[t][i];
    if (v == 1234.5f) sink[threadIdx.x] = v;
}
// ns per K-block of the SM (kCtas = 2 for W = 1: two CTAs' K-blocks in the time of the median CTA)
template <int W, int kS, int kEpi, int kExtras = 0>
void run_tasks(int sms, int num_kb, int task_kb, int epi_ns, int prod_ns, const uint8_t* src, unsigned long long* d_ns, float* d_sink,
               bool one_per_sm = false) {
    constexpr int kCtas = W == 1 ? 2 : 1;
    // one_per_sm: shared memory padded so that no SM can hold two (W = 2 only)
    const int smem = one_per_sm ? 200 * 1024 : kS * kStageBytes + kTableBytes + 2 * kS * 8 + 1024;
    const int grid = kCtas * sms;
    cudaFuncSetAttribute(task_probe<W, kS, kEpi, kExtras>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    int per_sm = 0;
    cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, task_probe<W, kS, kEpi, kExtras>, 128 * (W + 1), smem);
    for (int rep = 0; rep < 2; ++rep)
        task_probe<W, kS, kEpi, kExtras><<<grid, 128 * (W + 1), smem>>>(num_kb, task_kb, epi_ns, prod_ns, src, d_ns, d_sink);
    if (cudaError_t e = cudaDeviceSynchronize(); e != cudaSuccess) {
        std::printf("tasks W=%d: %s\n", W, cudaGetErrorString(e));
        std::exit(1);
    }
    std::vector<unsigned long long> ns(grid);
    cudaMemcpy(ns.data(), d_ns, grid * sizeof(unsigned long long), cudaMemcpyDeviceToHost);
    std::sort(ns.begin(), ns.end());
    const double per_kb = ns[grid / 2] / double(kCtas * num_kb);
    std::printf("%s%d CTA%s per SM (occupancy %d) x W = %d, %d stages, task %2d K-blocks, epilogue %4d ns (%s), producer pause %4d ns: "
                "%6.1f ns per SM K-block (median CTA; max %.1f), %.0f GB/s%s\n",
                src ? "streamed  " : "in smem   ", kCtas, kCtas > 1 ? "s" : "", per_sm, W, kS, task_kb, epi_ns, kEpi ? "issuing" : "waiting", prod_ns, per_kb,
                ns[grid - 1] / double(kCtas * num_kb), double(grid) * num_kb * (kCodeBytes + kDeltaBytes) / (ns[grid / 2] * 1e-9) / 1e9,
                kExtras ? ", with the kernel's extras 1 | 2 | 8" : "");
}

template <int W, int kMode, int kProducerWork = 0, bool kBusyWarp = false, int kExtras = 0>
void run(int sms, int num_kb, const uint8_t* src, unsigned long long* d_ns, float* d_sink) {
    const int smem = 200 * 1024;   // one CTA per SM
    cudaFuncSetAttribute(probe<W, kMode, kProducerWork, kBusyWarp, kExtras>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    probe<W, kMode, kProducerWork, kBusyWarp, kExtras><<<sms, 128 * (W + 1), smem>>>(num_kb, src, d_ns, d_sink, nullptr);   // warm-up
    cudaDeviceSynchronize();
    probe<W, kMode, kProducerWork, kBusyWarp, kExtras><<<sms, 128 * (W + 1), smem>>>(num_kb, src, d_ns, d_sink, nullptr);
    if (cudaError_t e = cudaDeviceSynchronize(); e != cudaSuccess) {
        std::printf("W=%d mode=%d: %s\n", W, kMode, cudaGetErrorString(e));
        std::exit(1);
    }
    std::vector<unsigned long long> ns(2 * sms);
    cudaMemcpy(ns.data(), d_ns, 2 * sms * sizeof(unsigned long long), cudaMemcpyDeviceToHost);
    std::vector<unsigned long long> cyc(ns.begin() + sms, ns.end());
    ns.resize(sms);
    std::sort(ns.begin(), ns.end());
    std::sort(cyc.begin(), cyc.end());
    const char* modes[] = {"expand + wgmma", "expand only", "wgmma only", "SS via smem", "WG 1 offset", "pipelined"};
    const double t = ns[sms / 2] / double(num_kb), c = cyc[sms / 2] / double(num_kb);
    std::printf("%3d CTAs, %s W = %d math warpgroups (%d M tile%s each), %-14s: %6.1f ns per K-block (median CTA; min %.1f, max %.1f), %5.0f cycles (%.2f GHz)",
                sms, src ? "streamed" : "in smem ", W, 4 / W, W == 4 ? "" : "s", modes[kMode], t, ns[0] / double(num_kb), ns[sms - 1] / double(num_kb), c, c / t);
    if (kProducerWork > 0) std::printf(", producer +%d dependent IMADs a stage", kProducerWork);
    if (kProducerWork < 0) std::printf(", producer +%d IMADs a stage in 4 chains", -kProducerWork);
    if (kBusyWarp) std::printf(", a busy warp on scheduler 1");
    if (kExtras) std::printf(", extras %d", kExtras);
    if (src) std::printf(", %.0f GB/s", double(sms) * num_kb * (kCodeBytes + kDeltaBytes) / (ns[sms / 2] * 1e-9) / 1e9);
    std::printf("\n");
}

int main(int argc, char** argv) {
    const bool pipelined_only = argc > 1 and std::string(argv[1]) == "pipelined";
    const bool tasks_only = argc > 1 and std::string(argv[1]) == "tasks";
    int sms = 0;
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
    const int num_kb = 20000;
    unsigned long long* d_ns;
    float* d_sink;
    cudaMalloc(&d_ns, 2 * sms * sizeof(unsigned long long));
    cudaMalloc(&d_sink, 1024 * sizeof(float));
    // Streamed runs: every CTA its own slice of ~2 GB, kb_stream K-blocks each
    const int kb_stream = static_cast<int>((size_t(2) << 30) / (size_t(sms) * (kCodeBytes + kDeltaBytes)));
    uint8_t* src = nullptr;
    const size_t src_bytes = size_t(sms) * kb_stream * (kCodeBytes + kDeltaBytes) + kABytes;
    if (cudaMalloc(&src, src_bytes) != cudaSuccess) { std::printf("cudaMalloc failed\n"); return 1; }
    cudaMemset(src, 0x13, src_bytes);
    std::printf("%d CTAs (one per SM), %d K-blocks each in shared memory, %d streamed\n", sms, num_kb, kb_stream);
    if (tasks_only) {   // task boundaries: one CTA x two warpgroups against two CTAs x one
        const int kbt = kb_stream / 2 / 96 * 96;   // two CTAs per SM share the region; whole tasks of 16, 32 and 6
        if (argc > 2 and std::string(argv[2]) == "stages") {   // the pair with 2 stages per CTA (what half of today's decode budget leaves)
            for (int rep = 0; rep < 2; ++rep)
                for (int task_kb : {96, 32, 16, 6}) {
                    const int epi = task_kb == 96 ? 0 : task_kb == 6 ? 1000 : task_kb == 16 ? 1600 : 900, pause = task_kb == 96 ? 0 : 1400;
                    run_tasks<2, 6, 0, 11>(sms, kbt, task_kb, epi, pause, src, d_ns, d_sink, true);
                    run_tasks<1, 2, 0, 11>(sms, kbt, task_kb, epi, pause, src, d_ns, d_sink);
                    run_tasks<1, 3, 0, 11>(sms, kbt, task_kb, epi, pause, src, d_ns, d_sink);
                }
            return 0;
        }
        if (argc > 2 and std::string(argv[2]) == "checks") {   // the math alone, and W = 2 held to one CTA per SM
            for (int rep = 0; rep < 2; ++rep) {
                run_tasks<2, 6, 0>(sms, 19200, 96, 0, 0, nullptr, d_ns, d_sink);
                run_tasks<1, 3, 0>(sms, 19200, 96, 0, 0, nullptr, d_ns, d_sink);
                run_tasks<2, 6, 0>(sms, 19200, 16, 1600, 1400, nullptr, d_ns, d_sink);
                run_tasks<1, 3, 0>(sms, 19200, 16, 1600, 1400, nullptr, d_ns, d_sink);
                run_tasks<2, 6, 0>(sms, kbt, 96, 0, 0, src, d_ns, d_sink, true);
                run_tasks<2, 6, 0>(sms, kbt, 16, 1600, 1400, src, d_ns, d_sink, true);
                run_tasks<2, 6, 0>(sms, kbt, 6, 1000, 1400, src, d_ns, d_sink, true);
                run_tasks<1, 3, 0>(sms, kbt, 16, 3200, 2800, src, d_ns, d_sink);
                run_tasks<1, 3, 0>(sms, kbt, 6, 2000, 2800, src, d_ns, d_sink);
                // with what the kernel's K-block has beyond the model (scales, opaque stage, top-k loads)
                run_tasks<2, 6, 0, 11>(sms, 19200, 96, 0, 0, nullptr, d_ns, d_sink);
                run_tasks<1, 3, 0, 11>(sms, 19200, 96, 0, 0, nullptr, d_ns, d_sink);
                run_tasks<2, 6, 0, 11>(sms, kbt, 96, 0, 0, src, d_ns, d_sink, true);
                run_tasks<1, 3, 0, 11>(sms, kbt, 96, 0, 0, src, d_ns, d_sink);
                run_tasks<2, 6, 0, 11>(sms, kbt, 16, 1600, 1400, src, d_ns, d_sink, true);
                run_tasks<1, 3, 0, 11>(sms, kbt, 16, 1600, 1400, src, d_ns, d_sink);
                run_tasks<2, 6, 0, 11>(sms, kbt, 6, 1000, 1400, src, d_ns, d_sink, true);
                run_tasks<1, 3, 0, 11>(sms, kbt, 6, 1000, 1400, src, d_ns, d_sink);
            }
            return 0;
        }
        for (int rep = 0; rep < 2; ++rep) {
            run_tasks<2, 6, 0>(sms, kbt, 96, 0, 0, src, d_ns, d_sink);
            run_tasks<1, 3, 0>(sms, kbt, 96, 0, 0, src, d_ns, d_sink);
            run_tasks<1, 6, 0>(sms, kbt, 96, 0, 0, src, d_ns, d_sink);
            for (int task_kb : {16, 6, 32}) {
                const int epi = task_kb == 6 ? 1000 : task_kb == 16 ? 1600 : 900;
                run_tasks<2, 6, 0>(sms, kbt, task_kb, epi, 1400, src, d_ns, d_sink);
                run_tasks<1, 3, 0>(sms, kbt, task_kb, epi, 1400, src, d_ns, d_sink);
                run_tasks<1, 6, 0>(sms, kbt, task_kb, epi, 1400, src, d_ns, d_sink);
                run_tasks<2, 6, 1>(sms, kbt, task_kb, epi, 1400, src, d_ns, d_sink);
                run_tasks<1, 3, 1>(sms, kbt, task_kb, epi, 1400, src, d_ns, d_sink);
            }
        }
        return 0;
    }
    if (pipelined_only) {   // mode 5 against mode 0, in shared memory and streamed (K-blocks: multiples of 4)
        const int kb4 = kb_stream / 4 * 4;
        for (int rep = 0; rep < 2; ++rep) {
            run<2, 0>(sms, num_kb, nullptr, d_ns, d_sink);
            run<2, 5>(sms, num_kb, nullptr, d_ns, d_sink);
            run<2, 0>(sms, kb4, src, d_ns, d_sink);
            run<2, 5>(sms, kb4, src, d_ns, d_sink);
            run<2, 0>(96, kb4, src, d_ns, d_sink);
            run<2, 5>(96, kb4, src, d_ns, d_sink);
        }
        return 0;
    }
    run<2, 0>(sms, num_kb, nullptr, d_ns, d_sink);
    run<4, 0>(sms, num_kb, nullptr, d_ns, d_sink);
    run<1, 0>(sms, num_kb, nullptr, d_ns, d_sink);
    run<2, 1>(sms, num_kb, nullptr, d_ns, d_sink);
    run<4, 1>(sms, num_kb, nullptr, d_ns, d_sink);
    run<2, 2>(sms, num_kb, nullptr, d_ns, d_sink);
    run<4, 2>(sms, num_kb, nullptr, d_ns, d_sink);
    run<2, 3>(sms, num_kb, nullptr, d_ns, d_sink);
    run<4, 3>(sms, num_kb, nullptr, d_ns, d_sink);
    run<2, 4>(sms, num_kb, nullptr, d_ns, d_sink);
    run<2, 0>(sms, kb_stream, src, d_ns, d_sink);
    run<4, 0>(sms, kb_stream, src, d_ns, d_sink);
    run<2, 1>(sms, kb_stream, src, d_ns, d_sink);
    run<2, 2>(sms, kb_stream, src, d_ns, d_sink);
    run<2, 3>(sms, kb_stream, src, d_ns, d_sink);
    run<2, 4>(sms, kb_stream, src, d_ns, d_sink);
    run<2, 0>(96, kb_stream, src, d_ns, d_sink);   // v4-flash at one token: 96 CTAs with a task
    run<2, 0, 100>(sms, kb_stream, src, d_ns, d_sink);
    run<2, 0, 200>(sms, kb_stream, src, d_ns, d_sink);
    run<2, 0, 400>(sms, kb_stream, src, d_ns, d_sink);
    run<2, 0, 100>(96, kb_stream, src, d_ns, d_sink);
    run<2, 0, 200>(96, kb_stream, src, d_ns, d_sink);
    run<2, 0, 50>(sms, kb_stream, src, d_ns, d_sink);
    run<2, 0, -100>(sms, kb_stream, src, d_ns, d_sink);
    run<2, 0, -200>(sms, kb_stream, src, d_ns, d_sink);
    run<2, 0, 0, true>(sms, kb_stream, src, d_ns, d_sink);
    run<2, 0, 0, true>(sms, num_kb, nullptr, d_ns, d_sink);
    run<2, 0, 0, false, 1>(sms, num_kb, nullptr, d_ns, d_sink);
    run<2, 0, 0, false, 2>(sms, num_kb, nullptr, d_ns, d_sink);
    run<2, 0, 0, false, 4>(sms, num_kb, nullptr, d_ns, d_sink);
    run<2, 0, 0, false, 8>(sms, num_kb, nullptr, d_ns, d_sink);
    run<2, 0, 0, false, 15>(sms, num_kb, nullptr, d_ns, d_sink);
    run<2, 0, 0, false, 15>(sms, kb_stream, src, d_ns, d_sink);
    run<2, 0, 0, false, 15>(96, kb_stream, src, d_ns, d_sink);
    return 0;
}
