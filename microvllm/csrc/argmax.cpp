// Greedy sampling's argmax over each row of the logits, for CPUs.
//
//   logits [rows, vocab] float32  ->  out [rows] int64: the first index of the row's
//                                     maximum, or of its first NaN if it has one
//
// which is exactly what torch.argmax(dim=-1) returns. Torch's CPU argmax is a generic
// reduction that tracks (value, index) pairs element by element; with a 49,152-token
// vocabulary and 32 rows that costs more per step than the step's RMSNorms.
// Here a row takes two vector passes: its maximum (and whether it holds a NaN), then
// the first position equal to it (the row is in cache by then).
//
// Compiled with -ffast-math, which lets the compiler assume there are no NaNs: the NaN
// tests are therefore intrinsics and bit tests, never `x != x` or std::isnan.
// vLLM's CPU build has the same kernel (greedy_argmax, csrc/cpu/sampling_kernels.cpp).
// Loaded by platforms/cpu/kernels.py, called by platforms/cpu/ops.py; compared with
// torch.argmax in tests/platforms/test_cpu_ops.py.

#include "ops.h"   // this file's C entry points, declared once
#include <cstdint>
#include <cstring>

#ifdef __AVX512F__
#include <immintrin.h>
#endif

namespace {

inline bool is_nan(float x) {
    uint32_t bits;
    std::memcpy(&bits, &x, sizeof bits);
    return (bits & 0x7fffffffu) > 0x7f800000u;
}

int64_t argmax_row(const float* row, int64_t n) {
    float max = row[0];
    int64_t i = 0;
    bool nan = false;
#ifdef __AVX512F__
    __m512 vmax = _mm512_set1_ps(row[0]);
    __mmask16 nans = 0;
    // A NaN's bits, less the sign, exceed +inf's, compared as integers: clang with
    // -ffast-math folds a floating-point "unordered" compare to false.
    const __m512i magnitude = _mm512_set1_epi32(0x7fffffff), inf = _mm512_set1_epi32(0x7f800000);
    for (; i + 16 <= n; i += 16) {
        const __m512 v = _mm512_loadu_ps(row + i);
        nans |= _mm512_cmpgt_epi32_mask(_mm512_and_si512(_mm512_castps_si512(v), magnitude), inf);
        vmax = _mm512_max_ps(vmax, v);   // a NaN operand is dealt with by the NaN scan
    }
    nan = nans != 0;
    max = _mm512_reduce_max_ps(vmax);
#endif
    for (; i < n; ++i) {
        nan |= is_nan(row[i]);
        if (row[i] > max) max = row[i];
    }
    if (nan) {
        for (int64_t j = 0; j < n; ++j)
            if (is_nan(row[j])) return j;
    }
    int64_t j = 0;
#ifdef __AVX512F__
    const __m512 target = _mm512_set1_ps(max);
    for (; j + 16 <= n; j += 16) {
        const __mmask16 hit = _mm512_cmp_ps_mask(_mm512_loadu_ps(row + j), target, _CMP_EQ_OQ);
        if (hit) return j + __builtin_ctz(hit);
    }
#endif
    for (; j < n; ++j)
        if (row[j] == max) return j;
    return 0;   // unreachable: max is one of the row's values
}

}  // namespace

extern "C" {

void argmax_rows(const void* logits_, void* out_, int rows, int64_t vocab) {
    const auto* logits = static_cast<const float*>(logits_);
    auto* out = static_cast<int64_t*>(out_);
    #pragma omp parallel for if (rows > 1 && rows * vocab >= (1 << 16))
    for (int r = 0; r < rows; ++r) out[r] = argmax_row(logits + r * vocab, vocab);
}

}  // extern "C"
