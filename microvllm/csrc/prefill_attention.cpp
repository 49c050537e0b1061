// Paged prefill attention for CPUs: every prefill chunk of a step (query_len > 1)
// attends over its request's context, read in place from the paged KV cache, in
// FlashAttention's way: key tiles stream past a tile of queries and a running softmax
// keeps the output exact without ever holding a [query, key] matrix.
//
//   query        [num_tokens, num_heads, head_dim]   rows query_stride elements apart
//   kv_cache     [2, num_blocks, block_size, num_kv_heads, head_dim]
//   query_start  [num_reqs + 1] int32   request r's queries are rows query_start[r] ..
//   seq_lens     [num_reqs]     int32   its context length, this chunk included; query
//                                       i of a chunk of q sits at position seq_len - q + i
//   block_table  [num_reqs, max_blocks_per_req] int32
//   out          [num_tokens, num_heads, head_dim]   contiguous
//
// A task is one request, one KV head and a tile of QT = 16 consecutive queries, which
// it holds transposed (qt[d][query], scaled), one copy per query head of the group.
// For each tile of KT = 16 visible keys (causal: up to the tile's last query; a
// sliding window also cuts the front) it converts the keys and values to float32
// scratch once, then for each of the `group` query heads sharing that KV head:
//
//   S^T[16 k][16 q] = K . Q^T (scaled)   one zmm per key, its 16 lanes the 16 queries;
//                                        8 keys at a time: 8 FMA chains
//   visible[k]      lanes (queries) that may see key k: causal, window, real rows
//   m' = max(m, max_k S^T[k]);  P^T[k] = exp(S^T[k] - m');  l = l·exp(m - m') + sum_k P^T[k]
//   O[16 q][d]      = O·exp(m - m') + P . V     four queries at a time, O in registers
//
// and at the end out = O / l. Because the queries are the lanes, the running max and
// sum of all 16 queries are single vectors: the softmax needs no horizontal reduction
// (a first version with queries as rows spent more time transposing keys and reducing
// lanes than multiplying). Arithmetic is float32 whatever T is; the result equals
// SDPA's up to float rounding.
//
// In float32 it beats SDPA's CPU kernel at every prompt length; in bfloat16 only up to
// a few hundred tokens (SDPA then multiplies in bfloat16 on the matrix units), so the
// backend keeps long low-precision chunks on SDPA (notebook 11 has the figures).
//
// Needs AVX-512 and head_dim 64 or 128 (prefill_supported() says); the caller falls back
// to SDPA otherwise. Called by platforms/cpu/attention.py; compared with the
// torch reference in tests/platforms/test_cpu_attention_kernels.py.

#include "ops.h"   // this file's C entry points, declared once
#include <algorithm>
#include <cfloat>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "dtypes.h"  // Float32, BFloat16, Float16
#include "vec512.h"  // load16, exp512 (AVX-512 builds)

namespace {

#ifdef __AVX512F__
constexpr int QT = 16;   // queries per tile
constexpr int KT = 16;   // keys per tile: one zmm of scores per query
constexpr float MASKED = -1e30f;   // a hidden key's score: exp() of it is 0, and no inf
                                   // arithmetic (the build assumes finite math)

template <typename Dtype, int HEAD_DIM, typename T = typename Dtype::storage>
void prefill(const T* query, int64_t query_stride, const T* kv_cache, const int32_t* block_table,
             const int32_t* query_start, const int32_t* seq_lens, T* out, int num_reqs,
             int num_heads, int num_kv_heads, int block_size, int num_blocks,
             int max_blocks_per_req, float scale, int sliding_window) {
    constexpr int V = HEAD_DIM / 16;   // zmm vectors per head
    const int group = num_heads / num_kv_heads;
    const int64_t token_stride = int64_t(num_kv_heads) * HEAD_DIM;
    const int64_t block_stride = block_size * token_stride;
    const T* key_cache = kv_cache;
    const T* value_cache = kv_cache + int64_t(num_blocks) * block_stride;
    const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);

    // Tasks: (request, query tile, KV head), listed so that each is found by index.
    std::vector<int> task_req, task_tile;
    for (int r = 0; r < num_reqs; ++r)
        for (int tile = 0; tile * QT < query_start[r + 1] - query_start[r]; ++tile)
            for (int h = 0; h < num_kv_heads; ++h) task_req.push_back(r), task_tile.push_back(tile * num_kv_heads + h);

    #pragma omp parallel
    {
        alignas(64) float keys_f[KT][HEAD_DIM];    // the key tile, as float32
        alignas(64) float vals[KT][HEAD_DIM];      // the value tile, as float32
        alignas(64) float p[KT][QT];               // P^T of one key tile: p[key][query]
        alignas(64) float correction[QT];
        // Per query head of the group: its query tile transposed and scaled (qt[d][query]),
        // its output rows, and the running max and sum of every query, one lane each.
        std::vector<float> qt(size_t(group) * HEAD_DIM * QT), o(size_t(group) * QT * HEAD_DIM),
                           m(size_t(group) * QT), l(size_t(group) * QT);

        // Causal prefills get longer towards the end: hand tasks out one at a time.
        #pragma omp for schedule(dynamic, 1)
        for (int task = 0; task < int(task_req.size()); ++task) {
            const int r = task_req[task];
            const int tile = task_tile[task] / num_kv_heads, h = task_tile[task] % num_kv_heads;
            const int q_len = query_start[r + 1] - query_start[r], seq_len = seq_lens[r];
            const int q0 = tile * QT, rows = std::min(QT, q_len - q0);
            const int pos0 = seq_len - q_len + q0;                 // position of the tile's first query
            const int last = pos0 + rows - 1;                      // ... and of its last
            const int first_key = sliding_window > 0 ? std::max(0, pos0 - sliding_window + 1) : 0;
            const int32_t* table = block_table + int64_t(r) * max_blocks_per_req;
            const __mmask16 real_rows = __mmask16((1u << rows) - 1);
            const __m512i query_pos = _mm512_add_epi32(_mm512_set1_epi32(pos0), lane);
            for (int g = 0; g < group; ++g) {
                std::fill(&m[g * QT], &m[g * QT] + QT, -FLT_MAX);
                std::fill(&l[g * QT], &l[g * QT] + QT, 0.f);
                float* qg = &qt[size_t(g) * HEAD_DIM * QT];
                for (int i = 0; i < QT; ++i) {
                    alignas(64) float row[HEAD_DIM] = {};
                    if (i < rows) {
                        const T* src = query + int64_t(query_start[r] + q0 + i) * query_stride
                                             + int64_t(h * group + g) * HEAD_DIM;
                        for (int v = 0; v < V; ++v)
                            _mm512_store_ps(row + 16 * v, _mm512_mul_ps(load16(src + 16 * v), _mm512_set1_ps(scale)));
                    }
                    for (int d = 0; d < HEAD_DIM; ++d) qg[d * QT + i] = row[d];
                }
            }
            std::fill(o.begin(), o.end(), 0.f);

            for (int k0 = first_key / KT * KT; k0 <= last; k0 += KT) {
                const int keys = std::min(KT, last + 1 - k0);
                for (int j = 0; j < keys; ++j) {   // gather the tile as float32
                    const int t = k0 + j;
                    const int64_t at = table[t / block_size] * block_stride
                                     + (t % block_size) * token_stride + int64_t(h) * HEAD_DIM;
                    for (int v = 0; v < V; ++v) {
                        _mm512_store_ps(&keys_f[j][16 * v], load16(key_cache + at + 16 * v));
                        _mm512_store_ps(&vals[j][16 * v], load16(value_cache + at + 16 * v));
                    }
                }
                // Which queries (lanes) see key j: real rows, not before the key
                // (causal), and within their window. Only tiles at the diagonal or at
                // the window's edge hide anything.
                __mmask16 visible[KT];
                for (int j = 0; j < KT; ++j) {
                    if (j >= keys) { visible[j] = 0; continue; }
                    const __m512i key_pos = _mm512_set1_epi32(k0 + j);
                    __mmask16 mask = _mm512_mask_cmpge_epi32_mask(real_rows, query_pos, key_pos);
                    if (sliding_window > 0)   // key > query - window  <=>  query < key + window
                        mask &= _mm512_cmplt_epi32_mask(query_pos, _mm512_add_epi32(key_pos, _mm512_set1_epi32(sliding_window)));
                    visible[j] = mask;
                }
                for (int g = 0; g < group; ++g) {
                    const float* qg = &qt[size_t(g) * HEAD_DIM * QT];
                    // S^T[key][query] = K . Q^T: one zmm per key, its lanes the 16 queries,
                    // 8 keys at a time (8 FMA chains).
                    __m512 s[KT];
                    for (int j0 = 0; j0 < keys; j0 += 8) {
                        __m512 acc[8];
                        for (int j = 0; j < 8; ++j) acc[j] = _mm512_setzero_ps();
                        for (int d = 0; d < HEAD_DIM; ++d) {
                            const __m512 qd = _mm512_loadu_ps(qg + d * QT);
                            for (int j = 0; j < 8; ++j)
                                acc[j] = _mm512_fmadd_ps(_mm512_set1_ps(keys_f[j0 + j][d]), qd, acc[j]);
                        }
                        for (int j = 0; j < 8; ++j) s[j0 + j] = acc[j];
                    }
                    // Online softmax, lane by lane (no horizontal reductions): the new
                    // maximum over visible keys, exp(m - m') for the sums so far, P.
                    const __m512 m_old = _mm512_loadu_ps(&m[g * QT]);
                    __m512 m_new = m_old;
                    for (int j = 0; j < keys; ++j) m_new = _mm512_mask_max_ps(m_new, visible[j], m_new, s[j]);
                    const __m512 c = exp512(_mm512_sub_ps(m_old, m_new));
                    __m512 sum = _mm512_mul_ps(_mm512_loadu_ps(&l[g * QT]), c);
                    for (int j = 0; j < keys; ++j) {
                        const __m512 pj = _mm512_maskz_mov_ps(visible[j], exp512(_mm512_sub_ps(s[j], m_new)));
                        sum = _mm512_add_ps(sum, pj);
                        _mm512_store_ps(p[j], pj);
                    }
                    _mm512_storeu_ps(&m[g * QT], m_new);
                    _mm512_storeu_ps(&l[g * QT], sum);
                    _mm512_store_ps(correction, c);
                    // O = O·correction + P . V, four queries at a time (each value vector
                    // loaded once for the four).
                    float* og = &o[size_t(g) * QT * HEAD_DIM];
                    for (int i0 = 0; i0 < rows; i0 += 4) {
                        __m512 acc[4][V];
                        for (int i = 0; i < 4; ++i)
                            for (int v = 0; v < V; ++v)
                                acc[i][v] = _mm512_mul_ps(_mm512_loadu_ps(og + (i0 + i) * HEAD_DIM + 16 * v),
                                                          _mm512_set1_ps(correction[i0 + i]));
                        for (int j = 0; j < keys; ++j) {
                            __m512 vj[V];
                            for (int v = 0; v < V; ++v) vj[v] = _mm512_load_ps(&vals[j][16 * v]);
                            for (int i = 0; i < 4; ++i) {
                                const __m512 pij = _mm512_set1_ps(p[j][i0 + i]);
                                for (int v = 0; v < V; ++v) acc[i][v] = _mm512_fmadd_ps(pij, vj[v], acc[i][v]);
                            }
                        }
                        for (int i = 0; i < 4; ++i)
                            for (int v = 0; v < V; ++v) _mm512_storeu_ps(og + (i0 + i) * HEAD_DIM + 16 * v, acc[i][v]);
                    }
                }
            }
            for (int g = 0; g < group; ++g) {
                for (int i = 0; i < rows; ++i) {
                    const float inv = 1.f / l[g * QT + i];
                    const float* oi = &o[(size_t(g) * QT + i) * HEAD_DIM];
                    T* dst = out + (int64_t(query_start[r] + q0 + i) * num_heads + h * group + g) * HEAD_DIM;
                    for (int d = 0; d < HEAD_DIM; ++d) dst[d] = Dtype::store(oi[d] * inv);
                }
            }
        }
    }
}
#endif

}  // namespace

extern "C" {

// Whether this build can run prefill attention for this head size.
int prefill_supported(int head_dim) {
#ifdef __AVX512F__
    return head_dim == 64 || head_dim == 128;
#else
    return 0;
#endif
}

// dtype: 0 = float32, 1 = bfloat16, 2 = float16. Called through ctypes, only where
// prefill_supported(head_dim).
void paged_attention_prefill(int dtype, const void* query, int64_t query_stride,
                             const void* kv_cache, const int32_t* block_table,
                             const int32_t* query_start, const int32_t* seq_lens, void* out,
                             int num_reqs, int num_heads, int num_kv_heads, int head_dim,
                             int block_size, int num_blocks, int max_blocks_per_req, float scale,
                             int sliding_window) {
#ifdef __AVX512F__
    auto run = [&](auto kernel, auto* type) {
        using T = std::remove_pointer_t<decltype(type)>;
        kernel(static_cast<const T*>(query), query_stride, static_cast<const T*>(kv_cache),
               block_table, query_start, seq_lens, static_cast<T*>(out), num_reqs, num_heads,
               num_kv_heads, block_size, num_blocks, max_blocks_per_req, scale, sliding_window);
    };
    const bool wide = head_dim == 128;
    switch (dtype) {
        case 0: wide ? run(prefill<Float32, 128>, (float*)nullptr) : run(prefill<Float32, 64>, (float*)nullptr); break;
        case 1: wide ? run(prefill<BFloat16, 128>, (uint16_t*)nullptr) : run(prefill<BFloat16, 64>, (uint16_t*)nullptr); break;
        case 2: wide ? run(prefill<Float16, 128>, (Half*)nullptr) : run(prefill<Float16, 64>, (Half*)nullptr); break;
    }
#endif
}

}  // extern "C"
