#pragma once

// Python bindings of the JIT runtime (csrc/jit/): compiler settings and cache, the SM-count
// setting, device queries, and two low-level helpers (`make_tma_2d`, `launch_kernel`) that let
// Python tests drive small device kernels without torch in C++.

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstring>
#include <string>
#include <vector>

#include "../jit/compiler.hpp"
#include "../jit/device.hpp"
#include "../jit/driver.hpp"
#include "../jit/kernel_runtime.hpp"
#include "../jit/tma.hpp"

namespace deep_gemm::apis::runtime {

namespace py = pybind11;

namespace detail {

inline jit::Dim3 to_dim3(const std::vector<uint32_t>& dims, const char* arg_name) {
    if (dims.empty() or dims.size() > 3)
        jit::raise_invalid_argument(arg_name, " must have 1 to 3 entries, got ", dims.size());
    jit::Dim3 out;
    out.x = dims[0];
    out.y = dims.size() > 1 ? dims[1] : 1;
    out.z = dims.size() > 2 ? dims[2] : 1;
    return out;
}

// One kernel parameter's bytes, aligned for any parameter type (CUtensorMap wants 64)
struct alignas(64) ParamSlot {
    unsigned char bytes[128];
};

inline py::dict device_info_dict(int device) {
    const auto& info = jit::device_info(device < 0 ? jit::current_device() : device);
    py::dict out;
    out["ordinal"] = info.ordinal;
    out["name"] = info.name;
    out["compute_capability"] = py::make_tuple(info.compute_capability_major, info.compute_capability_minor);
    out["num_sms"] = info.num_sms;
    out["max_smem_per_block_optin"] = info.max_smem_per_block_optin;
    out["max_smem_per_sm"] = info.max_smem_per_sm;
    out["max_threads_per_sm"] = info.max_threads_per_sm;
    out["max_registers_per_sm"] = info.max_registers_per_sm;
    out["l2_cache_bytes"] = info.l2_cache_bytes;
    out["clock_rate_khz"] = info.clock_rate_khz;
    out["memory_clock_rate_khz"] = info.memory_clock_rate_khz;
    out["memory_bus_width_bits"] = info.memory_bus_width_bits;
    out["hbm_gbps"] = jit::hbm_gbps(info);   // peak, what the heuristics take (get_mega_moe_config)
    out["total_memory_bytes"] = info.total_memory_bytes;
    out["driver_version"] = jit::driver_version();
    return out;
}

}  // namespace detail

inline void register_apis(py::module_& m) {
    // --- compiler -------------------------------------------------------------------------------
    m.def("init", &jit::init, py::arg("include_dir"), py::arg("cuda_home"), py::arg("cutlass_include"),
          "Set the JIT's paths: `include_dir` holds `deep_gemm/...` device headers, `cuda_home` the CUDA\n"
          "toolkit (its bin/nvcc is used unless DG_NVCC is set), `cutlass_include` CUTLASS/CuTe headers\n"
          "('' for none). Also (re)reads DG_NVCC and DG_JIT_CACHE_DIR. Called by `deep_gemm.jit.init()`.");
    m.def("compile",
          [](const std::string& name, const std::string& source, const std::vector<std::string>& extra_flags) {
              jit::Compiler::instance().snapshot_environment();   // with the GIL: os.environ as it is now
              py::gil_scoped_release release;
              return jit::compile(name, source, extra_flags).string();
          },
          py::arg("name"), py::arg("source"), py::arg("extra_flags") = std::vector<std::string>{},
          "Compile CUDA `source` for sm_90a with nvcc, or find it in the JIT cache; return the cache\n"
          "directory holding `kernel.cubin` (and `kernel.cu`). `name` (letters, digits, '_') prefixes the\n"
          "directory; `extra_flags` are appended to nvcc's command line and are part of the cache key.\n"
          "Raises RuntimeError with nvcc's output when compilation fails.");
    m.def("get_compile_flags",
          [](const std::vector<std::string>& extra_flags) { return jit::Compiler::instance().flags(extra_flags); },
          py::arg("extra_flags") = std::vector<std::string>{},
          "The nvcc flags a kernel is compiled with (without DG_JIT_PTXAS_VERBOSE's `-Xptxas -v`).");
    m.def("set_cache_dir", [](const std::string& path) { jit::Compiler::instance().set_cache_dir(path); }, py::arg("path"),
          "Use `path` as the JIT cache root for this process; '' restores DG_JIT_CACHE_DIR (default ~/.deep_gemm).");
    m.def("get_cache_dir", [] { return jit::Compiler::instance().cache_dir().string(); },
          "The JIT cache root: set_cache_dir's path, else DG_JIT_CACHE_DIR, else ~/.deep_gemm.");
    m.def("get_nvcc_version", [] { return jit::Compiler::instance().nvcc_version(); },
          py::call_guard<py::gil_scoped_release>(),
          "`nvcc --version` of the JIT's compiler (run once per process; part of every cache key).");
    m.def("get_num_nvcc_invocations", [] { return jit::Compiler::instance().num_invocations(); },
          "Number of nvcc compilations (JIT cache misses) run by this process.");

    // --- device -----------------------------------------------------------------------------------
    m.def("has_cuda_driver", &jit::has_cuda_driver,
          "True if the CUDA driver library (libcuda.so.1) can be opened. Never raises; True does not\n"
          "promise a usable GPU (use get_device_info for that).");
    m.def("set_num_sms", &jit::set_num_sms, py::arg("num_sms"),
          "Limit the persistent kernels to `num_sms` SMs (0: use all SMs of the device). Checked against\n"
          "the current device's SM count when a GPU is visible.");
    m.def("get_num_sms", &jit::get_num_sms,
          "The SM count the kernels use: set_num_sms's value, else the current device's SM count (which\n"
          "needs a GPU: RuntimeError without a CUDA driver).");
    m.def("get_device_info", &detail::device_info_dict, py::arg("device") = -1,
          "Properties of CUDA device `device` (-1: the current one) as a dict: name, compute_capability,\n"
          "num_sms, max_smem_per_block_optin, l2_cache_bytes, total_memory_bytes, driver_version, ...\n"
          "RuntimeError without a CUDA driver or GPU.");

    // --- low-level helpers for tests -------------------------------------------------------------
    m.def("make_tma_2d",
          [](uintptr_t ptr, int dtype, uint64_t inner_dim, uint64_t outer_dim, uint32_t inner_box, uint32_t outer_box,
             uint64_t outer_stride_bytes, int swizzle) {
              const CUtensorMap map = jit::make_tma_2d(reinterpret_cast<void*>(ptr), static_cast<CUtensorMapDataType>(dtype),
                                                       inner_dim, outer_dim, inner_box, outer_box, outer_stride_bytes,
                                                       static_cast<CUtensorMapSwizzle>(swizzle));
              return py::bytes(reinterpret_cast<const char*>(&map), sizeof(map));
          },
          py::arg("ptr"), py::arg("dtype"), py::arg("inner_dim"), py::arg("outer_dim"), py::arg("inner_box"),
          py::arg("outer_box"), py::arg("outer_stride_bytes"), py::arg("swizzle"),
          "Encode a 2D TMA descriptor (the 128 bytes of a CUtensorMap, to pass to `launch_kernel`) over a\n"
          "row-major [outer_dim, inner_dim] tensor at device address `ptr`. `dtype` is a CUtensorMapDataType\n"
          "(0 uint8, 6 float16, 7 float32, 9 bfloat16), `swizzle` a CUtensorMapSwizzle (0 none, 1 32B, 2 64B,\n"
          "3 128B). Arguments are checked before the driver is used: ValueError names the bad one.");
    m.def("launch_kernel",
          [](const std::string& cubin_or_dir, const std::string& symbol, const std::vector<uint32_t>& grid,
             const std::vector<uint32_t>& block, uint32_t smem_bytes, uintptr_t stream, const py::list& args,
             bool cooperative) {
              std::vector<detail::ParamSlot> slots(args.size());
              std::vector<void*> pointers(args.size());
              for (size_t i = 0; i < args.size(); ++i) {
                  const py::handle arg = args[i];
                  std::memset(slots[i].bytes, 0, sizeof(slots[i].bytes));
                  if (py::isinstance<py::bytes>(arg)) {
                      const std::string raw = arg.cast<std::string>();
                      if (raw.size() > sizeof(slots[i].bytes))
                          jit::raise_invalid_argument("args[", i, "]: at most ", sizeof(slots[i].bytes), " bytes, got ", raw.size());
                      std::memcpy(slots[i].bytes, raw.data(), raw.size());
                  } else if (py::isinstance<py::int_>(arg)) {
                      // Two's complement: negative values and pointers above 2^63 both fit 8 bytes
                      const py::int_ value = arg.cast<py::int_>();
                      const uint64_t bits = value < py::int_(0) ? static_cast<uint64_t>(value.cast<int64_t>()) : value.cast<uint64_t>();
                      std::memcpy(slots[i].bytes, &bits, sizeof(bits));
                  } else {
                      jit::raise_invalid_argument("args[", i, "]: expected int (an 8-byte parameter) or bytes (raw), got ",
                                                  py::str(py::type::handle_of(arg)).cast<std::string>());
                  }
                  pointers[i] = slots[i].bytes;
              }
              jit::LaunchConfig config;
              config.grid = detail::to_dim3(grid, "grid");
              config.block = detail::to_dim3(block, "block");
              config.smem_bytes = smem_bytes;
              config.stream = reinterpret_cast<CUstream>(stream);
              config.cooperative = cooperative;
              auto& kernel = jit::get_kernel(cubin_or_dir, symbol);
              jit::launch(kernel, config, pointers.empty() ? nullptr : pointers.data());
          },
          py::arg("cubin_or_dir"), py::arg("symbol"), py::arg("grid"), py::arg("block"), py::arg("smem_bytes"),
          py::arg("stream"), py::arg("args"), py::arg("cooperative") = false,
          "Launch kernel `symbol` ('' = the cubin's only kernel) of a cubin (or a directory from `compile`)\n"
          "on `stream` (an int such as torch.cuda.current_stream().cuda_stream). `args` holds one entry per\n"
          "kernel parameter: an int is passed as 8 bytes (pointers, int64), bytes are copied raw (e.g. a\n"
          "CUtensorMap from make_tma_2d, or struct.pack for other types). For tests and debugging.");
    m.def("get_kernel_info",
          [](const std::string& cubin_or_dir, const std::string& symbol) {
              auto& kernel = jit::get_kernel(cubin_or_dir, symbol);
              py::dict out;
              out["symbol"] = kernel.symbol();
              out["device"] = kernel.device();
              out["num_registers"] = kernel.num_registers();
              out["static_smem_bytes"] = kernel.static_smem_bytes();
              out["local_bytes"] = kernel.local_bytes();
              out["max_threads_per_block"] = kernel.max_threads_per_block();
              return out;
          },
          py::arg("cubin_or_dir"), py::arg("symbol") = "",
          "Load a kernel (as launch_kernel does) and return its resources: symbol, num_registers (per\n"
          "thread), static_smem_bytes, local_bytes (per thread; > 0 usually means register spills).");
}

}  // namespace deep_gemm::apis::runtime
