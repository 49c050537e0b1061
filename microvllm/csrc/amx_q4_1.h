// GGUF Q4_1 weights multiplied on Intel AMX tiles, with float32 activations, as stored:
//
//   y[M, N] = x[M, K] @ W[N, K]^T (+ bias[N])        x, y, bias float32; W: Q4_1 rows
//
// quantized_linear.cpp has the layout (a row = K/32 blocks of 20 bytes: d fp16 | m fp16 |
// 16 bytes of nibbles, byte j holding q[j] low and q[j+16] high; w = d*q + m). This file
// computes the same thing as its q4_1_linear, up to float rounding, with fewer
// instructions per weight: the 4-bit integers q go into AMX's bfloat16 multiplier whole.
//
// Per block b of 32 inputs, the block's d and m factor out of the sum:
//
//   y[m, n] = sum_b  d[n,b] * S[m,n,b]  +  m[n,b] * X[m,b]
//            S[m,n,b] = sum_{k in b} q[n,k] * x[m,k]        X[m,b] = sum_{k in b} x[m,k]
//
// S is what the tiles compute. q (0..15) is exact in bfloat16; a float32 x is not (24 bits
// of significand against 8), so x is split exactly into three bfloat16 parts,
// x = hi + mid + lo (each the rounded rest of the one before), and
//
//   S = q.hi + q.mid + q.lo          three tdpbf16ps into one float32 C tile
//
// (each product is exact; the tile sums in float32, as any GEMM does, in its own order).
//
// Two shapes of the work, by rows of x (M):
//
//   1-5 rows (decode, small batch)   the weights are the A tile, x's parts B's columns
//                                    (few_rows_item, below)
//   6 rows and more                  x is the A tile, the weights B (work_item):
//
// 6 rows and more. One work item: 16 output columns (an n tile) for up to 16 rows of x.
// Per block b:
//
//   B tile  [16 k-pairs][16 columns][2] bf16: q of the 16 rows' block b in AMX's pair
//           ("VNNI") order, built in registers: four dword gathers take bytes 4t..4t+3 of
//           each row's nibbles (that is already a transpose: lane n = row n), a byte
//           shuffle spreads each byte into a 16-bit lane, the nibbles are split (low:
//           k 0-15, high: k 16-31), and a 16-entry table gives each one's bf16 bits
//   A tiles x's hi / mid / lo parts of this block (rows x 32 bf16, split once per call)
//   C tile  S for this block; stored, then per row: acc += S * d + X * m  (AVX-512)
//
// Measured on the embedded model's shapes (30 layers' Q4_1 projections, weights streamed
// from memory, 2 threads of a Sapphire Rapids-class Xeon), against quantized_linear.cpp's
// AVX-512 paths: 1 row 6.0 vs 7.9 ms, 8 rows 10 vs 34 ms, 32 rows 24-27 vs 39-41 ms.
//
// Requires AMX (amx_tile, amx_bf16, AVX-512 BF16 and BW in a -march=native build), Linux's
// permission to use the tiles (ready()), N % 16 == 0 and K % 32 == 0. Included by
// quantized_linear.cpp, whose q4_1_linear calls linear() when all of that holds.
#pragma once

#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>
#include <vector>

namespace amx_q4_1 {

constexpr int QK = 32;            // weights per GGUF block = bf16 per A-tile row
constexpr int BLOCK_BYTES = 20;   // a Q4_1 block
constexpr int TILE = 16;          // rows of x and columns of y per work item

struct TileConfig {               // the 64-byte operand of ldtilecfg
    uint8_t palette_id = 1;
    uint8_t start_row = 0;
    uint8_t reserved[14] = {};
    uint16_t bytes_per_row[16] = {};
    uint8_t rows[16] = {};
};

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

// Per-thread buffers kept between calls (a decode step makes ~120 calls).
template <typename T>
inline T* thread_buffer(int which, int64_t count) {
    thread_local std::vector<T> buffers[5];
    std::vector<T>& buffer = buffers[which];
    if (int64_t(buffer.size()) < count) buffer.resize(count);
    return buffer.data();
}

inline __m512 bf16_bits_to_float(__m256i bits) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

// x [M, K] -> its three bf16 parts [M, K] each, and the block sums X [M, K/32].
inline void split_x(const float* x, uint16_t* hi, uint16_t* mid, uint16_t* lo, float* sums, int M, int K) {
    #pragma omp parallel for schedule(static)
    for (int m = 0; m < M; ++m)
        for (int b = 0; b < K / QK; ++b) {
            __m512 total = _mm512_setzero_ps();
            for (int half = 0; half < 2; ++half) {
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
            sums[int64_t(m) * (K / QK) + b] = _mm512_reduce_add_ps(total);
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

// Block b of 16 rows (`rows_at`: gather offsets of each row's block b) -> the B tile at `tile`
// (1 KiB: row r = k-pair r, 16 columns x 2 bf16) and the rows' d and m.
inline void build_b_tile(const uint8_t* block0, __m512i rows_at, uint16_t* tile, __m512& d, __m512& m) {
    const __m512i dm = _mm512_i32gather_epi32(rows_at, block0, 1);
    d = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(dm));
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
template <int ROWS>
void work_item(const uint16_t* hi, const uint16_t* mid, const uint16_t* lo, const float* sums,
               const uint8_t* w, __m512i rows_at, const float* bias, float* y, int N, int K) {
    const int blocks = K / QK;
    alignas(64) uint16_t b_tile[16 * 32];
    alignas(64) float c[TILE][TILE];
    __m512 acc[ROWS];
    for (int r = 0; r < ROWS; ++r) acc[r] = _mm512_setzero_ps();
    for (int b = 0; b < blocks; ++b) {
        __m512 d, m;
        build_b_tile(w + int64_t(b) * BLOCK_BYTES, rows_at, b_tile, d, m);
        _tile_loadd(1, b_tile, 64);
        _tile_loadd(2, hi + b * QK, K * 2);
        _tile_loadd(3, mid + b * QK, K * 2);
        _tile_loadd(4, lo + b * QK, K * 2);
        _tile_zero(0);
        _tile_dpbf16ps(0, 2, 1);
        _tile_dpbf16ps(0, 3, 1);
        _tile_dpbf16ps(0, 4, 1);
        _tile_stored(0, &c[0][0], 64);
        for (int r = 0; r < ROWS; ++r)
            acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(sums[r * blocks + b]), m,
                                     _mm512_fmadd_ps(_mm512_load_ps(c[r]), d, acc[r]));
    }
    const __m512 bias_v = bias ? _mm512_loadu_ps(bias) : _mm512_setzero_ps();
    for (int r = 0; r < ROWS; ++r) _mm512_storeu_ps(y + int64_t(r) * N, _mm512_add_ps(acc[r], bias_v));
}

using WorkItem = void (*)(const uint16_t*, const uint16_t*, const uint16_t*, const float*, const uint8_t*,
                          __m512i, const float*, float*, int, int);
constexpr WorkItem WORK_ITEMS[17] = {
    nullptr, work_item<1>, work_item<2>, work_item<3>, work_item<4>, work_item<5>, work_item<6>,
    work_item<7>, work_item<8>, work_item<9>, work_item<10>, work_item<11>, work_item<12>,
    work_item<13>, work_item<14>, work_item<15>, work_item<16>};

// ---- 1-5 rows of x (a decode step at small batch): the weights as the A tile ----
//
// With one row of x, a 16 x 16 C tile would have one useful row. So the roles swap: 16
// weight rows are A (each row's block is 32 consecutive k, its natural order, so no
// transpose is needed), and x is B, its three parts side by side as columns:
//
//   A  [16 weight rows][32 k] bf16          one block of 16 rows, unpacked per block
//   B  [16 k-pairs][3M columns][2] bf16     column 3r + p: part p of x row r (built per call)
//   C  [16 weight rows][3M] float32         S of each (row, x row, part), one tdpbf16ps
//
// and the accumulators hold C's layout (lane l of vector v: C's element 16v + l), each
// lane scaled by its weight row's d; the three parts are added at the end.

constexpr int FEW_ROWS = 5;   // 3 x 5 = 15 columns: the most a 16-column tile holds

// x's parts -> every block's B tile, one after another: [K/32][16][3M][2].
inline void x_as_b_tiles(const uint16_t* hi, const uint16_t* mid, const uint16_t* lo, uint16_t* bx, int M, int K) {
    const uint16_t* parts[3] = {hi, mid, lo};
    const int cols = 3 * M;
    for (int b = 0; b < K / QK; ++b)
        for (int pair = 0; pair < 16; ++pair)
            for (int r = 0; r < M; ++r)
                for (int p = 0; p < 3; ++p)
                    for (int e = 0; e < 2; ++e)
                        bx[((int64_t(b) * 16 + pair) * cols + 3 * r + p) * 2 + e] =
                            parts[p][int64_t(r) * K + b * QK + 2 * pair + e];
}

// Block b of 16 weight rows -> the A tile: row n = q[n, 0..31] as bf16 (the low nibbles are
// k 0-15, the high ones k 16-31, so a row's 16 bytes widen to 16-bit lanes, split, and
// look up their bf16 bits).
inline void weights_as_a_tile(const uint8_t* block0, int64_t stride, uint16_t* tile) {
    const __m256i nibble = _mm256_set1_epi16(0x0f);
    for (int n = 0; n < TILE; ++n) {
        // The same block two tiles on (its 16 rows are the next work item but one): the
        // hardware prefetcher does not follow 16 interleaved rows this far ahead, and
        // without it the weights arrived ~1.3x slower (a prefetch past the end is harmless).
        _mm_prefetch(reinterpret_cast<const char*>(block0 + (n + 2 * TILE) * stride), _MM_HINT_T0);
        const __m256i bytes = _mm256_cvtepu8_epi16(
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(block0 + n * stride + 4)));
        const __m512i q = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_and_si256(bytes, nibble)),
                                             _mm256_srli_epi16(bytes, 4), 1);
        _mm512_store_si512(reinterpret_cast<__m512i*>(tile + 32 * n), _mm512_permutexvar_epi16(q, BF16_OF_NIBBLE));
    }
}

inline void configure_few_rows_tiles(int M) {
    TileConfig config;
    auto shape = [&](int tile, int r, int bytes) { config.rows[tile] = r; config.bytes_per_row[tile] = bytes; };
    shape(0, 16, 12 * M);   // C: 16 weight rows x 3M float32
    shape(1, 16, 64);       // A: 16 weight rows x 32 bf16
    shape(2, 16, 12 * M);   // B: 16 k-pairs x 3M columns x 2 bf16
    shape(3, 16, 12 * M); shape(4, 16, 64); shape(5, 16, 12 * M);   // the same, for a second block
    _tile_loadconfig(&config);
}

// One work item: 16 outputs of each of the M rows of x.
template <int M>
void few_rows_item(const uint16_t* bx, const float* sums, const uint8_t* w, int64_t stride, __m512i rows_at,
                   const float* bias, float* y, int N, int K) {
    constexpr int COLS = 3 * M;   // also the C tile's size in 16-float vectors
    const int blocks = K / QK;
    alignas(64) uint16_t a_tile[16 * 32], a_tile1[16 * 32];
    alignas(64) float c[TILE * COLS];
    __m512 acc[COLS], acc_m[M];
    __m512i row_of[COLS];         // lane l of C vector v belongs to weight row (16v + l) / COLS
    for (int v = 0; v < COLS; ++v) {
        acc[v] = _mm512_setzero_ps();
        alignas(64) int32_t rows[16];
        for (int l = 0; l < 16; ++l) rows[l] = (16 * v + l) / COLS;
        row_of[v] = _mm512_load_si512(rows);
    }
    for (int r = 0; r < M; ++r) acc_m[r] = _mm512_setzero_ps();
    // Two blocks per iteration on two sets of tiles (A, B, C: tmm1-2-0 and tmm4-5-3): a
    // block's C must be stored and read back before it is scaled, and with one set each
    // block waited for the previous one's multiply to come back (~2x slower).
    alignas(64) float c1[TILE * COLS];
    auto scale = [&](const float* cb, int b, __m512 d, __m512 m) {
        for (int v = 0; v < COLS; ++v)
            acc[v] = _mm512_fmadd_ps(_mm512_load_ps(cb + 16 * v), _mm512_permutexvar_ps(row_of[v], d), acc[v]);
        for (int r = 0; r < M; ++r) acc_m[r] = _mm512_fmadd_ps(_mm512_set1_ps(sums[r * blocks + b]), m, acc_m[r]);
    };
    auto scales = [&](int b, __m512& d, __m512& m) {
        const __m512i dm = _mm512_i32gather_epi32(rows_at, w + int64_t(b) * BLOCK_BYTES, 1);
        d = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(dm));
        m = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(dm, 16)));
    };
    int b = 0;
    for (; b + 2 <= blocks; b += 2) {
        __m512 d0, m0, d1, m1;
        scales(b, d0, m0);
        scales(b + 1, d1, m1);
        weights_as_a_tile(w + int64_t(b) * BLOCK_BYTES, stride, a_tile);
        weights_as_a_tile(w + int64_t(b + 1) * BLOCK_BYTES, stride, a_tile1);
        _tile_loadd(1, a_tile, 64);
        _tile_loadd(2, bx + int64_t(b) * 16 * COLS * 2, COLS * 4);
        _tile_zero(0);
        _tile_dpbf16ps(0, 1, 2);
        _tile_loadd(4, a_tile1, 64);
        _tile_loadd(5, bx + int64_t(b + 1) * 16 * COLS * 2, COLS * 4);
        _tile_zero(3);
        _tile_dpbf16ps(3, 4, 5);
        _tile_stored(0, c, COLS * 4);
        _tile_stored(3, c1, COLS * 4);
        scale(c, b, d0, m0);
        scale(c1, b + 1, d1, m1);
    }
    if (b < blocks) {   // an odd number of blocks: the last one alone
        __m512 d0, m0;
        scales(b, d0, m0);
        weights_as_a_tile(w + int64_t(b) * BLOCK_BYTES, stride, a_tile);
        _tile_loadd(1, a_tile, 64);
        _tile_loadd(2, bx + int64_t(b) * 16 * COLS * 2, COLS * 4);
        _tile_zero(0);
        _tile_dpbf16ps(0, 1, 2);
        _tile_stored(0, c, COLS * 4);
        scale(c, b, d0, m0);
    }
    for (int v = 0; v < COLS; ++v) _mm512_store_ps(c + 16 * v, acc[v]);
    for (int r = 0; r < M; ++r) {
        alignas(64) float mterm[TILE];
        _mm512_store_ps(mterm, acc_m[r]);
        for (int n = 0; n < TILE; ++n) {
            const float* parts = c + n * COLS + 3 * r;
            y[int64_t(r) * N + n] = parts[0] + parts[1] + parts[2] + mterm[n] + (bias ? bias[n] : 0.f);
        }
    }
}

using FewRowsItem = void (*)(const uint16_t*, const float*, const uint8_t*, int64_t, __m512i, const float*,
                             float*, int, int);
constexpr FewRowsItem FEW_ROWS_ITEMS[FEW_ROWS + 1] = {nullptr, few_rows_item<1>, few_rows_item<2>,
                                                      few_rows_item<3>, few_rows_item<4>, few_rows_item<5>};

// Linux's permission for this process to use the tile registers (off by default: saving
// them costs 8 KiB per thread switch), asked once; false if refused (before Linux 5.16).
inline bool ready() {
    static const bool granted = [] {
        constexpr long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
        return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
    }();
    return granted;
}

inline void linear(const float* x, const uint8_t* w, const float* bias, float* y, int M, int N, int K) {
    const int blocks = K / QK;
    const int64_t stride = int64_t(blocks) * BLOCK_BYTES;
    uint16_t* hi = thread_buffer<uint16_t>(0, int64_t(M) * K);
    uint16_t* mid = thread_buffer<uint16_t>(1, int64_t(M) * K);
    uint16_t* lo = thread_buffer<uint16_t>(2, int64_t(M) * K);
    float* sums = thread_buffer<float>(3, int64_t(M) * blocks);
    split_x(x, hi, mid, lo, sums, M, K);
    const __m512i rows_at = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                               _mm512_set1_epi32(int(stride)));
    const int n_tiles = N / TILE;
    if (M <= FEW_ROWS) {
        uint16_t* bx = thread_buffer<uint16_t>(4, int64_t(K) * 3 * M);
        x_as_b_tiles(hi, mid, lo, bx, M, K);
        #pragma omp parallel
        {
            configure_few_rows_tiles(M);
            #pragma omp for schedule(static)
            for (int t = 0; t < n_tiles; ++t)
                FEW_ROWS_ITEMS[M](bx, sums, w + int64_t(t) * TILE * stride, stride, rows_at,
                                  bias ? bias + t * TILE : nullptr, y + t * TILE, N, K);
            _tile_release();
        }
        return;
    }
    for (int m0 = 0; m0 < M; m0 += TILE) {
        const int rows = M - m0 < TILE ? M - m0 : TILE;
        const int64_t at = int64_t(m0) * K;
        #pragma omp parallel
        {
            configure_tiles(rows);
            #pragma omp for schedule(static)
            for (int t = 0; t < n_tiles; ++t)
                WORK_ITEMS[rows](hi + at, mid + at, lo + at, sums + int64_t(m0) * blocks,
                                 w + int64_t(t) * TILE * stride, rows_at, bias ? bias + t * TILE : nullptr,
                                 y + int64_t(m0) * N + t * TILE, N, K);
            _tile_release();
        }
    }
}

}  // namespace amx_q4_1
