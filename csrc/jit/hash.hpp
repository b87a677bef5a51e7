#pragma once

// SHA-256 (FIPS 180-4) for JIT cache keys.
//
// Why a cryptographic hash: a cache directory is trusted on sight (a hit loads the cubin without
// looking at the source), so two different kernels must never share a key. A 64-bit FNV-style
// hash makes that unlikely; SHA-256 makes it a non-issue, and at ~300 MB/s it costs ~1 ms for
// the ~100 KB of headers hashed once per process. No OpenSSL: `_C` links nothing but libdl.

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>

namespace deep_gemm::jit {

class Sha256 {
public:
    Sha256& update(std::string_view data) {
        num_bytes_ += data.size();
        while (not data.empty()) {
            const size_t n = std::min(data.size(), 64 - block_size_);
            std::memcpy(block_.data() + block_size_, data.data(), n);
            block_size_ += n;
            data.remove_prefix(n);
            if (block_size_ == 64) {
                compress();
                block_size_ = 0;
            }
        }
        return *this;
    }

    // Feed a field that is followed by others: the length prefix keeps ("ab", "c") and
    // ("a", "bc") apart.
    Sha256& update_field(std::string_view data) {
        const uint64_t size = data.size();
        char prefix[8];
        for (int i = 0; i < 8; ++i)
            prefix[i] = static_cast<char>((size >> (8 * i)) & 0xff);
        update(std::string_view(prefix, 8));
        return update(data);
    }

    // Lower-case hex of the 32-byte digest. Finalises: call once.
    std::string hex_digest() {
        const uint64_t num_bits = num_bytes_ * 8;
        block_[block_size_++] = 0x80;
        if (block_size_ > 56) {
            std::memset(block_.data() + block_size_, 0, 64 - block_size_);
            compress();
            block_size_ = 0;
        }
        std::memset(block_.data() + block_size_, 0, 56 - block_size_);
        for (int i = 0; i < 8; ++i)
            block_[56 + i] = static_cast<uint8_t>(num_bits >> (56 - 8 * i));
        compress();

        static constexpr char kHex[] = "0123456789abcdef";
        std::string out;
        for (const uint32_t word : state_) {
            for (int shift = 28; shift >= 0; shift -= 4)
                out.push_back(kHex[(word >> shift) & 0xf]);
        }
        return out;
    }

private:
    static uint32_t rotr(uint32_t x, int n) { return (x >> n) | (x << (32 - n)); }

    void compress() {
        // First 32 bits of the fractional parts of the cube roots of the first 64 primes
        static constexpr uint32_t kRound[64] = {
            0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5,
            0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174,
            0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da,
            0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7, 0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967,
            0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85,
            0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070,
            0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
            0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7, 0xc67178f2};

        uint32_t w[64];
        for (int i = 0; i < 16; ++i)
            w[i] = (uint32_t(block_[4 * i]) << 24) | (uint32_t(block_[4 * i + 1]) << 16) |
                   (uint32_t(block_[4 * i + 2]) << 8) | uint32_t(block_[4 * i + 3]);
        for (int i = 16; i < 64; ++i) {
            const uint32_t s0 = rotr(w[i - 15], 7) ^ rotr(w[i - 15], 18) ^ (w[i - 15] >> 3);
            const uint32_t s1 = rotr(w[i - 2], 17) ^ rotr(w[i - 2], 19) ^ (w[i - 2] >> 10);
            w[i] = w[i - 16] + s0 + w[i - 7] + s1;
        }

        uint32_t a = state_[0], b = state_[1], c = state_[2], d = state_[3];
        uint32_t e = state_[4], f = state_[5], g = state_[6], h = state_[7];
        for (int i = 0; i < 64; ++i) {
            const uint32_t t1 = h + (rotr(e, 6) ^ rotr(e, 11) ^ rotr(e, 25)) + ((e & f) ^ (~e & g)) + kRound[i] + w[i];
            const uint32_t t2 = (rotr(a, 2) ^ rotr(a, 13) ^ rotr(a, 22)) + ((a & b) ^ (a & c) ^ (b & c));
            h = g, g = f, f = e, e = d + t1;
            d = c, c = b, b = a, a = t1 + t2;
        }
        state_[0] += a, state_[1] += b, state_[2] += c, state_[3] += d;
        state_[4] += e, state_[5] += f, state_[6] += g, state_[7] += h;
    }

    // First 32 bits of the fractional parts of the square roots of the first 8 primes
    std::array<uint32_t, 8> state_ = {0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a,
                                      0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19};
    std::array<uint8_t, 64> block_{};
    size_t block_size_ = 0;
    uint64_t num_bytes_ = 0;
};

inline std::string sha256_hex(std::string_view data) { return Sha256().update(data).hex_digest(); }

}  // namespace deep_gemm::jit
