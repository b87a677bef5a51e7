// Does compute-sanitizer racecheck order shared-memory accesses across two warpgroups through a
// named barrier with a thread count (bar.sync id, 256)? Warpgroup 1 writes, both meet at barrier 4,
// warpgroup 0 reads, both meet again, repeated: correct code, so any hazard it reports is about the
// tool's model of such barriers, not about the kernel (see scripts/device_run.sh).
//   nvcc -arch=sm_90a -o /tmp/probe scripts/racecheck_probe.cu && compute-sanitizer --tool racecheck /tmp/probe
#include <cstdio>

__device__ __forceinline__ void bar(int id, int n) { asm volatile("bar.sync %0, %1;\n" :: "r"(id), "r"(n) : "memory"); }

__global__ void probe(float* out) {
    __shared__ float xchg[32 * 128];
    const int wg = threadIdx.x / 128 - 1, tid = threadIdx.x % 128;   // warpgroup 0 of 3 does not take part
    if (wg < 0) return;
    float sum = 0.0f;
    for (int it = 0; it < 4; ++it) {
        for (int pass = 0; pass < 2; ++pass) {
            if (wg == 1)
                for (int i = 0; i < 32; ++i) xchg[i * 128 + tid] = static_cast<float>(it * 64 + pass * 32 + i + tid);
            bar(4, 256);
            if (wg == 0)
                for (int i = 0; i < 32; ++i) sum += xchg[i * 128 + tid];
            bar(4, 256);
        }
    }
    if (wg == 0) out[tid] = sum;
}

int main() {
    float* out;
    cudaMalloc(&out, 128 * sizeof(float));
    probe<<<1, 384>>>(out);
    const cudaError_t e = cudaDeviceSynchronize();
    std::printf("probe: %s\n", cudaGetErrorString(e));
    return e == cudaSuccess ? 0 : 1;
}
