// The decoder-layer loop of a decode step, in C++ (platforms/cpu/decode_fast_path.py says why).
//
// Nothing here computes: every line calls one of the kernels the modules' wrappers call
// (their C entry points, passed in as function pointers from the libraries Python
// already loaded), with the same arguments, in the order LlamaDecoderLayer runs them:
//
//   for each layer:
//     rms_norm(h, residual) -> x          (layer 0: the embeddings, no residual yet)
//     gemm(x, W_qkv) -> qkv               rope(qkv's q and k heads) -> qk
//     write_kv(qk's k heads, qkv's v heads) -> kv_cache
//     paged_attention_decode(qk's q heads, kv_cache) -> attn
//     gemm(attn, W_o) -> h                rms_norm(h, residual) -> x
//     gemm(x, W_gate_up) -> gate_up       silu_and_mul(gate_up) -> act
//     gemm(act, W_down) -> h
//
// so the results are those of the modules, bit for bit. What it saves is Python: about
// 15 us per kernel call (argument conversion, pointer lookups) x 300 calls per step.
// The structs mirror the ctypes Structures in platforms/cpu/decode_fast_path.py field for field.

#include <chrono>
#include <cstdint>

#include "ops.h"   // the kernels' C signatures, and this file's entry point

extern "C" {

struct Kernels {   // pointers to the very functions the wrappers call (their types: ops.h)
    decltype(&::rms_norm) rms_norm;
    decltype(&::rope) rope;
    decltype(&::amx_linear) gemm;   // amx_linear or vec_linear: one signature
    decltype(&::write_kv) write_kv;
    decltype(&::paged_attention_decode) paged_attention_decode;
    decltype(&::silu_and_mul) silu_and_mul;
};

struct Shape {   // the model's, and its caches'
    int dtype, element_bytes, hidden, intermediate, num_heads, num_kv_heads, head_dim;
    int block_size, num_blocks;
};

struct Layer {   // one decoder layer: weights (packed for `gemm`), biases or null, its cache
    const void *input_norm, *post_norm;
    const void *qkv, *qkv_bias, *o, *o_bias, *gate_up, *gate_up_bias, *down, *down_bias;
    void* kv_cache;
    float eps, scale;
    int sliding_window;   // 0: none
    int group;            // its KV cache group: which Group below it reads
};

struct Group {   // one cache group's attention metadata for this step
    const int32_t* block_table;   // [T, max_blocks] int32
    const int32_t* seq_lens;      // [T] int32
    const int64_t* slots;         // [T] int64
    int max_blocks;
};

struct Buffers {   // this step's activations, T rows each
    void *residual, *x, *h, *qkv, *qk, *attn, *gate_up, *act;
    const void *cos, *sin;        // [T, head_dim / 2]
};

// Kernel kinds for `seconds`, in this order.
enum { GEMM, ATTENTION, WRITE_KV, RMS_NORM, ROPE, SILU_AND_MUL, KINDS };

// Runs every layer for T decode tokens. With `seconds` (KINDS doubles) non-null, adds
// each kind's wall time to it (bench throughput --profile). Returns -1, or the first
// token whose slot write_kv refused (Python raises write_kv's IndexError for it).
int decode_layers(const Kernels* k, const Shape* s, const Layer* layers, int num_layers,
                  const Group* groups, const Buffers* b, int T, double* seconds) {
    const int Hq = s->num_heads, Hkv = s->num_kv_heads, d = s->head_dim, H = s->hidden, I = s->intermediate;
    const int qkv_cols = (Hq + 2 * Hkv) * d, qk_cols = (Hq + Hkv) * d;
    const int64_t num_slots = int64_t(s->num_blocks) * s->block_size;
    char* qk = static_cast<char*>(b->qk);
    char* qkv = static_cast<char*>(b->qkv);
    using Clock = std::chrono::steady_clock;
    auto last = Clock::now();
    auto charge = [&](int kind) {   // time since the last charge goes to `kind`
        if (!seconds) return;
        const auto now = Clock::now();
        seconds[kind] += std::chrono::duration<double>(now - last).count();
        last = now;
    };
    for (int i = 0; i < num_layers; ++i) {
        const Layer& L = layers[i];
        const Group& g = groups[L.group];
        if (i == 0)   // the residual stream starts as the embeddings: normalise them
            k->rms_norm(s->dtype, b->residual, nullptr, L.input_norm, b->x, T, H, L.eps);
        else          // residual += h (the previous MLP's output), normalised
            k->rms_norm(s->dtype, b->h, b->residual, L.input_norm, b->x, T, H, L.eps);
        charge(RMS_NORM);
        k->gemm(b->x, L.qkv, L.qkv_bias, b->qkv, T, qkv_cols, H);
        charge(GEMM);
        k->rope(s->dtype, b->qkv, b->cos, b->sin, b->qk, T, Hq + Hkv, d, qkv_cols);
        charge(ROPE);
        const int bad = k->write_kv(qk + int64_t(Hq) * d * s->element_bytes,
                                    qkv + int64_t(Hq + Hkv) * d * s->element_bytes, qk_cols, qkv_cols,
                                    L.kv_cache, g.slots, T, num_slots, Hkv * d, s->element_bytes);
        if (bad >= 0) return bad;
        charge(WRITE_KV);
        k->paged_attention_decode(s->dtype, b->qk, qk_cols, L.kv_cache, g.block_table, g.seq_lens, b->attn,
                                  T, Hq, Hkv, d, s->block_size, s->num_blocks, g.max_blocks, L.scale,
                                  L.sliding_window);
        charge(ATTENTION);
        k->gemm(b->attn, L.o, L.o_bias, b->h, T, H, Hq * d);
        charge(GEMM);
        k->rms_norm(s->dtype, b->h, b->residual, L.post_norm, b->x, T, H, L.eps);
        charge(RMS_NORM);
        k->gemm(b->x, L.gate_up, L.gate_up_bias, b->gate_up, T, 2 * I, H);
        charge(GEMM);
        k->silu_and_mul(s->dtype, b->gate_up, b->act, T, I);
        charge(SILU_AND_MUL);
        k->gemm(b->act, L.down, L.down_bias, b->h, T, H, I);
        charge(GEMM);
    }
    return -1;
}

}  // extern "C"
