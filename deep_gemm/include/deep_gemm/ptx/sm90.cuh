#pragma once

// Thin wrappers over the SM90 PTX this project uses: mbarriers, TMA, memory-ordering primitives,
// warpgroup register reallocation. Each wrapper is one instruction (or a short fixed sequence), so
// SASS reads back to these names.

#include <cstdint>
#include <cuda.h>

namespace deep_gemm::ptx {

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
    return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ int lane_idx() { return static_cast<int>(threadIdx.x & 31); }

// Warp index that the compiler knows is uniform across the warp
__device__ __forceinline__ int warp_idx() { return __shfl_sync(0xffffffff, static_cast<int>(threadIdx.x / 32), 0); }

__device__ __forceinline__ bool elect_one() {
    uint32_t pred = 0;
    asm volatile(
        "{\n .reg .pred p;\n elect.sync _|p, 0xffffffff;\n selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(pred));
    return pred != 0;
}

// ---------------------------------------------------------------------------------------------
// Register reallocation between warpgroups (needs __launch_bounds__(threads, 1))
template <int kRegisters>
__device__ __forceinline__ void setmaxnreg_inc() { asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" :: "n"(kRegisters)); }
template <int kRegisters>
__device__ __forceinline__ void setmaxnreg_dec() { asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" :: "n"(kRegisters)); }

// Named barrier over `num_threads` threads (multiple of 32); id 0 is __syncthreads
__device__ __forceinline__ void named_barrier(int id, int num_threads) {
    asm volatile("bar.sync %0, %1;\n" :: "r"(id), "r"(num_threads) : "memory");
}

// Named barrier that also ORs a predicate over its threads: every thread gets the same answer, so
// a group can take one decision (leave on abort) without splitting at its next barrier or wgmma
__device__ __forceinline__ bool named_barrier_or(int id, int num_threads, bool pred) {
    uint32_t any = 0;
    asm volatile(
        "{\n .reg .pred p, q;\n setp.ne.u32 p, %1, 0;\n bar.red.or.pred q, %2, %3, p;\n selp.u32 %0, 1, 0, q;\n}\n"
        : "=r"(any) : "r"(static_cast<uint32_t>(pred)), "r"(id), "r"(num_threads) : "memory");
    return any != 0;
}

// ---------------------------------------------------------------------------------------------
// mbarrier
__device__ __forceinline__ void mbarrier_init(uint64_t* bar, uint32_t count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" :: "r"(smem_addr(bar)), "r"(count) : "memory");
}

__device__ __forceinline__ void fence_barrier_init() {
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}

__device__ __forceinline__ void mbarrier_arrive(uint64_t* bar) {
    asm volatile("{\n .reg .b64 st;\n mbarrier.arrive.shared::cta.b64 st, [%0];\n}\n" :: "r"(smem_addr(bar)) : "memory");
}

// `count` arrivals at once (one thread standing for a group)
__device__ __forceinline__ void mbarrier_arrive_count(uint64_t* bar, uint32_t count) {
    asm volatile("{\n .reg .b64 st;\n mbarrier.arrive.shared::cta.b64 st, [%0], %1;\n}\n" :: "r"(smem_addr(bar)), "r"(count) : "memory");
}

// A probe that answers at once (try_wait may first wait a while for the phase)
__device__ __forceinline__ bool mbarrier_test_wait(uint64_t* bar, uint32_t parity) {
    uint32_t done = 0;
    asm volatile(
        "{\n .reg .pred p;\n mbarrier.test_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done) : "r"(smem_addr(bar)), "r"(parity) : "memory");
    return done != 0;
}

__device__ __forceinline__ void mbarrier_arrive_expect_tx(uint64_t* bar, uint32_t bytes) {
    asm volatile("{\n .reg .b64 st;\n mbarrier.arrive.expect_tx.shared::cta.b64 st, [%0], %1;\n}\n"
                 :: "r"(smem_addr(bar)), "r"(bytes) : "memory");
}

// Expect `bytes` more of async-proxy writes in the current phase, without arriving
__device__ __forceinline__ void mbarrier_expect_tx(uint64_t* bar, uint32_t bytes) {
    asm volatile("mbarrier.expect_tx.relaxed.cta.shared::cta.b64 [%0], %1;\n" :: "r"(smem_addr(bar)), "r"(bytes) : "memory");
}

// One probe: true once the phase with this parity has completed. try_wait may hold the thread
// for a system-dependent while before it answers false (mbarrier_test_wait answers at once)
__device__ __forceinline__ bool mbarrier_try_wait(uint64_t* bar, uint32_t parity) {
    uint32_t done = 0;
    asm volatile(
        "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done) : "r"(smem_addr(bar)), "r"(parity) : "memory");
    return done != 0;
}
// The same with a suspend-time hint: a thread whose phase is not complete may sleep up to
// kSuspendNs (waking when the phase completes) instead of the hardware's default short while, so a
// long wait issues few instructions. kSuspendNs = 0: the plain try_wait above.
template <uint32_t kSuspendNs>
__device__ __forceinline__ bool mbarrier_try_wait_suspend(uint64_t* bar, uint32_t parity) {
    if constexpr (kSuspendNs == 0) {
        return mbarrier_try_wait(bar, parity);
    } else {
        uint32_t done = 0;
        asm volatile(
            "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2, %3;\n selp.u32 %0, 1, 0, p;\n}\n"
            : "=r"(done) : "r"(smem_addr(bar)), "r"(parity), "n"(kSuspendNs) : "memory");
        return done != 0;
    }
}

// ---------------------------------------------------------------------------------------------
// Programmatic dependent launch (a kernel launched with PROGRAMMATIC_STREAM_SERIALIZATION may start
// while the kernel before it on its stream still runs). The executing thread waits until the grids
// this one depends on have completed and their writes are visible; without the launch attribute
// (or after a non-kernel operation) it returns at once.
__device__ __forceinline__ void griddepcontrol_wait() { asm volatile("griddepcontrol.wait;\n" ::: "memory"); }
// Lets the next such kernel on the stream be scheduled (once every CTA of this grid has issued it
// or exited); one thread per CTA suffices. The dependent still waits (above) before it reads.
__device__ __forceinline__ void griddepcontrol_launch_dependents() { asm volatile("griddepcontrol.launch_dependents;\n" :::); }

// ---------------------------------------------------------------------------------------------
// TMA (bulk tensor copies, plain sm_90)
__device__ __forceinline__ void prefetch_tma_descriptor(const CUtensorMap* desc) {
    asm volatile("prefetch.tensormap [%0];\n" :: "l"(reinterpret_cast<uint64_t>(desc)) : "memory");
}

__device__ __forceinline__ void tma_load_2d(void* smem_dst, const CUtensorMap* desc, uint64_t* bar,
                                            int32_t inner, int32_t outer) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4}], [%2];\n"
        :: "r"(smem_addr(smem_dst)), "l"(reinterpret_cast<uint64_t>(desc)), "r"(smem_addr(bar)),
           "r"(inner), "r"(outer)
        : "memory");
}
// 3-D and 4-D boxes (coordinates innermost first)
__device__ __forceinline__ void tma_load_3d(void* smem_dst, const CUtensorMap* desc, uint64_t* bar, int32_t c0, int32_t c1, int32_t c2) {
    asm volatile(
        "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, %5}], [%2];\n"
        :: "r"(smem_addr(smem_dst)), "l"(reinterpret_cast<uint64_t>(desc)), "r"(smem_addr(bar)), "r"(c0), "r"(c1), "r"(c2)
        : "memory");
}
__device__ __forceinline__ void tma_load_4d(void* smem_dst, const CUtensorMap* desc, uint64_t* bar, int32_t c0, int32_t c1, int32_t c2,
                                            int32_t c3) {
    asm volatile(
        "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, %5, %6}], [%2];\n"
        :: "r"(smem_addr(smem_dst)), "l"(reinterpret_cast<uint64_t>(desc)), "r"(smem_addr(bar)), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
        : "memory");
}

// Contiguous global -> shared copy through the TMA unit, counted on `bar` like a tensor load.
// `bytes`, both addresses: multiples of 16.
__device__ __forceinline__ void bulk_load(void* smem_dst, const void* src, uint32_t bytes, uint64_t* bar) {
    asm volatile(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n"
        :: "r"(smem_addr(smem_dst)), "l"(reinterpret_cast<uint64_t>(src)), "r"(bytes), "r"(smem_addr(bar))
        : "memory");
}

// Contiguous shared -> global copy through the TMA unit, in this thread's current bulk group
// (bulk_commit closes it). `bytes`, both addresses: multiples of 16.
__device__ __forceinline__ void bulk_store(void* dst, const void* smem_src, uint32_t bytes) {
    asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;\n"
                 :: "l"(reinterpret_cast<uint64_t>(dst)), "r"(smem_addr(smem_src)), "r"(bytes) : "memory");
}
__device__ __forceinline__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }
// Until at most kPending of this thread's bulk groups are left with shared memory still to read
template <int kPending>
__device__ __forceinline__ void bulk_wait_read() { asm volatile("cp.async.bulk.wait_group.read %0;\n" :: "n"(kPending) : "memory"); }
// Until at most kPending of this thread's bulk groups are left incomplete (their writes not yet done)
template <int kPending>
__device__ __forceinline__ void bulk_wait() { asm volatile("cp.async.bulk.wait_group %0;\n" :: "n"(kPending) : "memory"); }

// One 4-byte global -> shared copy (cp.async, not the TMA unit: too small for a bulk copy).
// Completion is tracked by `cp_async_arrive_on` on an mbarrier, not by cp.async groups.
__device__ __forceinline__ void cp_async_4(void* smem_dst, const void* src) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n"
                 :: "r"(smem_addr(smem_dst)), "l"(reinterpret_cast<uint64_t>(src)) : "memory");
}

// `bar`'s current phase also waits for every cp.async this thread issued so far: the pending count
// is raised by one now and the arrival happens when those copies land (count-neutral, no .noinc)
__device__ __forceinline__ void cp_async_arrive_on(uint64_t* bar) {
    asm volatile("cp.async.mbarrier.arrive.shared::cta.b64 [%0];\n" :: "r"(smem_addr(bar)) : "memory");
}

// Generic-proxy writes (st.global) must be fenced before the async proxy (TMA) reads them
__device__ __forceinline__ void fence_proxy_async_global() { asm volatile("fence.proxy.async.global;\n" ::: "memory"); }
__device__ __forceinline__ void fence_proxy_async_shared() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

// ---------------------------------------------------------------------------------------------
// Memory ordering across CTAs (gpu scope) and across GPUs (sys scope)
__device__ __forceinline__ uint32_t ld_acquire_gpu(const uint32_t* p) {
    uint32_t v;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];\n" : "=r"(v) : "l"(p) : "memory");
    return v;
}

// A strong relaxed load: followed by fence.acq_rel it acquires (the value is awaited at first use)
__device__ __forceinline__ uint32_t ld_relaxed_gpu(const uint32_t* p) {
    uint32_t v;
    asm volatile("ld.relaxed.gpu.global.u32 %0, [%1];\n" : "=r"(v) : "l"(p) : "memory");
    return v;
}

__device__ __forceinline__ void fence_acq_rel_gpu() { asm volatile("fence.acq_rel.gpu;\n" ::: "memory"); }

__device__ __forceinline__ uint64_t ld_acquire_sys(const uint64_t* p) {
    uint64_t v;
    asm volatile("ld.acquire.sys.global.u64 %0, [%1];\n" : "=l"(v) : "l"(p) : "memory");
    return v;
}

__device__ __forceinline__ uint64_t ld_acquire_gpu_u64(const uint64_t* p) {
    uint64_t v;
    asm volatile("ld.acquire.gpu.global.u64 %0, [%1];\n" : "=l"(v) : "l"(p) : "memory");
    return v;
}

__device__ __forceinline__ uint64_t ld_volatile(const uint64_t* p) {
    uint64_t v;
    asm volatile("ld.volatile.global.u64 %0, [%1];\n" : "=l"(v) : "l"(p) : "memory");
    return v;
}

__device__ __forceinline__ void st_release_sys(uint64_t* p, uint64_t v) {
    asm volatile("st.release.sys.global.u64 [%0], %1;\n" :: "l"(p), "l"(v) : "memory");
}

__device__ __forceinline__ void st_release_gpu_u64(uint64_t* p, uint64_t v) {
    asm volatile("st.release.gpu.global.u64 [%0], %1;\n" :: "l"(p), "l"(v) : "memory");
}

__device__ __forceinline__ void red_release_gpu_add(uint32_t* p, uint32_t v) {
    asm volatile("red.release.gpu.global.add.u32 [%0], %1;\n" :: "l"(p), "r"(v) : "memory");
}

__device__ __forceinline__ uint32_t atom_acq_rel_gpu_add(uint32_t* p, uint32_t v) {
    uint32_t old;
    asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], %2;\n" : "=r"(old) : "l"(p), "r"(v) : "memory");
    return old;
}

__device__ __forceinline__ void fence_acq_rel_sys() { asm volatile("fence.acq_rel.sys;\n" ::: "memory"); }

__device__ __forceinline__ uint64_t globaltimer_ns() {
    uint64_t t;
    asm volatile("mov.u64 %0, %%globaltimer;\n" : "=l"(t));
    return t;
}

// ---------------------------------------------------------------------------------------------
// 16-byte global accesses
__device__ __forceinline__ int4 ld_global_nc(const int4* p) {
    int4 v;
    asm volatile("ld.global.nc.L1::no_allocate.v4.s32 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}

// Loads of data another GPU or CTA wrote during this launch: no non-coherent path
__device__ __forceinline__ int4 ld_global_relaxed(const int4* p) {
    int4 v;
    asm volatile("ld.relaxed.sys.global.v4.s32 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p) : "memory");
    return v;
}

// ---------------------------------------------------------------------------------------------
// Shared-window accesses by 32-bit address (the compiler cannot always tell that a pointer into
// dynamic shared memory is one, and then emits generic 64-bit loads with their address math)
__device__ __forceinline__ uint2 ld_shared_v2(uint32_t addr) {
    uint2 v;
    asm volatile("ld.shared.v2.u32 {%0, %1}, [%2];\n" : "=r"(v.x), "=r"(v.y) : "r"(addr) : "memory");
    return v;
}
__device__ __forceinline__ float ld_shared_f32(uint32_t addr) {
    float v;
    asm volatile("ld.shared.f32 %0, [%1];\n" : "=f"(v) : "r"(addr) : "memory");
    return v;
}
// A flag other threads of the CTA write (no caching of the value in a register across calls)
__device__ __forceinline__ int ld_volatile_shared_s32(uint32_t addr) {
    int v;
    asm volatile("ld.volatile.shared.s32 %0, [%1];\n" : "=r"(v) : "r"(addr) : "memory");
    return v;
}
__device__ __forceinline__ uint32_t ld_shared_u32(uint32_t addr) {
    uint32_t v;
    asm volatile("ld.shared.u32 %0, [%1];\n" : "=r"(v) : "r"(addr) : "memory");
    return v;
}
__device__ __forceinline__ uint4 ld_shared_v4(uint32_t addr) {
    uint4 v;
    asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(addr) : "memory");
    return v;
}
__device__ __forceinline__ void st_shared_u32(uint32_t addr, uint32_t v) {
    asm volatile("st.shared.u32 [%0], %1;\n" :: "r"(addr), "r"(v) : "memory");
}

__device__ __forceinline__ void st_shared_f32(uint32_t addr, float v) {
    asm volatile("st.shared.f32 [%0], %1;\n" :: "r"(addr), "f"(v) : "memory");
}
// Word i (a compile-time constant after unrolling) of a 16-byte load
__device__ __forceinline__ uint32_t word_of(const uint4& v, int i) { return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w; }
// Four 8 x 8 matrices of 16-bit elements (8 rows of 16 bytes each) into shared memory, one warp:
// lane l gives the address of row l % 8 of matrix l / 8 (16-byte aligned, any row order) and holds
// in register i the 32-bit word l % 4 (bytes 4 (l % 4) .. + 3) of row l / 4 of matrix i
// (PTX ISA, stmatrix, sm_90)
__device__ __forceinline__ void stmatrix_x4(uint32_t addr, uint32_t r0, uint32_t r1, uint32_t r2, uint32_t r3) {
    asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n"
                 :: "r"(addr), "r"(r0), "r"(r1), "r"(r2), "r"(r3) : "memory");
}
// prmt.b32 in its default mode: byte i of the result is byte (sel nibble i & 7) of {b, a}, or, when
// bit 3 of that nibble is set, that byte's bit 7 copied into all 8 bits (CUDA's __byte_perm
// documents only the low 3 bits of each nibble)
__device__ __forceinline__ uint32_t prmt(uint32_t a, uint32_t b, uint32_t sel) {
    uint32_t d;
    asm("prmt.b32 %0, %1, %2, %3;\n" : "=r"(d) : "r"(a), "r"(b), "r"(sel));
    return d;
}

}  // namespace deep_gemm::ptx
