// GGUF Q4_1 and Q8_0 weights multiplied on Intel AMX tiles, with float32 activations, as stored:
//
//   y[M, N] = x[M, K] @ W[N, K]^T (+ bias[N])        x, y, bias float32; W: GGUF rows
//
// quantized_linear.cpp has the layouts (a row = K/32 blocks; Q4_1: 20 bytes, d fp16 | m fp16 |
// 16 bytes of nibbles, byte j holding q[j] low and q[j+16] high, w = d*q + m; Q8_0: 34 bytes,
// d fp16 | 32 int8, w = d*q). This file computes the same thing as its q4_1_linear and
// q8_0_linear, up to float rounding, with fewer instructions per weight: the integers q
// (0..15, or -128..127) go into AMX's bfloat16 multiplier whole.
//
// Per block b of 32 inputs, the block's d and m factor out of the sum:
//
//   y[m, n] = sum_b  d[n,b] * S[m,n,b]  +  m[n,b] * X[m,b]       (Q8_0: m = 0)
//            S[m,n,b] = sum_{k in b} q[n,k] * x[m,k]        X[m,b] = sum_{k in b} x[m,k]
//
// S is what the tiles compute. q is exact in bfloat16 (8 bits of significand); a float32 x
// is not (24 bits), so x is split exactly into three bfloat16 parts,
// x = hi + mid + lo (each the rounded rest of the one before), and
//
//   S = q.hi + q.mid + q.lo          three tdpbf16ps into one float32 C tile
//
// (each product is exact; the tile sums in float32, as any GEMM does, in its own order).
//
// One work item: 16 output columns (an n tile) for up to 16 rows of x. Per block b:
//
//   B tile  [16 k-pairs][16 columns][2] bf16: q of the 16 rows' block b in AMX's pair
//           ("VNNI") order, built in registers: dword gathers take bytes 4t..4t+3 of each
//           row's quants (that is already a transpose: lane n = row n) and a byte shuffle
//           spreads each byte into a 16-bit lane. Q4_1: the nibbles are split (low: k 0-15,
//           high: k 16-31) and a 16-entry table gives each one's bf16 bits. Q8_0: each
//           int8 is sign-extended and converted through float32
//   A tiles x's hi / mid / lo parts of this block (rows x 32 bf16, split once per call)
//   C tile  S for this block; stored, then per row: acc += S * d + X * m  (AVX-512)
//
// Measured on the embedded model's shapes (30 layers' Q4_1 projections, weights streamed
// from memory, 2 threads of a Sapphire Rapids-class Xeon) against quantized_linear.cpp's
// AVX-512 wide tiles: 5 rows 9.1 vs 32.5 ms, 32 rows 24-30 vs 39-41 ms; its Q8_0 lm_head
// (49152 x 576) at 32 rows 9.3 vs 12.2 ms. At 1-4 rows its register tiles stay faster (4.7-5.6 against 5.8-6.3 ms at 1 row, for a version of this
// file with the weights as the A tile): with so few rows of x, unpacking a block into a tile
// costs more than the tile multiply saves.
//
// Requires AMX (amx_tile, amx_bf16, AVX-512 BF16 and BW in a -march=native build), Linux's
// permission to use the tiles (ready()), N % 16 == 0 and K % 32 == 0. Included by
// quantized_linear.cpp, whose q4_1_linear and q8_0_linear call linear() from 5 rows of x on
// when all of that holds.
#pragma once

// AMX builds only (quantized_linear.cpp includes this only then); empty elsewhere.
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__AVX512BW__)
#include <immintrin.h>

#include <cstdint>

#include "amx_tiles.h"
#include "thread_buffer.h"

namespace amx_quantized {

constexpr int QK = 32;            // weights per GGUF block = bf16 per A-tile row
constexpr int block_bytes(bool q8) { return q8 ? 34 : 20; }   // a Q8_0 or Q4_1 block
constexpr int TILE = 16;          // rows of x and columns of y per work item

// tmm0: C (rows x 16 float32)   tmm1: B (16 k-pairs x 16 columns x 2 bf16)
// tmm2, tmm3, tmm4: A = x's hi, mid, lo parts (rows x 32 bf16)
inline void configure_tiles(int rows) {
    TileConfig config;
    auto shape = [&](int tile, int r) { config.rows[tile] = r; config.bytes_per_row[tile] = 64; };
    shape(0, rows);
    shape(1, 16);
    shape(2, rows); shape(3, rows); shape(4, rows);
    _tile_loadconfig(&config);
}

inline __m512 bf16_bits_to_float(__m256i bits) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

// x [M, K] -> its three bf16 parts [M, K] each, and the block sums X [M, K/32] (unless
// `sums` is null: Q8_0 has no m to multiply them by).
inline void split_x(const float* x, uint16_t* hi, uint16_t* mid, uint16_t* lo, float* sums, int M, int K) {
    #pragma omp parallel for schedule(static)
    for (int m = 0; m < M; ++m)
        for (int b = 0; b < K / QK; ++b) {
            __m512 total = _mm512_setzero_ps();
            for (int half = 0; half < 2; ++half) {   // (the compiler drops `total` when unused)
                const int64_t at = int64_t(m) * K + b * QK + 16 * half;
                const __m512 v = _mm512_loadu_ps(x + at);
                const __m256i h = reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v));
                const __m512 rest = _mm512_sub_ps(v, bf16_bits_to_float(h));       // exact
                const __m256i md = reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(rest));
                const __m512 rest2 = _mm512_sub_ps(rest, bf16_bits_to_float(md));  // exact, 8 bits left
                const __m256i l = reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(rest2));
                _mm256_storeu_si256(reinterpret_cast<__m256i*>(hi + at), h);
                _mm256_storeu_si256(reinterpret_cast<__m256i*>(mid + at), md);
                _mm256_storeu_si256(reinterpret_cast<__m256i*>(lo + at), l);
                total = _mm512_add_ps(total, v);
            }
            if (sums) sums[int64_t(m) * (K / QK) + b] = _mm512_reduce_add_ps(total);
        }
}

// The bf16 bits of 0.0, 1.0, ..., 15.0, indexed by a 16-bit lane's value (vpermw uses its
// low 5 bits; entries 16-31 are never looked up).
const __m512i BF16_OF_NIBBLE = _mm512_set_epi16(
    0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
    0x4170, 0x4160, 0x4150, 0x4140, 0x4130, 0x4120, 0x4110, 0x4100,
    0x40E0, 0x40C0, 0x40A0, 0x4080, 0x4040, 0x4000, 0x3F80, 0x0000);

// Byte shuffles spreading a dword lane's bytes 0,1 (word c = 2t) or 2,3 (c = 2t + 1) into
// two 16-bit lanes (0x80: a zero byte). vpshufb works within 128-bit lanes, which is all
// this needs: each row's dword stays in its own place.
const __m512i SPREAD_LOW_WORD = _mm512_set4_epi32(0x800d800c, 0x80098008, 0x80058004, 0x80018000);
const __m512i SPREAD_HIGH_WORD = _mm512_set4_epi32(0x800f800e, 0x800b800a, 0x80078006, 0x80038002);

// Q8_0's shuffles: a dword lane's bytes 0,1 (or 2,3) into the high byte of two 16-bit lanes,
// so that an arithmetic shift right by 8 sign-extends them.
const __m512i SPREAD_LOW_WORD_HIGH = _mm512_set4_epi32(0x0d800c80, 0x09800880, 0x05800480, 0x01800080);
const __m512i SPREAD_HIGH_WORD_HIGH = _mm512_set4_epi32(0x0f800e80, 0x0b800a80, 0x07800680, 0x03800280);

// 32 int16 lanes -> their bf16 bits (exact: |q| <= 128 needs 8 bits).
inline __m512i int16_to_bf16(__m512i v) {
    const __m512 lower = _mm512_cvtepi32_ps(_mm512_cvtepi16_epi32(_mm512_castsi512_si256(v)));
    const __m512 upper = _mm512_cvtepi32_ps(_mm512_cvtepi16_epi32(_mm512_extracti64x4_epi64(v, 1)));
    return reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(upper, lower));
}

// Block b of 16 rows (`rows_at`: gather offsets of each row's block b) -> the B tile at `tile`
// (1 KiB: row r = k-pair r, 16 columns x 2 bf16) and the rows' d and m (Q8_0: m = 0).
template <bool Q8>
inline void build_b_tile(const uint8_t* block0, __m512i rows_at, uint16_t* tile, __m512& d, __m512& m) {
    const __m512i dm = _mm512_i32gather_epi32(rows_at, block0, 1);
    d = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(dm));
    if (Q8) {
        m = _mm512_setzero_ps();
        for (int t = 0; t < 8; ++t) {   // quant bytes 4t..4t+3: the k-pairs c = 2t, 2t+1 of each row
            const __m512i bytes = _mm512_i32gather_epi32(rows_at, block0 + 2 + 4 * t, 1);
            for (int half = 0; half < 2; ++half) {
                const __m512i spread = _mm512_shuffle_epi8(bytes, half ? SPREAD_HIGH_WORD_HIGH : SPREAD_LOW_WORD_HIGH);
                _mm512_store_si512(reinterpret_cast<__m512i*>(tile + 32 * (2 * t + half)),
                                   int16_to_bf16(_mm512_srai_epi16(spread, 8)));
            }
        }
        return;
    }
    m = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(dm, 16)));
    const __m512i nibble = _mm512_set1_epi16(0x0f);
    for (int t = 0; t < 4; ++t) {   // nibble bytes 4t..4t+3: the words c = 2t, 2t+1 of each row
        const __m512i bytes = _mm512_i32gather_epi32(rows_at, block0 + 4 + 4 * t, 1);
        for (int half = 0; half < 2; ++half) {
            const int c = 2 * t + half;   // k-pair c (low nibbles: k = 2c, 2c+1) and c + 8 (high)
            const __m512i spread = _mm512_shuffle_epi8(bytes, half ? SPREAD_HIGH_WORD : SPREAD_LOW_WORD);
            const __m512i low = _mm512_permutexvar_epi16(_mm512_and_si512(spread, nibble), BF16_OF_NIBBLE);
            const __m512i high = _mm512_permutexvar_epi16(_mm512_srli_epi16(spread, 4), BF16_OF_NIBBLE);
            _mm512_store_si512(reinterpret_cast<__m512i*>(tile + 32 * c), low);
            _mm512_store_si512(reinterpret_cast<__m512i*>(tile + 32 * (c + 8)), high);
        }
    }
}

// One work item: rows x 16 outputs (ROWS: rows of x, 1..16, so that acc stays in registers).
template <bool Q8, int ROWS>
void work_item(const uint16_t* hi, const uint16_t* mid, const uint16_t* lo, const float* sums,
               const uint8_t* w, __m512i rows_at, const float* bias, float* y, int N, int K) {
    const int blocks = K / QK;
    alignas(64) uint16_t b_tile[16 * 32];
    alignas(64) float c[TILE][TILE];
    __m512 acc[ROWS];
    for (int r = 0; r < ROWS; ++r) acc[r] = _mm512_setzero_ps();
    for (int b = 0; b < blocks; ++b) {
        __m512 d, m;
        build_b_tile<Q8>(w + int64_t(b) * block_bytes(Q8), rows_at, b_tile, d, m);
        _tile_loadd(1, b_tile, 64);
        _tile_loadd(2, hi + b * QK, K * 2);
        _tile_loadd(3, mid + b * QK, K * 2);
        _tile_loadd(4, lo + b * QK, K * 2);
        _tile_zero(0);
        _tile_dpbf16ps(0, 2, 1);
        _tile_dpbf16ps(0, 3, 1);
        _tile_dpbf16ps(0, 4, 1);
        _tile_stored(0, &c[0][0], 64);
        for (int r = 0; r < ROWS; ++r) {
            acc[r] = _mm512_fmadd_ps(_mm512_load_ps(c[r]), d, acc[r]);
            if (!Q8) acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(sums[r * blocks + b]), m, acc[r]);
        }
    }
    const __m512 bias_v = bias ? _mm512_loadu_ps(bias) : _mm512_setzero_ps();
    for (int r = 0; r < ROWS; ++r) _mm512_storeu_ps(y + int64_t(r) * N, _mm512_add_ps(acc[r], bias_v));
}

using WorkItem = void (*)(const uint16_t*, const uint16_t*, const uint16_t*, const float*, const uint8_t*,
                          __m512i, const float*, float*, int, int);
template <bool Q8>
constexpr WorkItem WORK_ITEMS[17] = {
    nullptr, work_item<Q8, 1>, work_item<Q8, 2>, work_item<Q8, 3>, work_item<Q8, 4>, work_item<Q8, 5>,
    work_item<Q8, 6>, work_item<Q8, 7>, work_item<Q8, 8>, work_item<Q8, 9>, work_item<Q8, 10>,
    work_item<Q8, 11>, work_item<Q8, 12>, work_item<Q8, 13>, work_item<Q8, 14>, work_item<Q8, 15>,
    work_item<Q8, 16>};

// Linux's permission for the tile registers (amx_tiles.h), asked once.
inline bool ready() {
    static const bool granted = request_amx_tiles() == 0;
    return granted;
}

// q8: the weights are Q8_0 (else Q4_1).
inline void linear(bool q8, const float* x, const uint8_t* w, const float* bias, float* y, int M, int N, int K) {
    const int blocks = K / QK;
    const int64_t stride = int64_t(blocks) * block_bytes(q8);
    const WorkItem* items = q8 ? WORK_ITEMS<true> : WORK_ITEMS<false>;
    uint16_t* hi = thread_buffer<uint16_t>(0, int64_t(M) * K);
    uint16_t* mid = thread_buffer<uint16_t>(1, int64_t(M) * K);
    uint16_t* lo = thread_buffer<uint16_t>(2, int64_t(M) * K);
    float* sums = q8 ? nullptr : thread_buffer<float>(2, int64_t(M) * blocks);   // (float 0, 1: quantized_linear.cpp's)
    split_x(x, hi, mid, lo, sums, M, K);
    const __m512i rows_at = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                               _mm512_set1_epi32(int(stride)));
    const int n_tiles = N / TILE;
    for (int m0 = 0; m0 < M; m0 += TILE) {
        const int rows = M - m0 < TILE ? M - m0 : TILE;
        const int64_t at = int64_t(m0) * K;
        #pragma omp parallel
        {
            configure_tiles(rows);
            #pragma omp for schedule(static)
            for (int t = 0; t < n_tiles; ++t)
                items[rows](hi + at, mid + at, lo + at, sums + int64_t(m0) * blocks,
                                 w + int64_t(t) * TILE * stride, rows_at, bias ? bias + t * TILE : nullptr,
                                 y + int64_t(m0) * N + t * TILE, N, K);
            _tile_release();
        }
    }
}

}  // namespace amx_quantized

#endif  // AMX build
