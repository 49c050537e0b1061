// The kernel harness's linear-layer checks: y[M, N] = x[M, K] @ W[N, K]^T + bias, with W
// quantized (q4_1_linear, q8_0_linear, int8_linear, dequantize_rows) or packed float32
// (vec_linear), against W dequantized here from its layout and a double-precision dot:
//
//   Q4_1  a row = K/32 blocks of 20 bytes: d fp16 | m fp16 | 16 bytes; byte 4+j holds
//         q[j] (low nibble) and q[j+16] (high nibble); w = d·q + m
//   Q8_0  a row = K/32 blocks of 34 bytes: d fp16 | 32 int8;  w = d·q
//   int8  a row = K int8, a float32 scale per row;              w = s[n]·q
//   vec_linear's panels (vec_linear.cpp, P = vec_linear_panel() columns, the last
//   panel narrower):   packed[p][k][j] = W[P·p + j, k]
//
// An output's error is measured against the float32 rounding a K-term sum may have:
// |y - exact| / (sum_k |x_k w_k| + |bias|) must stay under 1e-5. dequantize_rows must
// give each weight to one rounding (it may fuse d·q + m): 2^-23 relative, 1e-7 absolute.

#include <cstring>

#include "check.h"

namespace {

enum Format { Q4_1 = 0, Q8_0 = 1, INT8 = 2 };
const char* const FORMAT_NAMES[] = {"q4_1", "q8_0", "int8"};

struct Quantized {
    Format format;
    int N, K;
    std::vector<uint8_t> bytes;   // the rows as stored
    std::vector<float> scales;    // int8 only
    std::vector<double> weight;   // [N, K], dequantized exactly

    Quantized(Random& random, Format format_, int N_, int K_) : format(format_), N(N_), K(K_), weight(size_t(N_) * K_) {
        const int block = format == Q4_1 ? 20 : 34;
        if (format == INT8) bytes.resize(size_t(N) * K), scales.resize(N);
        else bytes.resize(size_t(N) * (K / 32) * block);
        for (auto& b : bytes) b = uint8_t(random.next());
        for (int n = 0; n < N; ++n) {
            if (format == INT8) {
                scales[n] = float(0.01 + 0.04 * random.uniform());
                for (int k = 0; k < K; ++k) weight[size_t(n) * K + k] = double(scales[n]) * int8_t(bytes[size_t(n) * K + k]);
                continue;
            }
            for (int b = 0; b < K / 32; ++b) {
                uint8_t* blk = &bytes[(size_t(n) * (K / 32) + b) * block];
                const uint16_t d = float_to_half(float(0.002 + 0.02 * random.uniform()));
                const uint16_t m = float_to_half(float(-0.1 * random.uniform()));
                std::memcpy(blk, &d, 2);
                if (format == Q4_1) std::memcpy(blk + 2, &m, 2);
                for (int j = 0; j < 32; ++j) {
                    double w;
                    if (format == Q4_1) {
                        const uint8_t byte = blk[4 + j % 16];
                        w = double(half_to_float(d)) * (j < 16 ? byte & 15 : byte >> 4) + half_to_float(m);
                    } else {
                        w = double(half_to_float(d)) * int8_t(blk[2 + j]);
                    }
                    weight[size_t(n) * K + 32 * b + j] = w;
                }
            }
        }
    }
};

// Max over outputs of |y - exact| / (sum |x w| + |bias|), for y computed by a kernel.
double linear_error(const std::vector<float>& x, const std::vector<double>& weight, const float* bias,
                    const std::vector<float>& y, int M, int N, int K) {
    double error = 0;
    for (int m = 0; m < M; ++m)
        for (int n = 0; n < N; ++n) {
            double exact = bias ? bias[n] : 0.0, size = bias ? std::fabs(bias[n]) : 0.0;
            for (int k = 0; k < K; ++k) {
                const double term = double(x[size_t(m) * K + k]) * weight[size_t(n) * K + k];
                exact += term, size += std::fabs(term);
            }
            error = std::fmax(error, std::fabs(y[size_t(m) * N + n] - exact) / size);
        }
    return error;
}

std::vector<float> random_floats(Random& random, size_t n) {
    std::vector<float> out(n);
    for (auto& v : out) v = float(random.normal());
    return out;
}

void check_quantized(Random& random, Format format, int N, int K) {
    const Quantized q(random, format, N, K);
    std::vector<float> dequantized(size_t(N) * K);
    dequantize_rows(format, q.bytes.data(), format == INT8 ? q.scales.data() : nullptr, dequantized.data(), N, K);
    double error = 0;
    for (size_t i = 0; i < dequantized.size(); ++i)
        error = std::fmax(error, std::fabs(dequantized[i] - q.weight[i]) / (0x1p-23 * std::fabs(q.weight[i]) + 1e-7));
    const std::string shape = " N" + std::to_string(N) + " K" + std::to_string(K);
    report(std::string("dequantize_rows ") + FORMAT_NAMES[format] + shape, error, 1.0, "error / limit");
    const auto bias = random_floats(random, N);
    for (int M : {1, 5, 33}) {
        const auto x = random_floats(random, size_t(M) * K);
        std::vector<float> y(size_t(M) * N);
        const float* b = M == 5 ? nullptr : bias.data();   // one case without a bias
        if (format == Q4_1) q4_1_linear(x.data(), q.bytes.data(), b, y.data(), M, N, K);
        if (format == Q8_0) q8_0_linear(x.data(), q.bytes.data(), b, y.data(), M, N, K);
        if (format == INT8) int8_linear(x.data(), q.bytes.data(), q.scales.data(), b, y.data(), M, N, K);
        report(std::string(FORMAT_NAMES[format]) + "_linear M" + std::to_string(M) + shape + (b ? " bias" : ""),
               linear_error(x, q.weight, b, y, M, N, K), 1e-5);
    }
}

#ifdef MICROVLLM_CHECK_VEC_LINEAR
// N = two full panels and one vector's width more: the last panel is narrower.
void check_vec_linear(Random& random) {
    const int panel = vec_linear_panel();
    if (panel == 0) {
        std::printf("skip  vec_linear: vec_linear_panel() is 0 (no vector unit in this build)\n");
        return;
    }
    const int N = 2 * panel + panel / 3, K = 300;
    const auto w = random_floats(random, size_t(N) * K);
    std::vector<float> packed;
    for (int p0 = 0; p0 < N; p0 += panel) {
        const int width = std::min(panel, N - p0);
        for (int k = 0; k < K; ++k)
            for (int j = 0; j < width; ++j) packed.push_back(w[size_t(p0 + j) * K + k]);
    }
    const std::vector<double> weight(w.begin(), w.end());
    const auto bias = random_floats(random, N);
    for (int M : {1, 8, 33}) {
        const auto x = random_floats(random, size_t(M) * K);
        std::vector<float> y(size_t(M) * N);
        const float* b = M == 8 ? nullptr : bias.data();
        vec_linear(x.data(), packed.data(), b, y.data(), M, N, K);
        report("vec_linear M" + std::to_string(M) + " N" + std::to_string(N) + " K" + std::to_string(K) +
               " panel " + std::to_string(panel) + (b ? " bias" : ""), linear_error(x, weight, b, y, M, N, K), 1e-5);
    }
}
#endif

}  // namespace

void check_linear() {
    Random random(539);
    for (Format format : {Q4_1, Q8_0, INT8}) check_quantized(random, format, 100, 256);
    check_quantized(random, INT8, 52, 72);   // K not a multiple of any vector width
#ifdef MICROVLLM_CHECK_VEC_LINEAR
    check_vec_linear(random);
#else
    std::printf("skip  vec_linear: built without MICROVLLM_CHECK_VEC_LINEAR (no csrc/vec_linear.cpp)\n");
#endif
}
