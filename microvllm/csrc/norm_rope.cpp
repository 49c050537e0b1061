// Two small per-token layer operations in one pass each, for CPUs: RMSNorm with the
// residual add fused in (vLLM's fused_add_rms_norm) and rotary position embedding.
//
// In a decode step the tensors are tiny ([batch, hidden]), so torch's cost is per
// operator, not per byte: RMSNorm as Hugging Face writes it is eight operators (cast,
// pow, mean, add, rsqrt, mul, cast, mul) and RoPE seven, each with its own dispatch,
// allocation and pass over memory. Here each is one call and one pass per row.
//
// Both round where Hugging Face rounds, so bfloat16 results match it bit for bit except
// when the sum of squares, added in another order, lands on the other side of a
// rounding boundary (about 1 output in 10,000 differs by one bfloat16 step); float32
// results agree to float rounding.
//
//   rms_norm   x, out [rows, hidden]; residual [rows, hidden] or null; weight [hidden]
//              with residual:  residual = T(x + residual);  s = residual   (in place)
//              without:        s = x
//              out = T( weight * T( s / sqrt(mean(s * s) + eps) ) )   (math in float32)
//
//   rope       x [tokens, heads, head_dim] with rows `row_stride` elements apart (a view
//              of the fused QKV output: its query and key heads); cos, sin
//              [tokens, head_dim / 2]; out [tokens, heads, head_dim] contiguous.
//              For each head, with x1, x2 its two halves:
//              out = (T(T(x1*cos) - T(x2*sin)),  T(T(x2*cos) + T(x1*sin)))
//
// Called by platforms/cpu/ops.py; compared with the ops' forward_native in
// tests/platforms/test_cpu_ops.py.

#include "ops.h"   // this file's C entry points, declared once
#include <cmath>
#include <cstdint>

#include "dtypes.h"  // Float32, BFloat16: storage and conversions
#include "vec512.h"  // tail, load16, store16, round16 (AVX-512 builds)

namespace {

// The work on one row, two ways; the kernels below run it over rows and heads.
//
//   sum_of_squares(x, res, n)   with res: res = T(x + res), in place; returns the sum of
//                               s * s, s = res (or x without one)
//   normalize(s, weight, inv_rms, o, n)     o = T(weight * T(s * inv_rms))
//   rotate(x1, x2, c, s, o1, o2, n)         o1 = T(T(x1 c) - T(x2 s)),  o2 = T(T(x2 c) + T(x1 s))

#ifdef __AVX512BW__
// 16 lanes at a time, written out. The compiler's own vectorization of the portable
// loops below rounds to bfloat16 in integer arithmetic; with the CPU's instruction for
// it (vec512.h) these ran 1.5-1.6x faster in bfloat16 (RMSNorm over 32 rows of 576:
// 19 -> 12 us; 1,024 rows: 322 -> 194 us); float32 ran as fast as before.

template <typename Dtype, typename T = typename Dtype::storage>
float sum_of_squares(const T* x, T* res, int n) {
    __m512 sum_sq = _mm512_setzero_ps();
    for (int i = 0; i < n; i += 16) {
        const __mmask16 lanes = tail(n - i);
        __m512 s = load16(x + i, lanes);
        if (res) {
            s = round16<T>(_mm512_add_ps(s, load16(res + i, lanes)));
            store16(res + i, s, lanes);
        }
        sum_sq = _mm512_fmadd_ps(s, s, sum_sq);
    }
    return _mm512_reduce_add_ps(sum_sq);
}

template <typename Dtype, typename T = typename Dtype::storage>
void normalize(const T* s, const T* weight, float inv_rms, T* o, int n) {
    const __m512 inv = _mm512_set1_ps(inv_rms);
    for (int i = 0; i < n; i += 16) {
        const __mmask16 lanes = tail(n - i);
        const __m512 normed = round16<T>(_mm512_mul_ps(load16(s + i, lanes), inv));
        store16(o + i, _mm512_mul_ps(load16(weight + i, lanes), normed), lanes);
    }
}

template <typename Dtype, typename T = typename Dtype::storage>
void rotate(const T* x1, const T* x2, const T* c, const T* s, T* o1, T* o2, int n) {
    for (int i = 0; i < n; i += 16) {
        const __mmask16 lanes = tail(n - i);
        const __m512 a = load16(x1 + i, lanes), b = load16(x2 + i, lanes);
        const __m512 ci = load16(c + i, lanes), si = load16(s + i, lanes);
        store16(o1 + i, _mm512_sub_ps(round16<T>(_mm512_mul_ps(a, ci)), round16<T>(_mm512_mul_ps(b, si))), lanes);
        store16(o2 + i, _mm512_add_ps(round16<T>(_mm512_mul_ps(b, ci)), round16<T>(_mm512_mul_ps(a, si))), lanes);
    }
}

#else  // portable: the same math, one element at a time (the compiler vectorizes it)

template <typename Dtype, typename T = typename Dtype::storage>
float sum_of_squares(const T* x, T* res, int n) {
    float sum_sq = 0.f;
    // Two loops, not one with `if (res)` inside: vectorized, that test becomes masked
    // loads from res, and with res null every one of them needs the CPU's slow
    // fault-suppression assist (the norm ran 5x slower without a residual).
    if (res) {
        #pragma omp simd reduction(+ : sum_sq)
        for (int i = 0; i < n; ++i) {
            const float s = Dtype::round(Dtype::load(x[i]) + Dtype::load(res[i]));
            res[i] = Dtype::store(s);
            sum_sq += s * s;
        }
    } else {
        #pragma omp simd reduction(+ : sum_sq)
        for (int i = 0; i < n; ++i) {
            const float s = Dtype::load(x[i]);
            sum_sq += s * s;
        }
    }
    return sum_sq;
}

template <typename Dtype, typename T = typename Dtype::storage>
void normalize(const T* s, const T* weight, float inv_rms, T* o, int n) {
    #pragma omp simd
    for (int i = 0; i < n; ++i)
        o[i] = Dtype::store(Dtype::load(weight[i]) * Dtype::round(Dtype::load(s[i]) * inv_rms));
}

template <typename Dtype, typename T = typename Dtype::storage>
void rotate(const T* x1, const T* x2, const T* c, const T* s, T* o1, T* o2, int n) {
    #pragma omp simd
    for (int i = 0; i < n; ++i) {
        const float a = Dtype::load(x1[i]), b = Dtype::load(x2[i]);
        const float ci = Dtype::load(c[i]), si = Dtype::load(s[i]);
        o1[i] = Dtype::store(Dtype::round(a * ci) - Dtype::round(b * si));
        o2[i] = Dtype::store(Dtype::round(b * ci) + Dtype::round(a * si));
    }
}

#endif  // __AVX512BW__

template <typename Dtype, typename T = typename Dtype::storage>
void rms_norm(const T* x, T* residual, const T* weight, T* out, int rows, int hidden, float eps) {
    // Rows are independent; threads only pay off for prefill-sized batches.
    #pragma omp parallel for if (rows >= 64)
    for (int r = 0; r < rows; ++r) {
        const T* xr = x + int64_t(r) * hidden;
        T* res = residual ? residual + int64_t(r) * hidden : nullptr;
        const float sum_sq = sum_of_squares<Dtype>(xr, res, hidden);
        const float inv_rms = 1.f / std::sqrt(sum_sq / float(hidden) + eps);
        normalize<Dtype>(res ? res : xr, weight, inv_rms, out + int64_t(r) * hidden, hidden);
    }
}

template <typename Dtype, typename T = typename Dtype::storage>
void rope(const T* x, const T* cos, const T* sin, T* out, int tokens, int heads, int head_dim,
          int64_t row_stride) {
    const int half = head_dim / 2;
    #pragma omp parallel for if (tokens >= 64)
    for (int t = 0; t < tokens; ++t) {
        for (int h = 0; h < heads; ++h) {
            const T* x1 = x + t * row_stride + int64_t(h) * head_dim;
            T* o1 = out + (int64_t(t) * heads + h) * head_dim;
            rotate<Dtype>(x1, x1 + half, cos + int64_t(t) * half, sin + int64_t(t) * half, o1, o1 + half, half);
        }
    }
}

}  // namespace

extern "C" {

// dtype: 0 = float32, 1 = bfloat16. Called through ctypes.
void rms_norm(int dtype, const void* x, void* residual, const void* weight, void* out, int rows,
              int hidden, float eps) {
    if (dtype == 0)
        rms_norm<Float32>(static_cast<const float*>(x), static_cast<float*>(residual),
                          static_cast<const float*>(weight), static_cast<float*>(out), rows, hidden, eps);
    else
        rms_norm<BFloat16>(static_cast<const uint16_t*>(x), static_cast<uint16_t*>(residual),
                           static_cast<const uint16_t*>(weight), static_cast<uint16_t*>(out), rows,
                           hidden, eps);
}

void rope(int dtype, const void* x, const void* cos, const void* sin, void* out, int tokens,
          int heads, int head_dim, int64_t row_stride) {
    if (dtype == 0)
        rope<Float32>(static_cast<const float*>(x), static_cast<const float*>(cos),
                      static_cast<const float*>(sin), static_cast<float*>(out), tokens, heads,
                      head_dim, row_stride);
    else
        rope<BFloat16>(static_cast<const uint16_t*>(x), static_cast<const uint16_t*>(cos),
                       static_cast<const uint16_t*>(sin), static_cast<uint16_t*>(out), tokens,
                       heads, head_dim, row_stride);
}

}  // extern "C"
