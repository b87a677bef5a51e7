#pragma once

// The CUDA driver API, opened with dlopen on first GPU use and never linked.
//
// Why: `deep_gemm._C` must import, and its CPU tests (layout, heuristics, JIT compilation) must
// run, on machines with a CUDA toolkit but no GPU and no driver (CI, build hosts). So <cuda.h> is
// included for its types only; every entry point is a function pointer resolved by dlsym from
// libcuda.so.1 the first time a GPU call needs it.

#if defined(CUDA_API_PER_THREAD_DEFAULT_STREAM) || defined(__CUDA_API_PER_THREAD_DEFAULT_STREAM)
// cuda.h would rename entry points to their `_ptsz` variants behind our back, and the dlsym
// names below would then resolve a function of the other stream semantics.
#error "deep_gemm's JIT runtime resolves the legacy-default-stream driver entry points"
#endif

#include <cuda.h>
#include <dlfcn.h>

#include <string>
#include <string_view>

#include "utils.hpp"

namespace deep_gemm::jit {

inline constexpr const char* kNoDriverMessage =
    "no CUDA driver (libcuda.so.1) found: the Mega MoE kernels need an SM90 (Hopper) GPU";

// Entry points the runtime cannot work without. Plain libcuda symbol names are the first ABI
// version of each function; for every name here that version has the signature cuda.h declares
// (checked at compile time below: a name cuda.h remaps to a `_vN` variant fails the build).
#define DG_FOR_EACH_REQUIRED_DRIVER_ENTRY(X) \
    X(cuGetErrorName)                         \
    X(cuGetErrorString)                       \
    X(cuInit)                                 \
    X(cuDriverGetVersion)                     \
    X(cuDeviceGet)                            \
    X(cuDeviceGetCount)                       \
    X(cuDeviceGetName)                        \
    X(cuDeviceGetAttribute)                   \
    X(cuDeviceTotalMem_v2)                    \
    X(cuCtxGetCurrent)                        \
    X(cuCtxSetCurrent)                        \
    X(cuCtxGetDevice)                         \
    X(cuDevicePrimaryCtxRetain)               \
    X(cuModuleLoad)                           \
    X(cuModuleGetFunction)                    \
    X(cuFuncGetAttribute)                     \
    X(cuFuncSetAttribute)                     \
    X(cuOccupancyMaxActiveBlocksPerMultiprocessor) \
    X(cuLaunchKernelEx)                       \
    X(cuTensorMapEncodeTiled)                 \
    X(cuPointerGetAttribute)

// Entry points of newer drivers (12.3/12.4+), used only to find the kernel of a cubin by
// enumeration when the caller does not name it; null when the driver lacks them.
#define DG_FOR_EACH_OPTIONAL_DRIVER_ENTRY(X) \
    X(cuModuleGetFunctionCount)               \
    X(cuModuleEnumerateFunctions)             \
    X(cuFuncGetName)

#define DG_DRIVER_STRINGIFY_EXPANDED(x) DG_DRIVER_STRINGIFY(x)
#define DG_DRIVER_STRINGIFY(x) #x

// Fails to compile if cuda.h defines `name` as a macro (i.e. maps it to another ABI version):
// the string we dlsym must be the function whose type we call it through.
#define DG_DRIVER_CHECK_NOT_REMAPPED(name)                                                   \
    static_assert(std::string_view(#name) == std::string_view(DG_DRIVER_STRINGIFY_EXPANDED(name)), \
                  "cuda.h remaps " #name ": resolve its versioned symbol explicitly");
DG_FOR_EACH_REQUIRED_DRIVER_ENTRY(DG_DRIVER_CHECK_NOT_REMAPPED)
DG_FOR_EACH_OPTIONAL_DRIVER_ENTRY(DG_DRIVER_CHECK_NOT_REMAPPED)
#undef DG_DRIVER_CHECK_NOT_REMAPPED

// The dlopen handle of libcuda, or nullptr when no driver is installed. Never throws, so it can
// back `has_cuda_driver()`. A failed dlopen is remembered: a driver does not appear mid-process.
inline void* driver_library_handle() noexcept {
    static void* const handle = []() -> void* {
        for (const char* name : {"libcuda.so.1", "libcuda.so"}) {
            if (void* h = dlopen(name, RTLD_NOW | RTLD_LOCAL))
                return h;
        }
        return nullptr;
    }();
    return handle;
}

inline bool has_cuda_driver() noexcept { return driver_library_handle() != nullptr; }

// The table of resolved entry points. Members carry the driver's own names so that call sites
// read like ordinary driver code: `driver().cuModuleLoad(&module, path)`.
struct Driver {
#define DG_DRIVER_DECLARE_MEMBER(name) decltype(&::name) name = nullptr;
    DG_FOR_EACH_REQUIRED_DRIVER_ENTRY(DG_DRIVER_DECLARE_MEMBER)
    DG_FOR_EACH_OPTIONAL_DRIVER_ENTRY(DG_DRIVER_DECLARE_MEMBER)
#undef DG_DRIVER_DECLARE_MEMBER

    Driver() {
        void* handle = driver_library_handle();
        if (handle == nullptr)
            raise_runtime_error(kNoDriverMessage);
#define DG_DRIVER_RESOLVE_REQUIRED(name)                                                              \
    name = reinterpret_cast<decltype(name)>(dlsym(handle, #name));                                    \
    if (name == nullptr)                                                                              \
        raise_runtime_error("the CUDA driver (libcuda.so.1) lacks `" #name "`: it is too old for the " \
                            "Mega MoE kernels: install a driver at least as new as the CUDA toolkit used by the JIT");
        DG_FOR_EACH_REQUIRED_DRIVER_ENTRY(DG_DRIVER_RESOLVE_REQUIRED)
#undef DG_DRIVER_RESOLVE_REQUIRED
#define DG_DRIVER_RESOLVE_OPTIONAL(name) name = reinterpret_cast<decltype(name)>(dlsym(handle, #name));
        DG_FOR_EACH_OPTIONAL_DRIVER_ENTRY(DG_DRIVER_RESOLVE_OPTIONAL)
#undef DG_DRIVER_RESOLVE_OPTIONAL
    }

    // "CUDA_ERROR_INVALID_VALUE (invalid argument)"; safe for any code, known or not
    std::string describe(CUresult result) const {
        const char* name = nullptr;
        const char* text = nullptr;
        if (cuGetErrorName(result, &name) != CUDA_SUCCESS or name == nullptr)
            name = "unknown CUresult";
        if (cuGetErrorString(result, &text) != CUDA_SUCCESS or text == nullptr)
            text = "no description";
        return std::string(name) + " (" + std::to_string(static_cast<int>(result)) + ": " + text + ")";
    }

    // Every CUresult goes through here: the message names the call and, where it helps, what it
    // was called on (a cubin path, a symbol, an argument list).
    void check(CUresult result, std::string_view call, std::string_view context = {}) const {
        if (result == CUDA_SUCCESS)
            return;
        if (context.empty())
            raise_runtime_error(call, " failed: ", describe(result));
        raise_runtime_error(call, " failed: ", describe(result), " [", context, "]");
    }
};

// The driver, opened and initialised (cuInit) on first use. Throws std::runtime_error (Python:
// RuntimeError) with `kNoDriverMessage` when libcuda is absent, or with cuInit's error when the
// driver is present but no usable GPU is (e.g. CUDA_ERROR_NO_DEVICE). A failed initialisation
// is retried on the next call (a throwing static initialiser leaves the static unset).
inline const Driver& driver() {
    static const Driver instance = [] {
        Driver d;
        d.check(d.cuInit(0), "cuInit");
        return d;
    }();
    return instance;
}

}  // namespace deep_gemm::jit
