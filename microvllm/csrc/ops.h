// Every C entry point of microvllm's CPU kernels, declared once.
//
// Each kernel's .cpp file includes this header, so the compiler checks its definition
// against the declaration here; decode_layers.cpp takes its function-pointer types from
// it (decltype); and the Python side (platforms/cpu/kernels.py) reads these prototypes to
// declare the ctypes signatures. Change a signature here and everything follows.
//
// Conventions: `dtype` is 0 float32, 1 bfloat16, 2 float16 (dtypes.h); tensors cross as
// raw pointers to contiguous rows (a `*_stride` gives the distance between rows, in
// elements, where rows may be apart); the Python wrappers check shapes first.
//
// One line per prototype: the Python reader parses them line by line.

#pragma once
#include <cstdint>

extern "C" {

// norm_rope.cpp: RMSNorm (with residual += x first when `residual` is not null) and RoPE.
void rms_norm(int dtype, const void* x, void* residual, const void* weight, void* out, int rows, int hidden, float eps);
void rope(int dtype, const void* x, const void* cos, const void* sin, void* out, int tokens, int heads, int head_dim, int64_t row_stride);

// activation.cpp: silu(gate) * up over [rows, 2 d] -> [rows, d].
void silu_and_mul(int dtype, const void* gate_up, void* out, int rows, int d);

// amx_linear.cpp (bfloat16, AMX tiles) and vec_linear.cpp (float32, VecF panels: AVX-512,
// AVX2 or NEON): y [M, N] = x [M, K] @ W.T (+ bias), W packed by the wrapper. amx_init asks
// Linux for the tiles; vec_linear_panel is the panel width in columns (0: no vector unit).
int amx_init();
void amx_linear(const void* x, const void* packed, const void* bias, void* y, int M, int N, int K);
int vec_linear_panel();
void vec_linear(const void* x, const void* packed, const void* bias, void* y, int M, int N, int K);
// dpbf16_linear.cpp (bfloat16, AVX512-BF16's vdpbf16ps without AMX): the same signature, W in
// panels of 48 columns (dpbf16_linear_panel; 0 where the build has no AVX512-BF16).
int dpbf16_linear_panel();
void dpbf16_linear(const void* x, const void* packed, const void* bias, void* y, int M, int N, int K);

// quantized_linear.cpp: y [M, N] = x [M, K] @ W.T (+ bias), float32 x and y, W as stored:
// GGUF Q4_1 or Q8_0 rows of blocks, or int8 rows with float32 scales; dequantize_rows
// (format 0 Q4_1, 1 Q8_0, 2 int8) writes W [N, K] as float32.
void q4_1_linear(const void* x, const void* weight, const void* bias, void* y, int M, int N, int K);
void q8_0_linear(const void* x, const void* weight, const void* bias, void* y, int M, int N, int K);
void int8_linear(const void* x, const void* weight, const void* scales, const void* bias, void* y, int M, int N, int K);
// int8_linear with the GEMM signature (for the decode fast path): weight_and_scales = {weight, scales}.
void int8_linear_pair(const void* x, const void* weight_and_scales, const void* bias, void* y, int M, int N, int K);
void dequantize_rows(int format, const void* weight, const void* scales, void* out, int N, int K);
// 1 if q4_1_linear and q8_0_linear multiply 5 rows of x and more on AMX tiles here
// (amx_quantized_linear.h), else 0.
int quantized_amx_ready();

// argmax.cpp: greedy sampling, the first index of each row's maximum (or first NaN).
void argmax_rows(const void* logits, void* out, int rows, int64_t vocab);

// paged_attention.cpp: a step's keys and values into their slots (returns -1, or the
// first token whose slot is out of range), and decode attention from the paged cache.
int write_kv(const void* key, const void* value, int64_t key_stride, int64_t value_stride, void* kv_cache, const int64_t* slots, int num_tokens, int64_t num_slots, int row_elements, int element_bytes);
void paged_attention_decode(int dtype, const void* query, int64_t query_stride, const void* kv_cache, const int32_t* block_table, const int32_t* seq_lens, void* out, int num_reqs, int num_heads, int num_kv_heads, int head_dim, int block_size, int num_blocks, int max_blocks_per_req, float scale, int sliding_window);

// prefill_attention.cpp: prefill chunks, FlashAttention-style tiles (AVX-512 builds).
int prefill_supported(int head_dim);
void paged_attention_prefill(int dtype, const void* query, int64_t query_stride, const void* kv_cache, const int32_t* block_table, const int32_t* query_start, const int32_t* seq_lens, void* out, int num_reqs, int num_heads, int num_kv_heads, int head_dim, int block_size, int num_blocks, int max_blocks_per_req, float scale, int sliding_window);

// decode_layers.cpp: a decode step's decoder layers as one loop of the kernels above
// (its structs are defined there).
struct Kernels;
struct Shape;
struct Layer;
struct Group;
struct Buffers;
int decode_layers(const Kernels* kernels, const Shape* shape, const Layer* layers, int num_layers, const Group* groups, const Buffers* buffers, int T, double* seconds);

}  // extern "C"
