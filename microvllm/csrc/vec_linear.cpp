// A float32 linear layer for decode-sized batches, on any vector unit vec.h knows
// (AVX-512, AVX2 + FMA, NEON): one source, written against VecF.
//
//   y[M, N] = x[M, K] @ W[N, K]^T (+ bias[N])        all float32
//
// In a decode step M is the number of running requests (1-64). Every step reads all of
// the weights once and does 2·M FLOPs per weight read, so with a few rows the kernel
// must stream W at memory speed, and near 32 rows it must also keep the FMA units
// busy *while* W streams in; oneDNN, which torch uses, does neither at these sizes
// (notebook 11 has the recorded figures).
//
// The Python side packs W once, at load time, into panels of PANEL = 3 vectors of output
// columns (L = VecF::lanes floats each), each panel stored k-major, so that one input's
// PANEL weights are three contiguous vectors and a panel is one contiguous run of memory
// (vec_pack_weight in platforms/cpu/gemm_kernels.py; the width comes from
// vec_linear_panel(), so Python never guesses it):
//
//   packed[p][k][j] = W[PANEL·p + j, k]      panel p: K x PANEL floats
//                                            (the last panel N % PANEL = L or 2 L wide)
//
// Threads split the panels, so each streams its own contiguous slice of W. A panel is
// walked in k blocks of KC inputs, KC·PANEL·4 bytes = 24 KiB of W whatever the width
// (it stays in L1 while used). Within a block, x is taken MR rows at a time, and the
// micro-kernel keeps that MR x PANEL block of y in registers:
//
//   for k in block:  b0 b1 b2 = packed[p][k][0:L, L:2L, 2L:3L]   3 loads
//                    for r in 0..MR-1:  a = broadcast x[r, k]     MR loads
//                                       acc[r][v] += a * b_v      3·MR FMAs (v = 0..2)
//
// MR is as many rows as the registers hold: 3·MR accumulators + 3 b + 1 a, at most 8
// (more rows per chunk did not measure faster, and 8 keeps the AVX-512 kernel as it was):
//
//   target        L    PANEL   registers   MR   registers used
//   AVX-512      16      48       32        8   24 acc + 3 b + 1 a = 28
//   AVX2 + FMA    8      24       16        4   12 acc + 3 b + 1 a = 16
//   NEON          4      12       32        8   24 acc + 3 b + 1 a = 28
//
// so each weight comes from memory once per call and is reused from L1 for every
// MR rows. Overlapping that memory read with the arithmetic is what makes 32 rows
// fast: while a block computes, its row chunks prefetch the *next* block's lines, a
// few per k step, spread evenly over the block's work (without it, at 32 rows the
// AVX-512 kernel was much slower, as slow as oneDNN). A cache line is 64 bytes =
// 16 floats on all three, whatever the vector width.
//
// Every output is one chain of FMAs in k order (partial sums go to y between k blocks
// and come back exactly); the bias is added at the end.
//
// Requires: a vector unit (MICROVLLM_VEC != 0; the portable build compiles to stubs and
// vec_linear_panel() says 0) and N % L == 0. Called by platforms/cpu/gemm_kernels.py;
// compared with float64 math in tests/platforms/test_vec_linear.py.

#include "ops.h"   // this file's C entry points, declared once
#include "vec.h"

#include <cstdint>
#include <utility>

#if MICROVLLM_VEC

namespace {

constexpr int LANES = VecF::lanes;
constexpr int NV = 3;                  // vectors per panel
constexpr int PANEL = NV * LANES;      // output columns per panel: 48, 24 or 12
// Rows per micro-kernel: the accumulators (NV per row), the panel's NV b vectors and
// one broadcast a must all fit the registers, or the compiler spills them to the stack.
constexpr int MR = (VecF::registers - NV - 1) / NV < 8 ? (VecF::registers - NV - 1) / NV : 8;
constexpr int KC = 24 * 1024 / (4 * PANEL);   // inputs per k block: 24 KiB of W (128 on AVX-512)
constexpr int LINE = 16;               // floats per 64-byte cache line (for the prefetches)

// An inline function, not a lambda: GCC dropped __builtin_prefetch inside a [&] lambda.
inline void prefetch_line(const float* p) { __builtin_prefetch(p, 0, 3); }

// y[0:ROWS, 0:LANES·V] (+)= x[0:ROWS, k0:k0+kc] @ panel[k0:k0+kc], with that block of y
// in registers: ROWS and V are template parameters so that the loops unroll.
// `first` starts from zero instead of y; `bias` (given on the last k block) is added
// at the end; the call also prefetches `lines` cache lines from `prefetch` on.
template <int ROWS, int V>
void micro_kernel(const float* x, const float* panel, const float* bias, float* y,
                  int K, int N, int k0, int kc, bool first, const float* prefetch, int lines) {
    constexpr int width = LANES * V;
    VecF acc[ROWS][V];
    for (int r = 0; r < ROWS; ++r)
        for (int v = 0; v < V; ++v)
            acc[r][v] = first ? VecF::zero() : VecF::load(y + int64_t(r) * N + LANES * v);
    int owed = 0;   // prefetches are paced like Bresenham's line: `lines` over kc steps
    for (int k = k0; k < k0 + kc; ++k) {
        const float* w = panel + int64_t(k) * width;
        VecF b[V];
        for (int v = 0; v < V; ++v) b[v] = VecF::load(w + LANES * v);
        for (owed += lines; owed >= kc; owed -= kc, prefetch += LINE) prefetch_line(prefetch);
        for (int r = 0; r < ROWS; ++r) {
            const VecF a = VecF::set1(x[int64_t(r) * K + k]);
            for (int v = 0; v < V; ++v) acc[r][v] = fma(a, b[v], acc[r][v]);
        }
    }
    for (int r = 0; r < ROWS; ++r)
        for (int v = 0; v < V; ++v) {
            VecF out = acc[r][v];
            if (bias) out = out + VecF::load(bias + LANES * v);
            out.store(y + int64_t(r) * N + LANES * v);
        }
}

using MicroKernel = void (*)(const float*, const float*, const float*, float*, int, int, int,
                             int, bool, const float*, int);

// micro_kernel<rows, V> for rows = 1..MR, looked up in a table made at compile time.
template <int V, int... R>
MicroKernel pick_rows(int rows, std::integer_sequence<int, R...>) {
    static constexpr MicroKernel table[] = {micro_kernel<R + 1, V>...};
    return table[rows - 1];
}

MicroKernel pick(int rows, int vectors) {
    const auto all = std::make_integer_sequence<int, MR>{};
    return vectors == 3 ? pick_rows<3>(rows, all) : vectors == 2 ? pick_rows<2>(rows, all)
                                                                 : pick_rows<1>(rows, all);
}

}  // namespace

extern "C" {

int vec_linear_panel() { return PANEL; }

// x [M, K], packed as above, bias [N] or null, y [M, N].
void vec_linear(const void* x_, const void* packed_, const void* bias_, void* y_,
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
            const int chunks = (M + MR - 1) / MR, lines = kc * width / LINE;
            for (int m0 = 0, c = 0; m0 < M; m0 += MR, ++c) {
                const int rows = M - m0 < MR ? M - m0 : MR;
                const int begin = c * lines / chunks, end = (c + 1) * lines / chunks;
                pick(rows, width / LANES)(x + int64_t(m0) * K, panel,
                                          last && bias ? bias + n0 : nullptr,
                                          y + int64_t(m0) * N + n0, K, N, k0, kc, first,
                                          next + LINE * begin, end - begin);
            }
        }
    }
}

}  // extern "C"

#else   // no vector unit in this build (MICROVLLM_CPU_ISA=portable): the Python side
        // sees a panel of 0 and keeps float32 projections on oneDNN.

extern "C" {
int vec_linear_panel() { return 0; }
void vec_linear(const void*, const void*, const void*, void*, int, int, int) {}
}

#endif
