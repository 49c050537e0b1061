// A bfloat16 linear layer on Intel AMX (Advanced Matrix Extensions) tiles.
//
//   y[M, N] = x[M, K] @ W[N, K]^T (+ bias[N])        x, W, bias, y: bfloat16
//
// In a decode step M is the number of running requests (1-64), so the weights are
// the traffic: every step reads all of them once. oneDNN, which torch uses, streams
// them well below the machine's read bandwidth at such M; this kernel streams them
// near it, with each weight byte read once per call, and prefetches the weight tiles
// a few k blocks ahead (notebook 11 has the recorded figures).
//
// AMX has eight tile registers tmm0-7 of up to 16 rows x 64 bytes, and one instruction
// that matters here, tdpbf16ps C, A, B:
//
//   C[16 x 16 float32] += A[16 x 32 bf16] . B[32 x 16 bf16]     (8,192 multiply-adds)
//
// B must be in "VNNI" order: row r holds the pairs (k = 2r, 2r+1) of all 16 columns.
// The Python side packs W once, at load time, into one 1 KiB tile per (n block, k block):
//
//   packed[N/16][K/32][16 k-pairs][16 columns][2]      (amx_pack_weight in platforms/cpu/gemm_kernels.py)
//
// so a tile is 1,024 contiguous bytes and one n block's tiles follow each other.
//
// Work: a task is two n blocks (32 output columns) and tasks are split across threads,
// so each thread streams its own slice of W. Within a task, x is taken 32 rows at a
// time (two A tiles); the 2 x 2 C tiles accumulate over all of K, then are stored,
// the bias added and each float rounded to bfloat16 (to nearest even, like torch):
//
//   tmm0 C[rows 0-15,  cols 0-15]   tmm1 C[rows 0-15,  cols 16-31]   tmm4 A rows 0-15
//   tmm2 C[rows 16-31, cols 0-15]   tmm3 C[rows 16-31, cols 16-31]   tmm5 A rows 16-31
//   tmm6 B[cols 0-15]               tmm7 B[cols 16-31]
//
// Each W tile is reused for every 32 rows of x while it is still in cache, so a large M (a
// prefill) costs no extra memory traffic for W. Accumulation is float32 with the
// products summed in k order, which gave results bit-identical to torch's own
// bfloat16 matmul (tests/platforms/test_amx_linear.py checks).
//
// Requires: an AMX CPU (amx_tile, amx_bf16, avx512_bf16), N % 16 == 0, K % 32 == 0, and
// Linux's permission for this process to use the tile registers (amx_init). Called by
// platforms/cpu/gemm_kernels.py. Built for any other target, the file defines the same
// entry points with empty bodies (amx_init returns 1), which are never called: kernels.py
// checks the CPU's flags before it loads this library.

#include "ops.h"   // this file's C entry points, declared once
#include "amx_tiles.h"   // MICROVLLM_AMX: this build targets AMX

#include <cstdint>

#ifdef MICROVLLM_AMX
#include <immintrin.h>

namespace {

constexpr int TILE_M = 16;   // rows of an A or C tile
constexpr int TILE_N = 16;   // float32 columns of a C tile
constexpr int TILE_K = 32;   // bf16 elements in a row of an A tile (64 bytes)
constexpr int TILE_BYTES = 1024;
constexpr int PREFETCH_AHEAD = 4;   // k blocks; 2-8 measured alike

// An inline function, not a lambda: GCC dropped __builtin_prefetch inside a [&] lambda.
inline void prefetch_line(const char* p) { __builtin_prefetch(p, 0, 3); }

// Shape the tiles for a chunk of `rows` rows of x (1..32): rows 0-15 go to tmm0/1/4,
// the rest to tmm2/3/5. Unused tiles get no rows.
void configure_tiles(int rows) {
    TileConfig config;
    const int top = rows < TILE_M ? rows : TILE_M, bottom = rows - top;
    auto shape = [&](int tile, int r) { config.rows[tile] = r; config.bytes_per_row[tile] = r ? 64 : 0; };
    shape(0, top); shape(1, top); shape(4, top);
    shape(2, bottom); shape(3, bottom); shape(5, bottom);
    shape(6, 16); shape(7, 16);   // B tiles: 16 k-pairs x 16 columns x 2
    _tile_loadconfig(&config);
}

inline __m512 bf16_to_float(const uint16_t* p) {   // 16 values
    __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

// One task on one chunk of x: `rows` rows (two A tiles if more than 16) times
// `n_blocks` (1 or 2) n blocks starting at n_block. Tile numbers are immediates in
// the AMX instructions, hence the template parameters instead of loops.
template <bool TWO_M, bool TWO_N>
void tile_task(const uint16_t* x, const uint16_t* w, const uint16_t* bias, uint16_t* y,
               int rows, int N, int K, int n_block) {
    const int k_blocks = K / TILE_K;
    const int x_stride = K * 2;   // bytes between rows of x
    const uint16_t* w0 = w + int64_t(n_block) * k_blocks * (TILE_BYTES / 2);
    const uint16_t* w1 = w0 + int64_t(k_blocks) * (TILE_BYTES / 2);
    _tile_zero(0);
    if (TWO_N) _tile_zero(1);
    if (TWO_M) _tile_zero(2);
    if (TWO_M && TWO_N) _tile_zero(3);
    for (int kb = 0; kb < k_blocks; ++kb) {
        // Ask for the B tiles PREFETCH_AHEAD k blocks ahead now (past this task's last
        // block that is the next task's first: packed tiles are contiguous), so that
        // reading W overlaps the tile multiplies instead of stalling each tile load.
        const char* ahead0 = reinterpret_cast<const char*>(w0 + (kb + PREFETCH_AHEAD) * (TILE_BYTES / 2));
        const char* ahead1 = reinterpret_cast<const char*>(w1 + (kb + PREFETCH_AHEAD) * (TILE_BYTES / 2));
        for (int line = 0; line < TILE_BYTES; line += 64) {
            prefetch_line(ahead0 + line);
            if (TWO_N) prefetch_line(ahead1 + line);
        }
        _tile_loadd(4, x + kb * TILE_K, x_stride);
        if (TWO_M) _tile_loadd(5, x + TILE_M * K + kb * TILE_K, x_stride);
        _tile_loadd(6, w0 + kb * (TILE_BYTES / 2), 64);
        if (TWO_N) _tile_loadd(7, w1 + kb * (TILE_BYTES / 2), 64);
        _tile_dpbf16ps(0, 4, 6);
        if (TWO_N) _tile_dpbf16ps(1, 4, 7);
        if (TWO_M) _tile_dpbf16ps(2, 5, 6);
        if (TWO_M && TWO_N) _tile_dpbf16ps(3, 5, 7);
    }
    alignas(64) float c[2 * TILE_M][2 * TILE_N];   // the C tiles, side by side
    const int c_stride = sizeof(c[0]);
    _tile_stored(0, &c[0][0], c_stride);
    if (TWO_N) _tile_stored(1, &c[0][TILE_N], c_stride);
    if (TWO_M) _tile_stored(2, &c[TILE_M][0], c_stride);
    if (TWO_M && TWO_N) _tile_stored(3, &c[TILE_M][TILE_N], c_stride);

    const int n0 = n_block * TILE_N;
    const __m512 bias0 = bias ? bf16_to_float(bias + n0) : _mm512_setzero_ps();
    const __m512 bias1 = bias && TWO_N ? bf16_to_float(bias + n0 + TILE_N) : _mm512_setzero_ps();
    for (int m = 0; m < rows; ++m) {
        uint16_t* out = y + int64_t(m) * N + n0;
        // vcvtneps2bf16 rounds to nearest even, as torch does.
        __m256bh lo = _mm512_cvtneps_pbh(_mm512_add_ps(_mm512_load_ps(&c[m][0]), bias0));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), reinterpret_cast<__m256i>(lo));
        if (TWO_N) {
            __m256bh hi = _mm512_cvtneps_pbh(_mm512_add_ps(_mm512_load_ps(&c[m][TILE_N]), bias1));
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + TILE_N), reinterpret_cast<__m256i>(hi));
        }
    }
}

}  // namespace

extern "C" {

// Linux's permission for the tiles (amx_tiles.h). Returns 0 on success.
int amx_init() { return request_amx_tiles(); }

// x [M, K], packed_w as above, bias [N] or null, y [M, N]; all bf16 as uint16.
void amx_linear(const void* x_, const void* packed_w, const void* bias_, void* y_,
                int M, int N, int K) {
    const auto* x = static_cast<const uint16_t*>(x_);
    const auto* w = static_cast<const uint16_t*>(packed_w);
    const auto* bias = static_cast<const uint16_t*>(bias_);
    auto* y = static_cast<uint16_t*>(y_);
    const int n_blocks = N / TILE_N;
    const int tasks = (n_blocks + 1) / 2;
    #pragma omp parallel
    {
        int configured_rows = 0;   // tile shapes are per thread: set them when they change
        #pragma omp for schedule(static)
        for (int task = 0; task < tasks; ++task) {
            const int n_block = 2 * task;
            const bool two_n = n_block + 1 < n_blocks;
            for (int m0 = 0; m0 < M; m0 += 2 * TILE_M) {
                const int rows = M - m0 < 2 * TILE_M ? M - m0 : 2 * TILE_M;
                if (rows != configured_rows) {
                    configure_tiles(rows);
                    configured_rows = rows;
                }
                const uint16_t* xm = x + int64_t(m0) * K;
                uint16_t* ym = y + int64_t(m0) * N;
                if (rows > TILE_M)
                    two_n ? tile_task<true, true>(xm, w, bias, ym, rows, N, K, n_block)
                          : tile_task<true, false>(xm, w, bias, ym, rows, N, K, n_block);
                else
                    two_n ? tile_task<false, true>(xm, w, bias, ym, rows, N, K, n_block)
                          : tile_task<false, false>(xm, w, bias, ym, rows, N, K, n_block);
            }
        }
        if (configured_rows) _tile_release();
    }
}

}  // extern "C"

#else  // not an AMX build: the entry points, so that the library loads, and nothing else

extern "C" {
int amx_init() { return 1; }
void amx_linear(const void*, const void*, const void*, void*, int, int, int) {}
}  // extern "C"

#endif  // MICROVLLM_AMX
