// What the kernel harness's checks share: seeded random numbers, the one-line report of
// each check, and the element types of dtypes.h by their kernel dtype code.
//
// The harness (kernel_check.cpp, attention_check.cpp, linear_check.cpp) is linked with
// the kernels' objects, built for one target (tests/platforms/test_aarch64_kernels.py:
// arm64 under qemu, and x86 for comparison), and compares each C entry point of ops.h
// with a plain reference written here in double precision. Each check prints
//
//   ok    rms_norm bfloat16 7x576 residual    max error 0.0039 (limit 0.0078)
//
// (FAIL instead of ok past the limit) and main() exits 1 if any check failed.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "dtypes.h"   // Float32, BFloat16, Float16 and the float16 bit conversions
#include "ops.h"      // the kernels' C entry points

// splitmix64: the same numbers on every machine and compiler for a given seed.
struct Random {
    uint64_t state;
    explicit Random(uint64_t seed) : state(seed) {}
    uint64_t next() {
        uint64_t z = (state += 0x9e3779b97f4a7c15ull);
        z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
        z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
        return z ^ (z >> 31);
    }
    double uniform() { return double(next() >> 11) * 0x1p-53; }   // [0, 1)
    double normal() {                                               // Box-Muller
        const double u = 1.0 - uniform(), v = uniform();
        return std::sqrt(-2.0 * std::log(u)) * std::cos(6.283185307179586 * v);
    }
    int below(int n) { return int(next() % uint64_t(n)); }
};

inline int checks = 0, failures = 0;

// One line per check; `what` names the measure ("max error", "mismatches"). A NaN fails.
inline void report(const std::string& name, double value, double limit, const char* what = "max error") {
    const bool ok = value <= limit;
    std::printf("%s  %-64s %s %.3g (limit %.3g)\n", ok ? "ok  " : "FAIL", name.c_str(), what, value, limit);
    std::fflush(stdout);
    ++checks;
    failures += !ok;
}

// |got - want| relative to |want|, or to `floor` where |want| is smaller.
inline double relative(double got, double want, double floor) {
    return std::fabs(got - want) / std::fmax(std::fabs(want), floor);
}

// The dtype code every kernel takes (ops.h), and a name to print.
template <typename D> struct Code;
template <> struct Code<Float32> { static constexpr int dtype = 0; static constexpr const char* name = "float32"; };
template <> struct Code<BFloat16> { static constexpr int dtype = 1; static constexpr const char* name = "bfloat16"; };
template <> struct Code<Float16> { static constexpr int dtype = 2; static constexpr const char* name = "float16"; };

// x rounded to D's precision, to nearest even: the references' own rounding, written
// apart from dtypes.h's store (which they check). Significant bits: float32 24, bfloat16 8,
// float16 11; the smallest step (subnormals) 2^-133 and 2^-24; past the largest finite value, inf.
template <typename D>
double rounded(double x) {
    if (Code<D>::dtype == 0) return double(float(x));
    if (x == 0 || !std::isfinite(x)) return x;
    const int bits = Code<D>::dtype == 1 ? 8 : 11;
    int exponent;
    std::frexp(x, &exponent);   // |x| = m 2^exponent, 0.5 <= m < 1
    int quantum = exponent - bits;
    quantum = std::max(quantum, Code<D>::dtype == 1 ? -133 : -24);   // subnormals: a fixed step
    const double r = std::ldexp(std::nearbyint(std::ldexp(x, -quantum)), quantum);   // ties to even
    const double largest = Code<D>::dtype == 2 ? 65504.0 : 0x1.fep127;
    return std::fabs(r) > largest ? std::copysign(INFINITY, x) : r;
}

// n random normal values times `scale`, stored as D (so the kernel and the reference read
// the same numbers).
template <typename D>
std::vector<typename D::storage> random_tensor(Random& random, size_t n, double scale = 1.0) {
    std::vector<typename D::storage> out(n);
    for (auto& v : out) v = D::store(float(scale * random.normal()));
    return out;
}

void check_attention();   // attention_check.cpp
void check_linear();      // linear_check.cpp
