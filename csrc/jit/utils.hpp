#pragma once

// Small helpers shared by the JIT runtime: error formatting and `DG_*` environment settings.
// Errors are plain C++ exceptions because pybind11 maps them onto Python ones without any glue:
// std::runtime_error -> RuntimeError (environment, driver, compiler), std::invalid_argument ->
// ValueError (a caller passed something out of range).

#include <cctype>
#include <cstdlib>
#include <sstream>
#include <stdexcept>
#include <string>
#include <string_view>

namespace deep_gemm::jit {

// Concatenate anything streamable; every message starts with "deep_gemm: " so that a user who
// sees it deep inside a serving stack knows which library raised it.
template <typename... Args>
std::string format_message(const Args&... args) {
    std::ostringstream out;
    out << "deep_gemm: ";
    (out << ... << args);
    return out.str();
}

template <typename... Args>
[[noreturn]] void raise_runtime_error(const Args&... args) {
    throw std::runtime_error(format_message(args...));
}

template <typename... Args>
[[noreturn]] void raise_invalid_argument(const Args&... args) {
    throw std::invalid_argument(format_message(args...));
}

// `DG_*` settings are read where they are used (not cached) so that a test or a user can flip
// them between calls; getenv is ~50 ns and is only called on cold paths (init, with the GIL held).
// A compile (which may run without the GIL) reads its settings from the compiler's copy of the
// environment instead (Compiler::snapshot_environment).
inline std::string get_env(const char* name, const std::string& fallback = "") {
    const char* value = std::getenv(name);
    return (value != nullptr and value[0] != '\0') ? std::string(value) : fallback;
}

// "1", "true", "yes", "on" (any case) enable a flag; anything else, or unset, leaves it off.
inline bool is_env_flag_on(std::string value) {
    for (auto& c : value)
        c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    return value == "1" or value == "true" or value == "yes" or value == "on";
}
inline bool get_env_flag(const char* name) { return is_env_flag_on(get_env(name)); }

}  // namespace deep_gemm::jit
