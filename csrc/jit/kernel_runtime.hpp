#pragma once

// Load compiled cubins and launch their kernels through the driver API.
//
// The hot path of a Mega MoE call is `get_kernel` (one cuCtxGetCurrent and one hash lookup,
// well under 1 us) followed by `launch` (one cuLaunchKernelEx). Everything slow (module load,
// attribute queries, the shared-memory opt-in) happens once per kernel and context.
//
// Modules belong to a context, so the cache key is (cubin path, symbol, context); with torch
// that context is the primary context of the tensor's device, i.e. one entry per device.

#include <cstdint>
#include <filesystem>
#include <memory>
#include <mutex>
#include <sstream>
#include <string>
#include <unordered_map>
#include <vector>

#include "compiler.hpp"
#include "device.hpp"
#include "driver.hpp"

namespace deep_gemm::jit {

struct Dim3 {
    uint32_t x = 1, y = 1, z = 1;
};

// Dynamic shared memory above this needs an explicit per-function opt-in (a CUDA rule since Volta)
inline constexpr uint32_t kDefaultMaxDynamicSmem = 48 * 1024;

struct LaunchConfig {
    Dim3 grid, block;
    uint32_t smem_bytes = 0;   // dynamic shared memory per block
    CUstream stream = nullptr;  // e.g. torch.cuda.current_stream().cuda_stream
    // Cooperative launch: the driver guarantees all blocks are co-resident (or fails the launch),
    // which a kernel with grid-wide barriers needs
    bool cooperative = false;
    // Thread-block cluster along x (TMA multicast, distributed shared memory); 1 = no cluster
    uint32_t cluster_dim = 1;
    // Programmatic dependent launch: the kernel may start while the one before it on the stream
    // still runs (its `griddepcontrol.wait` then orders its reads after that kernel's writes)
    bool programmatic = false;
};

// One kernel loaded in one context. Owned by the cache below; references stay valid for the
// life of the process.
class Kernel {
public:
    Kernel(CUfunction function, int device, std::string symbol, std::string cubin)
        : function_(function), device_(device), symbol_(std::move(symbol)), cubin_(std::move(cubin)) {
        const auto& d = driver();
        const auto attribute = [&](CUfunction_attribute attr, const char* attr_name) {
            int value = 0;
            d.check(d.cuFuncGetAttribute(&value, attr, function_), "cuFuncGetAttribute", attr_name);
            return value;
        };
        num_registers_ = attribute(CU_FUNC_ATTRIBUTE_NUM_REGS, "NUM_REGS");
        static_smem_bytes_ = attribute(CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES, "SHARED_SIZE_BYTES");
        local_bytes_ = attribute(CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES, "LOCAL_SIZE_BYTES");
        max_threads_per_block_ = attribute(CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK, "MAX_THREADS_PER_BLOCK");
    }

    CUfunction function() const { return function_; }
    int device() const { return device_; }
    const std::string& symbol() const { return symbol_; }
    const std::string& cubin() const { return cubin_; }
    int num_registers() const { return num_registers_; }        // per thread
    int static_smem_bytes() const { return static_smem_bytes_; }  // __shared__ arrays, besides dynamic
    int local_bytes() const { return local_bytes_; }            // per thread; > 0 often means spills
    int max_threads_per_block() const { return max_threads_per_block_; }

    // Opt in to `smem_bytes` of dynamic shared memory, once per new high-water mark: the common
    // path is one relaxed atomic load.
    void ensure_dynamic_smem(uint32_t smem_bytes) {
        if (smem_bytes <= kDefaultMaxDynamicSmem or smem_bytes <= max_dynamic_smem_.load(std::memory_order_acquire))
            return;
        std::lock_guard<std::mutex> lock(mutex_);
        if (smem_bytes <= max_dynamic_smem_.load(std::memory_order_relaxed))
            return;
        const auto& info = device_info(device_);
        if (static_cast<int64_t>(smem_bytes) + static_smem_bytes_ > info.max_smem_per_block_optin)
            raise_invalid_argument("smem_bytes = ", smem_bytes, " (+ ", static_smem_bytes_, " static) exceeds the ",
                                   info.max_smem_per_block_optin, " bytes of shared memory a block may use on device ",
                                   device_, " (", info.name, ") for kernel ", symbol_);
        const auto& d = driver();
        d.check(d.cuFuncSetAttribute(function_, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, static_cast<int>(smem_bytes)),
                "cuFuncSetAttribute(MAX_DYNAMIC_SHARED_SIZE_BYTES)", symbol_ + ", " + std::to_string(smem_bytes) + " bytes");
        max_dynamic_smem_.store(smem_bytes, std::memory_order_release);
    }

private:
    CUfunction function_;
    int device_;
    std::string symbol_, cubin_;
    int num_registers_ = 0, static_smem_bytes_ = 0, local_bytes_ = 0, max_threads_per_block_ = 0;
    std::atomic<uint32_t> max_dynamic_smem_{kDefaultMaxDynamicSmem};
    std::mutex mutex_;
};

namespace detail {

// The one kernel of a module, for callers that do not know its (mangled) name: a generated
// translation unit instantiates exactly one __global__ template.
inline CUfunction find_sole_kernel(CUmodule module, const std::string& cubin, std::string& symbol) {
    const auto& d = driver();
    if (d.cuModuleGetFunctionCount == nullptr or d.cuModuleEnumerateFunctions == nullptr or d.cuFuncGetName == nullptr)
        raise_runtime_error("the CUDA driver cannot enumerate kernels (needs CUDA 12.4+): name the kernel symbol of ", cubin);
    unsigned count = 0;
    d.check(d.cuModuleGetFunctionCount(&count, module), "cuModuleGetFunctionCount", cubin);
    std::vector<CUfunction> functions(count);
    if (count > 0)
        d.check(d.cuModuleEnumerateFunctions(functions.data(), count, module), "cuModuleEnumerateFunctions", cubin);
    std::vector<std::string> names;
    for (const auto& function : functions) {
        const char* name = nullptr;
        d.check(d.cuFuncGetName(&name, function), "cuFuncGetName", cubin);
        names.emplace_back(name != nullptr ? name : "?");
    }
    if (count != 1) {
        std::ostringstream list;
        for (const auto& name : names)
            list << " " << name;
        raise_runtime_error(cubin, " holds ", count, " kernels (", list.str(), " ): name the one to launch");
    }
    // Enumerated handles are not loaded under lazy module loading (the default since CUDA 12.2):
    // look the kernel up by name, which loads it
    symbol = names[0];
    CUfunction function = nullptr;
    d.check(d.cuModuleGetFunction(&function, module, symbol.c_str()), "cuModuleGetFunction", symbol + " in " + cubin);
    return function;
}

}  // namespace detail

// The kernel `symbol` of `cubin_or_dir` (a .cubin file, or a directory returned by `compile`)
// in the calling thread's current context, loading the module on first use. An empty symbol
// means "the only kernel in the cubin". Creates/retains the primary context of device 0 if the
// thread has no current context (see device.hpp).
inline Kernel& get_kernel(const std::filesystem::path& cubin_or_dir, const std::string& symbol = "") {
    const CUcontext context = ensure_context();

    static std::mutex mutex;
    static std::unordered_map<std::string, std::unique_ptr<Kernel>> kernels;
    static std::unordered_map<std::string, CUmodule> modules;

    std::string path = cubin_or_dir.string();
    const std::string context_tag = std::to_string(reinterpret_cast<uintptr_t>(context));
    const std::string kernel_key = path + '\n' + symbol + '\n' + context_tag;

    std::lock_guard<std::mutex> lock(mutex);
    if (auto it = kernels.find(kernel_key); it != kernels.end())
        return *it->second;

    // Cold path: resolve the file, load the module (once per file and context), find the kernel
    std::error_code ec;
    if (std::filesystem::is_directory(cubin_or_dir, ec))
        path = cubin_path(cubin_or_dir).string();
    if (not std::filesystem::exists(path, ec))
        raise_runtime_error("no cubin at ", path, " (was the JIT cache directory removed?)");

    const auto& d = driver();
    const int device = current_context_device();
    const std::string module_key = path + '\n' + context_tag;
    CUmodule module = nullptr;
    if (auto it = modules.find(module_key); it != modules.end()) {
        module = it->second;
    } else {
        const CUresult result = d.cuModuleLoad(&module, path.c_str());
        if (result != CUDA_SUCCESS) {
            // The usual causes: not a Hopper GPU, or a driver older than the nvcc that built it
            const auto& info = device_info(device);
            d.check(result, "cuModuleLoad",
                    path + "; device " + std::to_string(device) + " is " + info.name + " (sm_" +
                        std::to_string(info.compute_capability()) + "), the kernels need sm_90 (Hopper); driver supports CUDA " +
                        std::to_string(driver_version() / 1000) + "." + std::to_string(driver_version() % 1000 / 10));
        }
        modules.emplace(module_key, module);
    }

    CUfunction function = nullptr;
    std::string resolved_symbol = symbol;
    if (symbol.empty())
        function = detail::find_sole_kernel(module, path, resolved_symbol);
    else
        d.check(d.cuModuleGetFunction(&function, module, symbol.c_str()), "cuModuleGetFunction", symbol + " in " + path);

    auto kernel = std::make_unique<Kernel>(function, device, resolved_symbol, path);
    return *kernels.emplace(kernel_key, std::move(kernel)).first->second;
}

// Launch with `args` as for cuLaunchKernel: one pointer per kernel parameter, each pointing at a
// value of exactly the parameter's type (a CUtensorMap for a `const __grid_constant__
// CUtensorMap`, an int64_t for an int64_t, ...). Asynchronous; errors the driver reports at
// launch (bad config, too many resources) raise here, faults inside the kernel surface at the
// next synchronisation.
inline void launch(Kernel& kernel, const LaunchConfig& config, void** args) {
    const auto& g = config.grid;
    const auto& b = config.block;
    if (g.x == 0 or g.y == 0 or g.z == 0 or b.x == 0 or b.y == 0 or b.z == 0)
        raise_invalid_argument("launch of ", kernel.symbol(), ": grid (", g.x, ", ", g.y, ", ", g.z, ") and block (",
                               b.x, ", ", b.y, ", ", b.z, ") dimensions must be >= 1");
    if (static_cast<int64_t>(b.x) * b.y * b.z > kernel.max_threads_per_block())
        raise_invalid_argument("launch of ", kernel.symbol(), ": block of ", b.x * b.y * b.z, " threads exceeds the kernel's ",
                               kernel.max_threads_per_block(), " (its __launch_bounds__ or register use)");
    if (config.cluster_dim == 0 or g.x % config.cluster_dim != 0)
        raise_invalid_argument("launch of ", kernel.symbol(), ": grid.x = ", g.x, " must be a multiple of cluster_dim = ",
                               config.cluster_dim);
    kernel.ensure_dynamic_smem(config.smem_bytes);

    CUlaunchAttribute attributes[3];
    unsigned num_attributes = 0;
    if (config.cooperative) {
        attributes[num_attributes].id = CU_LAUNCH_ATTRIBUTE_COOPERATIVE;
        attributes[num_attributes++].value.cooperative = 1;
    }
    if (config.cluster_dim > 1) {
        attributes[num_attributes].id = CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION;
        attributes[num_attributes].value.clusterDim.x = config.cluster_dim;
        attributes[num_attributes].value.clusterDim.y = 1;
        attributes[num_attributes++].value.clusterDim.z = 1;
    }
    if (config.programmatic) {
        attributes[num_attributes].id = CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
        attributes[num_attributes++].value.programmaticStreamSerializationAllowed = 1;
    }

    CUlaunchConfig launch_config = {};
    launch_config.gridDimX = g.x, launch_config.gridDimY = g.y, launch_config.gridDimZ = g.z;
    launch_config.blockDimX = b.x, launch_config.blockDimY = b.y, launch_config.blockDimZ = b.z;
    launch_config.sharedMemBytes = config.smem_bytes;
    launch_config.hStream = config.stream;
    launch_config.attrs = num_attributes > 0 ? attributes : nullptr;
    launch_config.numAttrs = num_attributes;

    const auto& d = driver();
    const CUresult result = d.cuLaunchKernelEx(&launch_config, kernel.function(), args, nullptr);
    if (result != CUDA_SUCCESS) {
        std::ostringstream context;
        context << kernel.symbol() << ": grid (" << g.x << ", " << g.y << ", " << g.z << "), block (" << b.x << ", "
                << b.y << ", " << b.z << "), " << config.smem_bytes << " B dynamic smem, " << kernel.num_registers()
                << " registers/thread" << (config.cooperative ? ", cooperative" : "")
                << (config.cluster_dim > 1 ? ", cluster " + std::to_string(config.cluster_dim) : std::string())
                << (config.programmatic ? ", programmatic" : "");
        d.check(result, "cuLaunchKernelEx", context.str());
    }
}

// `launch_with_args(kernel, config, params, tensor_map, num_tokens)` for parameters held in typed
// host variables; each type must be exactly the kernel's parameter type.
template <typename... Args>
void launch_with_args(Kernel& kernel, const LaunchConfig& config, const Args&... args) {
    if constexpr (sizeof...(Args) == 0) {
        launch(kernel, config, static_cast<void**>(nullptr));
    } else {
        void* pointers[] = {const_cast<void*>(static_cast<const void*>(&args))...};
        launch(kernel, config, pointers);
    }
}

// Blocks of `kernel` that fit on one SM with this block size and dynamic shared memory: a
// persistent grid larger than num_sms * this would not be co-resident.
inline int max_active_blocks_per_sm(Kernel& kernel, int block_threads, uint32_t smem_bytes) {
    kernel.ensure_dynamic_smem(smem_bytes);
    const auto& d = driver();
    int num_blocks = 0;
    d.check(d.cuOccupancyMaxActiveBlocksPerMultiprocessor(&num_blocks, kernel.function(), block_threads, smem_bytes),
            "cuOccupancyMaxActiveBlocksPerMultiprocessor", kernel.symbol());
    return num_blocks;
}

}  // namespace deep_gemm::jit
