// A float32 linear layer for decode-sized batches, on AVX-512.
//
//   y[M, N] = x[M, K] @ W[N, K]^T (+ bias[N])        all float32
//
// In a decode step M is the number of running requests (1-64). Every step reads all of
// the weights once and does 2·M FLOPs per weight read, so with a few rows the kernel
// must stream W at memory speed, and near 32 rows it must also keep both FMA units
// busy *while* W streams in; oneDNN, which torch uses, does neither at these sizes
// (notebook 11 has the recorded figures).
//
// The Python side packs W once, at load time, into panels of PANEL = 48 output
// columns, each panel stored k-major, so that one input's 48 weights are three
// contiguous 64-byte vectors and a panel is one contiguous run of memory
// (avx512_pack_weight in platforms/cpu/gemm_kernels.py):
//
//   packed[p][k][j] = W[48·p + j, k]      panel p: K x 48 floats
//                                         (the last panel N % 48 = 16 or 32 columns wide)
//
// Threads split the panels, so each streams its own contiguous slice of W. A panel is
// walked in k blocks of KC = 128 inputs (24 KiB of W, which stays in L1 while used).
// Within a block, x is taken MR = 8 rows at a time, and the micro-kernel keeps that
// 8 x 48 block of y in 24 of the 32 zmm registers:
//
//   for k in block:  b0 b1 b2 = packed[p][k][0:16, 16:32, 32:48]    3 loads
//                    for r in 0..7:  a = broadcast x[r, k]          8 loads
//                                    acc[r][v] += a * b_v           24 FMAs (v = 0..2)
//
// so each weight comes from memory once per call and is reused from L1 for every
// 8 rows. Overlapping that memory read with the arithmetic is what makes 32 rows
// fast: while a block computes, its row chunks prefetch the *next* block's lines, a
// few per k step, spread evenly over the block's work (without it, at 32 rows the
// kernel was much slower, as slow as oneDNN).
//
// Every output is one chain of FMAs in k order (partial sums go to y between k blocks
// and come back exactly); the bias is added at the end.
//
// Requires: AVX-512F and N % 16 == 0. Called by platforms/cpu/gemm_kernels.py; compared with F.linear in
// tests/platforms/test_avx512_linear.py.

#include "ops.h"   // this file's C entry points, declared once
#include <immintrin.h>

#include <cstdint>

namespace {

constexpr int PANEL = 48;   // output columns per panel: three zmm vectors of 16 floats
constexpr int MR = 8;       // rows of x per micro-kernel call
constexpr int KC = 128;     // inputs per k block

// An inline function, not a lambda: GCC dropped __builtin_prefetch inside a [&] lambda.
inline void prefetch_line(const float* p) { __builtin_prefetch(p, 0, 3); }

// y[0:ROWS, 0:16·NV] (+)= x[0:ROWS, k0:k0+kc] @ panel[k0:k0+kc], with that block of y
// in registers: ROWS and NV are template parameters so that the loops unroll.
// `first` starts from zero instead of y; `bias` (given on the last k block) is added
// at the end; the call also prefetches `lines` cache lines from `prefetch` on.
template <int ROWS, int NV>
void micro_kernel(const float* x, const float* panel, const float* bias, float* y,
                  int K, int N, int k0, int kc, bool first, const float* prefetch, int lines) {
    constexpr int width = 16 * NV;
    __m512 acc[ROWS][NV];
    for (int r = 0; r < ROWS; ++r)
        for (int v = 0; v < NV; ++v)
            acc[r][v] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(y + int64_t(r) * N + 16 * v);
    int owed = 0;   // prefetches are paced like Bresenham's line: `lines` over kc steps
    for (int k = k0; k < k0 + kc; ++k) {
        const float* w = panel + int64_t(k) * width;
        __m512 b[NV];
        for (int v = 0; v < NV; ++v) b[v] = _mm512_loadu_ps(w + 16 * v);
        for (owed += lines; owed >= kc; owed -= kc, prefetch += 16) prefetch_line(prefetch);
        for (int r = 0; r < ROWS; ++r) {
            const __m512 a = _mm512_set1_ps(x[int64_t(r) * K + k]);
            for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_fmadd_ps(a, b[v], acc[r][v]);
        }
    }
    for (int r = 0; r < ROWS; ++r)
        for (int v = 0; v < NV; ++v) {
            __m512 out = acc[r][v];
            if (bias) out = _mm512_add_ps(out, _mm512_loadu_ps(bias + 16 * v));
            _mm512_storeu_ps(y + int64_t(r) * N + 16 * v, out);
        }
}

using MicroKernel = void (*)(const float*, const float*, const float*, float*, int, int, int,
                             int, bool, const float*, int);

template <int NV>
MicroKernel pick_rows(int rows) {
    switch (rows) {
        case 1: return micro_kernel<1, NV>;
        case 2: return micro_kernel<2, NV>;
        case 3: return micro_kernel<3, NV>;
        case 4: return micro_kernel<4, NV>;
        case 5: return micro_kernel<5, NV>;
        case 6: return micro_kernel<6, NV>;
        case 7: return micro_kernel<7, NV>;
        default: return micro_kernel<8, NV>;
    }
}

MicroKernel pick(int rows, int vectors) {
    return vectors == 3 ? pick_rows<3>(rows) : vectors == 2 ? pick_rows<2>(rows) : pick_rows<1>(rows);
}

}  // namespace

extern "C" {

// x [M, K], packed as above, bias [N] or null, y [M, N].
void avx512_linear(const void* x_, const void* packed_, const void* bias_, void* y_,
                   int M, int N, int K) {
    const float *x = static_cast<const float*>(x_), *packed = static_cast<const float*>(packed_);
    const float* bias = static_cast<const float*>(bias_);
    float* y = static_cast<float*>(y_);
    const int panels = (N + PANEL - 1) / PANEL;
    #pragma omp parallel for schedule(static)
    for (int p = 0; p < panels; ++p) {
        const int n0 = p * PANEL;
        const int width = N - n0 < PANEL ? N - n0 : PANEL;
        const float* panel = packed + int64_t(n0) * K;
        for (int k0 = 0; k0 < K; k0 += KC) {
            const int kc = K - k0 < KC ? K - k0 : KC;
            const bool first = k0 == 0, last = k0 + kc == K;
            // The next block's W (the next panel's first block, after the last one:
            // panels are contiguous), shared out among this block's row chunks.
            const float* next = panel + int64_t(k0 + kc) * width;
            const int chunks = (M + MR - 1) / MR, lines = kc * width / 16;
            for (int m0 = 0, c = 0; m0 < M; m0 += MR, ++c) {
                const int rows = M - m0 < MR ? M - m0 : MR;
                const int begin = c * lines / chunks, end = (c + 1) * lines / chunks;
                pick(rows, width / 16)(x + int64_t(m0) * K, panel,
                                       last && bias ? bias + n0 : nullptr,
                                       y + int64_t(m0) * N + n0, K, N, k0, kc, first,
                                       next + 16 * begin, end - begin);
            }
        }
    }
}

}  // extern "C"
