#pragma once

#include <pybind11/pybind11.h>

namespace deep_gemm::apis::layout {

inline void register_apis(pybind11::module_& m) {
    (void)m;  // TODO: filled by its owner
}

}  // namespace deep_gemm::apis::layout
