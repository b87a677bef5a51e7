#pragma once

// nvcc-based JIT compilation with an on-disk cache.
//
// A kernel variant is a small generated .cu file that includes the device headers under
// `deep_gemm/include/deep_gemm/` and instantiates one kernel with its config as template
// arguments. `compile(name, source)` turns it into `<cache>/cache/<name>_<key>/kernel.cubin`,
// where <key> is the SHA-256 of everything that can change the cubin:
//   - the generated source text,
//   - the nvcc flag list (DG_JIT_PTXAS_VERBOSE and extra flags included; `-I` paths stand in as
//     a placeholder, so that a cache filled on one machine is valid on another),
//   - `nvcc --version` (computed once per process),
//   - the relative path and contents of every file under the deep_gemm include dir, and CUTLASS's
//     version.h (computed once per process), so editing a header invalidates the cache.
// A directory becomes visible only through an atomic rename of a fully written temporary one,
// so concurrent processes (e.g. 8 ranks starting together) never see a partial cubin: the
// first rename wins and the others discard their identical copies.
//
// Settings (see deep_gemm/jit.py for the user-facing list): DG_JIT_CACHE_DIR, DG_JIT_DEBUG,
// DG_JIT_PTXAS_VERBOSE, DG_NVCC.

#include <fcntl.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <mutex>
#include <random>
#include <sstream>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "hash.hpp"
#include "utils.hpp"

extern char** environ;

namespace deep_gemm::jit {

namespace fs = std::filesystem;

inline constexpr const char* kSourceFileName = "kernel.cu";
inline constexpr const char* kCubinFileName = "kernel.cubin";

// The cubin inside a directory returned by `compile`.
inline fs::path cubin_path(const fs::path& kernel_dir) { return kernel_dir / kCubinFileName; }

// What is wrong with the cubin at `path` as a file (empty: nothing found): a 64-bit ELF whose section
// header table lies within the file. nvcc on a full disk can exit 0 leaving an empty or truncated
// cubin, which must never be published or trusted as a cache hit.
inline std::string cubin_problem(const fs::path& path) {
    std::ifstream in(path, std::ios::binary);
    if (not in)
        return "missing";
    unsigned char h[64] = {};
    in.read(reinterpret_cast<char*>(h), sizeof(h));
    if (in.gcount() != static_cast<std::streamsize>(sizeof(h)) or h[0] != 0x7f or h[1] != 'E' or h[2] != 'L' or h[3] != 'F' or
        h[4] != 2)
        return "not a 64-bit ELF file";
    const auto le = [&](int at, int bytes) {
        uint64_t v = 0;
        for (int i = bytes - 1; i >= 0; --i)
            v = (v << 8) | h[at + i];
        return v;
    };
    const uint64_t sh_offset = le(0x28, 8), sh_entry = le(0x3a, 2), sh_count = le(0x3c, 2);
    std::error_code ec;
    const uint64_t size = fs::file_size(path, ec);
    if (ec or sh_count == 0 or sh_offset + sh_entry * sh_count > size)
        return "truncated (" + std::to_string(size) + " bytes, its section headers end at byte " +
               std::to_string(sh_offset + sh_entry * sh_count) + ")";
    return "";
}

// ---------------------------------------------------------------------------------------------
// Child processes
// ---------------------------------------------------------------------------------------------

struct ProcessResult {
    int exit_code = -1;  // exit status; 128 + signal if killed; 127 if it could not be started
    std::string output;  // stdout and stderr, interleaved as the child wrote them
};

inline std::string join_command(const std::vector<std::string>& argv) {
    std::string out;
    for (const auto& arg : argv) {
        if (not out.empty())
            out += ' ';
        const bool needs_quotes = arg.empty() or arg.find_first_of(" \t\"'$\\") != std::string::npos;
        out += needs_quotes ? "'" + arg + "'" : arg;
    }
    return out;
}

// posix_spawn (not system/popen): no shell, so paths need no quoting, and it is safe in a
// multi-threaded process (torch and Python threads) where fork-then-exec is not. Both output
// streams go into one CLOEXEC pipe that we drain until EOF, so a chatty child cannot block.
// `env`: the child's environment ("NAME=value" entries), the process's own when null
inline ProcessResult run_process(const std::vector<std::string>& argv, const std::vector<std::string>* env = nullptr) {
    int fds[2];
    if (pipe2(fds, O_CLOEXEC) != 0)
        raise_runtime_error("pipe2 failed: ", std::strerror(errno));

    posix_spawn_file_actions_t actions;
    posix_spawn_file_actions_init(&actions);
    posix_spawn_file_actions_addopen(&actions, STDIN_FILENO, "/dev/null", O_RDONLY, 0);
    posix_spawn_file_actions_adddup2(&actions, fds[1], STDOUT_FILENO);
    posix_spawn_file_actions_adddup2(&actions, fds[1], STDERR_FILENO);

    std::vector<char*> c_argv;
    for (const auto& arg : argv)
        c_argv.push_back(const_cast<char*>(arg.c_str()));
    c_argv.push_back(nullptr);

    std::vector<char*> c_env;
    if (env != nullptr) {
        for (const auto& kv : *env)
            c_env.push_back(const_cast<char*>(kv.c_str()));
        c_env.push_back(nullptr);
    }
    pid_t pid = 0;
    const int spawn_error = posix_spawnp(&pid, c_argv[0], &actions, nullptr, c_argv.data(), env != nullptr ? c_env.data() : environ);
    posix_spawn_file_actions_destroy(&actions);
    close(fds[1]);
    ProcessResult result;
    if (spawn_error != 0) {
        // Reported like a shell does (status 127), so callers handle one kind of failure
        close(fds[0]);
        result.exit_code = 127;
        result.output = "cannot run `" + argv[0] + "`: " + std::strerror(spawn_error);
        return result;
    }

    char buffer[4096];
    while (true) {
        const ssize_t n = read(fds[0], buffer, sizeof(buffer));
        if (n > 0)
            result.output.append(buffer, static_cast<size_t>(n));
        else if (n == 0 or errno != EINTR)
            break;
    }
    close(fds[0]);

    int status = 0;
    while (waitpid(pid, &status, 0) < 0) {
        if (errno != EINTR)
            raise_runtime_error("waitpid for `", argv[0], "` failed: ", std::strerror(errno));
    }
    result.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + (WIFSIGNALED(status) ? WTERMSIG(status) : 0);
    return result;
}

// ---------------------------------------------------------------------------------------------
// Files
// ---------------------------------------------------------------------------------------------

inline std::string read_file(const fs::path& path) {
    std::ifstream in(path, std::ios::binary);
    if (not in)
        raise_runtime_error("cannot read ", path.string());
    std::ostringstream content;
    content << in.rdbuf();
    return content.str();
}

inline void write_file(const fs::path& path, std::string_view content) {
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    out.write(content.data(), static_cast<std::streamsize>(content.size()));
    out.close();
    if (not out)
        raise_runtime_error("cannot write ", path.string());
}

// Digest of every regular file under `root` (path relative to root, then content), in sorted
// order so the result does not depend on directory iteration order. Empty root -> fixed value.
inline void hash_directory(Sha256& hasher, const fs::path& root) {
    std::vector<fs::path> files;
    std::error_code ec;
    if (root.empty() or not fs::is_directory(root, ec))
        return;
    for (auto it = fs::recursive_directory_iterator(root, fs::directory_options::follow_directory_symlink, ec);
         not ec and it != fs::recursive_directory_iterator(); it.increment(ec)) {
        if (it->is_regular_file(ec))
            files.push_back(it->path());
    }
    if (ec)
        raise_runtime_error("cannot list the headers under ", root.string(), ": ", ec.message());
    std::sort(files.begin(), files.end());
    for (const auto& file : files) {
        hasher.update_field(fs::relative(file, root).generic_string());
        hasher.update_field(read_file(file));
    }
}

// ---------------------------------------------------------------------------------------------
// The compiler
// ---------------------------------------------------------------------------------------------

class Compiler {
public:
    static Compiler& instance() {
        static Compiler compiler;
        return compiler;
    }

    // Set once from Python (`deep_gemm.jit.init()`); calling again re-reads DG_NVCC and
    // DG_JIT_CACHE_DIR and drops what was computed from the old paths.
    void init(const std::string& include_dir, const std::string& cuda_home, const std::string& cutlass_include) {
        std::lock_guard<std::mutex> lock(mutex_);
        include_dir_ = include_dir;
        cuda_home_ = cuda_home;
        cutlass_include_ = cutlass_include;
        const std::string nvcc_override = get_env("DG_NVCC");
        if (not nvcc_override.empty())
            nvcc_ = nvcc_override;
        else if (not cuda_home.empty())
            nvcc_ = (fs::path(cuda_home) / "bin" / "nvcc").string();
        else
            nvcc_.clear();
        if (not cache_dir_overridden_)
            cache_dir_ = default_cache_dir();
        nvcc_version_.clear();
        header_digest_.clear();
        memory_cache_.clear();
        ++generation_;
        env_ = environment();
        initialized_ = true;
    }

    // The process environment as the compiler uses it: nvcc runs with this copy and the JIT's own
    // settings (DG_JIT_DEBUG, DG_JIT_PTXAS_VERBOSE, nvcc's NVCC_* variables) are read from it, never
    // from `environ` during a compile, which runs without the GIL: a Python thread changing
    // os.environ meanwhile would free strings under a reader. Taken by init() and by every Python-side
    // compile request before it releases the GIL (callers hold the GIL: Python changes `environ`
    // only with it held)
    void snapshot_environment() {
        std::vector<std::string> env = environment();
        std::lock_guard<std::mutex> lock(mutex_);
        env_ = std::move(env);
    }

    // Bumped by init() and set_cache_dir(): launchers that remember compiled directories across
    // calls keep them only for the generation they were compiled in (their paths point into the
    // cache directory of that time)
    uint64_t generation() const { return generation_.load(); }

    bool initialized() const {
        std::lock_guard<std::mutex> lock(mutex_);
        return initialized_;
    }

    // Empty path: back to DG_JIT_CACHE_DIR, else ~/.deep_gemm.
    void set_cache_dir(const std::string& path) {
        std::lock_guard<std::mutex> lock(mutex_);
        cache_dir_overridden_ = not path.empty();
        cache_dir_ = path.empty() ? default_cache_dir() : fs::path(path);
        memory_cache_.clear();  // its entries point into the old directory
        ++generation_;
    }

    fs::path cache_dir() const {
        std::lock_guard<std::mutex> lock(mutex_);
        return cache_dir_.empty() ? default_cache_dir() : cache_dir_;
    }

    // `nvcc --version`, run once per process (per nvcc path).
    std::string nvcc_version() {
        std::lock_guard<std::mutex> lock(mutex_);
        return nvcc_version_locked();
    }

    // nvcc compilations (cache misses) run by this process; `nvcc --version` is not counted.
    int64_t num_invocations() const { return num_invocations_.load(); }

    // The flags a kernel is compiled with (also part of its cache key).
    std::vector<std::string> flags(const std::vector<std::string>& extra_flags = {}) const {
        std::lock_guard<std::mutex> lock(mutex_);
        return flags_locked(extra_flags);
    }

    // Compile `source` (or find it in the cache) and return the directory holding kernel.cubin.
    // `name` names the cache directory (letters, digits, '_'); `extra_flags` are appended to the
    // nvcc command line and hashed with it.
    fs::path compile(const std::string& name, const std::string& source, const std::vector<std::string>& extra_flags = {}) {
        check_kernel_name(name);
        bool debug, ptxas_verbose;
        {
            std::lock_guard<std::mutex> lock(mutex_);
            debug = is_env_flag_on(env_value_locked("DG_JIT_DEBUG"));
            ptxas_verbose = is_env_flag_on(env_value_locked("DG_JIT_PTXAS_VERBOSE"));
        }

        // In-process hit: launchers may call compile() on every call, so the first lookup is keyed
        // by the request itself (one std::hash of the source, ~0.2 us) rather than by SHA-256.
        // Everything else in the cache key is fixed until init()/set_cache_dir(), which clear this.
        std::string request = name;
        for (const auto& part : {std::string_view(source), std::string_view(ptxas_verbose ? "v" : "")})
            request.append(1, '\0').append(part);
        for (const auto& flag : extra_flags)
            request.append(1, '\0').append(flag);

        // Snapshot the settings and the key under the lock; compile outside it so that threads
        // compiling different kernels do not serialise on one another.
        std::vector<std::string> flag_list;
        std::vector<std::string> env;   // the snapshot nvcc runs with
        fs::path cache_root, nvcc;
        std::string key;
        {
            std::lock_guard<std::mutex> lock(mutex_);
            if (not initialized_)
                raise_runtime_error("the JIT is not initialised: call deep_gemm.jit.init() (Python) or "
                                    "deep_gemm::jit::init() first");
            if (auto it = memory_cache_.find(request); it != memory_cache_.end()) {
                std::error_code exists_ec;
                if (fs::exists(cubin_path(it->second), exists_ec))
                    return it->second;
                memory_cache_.erase(it);   // the cache directory was deleted meanwhile: look it up again
            }
            std::vector<std::string> all_extra = extra_flags;
            if (ptxas_verbose)
                all_extra.insert(all_extra.end(), {"-Xptxas", "-v"});
            flag_list = flags_locked(all_extra);
            env = env_;
            nvcc = nvcc_;
            cache_root = cache_dir_;

            Sha256 hasher;
            hasher.update_field(source);
            // Include paths differ between machines; what they hold is hashed instead (our headers
            // by content, CUTLASS by its pinned wheel), so a cache filled on a CPU-only machine is
            // found on the GPU machine that the cubins are carried to.
            for (const auto& flag : flag_list)
                hasher.update_field(flag.rfind("-I", 0) == 0 ? std::string("-I<path>") : flag);
            hasher.update_field(nvcc_version_locked());
            hasher.update_field(header_digest_locked());
            // nvcc's own environment variables change its output as its flags do (hashed where set:
            // keys without them stay as they were)
            for (const char* var : {"NVCC_APPEND_FLAGS", "NVCC_PREPEND_FLAGS", "NVCC_CCBIN"})
                if (const std::string v = env_value_locked(var); not v.empty())
                    hasher.update_field(std::string(var) + "=" + v);
            // 128 bits of the digest: a short directory name, still collision-free in practice
            key = name + "_" + hasher.hex_digest().substr(0, 32);
        }

        // Threads of this process asking for the same kernel wait for one nvcc run (processes
        // race instead, and `publish` keeps the first result)
        std::shared_ptr<std::mutex> key_mutex;
        {
            std::lock_guard<std::mutex> lock(mutex_);
            auto& slot = key_mutexes_[key];
            if (slot == nullptr)
                slot = std::make_shared<std::mutex>();
            key_mutex = slot;
        }
        std::lock_guard<std::mutex> key_lock(*key_mutex);

        const fs::path final_dir = cache_root / "cache" / key;
        std::error_code ec;
        if (fs::exists(cubin_path(final_dir), ec)) {
            const std::string problem = cubin_problem(cubin_path(final_dir));
            if (problem.empty()) {
                if (debug)
                    std::fprintf(stderr, "deep_gemm JIT: %s: cache hit: %s\n", name.c_str(), final_dir.c_str());
                remember(request, final_dir);
                return final_dir;
            }
            // A broken entry (an earlier nvcc on a full disk, a crash before the data reached it): rebuilt
            std::fprintf(stderr, "deep_gemm JIT: %s: the cached cubin in %s is %s: compiling it again\n", name.c_str(),
                         final_dir.c_str(), problem.c_str());
            fs::remove_all(final_dir, ec);
        }

        remove_stale_temporaries(cache_root / "tmp");
        // Miss: build in a private temporary directory on the same file system, then rename. Its name
        // is unique across processes and hosts sharing the cache (a PID alone repeats across containers)
        static std::atomic<uint64_t> sequence{0};
        static const uint64_t nonce = (static_cast<uint64_t>(std::random_device{}()) << 32) ^ std::random_device{}();
        char nonce_hex[17];
        std::snprintf(nonce_hex, sizeof(nonce_hex), "%016llx", static_cast<unsigned long long>(nonce));
        const fs::path tmp_dir = cache_root / "tmp" /
            (key + "." + std::to_string(getpid()) + "." + nonce_hex + "." + std::to_string(sequence.fetch_add(1)));
        fs::create_directories(tmp_dir, ec);
        if (ec)
            raise_runtime_error("cannot create the JIT cache directory ", tmp_dir.string(), ": ", ec.message(),
                                " (set DG_JIT_CACHE_DIR to a writable directory)");
        write_file(tmp_dir / kSourceFileName, source);

        std::vector<std::string> argv = {nvcc.string()};
        argv.insert(argv.end(), flag_list.begin(), flag_list.end());
        argv.insert(argv.end(), {(tmp_dir / kSourceFileName).string(), "-o", cubin_path(tmp_dir).string()});
        const std::string command = join_command(argv);
        write_file(tmp_dir / "command.txt", command + "\n");
        if (debug)
            std::fprintf(stderr, "deep_gemm JIT: %s: cache miss, compiling into %s\n  %s\n", name.c_str(),
                         final_dir.c_str(), command.c_str());

        const auto start = std::chrono::steady_clock::now();
        num_invocations_.fetch_add(1);
        const ProcessResult result = run_process(argv, &env);
        const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();

        const std::string problem = result.exit_code == 0 ? cubin_problem(cubin_path(tmp_dir)) : "";
        if (result.exit_code != 0 or not problem.empty()) {
            if (not debug)
                fs::remove_all(tmp_dir, ec);
            raise_runtime_error("nvcc failed to compile kernel `", name, "` (exit status ", result.exit_code,
                                problem.empty() ? std::string() : "; its cubin is " + problem + ": is the disk full?", "):\n",
                                result.output, "\ncommand: ", command,
                                debug ? "\nthe generated source is kept in " + tmp_dir.string()
                                      : std::string("\nset DG_JIT_DEBUG=1 to keep the generated source"));
        }
        if (ptxas_verbose or debug) {
            if (not result.output.empty())
                std::fprintf(stderr, "%s", result.output.c_str());
        }
        if (debug)
            std::fprintf(stderr, "deep_gemm JIT: %s: compiled in %.2f s\n", name.c_str(), seconds);

        publish(tmp_dir, final_dir);
        remember(request, final_dir);
        return final_dir;
    }

private:
    Compiler() = default;

    // Temporary build directories left by compiles that never finished (a killed process): removed
    // once a day old (no compile takes that long), at most once per process
    static void remove_stale_temporaries(const fs::path& tmp_root) {
        static std::atomic<bool> done{false};
        if (done.exchange(true))
            return;
        std::error_code ec;
        const auto cutoff = fs::file_time_type::clock::now() - std::chrono::hours(24);
        for (fs::directory_iterator it(tmp_root, ec), end; not ec and it != end; it.increment(ec)) {
            std::error_code entry_ec;
            if (fs::last_write_time(it->path(), entry_ec) < cutoff and not entry_ec)
                fs::remove_all(it->path(), entry_ec);
        }
    }

    static void check_kernel_name(const std::string& name) {
        const bool valid = not name.empty() and name.size() <= 128 and
            std::all_of(name.begin(), name.end(), [](char c) { return std::isalnum(static_cast<unsigned char>(c)) or c == '_'; });
        if (not valid)
            raise_invalid_argument("kernel name must be 1-128 letters, digits or '_' (it names a cache directory), got '",
                                   name, "'");
    }

    static fs::path default_cache_dir() {
        const std::string env_dir = get_env("DG_JIT_CACHE_DIR");
        if (not env_dir.empty())
            return env_dir;
        const std::string home = get_env("HOME");
        // Without a home (systemd units, some containers): a directory of this user's in the shared
        // temporary directory, not one every user of the machine can write cubins into
        return home.empty() ? fs::temp_directory_path() / ("deep_gemm-" + std::to_string(getuid())) : fs::path(home) / ".deep_gemm";
    }

    std::vector<std::string> flags_locked(const std::vector<std::string>& extra_flags) const {
        std::vector<std::string> flags = {
            "-std=c++20", "-gencode=arch=compute_90a,code=sm_90a", "-cubin", "-O3",
            "--expt-relaxed-constexpr", "--expt-extended-lambda", "-lineinfo",
            "-I" + include_dir_.string()};
        if (not cutlass_include_.empty())
            flags.push_back("-I" + cutlass_include_.string());
        flags.insert(flags.end(), extra_flags.begin(), extra_flags.end());
        return flags;
    }

    std::string nvcc_version_locked() {
        if (not nvcc_version_.empty())
            return nvcc_version_;
        if (nvcc_.empty())
            raise_runtime_error("nvcc not found: set CUDA_HOME to a CUDA 12.8+ toolkit (or DG_NVCC to its nvcc) "
                                "and call deep_gemm.jit.init()");
        const ProcessResult result = run_process({nvcc_.string(), "--version"}, &env_);
        if (result.exit_code != 0)
            raise_runtime_error("`", nvcc_.string(), " --version` failed (exit status ", result.exit_code, "): ",
                                result.output, "\nset CUDA_HOME (or DG_NVCC) to a CUDA 12.8+ toolkit");
        nvcc_version_ = result.output;
        return nvcc_version_;
    }

    std::string header_digest_locked() {
        if (header_digest_.empty()) {
            Sha256 hasher;
            hash_directory(hasher, include_dir_);
            // CUTLASS is too large to hash per process; its version header stands for it
            std::error_code ec;
            const fs::path cutlass_version = cutlass_include_ / "cutlass" / "version.h";
            hasher.update_field(not cutlass_include_.empty() and fs::exists(cutlass_version, ec) ? read_file(cutlass_version) : "");
            header_digest_ = hasher.hex_digest();
        }
        return header_digest_;
    }

    void remember(const std::string& request, const fs::path& dir) {
        std::lock_guard<std::mutex> lock(mutex_);
        memory_cache_.emplace(request, dir);
    }

    // Make `tmp_dir` visible as `final_dir` in one step. rename(2) fails if another process
    // published the same key first: its cubin is identical, so keep it and drop ours.
    static void publish(const fs::path& tmp_dir, const fs::path& final_dir) {
        std::error_code ec, rename_ec;
        fs::create_directories(final_dir.parent_path(), ec);
        for (int attempt = 0; attempt < 2; ++attempt) {
            fs::rename(tmp_dir, final_dir, rename_ec);
            if (not rename_ec)
                return;
            if (fs::exists(cubin_path(final_dir), ec)) {
                fs::remove_all(tmp_dir, ec);
                return;
            }
            // A leftover without a cubin (deleted by hand, or an older layout): replace it once
            fs::remove_all(final_dir, ec);
        }
        raise_runtime_error("cannot move the compiled kernel from ", tmp_dir.string(), " to ", final_dir.string(),
                            ": ", rename_ec.message());
    }

    static std::vector<std::string> environment() {
        std::vector<std::string> env;
        for (char** e = environ; e != nullptr and *e != nullptr; ++e)
            env.emplace_back(*e);
        return env;
    }
    // A variable of the snapshot ("" when unset or empty, as get_env)
    std::string env_value_locked(const std::string& name) const {
        for (const auto& kv : env_)
            if (kv.size() > name.size() and kv.compare(0, name.size(), name) == 0 and kv[name.size()] == '=')
                return kv.substr(name.size() + 1);
        return "";
    }

    mutable std::mutex mutex_;
    std::vector<std::string> env_;   // snapshot_environment()
    bool initialized_ = false;
    bool cache_dir_overridden_ = false;
    fs::path include_dir_, cuda_home_, cutlass_include_, nvcc_, cache_dir_;
    std::string nvcc_version_, header_digest_;
    std::unordered_map<std::string, fs::path> memory_cache_;  // request (name, source, flags) -> directory
    std::unordered_map<std::string, std::shared_ptr<std::mutex>> key_mutexes_;
    std::atomic<int64_t> num_invocations_{0};
    std::atomic<uint64_t> generation_{0};
};

// ---------------------------------------------------------------------------------------------
// Free-function API (what launchers and the bindings call)
// ---------------------------------------------------------------------------------------------

inline void init(const std::string& include_dir, const std::string& cuda_home, const std::string& cutlass_include) {
    Compiler::instance().init(include_dir, cuda_home, cutlass_include);
}

// Directory holding kernel.cubin (see `cubin_path`) for `source`, compiling it on a cache miss.
inline fs::path compile(const std::string& name, const std::string& source, const std::vector<std::string>& extra_flags = {}) {
    return Compiler::instance().compile(name, source, extra_flags);
}

// Changes whenever a compiled directory remembered outside the compiler may be stale (Compiler::generation)
inline uint64_t compile_generation() { return Compiler::instance().generation(); }

}  // namespace deep_gemm::jit
