// Diagnostic (session 8): can a kernel read, or prefetch into L2, its own code through a function
// pointer? If so, the Mega MoE kernel could warm its code into L2 at launch (after an L2 flush
// about 6 us of a one-token call is the code coming from HBM, docs/PERF.md).
//   nvcc -arch=sm_90a -o /tmp/code_addr_probe scripts/code_addr_probe.cu && /tmp/code_addr_probe
// Answer on the H200 (session 8): no. A __global__ function's address reads 0 in device code without
// dynamic parallelism, a __device__ function's is a module-relative offset (0x2c0), and a load from
// it faults ("an illegal memory access"); the bulk L2 prefetch of it is accepted but means nothing.
#include <cstdio>
#include <cstdint>
#include <cuda_runtime.h>

__device__ __noinline__ int helper(int x) { return x * 3 + 1; }

__global__ void probe(unsigned long long* out, int mode) {
    const void* self = reinterpret_cast<const void*>(&probe);
    const void* fn = reinterpret_cast<const void*>(&helper);
    out[0] = reinterpret_cast<unsigned long long>(self);
    out[1] = reinterpret_cast<unsigned long long>(fn);
    out[4] = helper(mode);
    if (mode == 1) {
        asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;\n" :: "l"(reinterpret_cast<uint64_t>(self)), "r"(4096) : "memory");
        out[2] = 1;
    }
    if (mode == 2) {
        unsigned v;
        asm volatile("ld.global.nc.u32 %0, [%1];\n" : "=r"(v) : "l"(reinterpret_cast<uint64_t>(self)));
        out[3] = v;
    }
}

int main() {
    unsigned long long* out;
    cudaMalloc(&out, 64);
    for (int mode = 0; mode < 3; ++mode) {
        cudaMemset(out, 0, 64);
        probe<<<1, 1>>>(out, mode);
        cudaError_t e = cudaDeviceSynchronize();
        unsigned long long h[5] = {};
        if (e == cudaSuccess) cudaMemcpy(h, out, 40, cudaMemcpyDeviceToHost);
        printf("mode %d (%s): %s self=%#llx helper=%#llx prefetched=%llu word=%#llx\n", mode,
               mode == 0 ? "pointers" : mode == 1 ? "bulk prefetch L2" : "ld.global", cudaGetErrorString(e), h[0], h[1], h[2], h[3]);
        if (e != cudaSuccess) { cudaDeviceReset(); cudaMalloc(&out, 64); }
    }
    return 0;
}
