// Linear layers on quantized weights, computed on the stored blocks (no float copy kept).
//
//   y[M, N] = x[M, K] @ W[N, K]^T (+ bias[N])      x, y float32; W in one of:
//
//   format 0  Q4_1 (GGUF)   a row = K/32 blocks of 20 bytes:  d fp16 | m fp16 | 16 bytes of nibbles
//                           byte 4+j: low nibble q[j], high nibble q[j+16];   w = d*q + m
//   format 1  Q8_0 (GGUF)   a row = K/32 blocks of 34 bytes:  d fp16 | 32 x int8;   w = d*q
//   format 2  int8          a row = K int8, one float32 scale per row:           w = s[n]*q
//
// (layers/quantization/gguf.py and int8.py draw the same layouts and dequantize them in
// torch: the reference these kernels are checked against.)
//
// Threads split the output rows; the activations stay float32, so the result is F.linear
// on the dequantized weights up to float rounding. The shapes of the work, by rows of x:
//
//   1-20 rows (decode, small batch)   small_batch_tile: 4 weight rows at a time, each block
//                                     dequantized in registers and used at once; a 16-lane
//                                     dot product per (x row, weight row), summed across lanes
//                                     at the end, all 16 at once (sum_lanes_16); 4 rows of x
//                                     per pass
//   21 rows and more (larger batch)   linear_wide: 48 weight rows dequantized into a float32
//                                     scratch (L2), x transposed once per call (64 rows at a
//                                     time), and tiles that broadcast a weight against 16 rows
//                                     of x per instruction
//   Q4_1 / Q8_0, 5 rows and more,     amx_quantized_linear.h: the integers multiplied on AMX
//   on AMX                            tiles against x split exactly into three bf16 parts
//   without AVX-512                   groups of 16 weight rows dequantized into the scratch,
//                                     then 4 x 4 tiles of dot products (plain loops where the
//                                     CPU lacks AVX-512; the compiler vectorizes what it can)
//
// So the weights cross memory once per call, in their stored size (Q4_1: 5 bits per
// weight instead of float32's 32), which is what a decode step is bound by. (llama.cpp
// instead quantizes x to 8 bits too and multiplies integers, e.g. with AVX-512 VNNI: faster
// arithmetic, but no longer the float model's result.) dequantize_rows is the dequantization
// alone: the prefill path (many rows of x) dequantizes a weight into a temporary and hands
// it to oneDNN / MKL.

#include "ops.h"   // this file's C entry points, declared once

#include <cstdint>
#include <cstring>
#include "thread_buffer.h"
#ifdef __AVX512F__
#include <immintrin.h>
#endif
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__AVX512BW__)
#define MICROVLLM_AMX_QUANTIZED 1
#include "amx_quantized_linear.h"
#endif

namespace {

constexpr int G = 16;      // output rows per thread work item
constexpr int QK = 32;     // weights per GGUF block

enum Format { Q4_1 = 0, Q8_0 = 1, INT8 = 2 };

inline float fp16_to_float(const uint8_t* p) {
    uint16_t h;
    std::memcpy(&h, p, 2);
#ifdef __F16C__
    return _cvtsh_ss(h);
#else
    const uint32_t sign = uint32_t(h & 0x8000) << 16, exponent = (h >> 10) & 0x1f, mantissa = h & 0x3ff;
    uint32_t bits;
    if (exponent == 0) {
        if (mantissa == 0) {
            bits = sign;
        } else {   // subnormal: normalise
            int e = -1;
            uint32_t m = mantissa;
            do { ++e; m <<= 1; } while (!(m & 0x400));
            bits = sign | uint32_t(127 - 15 - e) << 23 | (m & 0x3ff) << 13;
        }
    } else if (exponent == 31) {
        bits = sign | 0x7f800000u | mantissa << 13;
    } else {
        bits = sign | (exponent + 127 - 15) << 23 | mantissa << 13;
    }
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
#endif
}

int64_t row_bytes(int format, int K) {
    return format == Q4_1 ? int64_t(K) / QK * 20 : format == Q8_0 ? int64_t(K) / QK * 34 : K;
}

#ifdef __AVX512F__
template <int FORMAT>
inline void dequantize_block(const uint8_t* block, __m512& lo, __m512& hi) {
    if (FORMAT == Q4_1) {
        int32_t scales;
        std::memcpy(&scales, block, 4);
        const __m128 dm = _mm_cvtph_ps(_mm_cvtsi32_si128(scales));           // [d, m, 0, 0]
        const __m512 d = _mm512_broadcastss_ps(dm), m = _mm512_broadcastss_ps(_mm_movehdup_ps(dm));
        const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 4)));
        lo = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(bytes, _mm512_set1_epi32(0x0f))), d, m);
        hi = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(bytes, 4)), d, m);
    } else if (FORMAT == INT8) {   // the row's scale is applied to the sum instead
        const __m128i* q = reinterpret_cast<const __m128i*>(block);
        lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(q)));
        hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(q + 1)));
    } else {   // Q8_0
        const __m512 d = _mm512_set1_ps(fp16_to_float(block));
        const __m128i* q = reinterpret_cast<const __m128i*>(block + 2);
        lo = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(q))), d);
        hi = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(q + 1))), d);
    }
}

#endif

// One row of W (K weights) -> K floats.
void dequantize_row(int format, const uint8_t* row, float scale, float* out, int K) {
    if (format == Q4_1) {
        for (int b = 0; b < K / QK; ++b, row += 20, out += QK) {
#ifdef __AVX512F__
            __m512 lo, hi;
            dequantize_block<Q4_1>(row, lo, hi);
            _mm512_storeu_ps(out, lo);
            _mm512_storeu_ps(out + 16, hi);
#else
            const float d = fp16_to_float(row), m = fp16_to_float(row + 2);
            const uint8_t* qs = row + 4;
            for (int j = 0; j < 16; ++j) {
                out[j] = d * float(qs[j] & 0x0f) + m;
                out[j + 16] = d * float(qs[j] >> 4) + m;
            }
#endif
        }
    } else if (format == Q8_0) {
        for (int b = 0; b < K / QK; ++b, row += 34, out += QK) {
#ifdef __AVX512F__
            __m512 lo, hi;
            dequantize_block<Q8_0>(row, lo, hi);
            _mm512_storeu_ps(out, lo);
            _mm512_storeu_ps(out + 16, hi);
#else
            const float d = fp16_to_float(row);
            const int8_t* qs = reinterpret_cast<const int8_t*>(row + 2);
            for (int j = 0; j < QK; ++j) out[j] = d * float(qs[j]);
#endif
        }
    } else {
        const int8_t* qs = reinterpret_cast<const int8_t*>(row);
        int k = 0;
#ifdef __AVX512F__
        const __m512 vs = _mm512_set1_ps(scale);
        for (; k + 16 <= K; k += 16) {
            const __m512i q = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs + k)));
            _mm512_storeu_ps(out + k, _mm512_mul_ps(_mm512_cvtepi32_ps(q), vs));
        }
#endif
        for (; k < K; ++k) out[k] = float(qs[k]) * scale;
    }
}

#ifdef __AVX512F__
// 16 registers -> one: lane i = the sum of register i's 16 lanes (45 instructions, where 16
// separate reductions take ~160): pairs are interleaved and added, twice, then the four
// 128-bit quarters are added across registers.
inline __m512 sum_lanes_16(const __m512 v[16]) {
    __m512 s[8], u[4];
    for (int i = 0; i < 8; ++i)    // quarter j: [a0+a2, b0+b2, a1+a3, b1+b3] (a = v[2i], b = v[2i+1])
        s[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; ++i) {  // quarter j: the four registers' partial sums over their quarter j
        const __m512d a = _mm512_castps_pd(s[2 * i]), b = _mm512_castps_pd(s[2 * i + 1]);
        u[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
    }
    const __m512 v01 = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], 0x88), _mm512_shuffle_f32x4(u[0], u[1], 0xdd));
    const __m512 v23 = _mm512_add_ps(_mm512_shuffle_f32x4(u[2], u[3], 0x88), _mm512_shuffle_f32x4(u[2], u[3], 0xdd));
    return _mm512_add_ps(_mm512_shuffle_f32x4(v01, v23, 0x88), _mm512_shuffle_f32x4(v01, v23, 0xdd));
}
#endif

// Without AVX-512: y[0 .. ROWS, 0 .. 4] = x rows . w rows (4 rows of the scratch, K floats
// each) (+ bias), as plain loops (AVX-512 builds take small_batch_tile and linear_wide).
template <int ROWS>
void tile(const float* x, const float* w, const float* bias, float* y, int K, int N) {
    for (int r = 0; r < ROWS; ++r)
        for (int c = 0; c < 4; ++c) {
            float sum = 0.f;
            for (int k = 0; k < K; ++k) sum += x[int64_t(r) * K + k] * w[int64_t(c) * K + k];
            y[int64_t(r) * N + c] = sum + (bias ? bias[c] : 0.f);
        }
}

#ifdef __AVX512F__
// A few rows of x (a decode step at small batch): no scratch. Each block of 4 weight rows
// is dequantized in registers and used at once, so a weight costs its load, a few
// instructions to unpack, and ROWS fused multiply-adds (the scratch's store and reload
// are what the weights would otherwise cost twice at batch 1).
//
//   for each block b of 32 inputs:  for c in 0..3:  w_lo, w_hi = dequantize(W[n + c], b)
//                                                   acc[r][c] += x[r, b] * w  (r < ROWS)
// Rows ahead to prefetch: the same block two tiles on. The hardware prefetcher does not run
// that far ahead of four interleaved rows; without it the embedded model's Q8_0 lm_head at
// batch 1 took ~2.9 ms instead of ~1.8 (weights from memory; a prefetch past the end is harmless).
constexpr int PREFETCH_ROWS = 8;
template <int FORMAT, int ROWS>
void small_batch_tile(const float* x, const uint8_t* w, int64_t stride, const float* scales, const float* bias,
                      float* y, int K, int N) {
    constexpr int bytes = FORMAT == Q4_1 ? 20 : FORMAT == Q8_0 ? 34 : 32;
    __m512 acc[16];
    for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_ps();
    for (int b = 0; b < K / QK; ++b) {
        __m512 xs[ROWS][2];
        for (int r = 0; r < ROWS; ++r) {
            xs[r][0] = _mm512_loadu_ps(x + int64_t(r) * K + QK * b);
            xs[r][1] = _mm512_loadu_ps(x + int64_t(r) * K + QK * b + 16);
        }
        for (int c = 0; c < 4; ++c) {
            __m512 lo, hi;
            _mm_prefetch(reinterpret_cast<const char*>(w + (c + PREFETCH_ROWS) * stride + int64_t(b) * bytes), _MM_HINT_T0);
            dequantize_block<FORMAT>(w + c * stride + int64_t(b) * bytes, lo, hi);
            for (int r = 0; r < ROWS; ++r)
                acc[4 * r + c] = _mm512_fmadd_ps(xs[r][1], hi, _mm512_fmadd_ps(xs[r][0], lo, acc[4 * r + c]));
        }
    }
    alignas(64) float sums[16];
    _mm512_store_ps(sums, sum_lanes_16(acc));
    for (int r = 0; r < ROWS; ++r)
        for (int c = 0; c < 4; ++c)
            y[int64_t(r) * N + c] = sums[4 * r + c] * (scales ? scales[c] : 1.f) + (bias ? bias[c] : 0.f);
}

using SmallTile = void (*)(const float*, const uint8_t*, int64_t, const float*, const float*, float*, int, int);
template <int FORMAT>
constexpr SmallTile SMALL_TILES[5] = {nullptr, small_batch_tile<FORMAT, 1>, small_batch_tile<FORMAT, 2>,
                                      small_batch_tile<FORMAT, 3>, small_batch_tile<FORMAT, 4>};
constexpr int SMALL_BATCH = 4;   // rows of x the small-batch tiles take at once
// Passes of SMALL_BATCH rows before linear_wide takes over: the embedded model's Q4_1
// projections (weights from memory, 2 threads, AVX-512 without AMX) at 5 rows 11.0 ms in
// passes against 31.9 wide, at 16 rows 24.9 / 35.9, at 20 rows 31.0 / 33.9, at 32 48.4 / 37.4.
constexpr int SMALL_BATCH_PASSES = 5;
#endif

#ifdef __AVX512F__
// 5-64 rows of x (a decode step at larger batch): the weights are the broadcast side and
// x, transposed once per call, the vector side, so that no sum across lanes is needed and
// a dequantized weight, read once from the scratch, meets 16 rows of x per instruction:
//
//   xT[k][0 .. 16·MV]  = x[0 .. M, k] (zero rows up to a multiple of 16)
//   for n in the tile's NR rows:  acc[n][v] += broadcast(scratch[n][k]) * xT[k][16v .. 16v+16]
//
// NR x MV accumulators (24 of the 32 registers), MV + NR loads per NR·MV multiply-adds: the
// same balance as the float32 kernel's 8 x 48 tiles (avx512_linear.cpp).
template <int MV, int NR>
void wide_tile(const float* xT, const float* scratch, int K, float* out) {
    constexpr int MP = 16 * MV;
    __m512 acc[NR][MV];
    for (int n = 0; n < NR; ++n)
        for (int v = 0; v < MV; ++v) acc[n][v] = _mm512_setzero_ps();
    for (int k = 0; k < K; ++k) {
        __m512 a[MV];
        for (int v = 0; v < MV; ++v) a[v] = _mm512_loadu_ps(xT + int64_t(k) * MP + 16 * v);
        for (int n = 0; n < NR; ++n) {
            const __m512 b = _mm512_set1_ps(scratch[int64_t(n) * K + k]);
            for (int v = 0; v < MV; ++v) acc[n][v] = _mm512_fmadd_ps(b, a[v], acc[n][v]);
        }
    }
    for (int n = 0; n < NR; ++n)
        for (int v = 0; v < MV; ++v) _mm512_storeu_ps(out + n * MP + 16 * v, acc[n][v]);
}

using WideTile = void (*)(const float*, const float*, int, float*);
constexpr int WIDE_GROUP = 48;   // weight rows per thread work item (a multiple of every NR below)
constexpr WideTile WIDE_TILES[5][2] = {{nullptr, nullptr}, {wide_tile<1, 24>, wide_tile<1, 4>},
                                       {wide_tile<2, 12>, wide_tile<2, 4>}, {wide_tile<3, 8>, wide_tile<3, 4>},
                                       {wide_tile<4, 6>, wide_tile<4, 4>}};
constexpr int WIDE_ROWS[5] = {0, 24, 12, 8, 6};

void linear_wide(int format, const float* x, const uint8_t* w, const float* scales, const float* bias,
                 float* y, int M, int N, int K) {
    const int64_t stride = row_bytes(format, K);
    for (int m0 = 0; m0 < M; m0 += 64) {
        const int rows_x = M - m0 < 64 ? M - m0 : 64, MV = (rows_x + 15) / 16, MP = 16 * MV;
        float* xT = thread_buffer<float>(0, int64_t(K) * MP);
        for (int k = 0; k < K; ++k)
            for (int r = 0; r < MP; ++r) xT[int64_t(k) * MP + r] = r < rows_x ? x[int64_t(m0 + r) * K + k] : 0.f;
        const int groups = (N + WIDE_GROUP - 1) / WIDE_GROUP;
        #pragma omp parallel
        {
            float* scratch = thread_buffer<float>(1, int64_t(WIDE_GROUP) * K);
            alignas(64) float out[24 * 16];
            #pragma omp for schedule(static)
            for (int g = 0; g < groups; ++g) {
                const int n0 = g * WIDE_GROUP, rows = N - n0 < WIDE_GROUP ? N - n0 : WIDE_GROUP;
                for (int j = 0; j < rows; ++j)
                    dequantize_row(format, w + (n0 + j) * stride, scales ? scales[n0 + j] : 1.f,
                                   scratch + int64_t(j) * K, K);
                int full_tiles = rows / WIDE_ROWS[MV];   // then tiles of 4: rows is a multiple of 4
                while ((rows - full_tiles * WIDE_ROWS[MV]) % 4) --full_tiles;
                for (int n = 0, t = 0; n < rows; ++t) {
                    const bool full = t < full_tiles;
                    const int nr = full ? WIDE_ROWS[MV] : 4;
                    WIDE_TILES[MV][full ? 0 : 1](xT, scratch + int64_t(n) * K, K, out);
                    for (int j = 0; j < nr; ++j)
                        for (int r = 0; r < rows_x; ++r)
                            y[int64_t(m0 + r) * N + n0 + n + j] = out[j * MP + r] + (bias ? bias[n0 + n + j] : 0.f);
                    n += nr;
                }
            }
        }
    }
}
#endif

using Tile = void (*)(const float*, const float*, const float*, float*, int, int);
constexpr Tile TILES[5] = {nullptr, tile<1>, tile<2>, tile<3>, tile<4>};

void linear(int format, const float* x, const uint8_t* w, const float* scales, const float* bias,
            float* y, int M, int N, int K) {
    const int64_t stride = row_bytes(format, K);
    const int groups = (N + G - 1) / G;
#ifdef MICROVLLM_AMX_QUANTIZED
    if (format != INT8 && M > SMALL_BATCH && N % amx_quantized::TILE == 0 && amx_quantized::ready()) {
        amx_quantized::linear(format == Q8_0, x, w, bias, y, M, N, K);   // (K % 32 == 0: whole blocks)
        return;
    }
#endif
#ifdef __AVX512F__
    if (M <= SMALL_BATCH_PASSES * SMALL_BATCH && K % QK == 0) {
        // 4 rows of x per pass: past 4 rows the weights are read once per pass, which still
        // beats linear_wide's dequantization into the scratch up to ~SMALL_BATCH_PASSES passes.
        for (int m0 = 0; m0 < M; m0 += SMALL_BATCH) {
            const int rows = M - m0 < SMALL_BATCH ? M - m0 : SMALL_BATCH;
            const SmallTile tile = format == Q4_1 ? SMALL_TILES<Q4_1>[rows]
                                 : format == Q8_0 ? SMALL_TILES<Q8_0>[rows] : SMALL_TILES<INT8>[rows];
            const float* xm = x + int64_t(m0) * K;
            float* ym = y + int64_t(m0) * N;
            #pragma omp parallel for schedule(static)
            for (int n = 0; n < N; n += 4)
                tile(xm, w + n * stride, stride, scales ? scales + n : nullptr, bias ? bias + n : nullptr, ym + n, K, N);
        }
        return;
    }
    linear_wide(format, x, w, scales, bias, y, M, N, K);
    return;
#endif
    #pragma omp parallel
    {
        float* scratch = thread_buffer<float>(1, int64_t(G) * K);
        #pragma omp for schedule(static)
        for (int g = 0; g < groups; ++g) {
            const int n0 = g * G, rows = N - n0 < G ? N - n0 : G;   // a multiple of 4
            for (int j = 0; j < rows; ++j)
                dequantize_row(format, w + (n0 + j) * stride, scales ? scales[n0 + j] : 1.f,
                               scratch + int64_t(j) * K, K);
            for (int m0 = 0; m0 < M; m0 += 4) {
                const int m = M - m0 < 4 ? M - m0 : 4;
                for (int j0 = 0; j0 < rows; j0 += 4)
                    TILES[m](x + int64_t(m0) * K, scratch + int64_t(j0) * K,
                             bias ? bias + n0 + j0 : nullptr, y + int64_t(m0) * N + n0 + j0, K, N);
            }
        }
    }
}

}  // namespace

extern "C" {

void q4_1_linear(const void* x, const void* weight, const void* bias, void* y, int M, int N, int K) {
    linear(Q4_1, static_cast<const float*>(x), static_cast<const uint8_t*>(weight), nullptr,
           static_cast<const float*>(bias), static_cast<float*>(y), M, N, K);
}

void q8_0_linear(const void* x, const void* weight, const void* bias, void* y, int M, int N, int K) {
    linear(Q8_0, static_cast<const float*>(x), static_cast<const uint8_t*>(weight), nullptr,
           static_cast<const float*>(bias), static_cast<float*>(y), M, N, K);
}

void int8_linear(const void* x, const void* weight, const void* scales, const void* bias, void* y, int M, int N, int K) {
    linear(INT8, static_cast<const float*>(x), static_cast<const uint8_t*>(weight), static_cast<const float*>(scales),
           static_cast<const float*>(bias), static_cast<float*>(y), M, N, K);
}

// The GEMM signature the decode fast path's layer loop calls (decode_layers.cpp), for int8:
// `weight_and_scales` points to two pointers, the int8 rows and their float32 scales.
void int8_linear_pair(const void* x, const void* weight_and_scales, const void* bias, void* y, int M, int N, int K) {
    const void* const* pair = static_cast<const void* const*>(weight_and_scales);
    int8_linear(x, pair[0], pair[1], bias, y, M, N, K);
}

int quantized_amx_ready() {
#ifdef MICROVLLM_AMX_QUANTIZED
    return amx_quantized::ready() ? 1 : 0;
#else
    return 0;
#endif
}

void dequantize_rows(int format, const void* weight, const void* scales, void* out, int N, int K) {
    const uint8_t* w = static_cast<const uint8_t*>(weight);
    const float* s = static_cast<const float*>(scales);
    float* o = static_cast<float*>(out);
    const int64_t stride = row_bytes(format, K);
    #pragma omp parallel for schedule(static)
    for (int n = 0; n < N; ++n) dequantize_row(format, w + n * stride, s ? s[n] : 1.f, o + int64_t(n) * K, K);
}

}  // extern "C"
