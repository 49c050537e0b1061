// The kernel harness's main, and its checks of the per-token ops: float16 conversions,
// rms_norm, rope, silu_and_mul, argmax_rows (check.h says how the harness works).
//
// Tolerances: float32 results within 1e-5 of the reference (relative, or absolute below
// 0.1, as tests/platforms/test_cpu_ops.py allows); bfloat16 results within one bfloat16
// step (2^-7 relative), since a sum of squares added in another order may round the other
// way; integers and bit patterns exactly.

#include <cstring>
#include <limits>

#include "check.h"
#include "vec.h"   // MICROVLLM_VEC: the vector width this build's kernels use

#ifdef _OPENMP
#include <omp.h>
#endif

namespace {

// dtypes.h's conversions: the float16 bit functions against the compiler's own (the
// CPU's fcvt for __fp16 on arm64; F16C or libgcc for _Float16 on x86), and bfloat16's
// store against the references' rounding: every half, and every 251st float bit pattern
// (all exponents, every rounding case and tie seen many times).
void check_conversions() {
    double mismatches = 0;
    for (uint32_t h = 0; h < 65536; ++h) {
        const uint16_t bits = uint16_t(h);
        Half half;
        std::memcpy(&half, &bits, 2);
        const float want = load_half(half), got = half_to_float(bits);
        mismatches += std::memcmp(&want, &got, 4) != 0;
    }
    report("half_to_float, all 65,536 halves", mismatches, 0, "mismatches");
    mismatches = 0;
    double bfloat16_mismatches = 0;
    for (uint64_t i = 0; i < (1ull << 32); i += 251) {
        const uint32_t bits = uint32_t(i);
        float f;
        std::memcpy(&f, &bits, 4);
        const Half half = store_half(f);
        uint16_t want;
        std::memcpy(&want, &half, 2);
        const uint16_t got = float_to_half(f);
        const bool nan = (bits & 0x7fffffffu) > 0x7f800000u;   // any NaN of the same sign will do
        mismatches += nan ? ((got & 0x7fffu) <= 0x7c00u || (got ^ want) & 0x8000u) : got != want;
        const float bfloat16 = BFloat16::load(BFloat16::store(f));
        bfloat16_mismatches += nan ? !std::isnan(bfloat16) : bfloat16 != rounded<BFloat16>(f);
    }
    report("float_to_half, 17 million floats", mismatches, 0, "mismatches");
    report("BFloat16::store, 17 million floats", bfloat16_mismatches, 0, "mismatches");
}

template <typename D>
void check_rms_norm(Random& random, int rows, int hidden, bool with_residual) {
    using T = typename D::storage;
    const auto x = random_tensor<D>(random, size_t(rows) * hidden, 3.0);
    const auto weight = random_tensor<D>(random, hidden);
    const auto residual_in = random_tensor<D>(random, size_t(rows) * hidden, 4.0);
    auto residual = residual_in;
    std::vector<T> out(x.size());
    const float eps = 1e-5f;
    rms_norm(Code<D>::dtype, x.data(), with_residual ? residual.data() : nullptr, weight.data(), out.data(),
             rows, hidden, eps);
    double error = 0, residual_mismatches = 0;
    for (int r = 0; r < rows; ++r) {
        std::vector<double> s(hidden);
        double sum_sq = 0;
        for (int i = 0; i < hidden; ++i) {
            const size_t at = size_t(r) * hidden + i;
            if (with_residual) {   // residual = T(x + residual): a float32 add, rounded (as torch's)
                const float sum = D::load(x[at]) + D::load(residual_in[at]);
                s[i] = rounded<D>(sum);
                residual_mismatches += D::load(residual[at]) != s[i];
            } else {
                s[i] = D::load(x[at]);
            }
            sum_sq += s[i] * s[i];
        }
        const double inv_rms = 1.0 / std::sqrt(sum_sq / hidden + eps);
        for (int i = 0; i < hidden; ++i) {
            const float normalized = float(rounded<D>(s[i] * inv_rms));
            const double want = rounded<D>(D::load(weight[i]) * normalized);
            error = std::fmax(error, relative(D::load(out[size_t(r) * hidden + i]), want, 0.1));
        }
    }
    const std::string name = std::string("rms_norm ") + Code<D>::name + " " + std::to_string(rows) + "x" +
                             std::to_string(hidden) + (with_residual ? " residual" : "");
    if (with_residual) report(name + ": residual += x", residual_mismatches, 0, "mismatches");
    report(name, error, Code<D>::dtype == 0 ? 1e-5 : 0x1p-7);
}

// Query and key heads of a fused QKV row (9 + 3 heads of 64, rows 15 heads apart).
template <typename D>
void check_rope(Random& random, int tokens) {
    using T = typename D::storage;
    const int heads = 12, head_dim = 64, half = head_dim / 2;
    const int64_t row_stride = 15 * head_dim;
    const auto x = random_tensor<D>(random, size_t(tokens) * row_stride);
    std::vector<T> cos(size_t(tokens) * half), sin(cos.size()), out(size_t(tokens) * heads * head_dim);
    for (size_t i = 0; i < cos.size(); ++i) {
        const double angle = 6.3 * random.uniform();
        cos[i] = D::store(float(std::cos(angle)));
        sin[i] = D::store(float(std::sin(angle)));
    }
    rope(Code<D>::dtype, x.data(), cos.data(), sin.data(), out.data(), tokens, heads, head_dim, row_stride);
    double error = 0;
    for (int t = 0; t < tokens; ++t)
        for (int h = 0; h < heads; ++h)
            for (int i = 0; i < half; ++i) {
                const T* x1 = &x[t * row_stride + h * head_dim];
                const float a = D::load(x1[i]), b = D::load(x1[i + half]);
                const float c = D::load(cos[t * half + i]), s = D::load(sin[t * half + i]);
                const double want1 = rounded<D>(float(rounded<D>(a * c)) - float(rounded<D>(b * s)));
                const double want2 = rounded<D>(float(rounded<D>(b * c)) + float(rounded<D>(a * s)));
                const T* o = &out[(size_t(t) * heads + h) * head_dim];
                error = std::fmax(error, relative(D::load(o[i]), want1, 0.1));
                error = std::fmax(error, relative(D::load(o[i + half]), want2, 0.1));
            }
    report(std::string("rope ") + Code<D>::name + " " + std::to_string(tokens) + " tokens, QKV view", error,
           Code<D>::dtype == 0 ? 1e-5 : 0x1p-7);
}

// out = T(T(silu(gate)) * up) over [rows, 2 d]; the last row's gates are extremes
// (exp(-gate) overflowing or vanishing: silu must be 0 or the gate, never NaN).
template <typename D>
void check_silu_and_mul(Random& random, int rows, int d) {
    using T = typename D::storage;
    auto gate_up = random_tensor<D>(random, size_t(rows) * 2 * d, 4.0);
    const float extremes[] = {-1000.f, -200.f, -88.5f, -20.f, 0.f, 20.f, 200.f, 1000.f};
    for (int i = 0; i < d; ++i) gate_up[size_t(rows - 1) * 2 * d + i] = D::store(extremes[i % 8]);
    std::vector<T> out(size_t(rows) * d);
    silu_and_mul(Code<D>::dtype, gate_up.data(), out.data(), rows, d);
    double error = 0;
    for (int r = 0; r < rows; ++r)
        for (int i = 0; i < d; ++i) {
            const double gate = D::load(gate_up[size_t(r) * 2 * d + i]), up = D::load(gate_up[size_t(r) * 2 * d + d + i]);
            const float silu = float(rounded<D>(gate / (1.0 + std::exp(-gate))));
            error = std::fmax(error, relative(D::load(out[size_t(r) * d + i]), rounded<D>(silu * float(up)), 0.1));
        }
    report(std::string("silu_and_mul ") + Code<D>::name + " " + std::to_string(rows) + "x" + std::to_string(d) +
           ", extreme gates", error, Code<D>::dtype == 0 ? 1e-5 : 0x1p-7);
}

// The first index of each row's maximum, or of its first NaN (torch.argmax's answer).
void check_argmax(Random& random) {
    const int64_t vocab = 1003;   // not a multiple of any vector width: the tail counts
    const int rows = 7;
    std::vector<float> logits(rows * vocab);
    for (auto& v : logits) v = float(random.normal());
    const float nan = std::numeric_limits<float>::quiet_NaN();
    float* row = logits.data();
    row[1 * vocab + 900] = row[1 * vocab + 5] = 10.f;             // a tie: the first wins
    row[2 * vocab + 10] = 10.f, row[2 * vocab + 700] = nan;       // a NaN beats any maximum
    row[3 * vocab + vocab - 1] = 10.f;                            // the very last element
    for (int64_t j = 0; j < vocab; ++j) row[4 * vocab + j] = -1.f;   // all equal: index 0
    row[5 * vocab + 0] = row[5 * vocab + 1] = nan;                // NaNs first
    row[6 * vocab + 17] = -std::numeric_limits<float>::infinity();
    std::vector<int64_t> out(rows, -1);
    argmax_rows(logits.data(), out.data(), rows, vocab);
    double mismatches = 0;
    for (int r = 0; r < rows; ++r) {
        int64_t want = 0;
        for (int64_t j = 0; j < vocab; ++j) {
            const float v = row[r * vocab + j];
            if (std::isnan(v)) { want = j; break; }
            if (v > row[r * vocab + want]) want = j;
        }
        if (out[r] != want) {
            std::printf("      row %d: argmax_rows says %lld, the first maximum is at %lld\n", r, (long long)out[r],
                        (long long)want);
            ++mismatches;
        }
    }
    report("argmax_rows 7x1003: ties, NaNs, -inf", mismatches, 0, "mismatches");
}

}  // namespace

int main() {
    int threads = 1;
#ifdef _OPENMP
    threads = omp_get_max_threads();
#endif
    std::printf("build: MICROVLLM_VEC %d, float16 as %s, %d threads\n", MICROVLLM_VEC, MICROVLLM_FLOAT16, threads);
    Random random(20240539);
    check_conversions();
    for (bool with_residual : {false, true}) {
        check_rms_norm<Float32>(random, 7, 576, with_residual);
        check_rms_norm<BFloat16>(random, 7, 576, with_residual);
        check_rms_norm<Float32>(random, 3, 1000, with_residual);
        check_rms_norm<BFloat16>(random, 3, 1000, with_residual);
    }
    for (int tokens : {1, 5, 70}) {
        check_rope<Float32>(random, tokens);
        check_rope<BFloat16>(random, tokens);
    }
    check_silu_and_mul<Float32>(random, 7, 80);
    check_silu_and_mul<BFloat16>(random, 7, 80);
    check_silu_and_mul<Float32>(random, 2, 3072);
    check_silu_and_mul<BFloat16>(random, 2, 3072);
    check_argmax(random);
    check_attention();
    check_linear();
    std::printf("%d checks, %d failed\n", checks, failures);
    return failures ? 1 : 0;
}
