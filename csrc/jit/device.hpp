#pragma once

// Contexts, device properties and the SM-count setting.
//
// Contexts: PyTorch (through the CUDA runtime) makes the primary context of its current device
// current on every thread that touched CUDA, so normally we just use what is current. A thread
// with no current context (a fresh Python thread, a C++ caller without torch) gets the primary
// context of the requested device retained and made current, which is the same context the
// runtime would use: kernels we load are visible to torch's streams and vice versa.

#include <atomic>
#include <map>
#include <mutex>
#include <optional>
#include <string>

#include "driver.hpp"

namespace deep_gemm::jit {

// Properties of one device that the launchers and heuristics need, queried once per device
// (attributes do not change while a process runs).
struct DeviceInfo {
    int ordinal = 0;
    std::string name;
    int compute_capability_major = 0, compute_capability_minor = 0;
    int num_sms = 0;
    int max_smem_per_block_optin = 0;  // bytes one block may use after opting in (227 KB on H100/H200)
    int max_smem_per_sm = 0;           // bytes
    int max_threads_per_sm = 0;
    int max_registers_per_sm = 0;      // 32-bit registers
    int l2_cache_bytes = 0;
    int clock_rate_khz = 0;            // peak SM clock
    int memory_clock_rate_khz = 0;
    int memory_bus_width_bits = 0;
    size_t total_memory_bytes = 0;

    int compute_capability() const { return compute_capability_major * 10 + compute_capability_minor; }
};

// The device of the calling thread's current context, or -1 if it has none. Creates nothing.
inline int current_context_device() {
    const auto& d = driver();
    CUcontext context = nullptr;
    d.check(d.cuCtxGetCurrent(&context), "cuCtxGetCurrent");
    if (context == nullptr)
        return -1;
    CUdevice device = 0;
    d.check(d.cuCtxGetDevice(&device), "cuCtxGetDevice");
    return static_cast<int>(device);
}

// The device that a call without an explicit device refers to: the current context's, else 0
// (torch's default device). Creates nothing.
inline int current_device() {
    const int device = current_context_device();
    return device >= 0 ? device : 0;
}

inline int device_count() {
    const auto& d = driver();
    int count = 0;
    d.check(d.cuDeviceGetCount(&count), "cuDeviceGetCount");
    return count;
}

inline void check_device_ordinal(int ordinal) {
    const int count = device_count();
    if (ordinal < 0 or ordinal >= count)
        raise_invalid_argument("device ordinal ", ordinal, " out of range: ", count, " CUDA device(s) visible");
}

// Make sure the calling thread has a current context and return it. With `ordinal` < 0 any
// current context is accepted (the common path: one cuCtxGetCurrent, ~20 ns); otherwise a
// current context of another device is an error, since the caller's pointers would not be valid
// in it.
inline CUcontext ensure_context(int ordinal = -1) {
    const auto& d = driver();
    CUcontext context = nullptr;
    d.check(d.cuCtxGetCurrent(&context), "cuCtxGetCurrent");
    if (context != nullptr) {
        if (ordinal >= 0) {
            CUdevice device = 0;
            d.check(d.cuCtxGetDevice(&device), "cuCtxGetDevice");
            if (static_cast<int>(device) != ordinal)
                raise_runtime_error("the current CUDA context belongs to device ", device, ", not device ", ordinal,
                                    ": call torch.cuda.set_device(", ordinal, ") first");
        }
        return context;
    }

    // Retain each primary context once and keep it for the life of the process: releasing it
    // would tear down our modules (and torch's state) while torch still uses the device.
    static std::mutex mutex;
    static std::map<int, CUcontext> retained;
    const int device_ordinal = ordinal >= 0 ? ordinal : 0;
    std::lock_guard<std::mutex> lock(mutex);
    auto it = retained.find(device_ordinal);
    if (it == retained.end()) {
        check_device_ordinal(device_ordinal);
        CUdevice device = 0;
        d.check(d.cuDeviceGet(&device, device_ordinal), "cuDeviceGet");
        CUcontext primary = nullptr;
        d.check(d.cuDevicePrimaryCtxRetain(&primary, device), "cuDevicePrimaryCtxRetain",
                "device " + std::to_string(device_ordinal));
        it = retained.emplace(device_ordinal, primary).first;
    }
    d.check(d.cuCtxSetCurrent(it->second), "cuCtxSetCurrent");
    return it->second;
}

inline const DeviceInfo& device_info(int ordinal) {
    static std::mutex mutex;
    static std::map<int, DeviceInfo> cache;  // node-based: references stay valid as it grows
    std::lock_guard<std::mutex> lock(mutex);
    if (auto it = cache.find(ordinal); it != cache.end())
        return it->second;

    const auto& d = driver();
    check_device_ordinal(ordinal);
    CUdevice device = 0;
    d.check(d.cuDeviceGet(&device, ordinal), "cuDeviceGet");
    const auto attribute = [&](CUdevice_attribute attr, const char* attr_name) {
        int value = 0;
        d.check(d.cuDeviceGetAttribute(&value, attr, device), "cuDeviceGetAttribute", attr_name);
        return value;
    };

    DeviceInfo info;
    info.ordinal = ordinal;
    char name[256] = {};
    d.check(d.cuDeviceGetName(name, sizeof(name) - 1, device), "cuDeviceGetName");
    info.name = name;
    info.compute_capability_major = attribute(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, "compute capability major");
    info.compute_capability_minor = attribute(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, "compute capability minor");
    info.num_sms = attribute(CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, "multiprocessor count");
    info.max_smem_per_block_optin = attribute(CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN, "max shared memory per block (opt-in)");
    info.max_smem_per_sm = attribute(CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR, "max shared memory per SM");
    info.max_threads_per_sm = attribute(CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_MULTIPROCESSOR, "max threads per SM");
    info.max_registers_per_sm = attribute(CU_DEVICE_ATTRIBUTE_MAX_REGISTERS_PER_MULTIPROCESSOR, "max registers per SM");
    info.l2_cache_bytes = attribute(CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE, "L2 cache size");
    info.clock_rate_khz = attribute(CU_DEVICE_ATTRIBUTE_CLOCK_RATE, "clock rate");
    info.memory_clock_rate_khz = attribute(CU_DEVICE_ATTRIBUTE_MEMORY_CLOCK_RATE, "memory clock rate");
    info.memory_bus_width_bits = attribute(CU_DEVICE_ATTRIBUTE_GLOBAL_MEMORY_BUS_WIDTH, "memory bus width");
    d.check(d.cuDeviceTotalMem_v2(&info.total_memory_bytes, device), "cuDeviceTotalMem");
    return cache.emplace(ordinal, std::move(info)).first->second;
}

inline const DeviceInfo& current_device_info() { return device_info(current_device()); }

// Peak HBM bandwidth of a device in GB/s: double data rate x memory clock x bus width (H100 SXM:
// 2 x 2619 MHz x 5120 bits = 3352; H200: 2 x 3201 MHz x 6144 bits = 4917)
inline int hbm_gbps(const DeviceInfo& info) {
    return static_cast<int>(2.0 * info.memory_clock_rate_khz * 1e3 * (info.memory_bus_width_bits / 8) / 1e9);
}

// Driver version as an integer, e.g. 13000 for CUDA 13.0 (what cuDriverGetVersion reports).
inline int driver_version() {
    const auto& d = driver();
    int version = 0;
    d.check(d.cuDriverGetVersion(&version), "cuDriverGetVersion");
    return version;
}

// ---------------------------------------------------------------------------------------------
// SM count. The persistent kernels size their grid from this, and a serving engine that runs
// other work beside them (DESIGN §6: the kernel must not assume it owns the GPU) lowers it.
// 0 = not set: use every SM of the current device.
// ---------------------------------------------------------------------------------------------

inline std::atomic<int>& num_sms_setting() {
    static std::atomic<int> value{0};
    return value;
}

// Validated against the current device when one is reachable. With no driver or no GPU the
// value is stored unchecked (a CPU-only host may prepare settings or run heuristics tests) and
// checked against the device by `get_num_sms()`'s callers at launch.
inline void set_num_sms(int num_sms) {
    if (num_sms < 0)
        raise_invalid_argument("set_num_sms: num_sms must be >= 1 (or 0 to use all SMs), got ", num_sms);
    if (num_sms > 0 and has_cuda_driver()) {
        std::optional<int> device_sms;
        try {
            device_sms = current_device_info().num_sms;
        } catch (const std::exception&) {
            // Driver present but no usable device (e.g. CUDA_ERROR_NO_DEVICE): nothing to check against
        }
        if (device_sms.has_value() and num_sms > *device_sms)
            raise_invalid_argument("set_num_sms: num_sms must be in [1, ", *device_sms, "] (the SMs of device ",
                                   current_device(), "), got ", num_sms);
    }
    num_sms_setting().store(num_sms, std::memory_order_relaxed);
}

// The set value, or the current device's SM count when none is set (which needs the driver and
// raises the no-driver error on a CPU-only machine).
inline int get_num_sms() {
    const int value = num_sms_setting().load(std::memory_order_relaxed);
    return value > 0 ? value : current_device_info().num_sms;
}

}  // namespace deep_gemm::jit
