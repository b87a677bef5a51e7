// Module entry: every apis/*.hpp registers its own functions.
#include <pybind11/pybind11.h>

#include "apis/layout.hpp"
#include "apis/heuristics.hpp"
#include "apis/runtime.hpp"
#include "apis/mega_moe.hpp"

PYBIND11_MODULE(_C, m) {
    m.doc() = "deep_gemm C++ core: buffer layout, heuristics, JIT runtime and the Mega MoE launcher";
    deep_gemm::apis::layout::register_apis(m);
    deep_gemm::apis::heuristics::register_apis(m);
    deep_gemm::apis::runtime::register_apis(m);
    deep_gemm::apis::mega_moe::register_apis(m);
}
