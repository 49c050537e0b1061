// Paged decode attention for CPUs: the C++ twin of triton_kernels/decode.py.
//
// Every decode (one new query token per request) attends over its own context,
// read *in place* from the paged KV cache: no gathered copy of K and V is made,
// so each cached key and value crosses the memory bus exactly once per layer.
// On a CPU a decode step is memory-bound, which is why that matters.
//
//   query      [num_reqs, num_heads, head_dim]                 (T = float, bf16, fp16)
//              rows query_stride elements apart (a view of the QKV output: no copy)
//   kv_cache   [2, num_blocks, block_size, num_kv_heads, head_dim]   0 = keys, 1 = values
//   block_table[num_reqs, max_blocks_per_req]  int32   logical block -> physical block
//   seq_lens   [num_reqs]                      int32   context length, this token included
//   out        [num_reqs, num_heads, head_dim]
//
// Work is split by request (and by KV head when requests are few). The `group` query
// heads that share KV head h (grouped-query attention) are handled together, so each
// key row is loaded once and used `group` times:
//
//   key of token t:  kv_cache[0, block_table[r, t / block_size], t % block_size, h, :]
//
//   pass 1   scores[g, t] = scale * q[g] . key(t)        for t in the visible window
//   pass 2   p[g, t] = exp(scores[g, t] - max_t scores[g, :]),  denom[g] = sum_t p[g, t]
//   pass 3   out[g] = sum_t p[g, t] * value(t) / denom[g]
//
// Tokens are visited page by page (the next page's row prefetched as each token is
// read). With AVX-512 and a head size that is a multiple of 16, passes 1 and 3 are
// written with vector intrinsics: each KV head's row is converted to float32 registers
// once and used by its `group` query heads. Left to the compiler, the bfloat16 loops
// compiled to mostly scalar code: the intrinsics made bfloat16 decode attention 1.3x
// faster (float32 was already at memory speed). In 16-bit types pass 3 then keeps a KV
// head's query sums in registers over all tokens, one head at a time: 1.10-1.11x in
// bfloat16 on a 2-core AMD EPYC (Zen 4; 32 requests of ~170 tokens x 30 layers, the two
// versions alternated 20 times in one process, the same bits out); 0.97x in float32, which
// keeps the per-token loop. Summing 16 tokens' or 4 heads' dot products together in
// pass 1 measured slower than one horizontal sum each.
//
// Arithmetic is float32 whatever T is (as in SDPA's CPU kernel). Threads come from the
// OpenMP runtime torch already loaded, so torch.set_num_threads applies here too.
// Called by platforms/cpu/attention.py; compared with the torch reference in
// tests/platforms/test_cpu_attention_kernels.py.

#include "ops.h"   // this file's C entry points, declared once
#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "dtypes.h"  // Float32, BFloat16, Float16: storage and conversions
#include "vec512.h"  // load16 (AVX-512 builds)

#ifdef _OPENMP
#include <omp.h>
#else  // built without OpenMP (a compiler that lacks it): one thread, same results
inline int omp_get_max_threads() { return 1; }
#endif

namespace {

// Ask for the cache lines of `bytes` bytes at `p` (a hint: it never faults or waits).
inline void prefetch(const void* p, int bytes) {
    const char* line = static_cast<const char*>(p);
    for (int byte = 0; byte < bytes; byte += 64) __builtin_prefetch(line + byte);
}


// HEAD_DIM > 0 is a compile-time head size (the common ones: the inner loops unroll
// into a few vector instructions); 0 reads it at run time.
template <typename Dtype, int HEAD_DIM, typename T = typename Dtype::storage>
void decode(const T* query, int64_t query_stride, const T* kv_cache, const int32_t* block_table,
            const int32_t* seq_lens, T* out, int num_reqs, int num_heads, int num_kv_heads,
            int runtime_head_dim, int block_size, int num_blocks, int max_blocks_per_req,
            float scale, int sliding_window) {
    const int head_dim = HEAD_DIM > 0 ? HEAD_DIM : runtime_head_dim;
    const int group = num_heads / num_kv_heads;
    const int64_t token_stride = int64_t(num_kv_heads) * head_dim;   // next token, same page
    const int64_t block_stride = block_size * token_stride;          // next page
    const T* key_cache = kv_cache;
    const T* value_cache = kv_cache + int64_t(num_blocks) * block_stride;

    // A task is one request and a range of its KV heads. With a request per thread or
    // more, a task takes all heads: it then reads each cached token's row
    // [num_kv_heads, head_dim] as one contiguous run, which the hardware prefetcher
    // streams best (measured 1.3x faster than a task per head). With fewer requests
    // (one long prompt, say) each head is its own task, so that every thread has work.
    const int heads_per_task = num_reqs >= omp_get_max_threads() ? num_kv_heads : 1;
    const int tasks_per_req = num_kv_heads / heads_per_task;

    #pragma omp parallel
    {
        // Per-thread scratch, reused across tasks.
        const int rows = heads_per_task * group;          // query heads in one task
        std::vector<float> q(rows * head_dim), acc(rows * head_dim), denom(rows), scores;

        // Requests have different lengths: hand tasks out one at a time.
        #pragma omp for schedule(dynamic, 1)
        for (int task = 0; task < num_reqs * tasks_per_req; ++task) {
            const int r = task / tasks_per_req;
            const int first_head = (task % tasks_per_req) * heads_per_task;  // a KV head
            const int seq_len = seq_lens[r];
            const int first = sliding_window > 0 ? std::max(0, seq_len - sliding_window) : 0;
            const int n = seq_len - first;
            const int32_t* table = block_table + int64_t(r) * max_blocks_per_req;
            // This task's heads of the tokens in logical block b: token t of the block
            // at page(b) + t * token_stride, [heads_per_task, head_dim] contiguous.
            auto page = [&](const T* cache, int b) {
                return cache + table[b] * block_stride + first_head * head_dim;
            };
            // Pages are scattered, so the hardware prefetcher, which follows one 4 KiB
            // page at a time, stalls at every page change. Asking for the row of the
            // same token one block ahead while working on a token keeps loads in
            // flight: measured 15-25% faster on the decode batches of bench throughput.
            const int row_bytes = heads_per_task * head_dim * int(sizeof(T));
            // visit(t, row of token t) for every visible token, page by page, prefetching
            // the next page's row as it goes.
            auto for_each_token = [&](const T* cache, auto visit) {
                for (int b = first / block_size; b * block_size < seq_len; ++b) {
                    const T* rows_b = page(cache, b);
                    const bool more = (b + 1) * block_size < seq_len;
                    const T* next = more ? page(cache, b + 1) : nullptr;
                    const int begin = std::max(first, b * block_size);
                    const int end = std::min(seq_len, (b + 1) * block_size);
                    for (int t = begin; t < end; ++t) {
                        const int64_t offset = (t - b * block_size) * token_stride;
                        if (more) prefetch(next + offset, row_bytes);
                        visit(t, rows_b + offset);
                    }
                }
            };
            // Query rows i = 0 .. rows-1 are query heads first_head*group + i, which
            // read KV head first_head + i / group.
            const T* q_in = query + r * query_stride + int64_t(first_head) * group * head_dim;
            for (int i = 0; i < rows * head_dim; ++i) q[i] = Dtype::load(q_in[i]) * scale;
            scores.resize(size_t(rows) * n);

            // pass 1: q . k for every visible key
#ifdef __AVX512F__
            if constexpr (HEAD_DIM > 0 && HEAD_DIM % 16 == 0) {
                constexpr int V = HEAD_DIM / 16;   // zmm vectors per head
                for_each_token(key_cache, [&](int t, const T* keys) {
                    for (int h = 0; h < heads_per_task; ++h) {
                        __m512 k[V];
                        for (int v = 0; v < V; ++v) k[v] = load16(keys + h * HEAD_DIM + 16 * v);
                        for (int i = h * group; i < (h + 1) * group; ++i) {
                            const float* qi = &q[i * HEAD_DIM];
                            __m512 dot = _mm512_mul_ps(_mm512_loadu_ps(qi), k[0]);
                            for (int v = 1; v < V; ++v) dot = _mm512_fmadd_ps(_mm512_loadu_ps(qi + 16 * v), k[v], dot);
                            scores[size_t(i) * n + (t - first)] = _mm512_reduce_add_ps(dot);
                        }
                    }
                });
            } else
#endif
            for_each_token(key_cache, [&](int t, const T* keys) {
                for (int i = 0; i < rows; ++i) {
                    const T* k = keys + (i / group) * head_dim;
                    const float* qi = &q[i * head_dim];
                    float s = 0.f;
                    #pragma omp simd reduction(+ : s)
                    for (int d = 0; d < head_dim; ++d) s += qi[d] * Dtype::load(k[d]);
                    scores[size_t(i) * n + (t - first)] = s;
                }
            });
            // pass 2: softmax numerators (max subtracted for range), and their sums
            for (int i = 0; i < rows; ++i) {
                float* s = &scores[size_t(i) * n];
                float max = -FLT_MAX;
                for (int j = 0; j < n; ++j) max = std::max(max, s[j]);
                float sum = 0.f;
                #pragma omp simd reduction(+ : sum)
                for (int j = 0; j < n; ++j) {
                    s[j] = std::exp(s[j] - max);
                    sum += s[j];
                }
                denom[i] = sum;
            }
            // pass 3: the probability-weighted sum of values
            std::fill(acc.begin(), acc.end(), 0.f);
#ifdef __AVX512F__
            if constexpr (HEAD_DIM > 0 && HEAD_DIM % 16 == 0 && HEAD_DIM <= 128 && sizeof(T) == 2) {
                // 16-bit values: one KV head at a time, up to GROUP_TILE of its query heads'
                // sums held in registers across all the tokens (GROUP_TILE x V accumulators:
                // 4 x 4 for head_dim 64, 2 x 8 for 128), instead of loading and storing every
                // query head's sum at every token. Each token's row is then read once per
                // head: after the first head, from cache (one request's values fit in L2).
                // float32 keeps the loop below: its rows are twice the bytes, and reading
                // them once per head measured 3% slower there.
                constexpr int V = HEAD_DIM / 16;
                constexpr int GROUP_TILE = V <= 4 ? 4 : 2;
                for (int h = 0; h < heads_per_task; ++h)
                    for (int i0 = h * group; i0 < (h + 1) * group; i0 += GROUP_TILE) {
                        const int rows_here = std::min(GROUP_TILE, (h + 1) * group - i0);
                        __m512 sum[GROUP_TILE][V];
                        for (int g = 0; g < GROUP_TILE; ++g)
                            for (int v = 0; v < V; ++v) sum[g][v] = _mm512_setzero_ps();
                        for_each_token(value_cache, [&](int t, const T* values) {
                            __m512 val[V];
                            for (int v = 0; v < V; ++v) val[v] = load16(values + h * HEAD_DIM + 16 * v);
                            for (int g = 0; g < GROUP_TILE; ++g) {
                                if (g >= rows_here) break;
                                const __m512 p = _mm512_set1_ps(scores[size_t(i0 + g) * n + (t - first)]);
                                for (int v = 0; v < V; ++v) sum[g][v] = _mm512_fmadd_ps(p, val[v], sum[g][v]);
                            }
                        });
                        for (int g = 0; g < rows_here; ++g)
                            for (int v = 0; v < V; ++v) _mm512_storeu_ps(&acc[(i0 + g) * HEAD_DIM + 16 * v], sum[g][v]);
                    }
            } else
#endif
            for_each_token(value_cache, [&](int t, const T* values) {
                for (int i = 0; i < rows; ++i) {
                    const T* v = values + (i / group) * head_dim;
                    const float p = scores[size_t(i) * n + (t - first)];
                    float* a = &acc[i * head_dim];
                    #pragma omp simd
                    for (int d = 0; d < head_dim; ++d) a[d] += p * Dtype::load(v[d]);
                }
            });
            T* o = out + (int64_t(r) * num_heads + first_head * group) * head_dim;
            for (int i = 0; i < rows; ++i)
                for (int d = 0; d < head_dim; ++d) o[i * head_dim + d] = Dtype::store(acc[i * head_dim + d] / denom[i]);
        }
    }
}

template <typename Dtype, typename T = typename Dtype::storage>
void dispatch(const void* query, int64_t query_stride, const void* kv_cache, const int32_t* block_table,
              const int32_t* seq_lens, void* out, int num_reqs, int num_heads,
              int num_kv_heads, int head_dim, int block_size, int num_blocks,
              int max_blocks_per_req, float scale, int sliding_window) {
    auto run = [&](auto kernel) {
        kernel(static_cast<const T*>(query), query_stride, static_cast<const T*>(kv_cache), block_table,
               seq_lens, static_cast<T*>(out), num_reqs, num_heads, num_kv_heads, head_dim,
               block_size, num_blocks, max_blocks_per_req, scale, sliding_window);
    };
    switch (head_dim) {
        case 64: run(decode<Dtype, 64>); break;
        case 128: run(decode<Dtype, 128>); break;
        default: run(decode<Dtype, 0>);
    }
}

}  // namespace

extern "C" {

// Before attention reads the cache, each layer writes the step's new keys and values
// into it (vLLM's reshape_and_cache): token i's row [num_kv_heads, head_dim] goes to
// slot slots[i], i.e. kv_cache[0 / 1, slot / block_size, slot % block_size]. key and
// value rows are `key_stride` / `value_stride` elements apart, as in views of the fused
// QKV output; within a row, heads are contiguous. One call for both, instead of two
// torch index_copy_ calls. Returns -1, or the first token whose slot is out of range
// (then nothing from it on is written).
int write_kv(const void* key, const void* value, int64_t key_stride, int64_t value_stride,
             void* kv_cache, const int64_t* slots, int num_tokens, int64_t num_slots,
             int row_elements, int element_bytes) {
    char* keys = static_cast<char*>(kv_cache);
    char* values = keys + num_slots * row_elements * element_bytes;
    const size_t row_bytes = size_t(row_elements) * element_bytes;
    for (int i = 0; i < num_tokens; ++i) {
        const int64_t slot = slots[i];
        if (slot < 0 || slot >= num_slots) return i;
        std::memcpy(keys + slot * row_bytes, static_cast<const char*>(key) + i * key_stride * element_bytes, row_bytes);
        std::memcpy(values + slot * row_bytes, static_cast<const char*>(value) + i * value_stride * element_bytes, row_bytes);
    }
    return -1;
}

// dtype: 0 = float32, 1 = bfloat16, 2 = float16. Called through ctypes.
void paged_attention_decode(int dtype, const void* query, int64_t query_stride, const void* kv_cache,
                            const int32_t* block_table, const int32_t* seq_lens, void* out,
                            int num_reqs, int num_heads, int num_kv_heads, int head_dim,
                            int block_size, int num_blocks, int max_blocks_per_req,
                            float scale, int sliding_window) {
    switch (dtype) {
        case 0: dispatch<Float32>(query, query_stride, kv_cache, block_table, seq_lens, out, num_reqs, num_heads,
                                num_kv_heads, head_dim, block_size, num_blocks,
                                max_blocks_per_req, scale, sliding_window); break;
        case 1: dispatch<BFloat16>(query, query_stride, kv_cache, block_table, seq_lens, out, num_reqs, num_heads,
                               num_kv_heads, head_dim, block_size, num_blocks,
                               max_blocks_per_req, scale, sliding_window); break;
        case 2: dispatch<Float16>(query, query_stride, kv_cache, block_table, seq_lens, out, num_reqs,
                                   num_heads, num_kv_heads, head_dim, block_size, num_blocks,
                                   max_blocks_per_req, scale, sliding_window); break;
    }
}

}  // extern "C"
