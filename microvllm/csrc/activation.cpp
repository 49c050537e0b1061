// The SiLU-gated MLP activation in one pass, for CPUs (vLLM's silu_and_mul):
//
//   gate_up [rows, 2·d]  (the fused gate/up projection: gate columns, then up columns)
//   out     [rows, d]    out = T( T(silu(gate)) * up ),  silu(g) = g / (1 + exp(-g))
//
// Torch needs two operators and a temporary for it (F.silu(gate) * up), each a pass
// over memory; in a decode step the tensors are small and have just been pushed out
// of cache by the weights streaming through, so every pass is paid in full. T()
// rounds to the storage type where Hugging Face's bfloat16 model does (after the
// silu, after the product); the math is float32.
//
// Called by platforms/cpu/ops.py; compared with SiluAndMul.forward_native in
// tests/platforms/test_cpu_ops.py.

#include "ops.h"   // this file's C entry points, declared once
#include <algorithm>
#include <cmath>
#include <cstdint>

#include "dtypes.h"  // Float32, BFloat16: storage and conversions
#include "vec512.h"  // tail, load16, store16, round16, exp512 (AVX-512 builds)

namespace {

// One row, two ways: out[i] = T(T(silu(gate[i])) * up[i]) for i < d.

#ifdef __AVX512BW__
// 16 lanes at a time, written out (as in norm_rope.cpp), with vec512.h's inline exp:
// 1.15-1.25x faster than the portable loop below in bfloat16 (float32: as fast).
template <typename Dtype, typename T = typename Dtype::storage>
void silu_and_mul_row(const T* gate, const T* up, T* o, int d) {
    for (int i = 0; i < d; i += 16) {
        const __mmask16 lanes = tail(d - i);
        const __m512 g = load16(gate + i, lanes);
        // exp(-g) with -g capped at 88 (the portable loop says why)
        const __m512 e = exp512(_mm512_min_ps(_mm512_sub_ps(_mm512_setzero_ps(), g), _mm512_set1_ps(88.f)));
        const __m512 silu = round16<T>(_mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.f), e)));
        store16(o + i, _mm512_mul_ps(silu, load16(up + i, lanes)), lanes);
    }
}

#else  // portable: the same math, one element at a time (the compiler vectorizes it)
template <typename Dtype, typename T = typename Dtype::storage>
void silu_and_mul_row(const T* gate, const T* up, T* o, int d) {
    #pragma omp simd
    for (int i = 0; i < d; ++i) {
        const float g = Dtype::load(gate[i]);
        // exp(-g) overflows below g = -88.7; -ffast-math may then give inf * 0 =
        // NaN, so cap it: silu is then ~1e-36 instead of torch's -0.
        const float silu = Dtype::round(g / (1.f + std::exp(std::min(-g, 88.f))));
        o[i] = Dtype::store(silu * Dtype::load(up[i]));
    }
}

#endif  // __AVX512BW__

template <typename Dtype, typename T = typename Dtype::storage>
void silu_and_mul(const T* gate_up, T* out, int rows, int d) {
    #pragma omp parallel for if (int64_t(rows) * d >= (1 << 13))
    for (int r = 0; r < rows; ++r) {
        const T* gate = gate_up + int64_t(r) * 2 * d;
        silu_and_mul_row<Dtype>(gate, gate + d, out + int64_t(r) * d, d);
    }
}

}  // namespace

extern "C" {

// dtype: 0 = float32, 1 = bfloat16. Called through ctypes.
void silu_and_mul(int dtype, const void* gate_up, void* out, int rows, int d) {
    if (dtype == 0)
        silu_and_mul<Float32>(static_cast<const float*>(gate_up), static_cast<float*>(out), rows, d);
    else
        silu_and_mul<BFloat16>(static_cast<const uint16_t*>(gate_up), static_cast<uint16_t*>(out),
                               rows, d);
}

}  // extern "C"
