// A bfloat16 linear layer for decode-sized batches on AVX-512 CPUs with AVX512-BF16 and
// no AMX (AMD Zen 4 and later, Intel Cooper Lake): the float32 kernel's plan
// (vec_linear.cpp), with bfloat16 weights and one instruction that does twice the work.
//
//   y[M, N] = x[M, K] @ W[N, K]^T (+ bias[N])        x, W, bias, y: bfloat16
//
// In a decode step the weights are the traffic (every step reads all of them once), and
// bfloat16 halves it; oneDNN's bfloat16 GEMM, which torch uses, runs these sizes well
// below that (notebook 11 has the recorded figures). vdpbf16ps multiplies pairs:
//
//   acc[16 float32] += a[2i]·b[2i] + a[2i+1]·b[2i+1]      for each lane i = 0..15
//
// so b must hold, for 16 output columns, each column's two consecutive inputs side by
// side ("VNNI" order, what AMX's B tiles hold too), and a the same pair of x repeated.
// The Python side packs W once, at load time, into panels of PANEL = 48 output columns
// (3 vectors), each panel stored pair-major (dpbf16_pack_weight in gemm_kernels.py):
//
//   packed[p][kp][j][e] = W[48·p + j, 2·kp + e]      panel p: K/2 pairs x 48 columns x 2
//                                                    (the last panel N % 48 = 16 or 32 wide)
//
// so a pair's 48 columns are three contiguous 64-byte vectors. Threads split the panels;
// a panel is walked in k blocks of 24 KiB of W (KC = 128 pairs), and within a block x is
// taken MR = 8 rows at a time with that 8 x 48 block of y in registers:
//
//   for kp in block:  b0 b1 b2 = packed[p][kp][0:16, 16:32, 32:48]     3 loads
//                     for r in 0..7:  a = x[r, 2kp : 2kp+2] in every lane   (one 32-bit broadcast)
//                                     acc[r][v] = vdpbf16ps(acc[r][v], a, b_v)   (v = 0..2)
//
// 24 accumulators + 3 b + 1 a = 28 of 32 registers. Between k blocks the float32 sums
// wait in a per-thread scratch [M][48] (y is bfloat16: it cannot hold them); after the
// last block the bias is added in float32 and each value rounded once to bfloat16 (to
// nearest even, as torch rounds). While a block computes, its row chunks prefetch the
// next block's lines (vec_linear.cpp says why and how).
//
// Accumulation is float32 as in oneDNN, but in another order (and vdpbf16ps treats
// denormal inputs as zero), so results differ from torch's in the last bfloat16 bit now
// and then; tests/platforms/test_dpbf16_linear.py compares with float64 math.
//
// Requires: AVX512-BF16 in the build's target (the file compiles to empty bodies
// elsewhere; kernels.py checks the CPU before loading), N % 16 == 0, K % 2 == 0.

#include "ops.h"   // this file's C entry points, declared once

#include <cstdint>
#include <cstring>
#include <utility>

#if defined(__AVX512BF16__) && defined(__AVX512BW__) && !defined(MICROVLLM_PORTABLE)
#include <immintrin.h>

#include "thread_buffer.h"
#include "vec512.h"   // widen_bfloat16

namespace {

constexpr int LANES = 16;            // float32 accumulators per vector
constexpr int NV = 3;                // vectors per panel
constexpr int PANEL = NV * LANES;    // 48 output columns
constexpr int MR = 8;                // rows per micro-kernel (3·8 + 3 + 1 = 28 registers)
constexpr int KC = 24 * 1024 / (2 * 2 * PANEL);   // pairs per k block: 24 KiB of W (128)
constexpr int LINE = 32;             // bfloat16s per 64-byte cache line

inline void prefetch_line(const uint16_t* p) { __builtin_prefetch(p, 0, 3); }

// Rows x V vectors of y (+)= x[rows, pairs k0..k0+kc) @ panel, the sums in registers.
// `first`: start from zero, else from `partial`; `last`: add the bias (may be null) and
// write bfloat16 to y, else write the float32 sums back to `partial` ([rows][PANEL]).
template <int ROWS, int V>
void micro_kernel(const uint16_t* x, const uint16_t* panel, const uint16_t* bias, float* partial,
                  uint16_t* y, int K, int N, int k0, int kc, bool first, bool last,
                  const uint16_t* prefetch, int lines) {
    constexpr int width = LANES * V;   // this panel's columns
    __m512 acc[ROWS][V];
    for (int r = 0; r < ROWS; ++r)
        for (int v = 0; v < V; ++v)
            acc[r][v] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(partial + r * PANEL + LANES * v);
    int owed = 0;   // prefetches paced over the block (vec_linear.cpp)
    for (int kp = k0; kp < k0 + kc; ++kp) {
        const uint16_t* w = panel + int64_t(kp) * width * 2;
        __m512i b[V];
        for (int v = 0; v < V; ++v) b[v] = _mm512_loadu_si512(w + 2 * LANES * v);
        for (owed += lines; owed >= kc; owed -= kc, prefetch += LINE) prefetch_line(prefetch);
        for (int r = 0; r < ROWS; ++r) {
            int32_t pair;   // x[r, 2kp] and x[r, 2kp + 1], as one 32-bit lane
            std::memcpy(&pair, x + int64_t(r) * K + 2 * kp, sizeof(pair));
            const __m512i a = _mm512_set1_epi32(pair);
            for (int v = 0; v < V; ++v)
                acc[r][v] = _mm512_dpbf16_ps(acc[r][v], reinterpret_cast<__m512bh>(a),
                                             reinterpret_cast<__m512bh>(b[v]));
        }
    }
    for (int r = 0; r < ROWS; ++r)
        for (int v = 0; v < V; ++v) {
            if (!last) {
                _mm512_storeu_ps(partial + r * PANEL + LANES * v, acc[r][v]);
                continue;
            }
            __m512 out = acc[r][v];
            if (bias) out = _mm512_add_ps(out, widen_bfloat16(_mm256_loadu_si256(
                                                   reinterpret_cast<const __m256i*>(bias + LANES * v))));
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + int64_t(r) * N + LANES * v),
                                reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(out)));
        }
}

using MicroKernel = void (*)(const uint16_t*, const uint16_t*, const uint16_t*, float*, uint16_t*,
                             int, int, int, int, bool, bool, const uint16_t*, int);

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

int dpbf16_linear_panel() { return PANEL; }

// x [M, K], packed as above, bias [N] or null, y [M, N]; all bfloat16 as uint16.
void dpbf16_linear(const void* x_, const void* packed_, const void* bias_, void* y_,
                   int M, int N, int K) {
    const auto* x = static_cast<const uint16_t*>(x_);
    const auto* packed = static_cast<const uint16_t*>(packed_);
    const auto* bias = static_cast<const uint16_t*>(bias_);
    auto* y = static_cast<uint16_t*>(y_);
    const int panels = (N + PANEL - 1) / PANEL, pairs = K / 2;
    #pragma omp parallel
    {
        float* partial = thread_buffer<float>(0, int64_t(M) * PANEL);
        #pragma omp for schedule(static)
        for (int p = 0; p < panels; ++p) {
            const int n0 = p * PANEL;
            const int width = N - n0 < PANEL ? N - n0 : PANEL;
            const uint16_t* panel = packed + int64_t(n0) * K;
            for (int k0 = 0; k0 < pairs; k0 += KC) {
                const int kc = pairs - k0 < KC ? pairs - k0 : KC;
                const bool first = k0 == 0, last = k0 + kc == pairs;
                const uint16_t* next = panel + int64_t(k0 + kc) * width * 2;
                const int chunks = (M + MR - 1) / MR, lines = kc * width * 2 / LINE;
                for (int m0 = 0, c = 0; m0 < M; m0 += MR, ++c) {
                    const int rows = M - m0 < MR ? M - m0 : MR;
                    const int begin = c * lines / chunks, end = (c + 1) * lines / chunks;
                    pick(rows, width / LANES)(x + int64_t(m0) * K, panel,
                                              last && bias ? bias + n0 : nullptr,
                                              partial + int64_t(m0) * PANEL, y + int64_t(m0) * N + n0,
                                              K, N, k0, kc, first, last, next + LINE * begin, end - begin);
                }
            }
        }
    }
}

}  // extern "C"

#else   // a target without AVX512-BF16: the entry points, never called (kernels.py
        // checks the CPU's flags before it loads this library)

extern "C" {
int dpbf16_linear_panel() { return 0; }
void dpbf16_linear(const void*, const void*, const void*, void*, int, int, int) {}
}

#endif
