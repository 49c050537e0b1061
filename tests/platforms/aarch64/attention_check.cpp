// The kernel harness's attention checks: write_kv fills a paged KV cache the way the model
// runner does, then paged_attention_decode (and paged_attention_prefill, where this build
// has it) is compared with softmax attention computed in double from the same keys.
//
//   qkv          [tokens, (8 + 2·2) heads, head_dim]   fused QKV rows: 8 query heads, then
//                                                      2 KV heads of keys, 2 of values (GQA 4)
//   kv_cache     [2, num_blocks, 16, 2, head_dim]      written by write_kv, blocks shuffled
//   block_table  [num_reqs, max_blocks]                request r's logical block -> physical
//
// Tolerances: float32 within 1e-5 (relative, absolute below 1); bfloat16 and float16
// results are rounded once at the end, so within one step of their type (2^-7, 2^-10).

#include <algorithm>
#include <cstring>
#include <numeric>

#include "check.h"

namespace {

constexpr int HEADS = 8, KV_HEADS = 2, BLOCK_SIZE = 16;

template <typename D>
double step() { return Code<D>::dtype == 0 ? 1e-5 : Code<D>::dtype == 1 ? 0x1p-7 : 0x1p-10; }

template <typename D>
struct Context {
    using T = typename D::storage;
    int head_dim, row;                     // row: elements in a fused QKV row
    std::vector<int32_t> seq_lens, starts;   // request r's tokens: qkv rows starts[r] ..
    std::vector<T> qkv;
    int max_blocks, num_blocks;
    std::vector<int32_t> block_table;
    std::vector<T> cache;
    double write_mismatches = 0;
    int write_result = 0, out_of_range_result = 0;

    Context(Random& random, int head_dim_, std::vector<int32_t> lens)
        : head_dim(head_dim_), row((HEADS + 2 * KV_HEADS) * head_dim_), seq_lens(std::move(lens)) {
        int tokens = 0, longest = 0;
        for (int len : seq_lens) starts.push_back(tokens), tokens += len, longest = std::max(longest, len);
        qkv = random_tensor<D>(random, size_t(tokens) * row);
        max_blocks = (longest + BLOCK_SIZE - 1) / BLOCK_SIZE;
        num_blocks = int(seq_lens.size()) * max_blocks + 2;
        std::vector<int32_t> physical(num_blocks);   // a shuffled pool: pages are scattered
        std::iota(physical.begin(), physical.end(), 0);
        for (int i = num_blocks - 1; i > 0; --i) std::swap(physical[i], physical[random.below(i + 1)]);
        block_table.assign(physical.begin(), physical.begin() + seq_lens.size() * max_blocks);
        // Slots nobody writes hold 1000: a kernel reading a wrong slot cannot go unseen.
        cache.assign(size_t(2) * num_blocks * BLOCK_SIZE * KV_HEADS * head_dim, D::store(1000.f));
        std::vector<int64_t> slots;
        for (size_t r = 0; r < seq_lens.size(); ++r)
            for (int t = 0; t < seq_lens[r]; ++t)
                slots.push_back(int64_t(block_table[r * max_blocks + t / BLOCK_SIZE]) * BLOCK_SIZE + t % BLOCK_SIZE);
        const int64_t num_slots = int64_t(num_blocks) * BLOCK_SIZE;
        const int row_elements = KV_HEADS * head_dim;
        write_result = write_kv(&qkv[HEADS * head_dim], &qkv[(HEADS + KV_HEADS) * head_dim], row, row, cache.data(),
                                slots.data(), tokens, num_slots, row_elements, sizeof(T));
        for (int i = 0; i < tokens; ++i)
            for (int kv = 0; kv < 2; ++kv)
                write_mismatches += std::memcmp(&cache[(kv * num_slots + slots[i]) * row_elements],
                                                &qkv[size_t(i) * row + (HEADS + kv * KV_HEADS) * head_dim],
                                                row_elements * sizeof(T)) != 0;
        std::vector<T> scratch(cache);   // a slot past the cache: refused, its token's index returned
        const int64_t bad[] = {0, num_slots};
        out_of_range_result = write_kv(qkv.data(), qkv.data(), row, row, scratch.data(), bad, 2, num_slots,
                                       row_elements, sizeof(T));
    }

    // The exact output of query head `head` at position `pos` of request r, attending to
    // positions first .. pos (first: the sliding window's start).
    std::vector<double> attend(const T* q, int r, int head, int pos, int window, float scale) const {
        const int kv = head / (HEADS / KV_HEADS), first = window > 0 ? std::max(0, pos - window + 1) : 0;
        std::vector<double> p(pos + 1 - first), out(head_dim, 0.0);
        double max = -1e300, denom = 0;
        for (int t = first; t <= pos; ++t) {
            const T* key = &qkv[size_t(starts[r] + t) * row + (HEADS + kv) * head_dim];
            double s = 0;
            for (int d = 0; d < head_dim; ++d) s += double(D::load(q[d])) * D::load(key[d]);
            p[t - first] = s * scale;
            max = std::max(max, p[t - first]);
        }
        for (int t = first; t <= pos; ++t) {
            const double w = std::exp(p[t - first] - max);
            const T* value = &qkv[size_t(starts[r] + t) * row + (HEADS + KV_HEADS + kv) * head_dim];
            for (int d = 0; d < head_dim; ++d) out[d] += w * D::load(value[d]);
            denom += w;
        }
        for (auto& o : out) o /= denom;
        return out;
    }

    std::string name(const char* kernel, int window) const {
        std::string lens;
        for (int len : seq_lens) lens += (lens.empty() ? "" : ",") + std::to_string(len);
        return std::string(kernel) + " " + Code<D>::name + " d" + std::to_string(head_dim) + " lens " + lens +
               (window ? " window " + std::to_string(window) : "");
    }
};

template <typename D>
void check_decode(Random& random, int head_dim, std::vector<int32_t> seq_lens, int window) {
    using T = typename D::storage;
    const Context<D> context(random, head_dim, std::move(seq_lens));
    const int num_reqs = int(context.seq_lens.size()), row = context.row;
    report(context.name("write_kv", 0) + ": rows in slots, -1",
           context.write_mismatches + (context.write_result != -1), 0, "mismatches");
    report(context.name("write_kv", 0) + ": slot past the end", context.out_of_range_result != 1, 0, "mismatches");
    const auto query = random_tensor<D>(random, size_t(num_reqs) * row);   // rows `row` apart, as in QKV
    std::vector<T> out(size_t(num_reqs) * HEADS * head_dim);
    const float scale = 1.f / std::sqrt(float(head_dim));
    paged_attention_decode(Code<D>::dtype, query.data(), row, context.cache.data(), context.block_table.data(),
                           context.seq_lens.data(), out.data(), num_reqs, HEADS, KV_HEADS, head_dim, BLOCK_SIZE,
                           context.num_blocks, context.max_blocks, scale, window);
    double error = 0;
    for (int r = 0; r < num_reqs; ++r)
        for (int h = 0; h < HEADS; ++h) {
            const auto want = context.attend(&query[size_t(r) * row + h * head_dim], r, h, context.seq_lens[r] - 1,
                                             window, scale);
            for (int d = 0; d < head_dim; ++d)
                error = std::fmax(error, relative(D::load(out[(size_t(r) * HEADS + h) * head_dim + d]), want[d], 1.0));
        }
    report(context.name("paged_attention_decode", window), error, step<D>());
}

// Two prefill chunks: a whole 20-token prompt, and the last 37 tokens of a 50-token one.
template <typename D>
void check_prefill(Random& random, int head_dim, int window) {
    using T = typename D::storage;
    const Context<D> context(random, head_dim, {20, 50});
    const std::vector<int32_t> query_start = {0, 20, 57};
    const int row = context.row, tokens = query_start.back();
    const auto query = random_tensor<D>(random, size_t(tokens) * row);
    std::vector<T> out(size_t(tokens) * HEADS * head_dim);
    const float scale = 1.f / std::sqrt(float(head_dim));
    paged_attention_prefill(Code<D>::dtype, query.data(), row, context.cache.data(), context.block_table.data(),
                            query_start.data(), context.seq_lens.data(), out.data(), 2, HEADS, KV_HEADS, head_dim,
                            BLOCK_SIZE, context.num_blocks, context.max_blocks, scale, window);
    double error = 0;
    for (int r = 0; r < 2; ++r) {
        const int q_len = query_start[r + 1] - query_start[r];
        for (int i = 0; i < q_len; ++i)
            for (int h = 0; h < HEADS; ++h) {
                const size_t token = query_start[r] + i;
                const auto want = context.attend(&query[token * row + h * head_dim], r, h,
                                                 context.seq_lens[r] - q_len + i, window, scale);
                for (int d = 0; d < head_dim; ++d)
                    error = std::fmax(error, relative(D::load(out[(token * HEADS + h) * head_dim + d]), want[d], 1.0));
            }
    }
    report(context.name("paged_attention_prefill", window) + " (chunks 20, 37)", error, step<D>());
}

template <typename D>
void check_attention_in(Random& random) {
    check_decode<D>(random, 64, {1, 15, 16, 17, 100}, 0);
    check_decode<D>(random, 64, {1, 15, 16, 17, 100}, 32);
    check_decode<D>(random, 48, {1, 33, 100}, 0);        // a head size read at run time
    check_decode<D>(random, 64, {300}, 0);               // one request: a task per KV head
    for (int head_dim : {64, 128}) {
        if (!prefill_supported(head_dim)) {
            std::printf("skip  paged_attention_prefill d%d: prefill_supported says this build has none\n", head_dim);
            continue;
        }
        check_prefill<D>(random, head_dim, 0);
        check_prefill<D>(random, head_dim, 24);
    }
}

}  // namespace

void check_attention() {
    Random random(39);
    check_attention_in<Float32>(random);
    check_attention_in<BFloat16>(random);
    check_attention_in<Float16>(random);
}
