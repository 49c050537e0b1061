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
// on the dequantized weights up to float rounding. The code is written once against VecF
// (vec.h: 16 float lanes on AVX-512, 8 on AVX2, 4 on NEON). The shapes of the work, by
// rows of x:
//
//   a few rows (decode, small batch)  small_batch_tile: 4 weight rows at a time, each block
//                                     dequantized in registers a vector at a time and used
//                                     at once; a VecF dot product per (x row, weight row),
//                                     summed across lanes at the end. 4 rows of x per pass,
//                                     up to SMALL_BATCH_PASSES passes; the accumulators must
//                                     fit the registers:
//                                       AVX-512  4 x rows x 4 weight rows (16 of 32), 1-20 rows
//                                       AVX2     4 x rows x 2 weight rows ( 8 of 16), 1-8 rows
//                                       NEON     4 x rows x 4 weight rows (16 of 32), 1-8 rows
//   more rows (larger batch)          linear_wide: 48 weight rows dequantized into a float32
//                                     scratch (L2), x transposed once per call, and tiles that
//                                     broadcast a weight against LANES x MV rows of x per
//                                     instruction (AVX-512 and NEON: up to 4 vectors of x rows
//                                     x 6-24 weight rows; AVX2: up to 2 x 6-12)
//   Q4_1 / Q8_0, 5 rows and more,     amx_quantized_linear.h: the integers multiplied on AMX
//   on AMX                            tiles against x split exactly into three bf16 parts
//   portable build (no VecF)          groups of 16 weight rows dequantized into the scratch,
//                                     then 4 x 4 tiles of dot products as plain loops (the
//                                     compiler vectorizes what it can)
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
#include "dtypes.h"   // half_to_float, Half
#include "thread_buffer.h"
#include "vec.h"
#if defined(__F16C__) && !defined(MICROVLLM_PORTABLE)
#include <immintrin.h>   // _cvtsh_ss (vec.h includes it only for its own targets)
#endif
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__AVX512BW__)
#define MICROVLLM_AMX_QUANTIZED 1
#include "amx_quantized_linear.h"
#endif

namespace {

constexpr int QK = 32;     // weights per GGUF block

enum Format { Q4_1 = 0, Q8_0 = 1, INT8 = 2 };

// A block's fp16 scale at p (any alignment) -> float32: one instruction with F16C or on
// arm64, else dtypes.h's integer conversion (the portable build).
inline float fp16_to_float(const uint8_t* p) {
#if defined(__F16C__) && !defined(MICROVLLM_PORTABLE)
    uint16_t h;
    std::memcpy(&h, p, 2);
    return _cvtsh_ss(h);
#elif defined(__aarch64__) && !defined(MICROVLLM_PORTABLE)
    Half h;   // _Float16 or __fp16 there: converted by fcvt
    std::memcpy(&h, p, 2);
    return load_half(h);
#else
    uint16_t h;
    std::memcpy(&h, p, 2);
    return half_to_float(h);
#endif
}

int64_t row_bytes(int format, int K) {
    return format == Q4_1 ? int64_t(K) / QK * 20 : format == Q8_0 ? int64_t(K) / QK * 34 : K;
}

#if MICROVLLM_VEC
constexpr int LANES = VecF::lanes;
constexpr int VECTORS = QK / LANES;   // vectors per block: 2 (AVX-512), 4 (AVX2), 8 (NEON)

// A Q4_1 block's d and m (its first 4 bytes, two fp16), each in every lane. With F16C both
// are converted by one instruction: two scalar conversions (as fp16_to_float does) made the
// AVX-512 Q4_1 tiles ~12% slower at batch 1.
inline void load_d_m(const uint8_t* block, VecF& d, VecF& m) {
#if defined(__F16C__) && (MICROVLLM_VEC == 512 || MICROVLLM_VEC == 256)
    int32_t both;
    std::memcpy(&both, block, 4);
    const __m128 dm = _mm_cvtph_ps(_mm_cvtsi32_si128(both));   // [d, m, 0, 0]
#if MICROVLLM_VEC == 512
    d = {_mm512_broadcastss_ps(dm)}, m = {_mm512_broadcastss_ps(_mm_movehdup_ps(dm))};
#else
    d = {_mm256_broadcastss_ps(dm)}, m = {_mm256_broadcastss_ps(_mm_movehdup_ps(dm))};
#endif
#else
    d = VecF::set1(fp16_to_float(block)), m = VecF::set1(fp16_to_float(block + 2));
#endif
}

// One block of 32 weights, dequantized a vector at a time: use(v, w) gets vector v, the
// weights v*LANES .. v*LANES + LANES - 1 of the block, as float32 (INT8: q alone, the
// row's scale is applied by the caller). The vectors are made and used one by one, so a
// block costs one register, not VECTORS.
//
//   Q4_1  bytes 4..19 = nibbles:  v < VECTORS/2: the low nibbles of bytes 4 + v*LANES ..
//                                 else:          the high nibbles of the same bytes
template <int FORMAT, typename Use>
inline void for_each_vector(const uint8_t* block, Use&& use) {
    if (FORMAT == Q4_1) {
        VecF d, m;
        load_d_m(block, d, m);
        #pragma GCC unroll 8
        for (int v = 0; v < VECTORS / 2; ++v) use(v, fma(VecF::load_nibbles<false>(block + 4 + v * LANES), d, m));
        #pragma GCC unroll 8
        for (int v = 0; v < VECTORS / 2; ++v)
            use(VECTORS / 2 + v, fma(VecF::load_nibbles<true>(block + 4 + v * LANES), d, m));
    } else if (FORMAT == Q8_0) {
        const VecF d = VecF::set1(fp16_to_float(block));
        const int8_t* q = reinterpret_cast<const int8_t*>(block + 2);
        #pragma GCC unroll 8
        for (int v = 0; v < VECTORS; ++v) use(v, VecF::load_i8(q + v * LANES) * d);
    } else {
        const int8_t* q = reinterpret_cast<const int8_t*>(block);
        #pragma GCC unroll 8
        for (int v = 0; v < VECTORS; ++v) use(v, VecF::load_i8(q + v * LANES));
    }
}
#endif

// One row of W (K weights) -> K floats.
void dequantize_row(int format, const uint8_t* row, float scale, float* out, int K) {
#if MICROVLLM_VEC
    auto store = [](float* to) { return [to](int v, VecF w) { w.store(to + v * LANES); }; };
    if (format == Q4_1) {
        for (int b = 0; b < K / QK; ++b) for_each_vector<Q4_1>(row + 20 * b, store(out + QK * b));
    } else if (format == Q8_0) {
        for (int b = 0; b < K / QK; ++b) for_each_vector<Q8_0>(row + 34 * b, store(out + QK * b));
    } else {
        const int8_t* qs = reinterpret_cast<const int8_t*>(row);
        const VecF s = VecF::set1(scale);
        int k = 0;
        for (; k + LANES <= K; k += LANES) (VecF::load_i8(qs + k) * s).store(out + k);
        for (; k < K; ++k) out[k] = float(qs[k]) * scale;
    }
#else
    if (format == Q4_1) {
        for (int b = 0; b < K / QK; ++b, row += 20, out += QK) {
            const float d = fp16_to_float(row), m = fp16_to_float(row + 2);
            const uint8_t* qs = row + 4;
            for (int j = 0; j < 16; ++j) {
                out[j] = d * float(qs[j] & 0x0f) + m;
                out[j + 16] = d * float(qs[j] >> 4) + m;
            }
        }
    } else if (format == Q8_0) {
        for (int b = 0; b < K / QK; ++b, row += 34, out += QK) {
            const float d = fp16_to_float(row);
            const int8_t* qs = reinterpret_cast<const int8_t*>(row + 2);
            for (int j = 0; j < QK; ++j) out[j] = d * float(qs[j]);
        }
    } else {
        const int8_t* qs = reinterpret_cast<const int8_t*>(row);
        for (int k = 0; k < K; ++k) out[k] = float(qs[k]) * scale;
    }
#endif
}

#if MICROVLLM_VEC == 512
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

#if !MICROVLLM_VEC
// Portable build: y[0 .. ROWS, 0 .. 4] = x rows . w rows (4 rows of the scratch, K floats
// each) (+ bias), as plain loops (vector builds take small_batch_tile and linear_wide).
template <int ROWS>
void tile(const float* x, const float* w, const float* bias, float* y, int K, int N) {
    for (int r = 0; r < ROWS; ++r)
        for (int c = 0; c < 4; ++c) {
            float sum = 0.f;
            for (int k = 0; k < K; ++k) sum += x[int64_t(r) * K + k] * w[int64_t(c) * K + k];
            y[int64_t(r) * N + c] = sum + (bias ? bias[c] : 0.f);
        }
}
#endif

#if MICROVLLM_VEC
// A few rows of x (a decode step at small batch): no scratch. Each block of 4 weight rows
// is dequantized in registers and used at once, so a weight costs its load, a few
// instructions to unpack, and ROWS fused multiply-adds (the scratch's store and reload
// are what the weights would otherwise cost twice at batch 1).
//
//   for each block b of 32 inputs:  for c in 0..3:  for v in 0..VECTORS-1:
//                                       w = dequantize(W[n + c], b, vector v)
//                                       acc[r][c] += x[r, 32b + LANES v ..] * w   (r < ROWS)
//   y[r, n + c] = sum of acc[r][c]'s lanes
//
// Rows ahead to prefetch: the same block two tiles on. The hardware prefetcher does not run
// that far ahead of four interleaved rows; without it the embedded model's Q8_0 lm_head at
// batch 1 took ~2.9 ms instead of ~1.8 on AVX-512 (weights from memory; a prefetch past the
// end is harmless). Written once against VecF, this runs as fast as the AVX-512-only tile it
// replaced (one thread, the four projection shapes, 1 / 4 / 16 rows: Q4_1 0.27 / 0.40 / 1.57
// ms against 0.29 / 0.41 / 1.61, Q8_0 0.25 / 0.38 / 1.49 against 0.26 / 0.40 / 1.56).
constexpr int PREFETCH_ROWS = 8;
// Weight rows per tile: 4, or 2 where 4 x ROWS accumulators would crowd out the weight
// vector and Q4_1's d and m (AVX2's 16 registers at 4 rows of x: 16 accumulators spilled
// to the stack, 8 fit).
constexpr int tile_cols(int rows) { return 4 * rows <= VecF::registers * 3 / 4 ? 4 : 2; }
template <int FORMAT, int ROWS, int COLS = tile_cols(ROWS)>
void small_batch_tile(const float* x, const uint8_t* w, int64_t stride, const float* scales, const float* bias,
                      float* y, int K, int N) {
    constexpr int bytes = FORMAT == Q4_1 ? 20 : FORMAT == Q8_0 ? 34 : 32;
    VecF acc[ROWS][COLS];
    for (int r = 0; r < ROWS; ++r)
        for (int c = 0; c < COLS; ++c) acc[r][c] = VecF::zero();
    for (int b = 0; b < K / QK; ++b) {
        const float* xb = x + QK * b;
        for (int c = 0; c < COLS; ++c) {
            const uint8_t* block = w + c * stride + int64_t(b) * bytes;
            __builtin_prefetch(block + PREFETCH_ROWS * stride);
            for_each_vector<FORMAT>(block, [&](int v, VecF wv) {
                for (int r = 0; r < ROWS; ++r)
                    acc[r][c] = fma(VecF::load(xb + int64_t(r) * K + v * LANES), wv, acc[r][c]);
            });
        }
    }
#if MICROVLLM_VEC == 512
    static_assert(ROWS * COLS <= 16, "sum_lanes_16 takes 16 registers");
    __m512 all[16];
    for (int i = 0; i < 16; ++i) all[i] = i < ROWS * COLS ? acc[i / COLS][i % COLS].v : _mm512_setzero_ps();
    alignas(64) float sums[16];
    _mm512_store_ps(sums, sum_lanes_16(all));
#else
    float sums[ROWS * COLS];
    for (int i = 0; i < ROWS * COLS; ++i) sums[i] = acc[i / COLS][i % COLS].sum();
#endif
    for (int r = 0; r < ROWS; ++r)
        for (int c = 0; c < COLS; ++c)
            y[int64_t(r) * N + c] = sums[COLS * r + c] * (scales ? scales[c] : 1.f) + (bias ? bias[c] : 0.f);
}

constexpr int SMALL_BATCH = 4;   // rows of x the small-batch tiles take at once
using SmallTile = void (*)(const float*, const uint8_t*, int64_t, const float*, const float*, float*, int, int);
template <int FORMAT>
constexpr SmallTile SMALL_TILES[5] = {nullptr, small_batch_tile<FORMAT, 1>, small_batch_tile<FORMAT, 2>,
                                      small_batch_tile<FORMAT, 3>, small_batch_tile<FORMAT, 4>};
// Passes of SMALL_BATCH rows before linear_wide takes over. AVX-512: the embedded model's
// Q4_1 projections (weights from memory, 2 threads, AVX-512 without AMX) at 5 rows 11.0 ms
// in passes against 31.9 wide, at 16 rows 24.9 / 35.9, at 20 rows 31.0 / 33.9, at 32 48.4 / 37.4.
// AVX2 (one thread, the four projection shapes once each): Q4_1 at 4 rows 0.59 ms in passes
// against 1.03 wide, at 8 rows 1.14 / 1.05 (Q8_0 1.06 / 1.17, int8 0.98 / 1.1-1.5), at 12
// 1.68 / 1.60, at 16 2.24 / 1.67. NEON (not measured) follows AVX2: narrow vectors make
// the unpacking, repeated per pass, the larger share.
constexpr int SMALL_BATCH_PASSES = MICROVLLM_VEC == 512 ? 5 : 2;

// More rows of x (a decode step at larger batch): the weights are the broadcast side and
// x, transposed once per call, the vector side, so that no sum across lanes is needed and
// a dequantized weight, read once from the scratch, meets LANES rows of x per instruction:
//
//   xT[chunk][k][0 .. LANES·MV] = x[chunk's rows, k] (zero rows up to a multiple of LANES)
//   for n in the tile's NR rows:  acc[n][v] += broadcast(scratch[n][k]) * xT[k][LANES v ..]
//
// NR x MV accumulators (24 of 32 registers on AVX-512 and NEON, 12 of AVX2's 16), MV + NR
// loads per NR·MV multiply-adds: the same balance as the float32 kernel's 8 x 48 tiles
// (avx512_linear.cpp). A chunk is MAX_MV vectors of rows of x (64 rows on AVX-512, 16 on
// AVX2 and NEON); each group of weight rows is dequantized once and used by every chunk.
template <int MV, int NR>
void wide_tile(const float* xT, const float* scratch, int K, float* out) {
    constexpr int MP = LANES * MV;
    VecF acc[NR][MV];
    for (int n = 0; n < NR; ++n)
        for (int v = 0; v < MV; ++v) acc[n][v] = VecF::zero();
    for (int k = 0; k < K; ++k) {
        VecF a[MV];
        for (int v = 0; v < MV; ++v) a[v] = VecF::load(xT + int64_t(k) * MP + LANES * v);
        for (int n = 0; n < NR; ++n) {
            const VecF b = VecF::set1(scratch[int64_t(n) * K + k]);
            for (int v = 0; v < MV; ++v) acc[n][v] = fma(b, a[v], acc[n][v]);
        }
    }
    for (int n = 0; n < NR; ++n)
        for (int v = 0; v < MV; ++v) acc[n][v].store(out + n * MP + LANES * v);
}

using WideTile = void (*)(const float*, const float*, int, float*);
constexpr int WIDE_GROUP = 48;   // weight rows per thread work item (a multiple of every NR below)
#if MICROVLLM_VEC == 256   // 16 registers: NR x MV + MV + 1 <= 16
constexpr int MAX_MV = 2;
constexpr WideTile WIDE_TILES[MAX_MV + 1][2] = {{nullptr, nullptr}, {wide_tile<1, 12>, wide_tile<1, 4>},
                                                {wide_tile<2, 6>, wide_tile<2, 4>}};
constexpr int WIDE_ROWS[MAX_MV + 1] = {0, 12, 6};
#else                      // 32 registers
constexpr int MAX_MV = 4;
constexpr WideTile WIDE_TILES[MAX_MV + 1][2] = {{nullptr, nullptr}, {wide_tile<1, 24>, wide_tile<1, 4>},
                                                {wide_tile<2, 12>, wide_tile<2, 4>}, {wide_tile<3, 8>, wide_tile<3, 4>},
                                                {wide_tile<4, 6>, wide_tile<4, 4>}};
constexpr int WIDE_ROWS[MAX_MV + 1] = {0, 24, 12, 8, 6};
#endif
constexpr int CHUNK = LANES * MAX_MV;   // rows of x per chunk
constexpr int WIDE_OUT = 24 * 16;       // floats of the largest tile's output, NR x LANES·MV

void linear_wide(int format, const float* x, const uint8_t* w, const float* scales, const float* bias,
                 float* y, int M, int N, int K) {
    const int64_t stride = row_bytes(format, K);
    const int chunks = (M + CHUNK - 1) / CHUNK;
    float* xT = thread_buffer<float>(0, int64_t(chunks) * K * CHUNK);   // chunk i at i·K·CHUNK
    for (int i = 0; i < chunks; ++i) {
        const int m0 = i * CHUNK, rows_x = M - m0 < CHUNK ? M - m0 : CHUNK, MP = LANES * ((rows_x + LANES - 1) / LANES);
        float* chunk = xT + int64_t(i) * K * CHUNK;
        for (int k = 0; k < K; ++k)
            for (int r = 0; r < MP; ++r) chunk[int64_t(k) * MP + r] = r < rows_x ? x[int64_t(m0 + r) * K + k] : 0.f;
    }
    const int groups = (N + WIDE_GROUP - 1) / WIDE_GROUP;
    #pragma omp parallel
    {
        float* scratch = thread_buffer<float>(1, int64_t(WIDE_GROUP) * K);
        alignas(64) float out[WIDE_OUT];
        #pragma omp for schedule(static)
        for (int g = 0; g < groups; ++g) {
            const int n0 = g * WIDE_GROUP, rows = N - n0 < WIDE_GROUP ? N - n0 : WIDE_GROUP;
            for (int j = 0; j < rows; ++j)
                dequantize_row(format, w + (n0 + j) * stride, scales ? scales[n0 + j] : 1.f,
                               scratch + int64_t(j) * K, K);
            for (int i = 0; i < chunks; ++i) {
                const int m0 = i * CHUNK, rows_x = M - m0 < CHUNK ? M - m0 : CHUNK;
                const int MV = (rows_x + LANES - 1) / LANES, MP = LANES * MV;
                int full_tiles = rows / WIDE_ROWS[MV];   // then tiles of 4: rows is a multiple of 4
                while ((rows - full_tiles * WIDE_ROWS[MV]) % 4) --full_tiles;
                for (int n = 0, t = 0; n < rows; ++t) {
                    const bool full = t < full_tiles;
                    const int nr = full ? WIDE_ROWS[MV] : 4;
                    WIDE_TILES[MV][full ? 0 : 1](xT + int64_t(i) * K * CHUNK, scratch + int64_t(n) * K, K, out);
                    for (int j = 0; j < nr; ++j)
                        for (int r = 0; r < rows_x; ++r)
                            y[int64_t(m0 + r) * N + n0 + n + j] = out[j * MP + r] + (bias ? bias[n0 + n + j] : 0.f);
                    n += nr;
                }
            }
        }
    }
}
#endif  // MICROVLLM_VEC

void linear(int format, const float* x, const uint8_t* w, const float* scales, const float* bias,
            float* y, int M, int N, int K) {
    const int64_t stride = row_bytes(format, K);
#ifdef MICROVLLM_AMX_QUANTIZED
    if (format != INT8 && M > SMALL_BATCH && N % amx_quantized::TILE == 0 && amx_quantized::ready()) {
        amx_quantized::linear(format == Q8_0, x, w, bias, y, M, N, K);   // (K % 32 == 0: whole blocks)
        return;
    }
#endif
#if MICROVLLM_VEC
    if (M <= SMALL_BATCH_PASSES * SMALL_BATCH && K % QK == 0) {
        // SMALL_BATCH rows of x per pass: past that the weights are read once per pass, which
        // still beats linear_wide's dequantization into the scratch up to SMALL_BATCH_PASSES.
        for (int m0 = 0; m0 < M; m0 += SMALL_BATCH) {
            const int rows = M - m0 < SMALL_BATCH ? M - m0 : SMALL_BATCH;
            const SmallTile tile = format == Q4_1 ? SMALL_TILES<Q4_1>[rows]
                                 : format == Q8_0 ? SMALL_TILES<Q8_0>[rows] : SMALL_TILES<INT8>[rows];
            const float* xm = x + int64_t(m0) * K;
            float* ym = y + int64_t(m0) * N;
            const int cols = tile_cols(rows);
            #pragma omp parallel for schedule(static)
            for (int n = 0; n < N; n += cols)
                tile(xm, w + n * stride, stride, scales ? scales + n : nullptr, bias ? bias + n : nullptr, ym + n, K, N);
        }
        return;
    }
    linear_wide(format, x, w, scales, bias, y, M, N, K);
#else
    constexpr int G = 16;   // output rows per thread work item
    using Tile = void (*)(const float*, const float*, const float*, float*, int, int);
    constexpr Tile TILES[5] = {nullptr, tile<1>, tile<2>, tile<3>, tile<4>};
    const int groups = (N + G - 1) / G;
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
#endif
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
